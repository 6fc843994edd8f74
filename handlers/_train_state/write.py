"""The write phase: `_StateSnapshot` writes a captured train state as packs (the packed layout)
or chunk files (the zarr layout), linking or keeping what an incremental save finds unchanged."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import crc32c
import numpy as np
import xxhash

from cairn.handlers._files import (
    Destination,
    FileRecord,
    as_destination,
    lower_thread_priority,
    writing_process,
)
from cairn.handlers._packs import (
    Packed,
    group,
    group_staged,
    load_index,
    save_token,
    staged_pack,
    write_index,
    write_pack,
)
from cairn.handlers._packs import _Pack as Pack
from cairn.handlers._staging import Lease, Slab, StagingPool
from cairn.handlers._train_state.layout import (
    _cast_digest,
    _chunks_of,
    _MiB,
    _raw,
    _size,
    _zarr_metadata,
)
from cairn.handlers._train_state.staging import _Copying, _Leaf
from cairn.handlers._train_state.threads import _Tickets
from cairn.handlers._tree import TREE, keystr
from cairn.handlers.errors import CorruptCheckpointError


class _Options(Protocol):
    """What a snapshot reads of the `TrainStateHandler` that made it (handler.py, which imports
    this module)."""

    layout: str
    max_inflight_bytes: int
    threads: int | None


class _StateSnapshot:
    """A train state as `TrainStateHandler.snapshot` captured it: staged chunks (in the lease's
    slab, maybe still being copied: `_Copying`), views and values.

    Threads: made on the caller thread, which may call `settle` (the manager's ``save()`` does,
    after handing the snapshot to the commit thread); `write` runs once, on the commit thread
    (or in the writer process, on a copy sent only once settled), and waits for the copies
    into each span of the slab it writes; `release` may come from either thread, and waits
    for the copies first."""

    def __init__(
        self,
        handler: _Options,
        tree: Any,
        leaves: list[_Leaf],
        lease: Lease | None,
        staging: tuple[StagingPool, str] | None = None,
        previous: Mapping[str, Packed] | None = None,
        copying: _Copying | None = None,
    ) -> None:
        self._handler = handler
        self._tree = tree
        self._leaves = leaves
        self._lease = lease
        self._staging = staging
        self._previous = previous or {}  # incremental, packed: the last save's chunks
        self._copying = copying
        self._writes = 1  # writes before the slab goes back (`share`)
        self._writes_lock = threading.Lock()

    def share(self, writes: int) -> None:
        """`writes` writes of this snapshot are coming, maybe at once on two threads (a local
        tier's part and the persistent step, from one copy): the slab goes back after the
        last of them, not the first. Call before handing it over."""
        self._writes = writes

    @property
    def version(self) -> int:
        """The layout version this save writes (the manifest's): 2 packed, 1 zarr."""
        return 2 if self._handler.layout == "packed" else 1

    def settle(self) -> None:
        """Until the snapshot no longer reads the caller's arrays (every staging copy is done);
        a failed copy raises here, and fails the write too."""
        if self._copying is not None:
            self._copying.wait()

    def _staged_until(self, end: int) -> None:
        """Until the slab holds its bytes before offset `end` (the write of a span waits)."""
        if self._copying is not None:
            self._copying.wait(end)

    def __getstate__(self) -> dict[str, Any]:
        """The writer process's copy: the slab (sent as its memfd), not the pool's lease."""
        self.settle()
        slab = self._lease.slab if self._lease is not None else None
        return {"handler": self._handler, "tree": self._tree, "leaves": self._leaves, "slab": slab}

    def __setstate__(self, state: dict[str, Any]) -> None:
        slab = state["slab"]
        lease = Lease(None, "", slab) if slab is not None else None
        self.__init__(state["handler"], state["tree"], state["leaves"], lease)  # type: ignore[misc]

    def release(self) -> None:
        """One write of this snapshot is done without this copy (the writer process wrote its
        own) or will not come (the save never reached it). After the last of the writes
        `share` announced, the staging slab goes back to the pool and every view of it is let
        go: a traceback that keeps this snapshot alive (a kept commit error) must not keep the
        shared memory mapped after the manager closed. Before it, the other write (a local
        tier's part, on another thread) still reads the slab."""
        if self._let_go():
            self._lease, self._leaves = None, []

    def _let_go(self) -> bool:
        """Give the slab back to the pool, once no copy writes into it any more and no other
        write (`share`) reads it; whether it went back (this was the last write)."""
        with self._writes_lock:
            self._writes -= 1
            if self._writes > 0:
                return False
        if self._copying is not None:
            self._copying.wait(quiet=True)
        if self._lease is not None:
            self._lease.release()
        return True

    def write(self, dest: Destination | Path) -> Sequence[FileRecord]:
        dest = as_destination(dest)
        h = self._handler
        if h.layout == "packed":
            return self._write_packed(dest)
        primary = writing_process()[0] == 0  # shared files once; every process its own shards
        metadata: list[tuple[str, bytes]] = []  # written by the same pool, first
        jobs: list[tuple[str, np.ndarray, np.dtype]] = []
        linked: list[FileRecord] = []  # files of unchanged arrays, linked to the previous step
        viewed: set[int] = set()  # leaves written from views of their arrays
        for leaf in self._leaves if primary else ():
            meta = _zarr_metadata(leaf.shape, leaf.dtype, leaf.chunk)
            metadata.append((f"arrays/{leaf.index}/zarr.json", json.dumps(meta).encode()))
        staged, others = self._chunks(primary)
        for leaf, relpath, part in others:
            record = leaf.known.get(relpath) if leaf.known is not None else None
            if isinstance(record, FileRecord) and record.xxh3_128 is not None:
                reused = dest.link_known(relpath, record.size, record.xxh3_128)
                if reused is not None:
                    linked.append(reused)
                    continue
            viewed.add(leaf.index)
            jobs.append((relpath, part, leaf.dtype))
        try:
            slab = self._lease.slab if self._lease is not None else None
            records = _write_chunks(
                dest,
                jobs,
                h.max_inflight_bytes,
                h.threads or dest.writers,
                metadata,
                slab,
                staged,
                self._staged_until,
            )
        finally:
            self._let_go()  # the next save may stage into it now
        self._check_sources(viewed)
        records += linked
        if self._staging is not None and dest.incremental:  # not a local tier's part
            self._remember({r.path: r for r in records if not r.path.endswith("/zarr.json")})
        if primary:
            records.append(dest.write_file(TREE, json.dumps(self._tree).encode()))
        return records

    def _write_packed(self, dest: Destination) -> list[FileRecord]:
        """The packed layout (`cairn.handlers._packs`): this process's chunks in packs of up to
        `dest.pack_bytes` (64 MiB on disk, 16 MiB in a bucket), staged chunks in the slab's order (a pack is spans of the slab, written
        with O_DIRECT), then the other chunks; the packs are written by `threads` threads, then
        this process's index, then (the primary) tree.json.

        An incremental save keeps a chunk where the previous save put it when it is unchanged:
        its leaf is the same jax array (`leaf.known`, not read), or its bytes hash to what the
        previous save recorded for that chunk (`self._previous`, hashed here first). It links
        each previous pack that still holds at least half its bytes of unchanged chunks, and
        writes the unchanged chunks of the others again (so no step keeps a pack mostly for
        chunks no step uses), as it does where a link cannot be made."""
        h = self._handler
        process = writing_process()[0]
        views: list[tuple[str, np.ndarray, np.dtype]] = []
        viewed: set[int] = set()
        unchanged: dict[str, list[tuple[str, Packed, Any]]] = {}  # by pack: fallback to write
        slab = self._lease.slab.array if self._lease is not None else None
        workers = h.threads or dest.writers
        staged, others = self._chunks(process == 0)
        for leaf, vpath, part in others:
            was = leaf.known.get(vpath) if leaf.known is not None else None
            view = (vpath, part, leaf.dtype)
            if isinstance(was, Packed):
                unchanged.setdefault(was.pack, []).append((vpath, was, (view, leaf.index)))
            else:
                views.append(view)
                viewed.add(leaf.index)
        digests: dict[str, str] = {}
        previous = (self._previous or _previous_chunks(dest, process)) if dest.incremental else {}
        if previous:
            self.settle()  # every staged chunk may be hashed
            staged, views = self._match_previous(
                previous, staged, views, slab, unchanged, digests, workers
            )
        records: list[FileRecord] = []
        placed: dict[str, Packed] = {}
        for uses in unchanged.values():
            pack = uses[0][1].pack_record
            linked = None
            if 2 * sum(use[1].nbytes for use in uses) >= pack.size and pack.xxh3_128:
                # An index read from the checkpoint is not taken at its word: the chunks kept
                # are checked in the pack (once: what this save writes is remembered).
                ranges = [(v, was.offset, was.nbytes, was.xxh3_128) for v, was, _ in uses]
                linked = dest.link_known(
                    pack.path, pack.size, pack.xxh3_128, () if self._previous else ranges
                )
            if linked is not None:
                records.append(linked)
                for use in uses:
                    placed[use[0]] = dataclasses.replace(use[1], pack_record=linked)
                continue
            for _, _, (chunk, index) in uses:  # written after all, from where it is
                if index is None:
                    staged.append(chunk)
                else:
                    views.append(chunk)
                    viewed.add(index)
        token = save_token()
        staged.sort(key=lambda chunk: chunk[1])
        limit = dest.pack_bytes
        packs = [(True, chunks) for chunks in group_staged(staged, limit)]
        packs += [
            (False, chunks)
            for chunks in group([(v, _size(v[1].shape) * v[2].itemsize) for v in views], limit)
        ]
        budget = _Tickets(max(1, h.max_inflight_bytes // _MiB))

        def one(n: int, from_slab: bool, chunks: list[Any]) -> tuple[FileRecord, dict[str, Packed]]:
            name = f"packs/{process}.{token}.{n}"
            if from_slab:
                assert slab is not None
                self._staged_until(chunks[-1][1] + chunks[-1][2])
                return write_pack(dest, name, staged_pack(slab, chunks), digests)
            casts = sum(_size(p.shape) * want.itemsize for _, p, want in chunks if p.dtype != want)
            tickets = min(-(-casts // _MiB), budget.total)
            with budget.taking(tickets):
                pack = Pack()
                for vpath, part, want in chunks:
                    raw = _raw(part, want)
                    pack.keep.append(raw)
                    pack.add(vpath, memoryview(raw))  # type: ignore[arg-type]
                return write_pack(dest, name, pack, digests)

        try:
            with concurrent.futures.ThreadPoolExecutor(
                max_workers=workers,
                thread_name_prefix="cairn-write",
                initializer=lower_thread_priority,
            ) as pool:
                written = list(pool.map(lambda job: one(job[0], *job[1]), enumerate(packs)))
        finally:
            self._let_go()  # the next save may stage into it now
        for record, chunks in written:
            records.append(record)
            placed.update(chunks)
        self._check_sources(viewed)
        records.append(write_index(dest, process, placed))
        if self._staging is not None and dest.incremental:  # not a local tier's part
            self._remember(placed)
            self._staging[0].remember_chunks(self._staging[1], placed)
        if process == 0:
            records.append(dest.write_file(TREE, json.dumps(self._tree).encode()))
        return records

    def _chunks(
        self, primary: bool
    ) -> tuple[list[tuple[str, int, int]], list[tuple[_Leaf, str, np.ndarray]]]:
        """The chunks this process writes (shared leaves: the primary only): staged ones as
        (path, slab offset, bytes), the others as (leaf, path, contiguous data)."""
        staged: list[tuple[str, int, int]] = []
        others: list[tuple[_Leaf, str, np.ndarray]] = []
        together = writing_process()[1] > 1  # a shard held twice: written by its replica 0
        for leaf in self._leaves:
            if leaf.shared and not primary:
                continue
            base = f"arrays/{leaf.index}"
            skip = leaf.secondary if together else frozenset()
            if leaf.staged is not None:
                staged.extend((f"{base}/{k}", at, n) for k, at, n in leaf.staged if k not in skip)
                continue
            for region, data in leaf.pieces:
                others.extend(
                    (leaf, f"{base}/{key}", part)
                    for key, part in _chunks_of(region, data, leaf.chunk)
                    if key not in skip
                )
        return staged, others

    def _match_previous(
        self,
        previous: Mapping[str, Packed],
        staged: list[tuple[str, int, int]],
        views: list[tuple[str, np.ndarray, np.dtype]],
        slab: np.ndarray | None,
        unchanged: dict[str, list[tuple[str, Packed, Any]]],
        digests: dict[str, str],
        workers: int,
    ) -> tuple[list[tuple[str, int, int]], list[tuple[str, np.ndarray, np.dtype]]]:
        """Hash each chunk that the previous save recorded at the same path and size (staged, or
        a view, cast a piece at a time where `save_dtype` casts it: on an accelerator every
        chunk is a view); one whose hash is the recorded one joins `unchanged`. The staged
        chunks and views left to write are returned, and every hash made is put in `digests`
        (a pack writes it without hashing the chunk again)."""
        candidates: list[tuple[str, Any, memoryview | Callable[[], str], Packed]] = []
        for chunk in staged:
            vpath, at, nbytes = chunk
            was = previous.get(vpath)
            if slab is not None and was is not None and was.nbytes == nbytes:
                region = memoryview(slab[at : at + nbytes])  # type: ignore[arg-type]
                candidates.append((vpath, (chunk, None), region, was))
        for view in views:
            vpath, part, want = view
            was = previous.get(vpath)
            if was is not None and was.nbytes == part.size * want.itemsize:
                data: memoryview | Callable[[], str] = (
                    memoryview(_raw(part, want))  # type: ignore[arg-type]
                    if part.dtype == want
                    else functools.partial(_cast_digest, part, want)
                )
                candidates.append((vpath, (view, int(vpath.split("/")[1])), data, was))
        if not candidates:
            return staged, views
        with concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="cairn-write", initializer=lower_thread_priority
        ) as pool:
            hashed = list(
                pool.map(
                    lambda c: c[2]() if callable(c[2]) else xxhash.xxh3_128_hexdigest(c[2]),
                    candidates,
                )
            )
        same: set[str] = set()
        for (vpath, fallback, _, was), digest in zip(candidates, hashed, strict=True):
            digests[vpath] = digest
            if digest == was.xxh3_128:
                unchanged.setdefault(was.pack, []).append((vpath, was, fallback))
                same.add(vpath)
        return [c for c in staged if c[0] not in same], [v for v in views if v[0] not in same]

    def _check_sources(self, viewed: set[int]) -> None:
        """A donated buffer may have been overwritten while the write read it: fail then."""
        for leaf in self._leaves:
            if leaf.known is not None and leaf.index not in viewed:
                continue  # every file linked: nothing was read from the array
            for source in leaf.sources:
                if source.is_deleted():
                    raise RuntimeError(
                        f"the array at {keystr(leaf.path)} was deleted or donated while its "
                        "checkpoint was being written; the step is not committed. Keep it alive "
                        "until the save commits (wait_until_finished) or call save() again."
                    )

    def _remember(self, chunks: Mapping[str, FileRecord | Packed]) -> None:
        """Tell the pool where each jax leaf's chunks are now (see `StagingPool.remember`): by
        chunk path, their files (zarr layout) or their places in packs (packed layout)."""
        pool, item = self._staging  # type: ignore[misc]
        by_leaf: dict[str, dict[str, FileRecord | Packed]] = {}
        for vpath, where in chunks.items():
            by_leaf.setdefault(vpath.rpartition("/")[0], {})[vpath] = where
        pool.remember(
            item,
            {
                leaf.index: (leaf.ref, leaf.signature, by_leaf.get(f"arrays/{leaf.index}", {}))
                for leaf in self._leaves
                if leaf.ref is not None
            },
        )


def _previous_chunks(dest: Destination, process: int) -> Mapping[str, Packed]:
    """In an incremental save without what this process's last save wrote (its first save, a
    restarted process), the chunks the newest committed step's index of this process records;
    nothing where it has none (the zarr layout, a first step) or its index does not check out
    (the chunks are then written, not linked)."""
    stored = dest.previous()
    if stored is None:
        return {}
    try:
        return load_index(stored, process)
    except (CorruptCheckpointError, OSError):
        return {}


def _write_chunks(
    dest: Destination,
    jobs: list[tuple[str, np.ndarray, np.dtype]],
    max_inflight_bytes: int,
    threads: int,
    small: Sequence[tuple[str, bytes]] = (),
    slab: Slab | None = None,
    staged: Sequence[tuple[str, int, int]] = (),
    staged_until: Callable[[int], None] = lambda end: None,
) -> list[FileRecord]:
    """Write chunk files (data, then its crc32c) on a few threads; hashes and writes release the GIL.
    The `small` files (each leaf's zarr.json) go first, on the same threads: on an object store
    each is a request, which one after another would delay the chunks. Records in that order.

    The crc32c tail is zarr's codec; the record carries the XXH3-128 of the whole file, which is
    what binds the chunk to its place (a CRC over data plus its own CRC is a constant).

    `staged` chunks are in `slab` at page-aligned offsets with room for their tail: the crc32c
    and the content hash are computed together, a megabyte at a time (one pass over memory),
    the tail is put after the data, and the file goes out in one piece (O_DIRECT on disk),
    once `staged_until` says the copy into the slab got past it.
    Other pieces (`jobs`) are written straight from the snapshot's memory (no copy) unless a
    save_dtype cast is due, which allocates one chunk at a time; `max_inflight_bytes` bounds
    those casts in flight.
    """
    budget = _Tickets(max(1, max_inflight_bytes // _MiB))

    def one(relpath: str, part: np.ndarray, want: np.dtype) -> FileRecord:
        tickets = min(max(1, part.nbytes // _MiB), budget.total) if part.dtype != want else 0
        with budget.taking(tickets):
            view = memoryview(_raw(part, want))  # type: ignore[arg-type]
            tail = crc32c.crc32c(view).to_bytes(4, "little")
            return dest.write_file(relpath, [view, tail])

    def one_staged(relpath: str, at: int, nbytes: int) -> FileRecord:
        assert slab is not None
        staged_until(at + nbytes)
        file = slab.array[at : at + nbytes + 4]
        data = memoryview(file[:nbytes])  # type: ignore[arg-type]
        crc, digest = 0, xxhash.xxh3_128()
        for lo in range(0, nbytes, _MiB):  # each megabyte hashed while it is in the cache
            block = data[lo : lo + _MiB]
            crc = crc32c.crc32c(block, crc)
            digest.update(block)
        file[nbytes:] = np.frombuffer(crc.to_bytes(4, "little"), np.uint8)
        digest.update(memoryview(file[nbytes:]))  # type: ignore[arg-type]
        return dest.write_file(relpath, memoryview(file), xxh3_128=digest.hexdigest())  # type: ignore[arg-type]

    if not jobs and not small and not staged:
        return []
    with concurrent.futures.ThreadPoolExecutor(
        max_workers=threads, thread_name_prefix="cairn-write", initializer=lower_thread_priority
    ) as pool:
        first = pool.map(lambda file: dest.write_file(*file), small)  # all queued now
        rest = pool.map(lambda job: one(*job), jobs)
        from_slab = pool.map(lambda job: one_staged(*job), staged)
        return list(first) + list(rest) + list(from_slab)
