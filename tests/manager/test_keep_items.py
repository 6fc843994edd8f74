"""Per-item retention (keep_items): T5X's keep_dataset_checkpoints, by the protocol of DESIGN.md."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.iterutil import Shuffled, advanced, take
from support.treeutil import assert_tree_equal
from test_manager import edit_manifest

from cairn.handlers import Handler, StatefulIteratorHandler, StoredItem, TrainStateHandler
from cairn.manager import (
    CheckpointManager,
    CorruptCheckpointError,
    EveryNSteps,
    ItemNotFoundError,
    KeepLatest,
    StepNotFoundError,
)

TESTS = Path(__file__).parents[1]


def save_steps(mgr: CheckpointManager, steps: range) -> None:
    for step in steps:
        mgr.save(step, {"state": {"w": [step]}, "dataset": advanced(Shuffled(), step)})


def test_only_the_item_leaves_older_steps(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_items={"dataset": KeepLatest(2)}) as mgr:
        save_steps(mgr, range(1, 6))
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 2, 3, 4, 5]
        assert [s for s in mgr.all_steps() if not mgr.info(s).items["dataset"].dropped] == [4, 5]
        assert mgr.info(2).items["dataset"].bytes == 0
        assert mgr.restore(2) == {"state": {"w": [2]}}  # the rest of the step restores
        with pytest.raises(
            ItemNotFoundError, match="item 'dataset' of step 2 was dropped by retention"
        ):
            mgr.restore(2, {"dataset": Shuffled()})
        got = mgr.restore(4, {"dataset": Shuffled()})["dataset"]
        assert take(got) == take(advanced(Shuffled(), 4))
    assert not (tmp_path / "checkpoint_2" / "dataset").exists()
    assert (tmp_path / "checkpoint_5" / "dataset").is_dir()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".trash")]
    with CheckpointManager(tmp_path, read_only=True) as reader:  # a new reader agrees
        assert reader.info(3).items["dataset"].dropped
        assert not reader.info(4).items["dataset"].dropped


def test_a_fifo_where_a_dropped_item_was_is_removed_unopened(tmp_path: Path) -> None:
    """A crafted step whose item directory is a FIFO: dropping the item unlinks it; opening it,
    as rmtree does, would block the reclaim thread and close() for ever (found by the packed
    fuzz soak)."""
    with CheckpointManager(tmp_path, keep_items={"dataset": KeepLatest(1)}) as mgr:
        save_steps(mgr, range(1, 2))
        mgr.wait_until_finished()
    item = tmp_path / "checkpoint_1" / "dataset"
    shutil.rmtree(item)
    os.mkfifo(item)
    closed = threading.Event()

    def run() -> None:
        with CheckpointManager(tmp_path, keep_items={"dataset": KeepLatest(1)}) as mgr:
            save_steps(mgr, range(2, 3))  # step 1's dataset is dropped: its FIFO goes to trash
        closed.set()

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    if not closed.wait(30):
        with open(os.open(next(tmp_path.glob(".trash-*")), os.O_WRONLY | os.O_NONBLOCK), "wb"):
            pass  # let the blocked open return, so that the test process can end
        pytest.fail("close() hung removing the FIFO")
    worker.join()
    assert not item.exists() and not list(tmp_path.glob(".trash-*"))
    with CheckpointManager(tmp_path, read_only=True) as reader:
        assert reader.info(1).items["dataset"].dropped


def test_with_step_retention_and_steps_without_the_item(tmp_path: Path) -> None:
    """Steps without the item do not count towards its KeepLatest; step retention still runs."""
    with CheckpointManager(
        tmp_path, save=EveryNSteps(1), keep=KeepLatest(4), keep_items={"dataset": KeepLatest(1)}
    ) as mgr:
        save_steps(mgr, range(1, 4))
        mgr.save(4, {"state": {"w": [4]}})  # no dataset in this one
        save_steps(mgr, range(5, 7))
        mgr.wait_until_finished()
        assert mgr.all_steps() == [3, 4, 5, 6]
        have = {
            s: "dataset" in mgr.info(s).items and not mgr.info(s).items["dataset"].dropped
            for s in mgr.all_steps()
        }
        assert have == {3: False, 4: False, 5: False, 6: True}


def test_crash_between_manifest_and_trash_is_cleaned(tmp_path: Path) -> None:
    """A manifest already marks the item dropped but its directory is still there: the next
    start removes the directory; the step restores."""
    with CheckpointManager(tmp_path) as mgr:
        save_steps(mgr, range(1, 3))

    def drop(body: dict) -> None:
        body["items"]["dataset"].update(dropped=True, files=[])

    edit_manifest(tmp_path, 1, drop)
    (tmp_path / "checkpoint_1" / "._CHECKPOINT.json.tmp-0123").write_bytes(b"half")
    with CheckpointManager(tmp_path) as mgr:
        assert not (tmp_path / "checkpoint_1" / "dataset").exists()
        assert not (tmp_path / "checkpoint_1" / "._CHECKPOINT.json.tmp-0123").exists()
        assert mgr.restore(1) == {"state": {"w": [1]}}
        assert (tmp_path / "checkpoint_2" / "dataset").is_dir()


def test_a_directory_named_as_a_half_written_manifest_is_removed(tmp_path: Path) -> None:
    """A crafted step holding a directory (with a link out in it) under the name of a manifest
    being replaced: a writable start removes it, link unfollowed, instead of failing with
    IsADirectoryError (found by the fuzz soak); the step restores."""
    with CheckpointManager(tmp_path / "run") as mgr:
        save_steps(mgr, range(1, 2))
    (tmp_path / "victim").mkdir()
    (tmp_path / "victim" / "keep").write_bytes(b"x")
    crafted = tmp_path / "run" / "checkpoint_1" / "._CHECKPOINT.json.tmp-cccc"
    crafted.mkdir()
    os.symlink(tmp_path / "victim", crafted / "out")
    with CheckpointManager(tmp_path / "run") as mgr:
        assert not crafted.exists()
        assert mgr.restore(1)["state"] == {"w": [1]}
    assert (tmp_path / "victim" / "keep").read_bytes() == b"x"


@pytest.mark.parametrize(
    ("keep_items", "error", "match"),
    [
        ([("dataset", KeepLatest(1))], TypeError, "keep_items must be a mapping"),
        ({"../x": KeepLatest(1)}, ValueError, r"\.\./x"),
        ({"dataset": EveryNSteps(1)}, TypeError, r"keep_items\['dataset'\] must be a keep policy"),
        ({"dataset": 3}, TypeError, r"keep_items\['dataset'\] must be a keep policy"),
    ],
)
def test_bad_keep_items(tmp_path: Path, keep_items: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        CheckpointManager(tmp_path / "ck", keep_items=keep_items)  # type: ignore[arg-type]
    assert not (tmp_path / "ck").exists()


# ---------------------------------------------------------------- a reader beside the writer
# A reader holds the manifest it read (at open or reload) while the writer's per-item retention
# replaces it and moves the item away: the reader must read the manifest again and see a drop,
# never damage, and never fall back past the intact step it was reading.

KEEP_DATASET = {"dataset": KeepLatest(1)}


@pytest.fixture(params=["posix", "s3"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Path | str:
    if request.param == "posix":
        return tmp_path
    return f"{request.getfixturevalue('s3_bucket')}/run"


def no_damage_reported(caplog: pytest.LogCaptureFixture) -> bool:
    return not [r for r in caplog.records if "damaged" in r.getMessage()]


def test_reader_holding_a_manifest_from_before_the_drop(
    root: Path | str, caplog: pytest.LogCaptureFixture
) -> None:
    """The reader read step N's manifest, then the writer's next save dropped N's dataset:
    restore() gives step N without it (not step N-1), a named dataset is ItemNotFoundError,
    verify finds nothing wrong."""
    with CheckpointManager(root, keep_items=KEEP_DATASET) as writer:
        save_steps(writer, range(1, 3))
        writer.wait_until_finished()
        with (
            caplog.at_level("WARNING", logger="cairn"),
            CheckpointManager(root, read_only=True) as reader,
        ):
            assert not reader.info(2).items["dataset"].dropped  # what it read at open
            save_steps(writer, range(3, 4))
            writer.wait_until_finished()  # step 2's dataset is dropped now
            assert reader.restore() == {"state": {"w": [2]}}
            assert reader.info(2).items["dataset"].dropped  # it read the new manifest

            reader.reload()
            save_steps(writer, range(4, 5))  # drops step 3's dataset
            writer.wait_until_finished()
            with pytest.raises(
                ItemNotFoundError, match="item 'dataset' of step 3 was dropped by retention"
            ):
                reader.restore(3, {"state": None, "dataset": Shuffled()})

            reader.reload()
            save_steps(writer, range(5, 6))  # drops step 4's dataset
            writer.wait_until_finished()
            assert reader.verify(4) == []
            assert reader.info(4).items["dataset"].dropped
            reader.reload()
            got = reader.restore(5, {"dataset": Shuffled()})["dataset"]
            assert take(got) == take(advanced(Shuffled(), 5))
        assert no_damage_reported(caplog)


class RestoreHook:
    """A real handler whose restore calls `before` first, once: after the manager checked the
    item's files, before the handler reads them."""

    def __init__(self, inner: Handler, before: Callable[[], None]) -> None:
        self.inner, self.before, self.called = inner, before, False
        self.id, self.version = inner.id, inner.version

    def snapshot(self, obj: Any) -> Any:
        return self.inner.snapshot(obj)

    def restore(self, stored: StoredItem, target: Any = None) -> Any:
        if not self.called:
            self.called = True
            self.before()
        return self.inner.restore(stored, target)

    def describe(self, stored: StoredItem) -> dict[str, Any]:
        return self.inner.describe(stored)


