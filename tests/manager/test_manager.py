"""CheckpointManager on a real filesystem: round trips, commit protocol, async, errors, metrics."""

from __future__ import annotations

import errno
import json
import logging
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import Gate
from support.treeutil import assert_tree_equal, dir_state

from cairn.handlers import FileRecord, InMemoryHandler, JsonHandler, NumpyTreeHandler
from cairn.handlers._numpy_tree import _TreeSnapshot
from cairn.manager import (
    AnyOf,
    CheckpointManager,
    CommitError,
    CorruptCheckpointError,
    EveryNSteps,
    ItemNotFoundError,
    KeepBest,
    KeepLatest,
    ReadOnlyError,
    StepAlreadyExistsError,
    StepNotFoundError,
    UnsupportedFormatError,
)
from cairn.manager._format import dump_checked


def state(step: int) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal((8, 4)).astype(np.float32), "step": step, "tags": ["a", "b"]}


def leftovers(root: Path) -> list[str]:
    return [p.name for p in root.iterdir() if ".tmp-" in p.name or p.name.startswith(".trash-")]


@pytest.fixture(params=[True, False], ids=["async", "sync"])
def async_save(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


def test_round_trip_all_items_selected_items_and_targets(tmp_path: Path, async_save: bool) -> None:
    """Every item comes back without targets; a subset comes back with and without a target."""
    cfg = {"lr": 0.1, "name": "t5-small"}
    with CheckpointManager(
        tmp_path, async_save=async_save, handlers={"config": JsonHandler()}
    ) as mgr:
        assert mgr.save(5, {"state": state(5), "config": cfg, "extra": [np.ones(3)]})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [5] and mgr.latest_step() == 5
        everything = mgr.restore()
        assert sorted(everything) == ["config", "extra", "state"]
        assert_tree_equal(everything["state"], state(5))
        assert everything["config"] == cfg
        only = mgr.restore(
            5, {"state": {"w": np.zeros((8, 4), np.float32), "step": 0, "tags": [None, None]}}
        )
        assert list(only) == ["state"]
        assert_tree_equal(only["state"], state(5))
        assert list(mgr.restore(items={"config": None})) == ["config"]


def test_directory_layout_and_names(tmp_path: Path) -> None:
    """Steps are <prefix>_<step>, padded with step_digits; an empty prefix gives bare numbers."""
    with CheckpointManager(tmp_path / "a", step_digits=6) as mgr:
        mgr.save(100, {"s": [1]})
    assert (tmp_path / "a" / "checkpoint_000100" / "_CHECKPOINT.json").is_file()
    assert (tmp_path / "a" / "checkpoint_000100" / "s" / "tree.json").is_file()
    with CheckpointManager(tmp_path / "b", step_prefix="", async_save=False) as mgr:
        mgr.save(7, {"s": [1]})
    assert (tmp_path / "b" / "7").is_dir()
    with CheckpointManager(tmp_path / "a", step_digits=6) as mgr:
        assert mgr.all_steps() == [100]


@pytest.mark.parametrize("where", ["disk", "memory"])
@pytest.mark.parametrize("read_only", [False, True])
def test_steps_under_other_padding_are_refused_not_ignored(
    tmp_path: Path, where: str, read_only: bool
) -> None:
    """Issue 43: a run saved with step_digits=6 (``checkpoint_000100``) opened with the
    defaults used to list no step, and the next save started a run from scratch beside it
    (``checkpoint_0``). It is refused, naming the option that reads it, and nothing is
    written; the option works; directories that only look like steps are no reason."""
    import uuid

    root: Any = tmp_path / "run" if where == "disk" else f"memory://pad/{uuid.uuid4().hex}"
    with CheckpointManager(root, step_digits=6) as mgr:
        mgr.save(100, {"s": [1]})
    before = dir_state(tmp_path)
    with pytest.raises(ValueError, match="step_digits=6") as raised:
        CheckpointManager(root, read_only=read_only)
    assert "steps written by cairn named like 'checkpoint_000000'" in str(raised.value)
    assert dir_state(tmp_path) == before
    with CheckpointManager(root, step_digits=6, read_only=read_only) as mgr:
        assert mgr.all_steps() == [100]
    with pytest.raises(ValueError, match="step_prefix='checkpoint', step_digits=6"):
        CheckpointManager(root, step_prefix="checkpoint", step_digits=4)


def test_moved_checkpoint_directory_restores(tmp_path: Path) -> None:
    """The whole directory copied elsewhere restores: nothing on disk holds absolute paths."""
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, {"state": state(1)})
    shutil.move(tmp_path / "run", tmp_path / "moved")
    with CheckpointManager(tmp_path / "moved") as mgr:
        assert_tree_equal(mgr.restore()["state"], state(1))


