"""JsonHandler: JSON-serialisable data (configs, small metadata) as one file."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cairn.handlers._files import (
    Destination,
    FileRecord,
    StoredItem,
    as_destination,
    parse_json,
    writing_process,
)

__all__ = ["JsonHandler"]

_FILE = "data.json"


class _JsonSnapshot:
    def __init__(self, text: str) -> None:
        self._data = text.encode()

    def write(self, dest: Destination | Path) -> Sequence[FileRecord]:
        dest = as_destination(dest)
        if writing_process()[0] != 0:
            return []  # the same on every process: the primary writes it
        return [dest.write_file(_FILE, self._data)]


class JsonHandler:
    """Stores a JSON-serialisable value in ``data.json``.

    The snapshot serialises on the caller thread, so it is a deep copy: changes the caller makes
    after `save()` returns never reach the checkpoint, and a value that is not JSON-serialisable
    raises TypeError inside `save()`, before anything is written. JSON has only string keys: a dict
    with int keys comes back with str keys. Never picked by type: name it in ``handlers=``.
    """

    id = "cairn.json"
    version = 1

    def snapshot(self, obj: Any) -> _JsonSnapshot:
        try:
            text = json.dumps(obj, sort_keys=False)
        except (TypeError, ValueError) as e:
            raise TypeError(f"JsonHandler cannot store {type(obj).__qualname__}: {e}") from None
        return _JsonSnapshot(text)

    def restore(self, stored: StoredItem, target: Any = None) -> Any:
        del target  # JSON comes back as it was saved
        return parse_json(stored.read_bytes(_FILE), stored.describe_file(_FILE))

    def check(self, stored: StoredItem) -> None:
        """``data.json`` parses (``verify``); CorruptCheckpointError naming it otherwise."""
        self.restore(stored)

    def describe(self, stored: StoredItem) -> dict[str, Any]:
        record = stored.files.get(_FILE)
        return {"kind": "json", "bytes": record.size if record else None}

    def __repr__(self) -> str:
        return "JsonHandler()"
