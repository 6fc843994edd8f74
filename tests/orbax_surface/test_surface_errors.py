"""The errors Orbax raises for misuse, and that nothing is written when one is raised."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp
import pytest
from orbax.checkpoint import checkpoint_managers as policies
from orbax_surface.surface_util import jax_state, opts, save_all, steps_on_disk
from support.treeutil import dir_state


def test_save_without_args_is_a_value_error(impl: Any, root: Path) -> None:
    with impl(root) as manager:
        with pytest.raises(ValueError, match="Must provide `args`"):
            manager.save(0)
        assert manager.all_steps() == []
    assert steps_on_disk(root) == []


def test_checkpoint_args_passed_positionally_are_a_value_error(impl: Any, root: Path) -> None:
    with impl(root) as manager:
        with pytest.raises(ValueError, match="args="):
            manager.save(0, ocp.args.StandardSave(jax_state()))
        assert manager.all_steps() == []
    assert steps_on_disk(root) == []


def test_a_composite_in_default_item_mode_is_a_value_error(impl: Any, root: Path) -> None:
    with impl(root) as manager:
        manager.save(0, args=ocp.args.StandardSave(jax_state()))  # fixes the default-item mode
        manager.wait_until_finished()
        with pytest.raises(ValueError, match="Composite"):
            manager.save(
                1, args=ocp.args.Composite(state=ocp.args.StandardSave(jax_state())), force=True
            )
        manager.wait_until_finished()
        assert manager.all_steps() == [0]
    assert steps_on_disk(root) == [0]


def test_a_composite_with_a_single_item_handler_is_a_value_error(impl: Any, root: Path) -> None:
    with (
        impl(root, item_handlers=ocp.StandardCheckpointHandler()) as manager,
        pytest.raises(ValueError, match="Composite"),
    ):
        manager.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave(jax_state())))
    assert steps_on_disk(root) == []


def test_bare_args_in_multi_item_mode_are_a_value_error(impl: Any, root: Path) -> None:
    with (
        impl(root, item_names=("state", "meta")) as manager,
        pytest.raises(ValueError, match="Composite"),
    ):
        manager.save(0, args=ocp.args.StandardSave(jax_state()))
    with impl(root / "b") as manager:
        save_all(manager, [0])  # a Composite fixes the multi-item mode
        manager.wait_until_finished()
        with pytest.raises(ValueError, match="Composite"):
            manager.save(1, args=ocp.args.StandardSave(jax_state()))
        manager.wait_until_finished()
        assert manager.all_steps() == [0]


def test_an_item_outside_fixed_item_names_is_a_value_error(impl: Any, root: Path) -> None:
    with impl(root, item_names=("params",)) as manager:
        with pytest.raises(ValueError):
            manager.save(0, args=ocp.args.Composite(other=ocp.args.StandardSave(jax_state())))
        manager.wait_until_finished()
        assert manager.all_steps() == []
        # the named item itself is fine
        assert manager.save(1, args=ocp.args.Composite(params=ocp.args.StandardSave(jax_state())))
        manager.wait_until_finished()
        assert manager.all_steps() == [1]


def test_item_names_with_a_single_handler_is_a_value_error(impl: Any, root: Path) -> None:
    with pytest.raises(ValueError):
        impl(root, item_names=("state",), item_handlers=ocp.StandardCheckpointHandler())


def test_an_unknown_best_mode_is_a_value_error(impl: Any, root: Path) -> None:
    with pytest.raises(ValueError, match="best_mode"):
        opts(best_fn=lambda m: m["acc"], best_mode="median")
    options = opts(best_fn=lambda m: m["acc"])
    options.best_mode = "median"  # the dataclass is mutable: the manager checks it too
    with pytest.raises(ValueError):
        impl(root, options=options)
    assert steps_on_disk(root.parent) == []


def test_preservation_policy_with_max_to_keep_is_a_value_error(impl: Any, root: Path) -> None:
    options = opts(max_to_keep=3, preservation_policy=policies.LatestN(n=2))
    with pytest.raises(ValueError, match="preservation_policy"):
        impl(root, options=options)


def test_restore_of_a_missing_step_is_file_not_found(impl: Any, root: Path) -> None:
    with impl(root) as manager:
        save_all(manager, [0])
        manager.wait_until_finished()
        with pytest.raises(FileNotFoundError):
            manager.restore(3, args=ocp.args.Composite(state=ocp.args.StandardRestore()))


def test_restore_with_no_steps_is_file_not_found(impl: Any, root: Path) -> None:
    with impl(root) as manager:
        with pytest.raises(FileNotFoundError):
            manager.restore(None)
        with pytest.raises(FileNotFoundError):
            manager.restore(None, args=ocp.args.StandardRestore())


def test_delete_of_a_missing_step_is_file_not_found(impl: Any, root: Path) -> None:
    with impl(root) as manager:
        save_all(manager, [0])
        manager.wait_until_finished()
        before = dir_state(root)
        with pytest.raises(FileNotFoundError):
            manager.delete(1)
        assert manager.all_steps() == [0]
    assert dir_state(root) == before


def test_restore_of_an_item_not_in_the_checkpoint_is_a_key_error(impl: Any, root: Path) -> None:
    with impl(root) as manager:
        save_all(manager, [0])
        manager.wait_until_finished()
    with impl(root) as fresh, pytest.raises(KeyError, match="missing"):
        fresh.restore(0, args=ocp.args.Composite(missing=ocp.args.JsonRestore()))
