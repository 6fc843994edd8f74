"""Checkpoint directories in object stores (``s3://bucket/prefix``, ``gs://bucket/prefix``).

Everything goes through TensorStore's kvstore API: it is already what writes arrays, it speaks
S3 and GCS with the standard credentials, and it offers the one primitive the commit needs, a
conditional write (``If-None-Match`` / ``If-Match``), so two writers racing to commit one step
cannot both win. Object stores have no rename, so the protocol of DESIGN.md applies: a step's data
objects first, then its manifest, written last; a prefix without a manifest does not exist for any
reader. The manifest's key is claimed first (a claim object, created only if absent) and the
manifest replaces exactly that claim (If-Match), so a writer whose claim was removed meanwhile,
say by a writer that took its expired lease over, commits nothing. Deletion removes the manifest
first, then the data.

Handlers keep writing into a local directory: a save is written into a local staging directory
and uploaded by the commit thread; a restore downloads the step's files into a local cache and
reads them from there, with the usual checksums.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from cairn.handlers.errors import DirectoryLockedError, StepAlreadyExistsError
from cairn.manager._commit import SaveJob, build_manifest, write_items
from cairn.manager._format import MANIFEST, METRICS, Manifest, StepNames, dump_checked

LEASE = ".cairn.lock"
LEASE_SECONDS = 3600.0  # read when a lease is taken (the tests shorten it)
CLAIM = ".claim"  # delete_step's mark, before the manifest goes; older writers' claim too
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


def is_url(text: str) -> bool:
    return "://" in text


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
        bucket, _, path = rest.partition("/")
        if scheme not in ("s3", "gs") or not bucket:
            raise ValueError(
                f"directory {url!r}: object stores are s3://bucket/prefix or gs://bucket/prefix"
            )
        path = path.strip("/")
        self.url = f"{scheme}://{bucket}/{path}" if path else f"{scheme}://{bucket}"
        spec: dict[str, Any] = {"bucket": bucket, "path": f"{path}/" if path else ""}
        if scheme == "s3":
            spec["driver"] = "s3"
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
        else:
            spec["driver"] = "gcs"
        import tensorstore as ts

        self._ts = ts
        self._spec = spec
        self._kv = ts.KvStore.open(spec).result()

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r})"

    def list_keys(self, prefix: str = "") -> list[str]:
        """Every key under `prefix`, sorted."""
        if prefix:
            found = self._kv.list(self._ts.KvStore.KeyRange(prefix, _successor(prefix))).result()
        else:
            found = self._kv.list().result()
        return sorted(k.decode() for k in found)

    def read(self, key: str) -> bytes | None:
        """The object's bytes, or None if it does not exist."""
        result = self._kv.read(key).result()
        if result.state != "value":
            return None
        return bytes(result.value)

    def read_with_generation(self, key: str) -> tuple[bytes | None, Any]:
        result = self._kv.read(key).result()
        return (bytes(result.value) if result.state == "value" else None), result.stamp.generation

    def write(self, key: str, data: bytes, *, if_generation: Any = None) -> Any:
        """Write an object and return its new generation; with `if_generation`, only if the
        object is still at that generation (sent as If-Match, atomic on the server; the
        generation of a missing key means "only if absent", If-None-Match). None if it was not."""
        stamp = self._kv.write(key, data, if_equal=if_generation).result()
        return stamp.generation or None

    def create(self, key: str, data: bytes) -> Any:
        """Create the object only if it does not exist; its generation, or None if it did."""
        return self.write(key, data, if_generation=self._no_value)

    @functools.cached_property
    def _no_value(self) -> Any:
        """The generation TensorStore gives a missing key; as a write condition it means "only if
        absent". The same for every key: read once from a key that never exists."""
        return self._kv.read(".cairn-no-such-key").result().stamp.generation

    def delete(self, key: str, *, if_generation: Any = None) -> None:
        """Delete an object; with `if_generation`, only if it is still at that generation
        (TensorStore checks that with a HEAD request first: not atomic)."""
        self._kv.write(key, None, if_equal=if_generation).result()

    def delete_prefix(self, prefix: str) -> None:
        self.delete_range(prefix, _successor(prefix))

    def delete_range(self, start: str, stop: str) -> None:
        """Delete every key k with start <= k < stop."""
        self._kv.delete_range(self._ts.KvStore.KeyRange(start, stop)).result()

    def upload_tree(self, local: Path, prefix: str, skip: Iterable[str] = ()) -> int:
        """Upload every file under `local` to `prefix` + its relative path; returns the bytes."""
        skipped, total, futures = set(skip), 0, []
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            rel = path.relative_to(local).as_posix()
            if rel in skipped:
                continue
            data = path.read_bytes()
            total += len(data)
            futures.append(self._kv.write(prefix + rel, data))
        for future in futures:
            future.result()
        return total

    def download(self, keys: Mapping[str, Path]) -> None:
        """Download each key to its local path (parents created); FileNotFoundError if one is
        missing."""
        futures = {key: self._kv.read(key) for key in keys}
        for key, future in futures.items():
            result = future.result()
            if result.state != "value":
                raise FileNotFoundError(f"{self.url}/{key}")
            target = keys[key]
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f".{target.name}.part")
            partial.write_bytes(bytes(result.value))
            os.replace(partial, target)  # a cached file is always a whole download


