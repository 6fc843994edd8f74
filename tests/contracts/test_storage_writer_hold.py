"""A second writable manager of a directory in the same process takes over from the first.

T5X's Checkpointer has no close(), and trainers, eval tools and notebooks build another one on
the same directory; SpeechBrain recipes build a fresh Checkpointer to recover. Another process
is still refused (tests/manager/test_reliability.py holds the directory from a child).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import Gate
from support.treeutil import dir_state

from cairn.handlers import InMemoryHandler
from cairn.manager import (
    CheckpointManager,
    CommitError,
    KeepLatest,
    ReadOnlyError,
    SupersededError,
)

HOLDS = """
import sys
from cairn.manager import CheckpointManager, DirectoryLockedError
try:
    CheckpointManager(sys.argv[1]).close()
except DirectoryLockedError as e:
    print(e)
    sys.exit(3)
"""


def another_process_may_write(directory: Path | str) -> bool:
    """Whether a writable manager opens on `directory` in a fresh process (False: locked)."""
    done = subprocess.run(
        [sys.executable, "-c", HOLDS, str(directory)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode in (0, 3), done.stderr
    return done.returncode == 0


def test_the_new_manager_waits_for_the_old_ones_pending_commit(
    tmp_path: Path, gated_handler: InMemoryHandler, gate: Gate
) -> None:
    old = CheckpointManager(tmp_path, handlers={"x": gated_handler}, keep=KeepLatest(5))
    old.save(1, {"x": "one"})
    assert gate.entered.wait(30)
    opened: list[CheckpointManager] = []
    thread = threading.Thread(
        target=lambda: opened.append(
            CheckpointManager(tmp_path, handlers={"x": gated_handler}, keep=KeepLatest(5))
        )
    )
    thread.start()
    thread.join(timeout=0.5)
    assert thread.is_alive(), "the new manager opened while the old one's commit was held"
    gate.release.set()
    thread.join(timeout=60)
    (new,) = opened
    assert new.all_steps() == [1]  # the old one's pending step, committed before the new scan
    assert new.restore(1)["x"] == "one"
    new.save(2, {"x": "two"})
    new.wait_until_finished()
    old.reload()
    assert old.all_steps() == [1, 2]  # the old one still reads
    new.close()
    old.close()


def test_the_old_manager_turns_read_only(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    old = CheckpointManager(tmp_path)
    old.save(1, {"s": [1]})
    with caplog.at_level(logging.WARNING, logger="cairn"):
        new = CheckpointManager(tmp_path)
    assert "took over" in caplog.text and str(tmp_path) in caplog.text
    before = dir_state(tmp_path)
    for call in (
        lambda: old.save(2, {"s": [2]}),
        lambda: old.save(2, {"s": [2]}, force=True),
        lambda: old.delete(1),
        lambda: old.record_metrics(1, {"loss": 1.0}),
    ):
        with pytest.raises(SupersededError, match="newer writable CheckpointManager") as raised:
            call()
        assert isinstance(raised.value, ReadOnlyError)
    assert dir_state(tmp_path) == before
    assert old.read_only and not new.read_only
    assert old.restore()["s"] == [1]
    old.close()  # lets go of nothing: the lock is the new manager's
    assert not another_process_may_write(tmp_path)
    new.save(2, {"s": [2]})
    new.close()
    assert another_process_may_write(tmp_path)


def test_a_chain_of_managers_and_other_spellings_of_the_directory(tmp_path: Path) -> None:
    """Three managers in turn; the directory named through a link and with ``..``."""
    run = tmp_path / "run"
    run.mkdir()
    (tmp_path / "link").symlink_to(run)
    first = CheckpointManager(run)
    first.save(1, {"s": [1]})
    second = CheckpointManager(tmp_path / "link")
    second.save(2, {"s": [2]})
    third = CheckpointManager(tmp_path / "run" / ".." / "run")
    assert third.all_steps() == [1, 2]
    for old in (first, second):
        with pytest.raises(SupersededError):
            old.save(3, {"s": [3]})
    third.save(3, {"s": [3]})
    third.wait_until_finished()
    assert not another_process_may_write(run)
    for manager in (first, second, third):
        manager.close()
    assert another_process_may_write(run)


def test_a_failed_pending_commit_stays_with_the_old_manager(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def fail() -> None:
        raise OSError("disk on fire")

    old = CheckpointManager(tmp_path, handlers={"x": InMemoryHandler(on_write=fail)})
    old.save(1, {"x": "one"})
    with caplog.at_level(logging.WARNING, logger="cairn"):
        new = CheckpointManager(tmp_path)
    assert "disk on fire" in caplog.text  # logged at the hand-over, not lost with the old one
    assert new.all_steps() == []
    with pytest.raises(CommitError, match="disk on fire"):
        old.check_for_errors()
    new.save(1, {"s": [1]})
    new.close()
    old.close()
    assert CheckpointManager(tmp_path, read_only=True).all_steps() == [1]


def test_readers_do_not_take_over(tmp_path: Path) -> None:
    writer = CheckpointManager(tmp_path)
    with CheckpointManager(tmp_path, read_only=True) as reader:
        assert reader.all_steps() == []
    writer.save(1, {"s": [1]})  # still the writer
    writer.close()
    assert CheckpointManager(tmp_path, read_only=True).all_steps() == [1]


def test_a_closed_or_dropped_manager_is_not_disturbed(tmp_path: Path) -> None:
    CheckpointManager(tmp_path).close()
    dropped = CheckpointManager(tmp_path)
    dropped.save(1, {"s": [1]})
    del dropped  # garbage: its lock goes with it
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.all_steps() == [1]


def test_memory_directories_are_taken_over_too() -> None:
    url = f"memory://takeover-{os.getpid()}"
    old = CheckpointManager(url)
    old.save(1, {"s": [1]})
    with CheckpointManager(url) as new:
        assert new.all_steps() == [1]
        new.save(2, {"s": [2]})
        with pytest.raises(SupersededError):
            old.save(3, {"s": [3]})
    old.close()


@pytest.mark.parametrize("async_save", [True, False])
def test_a_takeover_from_another_thread_while_the_old_one_saves(
    tmp_path: Path, async_save: bool
) -> None:
    """Every save the old manager accepted is committed before the new one lists the
    directory; every later one raises SupersededError; none lands after the hand-over."""
    old = CheckpointManager(tmp_path, async_save=async_save, max_pending=2)
    accepted: list[int] = []
    refused: list[BaseException] = []
    some_saved = threading.Event()

    def train() -> None:
        for step in range(1, 10_000):
            try:
                old.save(step, {"s": [step]})
            except SupersededError as e:
                refused.append(e)
                return
            accepted.append(step)
            if step == 5:
                some_saved.set()

    trainer = threading.Thread(target=train)
    trainer.start()
    assert some_saved.wait(60)
    new = CheckpointManager(tmp_path)
    trainer.join(timeout=60)
    assert not trainer.is_alive() and refused, "the old manager kept saving"
    assert new.all_steps() == accepted  # each accepted save committed, before the new listing
    new.reload()
    assert new.all_steps() == accepted  # and nothing landed after it
    new.close()
    old.close()