def test_snapshot_protects_against_later_mutation(
    tmp_path: Path, gated_handler: InMemoryHandler, gate: Gate
) -> None:
    """Arrays changed in place right after save() returns are saved with their old values."""
    s = state(1)
    with CheckpointManager(tmp_path, handlers={"gate": gated_handler}) as mgr:
        mgr.save(1, {"state": s, "gate": 0})
        s["w"][:] = -1  # the commit thread has not even started writing
        gate.release.set()
        mgr.wait_until_finished()
        assert_tree_equal(mgr.restore(1)["state"], state(1))


def test_async_step_is_invisible_until_committed(
    tmp_path: Path, gated_handler: InMemoryHandler, gate: Gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the write is held, the step is neither listed nor on disk under its final name,
    for a reader of another process (one in this process waits for it: read your writes,
    tests/manager/test_read_your_writes.py; here it does not)."""
    from cairn.manager._core import takeover

    monkeypatch.setattr(takeover, "settle_writer", lambda key: None)
    with CheckpointManager(tmp_path, handlers={"x": gated_handler}) as mgr:
        assert mgr.save(1, {"x": "payload"})
        assert gate.entered.wait(30)
        assert mgr.all_steps() == []
        assert not (tmp_path / "checkpoint_1").exists()
        assert len(leftovers(tmp_path)) == 1  # the temporary directory being written
        with CheckpointManager(tmp_path, read_only=True) as reader:
            assert reader.all_steps() == []
        with pytest.raises(StepAlreadyExistsError, match="step 1 is already being committed"):
            mgr.save(1, {"x": "again"}, force=True)
        assert mgr.should_save(1) is False
        gate.release.set()
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1] and leftovers(tmp_path) == []
        assert mgr.restore(1)["x"] == "payload"


class WatchedSlots:
    """Wraps the manager's semaphore: notes each acquire, and whether it returned before the gate opened."""

    def __init__(self, inner: Any, gate: Gate) -> None:
        self.inner, self.gate = inner, gate
        self.waiting = threading.Event()
        self.returned_early: list[bool] = []

    def acquire(self, *args: Any, **kwargs: Any) -> bool:
        self.waiting.set()
        got = self.inner.acquire(*args, **kwargs)
        self.returned_early.append(not self.gate.release.is_set())
        return bool(got)

    def release(self) -> None:
        self.inner.release()


def test_max_pending_bounds_saves_in_flight(
    tmp_path: Path, gated_handler: InMemoryHandler, gate: Gate
) -> None:
    """With max_pending=1 a second save waits for the first commit; the wait counts as blocked."""
    with CheckpointManager(tmp_path, handlers={"x": gated_handler}) as mgr:
        mgr.save(1, {"x": 1})
        assert gate.entered.wait(30)
        slots = WatchedSlots(mgr._commits.slots, gate)
        mgr._commits.slots = slots  # type: ignore[assignment]
        second = threading.Thread(target=mgr.save, args=(2, {"x": 2}))
        second.start()
        assert slots.waiting.wait(30)  # the second save has reached the bound
        gate.release.set()
        second.join(timeout=30)
        mgr.wait_until_finished()
        assert slots.returned_early == [False], "the second save did not wait for the first commit"
        assert mgr.all_steps() == [1, 2]
        assert mgr.info(2).telemetry["blocked_s"] > 0
        assert mgr.info(2).telemetry["commit_s"] > 0


def test_step_already_exists_with_and_without_force(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A committed step is never saved again. As Orbax (issue 43): without force the policy is
    asked first and says no, so save() returns False (and logs); with force=True it raises
    StepAlreadyExistsError. The disk is unchanged either way."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(3, {"s": state(3)})
        mgr.wait_until_finished()
        before = dir_state(tmp_path)
        with caplog.at_level(logging.INFO, "cairn"):
            assert mgr.save(3, {"s": state(4)}) is False
        assert "step 3 exists" in caplog.text
        with pytest.raises(StepAlreadyExistsError, match="step 3 is already committed"):
            mgr.save(3, {"s": state(4)}, force=True)
        assert dir_state(tmp_path) == before


def test_a_loop_that_saves_its_last_step_again_goes_on(tmp_path: Path) -> None:
    """MaxText's completion save: the last step, a multiple of the period, is saved again at
    the end with force=False. Under Orbax that returns False; it must not raise (issue 43)."""
    with CheckpointManager(tmp_path, save=EveryNSteps(5)) as mgr:
        saved = [step for step in range(11) if mgr.save(step, {"s": state(step)})]
        assert saved == [0, 5, 10]
        assert mgr.save(10, {"s": state(10)}, force=False) is False  # the completion save
        mgr.wait_until_finished()
        assert mgr.all_steps() == [0, 5, 10]


def test_should_save_and_force(tmp_path: Path) -> None:
    """The policy decides unless forced; steps at or below the newest committed are never due."""
    with CheckpointManager(tmp_path, save=EveryNSteps(10)) as mgr:
        assert mgr.should_save(0) and not mgr.should_save(5) and mgr.should_save(10)
        assert mgr.save(5, {"s": [5]}) is False
        assert mgr.all_steps() == []
        assert mgr.save(5, {"s": [5]}, force=True) is True
        mgr.wait_until_finished()
        assert mgr.all_steps() == [5]
        assert not mgr.should_save(0)  # below the newest
        assert mgr.save(np.int64(20), {"s": [20]}) and mgr.save(np.array(30), {"s": [30]})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [5, 20, 30]


def test_metadata_is_stored_and_read_back(tmp_path: Path) -> None:
    """save(metadata=) lands in the manifest and comes back through info(step)."""
    meta = {"git": "abc123", "config": {"layers": 4, "dims": [1, 2]}}
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"s": [1]}, metadata=meta, metrics={"loss": np.float32(0.5)})
        meta["git"] = "changed"
        info = mgr.info(1)
    assert info.metadata == {"git": "abc123", "config": {"layers": 4, "dims": [1, 2]}}
    assert info.metrics == {"loss": 0.5}
    assert info.items["s"].handler == "cairn.train_state" and info.items["s"].bytes > 0
    assert set(info.telemetry) >= {"blocked_s", "write_s", "commit_s", "bytes", "bytes_per_s"}
    manifest = json.loads((tmp_path / "checkpoint_1" / "_CHECKPOINT.json").read_bytes())
    assert manifest["format_version"] == 2 and manifest["step"] == 1
    assert manifest["items"]["s"]["files"][0].keys() == {"path", "size", "xxh3_128"}


