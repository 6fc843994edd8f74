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

import concurrent.futures
import dataclasses
import errno
import json
import logging
import os
import shutil
import tempfile
import threading
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
from cairn.handlers.io import KnownFiles, RangeHashes, Ranges, check_relative
from cairn.manager._format import (
    MANIFEST,
    METRICS,
    SYNC_PREFIX,
    Manifest,
    StepNames,
    check_sync_name,
    namings,
)
from cairn.manager._layouts.base import MAX_READ, plain_parts, too_long
from cairn.manager._layouts.registry import read_foreign
from cairn.manager._storage.base import Listed, Reclaim
from cairn.manager._storage.kvstore import ObjectStore, StorageOptions, _successor
from cairn.manager._storage.lease import Lease

log = logging.getLogger("cairn")

CLAIM = ".claim"  # delete_step's mark, before the manifest goes; older writers' claim too
_DELETING = b"deleting"  # what delete_step's claim holds
_CLAIM_TAG = b'{"cairn_claim": '  # how a claim at a manifest's key begins; a manifest never does


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
        """Steps under another naming (one LIST, then the metadata of a few prefixes): cairn's,
        or a foreign layout's (Orbax's), as on POSIX."""
        heads: dict[str, set[str]] = {}
        for key in self.store.list_keys():
            head, sep, rest = key.partition("/")
            if sep:
                heads.setdefault(head, set()).add(rest)
        if any(names.parse(head) is not None for head in heads):
            return None
        for naming, steps in namings(heads):
            for step, name in steps[:3]:  # a few are enough to tell
                if MANIFEST in heads[name]:
                    return naming, "cairn"
                if CLAIM not in heads[name]:
                    found = read_foreign(step, _KvStepView(self, name, heads[name]))
                    if found is not None:
                        return naming, found[0]
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
                # an Orbax step) is not ours to delete; a foreign layout's step is read in place.
                if MANIFEST in rests or CLAIM in rests:
                    found.append((None, name, CLAIM in rests))
                    continue
                foreign = read_foreign(step, _KvStepView(self, name, rests))
                if foreign is not None:
                    listed = Listed(step, self.location(name), foreign=foreign[1])
                    found.append((listed, name, False))
                continue
            listed = Listed(step, self.location(name), data, metrics=metrics.get(name))
            found.append((listed, name, CLAIM in rests))
        return found

    def read_step(self, names: StepNames, step: int) -> Listed | None:
        name = names.format(step)
        manifest = read_manifest(self.store, name)
        if manifest is None:
            return self._read_foreign(step, name)
        metrics = self.store.read(f"{name}/{METRICS}")
        return Listed(step, self.location(name), manifest, metrics=metrics)

    def _read_foreign(self, step: int, name: str) -> Listed | None:
        """A prefix without a manifest, as `_scan` reads it: a foreign layout's step, or None
        (nothing there, a claim of cairn's, or no layout reads it)."""
        prefix = f"{name}/"
        rests = {key[len(prefix) :] for key in self.store.list_keys(prefix)}
        if not rests or MANIFEST in rests or CLAIM in rests:
            return None
        foreign = read_foreign(step, _KvStepView(self, name, rests))
        if foreign is None:
            return None
        return Listed(step, self.location(name), foreign=foreign[1])

    def source(self, name: str, item: str) -> Source:
        return _KvSource(self, f"{name}/{item}/")

    def view(self, name: str) -> _KvStepView:
        prefix = f"{name}/"
        return _KvStepView(self, name, {key[len(prefix) :] for key in self.store.list_keys(prefix)})

    def foreign_source(self, name: str, item: str) -> Source:
        """A foreign step's item: downloaded whole on first `local_directory` (see
        `_KvForeignSource`), removed at `release`."""
        return _KvForeignSource(self, name, item)

    # ------------------------------------------------------------------ writing

    def reuse_pages(self) -> None:
        """Nothing: an object store's objects are no pages of this host's."""

    def clean_leftovers(self, names: StepNames) -> list[Listed]:
        """Prefixes that a cairn writer claimed and never committed (it died, or lost its
        lease), and steps (or directories, `delete_directory`'s) whose deletion a crash
        interrupted; a step committed meanwhile stays. The committed steps left, from the same
        listing (the writer holds the lease: no other commits)."""
        keys = self.store.list_keys()
        removed = [key for key in keys if key.startswith(SYNC_PREFIX)]
        self.store.delete_keys(removed)  # meetings of writer processes that crashed
        committed = []
        for listed, name, claimed in self._scan(names, keys):
            if listed is not None:
                if claimed and self.store.read(f"{name}/{CLAIM}") == _DELETING:
                    log.info("cairn: finishing the deletion of %s/%s", self.url, name)
                    self.store.delete(f"{name}/{MANIFEST}")
                    self.finish_deletion(name)
                    removed.append(name)
                else:
                    committed.append(listed)
                continue
            data, generation = self.store.read_with_generation(f"{name}/{MANIFEST}")
            if (data is None or data.startswith(_CLAIM_TAG)) and _take_and_remove(
                self.store, name, generation
            ):
                removed.append(name)
                continue
            step = names.parse(name)  # changed since the listing: committed meanwhile?
            again = None if step is None else self.read_step(names, step)
            if again is not None:
                committed.append(again)
        # Directories that are no step of this naming (`delete_directory`'s, another naming's
        # step) whose deletion a crash interrupted: their claim says so, their rest goes.
        for name in sorted({k.partition("/")[0] for k in keys if k.partition("/")[2] == CLAIM}):
            if names.parse(name) is None and self.store.read(f"{name}/{CLAIM}") == _DELETING:
                log.info("cairn: finishing the deletion of %s/%s", self.url, name)
                self.store.delete(f"{name}/{MANIFEST}")
                self.finish_deletion(name)
                removed.append(name)
        if removed:
            log.info("cairn: removed %d leftovers in %s: %s", len(removed), self.url, removed)
        return committed

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


