"""Staging memory: page-aligned, pre-faulted host buffers that snapshots copy arrays into.

Why copy at all: a snapshot that keeps zero-copy views of a ``jax.Array``'s buffers makes JAX
decline to donate them, so the train step right after ``save()`` allocates and faults in a fresh
copy of the whole state (about 3 s per GiB of page faults on a VM whose memory the host backs
lazily, 0.3-1 s elsewhere). A copy into memory that is already faulted in costs a memcpy (about
0.1 s per GiB here), and the train step donates as usual.

A `StagingPool` belongs to one manager and keeps its buffers (`Slab`s) across saves, one set per
item name. A slab is an anonymous mapping (page aligned, so chunk files can be written with
``O_DIRECT``), with transparent huge pages asked for (the train step's own buffers get 4 KiB
pages, whose faults cost several times more here), and faulted in once: by the copy of the first
save of a state of that size, or beforehand, in the background (`prepare`, ``cairn-stage``), when
the size is known before that save (after a restore). The pool holds at most what is in flight
(``max_pending`` states per item, as the manager never snapshots more) and at most `max_bytes`
(slabs being faulted in count), frees an item's slabs of another size at the next lease once its
state changed size, and frees everything at `close`.

Threads: `lease` runs on the caller's thread (inside ``save()``); a `Lease` is released by the
write phase on the commit thread, or when its snapshot is dropped unwritten; `prepare`'s fault-in
runs on a thread of its own, which a `lease` of the same item waits for. One lock guards the
pool's lists.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Collection, Iterator, Mapping
from typing import Any

import numpy as np

from cairn.handlers._files import lower_thread_priority
from cairn.handlers._files.threads import _libc

__all__ = ["Lease", "Slab", "StagingPool", "current_staging", "staging_for"]

log = logging.getLogger("cairn")

PAGE = mmap.PAGESIZE
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+; 23 on every arch


def round_up(n: int, to: int = PAGE) -> int:
    return -(-n // to) * to


class Slab:
    """One mapping of `nbytes` (a multiple of the page size), as a uint8 array.

    Anonymous and private by default. `shared` maps a memfd instead (``writer="process"``): its
    descriptor, `fd`, goes to the writer process with each save that staged into it, and the
    memory lives as long as either process maps it or holds the descriptor, so it is freed
    when both are done with it, however they end. `attach` is the writer's side.
    """

    def __init__(self, nbytes: int, *, shared: bool = False, fd: int | None = None) -> None:
        self.nbytes = max(PAGE, round_up(nbytes))
        self.fd = fd
        if shared and fd is None:
            self.fd = os.memfd_create("cairn-stage", os.MFD_CLOEXEC)
            try:
                os.ftruncate(self.fd, self.nbytes)
            except BaseException:
                os.close(self.fd)
                raise
        if self.fd is None:
            self._map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        else:
            self._map = mmap.mmap(self.fd, self.nbytes, flags=mmap.MAP_SHARED)
            self._closing = weakref.finalize(self, os.close, self.fd)
        with contextlib.suppress(AttributeError, OSError):  # huge pages: fewer faults and misses
            self._map.madvise(mmap.MADV_HUGEPAGE)
        self.array = np.frombuffer(self._map, np.uint8)

    @classmethod
    def attach(cls, fd: int, nbytes: int) -> Slab:
        """The slab whose memfd `fd` (now owned by the slab) another process sent."""
        if os.fstat(fd).st_size < nbytes:
            os.close(fd)
            raise ValueError(f"a staging slab of {nbytes} bytes came with a smaller memfd")
        return cls(nbytes, fd=fd)

    def populate(self) -> None:
        """Fault every page in now: one madvise where the kernel has it, else a write per page.

        Through ctypes, which lets go of the GIL for the call (``mmap.madvise`` keeps it, and
        faulting in a gigabyte takes 0.2-3 s here, all of which the training loop would wait)."""
        address = self.array.ctypes.data
        if _libc().madvise(
            ctypes.c_void_p(address), ctypes.c_size_t(self.nbytes), _MADV_POPULATE_WRITE
        ):
            self.array[::PAGE] = 0  # an older kernel (EINVAL): NumPy lets go of the GIL too


class Lease:
    """A slab lent to one snapshot; `release` (idempotent) gives it back to its pool. Without a
    pool (the writer process's copy of a snapshot) it only holds the slab."""

    def __init__(self, pool: StagingPool | None, key: str, slab: Slab) -> None:
        self.slab = slab
        self._release = (
            weakref.finalize(self, pool._give_back, key, slab) if pool is not None else None
        )

    def release(self) -> None:
        if self._release is not None:
            self._release()


class StagingPool:
    """A manager's staging buffers, reused across saves (see the module docstring).

    `shared` (``writer="process"``) puts slabs in memfds the writer process maps, and never
    keeps views: a slab is mapped at once when none fits. `zero_copy=True` makes every lease
    refused: snapshots keep views of the arrays' buffers (no copy and no memory beyond the
    state, but JAX declines to donate those buffers until the commit ends). `max_bytes` bounds the
    slabs held, in use, free or being faulted in: a save that would need more keeps views, and
    a warning says so once.
    """

    def __init__(
        self,
        *,
        max_bytes: int | None = None,
        zero_copy: bool = False,
        remember: bool = False,
        shared: bool = False,
    ) -> None:
        self.max_bytes = max_bytes
        self.zero_copy = zero_copy
        self.remembers = remember
        self.shared = shared  # slabs in memfds, mapped at once (writer="process")
        self._remembered: dict[str, dict[int, tuple[Any, ...]]] = {}
        self._chunks: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._free: dict[str, list[Slab]] = {}
        self._in_use = 0  # bytes of leased slabs
        self._warming: dict[str, tuple[threading.Thread, int]] = {}  # key -> (thread, bytes)
        self._prepared: set[str] = set()  # keys whose memory `prepare` made, never leased since
        self._closed = False
        self._warned = False

    def __repr__(self) -> str:
        return f"StagingPool(held={self.held_bytes()}, max_bytes={self.max_bytes})"

    def held_bytes(self) -> int:
        """Bytes of slabs the pool holds: leased, free or being faulted in."""
        with self._lock:
            return self._held()

    def _held(self) -> int:
        free = sum(s.nbytes for slabs in self._free.values() for s in slabs)
        return self._in_use + free + sum(n for _, n in self._warming.values())

    def lease(self, key: str, nbytes: int) -> Lease | None:
        """A slab of at least `nbytes` for item `key`, or None: keep views this time.

        A free slab that fits is lent as it is (faulted in: a memcpy). Without one, a slab being
        faulted in for `key` (`prepare`) is waited for; else a new one is mapped at once, and the
        copy into it faults it in (huge pages asked for), which costs save() less than the fresh
        arrays a train step allocates when JAX declines to donate a viewed state
        (bench/bench_first_save.py). A free slab more than a quarter larger than needed (the
        state shrank) is freed. None when the pool copies nothing (`zero_copy`), is closed, or
        would exceed `max_bytes`.
        """
        if self.zero_copy or nbytes <= 0:
            return None
        while True:
            with self._lock:
                if self._closed:
                    return None
                self._prepared.discard(key)
                slab = self._fitting(key, nbytes, take=True)
                if slab is not None:
                    self._in_use += slab.nbytes
                    return Lease(self, key, slab)
                warming = self._warming.get(key)
                if warming is None:
                    if not self._room(key, max(PAGE, round_up(nbytes)), warn=True):
                        return None
                    try:
                        slab = Slab(nbytes, shared=self.shared)
                    except (OSError, MemoryError) as e:  # no memory to map: views this time
                        log.warning("cairn: no %d bytes of staging memory: %s", nbytes, e)
                        return None
                    self._in_use += slab.nbytes
                    return Lease(self, key, slab)
            warming[0].join()  # then take what it prepared, if it fits

    def prepare(self, key: str, nbytes: int) -> None:
        """Fault in a slab of `nbytes` for item `key`'s next save, on a background thread
        (``cairn-stage``): after a restore, which knows the state's size before its first
        save. Nothing if a fitting slab is free or being prepared, or there is no room."""
        if self.zero_copy or nbytes <= 0:
            return
        with self._lock:
            if self._closed or key in self._warming or self._fitting(key, nbytes) is not None:
                return
            size = max(PAGE, round_up(nbytes))
            if not self._room(key, size, warn=False):
                return
            thread = threading.Thread(
                target=self._warm, args=(key, nbytes), name="cairn-stage", daemon=True
            )
            self._warming[key] = (thread, size)  # counted as held from now on
            self._prepared.add(key)
            thread.start()

    def drop_unused(self, saved: Collection[str]) -> None:
        """After a save of the items `saved`: the memory `prepare` made for any other item (one
        restored that the manager does not save again) is freed, once its fault-in ends."""
        while True:
            with self._lock:
                unused = self._prepared.difference(saved)
                busy = [self._warming[key][0] for key in unused if key in self._warming]
                if not busy:
                    for key in unused:
                        self._free.pop(key, None)  # only the prepared slab: never leased
                    self._prepared -= unused
                    return
            for thread in busy:
                thread.join()

    def _fitting(self, key: str, nbytes: int, *, take: bool = False) -> Slab | None:
        """A free slab of `key` that fits `nbytes` (taken with `take`); the free slabs of `key`
        of another size are freed: the state changed size (a slab that a save in flight gives
        back later goes at the next call). Under the lock."""
        fitting = self._free[key] = [
            slab for slab in self._free.get(key, []) if nbytes <= slab.nbytes <= _fits(nbytes)
        ]
        if not fitting:
            return None
        return fitting.pop() if take else fitting[-1]

    def _room(self, key: str, size: int, *, warn: bool) -> bool:
        """Whether `size` more bytes fit in `max_bytes`, other items' free slabs freed first to
        make room (not a slab `prepare` made that its item has not leased yet: a save that
        comes to it takes it, `drop_unused` frees it if none does); `warn` logs, once per
        pool, why a save is not staged. Under the lock."""
        if self.max_bytes is None:
            return True
        for other in list(self._free):
            if self._held() + size <= self.max_bytes:
                break
            if other not in self._prepared:
                self._free[other] = []
        if self._held() + size <= self.max_bytes:
            return True
        if warn and not self._warned:
            self._warned = True
            log.warning(
                "cairn: item %r needs %d bytes of staging memory, beyond max_staging_bytes=%d "
                "with %d held; this save is not staged: it keeps views of arrays on the CPU "
                "(JAX will not donate them until the commit ends) and, with writer='process', "
                "sends the arrays' bytes through the writer's socket",
                key,
                size,
                self.max_bytes,
                self._held(),
            )
        return False

    def _warm(self, key: str, nbytes: int) -> None:
        lower_thread_priority()
        try:
            slab = Slab(nbytes, shared=self.shared)
            slab.populate()
        except (OSError, MemoryError) as e:  # no memory for it: the save maps its own
            log.warning("cairn: could not prepare %d bytes of staging memory: %s", nbytes, e)
            slab = None
        with self._lock:
            del self._warming[key]
            if slab is not None and not self._closed:
                self._free.setdefault(key, []).append(slab)

    def _give_back(self, key: str, slab: Slab) -> None:
        with self._lock:
            self._in_use -= slab.nbytes
            if not self._closed:
                self._free.setdefault(key, []).append(slab)

    def remember(self, key: str, leaves: dict[int, tuple[Any, ...]]) -> None:
        """What the last written save of item `key` wrote for its jax leaves (leaf index ->
        (weak reference to the array, the leaf's signature, its file records)), for the next
        snapshot: a leaf that is the same immutable array again need not be copied or hashed
        (incremental saves; a no-op unless the pool was made with `remember`)."""
        if self.remembers:
            with self._lock:
                self._remembered[key] = leaves

    def recall(self, key: str) -> dict[int, tuple[Any, ...]]:
        with self._lock:
            return self._remembered.get(key, {})

    def remember_chunks(self, key: str, chunks: Mapping[str, Any]) -> None:
        """Where the last written save of item `key` put every chunk (chunk path -> its place
        and content hash: the packed layout), so that the next save finds a chunk whose bytes
        did not change by its hash, whatever leaf it came from (a no-op unless remembering)."""
        if self.remembers:
            with self._lock:
                self._chunks[key] = dict(chunks)

    def recall_chunks(self, key: str) -> Mapping[str, Any]:
        with self._lock:
            return self._chunks.get(key, {})

    def wait(self) -> None:
        """Until no slab is being faulted in."""
        while True:
            with self._lock:
                warming = next(iter(self._warming.values()), None)
            if warming is None:
                return
            warming[0].join()

    def close(self) -> None:
        """Free the free slabs now; leased ones are freed when their snapshots release them."""
        self.wait()
        with self._lock:
            self._closed = True
            self._free.clear()
            self._remembered.clear()


def _fits(nbytes: int) -> int:
    """The largest slab reused for `nbytes`: a quarter more, or one huge page."""
    return max(round_up(nbytes + nbytes // 4), round_up(nbytes, 2 << 20))


_STAGING: contextvars.ContextVar[tuple[StagingPool, str] | None] = contextvars.ContextVar(
    "cairn_staging", default=None
)


def current_staging() -> tuple[StagingPool, str] | None:
    """The pool and item name a snapshot on this thread stages into, or None (outside a manager:
    arrays are then kept as views, NumPy arrays copied)."""
    return _STAGING.get()


@contextlib.contextmanager
def staging_for(pool: StagingPool, item: str) -> Iterator[None]:
    """Snapshots taken inside stage item `item`'s arrays in `pool` (set by the manager)."""
    token = _STAGING.set((pool, item))
    try:
        yield
    finally:
        _STAGING.reset(token)
