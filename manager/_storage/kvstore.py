"""The kvstore client of cairn's object-store directories: ``s3://``, ``gs://`` and ``memory://``
through TensorStore's kvstore API (`ObjectStore`), with its options (`StorageOptions`) and the
messages an open gives when the endpoint, the bucket or the credentials are wrong."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from cairn.handlers.io import optional
from cairn.manager._format import (
    LOCK,
)
from cairn.manager._storage import servercopy as _servercopy

log = logging.getLogger("cairn")


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
        self.list_range(LOCK, _successor(LOCK))

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
        generation of a missing key means "only if absent", If-None-Match). None if it was not.

        A refused write is read back once: a key that holds exactly `data` has it, and its
        generation is returned. That is this write's own doing when the server did it but its
        answer was lost on the way (a timeout, a 503 from a proxy) and TensorStore sent the
        request again, whose condition then fails on the first one's result. The conditional
        writes here (claims, manifests, the lease, meeting files) carry bytes no other writer
        writes, and identical bytes from another would come to the same."""
        try:
            stamp = self._result(self._kv.write(key, data, if_equal=if_generation))
        except ValueError as e:
            if "NOT_FOUND" not in str(e):
                raise
            raise _refusal(self, e, writing=True) from None
        if stamp.generation or if_generation is None:
            return stamp.generation or None
        found, generation = self.read_with_generation(key)
        if found != data:
            return None
        log.info("cairn: %s: %s was written, though its answer was a refusal", self.where, key)
        return generation

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

    def read_chunk(self, key: str, offset: int, size: int) -> bytes | None:
        """At most `size` bytes of an object from `offset`, fewer where it ends before (none at
        its end), or None if it does not exist: one ranged GET, two near the end (a range past
        the end is refused, and the kvstore API has no HEAD to learn the size first)."""
        try:
            result = self._kv.read(key, byte_range=slice(offset, offset + size)).result()
        except ValueError as e:
            if "OUT_OF_RANGE" not in str(e):
                raise
            result = self._kv.read(key, byte_range=slice(offset, None)).result()
        if result.state != "value":
            return None
        return bytes(result.value)

    def read_prefix(self, key: str, size: int, offset: int = 0) -> bytes | None:
        """The `size` bytes of an object from `offset` (the first ones by default; one ranged
        GET), or None if it does not exist; ValueError if it is shorter."""
        result = self._kv.read(key, byte_range=slice(offset, offset + size)).result()
        if result.state != "value":
            return None
        return bytes(result.value)
