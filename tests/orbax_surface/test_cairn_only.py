"""Where the cairn drop-in deliberately differs from Orbax (it is safer): cairn only.

Each test's docstring says what orbax-checkpoint 0.12.8 does instead
(docs/design/orbax-drop-in-research.md, section 4).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from orbax.checkpoint.checkpoint_manager import StepAlreadyExistsError
from orbax_surface.dropin_crash_writer import expected_state
from orbax_surface.surface_util import assert_same_tree, jax_state, opts, save_all, steps_on_disk
from support.treeutil import dir_state

from cairn.manager import CheckpointManager as CairnManager


@pytest.fixture
def dropin() -> type[Any]:
    from cairn.manager.orbax import CheckpointManager

    return CheckpointManager


def entries(root: Path) -> set[str]:
    return {p.name for p in root.iterdir()}


def test_a_read_only_forced_save_writes_nothing(
    dropin: Any, root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Orbax: read_only is only checked in should_save(), so save(force=True) writes the step."""
    with dropin(root) as manager:
        save_all(manager, [0])
    before = dir_state(root)
    with dropin(root, options=opts(read_only=True)) as reader:
        with caplog.at_level(logging.WARNING):
            assert save_all(reader, [5], force=True) == [False]
        reader.wait_until_finished()
        assert reader.all_steps() == [0]
        assert reader.is_saving_in_progress() is False
    assert any(r.levelno >= logging.WARNING for r in caplog.records), caplog.records
    assert dir_state(root) == before


def test_a_manager_with_another_prefix_is_refused(dropin: Any, root: Path) -> None:
    """Orbax lists [] for a directory whose steps are named under another prefix, and a run
    started with a mistyped prefix begins again from scratch beside them; cairn refuses to
    open it, naming the prefix that reads them, and changes nothing."""
    with dropin(root, options=opts(step_prefix="a")) as manager:
        save_all(manager, [1, 2])
    before = dir_state(root)
    for read_only in (True, False):
        with pytest.raises(ValueError, match="step_prefix='a'"):
            dropin(root, options=opts(step_prefix="b", read_only=read_only))
    assert dir_state(root) == before


@pytest.mark.parametrize("case", ["max_to_keep=0", "best_fn"])
def test_the_newest_step_stays_on_disk_until_a_newer_one_commits(
    dropin: Any, root: Path, case: str
) -> None:
    """Orbax deletes a step its policy drops even when it is the newest (max_to_keep=0, or a
    best_fn ranking it last), so a crash then resumes from an older step; cairn keeps the
    newest committed step on disk until a newer one commits. all_steps() follows Orbax."""
    if case == "max_to_keep=0":
        options, metrics, gone = opts(max_to_keep=0), [None, None], []
    else:
        options = opts(max_to_keep=1, best_fn=lambda m: m["loss"], best_mode="min")
        metrics, gone = [{"loss": 1.0}, {"loss": 2.0}], [0]
    with dropin(root, options=options) as manager:
        manager.save(0, args=ocp.args.StandardSave(jax_state(0.0)), metrics=metrics[0])
        manager.save(1, args=ocp.args.StandardSave(jax_state(1.0)), metrics=metrics[1])
        manager.wait_until_finished()
        assert manager.all_steps() == gone
    assert steps_on_disk(root) == sorted({*gone, 1})  # step 0 deleted once 1 committed
    with dropin(root, options=options) as fresh:
        assert fresh.latest_step() == 1
        assert_same_tree(fresh.restore(None)["w"], jax_state(1.0)["w"])
        fresh.save(2, args=ocp.args.StandardSave(jax_state(2.0)), metrics=metrics[1])
        fresh.wait_until_finished()
    assert steps_on_disk(root) == ([2] if case == "max_to_keep=0" else [0, 2])


def test_after_step_already_exists_later_saves_work(dropin: Any, root: Path) -> None:
    """Orbax sets the in-progress flag before the check and never clears it, so
    is_saving_in_progress() stays True (and a ContinuousCheckpointingPolicy never saves again)."""
    with dropin(root) as manager:
        save_all(manager, [0])
        manager.wait_until_finished()
        with pytest.raises(StepAlreadyExistsError):
            save_all(manager, [0], force=True)
        assert manager.is_saving_in_progress() is False
        assert manager.should_save(1) is True
        assert save_all(manager, [1]) == [True]
        manager.wait_until_finished()
        assert manager.all_steps() == [0, 1]
        assert manager.is_saving_in_progress() is False
    assert steps_on_disk(root) == [0, 1]


def test_save_interval_steps_zero_is_refused_at_construction(dropin: Any, root: Path) -> None:
    """Orbax accepts it and raises ZeroDivisionError at the first save (`step % 0`); read_only
    options force 0 themselves, so there it must stay accepted."""
    with pytest.raises(ValueError, match="save_interval_steps"):
        dropin(root, options=opts(save_interval_steps=0))
    with dropin(root, options=opts(save_interval_steps=0, read_only=True)) as reader:
        assert reader.all_steps() == []
        assert reader.should_save(0) is False


