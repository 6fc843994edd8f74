"""Reading checkpoints written by orbax-checkpoint (and T5X's Orbax layout), with orbax itself.

A step directory that has no cairn manifest but Orbax's marks (``_CHECKPOINT_METADATA``,
``commit_success.txt``, items with ``_METADATA``) is an Orbax step. cairn lists it, reads its
metrics, and restores its items through these handlers, which call the real orbax-checkpoint
package (imported only then). Orbax steps are read-only: cairn never writes, drops or deletes
them. Orbax keeps no checksums, so there is nothing for cairn to verify in them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cairn.handlers._files import StoredItem
from cairn.handlers.errors import CorruptCheckpointError, MismatchError

__all__ = [
    "OrbaxDatasetHandler",
    "OrbaxJsonHandler",
    "OrbaxPyTreeHandler",
    "orbax_item_kind",
]

STEP_METADATA = "_CHECKPOINT_METADATA"
COMMIT_SUCCESS = "commit_success.txt"
_PYTREE_MARKS = ("_METADATA", "manifest.ocdbt", "_sharding", "checkpoint")


def orbax_item_kind(path: Path) -> str | None:
    """The handler id for an Orbax item directory, or None if it is not one cairn reads."""
    names = {p.name for p in path.iterdir()} if path.is_dir() else set()
    if any(mark in names for mark in _PYTREE_MARKS):
        return OrbaxPyTreeHandler.id
    has_index = any(n.endswith(".index") for n in names)
    per_process = any(n.startswith("process_") and (path / n).is_dir() for n in names)
    if has_index or per_process:  # tf.train.Checkpoint files, T5X's dataset item
        return OrbaxDatasetHandler.id
    if "metadata" in names:
        return OrbaxJsonHandler.id
    return None


class _ReadOnly:
    id: str
    version = 1

    def snapshot(self, obj: Any) -> Any:
        raise TypeError(
            f"{self.id} items are read-only: cairn restores Orbax steps, never writes them"
        )

    def describe(self, stored: StoredItem) -> dict[str, Any]:
        return {"kind": self.id, "path": str(stored.directory)}

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class OrbaxPyTreeHandler(_ReadOnly):
    """An item written with Orbax's StandardSave or PyTreeSave (OCDBT or not).

    Without a target its arrays come back as NumPy arrays (on any topology); with a target (arrays or ``jax.ShapeDtypeStruct`` with shardings) each leaf
    comes back in the target's shape, dtype and sharding.
    """

    id = "orbax.pytree"

    def restore(self, stored: StoredItem, target: Any = None) -> Any:
        import orbax.checkpoint as ocp

        checkpointer = ocp.PyTreeCheckpointer()
        where = f"step {stored.step}, item {stored.name!r} (Orbax, {stored.directory})"
        try:
            if target is None:  # NumPy arrays: no saved sharding needed, any topology
                import jax
                import numpy as np

                meta = checkpointer.metadata(stored.directory).item_metadata
                as_numpy = jax.tree.map(
                    lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta.tree
                )
                return checkpointer.restore(
                    stored.directory, args=ocp.args.PyTreeRestore(restore_args=as_numpy)
                )
            restore_args = ocp.checkpoint_utils.construct_restore_args(target)
            return checkpointer.restore(
                stored.directory,
                args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args),
            )
        except FileNotFoundError as e:
            raise CorruptCheckpointError(f"{where}: {e}") from e
        except (ValueError, TypeError, OSError) as e:  # e.g. an ArraySave item, another target
            raise MismatchError(
                f"{where}: orbax could not restore it: {type(e).__name__}: {e}"
            ) from e


class OrbaxJsonHandler(_ReadOnly):
    """An item written with Orbax's JsonSave (a file named ``metadata``)."""

    id = "orbax.json"

    def restore(self, stored: StoredItem, target: Any = None) -> Any:
        del target
        path = stored.directory / "metadata"
        try:
            return json.loads(path.read_bytes())
        except (OSError, ValueError) as e:
            raise CorruptCheckpointError(
                f"step {stored.step}, item {stored.name!r}: {path} cannot be read: {e}"
            ) from e


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
        import tensorflow as tf

        directory = stored.directory
        index, count = writing_process()
        if count > 1:
            directory = directory / f"process_{index}-of-{count}"
        prefixes = sorted(p.with_suffix("") for p in directory.glob("*.index"))
        if len(prefixes) != 1:
            raise CorruptCheckpointError(
                f"step {stored.step}, item {stored.name!r}: expected one tf.train.Checkpoint in "
                f"{directory}, found {[p.name for p in prefixes]}"
            )
        tf.train.Checkpoint(ds=target).read(str(prefixes[0])).assert_consumed()
        return target
