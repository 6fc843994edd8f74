"""InMemoryHandler: a fake for fast tests in one process."""

from __future__ import annotations

import copy
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cairn.handlers._files import Destination, FileRecord, StoredItem, as_destination

__all__ = ["InMemoryHandler"]

_FILE = "token"


class _MemorySnapshot:
    def __init__(self, handler: InMemoryHandler, obj: Any) -> None:
        self._handler = handler
        self._obj = obj

    def write(self, dest: Destination | Path) -> Sequence[FileRecord]:
        dest = as_destination(dest)
        if self._handler.on_write is not None:
            self._handler.on_write()
        token = uuid.uuid4().hex
        with self._handler._lock:
            self._handler._store[token] = self._obj
        return [dest.write_file(_FILE, token.encode())]


class InMemoryHandler:
    """Keeps each saved object in memory and writes only a token file that points at it.

    For unit tests of the manager: it is fast, and `on_write` (called at the start of every write
    phase, on the commit thread) lets a test block the write on a `threading.Event` or raise from it.
    Objects are deep-copied at snapshot time. A step it wrote restores only in the process (and
    with the handler instance) that wrote it.
    """

    id = "cairn.testing.in_memory"
    version = 1

    def __init__(self, *, on_write: Callable[[], None] | None = None) -> None:
        self.on_write = on_write
        self._store: dict[str, Any] = {}
        self._lock = threading.Lock()

    def snapshot(self, obj: Any) -> _MemorySnapshot:
        return _MemorySnapshot(self, copy.deepcopy(obj))

    def restore(self, stored: StoredItem, target: Any = None) -> Any:
        del target
        token = stored.read_bytes(_FILE).decode()
        with self._lock:
            if token not in self._store:
                raise LookupError(f"{stored.describe_file(_FILE)} was written by another process")
            return copy.deepcopy(self._store[token])

    def describe(self, stored: StoredItem) -> dict[str, Any]:
        return {"kind": "in-memory", "files": sorted(stored.files)}

    def __repr__(self) -> str:
        return "InMemoryHandler()"
