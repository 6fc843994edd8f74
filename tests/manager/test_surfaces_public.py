"""The T5X and SpeechBrain faces go through a manager: one reader of step names, and the
directories SpeechBrain wrote itself deleted by the manager (`delete_directory`), under the
directory's lock, after pending commits."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cairn.manager import (
    CheckpointManager,
    ReadOnlyError,
    SupersededError,
    t5x,
)
from cairn.manager._storage.objectstore import ObjectStore, StorageOptions
from cairn.manager.speechbrain import Checkpointer


def _state(value: float) -> dict[str, Any]:
    return {"w": np.full(4, value, np.float32)}


# ---------------------------------------------------------------------------- step names


def test_t5x_lists_the_steps_a_manager_lists(tmp_path: Path) -> None:
    """`checkpoint_007` is no step for the T5X face, as for a manager of T5X's naming; a
    damaged step is left out by T5X's listing (T5X needs its ``checkpoint`` file)."""
    padded = tmp_path / "padded"
    with CheckpointManager(padded, step_digits=3, async_save=False) as mgr:
        mgr.save(7, {"s": _state(7)})
    assert (padded / "checkpoint_007").is_dir()
    assert t5x.all_steps(padded) == [] and t5x.latest_step(padded) is None
    with pytest.raises(ValueError, match="step_digits=3"):
        CheckpointManager(padded, read_only=True)
    # a path names its step however it is padded (T5X's get_checkpoint_dir pads)
    assert t5x.get_step_from_checkpoint_dir(padded / "checkpoint_007") == (str(padded), 7)

    plain = tmp_path / "plain"
    with CheckpointManager(plain, async_save=False) as mgr:
        for step in (7, 8, 9):
            mgr.save(step, {"s": _state(step)})
    (plain / "checkpoint_9" / "_CHECKPOINT.json").write_text("{")  # damaged
    with CheckpointManager(plain, read_only=True) as reader:
        assert reader.all_steps() == [7, 8, 9]
    assert t5x.all_steps(plain) == [7, 8]
    assert t5x.latest_step(plain) == 8
    assert t5x.find_checkpoint(plain) == str(plain / "checkpoint_8" / "_CHECKPOINT.json")
    assert t5x.find_checkpoint(plain / "checkpoint_7").endswith("checkpoint_7/_CHECKPOINT.json")
    assert t5x.find_checkpoint(plain, 9).endswith("checkpoint_9/_CHECKPOINT.json")  # asked for
    assert t5x.all_steps(tmp_path / "missing") == []


def test_t5x_reads_its_own_writes_through_the_manager(tmp_path: Path) -> None:
    """An async manager of this process has accepted a save: T5X's listing (a read-only
    manager) waits for it, as T5X's synchronous save would have it."""
    with CheckpointManager(tmp_path, async_save=True) as mgr:
        mgr.save(3, {"s": _state(3)})
        assert t5x.all_steps(tmp_path) == [3]
        assert t5x.all_dataset_checkpoint_steps(tmp_path) == []


# ---------------------------------------------------------------------------- delete_directory


def _foreign(root: Path, name: str = "CKPT+2024-01-01+00-00-00+00") -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "CKPT.yaml").write_text("end-of-epoch: true\nunixtime: 5.0\n")
    (path / "net.ckpt").write_bytes(b"x" * 100)
    return path


def test_delete_directory_deletes_a_foreign_directory_after_pending_commits(
    tmp_path: Path,
) -> None:
    foreign = _foreign(tmp_path)
    with CheckpointManager(tmp_path, async_save=True) as mgr:
        mgr.save(1, {"s": _state(1)})
        mgr.delete_directory(foreign.name)
        assert not foreign.exists() and mgr.all_steps() == [1]
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".trash-")]
    assert leftovers == []


@pytest.mark.parametrize(
    ("name", "error", "match"),
    [
        (5, TypeError, "must be a str"),
        (b"CKPT", TypeError, "must be a str"),
        ("", ValueError, "not a directory delete_directory may delete"),
        (".cairn.lock", ValueError, "not hidden"),
        (".trash-x", ValueError, "not hidden"),
        ("..", ValueError, "not hidden"),
        ("../outside", ValueError, "no '/'"),
        ("a/b", ValueError, "no '/'"),
        ("a\\b", ValueError, "no '/'"),
        ("a\0b", ValueError, "no '/'"),
        ("a\nb", ValueError, "one entry"),
        ("x" * 256, ValueError, "one entry"),
        ("cairn_metadata.json", ValueError, "cairn's own"),
        ("é" * 128, ValueError, "one entry"),  # 256 bytes
        ("checkpoint_1", ValueError, r"step 1 of this manager: delete it with delete\(1\)"),
        ("checkpoint_1.tmp-" + "0123456789abcdef" * 2, ValueError, "a save in progress"),
        ("ckpt_2", ValueError, "step 2 under another naming"),
        ("gone", ValueError, "there is no directory 'gone'"),
        ("file", ValueError, "is not a directory"),
        ("link", ValueError, "is not a directory"),
    ],
)
def test_delete_directory_refuses_what_is_not_a_foreign_directory(
    tmp_path: Path, name: Any, error: type[Exception], match: str
) -> None:
    """Nothing on disk changes: the manager's steps, another naming's cairn step, cairn's own
    files, a link (and what it leads to), a file."""
    root, outside = tmp_path / "run", _foreign(tmp_path / "outside")
    with CheckpointManager(root, metadata={"run": 1}, async_save=False) as mgr:
        mgr.save(1, {"s": _state(1)})
    with CheckpointManager(tmp_path / "o", step_prefix="ckpt", async_save=False) as other:
        other.save(2, {"s": _state(2)})
    os.rename(tmp_path / "o" / "ckpt_2", root / "ckpt_2")  # a step of another naming
    (root / "file").write_bytes(b"keep")
    os.symlink(outside, root / "link")
    with CheckpointManager(root, async_save=False) as mgr:
        before = sorted(p.name for p in root.iterdir())
        with pytest.raises(error, match=match):
            mgr.delete_directory(name)
        assert sorted(p.name for p in root.iterdir()) == before
        assert mgr.restore(1)["s"]["w"][0] == 1
    assert (root / "file").read_bytes() == b"keep" and (outside / "net.ckpt").exists()
    assert (root / "ckpt_2" / "_CHECKPOINT.json").is_file()


