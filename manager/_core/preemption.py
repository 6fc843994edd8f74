"""Noticing that the job is being preempted: a signal handler, or JAX's preemption sync point."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

log = logging.getLogger("cairn")

_received = threading.Event()
_installed: dict[int, list[Any]] = {}  # signal -> [watchers, the handler that was there before]
_guard = threading.Lock()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    _received.set()
    previous = _installed.get(signum, [0, None])[1]
    if callable(previous):  # chain a handler the program had (not SIG_DFL/SIG_IGN)
        previous(signum, frame)


def _jax_sync_manager() -> Any:
    """JAX's preemption sync manager when ``jax.distributed`` started one, else None."""
    if "jax" not in sys.modules:
        return None
    from jax._src import distributed

    return getattr(distributed.global_state, "preemption_sync_manager", None)


class PreemptionWatch:
    """Tells whether the job was asked to stop.

    In a ``jax.distributed`` run with JAX's preemption service, JAX catches SIGTERM itself and
    `reached(step)` is ``reached_preemption_sync_point(step)``: True on every process at the same
    step. Otherwise the watch installs a handler for `signals` (the process keeps running: the
    trainer is expected to save and exit) and `reached` is True from the first signal on; a handler
    the program had installed is still called. Handlers can only be installed from the main
    thread; a watch created elsewhere logs a warning and never fires. Signals are watched from
    construction until `close()`; the handler that was there before comes back when the last
    watch closes.

    Threads: the handler runs on the main thread between bytecodes and only sets an Event.
    """

    def __init__(self, signals: Sequence[int]) -> None:
        self._signals = tuple(dict.fromkeys(int(s) for s in signals))
        self._sync = _jax_sync_manager()
        self._reached_at: int | None = None
        self._watching = False
        if self._sync is not None:
            return
        if threading.current_thread() is not threading.main_thread():
            log.warning(
                "cairn: OnPreemption cannot watch %s from a thread other than the main thread; "
                "create the CheckpointManager on the main thread",
                [signal.Signals(s).name for s in self._signals],
            )
            return
        with _guard:
            if not _installed:
                _received.clear()
            for signum in self._signals:
                if signum in _installed:
                    _installed[signum][0] += 1
                else:
                    _installed[signum] = [1, signal.getsignal(signum)]
                    signal.signal(signum, _on_signal)
        self._watching = True

    @property
    def reached_at(self) -> int | None:
        """The step at which `reached` first returned True."""
        return self._reached_at

    @property
    def synchronised(self) -> bool:
        """Whether JAX's sync point decides (the same step on every process)."""
        return self._sync is not None

    def reached(self, step: int) -> bool:
        """Whether to save `step` and stop (stays True once reached)."""
        if self._reached_at is not None:
            return True
        if self._sync is not None:
            from jax.experimental import multihost_utils

            hit = bool(multihost_utils.reached_preemption_sync_point(step))
        else:
            hit = _received.is_set()
        if hit:
            self._reached_at = step
            log.warning("cairn: preemption noticed at step %d", step)
        return hit

    def close(self) -> None:
        if not self._watching:
            return
        self._watching = False
        with _guard:
            for signum in self._signals:
                entry = _installed[signum]
                entry[0] -= 1
                if entry[0] == 0:
                    del _installed[signum]
                    if threading.current_thread() is threading.main_thread():
                        signal.signal(signum, entry[1] if entry[1] is not None else signal.SIG_DFL)
