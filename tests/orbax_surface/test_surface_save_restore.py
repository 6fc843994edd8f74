"""Round trips through every `ocp.args` type a user passes, with Orbax's return types."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grain
import grain.python
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from orbax_surface.surface_util import assert_same_tree, jax_state, numpy_state, opts


def single_device_sharding() -> NamedSharding:
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    return NamedSharding(mesh, PartitionSpec())


def test_standard_save_restores_bit_exact_into_an_abstract_target(impl: Any, root: Path) -> None:
    state = jax_state(2.0)
    with impl(root) as manager:
        assert manager.save(3, args=ocp.args.StandardSave(state)) is True
        manager.wait_until_finished()
        target = jax.eval_shape(lambda: state)
        restored = manager.restore(3, args=ocp.args.StandardRestore(target))
    assert_same_tree(restored, state)


def test_standard_restore_places_arrays_on_the_target_sharding(impl: Any, root: Path) -> None:
    state = jax_state(1.5)
    sharding = single_device_sharding()
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), state
    )
    with impl(root) as manager:
        manager.save(0, args=ocp.args.StandardSave(state))
        manager.wait_until_finished()
    with impl(root) as fresh:  # a new process restarting: only the target says what to build
        restored = fresh.restore(0, args=ocp.args.StandardRestore(target))
    assert_same_tree(restored, state)
    for leaf in jax.tree.leaves(restored):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)


def test_pytree_restore_args_choose_the_restored_types(impl: Any, root: Path) -> None:
    sharding = single_device_sharding()
    tree = {"step": 12, "w": jnp.arange(8, dtype=jnp.float32), "n": np.arange(3, dtype=np.int64)}
    restore_args = {
        "step": ocp.RestoreArgs(restore_type=int),
        "w": ocp.ArrayRestoreArgs(sharding=sharding),
        "n": ocp.RestoreArgs(restore_type=np.ndarray),
    }
    with impl(root) as manager:
        manager.save(1, args=ocp.args.PyTreeSave(tree))
        manager.wait_until_finished()
    with impl(root) as fresh:
        restored = fresh.restore(
            1, args=ocp.args.PyTreeRestore(item=tree, restore_args=restore_args)
        )
    assert type(restored["step"]) is int and restored["step"] == 12
    assert isinstance(restored["w"], jax.Array)
    assert restored["w"].sharding.is_equivalent_to(sharding, 1)
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(8, dtype=np.float32))
    assert isinstance(restored["n"], np.ndarray) and restored["n"].dtype == np.int64
    np.testing.assert_array_equal(restored["n"], np.arange(3))


def test_pytree_restore_casts_to_the_requested_dtype(impl: Any, root: Path) -> None:
    tree = {"w": np.arange(5, dtype=np.float32) + 0.5}
    with impl(root) as manager:
        manager.save(0, args=ocp.args.PyTreeSave(tree))
        manager.wait_until_finished()
        restored = manager.restore(
            0,
            args=ocp.args.PyTreeRestore(
                item=tree,
                restore_args={"w": ocp.RestoreArgs(restore_type=np.ndarray, dtype=np.float16)},
            ),
        )
    assert restored["w"].dtype == np.float16
    np.testing.assert_array_equal(restored["w"], tree["w"].astype(np.float16))


def test_json_round_trip_gives_the_same_dict(impl: Any, root: Path) -> None:
    meta = {"name": "run-7", "lr": 0.25, "layers": [1, 2, 3], "nested": {"ok": True, "n": None}}
    with impl(root) as manager:
        manager.save(0, args=ocp.args.JsonSave(meta))
        manager.wait_until_finished()
    with impl(root) as fresh:
        assert fresh.restore(0, args=ocp.args.JsonRestore()) == meta


def test_array_round_trip(impl: Any, root: Path) -> None:
    array = np.arange(12, dtype=np.int32).reshape(3, 4)
    with impl(root) as manager:
        manager.save(0, args=ocp.args.ArraySave(array))
        manager.wait_until_finished()
    with impl(root) as fresh:
        restored = fresh.restore(0, args=ocp.args.ArrayRestore())
    np.testing.assert_array_equal(np.asarray(restored), array)
    assert restored.dtype == np.int32 and restored.shape == (3, 4)


def test_composite_result_gives_each_item_by_attribute_and_by_key(impl: Any, root: Path) -> None:
    state, meta, extra = jax_state(3.0), {"epoch": 4}, numpy_state()
    with impl(root) as manager:
        saved = manager.save(
            5,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                meta=ocp.args.JsonSave(meta),
                extra=ocp.args.PyTreeSave(extra),
            ),
        )
        assert saved is True
        manager.wait_until_finished()
    with impl(root) as fresh:
        restored = fresh.restore(
            5,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(jax.eval_shape(lambda: state)),
                meta=ocp.args.JsonRestore(),
                extra=ocp.args.PyTreeRestore(),
            ),
        )
    assert isinstance(restored, ocp.args.Composite)
    assert sorted(restored.keys()) == ["extra", "meta", "state"]
    assert "meta" in restored and "missing" not in restored
    assert restored.meta == restored["meta"] == meta
    assert_same_tree(restored.state, state)
    assert_same_tree(restored["extra"], extra)
    assert (root / "5" / "state").is_dir() and (root / "5" / "meta").is_dir()


def test_composite_restore_of_some_items_returns_only_those(impl: Any, root: Path) -> None:
    with impl(root) as manager:
        manager.save(
            0,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(jax_state()), meta=ocp.args.JsonSave({"a": 1})
            ),
        )
        manager.wait_until_finished()
        restored = manager.restore(0, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    assert list(restored.keys()) == ["meta"]
    assert restored.meta == {"a": 1}


def test_bare_args_are_the_default_item_and_restore_returns_the_bare_item(
    impl: Any, root: Path
) -> None:
    state = jax_state(4.0)
    with impl(root) as manager:
        manager.save(2, args=ocp.args.StandardSave(state))
        manager.wait_until_finished()
        assert (root / "2" / "default").is_dir()
    with impl(root) as fresh:
        restored = fresh.restore(2, args=ocp.args.StandardRestore(jax.eval_shape(lambda: state)))
        assert not isinstance(restored, ocp.args.Composite)
        assert_same_tree(restored, state)
        # no args: the default item is still returned bare
        assert_same_tree(fresh.restore(2), state)


def test_numpy_leaves_come_back_as_numpy_with_their_dtype(impl: Any, root: Path) -> None:
    tree = numpy_state(3.0)
    with impl(root) as manager:
        manager.save(0, args=ocp.args.StandardSave(tree))
        manager.wait_until_finished()
    with impl(root) as fresh:
        assert_same_tree(fresh.restore(0), tree)
        assert_same_tree(fresh.restore(0, args=ocp.args.StandardRestore(tree)), tree)


def test_python_scalars_come_back_as_python_scalars(impl: Any, root: Path) -> None:
    tree = {"i": 3, "f": 2.5, "n": np.arange(3)}
    with impl(root) as manager:
        manager.save(0, args=ocp.args.StandardSave(tree))
        manager.wait_until_finished()
    with impl(root) as fresh:
        restored = fresh.restore(0)
    assert type(restored["i"]) is int and restored["i"] == 3
    assert type(restored["f"]) is float and restored["f"] == 2.5
    assert isinstance(restored["n"], np.ndarray)


def test_restore_without_args_in_a_new_manager_returns_every_item(impl: Any, root: Path) -> None:
    state, meta, extra = jax_state(5.0), {"epoch": 9, "tag": "x"}, numpy_state(2.0)
    with impl(root) as manager:
        manager.save(
            7,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                meta=ocp.args.JsonSave(meta),
                extra=ocp.args.PyTreeSave(extra),
            ),
        )
        manager.wait_until_finished()
    with impl(root) as fresh:
        restored = fresh.restore(7)
        latest = fresh.restore(None)
    for result in (restored, latest):
        assert sorted(result.keys()) == ["extra", "meta", "state"]
        assert_same_tree(result.state, state)
        assert result.meta == meta
        assert_same_tree(result.extra, extra)


def test_restore_defaults_to_the_latest_step(impl: Any, root: Path) -> None:
    with impl(root) as manager:
        for step in (1, 4, 9):
            manager.save(step, args=ocp.args.JsonSave({"step": step}))
        manager.wait_until_finished()
        assert manager.restore(None, args=ocp.args.JsonRestore()) == {"step": 9}
        assert manager.restore(4, args=ocp.args.JsonRestore()) == {"step": 4}


def test_partial_restore_returns_only_the_requested_subtree(impl: Any, root: Path) -> None:
    tree = {"params": {"w": np.arange(4.0), "b": np.ones(2)}, "opt": {"mu": np.zeros(4)}}
    with impl(root) as manager:
        manager.save(0, args=ocp.args.PyTreeSave(tree))
        manager.wait_until_finished()
    with impl(root) as fresh:
        subtree = {"params": {"w": np.zeros(4)}}
        restored = fresh.restore(0, args=ocp.args.PyTreeRestore(item=subtree, partial_restore=True))
    assert list(restored) == ["params"] and list(restored["params"]) == ["w"]
    np.testing.assert_array_equal(restored["params"]["w"], np.arange(4.0))


def test_a_structure_mismatch_without_partial_restore_is_a_value_error(
    impl: Any, root: Path
) -> None:
    tree = {"params": {"w": np.arange(4.0), "b": np.ones(2)}, "opt": {"mu": np.zeros(4)}}
    with impl(root) as manager:
        manager.save(0, args=ocp.args.PyTreeSave(tree))
        manager.wait_until_finished()
        with pytest.raises(ValueError):
            manager.restore(0, args=ocp.args.PyTreeRestore(item={"params": {"w": np.zeros(4)}}))


def test_placeholder_leaves_are_not_restored(impl: Any, root: Path) -> None:
    tree = {"w": np.arange(4.0), "b": np.ones(2), "big": np.full(6, 7, dtype=np.int32)}
    with impl(root) as manager:
        manager.save(0, args=ocp.args.PyTreeSave(tree))
        manager.wait_until_finished()
    with impl(root) as fresh:
        item = {"w": np.zeros(4), "b": np.zeros(2), "big": ocp.PLACEHOLDER}
        restored = fresh.restore(0, args=ocp.args.PyTreeRestore(item=item))
    assert restored["big"] is ocp.PLACEHOLDER
    np.testing.assert_array_equal(restored["w"], tree["w"])
    np.testing.assert_array_equal(restored["b"], tree["b"])


def grain_iterator() -> Any:
    return iter(grain.MapDataset.range(40).shuffle(seed=3).map(lambda x: x * 10).to_iter_dataset())


def grain_loader_iterator() -> Any:
    source = grain.sources.RangeDataSource(0, 30, 1)
    sampler = grain.samplers.IndexSampler(
        num_records=len(source), shuffle=True, seed=5, num_epochs=1
    )
    return iter(grain.DataLoader(data_source=source, sampler=sampler, worker_count=0))


@pytest.mark.parametrize("make_iterator", [grain_iterator, grain_loader_iterator])
def test_a_grain_iterator_resumes_at_the_same_element(
    impl: Any, root: Path, make_iterator: Any
) -> None:
    iterator = make_iterator()
    for _ in range(7):
        next(iterator)
    with impl(root) as manager:
        manager.save(
            7,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave({"w": np.arange(3.0)}),
                data=grain.python.PyGrainCheckpointSave(iterator),
            ),
        )
        manager.wait_until_finished()
    expected = [next(iterator) for _ in range(5)]
    with impl(root) as fresh:
        restored = fresh.restore(
            7,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(),
                data=grain.python.PyGrainCheckpointRestore(make_iterator()),
            ),
        )
    resumed = restored.data
    assert [next(resumed) for _ in range(5)] == expected
    np.testing.assert_array_equal(restored.state["w"], np.arange(3.0))


def test_a_grain_default_item_resumes_at_the_same_element(impl: Any, root: Path) -> None:
    iterator = grain_iterator()
    for _ in range(3):
        next(iterator)
    with impl(root) as manager:
        manager.save(3, args=grain.python.PyGrainCheckpointSave(iterator))
        manager.wait_until_finished()
    expected = [next(iterator) for _ in range(4)]
    with impl(root) as fresh:
        resumed = fresh.restore(3, args=grain.python.PyGrainCheckpointRestore(grain_iterator()))
    assert [next(resumed) for _ in range(4)] == expected


def test_a_new_manager_restores_what_the_old_one_saved_with_the_same_args(
    impl: Any, root: Path
) -> None:
    state = jax_state(7.0)
    args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave({"e": 1}))
    with impl(root, options=opts(max_to_keep=3)) as manager:
        manager.save(0, args=args)
    with impl(root, options=opts(max_to_keep=3)) as fresh:
        assert fresh.all_steps() == [0]
        restored = fresh.restore(
            fresh.latest_step(),
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(jax.eval_shape(lambda: state)),
                meta=ocp.args.JsonRestore(),
            ),
        )
    assert_same_tree(restored.state, state)
    assert restored.meta == {"e": 1}


@pytest.mark.parametrize("enable_async", [True, False])
def test_synchronous_and_async_managers_write_the_same_readable_steps(
    impl: Any, root: Path, enable_async: bool
) -> None:
    state = numpy_state(4.0)
    with impl(root, options=opts(enable_async_checkpointing=enable_async)) as manager:
        assert manager.save(1, args=ocp.args.StandardSave(state)) is True
        if not enable_async:
            # a synchronous save is finished when save() returns
            assert manager.is_saving_in_progress() is False
            assert (root / "1" / "default").is_dir()
        manager.wait_until_finished()
        assert manager.all_steps() == [1]
    with impl(root, options=opts(enable_async_checkpointing=not enable_async)) as other:
        assert_same_tree(other.restore(1), state)


def test_item_handlers_fix_each_items_kind_for_save_and_restore(impl: Any, root: Path) -> None:
    handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
    state = jax_state(2.0)
    with impl(root, item_handlers=handlers) as manager:
        manager.save(
            0,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave({"k": "v"})
            ),
        )
        manager.wait_until_finished()
    with impl(
        root,
        item_handlers={
            "state": ocp.StandardCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(),
        },
    ) as fresh:
        # None: the item's configured handler restores it
        restored = fresh.restore(0, args=ocp.args.Composite(state=None, meta=None))
        assert_same_tree(restored.state, state)
        assert restored.meta == {"k": "v"}


def test_a_handler_registry_gives_each_item_its_handler(impl: Any, root: Path) -> None:
    def registry() -> Any:
        handlers = ocp.handlers.DefaultCheckpointHandlerRegistry()
        handlers.add("state", ocp.args.StandardSave, ocp.StandardCheckpointHandler)
        handlers.add("state", ocp.args.StandardRestore, ocp.StandardCheckpointHandler)
        return handlers

    state = jax_state(3.0)
    with impl(root, handler_registry=registry()) as manager:
        manager.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
        manager.wait_until_finished()
    with impl(root, handler_registry=registry()) as fresh:
        assert_same_tree(fresh.restore(1).state, state)
        restored = fresh.restore(1, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
        assert_same_tree(restored.state, state)


def test_restore_from_another_directory(impl: Any, root: Path) -> None:
    with impl(root / "elsewhere") as other:
        other.save(5, args=ocp.args.JsonSave({"from": "elsewhere"}))
    with impl(root / "here") as manager:
        manager.save(1, args=ocp.args.JsonSave({"from": "here"}))
        manager.wait_until_finished()
        got = manager.restore(5, args=ocp.args.JsonRestore(), directory=root / "elsewhere")
        assert got == {"from": "elsewhere"}
        assert manager.all_steps() == [1]
