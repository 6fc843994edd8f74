"""Where save and restore timings go besides `info(step)` and the "cairn" logger: TensorBoard
scalars (optional) and JAX's monitoring events, under the names Orbax uses, so that dashboards
built for Orbax show cairn's figures."""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

from cairn.handlers.io import optional

WRITE_BLOCKING = "/jax/checkpoint/write/blocking_duration_secs"
WRITE_TOTAL = "/jax/checkpoint/write/async/total_duration_secs"
WRITE_BYTES = "/jax/checkpoint/write/bytes"
WRITE_THROUGHPUT = "/jax/checkpoint/write/bytes_per_sec"
READ_DURATION = "/jax/checkpoint/read/duration_secs"


class Telemetry:
    """Records each commit and restore. Threads: commits are recorded on the commit thread and
    restores on the caller's; one lock orders the TensorBoard writes."""

    def __init__(self, tensorboard_dir: str | os.PathLike[str] | None) -> None:
        self._writer: Any = None
        self._lock = threading.Lock()
        if tensorboard_dir is not None:
            summary = optional("tensorboard.summary", feature="tensorboard_dir=")
            Writer = summary.Writer  # TensorFlow-free event writer

            self._writer = Writer(os.fspath(tensorboard_dir))

    def _emit(self, step: int, values: dict[str, float]) -> None:
        jax = sys.modules.get("jax")
        if jax is not None:  # JAX's monitoring listeners (as Orbax reports to them)
            for name, value in values.items():
                if name.endswith("_secs"):
                    jax.monitoring.record_event_duration_secs(name, value)
        if self._writer is not None:
            with self._lock:
                for name, value in values.items():
                    self._writer.add_scalar(name, value, step=step)
                self._writer.flush()

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
        if self._writer is not None:
            with self._lock:
                self._writer.close()
