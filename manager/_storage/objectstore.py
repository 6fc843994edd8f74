"""Checkpoint directories in key-value stores: ``s3://bucket/prefix``, ``gs://bucket/prefix``, and
``memory://name`` (TensorStore's in-memory kvstore, shared within the process, for tests).

Everything goes through TensorStore's kvstore API: it speaks S3 and GCS with the standard
credentials, and it offers the one primitive the commit needs, a conditional write
(``If-None-Match`` / ``If-Match``), so two writers racing to commit one step cannot both win.
Object stores have no rename, so the protocol of DESIGN.md applies: a step's data objects
first, then its manifest, written last; a prefix without a manifest does not exist for any
reader. The manifest's key is claimed first (a claim object, created only if absent) and the
manifest replaces exactly that claim (If-Match), so a writer whose claim was removed meanwhile,
say by a writer that took its expired lease over, commits nothing. Deletion removes the manifest
first, then the data.

Handlers write their files straight to the store (`_KvDestination`: one PUT per file, from the
snapshot's memory, as many in flight as the handler's writer threads) and restores read only the
files (byte ranges) a handler asks for (`_KvSource`); nothing is staged on local disk, except the
files of a handler that writes through a path (`Destination.local_directory`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cairn.handlers import Destination, FileRecord, Source
from cairn.handlers.errors import (
    CorruptCheckpointError,
    DirectoryLockedError,
    StepAlreadyExistsError,
)
from cairn.handlers.io import KnownFiles, RangeHashes, Ranges, check_relative, optional
from cairn.manager._format import (
    LOCK,
    MANIFEST,
    METRICS,
    SYNC_PREFIX,
    Manifest,
    StepNames,
    check_sync_name,
    namings,
    unix_time,
)
from cairn.manager._storage import servercopy as _servercopy
from cairn.manager._storage.base import Listed, Reclaim
from cairn.manager._storage.orphans import WRITER_WAIT_S, pid_alive, runs_writer, wait_for_orphan

log = logging.getLogger("cairn")

LEASE = LOCK
LEASE_SECONDS = 3600.0  # read when a lease is taken (the tests shorten it)
CLAIM = ".claim"  # delete_step's mark, before the manifest goes; older writers' claim too
_DELETING = b"deleting"  # what delete_step's claim holds
_CLAIM_TAG = b'{"cairn_claim": '  # how a claim at a manifest's key begins; a manifest never does


@dataclasses.dataclass(frozen=True)
class StorageOptions:
    """Where and how to reach the object store; unset fields come from the standard AWS
    environment variables (AWS_ENDPOINT_URL, AWS_DEFAULT_REGION / AWS_REGION; credentials from
    AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, else TensorStore's default AWS credential chain)."""

    endpoint: str | None = None
    region: str | None = None

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | None) -> StorageOptions:
        if options is None:
            return cls()
        if not isinstance(options, Mapping):
            raise TypeError(f"storage_options must be a mapping, got {options!r}")
        unknown = sorted(set(options) - {"endpoint", "region"})
        if unknown:
            raise ValueError(f"storage_options: unknown keys {unknown} (known: endpoint, region)")
        for key, value in options.items():
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"storage_options[{key!r}] must be a non-empty str, got {value!r}")
        return cls(**dict(options))


_MEMORY: list[Any] = []
_MEMORY_LOCK = threading.Lock()


def _memory_context(ts: Any) -> Any:
    """The TensorStore context whose in-memory kvstore every ``memory://`` directory shares."""
    with _MEMORY_LOCK:
        if not _MEMORY:
            _MEMORY.append(ts.Context())
        return _MEMORY[0]


WATCH_S = 5.0  # an open's first request unanswered this long: a warning says what cairn waits for
OPEN_TIMEOUT_S = 120.0  # ... and this long: ConnectionError (see `ObjectStore._result`)


def _refusal(store: ObjectStore, error: ValueError, *, writing: bool = False) -> Exception:
    """The service's refusal of an open's first request (or of a write: there NOT_FOUND can
    only be the bucket), in one line that says what to do: a missing bucket, refused
    credentials; else TensorStore's message without the XML or JSON body."""
    text = str(error)
    where = f" at {store._endpoint}" if store._endpoint else ""
    missing = "NOT_FOUND" in text and (writing or "bucket" in text.lower())
    if "NoSuchBucket" in text or missing:
        return ValueError(
            f"{store.url}: the bucket {store._bucket!r} does not exist{where}; create it, or "
            "check the URL and the endpoint"
        )
    refused = ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "PERMISSION_DENIED")
    if any(code in text for code in (*refused, "UNAUTHENTICATED")):
        code = next(c for c in (*refused, "UNAUTHENTICATED") if c in text)
        return PermissionError(
            f"{store.url}: the service{where} refused the request ({code}); check the "
            "credentials and their access to the bucket"
        )
    short = _BODY.sub("", text)[:500]  # the service's XML or JSON body says it again
    return ValueError(f"{store.url}: {short}")


_BODY = re.compile(r" \[http_response_body=.*", re.DOTALL)


def _dot_segments(key: str) -> bool:
    return any(part in (".", "..") for part in key.split("/"))


