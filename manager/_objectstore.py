"""Checkpoint directories in object stores (``s3://bucket/prefix``, ``gs://bucket/prefix``).

Everything goes through TensorStore's kvstore API: it is already what writes arrays, it speaks
S3 and GCS with the standard credentials, and it offers the one primitive the commit needs, a
conditional write (``If-None-Match``), so two writers racing to commit one step cannot both win.
Object stores have no rename, so the protocol of DESIGN.md applies: a step's data objects first,
then its manifest, written last and only if absent; a prefix without a manifest does not exist
for any reader. Deletion removes the manifest first, then the data.

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
LEASE_SECONDS = 3600.0


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

    def write(self, key: str, data: bytes, *, if_generation: Any = None) -> bool:
        """Write an object; with `if_generation`, only if the object is still at that generation
        (the generation read from a missing key means "only if absent"). False if it was not."""
        if if_generation is None:
            self._kv.write(key, data).result()
            return True
        stamp = self._kv.write(key, data, if_equal=if_generation).result()
        return bool(stamp.generation)

    def write_if_absent(self, key: str, data: bytes) -> bool:
        """Create the object only if it does not exist (If-None-Match); False if it did."""
        return self.write(key, data, if_generation=self._no_value)

    @functools.cached_property
    def _no_value(self) -> Any:
        """The generation TensorStore gives a missing key; as a write condition it means "only if
        absent". The same for every key: read once from a key that never exists."""
        return self._kv.read(".cairn-no-such-key").result().stamp.generation

    def delete(self, key: str) -> None:
        self._kv.write(key, None).result()

    def delete_prefix(self, prefix: str) -> None:
        self._kv.delete_range(self._ts.KvStore.KeyRange(prefix, _successor(prefix))).result()

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


class Lease:
    """One writer per object-store directory: a lease object ``.cairn.lock`` created only if
    absent (or expired), refreshed at each commit, deleted at close.

    A writer that crashed leaves its lease; another writer may take it over once it expired
    (`seconds` after the last refresh, one hour by default), or at once when the owner was a
    process on the same host that no longer runs.
    """

    def __init__(self, store: ObjectStore, seconds: float = LEASE_SECONDS) -> None:
        self._store, self._seconds = store, seconds
        self._owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        data, generation = store.read_with_generation(LEASE)
        if data is not None:
            try:
                held = json.loads(data)
                expires, owner = float(held["expires"]), str(held["owner"])
            except (ValueError, KeyError, TypeError):
                expires, owner = 0.0, "unknown"
            if expires > time.time() and not _dead_here(owner):
                raise DirectoryLockedError(
                    f"{store.url} is held by another writable CheckpointManager ({owner}) until "
                    f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(expires))}; open it with "
                    "read_only=True to read alongside"
                )
        self._generation = generation
        if not self.refresh():
            raise DirectoryLockedError(f"{store.url}: another writer took the lease first")

    def refresh(self) -> bool:
        body = json.dumps({"owner": self._owner, "expires": time.time() + self._seconds}).encode()
        if not self._store.write(LEASE, body, if_generation=self._generation):
            return False
        _, self._generation = self._store.read_with_generation(LEASE)
        return True

    def release(self) -> None:
        data, generation = self._store.read_with_generation(LEASE)
        if data is not None and json.loads(data).get("owner") == self._owner:
            self._store.delete(LEASE)
        del generation


CLAIM = ".claim"


def commit_step(store: ObjectStore, staging: Path, names: StepNames, job: SaveJob) -> Manifest:
    """Write one step into the object store; the manifest, written last and only if absent, is
    the commit. On any failure no manifest exists, so nothing is visible.

    The order: claim the step (a ``.claim`` object created only if absent, so a second writer
    racing for the same step stops before it uploads anything), write the items into a local
    staging directory, upload them, write the manifest if absent, drop the claim.
    """
    t0 = time.monotonic()
    final = names.format(job.step)
    if store.read(f"{final}/{MANIFEST}") is not None or not store.write_if_absent(
        f"{final}/{CLAIM}", uuid.uuid4().hex.encode()
    ):
        raise StepAlreadyExistsError(
            f"step {job.step}: {store.url}/{final} is committed or being committed by another writer"
        )
    tmp = staging / names.temporary(job.step)
    tmp.mkdir(parents=True)
    try:
        manifest = build_manifest(job, write_items(tmp, job), time.monotonic() - t0)
        store.upload_tree(tmp, f"{final}/")
        if not store.write_if_absent(f"{final}/{MANIFEST}", manifest.to_bytes()):  # the commit
            # Another writer committed this step although we held the claim: a server that
            # ignores conditional writes. Its step is not ours to delete.
            raise StepAlreadyExistsError(
                f"step {job.step}: {store.url}/{final} was committed by another writer meanwhile "
                "(does this server honour conditional writes?)"
            )
    except StepAlreadyExistsError:
        raise
    except BaseException:
        store.delete_prefix(f"{final}/")  # our claim and whatever we uploaded; no manifest yet
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    store.delete(f"{final}/{CLAIM}")
    return manifest


def scan(
    store: ObjectStore, names: StepNames
) -> tuple[dict[int, tuple[bytes, bytes | None]], list[str]]:
    """Committed steps (manifest bytes, metrics.json bytes or None) and the prefixes a cairn
    writer claimed but never committed (it died before writing the manifest)."""
    by_step: dict[int, set[str]] = {}
    for key in store.list_keys():
        head, sep, rest = key.partition("/")
        step = names.parse(head)
        if step is not None and sep:
            by_step.setdefault(step, set()).add(rest)
    committed, leftovers = {}, []
    for step, rests in sorted(by_step.items()):
        name = names.format(step)
        manifest = store.read(f"{name}/{MANIFEST}") if MANIFEST in rests else None
        if manifest is None:
            # Only a prefix cairn claimed is a leftover of cairn's: anything else there (say, an
            # Orbax step) is not ours to delete, and not a step we can read.
            if CLAIM in rests:
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
