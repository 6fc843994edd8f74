"""Continuing a run across the import swap: steps real Orbax wrote are listed, restored and
continued by the manager under test.

The first writer is always `orbax.checkpoint.CheckpointManager`, whatever `impl` is. On Orbax these
tests pass trivially; that is the point: the swap must change nothing. (What happens on disk to
the Orbax steps that retention drops is where the drop-in differs on purpose: test_cairn_only.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grain
import grain.python
import jax
import orbax.checkpoint as ocp
from orbax_surface.surface_util import assert_same_tree, jax_state, opts, steps_on_disk


def data_iterator() -> Any:
    return iter(grain.MapDataset.range(100).shuffle(seed=1).to_iter_dataset())


def save_args(step: int, iterator: Any) -> ocp.args.Composite:
    return ocp.args.Composite(
        state=ocp.args.StandardSave(jax_state(step)),
        meta=ocp.args.JsonSave({"step": step}),
        data=grain.python.PyGrainCheckpointSave(iterator),
    )


def restore_args(iterator: Any) -> ocp.args.Composite:
    return ocp.args.Composite(
        state=ocp.args.StandardRestore(jax.eval_shape(lambda: jax_state(0))),
        meta=ocp.args.JsonRestore(),
        data=grain.python.PyGrainCheckpointRestore(iterator),
    )


def test_a_run_orbax_wrote_continues_after_the_swap(impl: Any, root: Path) -> None:
    options = dict(max_to_keep=3, save_interval_steps=2)
    iterator = data_iterator()
    with ocp.CheckpointManager(root, options=opts(**options)) as orbax:
        for step in range(5):
            next(iterator)
            orbax.save(step, args=save_args(step, iterator))
    expected_next = list(iterator)[:3]  # what follows step 4's position

    with impl(root, options=opts(**options)) as manager:
        assert manager.all_steps() == [0, 2, 4]
        assert manager.latest_step() == 4
        restored = manager.restore(manager.latest_step(), args=restore_args(data_iterator()))
        assert_same_tree(restored.state, jax_state(4))
        assert restored.meta == {"step": 4}
        resumed = restored.data
        assert [next(resumed) for _ in range(3)] == expected_next
        assert manager.should_save(5) is False
        for step in (6, 7, 8):
            manager.save(step, args=save_args(step, resumed))
        manager.wait_until_finished()
        assert manager.all_steps() == [4, 6, 8]
        # an Orbax step and a step of this manager, side by side
        assert manager.restore(4, args=restore_args(data_iterator())).meta == {"step": 4}
        assert manager.restore(8, args=restore_args(data_iterator())).meta == {"step": 8}
    assert {6, 8} <= set(steps_on_disk(root))

    with impl(root, options=opts(**options)) as fresh:
        back = fresh.restore(None, args=restore_args(data_iterator()))
        assert_same_tree(back.state, jax_state(8))
        assert back.meta == {"step": 8}


def test_orbax_root_metadata_is_kept_after_the_swap(impl: Any, root: Path) -> None:
    with ocp.CheckpointManager(root, metadata={"run": "a"}) as orbax:
        orbax.save(0, args=ocp.args.StandardSave(jax_state()))
    with impl(root, metadata={"run": "b"}) as manager:
        assert manager.metadata() == ocp.metadata.RootMetadata(custom_metadata={"run": "a"})
    with impl(root, options=opts(read_only=True)) as reader:
        assert reader.metadata().custom_metadata == {"run": "a"}


def test_a_default_item_run_with_a_prefix_continues_after_the_swap(impl: Any, root: Path) -> None:
    options = dict(step_prefix="ckpt", step_format_fixed_length=4, max_to_keep=2)
    with ocp.CheckpointManager(root, options=opts(**options)) as orbax:
        for step in (10, 20):
            orbax.save(step, args=ocp.args.StandardSave(jax_state(step)))
    with impl(root, options=opts(**options)) as manager:
        assert manager.all_steps() == [10, 20]
        target = jax.eval_shape(lambda: jax_state(0))
        assert_same_tree(
            manager.restore(None, args=ocp.args.StandardRestore(target)), jax_state(20)
        )
        assert_same_tree(manager.restore(10, args=ocp.args.StandardRestore(target)), jax_state(10))
        manager.save(30, args=ocp.args.StandardSave(jax_state(30)))
        manager.wait_until_finished()
        assert manager.all_steps() == [20, 30]
    assert (root / "ckpt_0030" / "default").is_dir()
    with impl(root, options=opts(**options)) as fresh:
        assert_same_tree(fresh.restore(None), jax_state(30))
        assert_same_tree(fresh.restore(20, args=ocp.args.StandardRestore(target)), jax_state(20))


def test_orbax_steps_restore_without_args_after_the_swap(impl: Any, root: Path) -> None:
    with ocp.CheckpointManager(root / "default") as orbax:
        orbax.save(1, args=ocp.args.StandardSave(jax_state(1)))
    with ocp.CheckpointManager(root / "multi") as orbax:
        orbax.save(
            2,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(jax_state(2)), meta=ocp.args.JsonSave({"m": 2})
            ),
        )
    with impl(root / "default") as manager:
        assert_same_tree(manager.restore(1), jax_state(1))
    with impl(root / "multi") as manager:
        restored = manager.restore(2)
        assert sorted(restored.keys()) == ["meta", "state"]
        assert_same_tree(restored.state, jax_state(2))
        assert restored.meta == {"m": 2}


def test_orbax_metrics_keep_ranking_the_steps_after_the_swap(impl: Any, root: Path) -> None:
    options = dict(max_to_keep=2, best_fn=lambda m: m["loss"], best_mode="min")
    with ocp.CheckpointManager(root, options=opts(**options)) as orbax:
        for step, loss in enumerate([0.9, 0.3, 0.5]):
            orbax.save(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardSave(jax_state(step))),
                metrics={"loss": loss},
            )
    with impl(root, options=opts(**options)) as manager:
        assert manager.all_steps() == [1, 2]
        assert manager.best_step() == 1
        assert manager.metrics(2) == {"loss": 0.5}
        manager.save(
            3,
            args=ocp.args.Composite(state=ocp.args.StandardSave(jax_state(3))),
            metrics={"loss": 0.4},
        )
        manager.wait_until_finished()
        assert manager.all_steps() == [1, 3]
        assert manager.best_step() == 1
        assert manager.metrics(3) == {"loss": 0.4}
        manager.save(
            4,
            args=ocp.args.Composite(state=ocp.args.StandardSave(jax_state(4))),
            metrics={"loss": 0.1},
        )
        manager.wait_until_finished()
        assert manager.all_steps() == [1, 4]
        assert manager.best_step() == 4