def _successor(prefix: str) -> str:
    """The smallest key greater than every key that starts with `prefix` (ASCII keys)."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


class ObjectStore:
    """A prefix in an object store, with the few operations a checkpoint directory needs.

    Keys are relative to the prefix ("checkpoint_5/_CHECKPOINT.json"). Threads: TensorStore's
    kvstore is thread-safe; the manager calls this from its caller and commit threads.
    """

    def __init__(self, url: str, options: StorageOptions) -> None:
        scheme, _, rest = url.partition("://")
        ts = optional("tensorstore", feature=f"an object-store directory ({scheme}://)")
        bucket, _, path = rest.partition("/")
        path = path.strip("/")
        self.url = f"{scheme}://{bucket}/{path}" if path else f"{scheme}://{bucket}"
        spec: dict[str, Any] = {"path": f"{path}/" if path else ""}
        context = None
        if scheme == "s3":
            spec.update(driver="s3", bucket=bucket)
            endpoint = options.endpoint or os.environ.get("AWS_ENDPOINT_URL")
            if endpoint:
                spec["endpoint"] = endpoint
            spec["aws_region"] = (
                options.region
                or os.environ.get("AWS_DEFAULT_REGION")
                or os.environ.get("AWS_REGION")
                or "us-east-1"
            )
            if os.environ.get("AWS_ACCESS_KEY_ID"):
                spec["aws_credentials"] = {"type": "environment"}
        elif scheme == "gs":
            if options.region is not None or options.endpoint is not None:
                raise ValueError(
                    f"storage_options {dataclasses.asdict(options)!r}: for gs:// the endpoint "
                    "comes from TENSORSTORE_GCS_HTTP_URL and there is no region"
                )
            spec.update(driver="gcs", bucket=bucket)
        elif scheme == "memory":  # one store per name, shared by every manager of the process
            spec["driver"] = "memory"
            spec["path"] = f"{bucket}/{spec['path']}"
            context = _memory_context(ts)
        else:
            raise ValueError(f"directory {url!r}: unknown scheme {scheme!r}")
        self._ts = ts
        self._spec = spec
        self._kv = ts.KvStore.open(spec, context=context).result()
        self._scheme, self._bucket = scheme, bucket
        # which service's bucket: two endpoints may serve buckets of one name
        endpoint = spec.get("endpoint") or (
            os.environ.get("TENSORSTORE_GCS_HTTP_URL") if scheme == "gs" else None
        )
        self.where = f"{self.url} at {endpoint}" if endpoint else self.url
        self._copier: _servercopy.Copier | None = None
        self._copies = True  # until a copy fails for a reason other than the source's change
        self._copier_lock = threading.Lock()
        self._answered = scheme == "memory"  # until the service first answers (`_result`)
        self._endpoint = endpoint

    def _result(self, future: Any) -> Any:
        """``future.result()``. Until the service has answered once (the open's first reads
        and listings), the wait is watched and bounded: after `WATCH_S` seconds a warning says
        what cairn waits for, after `OPEN_TIMEOUT_S` ConnectionError says what to check (an
        unreachable endpoint, or no credentials, makes TensorStore retry for many minutes,
        silently); a missing bucket or refused credentials is one line that says so, not the
        service's XML."""
        if self._answered:
            return future.result()
        try:
            try:
                result = future.result(timeout=WATCH_S)
            except TimeoutError:
                log.warning(
                    "cairn: %s has not answered for %g s; waiting up to %g s in all (%s)",
                    self.where,
                    WATCH_S,
                    OPEN_TIMEOUT_S,
                    self._check_hint(),
                )
                result = future.result(timeout=OPEN_TIMEOUT_S - WATCH_S)
        except TimeoutError:
            future.cancel()
            raise ConnectionError(
                f"{self.where} did not answer within {OPEN_TIMEOUT_S:g} s: check "
                f"{self._check_hint()}"
            ) from None
        except ValueError as e:
            raise _refusal(self, e) from None
        self._answered = True
        return result

    def check_bucket(self) -> None:
        """One listing, watched and bounded as an open's first request (`_result`): raises
        what is wrong with the bucket (missing, refused, unreachable), if anything. A write
        that says only "not done" (a conditional write: TensorStore reports a missing bucket
        so) is told apart from a lost race with it."""
        self._answered = self._scheme == "memory"
        self.list_range(LEASE, _successor(LEASE))

    def _check_hint(self) -> str:
        """What to check when the service does not answer."""
        if self._scheme == "s3":
            endpoint = (
                f"the endpoint {self._endpoint} (AWS_ENDPOINT_URL or storage_options['endpoint'])"
                if self._endpoint
                else "the network to AWS"
            )
            return (
                f"{endpoint}, and the credentials: AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, a profile, or the instance's role"
            )
        endpoint = (
            f"the endpoint {self._endpoint} (TENSORSTORE_GCS_HTTP_URL)"
            if self._endpoint
            else "the network to Google Cloud Storage"
        )
        return f"{endpoint}, and the application default credentials"

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r})"

    def list_keys(self, prefix: str = "") -> list[str]:
        """Every key under `prefix`, sorted."""
        if prefix:
            return self.list_range(prefix, _successor(prefix))
        return sorted(k.decode() for k in self._result(self._kv.list()))

    def read(self, key: str) -> bytes | None:
        """The object's bytes, or None if it does not exist."""
        result = self._result(self._kv.read(key))
        if result.state != "value":
            return None
        return bytes(result.value)

    def read_many(self, keys: Sequence[str], *, in_flight: int = 64) -> list[bytes | None]:
        """`read` of many keys, `in_flight` requests at a time (a scan of thousands of steps)."""
        out: list[bytes | None] = []
        for start in range(0, len(keys), in_flight):
            futures = [self._kv.read(key) for key in keys[start : start + in_flight]]
            for future in futures:
                result = self._result(future)
                out.append(bytes(result.value) if result.state == "value" else None)
        return out

    def read_with_generation(self, key: str) -> tuple[bytes | None, Any]:
        result = self._result(self._kv.read(key))
        return (bytes(result.value) if result.state == "value" else None), result.stamp.generation

    def write(self, key: str, data: bytes, *, if_generation: Any = None) -> Any:
        """Write an object and return its new generation; with `if_generation`, only if the
        object is still at that generation (sent as If-Match, atomic on the server; the
        generation of a missing key means "only if absent", If-None-Match). None if it was not."""
        try:
            stamp = self._result(self._kv.write(key, data, if_equal=if_generation))
        except ValueError as e:
            if "NOT_FOUND" not in str(e):
                raise
            raise _refusal(self, e, writing=True) from None
        return stamp.generation or None

    def create(self, key: str, data: bytes) -> Any:
        """Create the object only if it does not exist; its generation, or None if it did."""
        return self.write(key, data, if_generation=self._no_value)

    @functools.cached_property
    def _no_value(self) -> Any:
        """The generation TensorStore gives a missing key; as a write condition it means "only if
        absent". The same for every key: read once from a key that never exists."""
        return self._kv.read(".cairn-no-such-key").result().stamp.generation

    def copy(self, source: str, target: str, generation: Any) -> Any:
        """A server-side copy of the object `source` to `target`, only if `source` is still at
        `generation` (as `write` or `read_with_generation` gave it); the target's generation,
        or None where it was not made (the source changed, or the store cannot copy: then the
        caller uploads the bytes). See `_servercopy`."""
        copier = self._get_copier()
        if copier is None:
            return None
        try:
            return copier.copy(source, target, generation)
        except Exception as e:  # a denied permission, a network error: upload instead
            with self._copier_lock:
                if self._copies:
                    log.warning(
                        "cairn: %s: a server-side copy failed (%s: %s); incremental saves to it "
                        "upload every file from now on",
                        self.url,
                        type(e).__name__,
                        e,
                    )
                self._copies = False
            return None

    def copy_unavailable(self) -> bool:
        """Whether `copy` is known to make nothing here (no library, denied before)."""
        return self._get_copier() is None

    def _get_copier(self) -> _servercopy.Copier | None:
        with self._copier_lock:
            if self._copier is None and self._copies:
                try:
                    self._copier = self._make_copier()
                except Exception as e:  # a missing library (MissingDependencyError), credentials
                    log.warning(
                        "cairn: %s: incremental saves cannot copy files on the server here (%s); "
                        "they upload every file",
                        self.url,
                        e,
                    )
                    self._copies = False
            return self._copier if self._copies else None

    def _make_copier(self) -> _servercopy.Copier:
        prefix = self._spec["path"]
        if self._scheme == "s3":
            return _servercopy.S3Copier(
                self._bucket, prefix, self._spec.get("endpoint"), self._spec["aws_region"]
            )
        if self._scheme == "gs":
            return _servercopy.GcsCopier(self._bucket, prefix)
        return _servercopy.MemoryCopier(self._kv)

    def delete(self, key: str, *, if_generation: Any = None) -> None:
        """Delete an object; with `if_generation`, only if it is still at that generation
        (TensorStore checks that with a HEAD request first: not atomic)."""
        self._kv.write(key, None, if_equal=if_generation).result()

    def delete_prefix(self, prefix: str) -> None:
        self.delete_range(prefix, _successor(prefix))

    def delete_range(self, start: str, stop: str) -> None:
        """Delete every key k with start <= k < stop, except keys with a `.` or `..` segment:
        one LIST, then one DELETE per key, all in flight at once (TensorStore's own
        delete_range would list the range a second time).

        An HTTP client collapses dot segments of a request path before it sends it (TensorStore's
        S3 driver does, against moto at least), so deleting the literal key ``a/../../x`` would
        delete ``x`` beside the directory. Such keys are never cairn's (every name cairn writes
        passes `check_relative`): they are left alone, with a warning."""
        keys = self.list_range(start, stop)
        odd = [k for k in keys if _dot_segments(k)]
        if odd:
            log.warning(
                "cairn: %s: not deleting %d keys with '.' or '..' segments (not cairn's; a "
                "request for them would reach outside the directory): %s",
                self.url,
                len(odd),
                odd[:5],
            )
        self.delete_keys([k for k in keys if not _dot_segments(k)])

    def delete_keys(self, keys: Sequence[str]) -> None:
        """Delete these keys, one DELETE each, all in flight at once."""
        futures = [self._kv.write(k, None) for k in keys]
        for future in futures:
            future.result()

    def list_range(self, start: str, stop: str) -> list[str]:
        """Every key k with start <= k < stop, sorted."""
        found = self._result(self._kv.list(self._ts.KvStore.KeyRange(start, stop)))
        return sorted(k.decode() for k in found)

    def read_prefix(self, key: str, size: int, offset: int = 0) -> bytes | None:
        """The `size` bytes of an object from `offset` (the first ones by default; one ranged
        GET), or None if it does not exist; ValueError if it is shorter."""
        result = self._kv.read(key, byte_range=slice(offset, offset + size)).result()
        if result.state != "value":
            return None
        return bytes(result.value)


