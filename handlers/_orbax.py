"""Reading checkpoints written by orbax-checkpoint (and T5X's Orbax layout), with orbax itself.

A step directory that has no cairn manifest but Orbax's marks (``_CHECKPOINT_METADATA``,
``commit_success.txt``, items with ``_METADATA``) is an Orbax step. cairn lists it, reads its
metrics, and restores its items through these handlers, which call the real orbax-checkpoint
package (imported only then). Orbax steps are read-only: cairn never writes, drops or deletes
them. Orbax keeps no checksums, so there is nothing for cairn to verify in them.

orbax-checkpoint runs each of its coroutines on a fresh event loop and closes the loop as soon as
the coroutine ends, also when it ends on the first failed read of a damaged step while its other
TensorStore reads still run; each of those then completes into a closed loop and Python prints
``RuntimeError: Event loop is closed`` ("Exception ignored"), once per read. While these handlers
call orbax, `orbax_reads_finish` has it wait for those reads (at most `_FINISH_S`) first.

An Orbax step is a directory cairn did not write, so everything in it is untrusted: cairn's own
reads never follow a link (the manager's `_layouts` read the step's listing and small files
through a view of it that follows none), and before an item is handed to
orbax or TensorFlow, which would follow links and block on a FIFO, `check_tree` refuses any
entry of the item's tree that is not a directory or a regular file.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import threading
from collections.abc import Coroutine, Iterator, Mapping
from pathlib import Path
from typing import Any

from cairn.handlers._files import StoredItem, parse_json, read_no_follow
from cairn.handlers._optional import optional
from cairn.handlers.errors import CorruptCheckpointError, MismatchError

__all__ = [
    "OrbaxDatasetHandler",
    "OrbaxJsonHandler",
    "OrbaxPyTreeHandler",
    "check_tree",
    "orbax_item_kind",
    "orbax_listing_kind",
]

STEP_METADATA = "_CHECKPOINT_METADATA"
COMMIT_SUCCESS = "commit_success.txt"
_PYTREE_MARKS = ("_METADATA", "manifest.ocdbt", "_sharding", "checkpoint")


def orbax_item_kind(path: Path) -> str | None:
    """The handler id for an Orbax item directory, or None if it is not one cairn reads."""
    try:
        with os.scandir(path) as it:
            is_dir = {e.name: e.is_dir(follow_symlinks=False) for e in it}
    except OSError:  # not a directory, gone, unreadable: not an item cairn can read
        return None
    return orbax_listing_kind(is_dir)


def orbax_listing_kind(is_dir: Mapping[str, bool]) -> str | None:
    """The handler id for an Orbax item whose directory lists `is_dir` (each entry's name ->
    whether it is a real directory), or None if it is not one cairn reads. Pure: the listing
    may come from a local directory or from an object store's keys."""
    if any(mark in is_dir for mark in _PYTREE_MARKS):
        return OrbaxPyTreeHandler.id
    has_index = any(n.endswith(".index") for n in is_dir)
    per_process = any(n.startswith("process_") and d for n, d in is_dir.items())
    if has_index or per_process:  # tf.train.Checkpoint files, T5X's dataset item
        return OrbaxDatasetHandler.id
    if "metadata" in is_dir:
        return OrbaxJsonHandler.id
    return None


def check_tree(directory: Path, where: str) -> None:
    """CorruptCheckpointError naming `where` and the entry unless `directory` and its step
    directory are real directories (not links) and every entry below holds only directories
    and regular files: orbax and TensorFlow follow links (out of the step) and block on FIFOs."""

    def refuse(path: str, mode: int) -> CorruptCheckpointError:
        kind = (
            "a symbolic link"
            if stat.S_ISLNK(mode)
            else f"not a regular file ({stat.filemode(mode)})"
        )
        return CorruptCheckpointError(
            f"{where}: {path} is {kind}; cairn hands an Orbax item to orbax only when its "
            "directory holds nothing but directories and regular files"
        )

    try:
        for path in (directory.parent, directory):
            mode = os.lstat(path).st_mode
            if not stat.S_ISDIR(mode):
                raise refuse(str(path), mode)
        pending = [str(directory)]
        while pending:
            with os.scandir(pending.pop()) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        pending.append(entry.path)
                    elif not entry.is_file(follow_symlinks=False):
                        raise refuse(entry.path, entry.stat(follow_symlinks=False).st_mode)
    except FileNotFoundError as e:
        raise CorruptCheckpointError(f"{where}: {e.filename} is missing") from None
    except OSError as e:
        raise CorruptCheckpointError(f"{where} cannot be read: {e}") from None


