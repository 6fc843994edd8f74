"""What goes wrong around the manager: hand-deleted steps, unreadable files, forks, exceptions."""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.treeutil import assert_tree_equal

from cairn.handlers import FileRecord, InMemoryHandler, JsonHandler, NumpyTreeHandler
from cairn.handlers.io import BACKGROUND_NICE
from cairn.manager import (
    CheckpointManager,
    CommitError,
    CorruptCheckpointError,
    KeepLatest,
    MismatchError,
    StepNotFoundError,
)


def test_step_deleted_by_hand_does_not_stall_retention(tmp_path: Path) -> None:
    """A step removed behind the manager's back is dropped; retention and saves go on."""
    with CheckpointManager(tmp_path, keep=KeepLatest(3), async_save=False) as mgr:
        for step in range(3):
            mgr.save(step, {"s": [step]})
        shutil.rmtree(tmp_path / "checkpoint_0")
        for step in range(3, 6):
            mgr.save(step, {"s": [step]})
        assert mgr.all_steps() == [3, 4, 5]
    assert sorted(p.name for p in tmp_path.glob("checkpoint_*")) == [
        "checkpoint_3",
        "checkpoint_4",
        "checkpoint_5",
    ]


def test_unreadable_manifest_is_a_corrupt_step_not_a_failed_open(tmp_path: Path) -> None:
    """A manifest that cannot be read (here: a directory) lists the step as corrupt."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"s": [1]})
        mgr.save(2, {"s": [2]})
    manifest = tmp_path / "checkpoint_2" / "_CHECKPOINT.json"
    manifest.unlink()
    manifest.mkdir()
    for read_only in (True, False):
        with CheckpointManager(tmp_path, read_only=read_only) as mgr:
            assert mgr.all_steps() == [1, 2]
            with pytest.raises(CorruptCheckpointError, match="cannot be read"):
                mgr.restore(2)
            assert mgr.restore() == {"s": [1]}


def test_commit_error_is_kept_even_if_the_step_cannot_be_read_back(tmp_path: Path) -> None:
    """A commit that fails with a broken final directory still reports once and frees the step."""

    def squat() -> None:
        (tmp_path / "checkpoint_1" / "_CHECKPOINT.json").mkdir(parents=True)

    with CheckpointManager(tmp_path, handlers={"x": InMemoryHandler(on_write=squat)}) as mgr:
        mgr.save(1, {"x": 1})
        with pytest.raises(CommitError, match="appeared on disk meanwhile"):
            mgr.wait_until_finished()
        assert mgr.all_steps() == [1]
        with pytest.raises(CorruptCheckpointError, match="cannot be read"):
            mgr.restore(1)


def test_handler_that_does_not_match_the_manifest(tmp_path: Path) -> None:
    """handlers= naming another handler than the one that wrote the item: MismatchError, no fallback."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"cfg": {"a": 1}})
    with (
        CheckpointManager(tmp_path, read_only=True, handlers={"cfg": JsonHandler()}) as mgr,
        pytest.raises(
            MismatchError, match=r"written by handler 'cairn\.train_state'.*'cairn\.json'"
        ),
    ):
        mgr.restore()


def test_refused_submit_leaves_no_step_in_flight(tmp_path: Path) -> None:
    """If the commit thread refuses work (interpreter shutting down), save raises and frees its slot."""
    mgr = CheckpointManager(tmp_path)
    assert mgr._commits.executor is not None
    mgr._commits.executor.shutdown()
    with pytest.raises(RuntimeError, match="shutdown"):
        mgr.save(1, {"s": [1]})
    assert mgr.should_save(1)
    assert mgr._commits.slots.acquire(blocking=False)


def test_reader_sees_steps_deleted_by_the_writer_as_gone(tmp_path: Path) -> None:
    """A read-only manager whose listing is stale gets StepNotFoundError, and restore() moves on."""
    with CheckpointManager(tmp_path) as writer:
        for step in (1, 2, 3):
            writer.save(step, {"s": [step]})
        writer.wait_until_finished()
        with CheckpointManager(tmp_path, read_only=True) as reader:
            assert reader.all_steps() == [1, 2, 3]
            writer.delete(1)
            writer.delete(3)
            with pytest.raises(StepNotFoundError, match="step 1 was deleted"):
                reader.restore(1)
            assert reader.restore() == {"s": [2]}
            assert reader.all_steps() == [2]


def test_exception_in_with_body_is_not_replaced_by_a_commit_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A KeyboardInterrupt in the body propagates; the pending commit failure is logged."""

    def fail() -> None:
        raise RuntimeError("disk on fire")

    with (
        caplog.at_level(logging.ERROR, logger="cairn"),
        pytest.raises(KeyboardInterrupt) as info,
        CheckpointManager(tmp_path, handlers={"x": InMemoryHandler(on_write=fail)}) as mgr,
    ):
        mgr.save(1, {"x": 1})
        raise KeyboardInterrupt
    assert "disk on fire" in caplog.text
    assert any("disk on fire" in note for note in info.value.__notes__)


class LyingHandler(NumpyTreeHandler):
    """Returns a record for a file outside what it wrote."""

    id = "test.lying"

    def snapshot(self, obj: Any) -> Any:
        class Snap:
            def write(self, directory: Path) -> list[FileRecord]:
                (directory / "a.json").write_text("{}")
                return [FileRecord("sub/../a.json", 2, 0)]

        return Snap()


def test_bad_file_record_fails_the_commit(tmp_path: Path) -> None:
    """A handler's record with '..' in its path fails at commit time, not after a restart."""
    with CheckpointManager(tmp_path, handlers={"x": LyingHandler()}) as mgr:
        mgr.save(1, {"x": 1})
        with pytest.raises(
            CommitError, match=r"must be relative, of plain names \(no '\.', '\.\.'"
        ):
            mgr.wait_until_finished()
        assert mgr.all_steps() == []


def test_save_errors_name_the_item(tmp_path: Path) -> None:
    """What a handler refuses is reported with the item's name."""
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(
            TypeError, match="item 'opt_state': no handler is registered for object"
        ):
            mgr.save(1, {"opt_state": object()})
        with pytest.raises(TypeError, match=r"item 'params': leaf at \['w'\] is a set"):
            mgr.save(1, {"params": {"w": {1}}})
        assert_tree_equal(mgr.all_steps(), [])


def test_background_threads_yield_the_cpu_to_training(tmp_path: Path) -> None:
    """The commit thread runs at nice 19 (Linux threads have their own); the caller is untouched."""
    seen: list[int] = []

    def record() -> None:
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with CheckpointManager(tmp_path, handlers={"x": InMemoryHandler(on_write=record)}) as mgr:
        mgr.save(1, {"x": 1})
        mgr.wait_until_finished()
    assert seen == [max(caller, BACKGROUND_NICE)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == caller


def test_a_manager_never_closed_still_commits_at_exit(tmp_path: Path) -> None:
    """A script that saves and ends without close(): its pending commits land before the
    interpreter shuts down, although the train-state write starts thread pools of its own."""
    import subprocess
    import sys

    script = (
        "import sys, numpy as np\n"
        "from cairn.manager import CheckpointManager\n"
        "mgr = CheckpointManager(sys.argv[1])\n"
        "for step in range(3):\n"
        "    mgr.save(step, {'x': np.full(1000, step)})\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "failed" not in out.stderr, out.stderr
    with CheckpointManager(tmp_path, read_only=True) as mgr:
        assert mgr.all_steps() == [0, 1, 2]
        np.testing.assert_array_equal(mgr.restore()["x"], np.full(1000, 2))