def test_metrics_are_kept_without_best_fn(dropin: Any, root: Path) -> None:
    """Orbax writes metrics only with best_fn: metrics(step) is None, even in the same manager.
    best_step() keeps Orbax's rule: the latest step when there is no best_fn."""
    with dropin(root) as manager:
        save_all(manager, [0], metrics={"loss": 0.25})
        save_all(manager, [1], metrics={"loss": 0.75})
        manager.wait_until_finished()
        assert manager.metrics(0) == {"loss": 0.25}
        assert manager.best_step() == 1
    with dropin(root) as fresh:
        assert fresh.metrics(0) == {"loss": 0.25}
        assert fresh.metrics(1) == {"loss": 0.75}
        assert fresh.best_step() == 1


def test_a_user_item_named_metrics_is_saved_and_restored_as_given(dropin: Any, root: Path) -> None:
    """Orbax, with best_fn set, silently overwrites a user item named `metrics` with the metrics
    JSON (RESERVED_ITEM_NAMES is empty)."""
    options = opts(best_fn=lambda m: m["loss"], best_mode="min")
    with dropin(root, options=options) as manager:
        manager.save(
            0,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(jax_state()),
                metrics=ocp.args.JsonSave({"user": "owned", "n": 3}),
            ),
            metrics={"loss": 0.5},
        )
        manager.wait_until_finished()
        assert manager.metrics(0) == {"loss": 0.5}
    with dropin(root, options=options) as fresh:
        restored = fresh.restore(0, args=ocp.args.Composite(metrics=ocp.args.JsonRestore()))
        assert restored.metrics == {"user": "owned", "n": 3}
        assert fresh.metrics(0) == {"loss": 0.5}
        assert fresh.best_step() == 0


def test_a_no_args_restore_has_no_internal_metrics_item(dropin: Any, root: Path) -> None:
    """Orbax returns its internal `metrics` item as one of the user's items in multi-item mode."""
    options = opts(best_fn=lambda m: m["loss"], best_mode="min")
    with dropin(root, options=options) as manager:
        save_all(manager, [0], metrics={"loss": 0.5})
    with dropin(root, options=options) as fresh:
        restored = fresh.restore(0)
    assert list(restored.keys()) == ["state"]
    assert_same_tree(restored.state, jax_state(0))


def test_a_multi_item_step_with_an_item_named_default_keeps_all_its_items(
    dropin: Any, root: Path
) -> None:
    """Orbax decides the mode of a fresh manager from `<step>/default` existing: it reads such a
    step as a default-item step and returns only that item, bare (the others are dropped)."""
    with dropin(root) as manager:
        manager.save(
            0,
            args=ocp.args.Composite(
                default=ocp.args.JsonSave({"d": 1}), other=ocp.args.JsonSave({"o": 2})
            ),
        )
    with dropin(root) as fresh:
        restored = fresh.restore(0)
    assert isinstance(restored, ocp.args.Composite)
    assert sorted(restored.keys()) == ["default", "other"]
    assert restored["default"] == {"d": 1} and restored.other == {"o": 2}


def test_a_raising_best_fn_fails_the_save_before_anything_is_written(
    dropin: Any, root: Path
) -> None:
    """Orbax calls best_fn after the write started: the step is listed but never finalized (a
    `1.orbax-checkpoint-tmp` stays), and in-progress stays True."""
    # max_to_keep=1: retention must rank the new step, so best_fn runs on its metrics
    options = opts(best_fn=lambda m: m["acc"], best_mode="max", max_to_keep=1)
    with dropin(root, options=options) as manager:
        save_all(manager, [0], metrics={"acc": 0.5})
        manager.wait_until_finished()
        names = entries(root)
        with pytest.raises(Exception) as raised:
            save_all(manager, [1], metrics={"loss": 2.0})
        chain: list[BaseException] = []
        error: BaseException | None = raised.value
        while error is not None:
            chain.append(error)
            error = error.__cause__ or error.__context__
        assert any(isinstance(e, KeyError) for e in chain), chain
        assert manager.all_steps() == [0]
        assert manager.is_saving_in_progress() is False
        assert entries(root) == names
        manager.wait_until_finished()
        assert entries(root) == names
        assert save_all(manager, [1], metrics={"acc": 0.7}) == [True]
        manager.wait_until_finished()
        assert manager.all_steps() == [1]
    assert steps_on_disk(root) == [1]


