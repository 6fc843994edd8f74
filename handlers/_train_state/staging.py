"""What a snapshot holds: each leaf as captured (`_Leaf`), the arrays an earlier save wrote and an
incremental save links (`_unchanged`), and the copies of the others into the staging pool's
slab (`_stage_layout`, `_stage`, `_Copying`)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from cairn.handlers._files import FileRecord
from cairn.handlers._packs import PACK_BYTES
from cairn.handlers._staging import PAGE, Lease, round_up
from cairn.handlers._train_state.layout import _chunk_parts, _size
from cairn.handlers._train_state.threads import _shared_pool
from cairn.handlers._tree import KeyPath


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
    #: chunk keys of shards another process holds as replica 0 (a local tier's part only)
    secondary: frozenset[str] = frozenset()

    def __getstate__(self) -> dict[str, Any]:
        """What the writer process gets (``writer="process"``): the data, staged or pickled with
        the pieces, without the jax arrays and the weak reference, which stay here."""
        if self.known is not None:
            raise TypeError("an incremental snapshot cannot be sent to a writer process")
        return {**self.__dict__, "sources": [], "ref": None}


_COPY_PIECE = 16 * (1 << 20)  # rows copied per task: both cores copy a large leaf


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
    tells when each span of the slab is filled.

    The bytes between two chunks (at most a page: alignment) are zeroed here, before any
    writer reads the slab: a pack spans them (`staged_pack`), and the writers of the tiers one
    snapshot feeds, whose chunks differ (a local tier's part holds every shard a process has,
    the persistent tier replica 0 only), read the slab at once and write nothing there but a
    zarr chunk's crc32c tail, into that chunk's own 4 bytes, the same value from either."""
    copies: list[tuple[np.ndarray, np.ndarray, int]] = []  # into, from, slab offset after
    end = 0
    for leaf, key, part, at, nbytes in placed:
        if 0 < at - end <= PAGE:
            lease.slab.array[end:at] = 0  # whatever an earlier save left there
        end = at + nbytes
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
