"""Root metadata (written once, Orbax's RootMetadata), per-step custom metadata and metrics, and
item metadata."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax_surface.surface_util import jax_state, opts, save_all
from support.treeutil import dir_state


def test_root_metadata_is_orbax_root_metadata_with_the_given_dict(impl: Any, root: Path) -> None:
    custom = {"model": "t5", "layers": 12, "tags": ["a", "b"]}
    with impl(root, metadata=custom) as manager:
        got = manager.metadata()
        assert isinstance(got, ocp.metadata.RootMetadata)
        assert got == ocp.metadata.RootMetadata(custom_metadata=custom)
        save_all(manager, [0])
    with impl(root) as fresh:
        assert fresh.metadata() == ocp.metadata.RootMetadata(custom_metadata=custom)


def test_the_first_managers_root_metadata_wins(impl: Any, root: Path) -> None:
    with impl(root, metadata={"run": 1}):
        pass
    before = dir_state(root)
    with impl(root, metadata={"run": 2}) as second:
        assert second.metadata().custom_metadata == {"run": 1}
    assert dir_state(root) == before
    with impl(root, metadata={"run": 3}, options=opts(read_only=True)) as reader:
        assert reader.metadata().custom_metadata == {"run": 1}


def test_without_metadata_the_root_metadata_is_empty_and_not_written(impl: Any, root: Path) -> None:
    with impl(root) as manager:
        assert manager.metadata().custom_metadata == {}
        save_all(manager, [0])
        manager.wait_until_finished()
    assert not (root / "metadata").exists()


def test_save_root_metadata_false_writes_none(impl: Any, root: Path) -> None:
    with impl(root, metadata={"a": 1}, options=opts(save_root_metadata=False)) as manager:
        assert manager.metadata().custom_metadata == {}
    assert not (root / "metadata").exists()


def test_a_read_only_manager_returns_its_metadata_argument_without_writing_it(
    impl: Any, root: Path
) -> None:
    with impl(root) as manager:
        save_all(manager, [0])
    before = dir_state(root)
    with impl(root, metadata={"given": True}, options=opts(read_only=True)) as reader:
        assert reader.metadata() == ocp.metadata.RootMetadata(custom_metadata={"given": True})
    assert dir_state(root) == before
    with impl(root) as fresh:
        assert fresh.metadata().custom_metadata == {}


def test_save_custom_metadata_is_the_steps_custom_metadata(impl: Any, root: Path) -> None:
    with impl(root) as manager:
        save_all(manager, [0], custom_metadata={"data_epoch": 3, "note": "warmup"})
        save_all(manager, [1])
        manager.wait_until_finished()
        assert manager.metadata(0).custom_metadata == {"data_epoch": 3, "note": "warmup"}
        assert manager.metadata(1).custom_metadata == {}
    with impl(root) as fresh:
        assert fresh.metadata(0).custom_metadata == {"data_epoch": 3, "note": "warmup"}


def test_step_metadata_has_the_metrics_saved_with_best_fn(impl: Any, root: Path) -> None:
    options = opts(best_fn=lambda m: m["loss"], best_mode="min")
    with impl(root, options=options) as manager:
        save_all(manager, [0], metrics={"loss": 1.5, "acc": 0.25})
        manager.wait_until_finished()
        assert manager.metadata(0).metrics == {"loss": 1.5, "acc": 0.25}
        assert manager.metrics(0) == {"loss": 1.5, "acc": 0.25}
    with impl(root, options=options) as fresh:
        assert fresh.metadata(0).metrics == {"loss": 1.5, "acc": 0.25}
        assert fresh.metrics(0) == {"loss": 1.5, "acc": 0.25}


def test_item_metadata_describes_each_saved_item(impl: Any, root: Path) -> None:
    state = {
        "w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3),
        "n": np.arange(4, dtype=np.int16),
        "c": {"x": jnp.ones(2, dtype=jnp.int32)},
    }
    with impl(root) as manager:
        manager.save(
            0,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave({"a": 1})
            ),
        )
        manager.wait_until_finished()
        metadata = manager.item_metadata(0)
        assert sorted(metadata.keys()) == ["meta", "state"]
        assert metadata.state["w"].shape == (2, 3)
        assert metadata.state["w"].dtype == jnp.float32
        assert metadata.state["n"].shape == (4,)
        assert metadata.state["n"].dtype == np.int16
        assert metadata.state["c"]["x"].dtype == jnp.int32
        # the usual use: an abstract target built from the metadata
        abstract = jax.tree.map(
            lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), metadata.state.tree
        )
        restored = manager.restore(
            0, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
        )
        for key in ("w", "n"):
            np.testing.assert_array_equal(np.asarray(restored.state[key]), np.asarray(state[key]))
    with impl(root) as fresh:  # without handlers, the item names are still known
        assert sorted(fresh.item_metadata(0).keys()) == ["meta", "state"]


def test_item_metadata_of_the_default_item_with_its_handler(impl: Any, root: Path) -> None:
    with impl(root) as manager:
        manager.save(3, args=ocp.args.StandardSave(jax_state()))
        manager.wait_until_finished()
        assert manager.item_metadata(3)["w"].shape == (2, 3)
    with impl(root, item_handlers=ocp.StandardCheckpointHandler()) as fresh:
        metadata = fresh.item_metadata(3)
        assert metadata["w"].shape == (2, 3) and metadata["w"].dtype == jnp.float32
        assert metadata["nested"]["count"].dtype == jnp.int32
