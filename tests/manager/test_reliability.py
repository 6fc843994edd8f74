"""Reliability: damage, links, readers beside a writer, a second writer, a full disk.

Nothing committed may be lost or shown partial: damage is reported naming step and file, restore
falls back past it, links never lead a reader out of the checkpoint, a reader beside a writer
never sees half a step, and a full disk fails the save cleanly and loses nothing.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.iterutil import Shuffled, advanced, take
from support.treeutil import assert_tree_equal

from cairn.manager import (
    CheckpointManager,
    CommitError,
    CorruptCheckpointError,
    ReadOnlyError,
    StepNotFoundError,
)

TESTS = Path(__file__).parents[1]


def state(step: int) -> dict[str, Any]:
    return {"w": np.arange(1000.0).reshape(10, 100) * step, "b": np.full(3, step)}


def save_two(root: Path) -> None:
    with CheckpointManager(root) as mgr:
        for step in (1, 2):
            mgr.save(step, {"state": state(step), "data": advanced(Shuffled(), step)})


def tree_digest(root: Path) -> dict[str, str]:
    """Every entry under root (links included, not followed) with its content's digest."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = f"link:{os.readlink(path)}"
        elif path.is_file():
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            out[rel] = "dir"
    return out


# ---------------------------------------------------------------------------- damage