def test_leftovers_are_removed_at_start_but_not_by_readers(tmp_path: Path) -> None:
    """Temporary and trash entries from a crashed writer go away when the next writer starts."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"s": [1]})
    (tmp_path / ("checkpoint_2.tmp-" + "0" * 32) / "s").mkdir(parents=True)
    (tmp_path / ".trash-checkpoint_0-abc").mkdir()
    (tmp_path / "checkpoint_1" / ".metrics.json.tmp-123").write_text("{")
    (tmp_path / "unrelated.tmp-x").mkdir()  # not ours: left alone
    with CheckpointManager(tmp_path, read_only=True) as reader:
        assert reader.all_steps() == [1]
        assert len(leftovers(tmp_path)) == 3
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.all_steps() == [1]
    assert leftovers(tmp_path) == ["unrelated.tmp-x"]
    assert not (tmp_path / "checkpoint_1" / ".metrics.json.tmp-123").exists()


def test_read_only_refuses_writes(tmp_path: Path) -> None:
    """A read-only manager refuses save, delete and record_metrics with ReadOnlyError."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"s": [1]})
    before = dir_state(tmp_path)
    with CheckpointManager(tmp_path, read_only=True) as reader:
        for call in (
            lambda: reader.save(2, {"s": [2]}),
            lambda: reader.delete(1),
            lambda: reader.record_metrics(1, {"a": 1}),
        ):
            with pytest.raises(ReadOnlyError, match="read_only=True"):
                call()
        assert reader.restore(1)["s"] == [1]
    assert dir_state(tmp_path) == before


