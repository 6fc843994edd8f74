"""Writing and reading one item with a handler directly, without a manager (handler tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cairn.handlers import FileRecord, Handler, StoredItem


def write_item(handler: Handler, obj: Any, directory: Path) -> list[FileRecord]:
    directory.mkdir(parents=True)
    return list(handler.snapshot(obj).write(directory))


def stored(directory: Path, records: list[FileRecord], step: int | None = 7) -> StoredItem:
    return StoredItem(directory, {r.path: r for r in records}, step, "item")