class _KvStepView:
    """A step prefix of an object store as a `StepView` of `_layouts.base`: its listing (the
    keys under the prefix, relative to it, taken once by the caller) and reads of its small
    objects. A key segment that is empty, ``.`` or ``..`` names no entry."""

    renames = False  # Orbax writes a step in place on object stores: its commit mark counts

    def __init__(self, storage: KvStorage, name: str, rests: Iterable[str]) -> None:
        self._store, self._name = storage.store, name
        self._rests = frozenset(rests)
        self.where = storage.location(name)

    def __repr__(self) -> str:
        return f"_KvStepView({self.where!r})"

    def entries(self, relpath: str = "") -> dict[str, bool]:
        if relpath and plain_parts(relpath) is None:
            raise NotADirectoryError(f"{self.where}: {relpath!r:.200} is not a relative path")
        prefix = f"{relpath}/" if relpath else ""
        found: dict[str, bool] = {}
        for rest in self._rests:
            if rest.startswith(prefix):
                head, sep, _ = rest[len(prefix) :].partition("/")
                if head not in ("", ".", ".."):
                    found[head] = found.get(head, False) or bool(sep)
        if relpath and not found:
            raise FileNotFoundError(f"{self.where}/{relpath}")
        return found

    def is_file(self, relpath: str) -> bool:
        return relpath in self._rests and plain_parts(relpath) is not None

    def read(self, relpath: str, limit: int = MAX_READ) -> bytes:
        if not self.is_file(relpath):
            raise FileNotFoundError(f"{self.where}/{relpath}")
        data = self._store.read_chunk(f"{self._name}/{relpath}", 0, limit + 1)
        if data is None:
            raise FileNotFoundError(f"{self.where}/{relpath}")
        if len(data) > limit:
            raise too_long(f"{self.where}/{relpath}", limit)
        return data

    def mtime(self) -> float | None:
        return None  # a listing carries no times