def _dead_here(owner: str) -> bool:
    """Whether the lease's owner was a process on this host that no longer runs (a crash)."""
    host, _, rest = owner.partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _parse_lease(data: bytes) -> tuple[float, str]:
    """A lease object's expiry time and owner; (0.0, "unknown") if it does not parse."""
    try:
        held = json.loads(data)
        return float(held["expires"]), str(held["owner"])
    except (ValueError, KeyError, TypeError):
        return 0.0, "unknown"


class Lease:
    """One writer per object-store directory: a lease object ``.cairn.lock`` created only if
    absent (or expired), checked before and after each upload, refreshed at each commit,
    deleted at close.

    A writer that crashed leaves its lease; another writer may take it over once it expired
    (`LEASE_SECONDS` after the last refresh, one hour), or at once when the owner was a process on
    the same host that no longer runs. A writer whose lease was taken over (or deleted) has lost
    it for good: every later check raises DirectoryLockedError, so it commits nothing more.
    """

    def __init__(self, store: ObjectStore) -> None:
        self._store, self._seconds = store, LEASE_SECONDS
        self._owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._lost: str | None = None
        data, self._generation = store.read_with_generation(LEASE)
        if data is not None:
            expires, owner = _parse_lease(data)
            if expires > time.time() and not _dead_here(owner):
                raise DirectoryLockedError(
                    f"{store.url} is held by another writable CheckpointManager ({owner}) until "
                    f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(expires))}; open it with "
                    "read_only=True to read alongside"
                )
        if not self._write():
            raise DirectoryLockedError(f"{store.url}: another writer took the lease first")

    def _write(self) -> bool:
        body = json.dumps({"owner": self._owner, "expires": time.time() + self._seconds}).encode()
        generation = self._store.write(LEASE, body, if_generation=self._generation)
        if generation is None:
            return False
        self._generation = generation
        return True

    def check(self) -> None:
        """DirectoryLockedError if the lease is no longer this manager's (one read)."""
        if self._lost is None:
            data, generation = self._store.read_with_generation(LEASE)
            if generation == self._generation:
                return
            self._lose(data)
        raise DirectoryLockedError(self._lost)

    def refresh(self) -> None:
        """Extend the lease by `LEASE_SECONDS`; DirectoryLockedError if it was lost."""
        if self._lost is None:
            if self._write():
                return
            self._lose(self._store.read(LEASE))
        raise DirectoryLockedError(self._lost)

    def _lose(self, data: bytes | None) -> None:
        how = "deleted" if data is None else f"taken over by {_parse_lease(data)[1]}"
        self._lost = (
            f"{self._store.url}: this manager's lease {LEASE} was {how} (a lease not refreshed "
            f"by a commit for {self._seconds:g} s expires and another writer may take it); it "
            "commits nothing more: close it, and open a new writable CheckpointManager once the "
            "other writer has closed"
        )

    def release(self) -> None:
        """Delete the lease, unless it is no longer this manager's."""
        if self._lost is None:
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


def remove_leftover(store: ObjectStore, name: str) -> None:
    """A starting writer removes a prefix that a cairn writer claimed and never committed (it
    died, or lost its lease); a step committed meanwhile stays."""
    data, generation = store.read_with_generation(f"{name}/{MANIFEST}")
    if data is None or data.startswith(_CLAIM_TAG):
        _take_and_remove(store, name, generation)


