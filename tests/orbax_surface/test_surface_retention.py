"""Retention: max_to_keep, keep_period, best_fn/best_mode, preservation policies, delete, and the
same retention in a new manager on the same directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp
import pytest
from orbax.checkpoint import checkpoint_managers as policies
from orbax_surface.surface_util import assert_same_tree, jax_state, opts, save_all, steps_on_disk


def save_with_metrics(manager: Any, metrics_by_step: dict[int, dict[str, float] | None]) -> None:
    for step, metrics in metrics_by_step.items():
        saved = manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(jax_state(step))),
            metrics=metrics,
        )
        assert saved is True


def test_max_to_keep_keeps_the_newest_steps(impl: Any, root: Path) -> None:
    with impl(root, options=opts(max_to_keep=2)) as manager:
        save_all(manager, range(6))
        manager.wait_until_finished()
        assert manager.all_steps() == [4, 5]
        assert manager.latest_step() == 5
        assert steps_on_disk(root) == [4, 5]
        restored = manager.restore(4, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    assert_same_tree(restored.state, jax_state(4))


def test_max_to_keep_zero_deletes_even_the_step_just_saved(impl: Any, root: Path) -> None:
    with impl(root, options=opts(max_to_keep=0)) as manager:
        assert save_all(manager, [0]) == [True]
        assert manager.all_steps() == []
        manager.wait_until_finished()
        assert manager.all_steps() == []
    # On disk the two differ on purpose: cairn keeps the newest committed step
    # (test_cairn_only.py::test_the_newest_step_stays_on_disk_until_a_newer_one_commits).


def test_keep_period_keeps_every_nth_step_beside_max_to_keep(impl: Any, root: Path) -> None:
    with impl(root, options=opts(max_to_keep=1, keep_period=3)) as manager:
        save_all(manager, range(8))
        manager.wait_until_finished()
        assert manager.all_steps() == [0, 3, 6, 7]
    assert steps_on_disk(root) == [0, 3, 6, 7]


@pytest.mark.parametrize(
    ("mode", "kept", "best"), [("max", [1, 3], 1), ("min", [0, 4], 0)], ids=["max", "min"]
)
def test_best_fn_keeps_the_best_steps_by_mode(
    impl: Any, root: Path, mode: str, kept: list[int], best: int
) -> None:
    values = [0.1, 0.9, 0.3, 0.8, 0.2]
    options = opts(max_to_keep=2, best_fn=lambda m: m["score"], best_mode=mode)
    with impl(root, options=options) as manager:
        save_with_metrics(manager, {s: {"score": v} for s, v in enumerate(values)})
        manager.wait_until_finished()
        assert manager.all_steps() == kept
        assert manager.best_step() == best
        assert manager.metrics(best) == {"score": values[best]}
    newest = len(values) - 1  # cairn keeps it on disk while it is the newest (test_cairn_only)
    on_disk = sorted({*kept, newest}) if impl.__module__.startswith("cairn") else kept
    assert steps_on_disk(root) == on_disk
    with impl(root, options=options) as fresh:
        assert fresh.all_steps() == on_disk
        assert fresh.best_step() == best


@pytest.mark.parametrize(("keep_without", "kept"), [(True, [0, 2, 4]), (False, [2, 4])])
def test_keep_checkpoints_without_metrics_decides_steps_saved_without_metrics(
    impl: Any, root: Path, keep_without: bool, kept: list[int]
) -> None:
    options = opts(
        max_to_keep=2,
        best_fn=lambda m: m["acc"],
        best_mode="max",
        keep_checkpoints_without_metrics=keep_without,
    )
    with impl(root, options=options) as manager:
        save_with_metrics(
            manager, {0: None, 1: {"acc": 0.2}, 2: {"acc": 0.7}, 3: {"acc": 0.1}, 4: {"acc": 0.5}}
        )
        manager.wait_until_finished()
        assert manager.all_steps() == kept
        assert manager.best_step() == 2
    assert steps_on_disk(root) == kept


def test_best_step_without_metrics_is_none_with_best_fn_and_latest_without(
    impl: Any, root: Path
) -> None:
    with impl(root / "a", options=opts(best_fn=lambda m: m["acc"])) as manager:
        assert manager.best_step() is None
        save_all(manager, [0, 1])
        manager.wait_until_finished()
        assert manager.best_step() is None  # no step has metrics
    with impl(root / "b") as manager:
        assert manager.best_step() is None
        save_all(manager, [0, 1])
        manager.wait_until_finished()
        assert manager.best_step() == 1  # no best_fn: the latest


def test_a_new_manager_reloads_metrics_and_keeps_applying_best_retention(
    impl: Any, root: Path
) -> None:
    options = dict(max_to_keep=2, best_fn=lambda m: m["acc"], best_mode="max")
    with impl(root, options=opts(**options)) as manager:
        save_with_metrics(manager, {s: {"acc": v} for s, v in enumerate([0.5, 0.9, 0.1, 0.7])})
        manager.wait_until_finished()
        assert manager.all_steps() == [1, 3]
    with impl(root, options=opts(**options)) as restarted:
        assert restarted.all_steps() == [1, 3]
        assert restarted.best_step() == 1
        assert restarted.metrics(3) == {"acc": 0.7}
        # worse than both kept steps: the new step itself is the one dropped
        save_with_metrics(restarted, {4: {"acc": 0.2}})
        restarted.wait_until_finished()
        assert restarted.all_steps() == [1, 3]
        save_with_metrics(restarted, {5: {"acc": 0.95}})
        restarted.wait_until_finished()
        assert restarted.all_steps() == [1, 5]
        assert restarted.best_step() == 5
    assert steps_on_disk(root) == [1, 5]


def test_a_new_manager_keeps_applying_max_to_keep(impl: Any, root: Path) -> None:
    with impl(root, options=opts(max_to_keep=3)) as manager:
        save_all(manager, range(4))
    with impl(root, options=opts(max_to_keep=3)) as restarted:
        assert restarted.all_steps() == [1, 2, 3]
        save_all(restarted, [4, 5])
        restarted.wait_until_finished()
        assert restarted.all_steps() == [3, 4, 5]
    assert steps_on_disk(root) == [3, 4, 5]


def test_preservation_policy_objects_decide_what_is_kept(impl: Any, root: Path) -> None:
    policy = policies.AnyPreservationPolicy(
        [policies.LatestN(n=1), policies.CustomSteps(steps=[2])]
    )
    with impl(root, options=opts(preservation_policy=policy)) as manager:
        save_all(manager, range(6))
        manager.wait_until_finished()
        assert manager.all_steps() == [2, 5]
    assert steps_on_disk(root) == [2, 5]


def test_a_best_n_preservation_policy_ranks_by_the_saved_metrics(impl: Any, root: Path) -> None:
    policy = policies.BestN(get_metric_fn=lambda m: m["loss"], reverse=True, n=2)
    options = opts(preservation_policy=policy, best_fn=lambda m: m["loss"], best_mode="min")
    with impl(root, options=options) as manager:
        save_with_metrics(manager, {s: {"loss": v} for s, v in enumerate([3.0, 1.0, 4.0, 2.0])})
        manager.wait_until_finished()
        assert manager.all_steps() == [1, 3]
        assert manager.best_step() == 1
    assert steps_on_disk(root) == [1, 3]


def test_delete_removes_the_step_from_the_list_and_the_disk(impl: Any, root: Path) -> None:
    with impl(root) as manager:
        save_all(manager, [0, 1, 2])
        manager.wait_until_finished()
        manager.delete(1)
        assert manager.all_steps() == [0, 2]
        assert steps_on_disk(root) == [0, 2]
        manager.delete(2)
        assert manager.latest_step() == 0
        # the next save at a deleted step number is allowed again
        assert save_all(manager, [1]) == [True]
        manager.wait_until_finished()
        assert manager.all_steps() == [0, 1]
    with impl(root) as fresh:
        assert fresh.all_steps() == [0, 1]
