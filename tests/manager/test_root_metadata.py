"""Orbax's manager-level surface: the directory's metadata (saved once) and is_saving_in_progress."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
from conftest import Gate
from support.treeutil import dir_state

from cairn.handlers import InMemoryHandler
from cairn.manager import CheckpointManager, CorruptCheckpointError

FILE = "cairn_metadata.json"


def test_saved_once_readable_without_a_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with CheckpointManager(tmp_path, metadata={"model": "t5-small", "lr": 1e-3}) as mgr:
        assert mgr.metadata() == {"model": "t5-small", "lr": 1e-3}
        assert mgr.all_steps() == []  # the file is not a step
    assert json.loads((tmp_path / FILE).read_text()) == {
        "custom_metadata": {"lr": 0.001, "model": "t5-small"}
    }
    with (  # a later run does not overwrite it
        caplog.at_level(logging.WARNING, logger="cairn"),
        CheckpointManager(tmp_path, metadata={"model": "other"}) as mgr,
    ):
        assert mgr.metadata() == {"model": "t5-small", "lr": 1e-3}
        mgr.save(1, {"s": [1]}, metadata={"note": "step's own"})
        mgr.wait_until_finished()
        assert mgr.metadata(1) == {"note": "step's own"}
    assert "already has metadata" in caplog.text
    with CheckpointManager(tmp_path) as mgr:  # none given: the directory's
        assert mgr.metadata() == {"model": "t5-small", "lr": 1e-3}
    with CheckpointManager(tmp_path, read_only=True, metadata={"x": 1}) as reader:
        assert reader.metadata() == {"model": "t5-small", "lr": 1e-3}


def test_without_a_file(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.metadata() == {}
    assert not (tmp_path / FILE).exists()
    with CheckpointManager(tmp_path, read_only=True, metadata={"x": 1}) as reader:
        assert reader.metadata() == {"x": 1}  # Orbax: a reader uses what it was given
    assert not (tmp_path / FILE).exists()


def test_object_store_and_memory(s3_bucket: str) -> None:
    for url in (f"{s3_bucket}/root-meta", f"memory://root-meta-{os.getpid()}"):
        with CheckpointManager(url, metadata={"a": [1, 2]}) as mgr:
            assert mgr.metadata() == {"a": [1, 2]}
        with CheckpointManager(url, metadata={"a": "changed"}) as mgr:
            assert mgr.metadata() == {"a": [1, 2]}


@pytest.mark.parametrize("bad", [{1: "x"}, {"x": float("nan")}, {"x": object()}, [("a", 1)]])
def test_bad_metadata_is_refused_before_anything_is_written(tmp_path: Path, bad: object) -> None:
    with pytest.raises(TypeError, match=r"metadata= \(the directory's metadata\)"):
        CheckpointManager(tmp_path / "run", metadata=bad)  # type: ignore[arg-type]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "content", [b"not json", b"[1]", b'{"custom_metadata": 3}', b'{"other": {}}']
)
def test_a_damaged_file_names_itself(tmp_path: Path, content: bytes) -> None:
    (tmp_path / FILE).write_bytes(content)
    with CheckpointManager(tmp_path, metadata={"a": 1}) as mgr:
        with pytest.raises(CorruptCheckpointError, match=FILE):
            mgr.metadata()
        mgr.save(1, {"s": [1]})  # saving goes on
    assert (tmp_path / FILE).read_bytes() == content  # never replaced


def test_a_link_is_not_followed_or_replaced(tmp_path: Path) -> None:
    outside = tmp_path / "outside.json"
    outside.write_text('{"custom_metadata": {"secret": 1}}')
    run = tmp_path / "run"
    run.mkdir()
    (run / FILE).symlink_to(outside)
    CheckpointManager(run).close()  # the lock file stays; nothing else may change
    before = dir_state(tmp_path)
    with (
        CheckpointManager(run, metadata={"a": 1}) as mgr,
        pytest.raises(CorruptCheckpointError, match="follows no link"),
    ):
        mgr.metadata()
    assert dir_state(tmp_path) == before
    assert outside.read_text() == '{"custom_metadata": {"secret": 1}}'


def test_is_saving_in_progress(tmp_path: Path, gated_handler: InMemoryHandler, gate: Gate) -> None:
    with CheckpointManager(tmp_path, handlers={"x": gated_handler}) as mgr:
        assert mgr.is_saving_in_progress() is False
        mgr.save(1, {"x": "one"})
        assert gate.entered.wait(30)
        assert mgr.is_saving_in_progress() is True
        gate.release.set()
        mgr.wait_until_finished()
        assert mgr.is_saving_in_progress() is False
    with CheckpointManager(tmp_path, async_save=False, handlers={"x": gated_handler}) as mgr:
        mgr.save(2, {"x": "two"})
        assert mgr.is_saving_in_progress() is False
