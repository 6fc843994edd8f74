"""The two-phase Handler protocol."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from cairn.handlers._files import Destination, FileRecord, StoredItem

__all__ = [
    "Handler",
    "Snapshot",
    "check_item",
    "release_snapshot",
    "settle_snapshot",
    "snapshot_version",
]


class Snapshot(Protocol):
    """What a handler captured on the caller thread, ready to be written in the background.

    A snapshot owns its data: nothing the caller does to the original object after `save()` returns
    (mutating, overwriting, donating arrays) may change what `write` stores.

    Optional, besides the protocol (the manager calls them through `settle_snapshot`,
    `release_snapshot`, `snapshot_version` and `share_snapshot`, which do without them):

    - ``settle()``: a snapshot whose copies of the caller's data still run when `snapshot`
      returns (the train state's staging copies) waits for them there. The manager hands the
      snapshot to the commit thread first and calls `settle` before ``save()`` returns, so
      `write` may start meanwhile and must itself wait for what it reads. Without `settle`, the
      snapshot is complete when `snapshot` returns.
    - ``release()``: give back what the snapshot holds (the train state's staging memory) once
      a writer process is done with it, or when the save never reached one; after
      ``share(writes)``, each call counts as one of the writes, and the last one gives it back.
    - ``version``: which of its handler's versions the snapshot writes (the train state's
      layout), stored in the manifest instead of the handler's `version`.
    - ``share(writes)`` (through `share_snapshot`): `write` will be called `writes` times,
      perhaps at once from two threads (a local tier's part and the persistent step); what
      it releases after a write waits for the last one.
    """

    def write(self, dest: Destination) -> Sequence[FileRecord]:
        """Write the captured state through `dest` and return the files written.

        Runs on the manager's commit thread (or the caller's, for synchronous saves). `dest` is
        the item's place in an uncommitted step, empty: a temporary directory on disk, or a
        prefix in an object store that no reader sees before the manifest is written. Create
        each file with ``dest.write_file(relpath, data)`` or ``with dest.create(relpath) as f``,
        which return its `FileRecord` (size and content hash, computed as the bytes go out), and
        return those records. A file not returned is not part of the step. The storage makes
        everything durable afterwards. A handler that can only write through a path may use
        ``os.fspath(dest)`` / ``dest / name``: a local directory (see `Destination`).
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

    Optional, besides the protocol: ``check(stored) -> None``, what `restore` would refuse
    before it reads any data (see `check_item`, through which ``verify`` calls it).
    """

    id: str
    version: int

    def snapshot(self, obj: Any) -> Snapshot:
        """Capture `obj`; raise TypeError/ValueError naming the key path for what it cannot store."""
        ...

    def restore(self, stored: StoredItem, target: Any = None) -> Any:
        """Read the item back: into the shape of `target` when given, else as it was saved.

        Disagreement between target and checkpoint raises MismatchError naming the key path;
        damaged files raise CorruptCheckpointError (use `stored.read_bytes` or
        `stored.read_into`, which read from wherever the step is and check what they read). Stateful targets
        (iterators) are restored in place and also returned.
        """
        ...

    def describe(self, stored: StoredItem) -> dict[str, Any]:
        """A JSON-serialisable summary of the stored item (structure, shapes, dtypes, sizes)."""
        ...


# The optional hooks, as the manager calls them. Handlers and snapshots do not inherit from the
# protocols above (they are structural), so a hook one does not define is looked up here, and
# these do nothing (or take the handler's own value) where it is absent.


def settle_snapshot(snapshot: Snapshot) -> None:
    """The snapshot's ``settle()`` (see `Snapshot`), where it has one."""
    settle = getattr(snapshot, "settle", None)
    if callable(settle):
        settle()


def release_snapshot(snapshot: Snapshot) -> None:
    """The snapshot's ``release()`` (see `Snapshot`), where it has one."""
    release = getattr(snapshot, "release", None)
    if callable(release):
        release()


def share_snapshot(snapshot: Snapshot, writes: int) -> None:
    """The snapshot's ``share(writes)`` (see `Snapshot`), where it has one: `writes` writes of
    it are coming (a local tier's part and the persistent step). A snapshot without it writes
    what it captured as often as it is asked."""
    share = getattr(snapshot, "share", None)
    if share is not None:
        share(writes)


def snapshot_version(handler: Handler, snapshot: Snapshot) -> int:
    """The version the manifest records for an item: the snapshot's ``version`` (see
    `Snapshot`), else its handler's."""
    version: int = getattr(snapshot, "version", handler.version)
    return version


def check_item(handler: Handler, stored: StoredItem) -> None:
    """The handler's ``check(stored)``, where it has one: what `restore` would refuse before it
    reads any data (metadata that does not parse or does not agree with the files' records), as
    CorruptCheckpointError naming the file. ``verify`` calls it after it checked every file's
    content (`TrainStateHandler`, `JsonHandler` and the iterator handlers have it)."""
    check = getattr(handler, "check", None)
    if check is not None:
        check(stored)