class _KvForeignSource(Source):
    """An item of a foreign step (Orbax's) in the store, for handlers that read through a
    library that wants a local directory (orbax-checkpoint, TensorFlow): `local_directory`
    downloads every object under the item's prefix, once, into a private directory that
    `release` removes (and `KvStorage.close`, should a restore not release it).

    The keys are a stranger's: every one must be a relative path of plain names
    (`check_relative`: no ``.``, ``..``, empty parts or control characters; a request for a key
    with dot segments would reach outside the directory) and no key may be both a file and the
    directory of another, or nothing is downloaded (CorruptCheckpointError naming the key).
    Objects stream to disk `CHUNK` bytes at a time, `THREADS` objects at once; the files are
    created new (``O_EXCL``) inside the private directory only.
    """

    cheap_size = False
    CHUNK = 16 << 20
    THREADS = 8

    def __init__(self, storage: KvStorage, name: str, item: str) -> None:
        self._storage, self._item = storage, item
        self._prefix = f"{name}/{item}/"
        self._where = f"{storage.location(name)}, item {item!r}"
        self._local: Path | None = None
        self._lock = threading.Lock()

    def describe(self, relpath: str) -> str:
        return f"{self._storage.url}/{self._prefix}{relpath}"

    def _key(self, relpath: str) -> str:
        check_relative(relpath)
        return self._prefix + relpath

    def size(self, relpath: str) -> int:
        return len(self.read(relpath, 1 << 62))

    def read(self, relpath: str, size: int) -> bytes:
        data = self._storage.store.read_chunk(self._key(relpath), 0, size + 1)
        if data is None:
            raise FileNotFoundError(self.describe(relpath))
        return data

    def local_directory(self, relpaths: Sequence[str] = ()) -> Path:
        """The item's objects on local disk, downloaded on the first call (`relpaths` is
        ignored: a foreign manifest lists no files)."""
        del relpaths
        with self._lock:
            if self._local is None:
                self._local = self._download()
            return self._local

    def release(self) -> None:
        with self._lock:
            if self._local is not None:
                shutil.rmtree(self._local.parent, ignore_errors=True)
                self._local = None

    def _download(self) -> Path:
        keys = self._storage.store.list_keys(self._prefix)
        rels = [key[len(self._prefix) :] for key in keys]
        # "state/" keys: the folder markers of tf.io.gfile and cloud consoles, no files
        markers = {rel.rstrip("/") for rel in rels if rel.endswith("/")} - {""}
        rels = [rel for rel in rels if rel and not rel.endswith("/")]
        if not rels:
            raise CorruptCheckpointError(f"{self._where}: no object under {self.describe('')}")
        for rel in [*rels, *sorted(markers)]:
            try:
                check_relative(rel)
            except ValueError as e:
                raise CorruptCheckpointError(
                    f"{self._where}: the key {self._prefix + rel!r:.300} is not cairn's to "
                    f"download: {e}"
                ) from None
        dirs = {rel.rsplit("/", 1)[0] for rel in rels if "/" in rel} | markers
        dirs |= {d.rsplit("/", i)[0] for d in list(dirs) for i in range(1, d.count("/") + 1)}
        clash = sorted(dirs.intersection(rels))
        if clash:
            raise CorruptCheckpointError(
                f"{self._where}: {self.describe(clash[0])} is both an object and the prefix of "
                "others; no directory can hold it"
            )
        scratch = Path(tempfile.mkdtemp(prefix="foreign-", dir=self._storage.local_dir()))
        top = scratch / self._item
        try:
            top.mkdir()
            for d in sorted(dirs):
                (top / d).mkdir(parents=True, exist_ok=True)
            pool = concurrent.futures.ThreadPoolExecutor(
                self.THREADS, thread_name_prefix="cairn-fetch"
            )
            try:
                for future in [pool.submit(self._fetch, rel, top / rel) for rel in rels]:
                    future.result()
            finally:  # the first failure stops the rest: nothing more is fetched to be removed
                pool.shutdown(wait=True, cancel_futures=True)
        except BaseException as e:
            shutil.rmtree(scratch, ignore_errors=True)
            # an object gone meanwhile, a key no local file can be named by: the step's doing;
            # a network error or a full disk is not damage, and is raised as it is
            if isinstance(e, FileNotFoundError) or (
                isinstance(e, OSError) and e.errno in (errno.ENAMETOOLONG, errno.EEXIST)
            ):
                raise CorruptCheckpointError(f"{self._where} cannot be downloaded: {e}") from e
            raise
        return top

    def _fetch(self, rel: str, path: Path) -> None:
        """One object streamed into a new file."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "wb") as f:
            offset = 0
            while True:
                chunk = self._storage.store.read_chunk(self._prefix + rel, offset, self.CHUNK)
                if chunk is None:
                    raise FileNotFoundError(f"{self.describe(rel)} is gone")
                f.write(chunk)
                offset += len(chunk)
                if len(chunk) < self.CHUNK:
                    return
