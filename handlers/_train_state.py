"""TrainStateHandler: JAX train states (pytrees of jax.Array / np.ndarray), in packs or as zarr3.

Layouts of one item (docs/format.md): the packed layout (the default, version 2; its files in
`cairn.handlers._packs`) keeps `tree.json` and puts the chunks of every leaf into a few pack
files per process, found through an index; the zarr layout (``layout="zarr"``, version 1)::

    tree.json                   structure, key paths, per leaf: shape, dtype, chunk shape, file
    arrays/<i>/zarr.json        zarr v3 metadata of leaf i (bytes + crc32c codecs, "." keys)
    arrays/<i>/<c0>.<c1>...     chunk files: the raw little-endian bytes, then their crc32c

Chunks tile each process's shards (so processes never write the same chunk) and are split along
their first axis to at most `chunk_bytes`, so large arrays write and read in parallel. The zarr
layout's files are standard zarr v3: TensorStore (or any zarr v3 reader) opens them. Restore
reads the chunks itself, each device only the chunks its slices overlap, and checks each against
its content hash (the manifest's, or the index's) before its bytes are used.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import json
import math
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import xxhash

from cairn.handlers._files import (
    Destination,
    FileRecord,
    StoredItem,
    as_destination,
    lower_thread_priority,
    parse_json,
    writing_process,
)
from cairn.handlers._optional import optional
from cairn.handlers._packs import (
    PACK_BYTES,
    Packed,
    group,
    group_staged,
    is_packed,
    load_index,
    save_token,
    staged_pack,
    write_index,
    write_pack,
)
from cairn.handlers._packs import _Pack as Pack
from cairn.handlers._packs import read_chunks as read_packed_chunks
from cairn.handlers._packs import runs as packed_runs
from cairn.handlers._staging import Lease, Slab, StagingPool, current_staging, round_up
from cairn.handlers._tree import (
    NONE,
    PRNG_IMPLS,
    TREE,
    KeyPath,
    check_leaf,
    decode,
    describe_tree,
    dtype_from_name,
    dtype_name,
    encode,
    flatten_custom,
    keystr,
    like,
    load_tree,
    unflatten_custom,
    walk_leaves,
)
from cairn.handlers.errors import CorruptCheckpointError, MismatchError

__all__ = ["LazyArray", "TrainStateHandler", "TrainStateRestore"]

KeyPathPredicate = Callable[[KeyPath], bool]
Transform = Callable[[Any, Any], Any]
_MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class TrainStateRestore:
    """Restore options for a TrainStateHandler item; pass it as the item's target.

    ``mgr.restore(items={"state": TrainStateRestore(target, restore_dtype=jnp.bfloat16)})``

    - `target`: a pytree of arrays or ``jax.ShapeDtypeStruct`` (with or without shardings) giving
      the structure, shapes, dtypes and placement of the result; None restores as saved.
    - `restore_dtype`: cast floating leaves selected by `cast` (default: every floating leaf) after
      reading (T5X casts only the params: ``cast=lambda path: path[0] == "params"``).
    - `subtree`: a key path prefix such as ``("params",)``: only that subtree is read and returned
      (the target, if any, is for that subtree).
    - `where`: a key-path predicate: only matching leaves are read; the others come back as the
      target's leaf (or None without a target).
    - `transforms`: functions ``fn(state, target) -> state`` applied in order to the restored state
      (leaves still lazy, so a transform that renames or drops keys reads nothing it drops), as
      T5X's state_transformation_fns.
    - `fallback_state`: after the transforms, leaves the checkpoint lacks are taken from here; the
      union must match the target (T5X).
    - `lazy`: return `LazyArray` leaves that read on first use (T5X's lazy_parameters).
    """

    target: Any = None
    _: dataclasses.KW_ONLY
    restore_dtype: Any = None
    cast: KeyPathPredicate | None = None
    subtree: tuple[str | int, ...] = ()
    where: KeyPathPredicate | None = None
    transforms: Sequence[Transform] = ()
    fallback_state: Any = None
    lazy: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.subtree, tuple):
            raise TypeError(
                f"TrainStateRestore: subtree must be a tuple of keys, got {self.subtree!r}"
            )
        for name in ("cast", "where"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(
                    f"TrainStateRestore: {name} must be a key-path predicate, got {value!r}"
                )
        if not all(callable(fn) for fn in self.transforms):
            raise TypeError(
                f"TrainStateRestore: transforms must be callables, got {self.transforms!r}"
            )
        if self.restore_dtype is not None:
            np.dtype(self.restore_dtype)  # raises TypeError for a bad dtype
        if not isinstance(self.lazy, bool):
            raise TypeError(f"TrainStateRestore: lazy must be a bool, got {self.lazy!r}")


class LazyArray:
    """A leaf of a restored train state that reads its data on first use (``get()``, ``np.asarray``).

    `shape` and `dtype` are known without reading. ``get()`` returns an ``np.ndarray`` (cast to the
    restore dtype, if any) and caches nothing, as T5X's LazyArray.
    """

    def __init__(self, reader: _LeafReader, dtype: np.dtype, keys: _Keys | None = None) -> None:
        self._reader = reader
        self._keys = keys
        self.shape: tuple[int, ...] = reader.shape if keys is None else keys.shape
        self.dtype: Any = dtype if keys is None else keys.dtype
        self._read_dtype = dtype  # of the stored data (uint32 key data for keys)
        self.path = reader.path

    def get(self) -> Any:
        """An ``np.ndarray``; for typed PRNG keys, a jax key array."""
        data = self._reader.read().result().astype(self._read_dtype, copy=False)
        return data if self._keys is None else self._keys.wrap(data)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        arr = self.get()
        return arr if dtype is None else arr.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"LazyArray({keystr(self.path)}, shape={self.shape}, dtype={self.dtype})"


# ---------------------------------------------------------------------------- saving


@dataclasses.dataclass
class _Leaf:
    """One array leaf as captured: the pieces to write and the arrays to watch for donation."""

    index: int
    path: KeyPath
    shape: tuple[int, ...]
    dtype: np.dtype  # as stored
    chunk: tuple[int, ...]
    pieces: list[tuple[tuple[slice, ...], np.ndarray]]  # (global region, host data)
    sources: list[Any]  # jax arrays whose buffers `pieces` view
    shared: bool  # the same on every process (host data, process-local arrays): primary writes
    owned: bool  # `pieces` are private to the snapshot (a device-to-host copy, a staged copy)
    staged: list[tuple[str, int, int]] | None = None  # (chunk key, slab offset, data bytes)
    ref: Any = None  # a weak reference to the jax array (incremental saves)
    signature: tuple[Any, ...] = ()  # what its files depend on besides its content
    known: Mapping[str, FileRecord] | None = None  # its files as a save wrote them before

    def __getstate__(self) -> dict[str, Any]:
        """What the writer process gets (``writer="process"``): the data, staged or pickled with
        the pieces, without the jax arrays and the weak reference, which stay here."""
        if self.known is not None:
            raise TypeError("an incremental snapshot cannot be sent to a writer process")
        return {**self.__dict__, "sources": [], "ref": None}


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
        handler: TrainStateHandler,
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
        """Give the staging slab back to the pool (the writer process has written it), and
        let go of every view of it: a traceback that keeps this snapshot alive (a kept commit
        error) must not keep the shared memory mapped after the manager closed."""
        self._let_go()
        self._lease, self._leaves = None, []

    def _let_go(self) -> None:
        """Give the slab back to the pool, once no copy writes into it any more."""
        if self._copying is not None:
            self._copying.wait(quiet=True)
        if self._lease is not None:
            self._lease.release()

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
        if self._staging is not None:
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
        previous = self._previous or _previous_chunks(dest, process)
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
        if self._staging is not None:
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
        for leaf in self._leaves:
            if leaf.shared and not primary:
                continue
            base = f"arrays/{leaf.index}"
            if leaf.staged is not None:
                staged.extend((f"{base}/{key}", at, n) for key, at, n in leaf.staged)
                continue
            for region, data in leaf.pieces:
                others.extend(
                    (leaf, f"{base}/{key}", part)
                    for key, part in _chunks_of(region, data, leaf.chunk)
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


_COPY_PIECE = 16 * (1 << 20)  # rows copied per task: both cores copy a large leaf
_POOLS: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _shared_pool(name: str, workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """The process's pool of `workers` threads named `name`, made on first use (copies into the
    staging pool in save(), chunk reads in restore)."""
    with _POOLS_LOCK:
        if name not in _POOLS:
            _POOLS[name] = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=name)
        return _POOLS[name]


_Placed = tuple[_Leaf, str, np.ndarray, int, int]  # leaf, chunk key, its rows, slab offset, bytes


def _unchanged(
    leaves: Sequence[_Leaf], remembered: Mapping[int, tuple[Any, ...]]
) -> Iterator[tuple[_Leaf, Mapping[str, FileRecord]]]:
    """The jax leaves that are the very arrays an earlier save of the item wrote, with the same
    signature (key path, shape, dtypes, chunks, shards), and what it wrote for them. A jax array
    never changes, so their files need not be written, nor their content copied or hashed."""
    for leaf in leaves:
        entry = remembered.get(leaf.index)
        if leaf.ref is None or entry is None:
            continue
        array = leaf.ref()
        same = array is not None and entry[0]() is array and entry[1] == leaf.signature
        if same and entry[2] and not array.is_deleted():
            yield leaf, entry[2]


def _stage_layout(
    leaves: Sequence[_Leaf], *, known: bool = False, packed: bool = False, owned: bool = False
) -> tuple[list[_Placed], int]:
    """Where `_stage` puts each chunk of the leaves that do not own their pieces (with `owned`,
    of those that do too: a writer process reads the slab, and a host copy would otherwise be
    pickled to it), and the slab bytes that takes. Unchanged arrays (`known`, incremental
    saves) keep views and are left out, unless `known` asks for them too (the size a slab is
    kept at).

    The zarr layout writes each chunk as a file of its own, with O_DIRECT: each chunk (its data
    and the 4-byte crc32c tail) from a page boundary. The packed layout writes spans of the slab
    as packs: chunks follow each other from 64-byte boundaries, and a chunk that would make a
    pack larger than `PACK_BYTES` starts the next pack, from a page boundary (see
    `group_staged`), so that small chunks do not take a page each on disk."""
    placed: list[_Placed] = []
    at = 0
    pack_start = 0
    for leaf in leaves:
        if (leaf.owned and not owned) or (leaf.known is not None and not known):
            continue
        nbytes = _size(leaf.chunk) * leaf.dtype.itemsize
        for region, data in leaf.pieces:
            for key, part in _chunk_parts(region, data, leaf.chunk):
                if packed:
                    at = round_up(at, _CHUNK_ALIGN)
                    if at > pack_start and at + nbytes - pack_start > PACK_BYTES:
                        at = pack_start = round_up(at)
                placed.append((leaf, key, part, at, nbytes))
                at += nbytes if packed else round_up(nbytes + 4)
    return placed, at


_CHUNK_ALIGN = 64  # a staged chunk of the packed layout starts on a cache line


def _stage(placed: Sequence[_Placed], lease: Lease) -> _Copying | None:
    """Copy each placed chunk into the lease's slab (cast to the stored dtype, little-endian,
    edge chunks padded with zeros); the leaves then hold their slab offsets and no longer
    reference the arrays they came from. Copies of less than `_COPY_PIECE` in all are done
    here (None); larger ones go to the copy pool's two threads, and the `_Copying` returned
    tells when each span of the slab is filled."""
    copies: list[tuple[np.ndarray, np.ndarray, int]] = []  # into, from, slab offset after
    for leaf, key, part, at, nbytes in placed:
        dst = lease.slab.array[at : at + nbytes].view(leaf.dtype).reshape(leaf.chunk)
        if not leaf.chunk:
            copies.append((dst, part.reshape(()), at + nbytes))
        else:
            rows = part.shape[0]
            row = dst[:1].nbytes
            step = max(1, _COPY_PIECE // max(1, part[:1].nbytes))
            copies.extend(
                (dst[r : r + step], part[r : r + step], at + (r + step) * row)
                if r + step < rows
                else (dst[r:rows], part[r:], at + nbytes)  # the chunk's end: padding included
                for r in range(0, rows, step)
            )
            if rows < dst.shape[0]:
                dst[rows:] = 0  # the padded edge chunk (see _choose_chunk)
        if leaf.staged is None:
            leaf.staged = []
        leaf.staged.append((key, at, nbytes))
    for leaf, *_ in placed:
        leaf.pieces, leaf.sources, leaf.owned = [], [], True
    if sum(d.nbytes for d, _, _ in copies) < _COPY_PIECE:
        for dst, src, _ in copies:
            np.copyto(dst, src, casting="unsafe")
        return None
    return _Copying(copies, lease)


class _Copying:
    """The staging copies of one snapshot, in slab order, on the copy pool's two threads. The
    snapshot returns while they run, so that its save can hand the commit over at once: the
    writes of a span of the slab wait only for the copies into it (`wait(end)`), and the
    manager's ``save()`` waits for all of them (`_StateSnapshot.settle`) before it returns, so
    the caller may donate or change its arrays from then on.

    Threads: made on the caller thread; each copy reports from a pool thread; any thread may
    wait. It holds the lease until the last copy is done, so that the slab cannot go back to
    its pool (for another save to stage into) while a copy still writes into it."""

    def __init__(self, copies: list[tuple[np.ndarray, np.ndarray, int]], lease: Lease) -> None:
        self._ends = [end for _, _, end in copies]
        self._done = [False] * len(copies)
        self._prefix = 0  # copies done, counted from the first
        self._left = len(copies)
        self._error: BaseException | None = None
        self._lease: Lease | None = lease
        self._cond = threading.Condition()
        pool = _shared_pool("cairn-copy", 2)
        started: list[concurrent.futures.Future[None]] = []
        try:
            for n, (dst, src, _) in enumerate(copies):
                started.append(pool.submit(self._copy, n, dst, src))
        except BaseException:  # e.g. at interpreter shutdown: the lease is free once they end
            concurrent.futures.wait(started)
            raise

    def _copy(self, n: int, dst: np.ndarray, src: np.ndarray) -> None:
        error = None
        try:
            np.copyto(dst, src, casting="unsafe")
        except BaseException as e:  # kept for the waiters: the pool's thread carries on
            error = e
        with self._cond:
            self._error = self._error or error
            self._done[n] = True
            while self._prefix < len(self._done) and self._done[self._prefix]:
                self._prefix += 1
            self._left -= 1
            if not self._left:
                self._lease = None
            self._cond.notify_all()

    def _copied(self, end: int | None) -> bool:
        if not self._left:
            return True
        return end is not None and self._prefix > 0 and self._ends[self._prefix - 1] >= end

    def wait(self, end: int | None = None, *, quiet: bool = False) -> None:
        """Until every copy into the slab before offset `end` (all, without it) is done. A failed
        copy raises then, whichever span it was in (once the others have ended), unless
        `quiet`."""
        with self._cond:
            self._cond.wait_for(lambda: self._copied(end) or self._error is not None)
            if self._error is None:
                return
            self._cond.wait_for(lambda: not self._left)
            if not quiet:
                raise RuntimeError(
                    f"copying the train state into staging memory failed: {self._error!r}"
                ) from self._error


def _zarr_metadata(
    shape: tuple[int, ...], dtype: np.dtype, chunk: tuple[int, ...]
) -> dict[str, Any]:
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": _zarr_dtype(dtype),
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk)}},
        "chunk_key_encoding": {"name": "v2", "configuration": {"separator": "."}},
        "fill_value": _zarr_fill(dtype),
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
    }


def _zarr_dtype(dtype: np.dtype) -> str:
    if dtype.kind == "b":
        return "bool"
    return dtype.name  # int8..uint64, float16..float64, complex64/128, bfloat16, float8_*


def _zarr_fill(dtype: np.dtype) -> Any:
    if dtype.kind == "b":
        return False
    if dtype.kind == "c":
        return [0.0, 0.0]
    if dtype.kind in "iu":
        return 0
    return 0.0


def _choose_chunk(
    region_shape: tuple[int, ...], itemsize: int, chunk_bytes: int, *, whole_rows: bool
) -> tuple[int, ...]:
    """The piece's own shape, split along axis 0 into parts of at most `chunk_bytes`.

    Parts are equal (a divisor of the rows) so chunks never straddle two processes' shards. When
    the piece spans the whole first axis (`whole_rows`) and no divisor is near the bound (a prime
    row count, say), chunks of the bound are used and the last one is padded, as zarr requires.
    """
    if not region_shape:
        return ()
    rows = region_shape[0]
    row_bytes = max(1, itemsize * math.prod(region_shape[1:]))
    if rows <= 1 or rows * row_bytes <= chunk_bytes:
        return tuple(max(1, n) for n in region_shape)
    cap = max(1, chunk_bytes // row_bytes)
    best = max(d for d in _divisors(rows) if d <= cap)
    if whole_rows and best * 4 < cap:
        best = cap
    return (best, *(max(1, n) for n in region_shape[1:]))


def _divisors(n: int) -> Iterator[int]:
    i = 1
    while i * i <= n:
        if n % i == 0:
            yield i
            yield n // i
        i += 1


def _chunk_parts(
    region: tuple[slice, ...], data: np.ndarray, chunk: tuple[int, ...]
) -> Iterator[tuple[str, np.ndarray]]:
    """(chunk key, view of its rows of `data`) for each chunk of a piece that starts on a chunk
    boundary; the last part may have fewer rows than the chunk (see _choose_chunk)."""
    if not chunk:
        yield "0", data.reshape(())
        return
    if data.size == 0:  # nothing to store: zarr reads absent chunks as the fill value
        return
    origin = [s.start or 0 for s in region]
    step = chunk[0]
    for r0 in range(0, data.shape[0], step):
        coords = [
            (origin[0] + r0) // step,
            *(o // c for o, c in zip(origin[1:], chunk[1:], strict=True)),
        ]
        yield ".".join(map(str, coords)), data[r0 : r0 + step]


def _chunks_of(
    region: tuple[slice, ...], data: np.ndarray, chunk: tuple[int, ...]
) -> Iterator[tuple[str, np.ndarray]]:
    """(chunk key, contiguous data) for each chunk of a piece, the edge chunk padded."""
    for key, part in _chunk_parts(region, data, chunk):
        if chunk and part.shape[0] < chunk[0]:  # the padded edge chunk (see _choose_chunk)
            padded = np.zeros((chunk[0], *part.shape[1:]), part.dtype)
            padded[: part.shape[0]] = part
            part = padded
        yield key, part


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


def _raw(part: np.ndarray, want: np.dtype) -> np.ndarray:
    """A chunk's bytes as stored: cast to `want` if it differs, contiguous, as uint8."""
    data = part.astype(want) if part.dtype != want else part
    return np.ascontiguousarray(data).reshape(-1).view(np.uint8)  # ml_dtypes lack buffers