@pytest.mark.parametrize("during", ["state", "dataset"])
@pytest.mark.parametrize("named", [False, True])
def test_item_dropped_while_the_reader_reads_the_step(
    root: Path | str, during: str, named: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The writer's next save drops the dataset while the reader is inside the restore of the
    newest step: of the dataset itself (after its files were checked), or of the state (read
    after the dataset, which the reader then cannot trust). items=None gives that step's state
    (not the older step's); a named dataset is ItemNotFoundError."""
    with CheckpointManager(root, keep_items=KEEP_DATASET) as writer:
        save_steps(writer, range(1, 3))
        writer.wait_until_finished()

        def drop() -> None:
            save_steps(writer, range(3, 4))
            writer.wait_until_finished()

        inner = TrainStateHandler() if during == "state" else StatefulIteratorHandler()
        hooked = RestoreHook(inner, drop)
        with (
            caplog.at_level("WARNING", logger="cairn"),
            CheckpointManager(root, read_only=True, handlers={during: hooked}) as reader,
        ):
            if named:
                with pytest.raises(
                    ItemNotFoundError, match="item 'dataset' of step 2 was dropped by retention"
                ):
                    reader.restore(items={"state": None, "dataset": Shuffled()})
            else:
                assert reader.restore() == {"state": {"w": [2]}}
            assert hooked.called  # the drop did happen inside the restore
            assert reader.all_steps() == [1, 2]
            assert reader.info(2).items["dataset"].dropped
        assert no_damage_reported(caplog)


def test_item_dropped_while_verify_reads_the_step(root: Path | str) -> None:
    """After verify read the dataset's file (items go in name order), the writer drops the state:
    the files that left are not reported, the step is intact."""
    with CheckpointManager(root, keep_items={"state": KeepLatest(1)}) as writer:
        save_steps(writer, range(1, 3))
        writer.wait_until_finished()
        calls: list[int] = []

        def progress(n: int) -> None:
            if not calls:
                save_steps(writer, range(3, 4))
                writer.wait_until_finished()
            calls.append(n)

        with CheckpointManager(root, read_only=True) as reader:
            assert reader.verify(2, progress=progress) == []
            assert reader.info(2).items["state"].dropped


def test_damage_is_still_damage_beside_a_keep_items_writer(tmp_path: Path) -> None:
    """Reading the manifest again changes nothing when it did not change: a missing file of a
    live item is CorruptCheckpointError, and restore() falls back past the damaged step."""
    with CheckpointManager(tmp_path, keep_items=KEEP_DATASET) as writer:
        save_steps(writer, range(1, 3))
    victim = next((tmp_path / "checkpoint_2" / "dataset").rglob("*.*"))
    victim.unlink()
    with CheckpointManager(tmp_path, read_only=True) as reader:
        with pytest.raises(CorruptCheckpointError, match=rf"step 2, .*{victim.name}.* is missing"):
            reader.restore(2, {"dataset": Shuffled()})
        assert reader.restore() == {"state": {"w": [1]}}
        assert [p for p in reader.verify(2) if victim.name in p]


def soak(root: Path, saves: int, caplog: pytest.LogCaptureFixture) -> None:
    """A real writer process (async saves, KeepLatest(8), its dataset item kept by
    keep_items=KeepLatest(1)) and a reader restoring its newest step in a loop, until the writer
    has made `saves` saves. Every restore is of the newest step the reader listed (unless the
    writer deleted that step), complete and correct; a named dataset may have been dropped; no
    damage is ever reported."""
    from crash_writer import expected_data, expected_state

    writer = subprocess.Popen(
        [sys.executable, str(TESTS / "crash_writer.py"), str(root), "--dataset", "--keep-latest=8"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout is not None
    done = threading.Event()

    def follow() -> None:
        assert writer.stdout is not None
        for line in writer.stdout:
            if line == f"saved {saves - 1}\n":
                done.set()
        done.set()  # the writer died: the loop ends and the exit code tells

    def gone(step: int) -> bool:  # deleted by the writer's KeepLatest: restore moved on
        return not (root / f"checkpoint_{step}").exists()

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    counts = {"restored": 0, "with data": 0, "data dropped": 0, "step gone": 0, "verified": 0}
    try:
        with (
            caplog.at_level("WARNING", logger="cairn"),
            CheckpointManager(root, read_only=True) as reader,
        ):
            while not done.is_set():
                reader.reload()
                newest = reader.latest_step()
                if newest is None:
                    continue
                named = counts["restored"] % 2 == 1
                try:
                    if counts["restored"] % 5 == 4:
                        assert reader.verify(newest) == []
                        counts["verified"] += 1
                    got = reader.restore(
                        items={"state": None, "data": Shuffled()} if named else None
                    )
                except ItemNotFoundError as e:
                    assert named, e
                    assert f"of step {newest} was dropped" in str(e) or gone(newest), e
                    counts["data dropped"] += 1
                    continue
                except StepNotFoundError:
                    counts["step gone"] += 1
                    continue
                step = int(got["state"]["step"])
                assert step == newest or gone(newest), (step, newest)
                assert_tree_equal(got["state"], expected_state(step))
                if named:
                    assert take(got["data"]) == take(expected_data(step))
                elif "data" in got:  # its state, as saved
                    assert int(got["data"]["pos"]) == expected_data(step).pos
                counts["with data"] += "data" in got
                counts["restored"] += 1
    finally:
        writer.send_signal(signal.SIGKILL)
        _, err = writer.communicate()
        follower.join()
    assert writer.returncode == -signal.SIGKILL, err
    assert no_damage_reported(caplog), [r.getMessage() for r in caplog.records][:3]
    assert counts["restored"] >= 20, counts
    print(f"beside {saves} saves: {counts}")


def test_reader_beside_a_keep_items_writer_soak(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    soak(tmp_path, 120, caplog)


@pytest.mark.slow
def test_reader_beside_a_keep_items_writer_long_soak(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    soak(tmp_path, 1000, caplog)
