"""The one place that picks a storage for a directory (the only importer of the backends)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cairn.manager._storage.base import Storage
from cairn.manager._storage.objectstore import KvStorage, StorageOptions
from cairn.manager._storage.posix import PosixStorage


def open_storage(directory: Path | str, options: Mapping[str, Any] | None) -> Storage:
    """The storage for a directory `check_directory` accepted."""
    if isinstance(directory, Path):
        if options:
            raise ValueError(
                f"storage_options {dict(options)!r} apply to object stores; {directory} is a "
                "local directory"
            )
        return PosixStorage(directory)
    return KvStorage(directory, StorageOptions.from_mapping(options))