_LEASE_BYTES = 4096  # the most a lease object may hold (cairn's are under 200 bytes)
_CLOCK_SLACK_S = 60.0  # clocks of two hosts may differ this much before a message says so


@dataclasses.dataclass(frozen=True)
class _Held:
    """What a lease object says: until when, whose (``host:pid:id``), and the pid of that
    trainer's writer process (``writer="process"``), which commits under the same lease.

    A lease that is not one cairn writes is *damaged* (`damaged` says why): not JSON of at most
    `_LEASE_BYTES`, an `expires` that is not a number of seconds from 1970 to 9999 (NaN,
    Infinity, 1e300, a bool, a string), an `owner` that is not a short printable string, a
    `writer` that is not a pid. No live cairn writer leaves such an object, so it counts as
    expired (a writer takes it over, with a warning)."""

    expires: float
    owner: str
    writer: int | None = None
    damaged: str | None = None

    @classmethod
    def parse(cls, data: bytes) -> _Held:
        def damaged(why: str) -> _Held:
            return cls(0.0, "unknown", damaged=why)

        if len(data) > _LEASE_BYTES:
            return damaged(f"it holds {len(data)} bytes")
        try:
            held = json.loads(data)
        except (ValueError, RecursionError) as e:  # not JSON, nested too deep, too many digits
            return damaged(f"it does not parse ({type(e).__name__})")
        if not isinstance(held, dict):
            return damaged("it is not a JSON object")
        owner, writer = held.get("owner"), held.get("writer")
        try:
            expires = unix_time(held.get("expires"), "expires")
        except (TypeError, ValueError) as e:
            return damaged(str(e))
        if not (isinstance(owner, str) and 0 < len(owner) <= 255 and owner.isprintable()):
            return damaged("its owner is not a printable name of at most 255 characters")
        if writer is not None and not (type(writer) is int and 0 < writer < 1 << 31):
            return damaged("its writer is not a pid")
        return cls(expires, owner, writer)

    def _trainer_here(self) -> int | None:
        """The owner's pid, if it ran on this host."""
        host, _, rest = self.owner.partition(":")
        pid = rest.partition(":")[0]
        here = host == socket.gethostname() and pid.isascii() and pid.isdigit()
        return int(pid) if here else None

    def orphaned_writer(self) -> tuple[int, int] | None:
        """(trainer, writer) when the owner ran here with a writer process, and has ended."""
        trainer = self._trainer_here()
        if trainer is None or self.writer is None or pid_alive(trainer) is not False:
            return None
        return trainer, self.writer

    def gone(self) -> bool:
        """Whether the owner ran on this host and no longer runs, nor its writer (a crash)."""
        trainer = self._trainer_here()
        return (
            trainer is not None
            and pid_alive(trainer) is False
            and (
                self.writer is None
                or pid_alive(self.writer) is False
                or not runs_writer(self.writer)  # a pid reused, or any pid a crafted lease names
            )
        )


