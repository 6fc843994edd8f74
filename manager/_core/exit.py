"""Commits of managers never closed land before the interpreter shuts down."""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401 - registers its shutdown hook before ours (below)
import contextlib
import threading
import weakref
from typing import Protocol


class _Draining(Protocol):
    def drain(self) -> None: ...


_OPEN: weakref.WeakSet[_Draining] = weakref.WeakSet()


def finish_before_shutdown(commits: _Draining) -> None:
    """Wait for a manager's commit thread (its `Committer.drain`, which returns at once once
    it is closed) before the interpreter shuts down, unless it was garbage-collected first."""
    _OPEN.add(commits)


def _finish_at_exit() -> None:
    """Registered with threading's pre-shutdown hooks, which run (newest first) before
    concurrent.futures refuses new work; a commit's write phase may still start thread pools.
    Errors are logged by the commit thread; nothing is raised here."""
    for commits in list(_OPEN):
        with contextlib.suppress(Exception):
            commits.drain()


_register_before_shutdown = getattr(threading, "_register_atexit", None)
if _register_before_shutdown is not None:
    _register_before_shutdown(_finish_at_exit)