def test_reader_sees_new_steps_after_reload(tmp_path: Path) -> None:
    """reload() picks up what another manager committed and deleted."""
    with (
        CheckpointManager(tmp_path) as writer,
        CheckpointManager(tmp_path, read_only=True) as reader,
    ):
        writer.save(1, {"s": [1]})
        writer.wait_until_finished()
        assert reader.all_steps() == []
        reader.reload()
        assert reader.all_steps() == [1]
        writer.delete(1)
        reader.reload()
        assert reader.all_steps() == []


def test_delete(tmp_path: Path, async_save: bool) -> None:
    """delete removes a step completely; an unknown step raises StepNotFoundError."""
    with CheckpointManager(tmp_path, async_save=async_save) as mgr:
        mgr.save(1, {"s": [1]})
        mgr.save(2, {"s": [2]})
        mgr.delete(1)
        assert mgr.all_steps() == [2]
        names = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".trash-"))
        assert names == [".cairn.lock", "checkpoint_2"]  # its space may still be being freed
        with pytest.raises(StepNotFoundError, match=r"step 1 is not committed.*committed: \[2\]"):
            mgr.delete(1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".cairn.lock",
        "checkpoint_2",
    ]  # close waits


# ---------------------------------------------------------------------------- damage


def damage_manifest(root: Path, step: int, how: str) -> None:
    path = root / f"checkpoint_{step}" / "_CHECKPOINT.json"
    if how == "delete":
        path.unlink()
    elif how == "garbage":
        path.write_text("{not json")
    elif how == "flip":  # still valid JSON: only the manifest's own checksum catches it
        text = path.read_text()
        path.write_text(text.replace(f'"step": {step}', f'"step": {step + 1000}'))