class _ReadOnly:
    id: str
    version = 1

    def snapshot(self, obj: Any) -> Any:
        raise TypeError(
            f"{self.id} items are read-only: cairn restores Orbax steps, never writes them"
        )

    def describe(self, stored: StoredItem) -> dict[str, Any]:
        return {"kind": self.id, "path": _place(stored)}

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


_FINISH_S = 30.0
_patch_lock = threading.Lock()
_patch_users = 0  # callers inside orbax_reads_finish
_patched_out: Any = None  # orbax's own function while swapped


def _run_sync_finishing(coro: Coroutine[Any, Any, Any]) -> Any:
    """orbax's ``_run_sync_via_new_loop`` (its `run_sync` outside a running loop), but the loop
    is closed only once the tasks the coroutine left running are done (or `_FINISH_S` passed)."""
    loop = asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    finally:
        try:
            try:
                left = asyncio.all_tasks(loop)
            except RuntimeError:  # other threads' tasks kept changing asyncio's set: as orbax
                left = set()
            if left:
                done, _ = loop.run_until_complete(asyncio.wait(left, timeout=_FINISH_S))
                for task in done:  # retrieved: no "exception was never retrieved" log
                    if not task.cancelled():
                        task.exception()
        finally:
            asyncio.set_event_loop(None)
            loop.close()


@contextlib.contextmanager
def orbax_reads_finish() -> Iterator[None]:
    """While inside, orbax-checkpoint's `run_sync` waits for the reads a failed coroutine left
    running (see the module docstring). Nests and overlaps across threads; the first to enter
    swaps orbax's function, the last to leave puts it back. With an orbax that has no such
    function, it changes nothing."""
    global _patch_users, _patched_out
    try:
        from orbax.checkpoint._src import asyncio_utils as target
    except ImportError:
        target = None
    name = "_run_sync_via_new_loop"
    if target is None or not callable(getattr(target, name, None)):
        yield
        return
    with _patch_lock:
        if _patch_users == 0:
            _patched_out = getattr(target, name)
            setattr(target, name, _run_sync_finishing)
        _patch_users += 1
    try:
        yield
    finally:
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0:
                setattr(target, name, _patched_out)


def _place(stored: StoredItem) -> str:
    """Where the item is (a path, or a URL on an object store), without a download."""
    return stored.source.describe("").rstrip("/") or "."


def _where(stored: StoredItem) -> str:
    return f"step {stored.step}, item {stored.name!r} (Orbax, {_place(stored)})"


def _local(stored: StoredItem) -> Path:
    """The item's local directory: its own on disk; on an object store a private download of
    its objects, which the manager removes after the restore (`Source.release`)."""
    try:
        return stored.directory
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"step {stored.step}, item {stored.name!r}: {e}") from None