def commit_step(
    store: ObjectStore, staging: Path, names: StepNames, job: SaveJob, lease: Lease | None = None
) -> Manifest:
    """Write one step into the object store; the manifest, written last, is the commit. On any
    failure no manifest exists, so nothing is visible.

    The order: check the lease; claim the step (a claim object created at the manifest's key only
    if absent, so a second writer racing for the same step stops before it uploads anything);
    write the items into a local staging directory and upload them; check the lease again (a
    writer whose lease was taken over meanwhile stops here); replace the claim with the manifest
    only if the claim is still the one we wrote (If-Match: a claim that another writer removed,
    say one that took our expired lease over and cleaned up at its start, fails the write
    atomically, even if that happened after the check); refresh the lease.
    """
    t0 = time.monotonic()
    final = names.format(job.step)
    if lease is not None:
        lease.check()
    claim = store.create(f"{final}/{MANIFEST}", _claim("saving"))
    if claim is None:
        raise StepAlreadyExistsError(
            f"step {job.step}: {store.url}/{final} is committed or being committed by another writer"
        )
    tmp = staging / names.temporary(job.step)
    tmp.mkdir(parents=True)
    try:
        manifest = build_manifest(job, write_items(tmp, job), time.monotonic() - t0)
        store.upload_tree(tmp, f"{final}/")
        if lease is not None:
            lease.check()
        if store.write(f"{final}/{MANIFEST}", manifest.to_bytes(), if_generation=claim) is None:
            if lease is not None:
                lease.check()  # the likely cause, and the clearer message
            raise DirectoryLockedError(
                f"step {job.step}: the claim {store.url}/{final}/{MANIFEST} was removed or "
                "replaced by another writer while the step was being written; nothing was "
                "committed (is another writer using this directory?)"
            )
    except BaseException:
        _take_and_remove(store, final, claim)  # only while the claim is still ours
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if lease is not None:
        # Lost since the last check: this step is whole (its claim was intact at the commit) and
        # stays committed; the error stops every later commit.
        lease.refresh()
    return manifest


def scan(
    store: ObjectStore, names: StepNames
) -> tuple[dict[int, tuple[bytes, bytes | None]], list[str]]:
    """Committed steps (manifest bytes, metrics.json bytes or None) and the prefixes a cairn
    writer claimed but never committed (it died, or lost its lease, before the commit); a
    writer removes those with `remove_leftover`."""
    by_step: dict[int, set[str]] = {}
    for key in store.list_keys():
        head, sep, rest = key.partition("/")
        step = names.parse(head)
        if step is not None and sep:
            by_step.setdefault(step, set()).add(rest)
    committed, leftovers = {}, []
    for step, rests in sorted(by_step.items()):
        name = names.format(step)
        manifest = read_manifest(store, name) if MANIFEST in rests else None
        if manifest is None:
            # Only a prefix cairn claimed is a leftover of cairn's: anything else there (say, an
            # Orbax step) is not ours to delete, and not a step we can read.
            if MANIFEST in rests or CLAIM in rests:
                leftovers.append(name)
            continue
        metrics = store.read(f"{name}/{METRICS}") if METRICS in rests else None
        committed[step] = (manifest, metrics)
    return committed, leftovers


def remove_dropped(store: ObjectStore, dropped: Mapping[str, Iterable[str]]) -> None:
    """Delete the objects of items that manifests mark dropped (a crash in `drop_item` left
    them); `dropped` maps a step name to its dropped items."""
    keys = store.list_keys()
    for name, items in dropped.items():
        for item in items:
            prefix = f"{name}/{item}/"
            if any(k.startswith(prefix) for k in keys):
                store.delete_prefix(prefix)


def delete_step(store: ObjectStore, name: str) -> None:
    """Retire a step: a claim first (so that a crash part-way leaves a prefix the next writer
    knows as cairn's and removes), then the manifest (from then on it is no step), then the rest."""
    store.write(f"{name}/{CLAIM}", b"deleting")
    store.delete(f"{name}/{MANIFEST}")
    store.delete_prefix(f"{name}/")


def drop_item(store: ObjectStore, name: str, manifest: Manifest, item: str) -> Manifest:
    """Per-item retention: a manifest that marks the item dropped replaces the old one (one
    object, replaced atomically), then the item's objects are deleted."""
    entry = manifest.items[item]
    items = {**manifest.items, item: dataclasses.replace(entry, dropped=True, files=())}
    new = dataclasses.replace(manifest, items=items)
    store.write(f"{name}/{MANIFEST}", new.to_bytes())
    store.delete_prefix(f"{name}/{item}/")
    return new


def write_metrics(store: ObjectStore, name: str, metrics: Mapping[str, float]) -> None:
    store.write(f"{name}/{METRICS}", dump_checked({"metrics": dict(metrics)}))


def fetch(
    store: ObjectStore, name: str, manifest: Manifest, items: Iterable[str], cache: Path
) -> Path:
    """A local copy of the items' files of a committed step (downloaded once per manager);
    returns the local step directory. Checksums are verified when the handlers read."""
    local = cache / f"{name}-{manifest.committed_at!r}"  # a step saved again is another copy
    wanted = {}
    for item in items:
        for record in manifest.items[item].files:
            target = local / item / record.path
            if not target.exists():
                wanted[f"{name}/{item}/{record.path}"] = target
    if wanted:
        store.download(wanted)
    return local
