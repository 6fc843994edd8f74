"""Where save and restore timings go besides `info(step)` and the "cairn" logger: TensorBoard
scalars (optional) and JAX's monitoring events, under the names Orbax uses, so that dashboards
built for Orbax show cairn's figures.

A local tier (`LocalTier`) reports its own: this process's parts under the same names with
``/jax`` replaced by ``/cairn/local`` (`local_name`), as events and, when the manager has a
`tensorboard_dir`, as scalars in the same event file as the persistent tier's (one writer per
directory in a process, `_Shared`: TensorBoard can miss what several event files written at
once in one directory hold). The replicas a process holds of others' parts are not reported:
their saves are their owners', which report them."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from cairn.handlers.io import optional

WRITE_BLOCKING = "/jax/checkpoint/write/blocking_duration_secs"
WRITE_TOTAL = "/jax/checkpoint/write/async/total_duration_secs"
WRITE_BYTES = "/jax/checkpoint/write/bytes"
WRITE_THROUGHPUT = "/jax/checkpoint/write/bytes_per_sec"
READ_DURATION = "/jax/checkpoint/read/duration_secs"

LOCAL_PREFIX = "/cairn/local"


def local_name(name: str) -> str:
    """What a local tier reports Orbax's `name` as: ``/jax/checkpoint/write/bytes`` is
    ``/cairn/local/checkpoint/write/bytes``."""
    return LOCAL_PREFIX + name.removeprefix("/jax")


def _same(name: str) -> str:
    return name


class _Shared:
    """One TensorBoard event writer of a directory, and the managers of this process using it."""

    def __init__(self, writer: Any) -> None:
        self.writer, self.lock, self.users = writer, threading.Lock(), 0


_WRITERS: dict[str, _Shared] = {}  # by directory
_WRITERS_LOCK = threading.Lock()


def _key(directory: str | os.PathLike[str]) -> str:
    path = os.fspath(directory)
    return path if "://" in path else os.path.abspath(path)


class Telemetry:
    """Records each commit and restore. Threads: commits are recorded on the commit thread and
    restores on the caller's; one lock per event writer orders the TensorBoard writes."""

    def __init__(self, tensorboard_dir: str | os.PathLike[str] | None) -> None:
        self._name: Callable[[str], str] | None = _same  # None: reports nothing
        self._writer: _Shared | None = None
        self._key = ""  # the writer's, in _WRITERS
        if tensorboard_dir is not None:
            self._open(tensorboard_dir)

    def _open(self, tensorboard_dir: str | os.PathLike[str]) -> None:
        key = _key(tensorboard_dir)
        with _WRITERS_LOCK:
            shared = _WRITERS.get(key)
            if shared is None:
                summary = optional("tensorboard.summary", feature="tensorboard_dir=")
                Writer = summary.Writer  # TensorFlow-free event writer

                shared = _WRITERS[key] = _Shared(Writer(os.fspath(tensorboard_dir)))
            shared.users += 1
        self._writer, self._key = shared, key

    def local_tier(self, tensorboard_dir: str | os.PathLike[str] | None, *, own: bool) -> None:
        """Report as a manager of the local tier (called before its first commit): this
        process's own parts (`own`) under `local_name`s, into the persistent tier's
        `tensorboard_dir` too; the replicas it holds of other processes' parts, nothing."""
        self._name = local_name if own else None
        if own and tensorboard_dir is not None and self._writer is None:
            self._open(tensorboard_dir)

    def _emit(self, step: int, values: dict[str, float]) -> None:
        name = self._name
        if name is None:
            return
        jax = sys.modules.get("jax")
        if jax is not None:  # JAX's monitoring listeners (as Orbax reports to them)
            for key, value in values.items():
                if key.endswith("_secs"):
                    jax.monitoring.record_event_duration_secs(name(key), value)
        shared = self._writer
        if shared is not None:
            with shared.lock:
                for key, value in values.items():
                    shared.writer.add_scalar(name(key), value, step=step)
                shared.writer.flush()

    def committed(self, step: int, blocked_s: float, commit_s: float, nbytes: float) -> None:
        self._emit(
            step,
            {
                WRITE_BLOCKING: blocked_s,
                WRITE_TOTAL: commit_s,
                WRITE_BYTES: nbytes,
                WRITE_THROUGHPUT: nbytes / commit_s if commit_s > 0 else 0.0,
            },
        )

    def restored(self, step: int, seconds: float) -> None:
        self._emit(step, {READ_DURATION: seconds})

    def close(self) -> None:
        """Let go of the event writer; the last manager using it closes it."""
        shared, self._writer = self._writer, None
        if shared is None:
            return
        with _WRITERS_LOCK:
            shared.users -= 1
            if shared.users:
                return
            del _WRITERS[self._key]
        with shared.lock:
            shared.writer.close()
