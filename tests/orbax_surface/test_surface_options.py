"""Save decisions, step naming and read-only managers, with Orbax's options and policy objects."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import pytest
from orbax.checkpoint import checkpoint_managers as policies
from orbax.checkpoint.checkpoint_manager import StepAlreadyExistsError
from orbax_surface.surface_util import (
    assert_same_tree,
    jax_state,
    opts,
    save_all,
    steps_on_disk,
)
from support.treeutil import dir_state


def test_save_interval_steps_saves_only_on_the_interval_after_the_first_save(
    impl: Any, root: Path
) -> None:
    with impl(root, options=opts(save_interval_steps=3)) as manager:
        decisions = {step: manager.should_save(step) for step in (1, 2, 3)}
        said = save_all(manager, range(1, 11))
        manager.wait_until_finished()
        assert manager.all_steps() == [1, 3, 6, 9]
    assert decisions == {1: True, 2: True, 3: True}  # nothing saved yet: any step is saved
    assert said == [step in (1, 3, 6, 9) for step in range(1, 11)]
    assert steps_on_disk(root) == [1, 3, 6, 9]


def test_the_first_save_happens_at_any_step_but_not_after_a_restart(impl: Any, root: Path) -> None:
    with impl(root, options=opts(save_interval_steps=10)) as manager:
        assert save_all(manager, [3, 4, 10, 13]) == [True, False, True, False]
    with impl(root, options=opts(save_interval_steps=10)) as restarted:
        # the initial-save rule only applies while there is no checkpoint
        assert restarted.should_save(17) is False
        assert save_all(restarted, [17, 20]) == [False, True]
        restarted.wait_until_finished()
        assert restarted.all_steps() == [3, 10, 20]


def test_save_on_steps_adds_steps_off_the_interval(impl: Any, root: Path) -> None:
    with impl(root, options=opts(save_interval_steps=5, save_on_steps=[7, 12])) as manager:
        save_all(manager, range(13))
        manager.wait_until_finished()
        assert manager.all_steps() == [0, 5, 7, 10, 12]


def test_should_save_fn_replaces_the_interval_and_the_initial_save(impl: Any, root: Path) -> None:
    calls: list[tuple[int, int | None]] = []

    def should_save_fn(step: int, last_saved: int | None) -> bool:
        calls.append((step, last_saved))
        return step % 4 == 2

    options = opts(save_interval_steps=1, should_save_fn=should_save_fn)
    with impl(root, options=options) as manager:
        said = save_all(manager, range(1, 11))
        manager.wait_until_finished()
        assert manager.all_steps() == [2, 6, 10]
    assert said == [step in (2, 6, 10) for step in range(1, 11)]
    # the function is told the last saved step (None before the first)
    seen = dict(calls)
    assert seen[1] is None and seen[2] is None and seen[3] == 2 and seen[10] == 6


def test_save_decision_policy_objects_decide_every_save(impl: Any, root: Path) -> None:
    policy = policies.AnySavePolicy(
        [policies.FixedIntervalPolicy(4), policies.SpecificStepsPolicy(steps=[5])]
    )
    with impl(root, options=opts(save_decision_policy=policy)) as manager:
        said = save_all(manager, range(1, 10))  # no InitialSavePolicy: step 1 is not saved
        manager.wait_until_finished()
        assert manager.all_steps() == [4, 5, 8]
    assert said == [step in (4, 5, 8) for step in range(1, 10)]


def test_an_initial_save_policy_object_saves_the_first_step(impl: Any, root: Path) -> None:
    policy = policies.AnySavePolicy([policies.InitialSavePolicy(), policies.FixedIntervalPolicy(5)])
    with impl(root, options=opts(save_decision_policy=policy)) as manager:
        save_all(manager, range(1, 12))
        manager.wait_until_finished()
        assert manager.all_steps() == [1, 5, 10]


def test_force_saves_a_step_the_policy_would_skip(impl: Any, root: Path) -> None:
    with impl(root, options=opts(save_interval_steps=10)) as manager:
        assert save_all(manager, [0]) == [True]
        assert manager.should_save(3) is False
        assert save_all(manager, [3], force=True) == [True]
        manager.wait_until_finished()
        assert manager.all_steps() == [0, 3]
    assert steps_on_disk(root) == [0, 3]


def test_save_returns_false_for_a_step_at_or_below_the_latest(impl: Any, root: Path) -> None:
    with impl(root) as manager:
        assert save_all(manager, [5]) == [True]
        manager.wait_until_finished()
        before = dir_state(root)
        assert manager.should_save(5) is False and manager.should_save(4) is False
        assert save_all(manager, [5, 3]) == [False, False]
        manager.wait_until_finished()
        assert manager.all_steps() == [5]
        assert dir_state(root) == before


def test_a_forced_save_of_an_existing_step_raises_and_keeps_its_data(impl: Any, root: Path) -> None:
    state = jax_state(2.0)
    with impl(root) as manager:
        manager.save(4, args=ocp.args.StandardSave(state))
        manager.wait_until_finished()
        before = {k: v for k, v in dir_state(root / "4").items() if v != b"<dir>"}
        with pytest.raises(StepAlreadyExistsError) as raised:
            manager.save(4, args=ocp.args.StandardSave(jax_state(9.0)), force=True)
        assert isinstance(raised.value, ValueError)
        assert "4" in str(raised.value)
        after = {k: v for k, v in dir_state(root / "4").items() if v != b"<dir>"}
        assert after == before
        assert manager.all_steps() == [4]
    with impl(root) as fresh:
        assert_same_tree(fresh.restore(4), state)


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"step_prefix": "ckpt", "step_format_fixed_length": 5}, "ckpt_00007"),
        ({"step_prefix": "step"}, "step_7"),
        ({"step_format_fixed_length": 3}, "007"),
    ],
    ids=["prefix-and-padding", "prefix", "padding"],
)
def test_step_prefix_and_fixed_length_name_the_step_directories(
    impl: Any, root: Path, options: dict[str, Any], name: str
) -> None:
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(jax_state()), meta=ocp.args.JsonSave({"a": 1})
    )
    with impl(root, options=opts(**options)) as manager:
        manager.save(7, args=args)
        manager.wait_until_finished()
    assert (root / name / "state").is_dir() and (root / name / "meta").is_dir()
    prefix, digits = options.get("step_prefix"), options.get("step_format_fixed_length")
    assert steps_on_disk(root, prefix, digits) == [7]
    with impl(root, options=opts(**options)) as fresh:
        assert fresh.all_steps() == [7]
        assert fresh.restore(7, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta == {
            "a": 1
        }


def test_a_read_only_manager_restores_but_never_writes(impl: Any, root: Path) -> None:
    state = jax_state(3.0)
    with impl(root) as manager:
        manager.save(0, args=ocp.args.StandardSave(state))
        manager.save(1, args=ocp.args.StandardSave(state))
    before = dir_state(root)
    options = opts(read_only=True, max_to_keep=1, save_interval_steps=1)
    with impl(root, options=options, metadata={"never": "written"}) as reader:
        assert reader.all_steps() == [0, 1]  # max_to_keep deletes nothing
        assert reader.should_save(5) is False
        assert reader.save(5, args=ocp.args.StandardSave(state)) is False
        reader.delete(0)  # a no-op
        assert reader.all_steps() == [0, 1]
        assert_same_tree(reader.restore(1), state)
        assert_same_tree(reader.restore(0), state)
        reader.wait_until_finished()
        assert reader.is_saving_in_progress() is False
    assert dir_state(root) == before
    assert not (root / "metadata").exists()


def test_a_read_only_manager_on_a_missing_directory_does_not_create_it(
    impl: Any, root: Path
) -> None:
    with impl(root, options=opts(read_only=True)) as reader:
        assert reader.all_steps() == []
        assert reader.latest_step() is None
    assert not root.exists()


def test_a_writable_manager_creates_its_directory(impl: Any, root: Path) -> None:
    with impl(root / "deep" / "er") as manager:
        assert manager.all_steps() == []
        assert manager.directory == root / "deep" / "er"
    assert (root / "deep" / "er").is_dir()


def test_the_directory_property_is_the_root_given(impl: Any, root: Path) -> None:
    with impl(str(root)) as manager:
        assert Path(manager.directory) == root
        save_all(manager, [0])
        manager.wait_until_finished()
    assert np.array_equal(steps_on_disk(root), [0])


def test_no_preemption_is_reached_in_a_single_process(impl: Any, root: Path) -> None:
    with impl(root) as manager:
        assert manager.reached_preemption(0) is False
        assert manager.reached_preemption(100) is False
