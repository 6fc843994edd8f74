"""One writable manager per directory in a process: a new one takes over from the one open
there (T5X and SpeechBrain code builds a second checkpointer on a directory without closing
the first), and a reader opened in the process sees the saves its writer accepted."""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

log = logging.getLogger("cairn")

# The writable manager open on each directory in this process, by the storage's identity.
_WRITERS: dict[str, weakref.ref[Any]] = {}
_WRITERS_LOCK = threading.Lock()


def take_over(key: str, manager: Any) -> None:
    """Register `manager` as the directory's writer; the one registered before hands over
    (`hand_over`: it finishes its pending commits and turns read-only)."""
    with _WRITERS_LOCK:
        ref = _WRITERS.get(key)
        _WRITERS[key] = weakref.ref(manager)
    previous = ref() if ref is not None else None
    if previous is not None and previous is not manager:
        hand_over(previous)


def hand_over(self: Any) -> None:
    """A newer writable manager of this process opens the directory: the older one, `self`,
    finishes what is pending, lets go of the directory and stays open for reading. An error of
    a pending commit is logged and stays kept for its next call."""
    with self._handing:
        if self._commits.closed or self._superseded:
            return
        self._superseded = (
            f"a newer writable CheckpointManager of {self._where} in this process took "
            "over; this one is read-only now. Save through the new one (or close it and "
            "open a new manager)"
        )
    try:
        self._commits.drain()
    finally:
        self._commits.stop()
        if self._preemption is not None:
            self._preemption.close()
            self._preemption = None
        if self._writer:
            self._storage.release()
            self._writer = False
        self._read_only = True
    pending = self._commits.errors.pending()
    log.warning(
        "cairn: a newer writable CheckpointManager of %s in this process took over; the "
        "older one finished its pending commits and is read-only now%s",
        self._where,
        f" (they failed: {pending})" if pending else "",
    )


def settle_writer(key: str) -> None:
    """Read your own writes: when this process has a writable manager open on the directory
    `key` (a storage's ``identity``), wait until the saves it accepted are committed (or have
    failed: their errors stay that manager's), so that a reader opened now sees them. Bounded
    by that manager's ``barrier_timeout``, and logged; a reader on the writer's own commit
    thread does not wait. Other processes' writers are not waited for."""
    with _WRITERS_LOCK:
        ref = _WRITERS.get(key)
    writer = ref() if ref is not None else None
    commits = getattr(writer, "_commits", None)  # None while the writer is being built
    if commits is not None:
        commits.settle_for_reader()


def forget_writer(key: str, manager: Any) -> None:
    with _WRITERS_LOCK:
        ref = _WRITERS.get(key)
        if ref is not None and ref() in (manager, None):
            del _WRITERS[key]