class Lease:
    """One writer per object-store directory: a lease object ``.cairn.lock`` created only if
    absent (or expired), checked before and after each upload, refreshed at each commit,
    deleted at close.

    A writer that crashed leaves its lease; another writer may take it over once it expired
    (`LEASE_SECONDS` after the last refresh, one hour), or at once when the owner was a process on
    the same host that no longer runs. A writer whose lease was taken over (or deleted) has lost
    it for good: every later check raises DirectoryLockedError, so it commits nothing more.

    A lease is its owner's while the object names that owner. With ``writer="process"`` two
    processes share it (`for_writer`, `shared`): the writer process refreshes it at each of
    its commits, the trainer checks it in its retention, so each takes the other's newer
    generation for its own when the owner is unchanged. The object names the writer's pid
    (`set_writer`): a trainer started on this host after the owner ended waits for that writer
    to finish (`wait_for_orphan`) before it takes the lease over; an orphaned writer deletes the
    lease when it has committed what it was handed.
    """

    def __init__(self, store: ObjectStore) -> None:
        self._store, self._seconds = store, LEASE_SECONDS
        self._owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._writer: int | None = None
        self._lost: str | None = None
        data, self._generation = store.read_with_generation(LEASE)
        if data is not None:
            held = _Held.parse(data)
            if held.damaged is not None:
                log.warning(
                    "cairn: %s/%s is no lease cairn wrote (%s); taking it over as an expired one",
                    store.url,
                    LEASE,
                    held.damaged,
                )
            orphan = held.orphaned_writer() if held.expires > time.time() else None
            if orphan is not None and wait_for_orphan(*orphan, WRITER_WAIT_S):
                data, self._generation = store.read_with_generation(LEASE)  # it may have gone
                held = _Held.parse(data) if data is not None else _Held(0.0, "nobody")
            now = time.time()
            if held.expires > now and not held.gone():
                also = f", with its writer process pid {held.writer}" if held.writer else ""
                ahead = (
                    f" (more than the lease's {self._seconds:g} s ahead of this host's clock: the "
                    "owner's clock runs ahead of this one, or the lease was written by hand; if "
                    f"its owner is gone, delete {LEASE})"
                    if held.expires - now > self._seconds + _CLOCK_SLACK_S
                    else ""
                )
                raise DirectoryLockedError(
                    f"{store.url} is held by another writable CheckpointManager ({held.owner}"
                    f"{also}) until "
                    f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(held.expires))}{ahead}; "
                    "open it with read_only=True to read alongside"
                )
        if not self._write():
            store.check_bucket()  # a write refused: the bucket may be missing, not the race lost
            raise DirectoryLockedError(f"{store.url}: another writer took the lease first")

    @classmethod
    def shared(cls, store: ObjectStore, state: Mapping[str, Any]) -> Lease:
        """The lease a trainer holds (`for_writer`), as its writer process holds it too."""
        lease = cls.__new__(cls)
        lease._store, lease._seconds = store, float(state["seconds"])
        lease._owner, lease._writer = str(state["owner"]), os.getpid()
        lease._lost, lease._generation = None, state["generation"]
        return lease

    def for_writer(self) -> dict[str, Any]:
        """What `shared` needs (picklable)."""
        return {"owner": self._owner, "generation": self._generation, "seconds": self._seconds}

    def set_writer(self, pid: int) -> None:
        """Name writer process `pid` in the lease (before it is sent a save)."""
        self._writer = pid
        self.refresh()

    def _write(self) -> bool:
        body = {"owner": self._owner, "expires": time.time() + self._seconds}
        if self._writer is not None:
            body["writer"] = self._writer
        generation = self._store.write(
            LEASE, json.dumps(body).encode(), if_generation=self._generation
        )
        if generation is None:
            return False
        self._generation = generation
        return True

    def _still_ours(self) -> bool:
        """Whether the lease object (one read) is still this manager's: at the generation it
        last wrote, or at another that still names this owner (the other process of a shared
        lease wrote it), whose generation is ours from then on. Else the lease is lost."""
        data, generation = self._store.read_with_generation(LEASE)
        if generation == self._generation:
            return True
        if data is not None and _Held.parse(data).owner == self._owner:
            self._generation = generation
            return True
        self._lose(data)
        return False

    def check(self) -> None:
        """DirectoryLockedError if the lease is no longer this manager's (one read)."""
        if self._lost is None and self._still_ours():
            return
        raise DirectoryLockedError(self._lost)

    def refresh(self) -> None:
        """Extend the lease by `LEASE_SECONDS`; DirectoryLockedError if it was lost."""
        for _ in range(3):  # the other holder of a shared lease may write it meanwhile
            if self._lost is None and self._write():
                return
            if self._lost is not None or not self._still_ours():
                break
        raise DirectoryLockedError(
            self._lost or f"{self._store.url}: the lease {LEASE} changed at each of 3 refreshes"
        )

    def _lose(self, data: bytes | None) -> None:
        how = "deleted" if data is None else f"taken over by {_Held.parse(data).owner}"
        self._lost = (
            f"{self._store.url}: this manager's lease {LEASE} was {how} (a lease not refreshed "
            f"by a commit for {self._seconds:g} s expires and another writer may take it); it "
            "commits nothing more: close it, and open a new writable CheckpointManager once the "
            "other writer has closed"
        )

    def release(self) -> None:
        """Delete the lease, unless it is no longer this manager's."""
        if self._lost is None and self._still_ours():
            self._store.delete(LEASE, if_generation=self._generation)


