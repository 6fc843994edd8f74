"""The threads and processes of a commit: which process runs a write phase (`writing_process`,
`writing_as`), background threads that take the CPU and the disk last (`lower_thread_priority`),
and a bound on the bytes a commit writes per second (`WriteBudget`).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import numbers
import os
import sys
import threading
import time
from collections.abc import Iterator

BACKGROUND_NICE = 19

_WRITING_PROCESS: contextvars.ContextVar[tuple[int, int]] = contextvars.ContextVar(
    "cairn_writing_process", default=(0, 1)
)


def writing_process() -> tuple[int, int]:
    """(index, count) of the process whose write phase is running; (0, 1) outside multi-process.

    In a multi-process save every process runs each item's write phase into the same directory.
    A handler writes its per-process files (its shards) everywhere, and files that every process
    would write alike (structure, metadata) only where the index is 0, the primary.
    """
    return _WRITING_PROCESS.get()


@contextlib.contextmanager
def writing_as(index: int, count: int) -> Iterator[None]:
    """Run write phases as process `index` of `count` (set by the manager)."""
    token = _WRITING_PROCESS.set((index, count))
    try:
        yield
    finally:
        _WRITING_PROCESS.reset(token)


_PARTS: contextvars.ContextVar[bool] = contextvars.ContextVar("cairn_parts", default=False)


def in_parts() -> bool:
    """Whether a snapshot or a read is of one process's *part* (a local tier's step): a
    snapshot then captures every distinct shard this process holds, not only those with
    ``replica_id == 0`` (it writes the others only into a part, `writing_process` being
    (0, 1) there); a read of a part checks only the chunks it reads, since the part holds
    this process's regions of each array and no more."""
    return _PARTS.get()


@contextlib.contextmanager
def as_parts(on: bool = True) -> Iterator[None]:
    """Take snapshots, or read steps, as parts (`in_parts`; set by the manager)."""
    token = _PARTS.set(on)
    try:
        yield
    finally:
        _PARTS.reset(token)


def lower_thread_priority(nice: int = BACKGROUND_NICE) -> None:
    """Lower the calling thread's CPU and I/O priority (Linux: each thread has its own), and
    give the kernel its Python name, so that ``top -H`` shows which cairn thread uses the CPU.

    cairn's background threads (commit, chunk writers, reclaim, staging) call this when they
    start, so that on a machine whose cores the training step keeps busy, the step gets the CPU
    first and the checkpoint takes the rest: nice `nice`, and the lowest best-effort I/O level.
    A no-op where threads cannot be reprioritised.
    """
    if not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), nice))
    set_io_priority(tid, BACKGROUND_IO_LEVEL)
    # The thread's name in the kernel too (top -H, /proc/<pid>/task/*/comm): 15 bytes at most.
    name = threading.current_thread().name.encode()[:15]
    _libc().prctl(_PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)


# ioprio_set(2) / ioprio_get(2): no libc wrapper, so the raw system call (numbers per architecture).
_IOPRIO_SYSCALLS = {"x86_64": (251, 252), "aarch64": (30, 31), "ppc64le": (273, 274)}
_IOPRIO_CLASS_BE, _IOPRIO_CLASS_SHIFT, _IOPRIO_WHO_PROCESS = 2, 13, 1
BACKGROUND_IO_LEVEL = 7  # the lowest best-effort level: after the trainer's reads and writes


_PR_SET_NAME = 15


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def set_io_priority(tid: int, level: int) -> bool:
    """Put thread `tid` in the best-effort I/O class at `level` (0 first .. 7 last); whether it
    took. I/O schedulers that weigh priorities (BFQ, CFQ) serve its reads and writes after those
    of threads at the default level 4; others ignore it."""
    numbers = _IOPRIO_SYSCALLS.get(os.uname().machine)
    if numbers is None or not sys.platform.startswith("linux"):
        return False
    value = (_IOPRIO_CLASS_BE << _IOPRIO_CLASS_SHIFT) | level
    return int(_libc().syscall(numbers[0], _IOPRIO_WHO_PROCESS, tid, value)) == 0


def io_priority(tid: int) -> tuple[int, int] | None:
    """(class, level) of thread `tid`'s I/O priority, or None where it cannot be read."""
    numbers = _IOPRIO_SYSCALLS.get(os.uname().machine)
    if numbers is None or not sys.platform.startswith("linux"):
        return None
    value = int(_libc().syscall(numbers[1], _IOPRIO_WHO_PROCESS, tid))
    if value < 0:
        return None
    return value >> _IOPRIO_CLASS_SHIFT, value & ((1 << _IOPRIO_CLASS_SHIFT) - 1)


class WriteBudget:
    """A bound on the bytes a commit writes per second (``max_write_bytes_per_s``), shared by
    its writer threads: each file waits for its turn, so a commit takes longer and takes the
    disk and the cores less. Bursts are one file (a chunk of at most ``chunk_bytes``).

    Threads: `take` may be called from any number of threads at once.
    """

    def __init__(self, bytes_per_s: float) -> None:
        rate = float("nan")
        if isinstance(bytes_per_s, numbers.Real) and not isinstance(bytes_per_s, bool):
            with contextlib.suppress(OverflowError):  # an int past float's range: refused too
                rate = float(bytes_per_s)  # NumPy's numbers too
        if not 1 <= rate < float("inf"):  # less than a byte a second: a typo
            raise ValueError(
                "max_write_bytes_per_s must be a number of bytes per second, at least 1, "
                f"got {bytes_per_s!r}"
            )
        self.bytes_per_s = rate
        self._lock = threading.Lock()
        self._next = 0.0  # when the budget has room again (time.monotonic)

    def take(self, nbytes: int) -> None:
        """Wait until `nbytes` may be written without exceeding the rate on average."""
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + nbytes / self.bytes_per_s
        if start > now:
            time.sleep(start - now)