def test_numpy_and_jax_scalar_metrics_are_accepted(dropin: Any, root: Path) -> None:
    """Orbax writes metrics as JSON: np.float32 raises TypeError in save (leaving a tmp dir)."""
    options = opts(best_fn=lambda m: m["loss"], best_mode="min", max_to_keep=1)
    with dropin(root, options=options) as manager:
        metrics = {"loss": np.float32(0.5), "acc": jnp.float32(0.25), "n": np.int64(3)}
        assert save_all(manager, [0], metrics=metrics) == [True]
        assert save_all(manager, [1], metrics={"loss": jnp.asarray(0.75)}) == [True]
        manager.wait_until_finished()
        assert manager.all_steps() == [0]
        assert manager.metrics(0) == {"loss": 0.5, "acc": 0.25, "n": 3}
    with dropin(root, options=options) as fresh:
        assert fresh.metrics(0) == {"loss": 0.5, "acc": 0.25, "n": 3}
        assert fresh.best_step() == 0


@pytest.mark.parametrize("read_only", [True, False], ids=["read-only", "writable"])
def test_the_users_options_are_not_mutated(dropin: Any, root: Path, read_only: bool) -> None:
    """Orbax rewrites `async_options.create_directories_asynchronously` in place (and the legacy
    path assigns `options.async_options`)."""
    options = opts(
        read_only=read_only,
        enable_async_checkpointing=False,
        async_options=ocp.AsyncOptions(timeout_secs=77),
        max_to_keep=None if read_only else 2,
        save_on_steps=[3],
    )
    before = dataclasses.asdict(options)
    with dropin(root, options=options) as manager:
        if not read_only:
            save_all(manager, range(4))
        manager.wait_until_finished()
    assert dataclasses.asdict(options) == before


def test_orbax_steps_that_retention_drops_are_left_on_disk(dropin: Any, root: Path) -> None:
    """Orbax deletes them. The drop-in never changes another checkpointer's steps: they leave
    all_steps() as in Orbax and come back on reload() (docs/migrating-from-orbax.md)."""
    with ocp.CheckpointManager(root, options=opts(max_to_keep=2)) as orbax:
        save_all(orbax, [0, 1, 2])
    assert steps_on_disk(root) == [1, 2]
    orbax_step_1 = dir_state(root / "1")
    with dropin(root, options=opts(max_to_keep=2)) as manager:
        assert manager.all_steps() == [1, 2]
        save_all(manager, [3, 4])
        manager.wait_until_finished()
        assert manager.all_steps() == [3, 4]
        assert steps_on_disk(root) == [1, 2, 3, 4]
        assert dir_state(root / "1") == orbax_step_1
        manager.reload()
        assert manager.all_steps() == [1, 2, 3, 4]
        restored = manager.restore(1, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
        assert_same_tree(restored.state, jax_state(1))


@pytest.mark.parametrize(
    ("options", "cairn_names"),
    [
        ({}, {"step_prefix": ""}),
        (
            {"step_prefix": "ckpt", "step_format_fixed_length": 5},
            {"step_prefix": "ckpt", "step_digits": 5},
        ),
    ],
    ids=["orbax-default-names", "prefix-and-padding"],
)
def test_the_steps_written_are_cairn_steps(
    dropin: Any, root: Path, options: dict[str, Any], cairn_names: dict[str, Any]
) -> None:
    """Orbax's steps have no checksums: a directory without the tmp suffix counts as complete."""
    state = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(2, np.int32)}
    with dropin(root, options=opts(**options)) as manager:
        manager.save(
            4,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave({"a": 1})
            ),
        )
    with CairnManager(root, read_only=True, **cairn_names) as cairn:
        assert cairn.all_steps() == [4]
        assert cairn.verify(4) == []
        restored = cairn.restore(4)
    assert sorted(restored) == ["meta", "state"]
    assert restored["meta"] == {"a": 1}
    for key, value in state.items():
        np.testing.assert_array_equal(np.asarray(restored["state"][key]), value)


def test_a_writer_killed_mid_commit_leaves_only_intact_steps(dropin: Any, root: Path) -> None:
    """Orbax on a local disk counts any step directory without the tmp suffix as complete, with
    no content check. Here the kill lands right after save(1) returns (usually mid-commit); either
    outcome is fine as long as every listed step restores bit-exact."""
    script = Path(__file__).with_name("dropin_crash_writer.py")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    with subprocess.Popen(
        [sys.executable, str(script), str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    ) as child:
        assert child.stdout is not None
        watchdog = threading.Timer(300, child.kill)  # a hung child fails the test, not the run
        watchdog.start()
        try:
            line = child.stdout.readline()
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=60)
        finally:
            watchdog.cancel()
    assert line == "started 1\n", line
    with dropin(root) as manager:
        steps = manager.all_steps()
        assert steps in ([0], [0, 1])
        for step in steps:
            restored = manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore())
            )
            assert_same_tree(restored.state, expected_state(step))
        assert manager.latest_step() == steps[-1]
        # the run goes on beside whatever the crash left
        manager.save(2, args=ocp.args.Composite(state=ocp.args.StandardSave(expected_state(2))))
        manager.wait_until_finished()
        assert manager.all_steps() == [*steps, 2]
    with CairnManager(root, read_only=True, step_prefix="") as cairn:
        for step in [*steps, 2]:
            assert cairn.verify(step) == []