DAMAGED_FILES = {  # glob patterns: a pack's name is random per save
    "array data": "state/packs/0.*.0",
    "array index": "state/packs/index.0.json",
    "tree structure": "state/tree.json",
    "iterator state": "data/process_0-of-1.json",
    "manifest": "_CHECKPOINT.json",
}


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
@pytest.mark.parametrize("kind", sorted(DAMAGED_FILES))
def test_damage_names_step_and_file_and_restore_falls_back(
    tmp_path: Path, kind: str, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    save_two(tmp_path)
    (victim,) = (tmp_path / "checkpoint_2").glob(DAMAGED_FILES[kind])
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x20
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(bytes(data[: len(data) // 2]))
    else:
        victim.unlink()
    name = victim.name.replace(".", r"\.")
    with CheckpointManager(tmp_path, read_only=True) as mgr:
        with pytest.raises(CorruptCheckpointError, match=rf"step 2\b.*{name}|{name}.*step 2\b"):
            mgr.restore(2)
        with pytest.raises(CorruptCheckpointError):
            mgr.restore(fallback=False)
        with caplog.at_level(logging.WARNING, logger="cairn"):
            got = mgr.restore(items={"state": None, "data": Shuffled()})
        assert "step 2 is damaged, falling back" in caplog.text
        assert_tree_equal(got["state"], state(1))
        assert take(got["data"]) == take(advanced(Shuffled(), 1))


# ---------------------------------------------------------------------------- links


def test_symlinked_step_directory_is_never_followed(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    save_two(root)
    shutil.copytree(root / "checkpoint_2", elsewhere)
    (root / "checkpoint_3").symlink_to(elsewhere, target_is_directory=True)
    with CheckpointManager(root) as mgr:
        assert mgr.all_steps() == [1, 2, 3]  # listed, as a damaged step
        with pytest.raises(CorruptCheckpointError, match=r"step 3 .* is a symbolic link"):
            mgr.restore(3)
        assert_tree_equal(mgr.restore()["state"], state(2))  # falls back past it
        mgr.delete(3)
    assert not (root / "checkpoint_3").exists() and (elsewhere / "_CHECKPOINT.json").is_file()


@pytest.mark.parametrize("what", ["file", "item directory"])
def test_links_inside_a_step_are_refused(tmp_path: Path, what: str) -> None:
    save_two(tmp_path)
    secret = tmp_path / "secret.bin"
    step = tmp_path / "checkpoint_2"
    if what == "file":
        (target,) = (step / "state" / "packs").glob("0.*.0")
        secret.write_bytes(target.read_bytes())  # same size and content: only the link is wrong
        target.unlink()
        target.symlink_to(secret)
    else:
        shutil.move(step / "data", tmp_path / "data-elsewhere")
        (step / "data").symlink_to(tmp_path / "data-elsewhere", target_is_directory=True)
    with (
        CheckpointManager(tmp_path, read_only=True) as mgr,
        pytest.raises(CorruptCheckpointError, match="symbolic link"),
    ):
        mgr.restore(2, {"state": None, "data": Shuffled()})


# ---------------------------------------------------------------------------- readers and writers


def test_read_only_manager_never_changes_the_directory(tmp_path: Path) -> None:
    save_two(tmp_path)
    (tmp_path / "checkpoint_9.tmp-0123456789abcdef0123456789abcdef").mkdir()  # a crash leftover
    (tmp_path / ".trash-checkpoint_0-aa").mkdir()
    before = tree_digest(tmp_path)
    with CheckpointManager(tmp_path, read_only=True) as mgr:
        for call in (
            lambda: mgr.save(3, {"state": state(3)}),
            lambda: mgr.delete(1),
            lambda: mgr.record_metrics(1, {"x": 1.0}),
        ):
            with pytest.raises(ReadOnlyError, match="read_only=True"):
                call()
        assert_tree_equal(mgr.restore()["state"], state(2))
        mgr.reload()
    assert tree_digest(tmp_path) == before  # leftovers too: cleaning up is the writer's job


def test_reader_beside_a_saving_and_deleting_writer_never_sees_a_partial_step(
    tmp_path: Path,
) -> None:
    """A real writer process (async saves, KeepLatest(2)) and this process polling and restoring:
    every restore is complete and correct, or the step is gone (StepNotFoundError)."""
    from crash_writer import expected_state

    writer = subprocess.Popen(
        [sys.executable, str(TESTS / "crash_writer.py"), str(tmp_path), "--keep-latest", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout is not None
    restored, gone = 0, 0
    try:
        assert writer.stdout.readline().startswith("saved")
        with CheckpointManager(tmp_path, read_only=True) as reader:
            while restored < 60:
                reader.reload()
                for step in reader.all_steps():
                    try:
                        got = reader.restore(step, fallback=False)
                    except StepNotFoundError:
                        gone += 1
                        continue
                    assert_tree_equal(got["state"], expected_state(step))
                    restored += 1
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.communicate()
    assert restored >= 60
    print(f"{restored} restores beside the writer, {gone} steps deleted while being read")


# ---------------------------------------------------------------------------- a full disk


@contextlib.contextmanager
def small_filesystem(path: Path, size: str = "3m") -> Iterator[str]:
    """A real tmpfs of `size` at `path` when the machine lets us mount one (root, CAP_SYS_ADMIN);
    else a write layer that fails with ENOSPC past that many bytes. Yields which one."""
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode == 0:
        try:
            yield "tmpfs"
        finally:
            subprocess.run(["umount", "-l", str(path)], check=True)
        return
    yield "layer"  # the test installs `enospc_layer` itself in this case


def enospc_layer(monkeypatch: pytest.MonkeyPatch, budget: list[int]) -> None:
    """Make cairn's file writes fail with ENOSPC once `budget[0]` bytes are used up."""
    from cairn.handlers import _files

    def spend(n: int) -> None:
        if n > budget[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        budget[0] -= n

    real_write = _files.ChecksummedFile.write
    real_writev = os.writev

    def write(self: Any, data: Any) -> int:
        spend(memoryview(data).nbytes)
        return real_write(self, data)

    def writev(fd: int, buffers: Any) -> int:
        spend(sum(memoryview(b).nbytes for b in buffers))
        return real_writev(fd, buffers)

    monkeypatch.setattr(_files.ChecksummedFile, "write", write)
    monkeypatch.setattr(os, "writev", writev)


def test_a_full_disk_fails_the_save_and_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "fs"
    with small_filesystem(root) as kind:
        budget = [1_500_000]
        if kind == "layer":
            enospc_layer(monkeypatch, budget)
        small = {"w": np.ones(1000)}  # 8 KB
        big = {"w": np.ones(500_000)}  # 4 MB: more than the filesystem holds
        with CheckpointManager(root / "ck") as mgr:
            mgr.save(1, {"state": small})
            mgr.save(2, {"state": big})
            with pytest.raises(CommitError) as info:
                mgr.wait_until_finished()
            assert isinstance(info.value.__cause__, OSError)
            assert info.value.__cause__.errno == errno.ENOSPC
            assert mgr.all_steps() == [1]
            assert sorted(p.name for p in (root / "ck").iterdir()) == [
                ".cairn.lock",
                "checkpoint_1",
            ]
            assert_tree_equal(mgr.restore()["state"], small)
            mgr.save(3, {"state": {"w": np.full(1000, 3.0)}})  # there is room for this one
            mgr.wait_until_finished()
            assert mgr.all_steps() == [1, 3]
        print(f"disk full via {kind}")
