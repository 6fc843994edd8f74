"""Per-item retention (keep_items): T5X's keep_dataset_checkpoints, by the protocol of DESIGN.md."""

from __future__ import annotations

from pathlib import Path

import pytest
from iterutil import Shuffled, advanced, take
from test_manager import edit_manifest

from cairn.manager import (
    CheckpointManager,
    EveryNSteps,
    ItemNotFoundError,
    KeepLatest,
)


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