def _claim(purpose: str) -> bytes:
    """A claim on a step's manifest key: unique, so its generation (ETag) is ours alone."""
    return json.dumps({"cairn_claim": purpose, "id": uuid.uuid4().hex}).encode()


def read_manifest(store: ObjectStore, name: str) -> bytes | None:
    """The manifest of step `name`, or None when it has none: absent, or a claim (a save or a
    removal in progress). Every read of a manifest from a store goes through here."""
    data = store.read(f"{name}/{MANIFEST}")
    return None if data is None or data.startswith(_CLAIM_TAG) else data


def _take_and_remove(store: ObjectStore, name: str, generation: Any) -> bool:
    """Remove the uncommitted prefix `name` whose manifest key is at `generation` (a claim, or
    absent): first replace that claim with our own (If-Match, atomic, so a writer about to
    commit with it commits nothing, and a prefix changed meanwhile is left alone), then every
    other object, then our claim, so that a crash part-way leaves a claimed prefix, which the
    next writer removes. False if the prefix had changed."""
    key = f"{name}/{MANIFEST}"
    ours = store.write(key, _claim("removing"), if_generation=generation)
    if ours is None:
        return False
    store.delete_range(f"{name}/", key)
    store.delete_range(key + "\0", _successor(f"{name}/"))
    store.delete(key, if_generation=ours)
    return True


