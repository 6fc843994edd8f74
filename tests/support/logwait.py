"""Gating a test on a line the "cairn" logger writes, instead of on time."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def logged(text: str, logger: str = "cairn") -> Iterator[threading.Event]:
    """An event set once `logger` logs a message that contains `text` (while in the block)."""
    seen = threading.Event()

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if text in record.getMessage():
                seen.set()

    watch = Watch()
    logging.getLogger(logger).addHandler(watch)
    try:
        yield seen
    finally:
        logging.getLogger(logger).removeHandler(watch)
