"""The two-phase Handler protocol."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from cairn.handlers._files import FileRecord, StoredItem

__all__ = ["Handler", "Snapshot"]


class Snapshot(Protocol):
    """What a handler captured on the caller thread, ready to be written in the background.

    A snapshot owns its data: nothing the caller does to the original object after `save()` returns
    (mutating, overwriting, donating arrays) may change what `write` stores.
    """

    def write(self, directory: Path) -> Sequence[FileRecord]:
        """Write the captured state into `directory` and return the files written.

        Runs on the manager's commit thread (or the caller's, for synchronous saves). `directory`
        exists and is empty; it is a temporary directory that the manager renames after every
        item is written, so store only paths relative to it. Each returned record has the size and
        crc32c computed while writing (`ChecksummedFile`, `write_file`); files not returned (for
        example chunk files that carry their own checksums) are not verified by the manager.
        The manager fsyncs every file and directory afterwards.
        """
        ...


class Handler(Protocol):
    """Saves and restores one kind of item (a pytree, an iterator, JSON, ...).

    Threads: `snapshot` runs on the caller's thread, inside `save()`, and must capture everything it
    needs (host copies of arrays, iterator state, a deep copy) before it returns, because the caller
    goes on with its objects at once. The returned `Snapshot.write` runs on the commit thread.
    `restore` and `describe` run on the caller's thread.

    `id` is stored in the manifest and finds the handler again at restore time; `version` is the
    handler's on-disk format version, also stored. The manager refuses (UnsupportedFormatError)
    to hand a handler an item written by a newer version of the same handler id.
    """

    id: str
    version: int

    def snapshot(self, obj: Any) -> Snapshot:
        """Capture `obj`; raise TypeError/ValueError naming the key path for what it cannot store."""
        ...

    def restore(self, stored: StoredItem, target: Any = None) -> Any:
        """Read the item back: into the shape of `target` when given, else as it was saved.

        Disagreement between target and checkpoint raises MismatchError naming the key path;
        damaged files raise CorruptCheckpointError (use `stored.read_bytes`). Stateful targets
        (iterators) are restored in place and also returned.
        """
        ...

    def describe(self, stored: StoredItem) -> dict[str, Any]:
        """A JSON-serialisable summary of the stored item (structure, shapes, dtypes, sizes)."""
        ...