class KvStorage:
    """A checkpoint directory in a key-value store (see the module docstring).

    Keys are relative to the directory's prefix ("checkpoint_5/_CHECKPOINT.json"). Threads:
    TensorStore's kvstore is thread-safe; the manager calls this from its caller and commit
    threads.

    Several processes of one job (docs/multihost.md) share one writer: the primary holds the
    lease, claims each step and commits it; every other process only PUTs its own files into
    the claimed prefix (`prepare(..., create=False)` sends no request) and reads.
    """

    shares_deletion = True  # retire_step, remove_files, finish_deletion

    def __init__(self, url: str, options: StorageOptions) -> None:
        self.store = ObjectStore(url, options)
        self.options = options
        self.url = self.directory = self.identity = self.store.url
        # memory:// is one process's memory: other processes cannot see it.
        self.multi_process = not url.startswith("memory://")
        self.lease: Lease | None = None
        self._local: Path | None = None  # staging of path-writing handlers, downloads
        self._local_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"KvStorage({self.url!r})"

    def location(self, name: str) -> str:
        return f"{self.url}/{name}"

    def acquire(self) -> None:
        self.lease = Lease(self.store)

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()

    def check_writer(self) -> None:
        if self.lease is not None:
            self.lease.check()

    def for_writer_process(self) -> tuple[dict[str, Any], list[int]] | None:
        """How a writer process opens this directory and shares the lease (`Lease.shared`);
        None for ``memory://``, which is this process's memory."""
        if not self.multi_process:
            return None
        spec = {
            "directory": self.url,
            "storage_options": dataclasses.asdict(self.options),
            "lease": None if self.lease is None else self.lease.for_writer(),
        }
        return spec, []

    def join_writer_process(self, spec: Mapping[str, Any]) -> None:
        """In the writer process: hold the trainer's lease with it (the primary's)."""
        if spec["lease"] is not None:
            self.lease = Lease.shared(self.store, spec["lease"])

    def writer_started(self, pid: int) -> None:
        """Name writer process `pid` in the lease, so that a trainer started on this host after
        this one ended waits for it, and its commits count as this trainer's."""
        if self.lease is not None:  # else not the primary of a multi-process run
            self.lease.set_writer(pid)

    def local_dir(self) -> Path:
        """A local scratch directory, made on first use and removed by `close`."""
        with self._local_lock:
            if self._local is None:
                self._local = Path(tempfile.mkdtemp(prefix="cairn-local-"))
                weakref.finalize(self, shutil.rmtree, self._local, True)
            return self._local

    def close(self) -> None:
        with self._local_lock:
            if self._local is not None:
                shutil.rmtree(self._local, ignore_errors=True)
                self._local = None

    # ------------------------------------------------------------------ listing and reading

    lists_cheaply = False

    def other_naming(self, names: StepNames) -> tuple[StepNames, str] | None:
        """cairn's steps under another naming (one LIST); Orbax steps are not looked for:
        cairn reads them in place on local filesystems only."""
        heads: dict[str, set[str]] = {}
        for key in self.store.list_keys():
            head, sep, rest = key.partition("/")
            if sep:
                heads.setdefault(head, set()).add(rest)
        if any(names.parse(head) is not None for head in heads):
            return None
        for naming, steps in namings(heads):
            if any(MANIFEST in heads[name] for _, name in steps[:3]):
                return naming, "cairn"
        return None

    def scan(self, names: StepNames) -> list[Listed]:
        """Committed steps: prefixes with a manifest (one LIST of the directory, then one GET
        per step's manifest and metrics)."""
        return [listed for listed, _, _ in self._scan(names) if listed is not None]

    def _scan(
        self, names: StepNames, keys: list[str] | None = None
    ) -> list[tuple[Listed | None, str, bool]]:
        """(the step, or None for a prefix a cairn writer claimed and never committed, its
        name, whether it holds a `.claim`) for every step prefix (of `keys`, the directory's
        listing, if given)."""
        by_step: dict[int, set[str]] = {}
        for key in self.store.list_keys() if keys is None else keys:
            head, sep, rest = key.partition("/")
            step = names.parse(head)
            if step is not None and sep:
                by_step.setdefault(step, set()).add(rest)
        steps = sorted(by_step)
        stepnames = [names.format(step) for step in steps]
        manifests = self.store.read_many(
            [
                f"{name}/{MANIFEST}"
                for step, name in zip(steps, stepnames, strict=True)
                if MANIFEST in by_step[step]
            ]
        )
        with_metrics = [n for s, n in zip(steps, stepnames, strict=True) if METRICS in by_step[s]]
        metrics = dict(
            zip(
                with_metrics,
                self.store.read_many([f"{n}/{METRICS}" for n in with_metrics]),
                strict=True,
            )
        )
        found: list[tuple[Listed | None, str, bool]] = []
        read = iter(manifests)
        for step, name in zip(steps, stepnames, strict=True):
            rests = by_step[step]
            data = next(read) if MANIFEST in rests else None
            if data is None or data.startswith(_CLAIM_TAG):
                # Only a prefix cairn claimed is a leftover of cairn's: anything else there (say,
                # an Orbax step) is not ours to delete, and not a step we can read.
                if MANIFEST in rests or CLAIM in rests:
                    found.append((None, name, CLAIM in rests))
                continue
            listed = Listed(step, self.location(name), data, metrics=metrics.get(name))
            found.append((listed, name, CLAIM in rests))
        return found

    def read_step(self, names: StepNames, step: int) -> Listed | None:
        name = names.format(step)
        manifest = read_manifest(self.store, name)
        if manifest is None:
            return None
        metrics = self.store.read(f"{name}/{METRICS}")
        return Listed(step, self.location(name), manifest, metrics=metrics)

    def source(self, name: str, item: str) -> Source:
        return _KvSource(self, f"{name}/{item}/")

    # ------------------------------------------------------------------ writing

    def clean_leftovers(self, names: StepNames) -> list[str]:
        """Prefixes that a cairn writer claimed and never committed (it died, or lost its
        lease), and steps whose deletion a crash interrupted before their manifest went; a
        step committed meanwhile stays."""
        keys = self.store.list_keys()
        removed = [key for key in keys if key.startswith(SYNC_PREFIX)]
        self.store.delete_keys(removed)  # meetings of writer processes that crashed
        for listed, name, claimed in self._scan(names, keys):
            if listed is not None:
                if claimed and self.store.read(f"{name}/{CLAIM}") == _DELETING:
                    log.info("cairn: finishing the deletion of %s/%s", self.url, name)
                    self.store.delete(f"{name}/{MANIFEST}")
                    self.finish_deletion(name)
                    removed.append(name)
                continue
            data, generation = self.store.read_with_generation(f"{name}/{MANIFEST}")
            if (data is None or data.startswith(_CLAIM_TAG)) and _take_and_remove(
                self.store, name, generation
            ):
                removed.append(name)
        return removed

    def prepare(
        self, name: str, tmp_name: str, items: Iterable[str], *, create: bool
    ) -> _KvPrepared:
        """Claim the step (`create`, on the primary): a claim object created at the manifest's
        key only if absent, so a second writer racing for the same step stops before it uploads
        anything. The other processes of the job write into the prefix their primary claimed,
        and send nothing here."""
        del tmp_name, items  # no temporary name: the prefix is invisible until the manifest
        if not create:
            return _KvPrepared(self, name, None)
        claim = self.store.create(f"{name}/{MANIFEST}", _claim("saving"))
        if claim is None:
            raise StepAlreadyExistsError(
                f"{self.url}/{name} is committed or being committed by another writer"
            )
        return _KvPrepared(self, name, claim)

    def delete_step(self, name: str) -> Reclaim | None:
        """A claim first (so that a crash part-way leaves a prefix the next writer knows as
        cairn's and removes), then the manifest (from then on it is no step), then every other
        object, the claim last. A crash after the claim and before the manifest's deletion
        leaves a committed step holding a deletion claim: the next writer finishes the job."""
        self.retire_step(name)
        self.finish_deletion(name)
        return None

    def retire_step(self, name: str) -> None:
        """The first half of `delete_step`: the claim, then the manifest (from then on it is no
        step; the claimed prefix is a leftover the next writer removes, should we die)."""
        self.check_writer()
        self.store.write(f"{name}/{CLAIM}", _DELETING)
        self.store.delete(f"{name}/{MANIFEST}")

    def remove_files(self, name: str, relpaths: Sequence[str]) -> None:
        """Delete these objects of a retired step, all in flight at once, without listing (the
        processes of a job share a step's deletion out this way)."""
        for relpath in relpaths:
            check_relative(relpath)
        self.store.delete_keys([f"{name}/{relpath}" for relpath in relpaths])

    def finish_deletion(self, name: str) -> None:
        """The second half: every object left under the retired step's prefix, the claim last."""
        claim = f"{name}/{CLAIM}"
        self.store.delete_range(f"{name}/", claim)
        self.store.delete_range(claim + "\0", _successor(f"{name}/"))
        self.store.delete(claim)

    def drop_item(self, name: str, manifest: Manifest, item: str) -> Reclaim | None:
        """The manifest that marks the item dropped replaces the old one (one object, replaced
        atomically), then the item's objects are deleted."""
        self.check_writer()
        self.store.write(f"{name}/{MANIFEST}", manifest.to_bytes())
        self.store.delete_prefix(f"{name}/{item}/")
        return None

    def remove_dropped(self, steps: Mapping[str, Manifest]) -> None:
        keys = self.store.list_keys() if steps else []
        for name, manifest in steps.items():
            for item, entry in manifest.items.items():
                prefix = f"{name}/{item}/"
                if entry.dropped and any(k.startswith(prefix) for k in keys):
                    self.store.delete_prefix(prefix)

    def write_metrics(self, name: str, body: bytes) -> None:
        self.check_writer()
        self.store.write(f"{name}/{METRICS}", body)

    def create_root_file(self, name: str, body: bytes) -> bool:
        self.check_writer()
        return self.store.create(name, body) is not None

    def read_root_file(self, name: str) -> bytes | None:
        return self.store.read(name)

    def remove_sync_files(self, names: Sequence[str]) -> None:
        for name in names:
            check_sync_name(name)
        self.store.delete_keys(list(names))


