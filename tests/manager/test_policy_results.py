"""A user's policy object answers wrongly: the error names the policy and the answer; nothing is lost.

Retention runs on the commit thread, so a bad keep answer comes back as CommitError (the policy's
TypeError/ValueError chained) from the next wait_until_finished, or straight from a synchronous
save or from record_metrics. Every committed step stays on disk and restores.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cairn.manager import (
    AnyOf,
    CheckpointManager,
    CommitError,
    EveryNSteps,
    KeepLatest,
    SaveContext,
    StepView,
)

STEPS = [1, 2, 3]


@dataclasses.dataclass(frozen=True)
class Keeps:
    """A keep policy that always answers `answer`, whatever the steps."""

    answer: Any

    def keep(self, steps: Any) -> Any:
        return self.answer


@dataclasses.dataclass(frozen=True)
class Says:
    """A save policy that always answers `answer`."""

    answer: Any

    def should_save(self, step: int, context: SaveContext) -> Any:
        return self.answer


def committed(root: Path) -> Path:
    with CheckpointManager(root) as mgr:
        for step in STEPS:
            mgr.save(step, {"state": {"w": np.full(3, step)}}, metrics={"loss": 1.0 / step})
    return root


def assert_all_intact(root: Path, steps: list[int]) -> None:
    assert sorted(p.name for p in root.glob("checkpoint_*")) == [f"checkpoint_{s}" for s in steps]
    with CheckpointManager(root, read_only=True) as mgr:
        assert mgr.all_steps() == steps
        for step in steps:
            np.testing.assert_array_equal(mgr.restore(step)["state"]["w"], np.full(3, step))
            assert not mgr.verify(step)


BAD_KEEPS = [
    pytest.param([1, 2], TypeError, "got list [1, 2]", id="list"),
    pytest.param(None, TypeError, "got NoneType None", id="None"),
    pytest.param(1.5, TypeError, "got float 1.5", id="float"),
    pytest.param({1: True}, TypeError, "got dict", id="dict"),
    pytest.param({99}, ValueError, "returned steps [99] that are not among", id="unknown-step"),
    pytest.param({-1, 2}, ValueError, "returned steps [-1]", id="negative-step"),
    pytest.param({"1"}, TypeError, "(holding str '1')", id="str-step"),
    pytest.param({True}, TypeError, "(holding bool True)", id="bool-step"),
    pytest.param({1.0}, TypeError, "(holding float 1.0)", id="float-step"),
]


@pytest.mark.parametrize(("answer", "error", "message"), BAD_KEEPS)
def test_a_bad_keep_answer_deletes_nothing(
    tmp_path: Path, answer: Any, error: type[Exception], message: str
) -> None:
    root = committed(tmp_path)
    policy = Keeps(answer)
    with CheckpointManager(root, keep=policy) as mgr:
        mgr.save(4, {"state": {"w": np.full(3, 4)}})
        with pytest.raises(CommitError, match="retention after step 4") as info:
            mgr.wait_until_finished()
        cause = info.value.__cause__
        assert type(cause) is error
        assert f"keep policy {policy!r}: keep()" in str(cause) and message in str(cause)
        assert mgr.all_steps() == [1, 2, 3, 4]
    assert_all_intact(root, [1, 2, 3, 4])


@pytest.mark.parametrize(("answer", "error", "message"), BAD_KEEPS[:5])
def test_a_bad_keep_answer_raises_from_a_synchronous_save(
    tmp_path: Path, answer: Any, error: type[Exception], message: str
) -> None:
    root = committed(tmp_path)
    with CheckpointManager(root, keep=Keeps(answer), async_save=False) as mgr:
        with pytest.raises(error, match="keep policy Keeps") as info:
            mgr.save(4, {"state": {"w": np.full(3, 4)}})
        assert message in str(info.value)
    assert_all_intact(root, [1, 2, 3, 4])


def test_a_bad_keep_answer_raises_from_record_metrics(tmp_path: Path) -> None:
    root = committed(tmp_path)
    with CheckpointManager(root, keep=Keeps({99})) as mgr:
        with pytest.raises(ValueError, match=r"Keeps\(answer=\{99\}\).*\[99\]"):
            mgr.record_metrics(2, {"loss": 0.0})
        assert mgr.metrics(2)["loss"] == 0.0  # the metrics were written; only retention refused
    assert_all_intact(root, STEPS)


def test_any_of_checks_each_member(tmp_path: Path) -> None:
    """KeepLatest(1) alone would keep {3}; a broken member must not be merged into the union."""
    root = committed(tmp_path)
    with CheckpointManager(root, keep=AnyOf(KeepLatest(1), Keeps([1]))) as mgr:
        mgr.save(4, {"state": {"w": np.full(3, 4)}})
        with pytest.raises(CommitError) as info:
            mgr.wait_until_finished()
        assert "keep policy Keeps(answer=[1])" in str(info.value.__cause__)
    assert_all_intact(root, [1, 2, 3, 4])


def test_a_bad_keep_items_answer_drops_nothing(tmp_path: Path) -> None:
    root = committed(tmp_path)
    with CheckpointManager(root, keep_items={"state": Keeps({"2"})}) as mgr:
        mgr.save(4, {"state": {"w": np.full(3, 4)}})
        with pytest.raises(CommitError, match="holding str '2'"):
            mgr.wait_until_finished()
        assert not any(mgr.info(s).items["state"].dropped for s in mgr.all_steps())
    assert_all_intact(root, [1, 2, 3, 4])


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(frozenset({1, 4}), id="frozenset"),
        pytest.param({np.int64(1)}, id="numpy-int"),
        pytest.param({1, 4}, id="set"),
    ],
)
def test_good_keep_answers_are_obeyed(tmp_path: Path, answer: Any) -> None:
    root = committed(tmp_path)
    with CheckpointManager(root, keep=Keeps(answer)) as mgr:
        mgr.save(4, {"state": {"w": np.full(3, 4)}})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 4]  # the newest always stays
    assert_all_intact(root, [1, 4])


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param("no", id="str"),
        pytest.param(None, id="None"),
        pytest.param(1, id="int-1"),
        pytest.param(0, id="int-0"),
        pytest.param(np.int64(1), id="numpy-int"),
        pytest.param(np.array([True]), id="numpy-array"),
    ],
)
def test_a_bad_save_answer_saves_nothing(tmp_path: Path, answer: Any) -> None:
    root = committed(tmp_path)
    for policy in (Says(answer), AnyOf(EveryNSteps(1), Says(answer))):
        with CheckpointManager(root, save=policy) as mgr:
            with pytest.raises(TypeError, match="must return a bool") as info:
                mgr.should_save(4)
            assert f"save policy {Says(answer)!r}: should_save(4)" in str(info.value)
            with pytest.raises(TypeError, match=r"should_save\(4\) must return a bool"):
                mgr.save(4, {"state": {"w": np.full(3, 4)}})
            assert mgr.all_steps() == STEPS
            # force=True does not ask the policy: the save goes ahead
            assert mgr.save(5, {"state": {"w": np.full(3, 5)}}, force=True)
            mgr.delete(5)
    assert_all_intact(root, STEPS)


@pytest.mark.parametrize(
    ("answer", "saved"),
    [(True, True), (False, False), (np.bool_(True), True), (np.bool_(False), False)],
)
def test_bool_and_numpy_bool_are_answers(tmp_path: Path, answer: Any, saved: bool) -> None:
    with CheckpointManager(tmp_path, save=Says(answer)) as mgr:
        assert mgr.should_save(1) is saved
        assert mgr.save(1, {"state": [1]}) is saved
        mgr.wait_until_finished()
        assert mgr.all_steps() == ([1] if saved else [])


def test_the_checks_called_directly() -> None:
    from cairn.manager._core.policies import checked_keep, checked_should_save, steps_to_delete

    views = [StepView(s, float(s)) for s in STEPS]
    assert steps_to_delete(views, Keeps(set())) == [1, 2]
    with pytest.raises(ValueError, match="not among the steps it was given"):
        steps_to_delete(views, Keeps({4}))
    assert checked_keep(Keeps(frozenset({np.int32(2)})), views) == {2}
    context = SaveContext(latest_step=None, last_save_time=None, now=0.0)
    with pytest.raises(TypeError, match=r"got str 'no'"):
        checked_should_save(Says("no"), 1, context)
    with pytest.raises(TypeError, match="save policy"):
        AnyOf(Says(True), Says("yes")).should_save(1, context)