def test_delete_directory_refuses_a_directory_that_holds_a_checkpoint(tmp_path: Path) -> None:
    """Whatever its name: another cairn directory nested in the root (its writer at work), a
    step Orbax marked committed, a step under another naming cairn cannot read (damaged, or of
    an Orbax item kind cairn does not know), an empty directory. Nothing changes."""
    root = tmp_path / "run"
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"s": _state(1)})
    nested = CheckpointManager(root / "eval", async_save=False)  # open: holds its lock
    nested.save(5, {"s": _state(5)})
    orbax = root / "my.ckpt_5"  # no naming parses it: Orbax's marks tell
    (orbax / "proto").mkdir(parents=True)
    (orbax / "proto" / "state.pbtxt").write_text("x")
    (orbax / "commit_success.txt").write_text("done")
    unknown = root / "ckpt_6"  # a step-like name cairn reads as a damaged step
    (unknown / "proto").mkdir(parents=True)
    (unknown / "proto" / "state.pbtxt").write_text("x")
    (root / "empty").mkdir()
    with CheckpointManager(root, async_save=False) as mgr:
        before = sorted(str(p) for p in root.rglob("*"))
        for name, match in [
            ("eval", "holds a checkpoint"),
            ("my.ckpt_5", r"holds a checkpoint \(commit_success.txt\)"),
            ("ckpt_6", "step 6 under another naming"),
            ("empty", "or it is empty"),
        ]:
            with pytest.raises(ValueError, match=match):
                mgr.delete_directory(name)
        assert sorted(str(p) for p in root.rglob("*")) == before
    nested.save(6, {"s": _state(6)})  # the nested writer goes on
    nested.close()


def test_delete_directory_needs_the_writer(tmp_path: Path) -> None:
    foreign = _foreign(tmp_path)
    with (
        CheckpointManager(tmp_path, read_only=True) as reader,
        pytest.raises(ReadOnlyError, match="delete_directory"),
    ):
        reader.delete_directory(foreign.name)
    assert foreign.exists()


def test_delete_directory_on_an_object_store() -> None:
    """On an object store the directory is a prefix: its objects go; a prefix with no object
    is no directory."""
    url = f"memory://delete-directory/{uuid.uuid4().hex}"
    store = ObjectStore(url, StorageOptions())
    for key in ("CKPT+x/CKPT.yaml", "CKPT+x/net.ckpt", "CKPT+x/sub/a"):
        store.write(key, b"x")
    with CheckpointManager(url, async_save=False) as mgr:
        mgr.save(1, {"s": _state(1)})
        mgr.delete_directory("CKPT+x")
        with pytest.raises(ValueError, match="there is no directory 'CKPT"):
            mgr.delete_directory("CKPT+x")
        assert mgr.all_steps() == [1]
    assert not [k for k in store.list_keys() if k.startswith("CKPT+x")]


def test_a_directory_deletion_a_crash_cut_short_is_finished_by_the_next_writer() -> None:
    """delete_directory marks the prefix first (a `.claim` saying "deleting"): what a crash
    part-way leaves is removed when the next writer opens the directory; a prefix whose `.claim`
    says anything else is not ours, and stays."""
    url = f"memory://delete-directory/{uuid.uuid4().hex}"
    store = ObjectStore(url, StorageOptions())
    for key in ("CKPT+x/net.ckpt", "CKPT+x/sub/a", "CKPT+x/zz"):
        store.write(key, b"x")
    store.write("CKPT+x/.claim", b"deleting")  # the mark, and the rest a crash left
    store.write("other/.claim", b"someone else's")
    store.write("other/data", b"x")
    before = sorted(store.list_keys())
    with CheckpointManager(url, read_only=True):
        pass
    assert sorted(store.list_keys()) == before  # a reader removes nothing
    with CheckpointManager(url, async_save=False) as mgr:
        assert mgr.all_steps() == []
    assert sorted(store.list_keys()) == ["other/.claim", "other/data"]


# ---------------------------------------------------------------------------- SpeechBrain


def test_speechbrain_deletes_its_own_directories_only_as_the_writer(tmp_path: Path) -> None:
    """A Checkpointer superseded by a newer one of the same directory (this process) no longer
    holds the directory's lock: it deletes nothing, a SpeechBrain-written directory included."""
    old = _foreign(tmp_path)
    first = Checkpointer(tmp_path, {"n": {"w": np.ones(2)}})
    with Checkpointer(tmp_path, {"n": {"w": np.ones(2)}}) as second:
        with pytest.raises(SupersededError, match="delete_directory"):
            first.delete_checkpoints(num_to_keep=0)
        assert old.exists()
        second.delete_checkpoints(num_to_keep=0)
        assert not old.exists()
    first.close()