class OrbaxPyTreeHandler(_ReadOnly):
    """An item written with Orbax's StandardSave or PyTreeSave (OCDBT or not).

    Without a target its arrays come back as NumPy arrays (on any topology); with a target (arrays or ``jax.ShapeDtypeStruct`` with shardings) each leaf
    comes back in the target's shape, dtype and sharding.
    """

    id = "orbax.pytree"

    def restore(self, stored: StoredItem, target: Any = None) -> Any:
        ocp = optional("orbax.checkpoint", feature="reading a step orbax-checkpoint wrote")

        where = _where(stored)
        directory = _local(stored)
        check_tree(directory, where)
        checkpointer = ocp.PyTreeCheckpointer()
        try:
            with orbax_reads_finish():
                return self._restore(ocp, checkpointer, stored, directory, target)
        except CorruptCheckpointError:
            raise
        except FileNotFoundError as e:
            raise CorruptCheckpointError(f"{where}: {e}") from e
        except (ValueError, TypeError, OSError) as e:  # e.g. an ArraySave item, another target
            raise MismatchError(
                f"{where}: orbax could not restore it: {type(e).__name__}: {e}"
            ) from e
        except Exception as e:
            # orbax on metadata it did not expect: KeyError, AttributeError, RecursionError, ...
            raise CorruptCheckpointError(
                f"{where}: orbax could not read it: {type(e).__name__}: {e!s:.300}"
            ) from e

    @staticmethod
    def _restore(
        ocp: Any, checkpointer: Any, stored: StoredItem, directory: Path, target: Any
    ) -> Any:
        if target is not None:
            restore_args = ocp.checkpoint_utils.construct_restore_args(target)
            return checkpointer.restore(
                directory,
                args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args),
            )
        # NumPy arrays: no saved sharding needed, any topology
        jax = optional("jax", feature="reading a step orbax-checkpoint wrote")
        import numpy as np

        meta = checkpointer.metadata(directory).item_metadata
        if meta is None:  # orbax logs why and returns None
            raise CorruptCheckpointError(
                f"{_where(stored)}: orbax could not read its metadata (its _METADATA file or "
                "the metadata of one of its arrays)"
            )
        as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta.tree)
        return checkpointer.restore(directory, args=ocp.args.PyTreeRestore(restore_args=as_numpy))


class OrbaxJsonHandler(_ReadOnly):
    """An item written with Orbax's JsonSave (a file named ``metadata``)."""

    id = "orbax.json"

    def restore(self, stored: StoredItem, target: Any = None) -> Any:
        del target
        where = _where(stored)
        directory = _local(stored)
        check_tree(directory, where)
        path = directory / "metadata"
        try:
            data = read_no_follow(path)
        except OSError as e:
            raise CorruptCheckpointError(f"{where}: {path} cannot be read: {e}") from e
        return parse_json(data, f"{where}: {path}")


class OrbaxDatasetHandler(_ReadOnly):
    """T5X's dataset item in the Orbax layout: a ``tf.train.Checkpoint`` of the tf.data iterator
    (``train_ds-XXX-of-YYY.*``; with several processes under ``process_<i>-of-<n>/``). Restore
    needs the iterator (``iter()`` of the same pipeline), which is moved in place and returned."""

    id = "orbax.tf_dataset"

    def restore(self, stored: StoredItem, target: Any = None) -> Any:
        from cairn.handlers._files import writing_process

        if target is None or getattr(target, "_iterator_resource", None) is None:
            raise MismatchError(
                f"step {stored.step}, item {stored.name!r} is T5X's tf.data iterator: give the "
                "iterator to restore into, iter() of the same pipeline"
            )
        tf = optional("tensorflow", feature="a tf.data iterator item orbax-checkpoint wrote")

        where = _where(stored)
        directory = _local(stored)
        check_tree(directory, where)
        index, count = writing_process()
        if count > 1:
            directory = directory / f"process_{index}-of-{count}"
        prefixes = sorted(p.with_suffix("") for p in directory.glob("*.index"))
        if len(prefixes) != 1:
            raise CorruptCheckpointError(
                f"step {stored.step}, item {stored.name!r}: expected one tf.train.Checkpoint in "
                f"{directory}, found {[p.name for p in prefixes]}"
            )
        try:
            tf.train.Checkpoint(ds=target).read(str(prefixes[0])).assert_consumed()
        except AssertionError as e:  # assert_consumed: not this pipeline's iterator
            raise MismatchError(f"{where}: {e}") from e
        except Exception as e:  # tf.errors.OpError, IndexError ("Read less bytes than requested")
            raise CorruptCheckpointError(
                f"{where}: TensorFlow cannot read it: {type(e).__name__}: {e!s:.300}"
            ) from e
        return target