_CAST_PIECE = 4 * _MiB  # of a view cast to be hashed (an incremental save with save_dtype)


def _cast_digest(part: np.ndarray, want: np.dtype) -> str:
    """The content hash of `part` as stored (cast to `want`), cast `_CAST_PIECE` bytes of rows
    at a time: no cast copy of the whole chunk is held."""
    if not part.ndim:
        return xxhash.xxh3_128_hexdigest(memoryview(_raw(part, want)))  # type: ignore[arg-type]
    row = max(1, part[:1].size * max(part.dtype.itemsize, want.itemsize))
    rows = max(1, _CAST_PIECE // row)
    hashed = xxhash.xxh3_128()
    for at in range(0, part.shape[0], rows):
        hashed.update(memoryview(_raw(part[at : at + rows], want)))  # type: ignore[arg-type]
    return hashed.hexdigest()


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


class _Tickets:
    """A count of megabytes that casts in flight may take (`max_inflight_bytes`); a writer takes
    all it needs at once or waits, so two writers never each hold part and wait for the rest.

    Threads: `taking` may be entered from any number of threads at once."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._free = total
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def taking(self, n: int) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: self._free >= n)
            self._free -= n
        try:
            yield
        finally:
            with self._cond:
                self._free += n
                self._cond.notify_all()


class TrainStateHandler:
    """Saves and restores a training state: any JAX pytree of arrays and scalars, in packs
    (`layout="packed"`, the default) or as zarr3 arrays (`layout="zarr"`).

    What is copied when (the snapshot, inside ``save()``):

    - Inside a manager's ``save()`` whose staging pool has room (every save of a state but the
      first, unless ``zero_copy=True``): every leaf, ``jax.Array`` shards (those with
      ``replica_id == 0``) and NumPy arrays alike, is copied chunk by chunk into the pool's
      page-aligned memory, cast to its stored dtype, on two threads, which may still run when
      `snapshot` returns: the manager's ``save()`` hands the commit over, then waits for them
      (`_StateSnapshot.settle`). The snapshot then holds no reference to the arrays: the next
      train step donates them as usual.
    - Otherwise, ``jax.Array`` leaves are *not* copied on CPU: the snapshot keeps zero-copy host
      views of the addressable shards with ``replica_id == 0``. While such a view exists, JAX
      will not donate the buffer (a donating train step gets fresh buffers instead, silently,
      using more memory until the commit ends), so the checkpoint holds the values at save time.
      As a second line, the write phase fails the commit if a source array was deleted or
      donated meanwhile.
    - On GPU/TPU the snapshot is each shard's device-to-host copy (`_start_transfer`: into
      pinned host memory on GPU), all started before the first is waited for, and kept as it
      is, not staged; with a writer process (a pool of shared slabs), staged all the same, so
      that the job sent to it holds the slab's descriptor, not pickled arrays.
    - ``np.ndarray`` leaves (and other array-likes) are copied, since the caller may change
      them in place; NumPy and Python scalars and the structure are captured as values.

    Write phase (commit thread): packs (or chunk files) are written by `threads` threads at low
    CPU and I/O priority. Staged chunks are hashed as they go out (16 MiB at a time in a pack, a
    megabyte in a zarr chunk file) and written with O_DIRECT where the filesystem allows (a
    pack: spans of the pool's memory); views are written from the arrays' memory, no copy
    unless `save_dtype` casts a leaf, within `max_inflight_bytes` (a pack's casts at once).

    Options: `save_dtype` casts the floating leaves selected by `save_dtype_where` (a key-path
    predicate; default all floating leaves; T5X casts only ``params``) when writing; `chunk_bytes`
    bounds a chunk file. Restore options come through `TrainStateRestore`.
    """

    id = "cairn.train_state"
    version = 2  # what this cairn reads: 1 (the zarr layout) and 2 (the packed layout)

    def __init__(
        self,
        *,
        save_dtype: Any = None,
        save_dtype_where: KeyPathPredicate | None = None,
        chunk_bytes: int = 64 * _MiB,
        max_inflight_bytes: int = 256 * _MiB,
        threads: int | None = None,
        layout: str = "packed",
    ) -> None:
        if layout not in ("zarr", "packed"):
            raise ValueError(
                f"TrainStateHandler: layout must be 'zarr' or 'packed', got {layout!r}"
            )
        self.layout = layout
        self.save_dtype = None if save_dtype is None else np.dtype(save_dtype)
        if save_dtype_where is not None and not callable(save_dtype_where):
            raise TypeError(
                f"save_dtype_where must be a key-path predicate, got {save_dtype_where!r}"
            )
        self.save_dtype_where = save_dtype_where
        for name, value, low in (
            ("chunk_bytes", chunk_bytes, 1),
            ("max_inflight_bytes", max_inflight_bytes, _MiB),
            ("threads", 1 if threads is None else threads, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(
                    f"TrainStateHandler: {name} must be an int >= {low}, got {value!r}"
                )
        self.chunk_bytes = chunk_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.threads = threads

    def __repr__(self) -> str:
        cast = f"save_dtype={self.save_dtype}, " if self.save_dtype is not None else ""
        zarr = ", layout='zarr'" if self.layout == "zarr" else ""
        return f"TrainStateHandler({cast}chunk_bytes={self.chunk_bytes}{zarr})"

    # -------------------------------------------------------------- snapshot (caller thread)

    def snapshot(self, obj: Any) -> _StateSnapshot:
        leaves: list[_Leaf] = []
        jax = sys.modules.get("jax")
        jax_array = jax.Array if jax is not None else ()

        transfers: list[tuple[list[Any], int, Any, Any]] = []  # pieces, at, coming, shard data

        def leaf(x: Any, path: KeyPath) -> dict[str, Any]:
            if isinstance(x, jax_array) and _Keys.of(x.dtype):  # typed PRNG keys: their data
                impl = _Keys.impl_of(x, path)
                return {**leaf(jax.random.key_data(x), path), "prng": impl}  # type: ignore[union-attr]
            index = len(leaves)
            if isinstance(x, jax_array):
                shape, src_dtype = tuple(x.shape), _storable(np.dtype(x.dtype), path)
                pieces: list[tuple[tuple[slice, ...], np.ndarray]] = []
                zero_copy = False
                for shard in x.addressable_shards:
                    if shard.replica_id != 0:
                        continue
                    region = _full_index(shard.index, shape)
                    coming = _start_transfer(shard.data)
                    if coming is not None:  # on an accelerator: copied to the host below
                        transfers.append((pieces, len(pieces), coming, shard.data))
                        pieces.append((region, _COMING))
                        continue
                    view = np.asarray(shard.data)
                    zero_copy |= _shares_buffer(view, shard.data)
                    pieces.append((region, view))
                region_shape = tuple(sl.stop - sl.start for sl in pieces[0][0]) if pieces else shape
                sources = [x] if zero_copy else []  # only views need the donation check
                shared = bool(x.is_fully_addressable)  # not a global array: every process has it
                owned = not zero_copy  # a device-to-host copy (GPU, TPU, int4) is ours already
                kind = "jax"
            else:
                arr = np.asarray(x)  # copied below: staged, or np.array
                src_dtype = _storable(arr.dtype, path)
                shape, region_shape = arr.shape, arr.shape
                pieces = [(tuple(slice(0, n) for n in shape), arr)]
                sources = []
                shared = True
                owned = False  # the caller's own array: copied before save() returns
                kind = "npscalar" if isinstance(x, np.generic) else "numpy"
            src_dtype = src_dtype.newbyteorder("<") if src_dtype.byteorder == ">" else src_dtype
            dtype = self._stored_dtype(path, src_dtype)
            whole_rows = bool(shape) and region_shape[:1] == shape[:1]
            chunk = _choose_chunk(
                region_shape, dtype.itemsize, self.chunk_bytes, whole_rows=whole_rows
            )
            leaves.append(_Leaf(index, path, shape, dtype, chunk, pieces, sources, shared, owned))
            if kind == "jax":
                leaves[-1].ref = weakref.ref(x)
                regions = tuple(tuple((sl.start, sl.stop) for sl in r) for r, _ in pieces)
                leaves[-1].signature = (
                    path,
                    shape,
                    dtype.str,
                    src_dtype.str,
                    chunk,
                    regions,
                    self.layout,
                )
            node = {
                "t": "npscalar" if kind == "npscalar" else "array",
                "kind": kind,
                "f": f"arrays/{index}",
                "shape": list(shape),
                "dtype": dtype_name(dtype),
                "chunk": list(chunk),
            }
            if dtype != src_dtype:
                node["saved_from"] = dtype_name(src_dtype)
            return node

        tree = encode(obj, leaf, pytrees=True)
        for pieces, at, coming, data in transfers:  # every transfer started: wait for each
            try:
                host = np.asarray(coming)
            except Exception:  # a pinned copy NumPy cannot take here: the plain copy, as before
                if coming is data:
                    raise
                host = np.asarray(data)
            if _shares_buffer(host, data):  # the state's own buffer: never keep it as ours
                host = host.copy()
            pieces[at] = (pieces[at][0], host)
        staging = current_staging()
        lease = None
        if staging is not None and staging[0].remembers:  # incremental: unchanged arrays
            for kept, files in _unchanged(leaves, staging[0].recall(staging[1])):
                kept.known = files  # linked at write time, or written from these views
        if staging is not None:  # inside a manager's save(): its pool, if it has room
            # Nothing to view (NumPy leaves only): they are copied anyway, so into a slab now.
            copies_anyway = not any(kept.sources for kept in leaves)
            packed, shared = self.layout == "packed", staging[0].shared
            placed, size = _stage_layout(leaves, packed=packed, owned=shared)
            if any(kept.known is not None for kept in leaves):
                # A slab for the whole state all the same: the next save may change every leaf,
                # and a pool that shrank would fault a new one in then.
                size = _stage_layout(leaves, known=True, packed=packed, owned=shared)[1]
            lease = staging[0].lease(staging[1], size, now=copies_anyway)
        copying = None
        if lease is not None:
            try:
                copying = _stage(placed, lease)
            except BaseException:
                lease.release()
                raise
        for kept in leaves:  # not staged: keep views of jax arrays (see the class docstring)
            if kept.staged is None:
                kept.pieces = [(r, _private(d, kept)) for r, d in kept.pieces]
        previous = None
        if staging is not None and staging[0].remembers and self.layout == "packed":
            previous = staging[0].recall_chunks(staging[1])
        return _StateSnapshot(self, tree, leaves, lease, staging, previous, copying)

    def _stored_dtype(self, path: KeyPath, dtype: np.dtype) -> np.dtype:
        if self.save_dtype is None or not _is_float(dtype):
            return dtype
        if self.save_dtype_where is not None and not self.save_dtype_where(path):
            return dtype
        return self.save_dtype

    # -------------------------------------------------------------- restore (caller thread)

    def restore(self, stored: StoredItem, target: Any = None) -> Any:
        opts = target if isinstance(target, TrainStateRestore) else TrainStateRestore(target)
        tree = load_tree(stored)
        index = load_index(stored) if is_packed(stored) else None
        for key in opts.subtree:
            tree = _subtree(tree, key, opts.subtree)
        prefix = opts.subtree

        def lazy_leaf(node: Mapping[str, Any], target_leaf: Any, path: KeyPath) -> Any:
            full = (*prefix, *path)
            reader = _LeafReader(stored, node, full, index)
            dtype = reader.dtype
            if "prng" in node:  # typed PRNG keys, stored as their key data
                keys = _Keys(node["prng"], reader.shape, full, stored)
                keys.check(target_leaf, path)
                if opts.where is not None and not opts.where(full):
                    return None if target_leaf is NONE else target_leaf
                return LazyArray(reader, dtype, keys)
            saved_from = dtype_from_name(node["saved_from"]) if "saved_from" in node else None
            recast = opts.restore_dtype is not None and _is_float(dtype)
            if recast and (opts.cast is None or opts.cast(full)):
                dtype = np.dtype(opts.restore_dtype)  # the target's dtype is not checked then
                check_leaf(node, target_leaf, path, dtype=None, check_dtype=False)
            else:
                target_dtype = getattr(target_leaf, "dtype", None)  # np.dtype(None) is float64:
                if (
                    saved_from is not None
                    and target_dtype is not None
                    and target_dtype == saved_from
                ):
                    dtype = saved_from  # undo the save_dtype cast
                check_leaf(node, target_leaf, path, dtype=dtype)
            if opts.where is not None and not opts.where(full):
                return None if target_leaf is NONE else target_leaf
            return LazyArray(reader, dtype) if node["t"] == "array" else _Scalar(reader, dtype)

        simple = not opts.transforms and opts.fallback_state is None
        state = decode(tree, lazy_leaf, NONE if opts.target is None or not simple else opts.target)
        for fn in opts.transforms:
            state = fn(state, opts.target)
        if opts.fallback_state is not None:
            state = _fill_from(state, opts.fallback_state, opts.target)
        if not simple and opts.target is not None:
            state = _align(state, opts.target, ())
        if opts.lazy:
            return _map_with_target(
                state, None, lambda x, _: x.get() if isinstance(x, _Scalar) else x
            )
        return _materialize(state, opts.target)

    def describe(self, stored: StoredItem) -> dict[str, Any]:
        return describe_tree(stored, "train-state")

    def check(self, stored: StoredItem) -> None:
        """What a restore of every leaf checks before it allocates anything: ``tree.json`` node
        by node, each leaf's chunks listed (with its ``zarr.json``) or indexed, at their exact
        sizes, the data of typed PRNG keys; CorruptCheckpointError naming the file otherwise.
        ``verify`` calls it after checking every file's content, so a step it calls intact is
        one a restore takes."""
        index = load_index(stored) if is_packed(stored) else None
        for path, node in walk_leaves(load_tree(stored)):
            if node["t"] in ("array", "npscalar"):
                reader = _LeafReader(stored, node, path, index)
                if "prng" in node:
                    _Keys(node["prng"], reader.shape, path, stored)
                reader.check()


def _storable(dtype: np.dtype, path: KeyPath) -> np.dtype:
    """Booleans, integers, floats (ml_dtypes included) and complex numbers; TypeError otherwise."""
    if dtype.kind in "biufc" or dtype_name(dtype) != dtype.str:
        return dtype
    raise TypeError(
        f"array at {keystr(path)} has dtype {dtype}, which cannot be stored in a train state "
        "(numbers and booleans only)"
    )


def _private(data: np.ndarray, leaf: _Leaf) -> np.ndarray:
    """`data` as an unstaged snapshot keeps it: little-endian, and a copy unless it is a jax
    array's buffer (kept as a view and checked at write time) or already the snapshot's own."""
    if data.dtype.byteorder == ">":
        return data.astype(data.dtype.newbyteorder("<"))
    return data if leaf.owned or leaf.sources else np.array(data, copy=True)


_COMING = np.empty(0)  # a piece whose device-to-host copy is still running
_PINNED_PLATFORMS = ("gpu",)  # pinned host memory as the target; TPU's is scarce (Orbax's rule)
_HOST_PLATFORMS = ("cpu",)  # whose buffers NumPy views in place


def _start_transfer(data: Any) -> Any:
    """For a single-device array on an accelerator, start its device-to-host copy and return
    what `np.asarray` then waits for: a copy in pinned host memory where the platform is one of
    `_PINNED_PLATFORMS` and its device has that memory kind (``jax.device_put`` to it), else
    `data` itself after ``copy_to_host_async``. None for a host (CPU) array: it is viewed in
    place. The snapshot waits for every copy before ``save()`` returns, so a donation after it
    cannot race them.

    Started for every shard of the state before the first is waited for, the copies overlap
    instead of running one after the other as ``np.asarray`` alone would have them."""
    device = getattr(data, "device", None)
    if device is None or device.platform in _HOST_PLATFORMS or data.is_deleted():
        return None
    platform = device.platform
    if platform in _PINNED_PLATFORMS:
        with contextlib.suppress(Exception):  # no such memory kind here: the plain copy
            if any(m.kind == "pinned_host" for m in device.addressable_memories()):
                jax = optional("jax", feature="a JAX train state")
                sharding = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
                return jax.device_put(data, sharding)
    data.copy_to_host_async()
    return data


def _shares_buffer(view: np.ndarray, device_array: Any) -> bool:
    """Whether `view` is the device buffer itself (CPU), rather than a host copy (GPU/TPU, int4)."""
    try:
        return bool(view.size) and view.ctypes.data == device_array.unsafe_buffer_pointer()
    except Exception:  # no pointer to compare: assume a view, so the donation check stays on
        return True


def _full_index(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(
        slice(s.start or 0, n if s.stop is None else s.stop)
        for s, n in zip(index, shape, strict=True)
    )


def _is_float(dtype: np.dtype) -> bool:
    """NumPy floats and the ml_dtypes ones (bfloat16, float8_*, ...), which NumPy files as void."""
    return dtype.kind == "f" or (dtype.kind == "V" and dtype.name.startswith(("bfloat", "float")))


def _subtree(tree: Mapping[str, Any], key: str | int, whole: tuple[str | int, ...]) -> Any:
    if tree["t"] in ("dict", "namedtuple", "custom") and key in tree["k"]:
        return tree["c"][tree["k"].index(key)]
    if tree["t"] in ("list", "tuple") and isinstance(key, int) and 0 <= key < len(tree["c"]):
        return tree["c"][key]
    raise MismatchError(f"subtree {keystr(whole)}: the checkpoint has no key {key!r} there")


# ---------------------------------------------------------------------------- reading


class _LeafReader:
    """Reads one stored leaf, whole or by slices, from its chunk files.

    Nothing is allocated before the leaf's metadata is checked against the files (`check`):
    ``zarr.json`` must be what this layout writes for the shape, dtype and chunk shape in
    ``tree.json``, and every chunk of the grid must be listed in the manifest at its exact size,
    so an array is never larger than the files that hold it. Each chunk file read is checked
    against its manifest record: its content hash (format 2), which binds the bytes to this
    leaf and chunk, or its crc32c tail (format 1, the zarr codec's check only).

    A region made of whole chunks (the usual case: restoring without a sharding, or with the one
    it was saved with) is read straight into a 64-byte aligned buffer, which JAX adopts without
    a copy on CPU; any other region reads each overlapping chunk whole and copies the overlap.
    """

    def __init__(
        self,
        stored: StoredItem,
        node: Mapping[str, Any],
        path: KeyPath,
        index: Mapping[str, Packed] | None = None,
    ) -> None:
        self.stored, self.node, self.path, self.index = stored, node, path, index
        self.shape = tuple(node["shape"])
        self.dtype = dtype_from_name(node["dtype"])
        self.chunk = tuple(node.get("chunk") or ())
        self._checked = False

    def describe(self, relpath: str) -> str:
        return f"{self.stored.describe_file(relpath)} (leaf {keystr(self.path)})"

    def describe_chunk(self, vpath: str, pack: str | None = None) -> str:
        """A chunk of the packed layout, for messages: in its pack file, or in the item."""
        where = self.stored.describe_file(pack) if pack else self.stored._where()[:-2]
        return f"{where}, chunk {vpath} (leaf {keystr(self.path)})"

    def check(self) -> None:
        """Check the leaf's metadata and files (once; before anything is allocated)."""
        if self._checked:
            return
        base = self.node["f"]
        if len(self.chunk) != len(self.shape):
            raise CorruptCheckpointError(
                f"{self.describe(TREE)}: tree.json gives no chunk shape of rank {len(self.shape)}"
            )
        if self.index is not None:
            self._check_packed(base)
            return
        where = self.describe(f"{base}/zarr.json")
        meta = parse_json(self.stored.read_bytes(f"{base}/zarr.json"), where)
        if meta != _zarr_metadata(self.shape, self.dtype, self.chunk):
            raise CorruptCheckpointError(
                f"{where} does not describe the leaf tree.json records (shape {list(self.shape)}, "
                f"dtype {dtype_name(self.dtype)}, chunk {list(self.chunk)})"
            )
        if _size(self.shape):
            grid = [-(-n // c) for n, c in zip(self.shape, self.chunk, strict=True)]
            size = _size(self.chunk) * self.dtype.itemsize + 4
            if _size(grid) > len(self.stored.files):
                raise CorruptCheckpointError(
                    f"{where}: the leaf has {_size(grid)} chunks, the manifest lists "
                    f"{len(self.stored.files)} files for the item"
                )
            for coords in itertools.product(*map(range, grid)):
                relpath = f"{base}/{'.'.join(map(str, coords)) or '0'}"
                record = self.stored.files.get(relpath)
                if record is None or record.size != size:
                    got = "not listed" if record is None else f"listed with {record.size} bytes"
                    raise CorruptCheckpointError(
                        f"{self.describe(relpath)} is {got} in the manifest; the leaf needs it "
                        f"with {size} bytes"
                    )
        self.stored.check_files(f"{base}/")  # present, regular, not links, at those sizes
        self._checked = True

    def _check_packed(self, base: str) -> None:
        """The packed layout: every chunk of the grid in the index, at its exact size (the index
        entries themselves were checked against the manifest by `load_index`)."""
        assert self.index is not None
        if _size(self.shape):
            grid = [-(-n // c) for n, c in zip(self.shape, self.chunk, strict=True)]
            size = _size(self.chunk) * self.dtype.itemsize
            if _size(grid) > len(self.index):
                raise CorruptCheckpointError(
                    f"{self.describe_chunk(base)}: the leaf has {_size(grid)} chunks, the index lists "
                    f"{len(self.index)} for the item"
                )
            for coords in itertools.product(*map(range, grid)):
                vpath = f"{base}/{'.'.join(map(str, coords)) or '0'}"
                where = self.index.get(vpath)
                if where is None or where.nbytes != size:
                    got = "not indexed" if where is None else f"indexed with {where.nbytes} bytes"
                    raise CorruptCheckpointError(
                        f"{self.describe_chunk(vpath)} is {got}; the leaf needs {size} bytes"
                    )
        self.stored.check_files("packs/")  # present, regular, not links, at those sizes
        self._checked = True

    def read(self, index: tuple[slice, ...] = (), batch: _Batch | None = None) -> _Read:
        """A future of the data in `index` (whole leaf by default), as np.ndarray; with `batch`,
        the chunks it can read with others wait for ``batch.start()``."""
        self.check()
        region = index or tuple(slice(0, n) for n in self.shape)
        return _Read(self, region, batch)

    def vpath(self, coords: tuple[int, ...]) -> str:
        """The chunk at grid `coords`: its file (zarr layout) or its index entry (packed)."""
        return f"{self.node['f']}/{'.'.join(map(str, coords)) or '0'}"

    def read_chunk(self, coords: tuple[int, ...], dest: np.ndarray) -> None:
        """Read the chunk at grid `coords` into `dest` (C-contiguous, the chunk's full shape) and
        check it against the manifest; CorruptCheckpointError naming the file otherwise."""
        relpath = self.vpath(coords)
        data = memoryview(dest.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
        if self.index is not None:
            where = self.index[relpath]
            describe = functools.partial(self.describe_chunk, relpath, where.pack)
            read_packed_chunks(self.stored, [(where, data, describe)])
            return
        record = self.stored.files[relpath]
        tail = bytearray(4)
        self.stored.read_into(relpath, [data, memoryview(tail)])
        if record.xxh3_128 is not None:
            digest = xxhash.xxh3_128(data)
            digest.update(tail)
            if digest.hexdigest() != record.xxh3_128:
                raise CorruptCheckpointError(
                    f"{self.describe(relpath)} is not the chunk the manifest records "
                    "(its content hash differs)"
                )
        elif crc32c.crc32c(data) != int.from_bytes(tail, "little"):
            raise CorruptCheckpointError(f"{self.describe(relpath)} fails its crc32c check")


def _size(shape: Sequence[int]) -> int:
    return math.prod(int(n) for n in shape)


def _read_pool() -> concurrent.futures.ThreadPoolExecutor:
    return _shared_pool("cairn-read", 4)


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype, align: int = 64) -> np.ndarray:
    """An uninitialised array whose data starts on an `align`-byte boundary (JAX adopts it as is)."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start : start + nbytes].view(dtype).reshape(shape)


class _Read:
    """One region of a leaf being read on the read pool: a chunk per task, or with a `_Batch`,
    the chunks of the packed layout that land whole in the result in the batch's reads."""

    def __init__(
        self, reader: _LeafReader, region: tuple[slice, ...], batch: _Batch | None
    ) -> None:
        self._reader = reader
        self._region = region
        self._out = _aligned_empty(tuple(sl.stop - sl.start for sl in region), reader.dtype)
        self._futures: list[concurrent.futures.Future[None]] = []
        if not self._out.size:
            return
        spans = [
            range(sl.start // c, -(-sl.stop // c))
            for sl, c in zip(region, reader.chunk, strict=True)
        ]
        for coords in itertools.product(*spans):
            dest, inner = self._place(coords)
            if batch is not None and reader.index is not None and inner is None:
                batch.add(self, coords, dest)
            else:
                self._futures.append(_read_pool().submit(self._one, coords))

    def _place(self, coords: tuple[int, ...]) -> tuple[np.ndarray, tuple[slice, ...] | None]:
        """Where the chunk at `coords` goes in the result, and which part of it goes there (None:
        all of it, a C-contiguous destination it is read into straight)."""
        reader, region = self._reader, self._region
        lo = [k * c for k, c in zip(coords, reader.chunk, strict=True)]
        # The overlap of this chunk with the region, in chunk and in output coordinates.
        inner = tuple(
            slice(max(sl.start, a) - a, min(sl.stop, a + c) - a)
            for sl, a, c in zip(region, lo, reader.chunk, strict=True)
        )
        outer = tuple(
            slice(a + i.start - sl.start, a + i.stop - sl.start)
            for sl, a, i in zip(region, lo, inner, strict=True)
        )
        whole = all(i.start == 0 and i.stop == c for i, c in zip(inner, reader.chunk, strict=True))
        dest = self._out[outer] if reader.shape else self._out.reshape(1)
        return dest, None if whole and dest.flags.c_contiguous else inner

    def _one(self, coords: tuple[int, ...]) -> None:
        reader = self._reader
        dest, inner = self._place(coords)
        if inner is None:
            reader.read_chunk(coords, dest)  # straight into the result
            return
        buffer = np.empty(reader.chunk, reader.dtype)
        reader.read_chunk(coords, buffer)
        dest[...] = buffer[inner]

    def result(self) -> np.ndarray:
        for future in self._futures:
            future.result()
        return self._out


class _Batch:
    """Chunks of the packed layout that reads of one restore want whole, read together: the
    chunks of a pack that lie close are read with one call, then checked one by one
    (`packed_runs`). A restore of a state of many small leaves then costs a few reads, not a
    task, an open and a read (a request, on an object store) per chunk.

    Filled on the calling thread, then `start`ed once: a `_Read` of the batch waits for the
    reads of the runs that hold its chunks."""

    def __init__(self) -> None:
        # Per item read (one, from `_materialize`): its chunks, and what goes with each.
        self._parts: dict[
            int, list[tuple[Packed, tuple[_Read, memoryview, Callable[[], str]]]]
        ] = {}

    def add(self, read: _Read, coords: tuple[int, ...], dest: np.ndarray) -> None:
        reader = read._reader
        assert reader.index is not None
        vpath = reader.vpath(coords)
        packed = reader.index[vpath]
        view = memoryview(dest.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
        describe = functools.partial(reader.describe_chunk, vpath, packed.pack)
        self._parts.setdefault(id(reader.stored), []).append((packed, (read, view, describe)))

    def start(self) -> None:
        for parts in self._parts.values():
            stored = parts[0][1][0]._reader.stored
            for run in packed_runs(parts):
                future = _read_pool().submit(
                    read_packed_chunks, stored, [(p, view, what) for p, (_, view, what) in run]
                )
                for read in {id(r): r for _, (r, _, _) in run}.values():
                    read._futures.append(future)
        self._parts = {}


class _Scalar:
    """A NumPy scalar leaf, read like an array and returned as a scalar."""

    def __init__(self, reader: _LeafReader, dtype: np.dtype) -> None:
        self.reader, self.dtype = reader, dtype
        self.shape = reader.shape

    def get(self) -> Any:
        return self.reader.read().result().astype(self.dtype, copy=False)[()]


def _is_lazy(x: Any) -> bool:
    return isinstance(x, (LazyArray, _Scalar))


def _map_with_target(
    tree: Any, target: Any, fn: Callable[[Any, Any], Any], is_leaf: Callable[[Any], bool] = _is_lazy
) -> Any:
    """Map `fn(leaf, target_leaf)` over the leaves of `tree`, walking `target` alongside (or None)."""
    if is_leaf(tree):
        return fn(tree, target)
    if isinstance(tree, Mapping):
        return like(
            tree, {k: _map_with_target(v, _child(target, k), fn, is_leaf) for k, v in tree.items()}
        )
    if isinstance(tree, (list, tuple)):
        values = [_map_with_target(v, _child(target, i), fn, is_leaf) for i, v in enumerate(tree)]
        if isinstance(tree, list):
            return values
        return type(tree)(*values) if hasattr(tree, "_fields") else tuple(values)
    keyed = flatten_custom(tree)
    if keyed is not None:
        return unflatten_custom(
            tree, [_map_with_target(v, _child(target, k), fn, is_leaf) for k, v in keyed]
        )
    return tree


def _child(target: Any, key: str | int) -> Any:
    if target is None:
        return None
    if isinstance(target, Mapping):
        return target.get(key)
    if isinstance(target, (list, tuple)) and isinstance(key, int):
        return target[key] if key < len(target) else None
    return getattr(target, key, None) if isinstance(key, str) else None


def _materialize(state: Any, target: Any) -> Any:
    """Read every lazy leaf: check every leaf's metadata first, then start all reads, then wait.
    The checks run on the read pool where each is a request (the zarr layout's ``zarr.json`` on
    an object store), on this thread otherwise: a task each would cost more than the check."""
    readers: list[_LeafReader] = []
    _map_with_target(
        state,
        None,
        lambda leaf, _: readers.append(
            leaf._reader if isinstance(leaf, LazyArray) else leaf.reader
        ),
    )
    remote = []
    for reader in readers:
        if reader.index is None and not reader.stored.source.cheap_size:
            remote.append(reader)
        else:
            reader.check()
    for _ in _read_pool().map(_LeafReader.check, remote):
        pass
    batch = _Batch()
    started = _map_with_target(state, target, lambda leaf, t: _start_read(leaf, t, batch))
    batch.start()
    return _map_with_target(started, None, lambda finish, _: finish(), is_leaf=callable)


def _start_read(leaf: Any, target: Any, batch: _Batch) -> Callable[[], Any]:
    """Start reading `leaf` for `target` (or add its chunks to `batch`); the returned function
    waits and assembles."""
    if isinstance(leaf, _Scalar):
        future = leaf.reader.read(batch=batch)
        return lambda: future.result().astype(leaf.dtype, copy=False)[()]
    reader, dtype, keys = leaf._reader, leaf._read_dtype, leaf._keys
    wrap = keys.wrap if keys is not None else lambda data: data
    sharding = getattr(target, "sharding", None)
    if sharding is not None and "jax" in sys.modules:
        jax = optional("jax", feature="a JAX train state")

        # Keys' data has the keys' shape and more: a sharding of the keys shards it alike.
        index_map = sharding.addressable_devices_indices_map(reader.shape)
        futures = {
            d: reader.read(_full_index(idx, reader.shape) if idx else (), batch)
            for d, idx in index_map.items()
        }

        def assemble() -> Any:
            arrays = [
                jax.device_put(f.result().astype(dtype, copy=False), d) for d, f in futures.items()
            ]
            return wrap(jax.make_array_from_single_device_arrays(reader.shape, sharding, arrays))

        return assemble
    future = reader.read(batch=batch)
    jax_module = sys.modules.get("jax")
    if target is None:
        as_jax = reader.node.get("kind") == "jax"
    else:
        as_jax = jax_module is not None and isinstance(
            target, (jax_module.Array, jax_module.ShapeDtypeStruct)
        )

    def finish() -> Any:
        arr = future.result().astype(dtype, copy=False)
        if keys is not None:
            return keys.wrap(arr)
        if as_jax:
            jax = optional("jax", feature="a JAX train state")

            return jax.device_put(arr)
        return arr

    return finish


class _Keys:
    """Typed PRNG keys (``jax.random.key``) as a train state stores them: their key data (uint32,
    the keys' shape and the implementation's own trailing dimensions) in an array leaf whose
    ``tree.json`` node names the implementation (``"prng"``, `PRNG_IMPLS`); restored as keys
    of that implementation again (``jax.random.wrap_key_data``)."""

    def __init__(self, impl: str, data_shape: tuple[int, ...], path: KeyPath, stored: StoredItem):
        self.impl, self.path = impl, path
        self.dtype, trailing = _key_kind(impl)
        n = len(trailing)
        if data_shape[len(data_shape) - n :] != trailing:
            raise CorruptCheckpointError(
                f"{stored.describe_file(TREE)}: the PRNG keys at {keystr(path)} have data of "
                f"shape {data_shape}, which {impl} keys' data does not end in {trailing}"
            )
        self.shape = data_shape[: len(data_shape) - n]

    @staticmethod
    def of(dtype: Any) -> bool:
        """Whether `dtype` is a typed PRNG key dtype."""
        jax = sys.modules.get("jax")
        return jax is not None and bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))

    @staticmethod
    def impl_of(keys: Any, path: KeyPath) -> str:
        """The name of the implementation of `keys` (a jax key array); TypeError for keys of an
        implementation jax.random does not name (a custom one), which could not be restored."""
        jax = optional("jax", feature="typed PRNG keys")
        impl = str(jax.random.key_impl(keys))
        if impl not in PRNG_IMPLS or _key_kind(impl)[0] != keys.dtype:
            raise TypeError(
                f"the PRNG keys at {keystr(path)} are of implementation {impl!r}; a train state "
                f"stores keys of {sorted(PRNG_IMPLS)} (or save jax.random.key_data(keys))"
            )
        return impl

    def check(self, target: Any, path: KeyPath) -> None:
        """A target leaf (keys, or their ShapeDtypeStruct) must be keys of this implementation
        and shape; MismatchError naming the key path otherwise."""
        if target is NONE or target is None or not hasattr(target, "dtype"):
            return
        if not _Keys.of(target.dtype) or target.dtype != self.dtype:
            raise MismatchError(
                f"at {keystr(path)}: {self.impl} PRNG keys ({self.dtype}) in the checkpoint, "
                f"{target.dtype} in the target"
            )
        if tuple(target.shape) != self.shape:
            raise MismatchError(
                f"at {keystr(path)}: PRNG keys of shape {self.shape} in the checkpoint, "
                f"{tuple(target.shape)} in the target"
            )

    def wrap(self, data: Any) -> Any:
        jax = optional("jax", feature="typed PRNG keys")
        return jax.random.wrap_key_data(data, impl=self.impl)


@functools.cache
def _key_kind(impl: str) -> tuple[Any, tuple[int, ...]]:
    """The dtype of `impl` keys and the trailing shape of their data (no key is made)."""
    jax = optional("jax", feature="typed PRNG keys")
    keys = jax.eval_shape(lambda: jax.random.key(0, impl=impl))
    return keys.dtype, tuple(jax.eval_shape(jax.random.key_data, keys).shape)


def _fill_from(state: Any, fallback: Any, target: Any) -> Any:
    """T5X's fallback_state: keys the (transformed) checkpoint lacks come from `fallback`."""
    if isinstance(fallback, Mapping):
        merged = dict(state) if isinstance(state, Mapping) else {}
        for key, value in fallback.items():
            if key in merged:
                merged[key] = _fill_from(merged[key], value, None)
            else:
                merged[key] = value
        return merged
    return state


def _align(state: Any, target: Any, path: KeyPath) -> Any:
    """After transforms/fallback: give the state the target's structure and types, checking shapes.

    The state comes from a restore without target, so namedtuples and custom nodes are dicts there.
    """
    if isinstance(target, Mapping):
        by_key = _by_keys(state, list(target), path)
        return like(target, {k: _align(by_key[k], target[k], (*path, k)) for k in target})
    if isinstance(target, tuple) and hasattr(target, "_fields") and isinstance(state, Mapping):
        fields = _by_keys(state, list(target._fields), path)
        return type(target)(
            *[_align(fields[f], t, (*path, f)) for f, t in zip(target._fields, target, strict=True)]
        )
    if isinstance(target, (list, tuple)):
        if not isinstance(state, (list, tuple)) or len(state) != len(target):
            raise MismatchError(
                f"at {keystr(path)}: the target has {len(target)} entries, the restored state "
                f"is a {type(state).__qualname__} of {len(state) if isinstance(state, (list, tuple)) else '-'}"
            )
        values = [
            _align(s, t, (*path, i)) for i, (s, t) in enumerate(zip(state, target, strict=True))
        ]
        if isinstance(target, list):
            return values
        return type(target)(*values) if hasattr(target, "_fields") else tuple(values)
    keyed = flatten_custom(target)
    if keyed is not None:
        if isinstance(state, Mapping):
            by_key = _by_keys(state, [k for k, _ in keyed], path)
            return unflatten_custom(target, [_align(by_key[k], t, (*path, k)) for k, t in keyed])
        state_keyed = flatten_custom(state) or []
        if [k for k, _ in state_keyed] != [k for k, _ in keyed]:
            raise MismatchError(
                f"at {keystr(path)}: the restored state does not match the target's {type(target).__qualname__}"
            )
        return unflatten_custom(
            target,
            [_align(s, t, (*path, k)) for (k, t), (_, s) in zip(keyed, state_keyed, strict=True)],
        )
    if (
        hasattr(target, "shape")
        and hasattr(state, "shape")
        and tuple(target.shape) != tuple(state.shape)
    ):
        raise MismatchError(
            f"at {keystr(path)}: shape {tuple(state.shape)} in the restored state, "
            f"{tuple(target.shape)} in the target"
        )
    return state


def _by_keys(state: Any, keys: list[str], path: KeyPath) -> Mapping[str, Any]:
    if not isinstance(state, Mapping):
        raise MismatchError(
            f"at {keystr(path)}: the target has keys {keys}, the restored state is a {type(state).__qualname__}"
        )
    missing = sorted(set(keys) - set(state))
    extra = sorted(set(state) - set(keys))
    if missing or extra:
        raise MismatchError(
            f"at {keystr(path)}: keys differ after transforms and fallback; only in the target: "
            f"{missing}, only in the restored state: {extra}"
        )
    return state