class _KvPrepared:
    """A claimed step prefix being written; the manifest, replacing the claim, is the commit."""

    def __init__(self, storage: KvStorage, name: str, claim: Any) -> None:
        self._storage, self._store, self._name, self._claim = storage, storage.store, name, claim
        self._staging: Path | None = None

    def destination(self, item: str) -> Destination:
        return _KvDestination(self._storage, f"{self._name}/{item}/", self._stage)

    def _stage(self) -> Path:
        if self._staging is None:
            self._staging = Path(tempfile.mkdtemp(prefix="stage-", dir=self._storage.local_dir()))
        return self._staging

    def sync(self) -> None:
        """Every PUT is durable once it returned."""

    def commit(self, manifest: Manifest) -> None:
        """Replace the claim with the manifest only if the claim is still the one we wrote
        (If-Match: a claim that another writer removed, say one that took our expired lease
        over and cleaned up at its start, fails the write atomically); refresh the lease.
        `commit_step` has checked the lease after the upload (`check_writer`)."""
        self._drop_staging()
        lease = self._storage.lease
        key = f"{self._name}/{MANIFEST}"
        if self._store.write(key, manifest.to_bytes(), if_generation=self._claim) is None:
            if lease is not None:
                lease.check()  # the likely cause, and the clearer message
            raise DirectoryLockedError(
                f"step {manifest.step}: the claim {self._storage.url}/{key} was removed or "
                "replaced by another writer while the step was being written; nothing was "
                "committed (is another writer using this directory?)"
            )
        if lease is not None:
            # Lost since the last check: this step is whole (its claim was intact at the commit)
            # and stays committed; the error stops every later commit.
            lease.refresh()

    def abort(self) -> None:
        self._drop_staging()
        _take_and_remove(self._store, self._name, self._claim)  # only while the claim is ours

    def _drop_staging(self) -> None:
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None