@pytest.mark.parametrize("how", ["delete", "garbage", "flip"])
def test_damaged_manifest_is_a_corrupt_step(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A step dir with a bad manifest is listed, restore(step) raises, restore() falls back."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"s": state(1)})
        mgr.save(2, {"s": state(2)})
    damage_manifest(tmp_path, 2, how)
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.all_steps() == [1, 2]
        with pytest.raises(CorruptCheckpointError, match="step 2"):
            mgr.restore(2)
        with pytest.raises(CorruptCheckpointError, match="step 2"):
            mgr.restore(fallback=False)
        with caplog.at_level(logging.WARNING, logger="cairn"):
            assert_tree_equal(mgr.restore()["s"], state(1))
        assert "step 2 is damaged, falling back" in caplog.text


def test_damaged_array_file_names_the_file_and_falls_back(tmp_path: Path) -> None:
    """A flipped byte in array data: restore(step) names step, file and chunk; restore() takes the
    older step."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"s": state(1)})
        mgr.save(2, {"s": state(2)})
    (victim,) = (tmp_path / "checkpoint_2" / "s" / "packs").glob("0.*.0")  # the one pack
    data = bytearray(victim.read_bytes())
    data[10] ^= 1  # in the first chunk: leaf 'w'
    victim.write_bytes(bytes(data))
    with CheckpointManager(tmp_path, read_only=True) as mgr:
        with pytest.raises(
            CorruptCheckpointError,
            match=rf"step 2, item 's', file .*{victim.name}, chunk arrays/0/0\.0 \(leaf \['w'\]\) "
            "is not the chunk the index records",
        ):
            mgr.restore(2)
        assert_tree_equal(mgr.restore()["s"], state(1))
        victim.unlink()
        with pytest.raises(CorruptCheckpointError, match=rf"{victim.name} is missing"):
            mgr.restore(2)


def edit_manifest(root: Path, step: int, edit: Any) -> None:
    """Change a committed manifest and re-sign it, so only what `edit` did is wrong."""
    path = root / f"checkpoint_{step}" / "_CHECKPOINT.json"
    body = json.loads(path.read_bytes())
    del body["crc32c"]
    edit(body)
    path.write_bytes(dump_checked(body))


def test_newer_format_version_is_refused(tmp_path: Path) -> None:
    """A manifest from a newer format version raises UnsupportedFormatError, not a fallback."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"s": [1]})
    edit_manifest(tmp_path, 1, lambda body: body.update(format_version=99))
    with CheckpointManager(tmp_path, read_only=True) as mgr:
        assert mgr.all_steps() == [1]
        for call in (lambda: mgr.restore(1), lambda: mgr.restore(), lambda: mgr.info(1)):
            with pytest.raises(
                UnsupportedFormatError, match="format version 99; this cairn reads up to 2"
            ):
                call()


def test_unknown_and_dropped_items(tmp_path: Path) -> None:
    """Asking for an item the step lacks raises ItemNotFoundError listing what it has."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"s": [1], "t": [2]})
        with pytest.raises(ItemNotFoundError, match=r"step 1 has no item 'u'; it has \['s', 't'\]"):
            mgr.restore(1, {"u": None})
        with pytest.raises(StepNotFoundError, match="step 9 is not committed"):
            mgr.restore(9)
    with (
        CheckpointManager(tmp_path / "empty") as mgr,
        pytest.raises(StepNotFoundError, match="no committed step"),
    ):
        mgr.restore()


# ---------------------------------------------------------------------------- failures on the commit thread


class FailingHandler(NumpyTreeHandler):
    """A real handler whose write phase fails: after `fail_after` bytes, like a full disk."""

    id = "test.failing"

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.enabled = True

    def snapshot(self, obj: Any) -> Any:
        inner = super().snapshot(obj)
        handler = self

        class Snap:
            def write(self, directory: Path) -> list[FileRecord]:
                records = list(_TreeSnapshot.write(inner, directory))
                if handler.enabled:
                    (directory / "partial").write_bytes(b"x" * 1000)
                    raise handler.error
                return records

        return Snap()


@pytest.mark.parametrize(
    "error",
    [RuntimeError("handler exploded"), OSError(errno.ENOSPC, "No space left on device")],
    ids=["raise", "enospc"],
)
def test_failed_commit_surfaces_once_and_loses_nothing(
    tmp_path: Path, error: BaseException
) -> None:
    """The error comes back once as CommitError; earlier steps stay; nothing partial; next save works."""
    handler = FailingHandler(error)
    handler.enabled = False
    with CheckpointManager(tmp_path, handlers={"s": handler}) as mgr:
        mgr.save(1, {"s": state(1)})
        mgr.wait_until_finished()
        handler.enabled = True
        mgr.save(2, {"s": state(2)})
        with pytest.raises(CommitError, match="the commit of step 2 failed") as info:
            mgr.wait_until_finished()
        assert info.value.__cause__ is error
        mgr.check_for_errors()  # raised exactly once
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1] and leftovers(tmp_path) == []
        assert not (tmp_path / "checkpoint_2").exists()
        handler.enabled = False
        assert mgr.save(2, {"s": state(2)})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 2]
        assert_tree_equal(mgr.restore(2)["s"], state(2))


def test_failed_commit_is_raised_by_next_save(tmp_path: Path) -> None:
    """A background failure is raised by the next save(), which then starts nothing."""
    handler = FailingHandler(RuntimeError("boom"))
    with CheckpointManager(tmp_path, handlers={"s": handler}) as mgr:
        mgr.save(1, {"s": [1]})
        with pytest.raises(CommitError, match="boom"):
            mgr.save(2, {"s": [2]})
        handler.enabled = False
        mgr.wait_until_finished()
        assert mgr.all_steps() == []


def test_sync_save_raises_the_original_error(tmp_path: Path) -> None:
    """With async_save=False the write error is raised by save() itself, unwrapped."""
    with CheckpointManager(
        tmp_path, async_save=False, handlers={"s": FailingHandler(OSError(errno.ENOSPC, "full"))}
    ) as mgr:
        with pytest.raises(OSError, match="full"):
            mgr.save(1, {"s": [1]})
        assert mgr.all_steps() == [] and leftovers(tmp_path) == []
        mgr.check_for_errors()


def test_close_raises_a_pending_error_and_releases_the_lock(tmp_path: Path) -> None:
    """close() waits, raises the pending CommitError, and still releases the directory."""
    mgr = CheckpointManager(tmp_path, handlers={"s": FailingHandler(RuntimeError("late"))})
    mgr.save(1, {"s": [1]})
    with pytest.raises(CommitError, match="late"):
        mgr.close()
    CheckpointManager(tmp_path).close()


# ---------------------------------------------------------------------------- metrics and retention


def test_keep_latest_after_each_commit(tmp_path: Path, async_save: bool) -> None:
    """KeepLatest(2) leaves the two newest steps on disk after every commit."""
    with CheckpointManager(tmp_path, keep=KeepLatest(2), async_save=async_save) as mgr:
        for step in range(6):
            mgr.save(step, {"s": [step]})
            mgr.wait_until_finished()
            assert mgr.all_steps() == list(range(max(0, step - 1), step + 1))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint")) == [
        "checkpoint_4",
        "checkpoint_5",
    ]


def test_late_metrics_best_step_and_keep_best(tmp_path: Path) -> None:
    """record_metrics merges over save metrics, KeepBest sees it, best_step and restore('best') agree."""
    keep = AnyOf(KeepLatest(1), KeepBest(1, "eval_loss", mode="min", keep_without_metrics=False))
    with CheckpointManager(tmp_path, keep=keep) as mgr:
        mgr.save(1, {"s": [1]}, metrics={"eval_loss": 0.5, "loss": 2.0})
        mgr.save(2, {"s": [2]}, metrics={"loss": 1.0})
        mgr.record_metrics(2, {"eval_loss": 0.1})
        assert mgr.metrics(2) == {"loss": 1.0, "eval_loss": 0.1}
        mgr.save(3, {"s": [3]}, metrics={"eval_loss": 0.3})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [2, 3]
        assert mgr.best_step() == 2
        assert mgr.restore("best") == {"s": [2]}
        mgr.record_metrics(3, {"eval_loss": 0.05})
        assert mgr.all_steps() == [3] and mgr.best_step() == 3
        with pytest.raises(StepNotFoundError, match="step 7"):
            mgr.record_metrics(7, {"eval_loss": 1.0})
    with CheckpointManager(tmp_path, best=("eval_loss", "max"), read_only=True) as reader:
        assert reader.metrics(3) == {"eval_loss": 0.05}  # metrics.json read back from disk
        assert reader.best_step() == 3


def test_best_step_needs_a_rule(tmp_path: Path) -> None:
    """best_step() without best= or a single KeepBest is a ValueError."""
    with (
        CheckpointManager(tmp_path) as mgr,
        pytest.raises(ValueError, match=r"best=\(metric, mode\)"),
    ):
        mgr.best_step()


def test_damaged_metrics_file_falls_back_to_manifest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An unparseable metrics.json logs a warning; the manifest's metrics stand."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"s": [1]}, metrics={"a": 1.0})
        mgr.record_metrics(1, {"a": 2.0})
    (tmp_path / "checkpoint_1" / "metrics.json").write_text('{"metrics": {"a": 3.0}, "crc32c": 1}')
    with (
        caplog.at_level(logging.WARNING, logger="cairn"),
        CheckpointManager(tmp_path, read_only=True) as mgr,
    ):
        assert mgr.metrics(1) == {"a": 1.0}
    assert "ignoring unreadable" in caplog.text


def test_restore_waits_for_pending_commits(
    tmp_path: Path, gated_handler: InMemoryHandler, gate: Gate
) -> None:
    """restore() during an in-flight save returns that step once it is committed."""
    results: list[Any] = []
    with CheckpointManager(tmp_path, handlers={"x": gated_handler}) as mgr:
        mgr.save(1, {"x": "one"})
        assert gate.entered.wait(30)
        draining = threading.Event()
        drain = mgr._commits.drain

        def watched_drain() -> None:
            draining.set()
            drain()
            results.append(("drained after release", gate.release.is_set()))

        mgr._commits.drain = watched_drain  # type: ignore[method-assign]
        reader = threading.Thread(target=lambda: results.append(mgr.restore()))
        reader.start()
        assert draining.wait(30)
        gate.release.set()
        reader.join(timeout=30)
    assert results[:2] == [("drained after release", True), {"x": "one"}]


def test_final_name_appearing_meanwhile_is_never_replaced(tmp_path: Path) -> None:
    """If a directory of the final name appears during the write, the commit refuses to replace it."""
    squatter = InMemoryHandler(on_write=lambda: (tmp_path / "checkpoint_1").mkdir())
    with CheckpointManager(tmp_path, handlers={"x": squatter}) as mgr:
        mgr.save(1, {"x": 1})
        with pytest.raises(CommitError, match="appeared on disk meanwhile"):
            mgr.wait_until_finished()
        assert mgr.all_steps() == [1]  # what is on disk: an empty, hence corrupt, step directory
        with pytest.raises(CorruptCheckpointError, match="has no manifest"):
            mgr.restore(1)
        assert leftovers(tmp_path) == []


def test_python_scalar_items_and_calls_after_close(tmp_path: Path) -> None:
    """Top-level Python scalars are pytrees too; a closed manager refuses writes, reads still work."""
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, {"lr": 0.5, "count": 3})
    mgr.close()
    mgr.close()  # idempotent
    mgr.wait_until_finished()  # nothing pending: returns
    assert mgr.restore(1) == {"lr": 0.5, "count": 3}
    for call in (lambda: mgr.save(2, {"x": 1}), lambda: mgr.delete(1), lambda: mgr.reload()):
        with pytest.raises(RuntimeError, match="is closed"):
            call()


def test_manifest_paths_must_stay_inside_the_step(tmp_path: Path) -> None:
    """A manifest naming '../' files is corrupt: restore never reads outside the step."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"s": [1]})
    edit_manifest(
        tmp_path, 1, lambda body: body["items"]["s"]["files"][0].update(path="../../secret")
    )
    with (
        CheckpointManager(tmp_path, read_only=True) as mgr,
        pytest.raises(CorruptCheckpointError, match="malformed"),
    ):
        mgr.restore(1)


def test_telemetry_in_info_logs_and_tensorboard(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each save's blocked/commit seconds, bytes and bytes/s, each restore's seconds: in info(),
    in the log, and as TensorBoard scalars under Orbax's names."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    tb = tmp_path / "tb"
    with (
        caplog.at_level(logging.INFO, logger="cairn"),
        CheckpointManager(tmp_path / "ck", tensorboard_dir=tb) as mgr,
    ):
        mgr.save(1, {"s": {"w": np.ones(10_000)}})
        mgr.wait_until_finished()
        mgr.restore(1)
        t = mgr.info(1).telemetry
    assert t["bytes"] > 80_000 and t["commit_s"] > 0 and t["restore_s"] > 0
    assert t["bytes_per_s"] == pytest.approx(t["bytes"] / t["commit_s"])
    assert "committed step 1: blocked" in caplog.text and "restored step 1 in" in caplog.text
    seen = {}
    for path in tb.glob("*tfevents*"):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                seen[value.tag] = float(tensor_util.make_ndarray(value.tensor))
    assert set(seen) == {
        "/jax/checkpoint/write/blocking_duration_secs",
        "/jax/checkpoint/write/async/total_duration_secs",
        "/jax/checkpoint/write/bytes",
        "/jax/checkpoint/write/bytes_per_sec",
        "/jax/checkpoint/read/duration_secs",
    }
    assert seen["/jax/checkpoint/write/bytes"] == t["bytes"]