# Objects whose content this process knows (it wrote, copied or read and hashed them):
# (store.where, key) -> (generation, size, content hash). An incremental save copies such an
# object on the server without reading it, if it is still at that generation.
_KNOWN = KnownFiles()


class _KvDestination(Destination):
    """An item's prefix in the store: each file one PUT, straight from the handler's buffers
    (joined into one bytes object, which TensorStore's write takes). In an incremental save, a
    file of at least `COPY_MIN` bytes that the previous step has is a server-side copy of that
    step's object (`_link`)."""

    #: A copy costs two requests (the check, then the copy), an upload one and its bytes: below
    #: this size the upload is as quick (measured on moto: 345 files of a 16 MiB state took
    #: 1.7 to 1.9 times as long to copy as to upload), and its bytes are few.
    COPY_MIN = 1 << 20

    def __init__(self, storage: KvStorage, prefix: str, staging: Callable[[], Path]) -> None:
        super().__init__()
        self._storage, self._prefix, self._staging = storage, prefix, staging
        self._local: Path | None = None

    def describe(self, relpath: str) -> str:
        return f"{self._storage.url}/{self._prefix}{relpath}"

    def _put(self, relpath: str, pieces: list[memoryview]) -> Any:
        data = pieces[0].tobytes() if len(pieces) == 1 else b"".join(pieces)
        return self._storage.store.write(self._prefix + relpath, data)

    def _wrote(self, relpath: str, size: int, digest: str, stored: Any) -> None:
        _KNOWN.put((self._storage.store.where, self._prefix + relpath), (stored, size, digest))

    def _link(
        self,
        relpath: str,
        source: Source,
        source_relpath: str,
        size: int,
        digest: str,
        ranges: Ranges = (),
    ) -> bool:
        """A server-side copy of the previous step's object (`ObjectStore.copy`), made only
        from the object at the generation whose content is known to be `digest`: one this
        process wrote, copied, or read whole and hashed first (so a replaced or damaged object
        of an older step is uploaded afresh, not copied on), and read whole whenever `ranges`
        must hold in it (`Destination.link_known`). False where it is not made."""
        store = self._storage.store
        if size < self.COPY_MIN:
            return False
        if not isinstance(source, _KvSource) or source._storage is not self._storage:
            return False
        if store.copy_unavailable():
            return False
        key = source.key(source_relpath)
        known = _KNOWN.get((store.where, key))
        if known is not None and known[1:] == (size, digest) and not ranges:
            generation = known[0]
        else:
            try:
                data, generation = store.read_with_generation(key)
            except Exception as e:  # unreachable, denied: upload the bytes, as a full save does
                where = source.describe(source_relpath)
                log.warning("cairn: could not read %s (%s); this save uploads it", where, e)
                return False
            hashes = RangeHashes(ranges)
            if data is not None and len(data) == size:
                hashes.update(memoryview(data))
            if not hashes.hold(digest, source.describe(source_relpath)):
                return False
            _KNOWN.put((store.where, key), (generation, size, digest))
        copied = store.copy(key, self._prefix + relpath, generation)
        if copied is None:
            return False
        _KNOWN.put((store.where, self._prefix + relpath), (copied, size, digest))
        return True

    def local_directory(self) -> Path:
        if self._local is None:
            self._local = self._staging() / self._prefix
            self._local.mkdir(parents=True, exist_ok=True)
        return self._local

    def _upload_staged(self, path: Path, record: FileRecord) -> None:
        self._storage.store.write(self._prefix + record.path, path.read_bytes())


class _KvSource(Source):
    """An item's prefix in the store, read a file (one ranged GET) at a time."""

    cheap_size = False

    def __init__(self, storage: KvStorage, prefix: str) -> None:
        self._storage, self._prefix = storage, prefix

    def describe(self, relpath: str) -> str:
        return f"{self._storage.url}/{self._prefix}{relpath}"

    def key(self, relpath: str) -> str:
        """The key of `relpath` in the store."""
        check_relative(relpath)
        return self._prefix + relpath

    def size(self, relpath: str) -> int:
        data = self._storage.store.read(self._prefix + relpath)  # no HEAD in the kvstore API
        if data is None:
            raise FileNotFoundError(self.describe(relpath))
        return len(data)

    def read(self, relpath: str, size: int) -> bytes:
        return self.read_at(relpath, size, 0, size)

    def read_at(self, relpath: str, size: int, offset: int, nbytes: int) -> bytes:
        """`nbytes` of an object of `size` bytes (the manifest's) from `offset`: one ranged GET
        (the object's size is not checked: the caller checks the content's hash)."""
        try:
            data = self._storage.store.read_prefix(self._prefix + relpath, nbytes, offset)
        except ValueError as e:  # OUT_OF_RANGE: the object is shorter than the manifest says
            raise CorruptCheckpointError(
                f"{self.describe(relpath)} is shorter than the manifest says ({size} bytes): {e}"
            ) from None
        if data is None:
            raise FileNotFoundError(self.describe(relpath))
        return data

    def local_directory(self, relpaths: Sequence[str] = ()) -> Path:
        """A download of `relpaths` into a fresh local directory (removed at close)."""
        local = Path(tempfile.mkdtemp(prefix="download-", dir=self._storage.local_dir()))
        for relpath in relpaths:
            check_relative(relpath)
            data = self._storage.store.read(self._prefix + relpath)
            if data is None:
                raise FileNotFoundError(self.describe(relpath))
            target = local / relpath
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        return local
