"""Incremental saves (``incremental=True``): a file whose content the newest committed step
already has is a hard link to that step's file, and every step stays whole on its own."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.treeutil import assert_tree_equal

from cairn.manager import CheckpointManager, CorruptCheckpointError, KeepLatest

FROZEN = "state/arrays/0/0"  # the frozen leaf's one chunk ("frozen" sorts before "lora")
LORA = "state/arrays/1/0"

# What the zarr layout writes and shares, file by file (tests/handlers/test_packed.py: packs).
pytestmark = pytest.mark.usefixtures("zarr_layout")


def state(step: int) -> dict[str, Any]:
    return {
        "frozen": jnp.arange(1 << 18, dtype=jnp.float32),  # 1 MiB: staged, written O_DIRECT
        "lora": jnp.full(1000, float(step)),
    }


def host(tree: Any) -> Any:
    return jax.tree.map(np.asarray, tree)


def records(root: Path, step: int) -> dict[str, dict[str, Any]]:
    manifest = json.loads((root / f"checkpoint_{step}" / "_CHECKPOINT.json").read_text())
    return {f"{item}/{f['path']}": f for item, e in manifest["items"].items() for f in e["files"]}


def inode(root: Path, step: int, relpath: str) -> int:
    return os.lstat(root / f"checkpoint_{step}" / relpath).st_ino


def test_unchanged_files_are_links_to_the_newest_step(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, incremental=True) as mgr:
        for step in (1, 2, 3):  # 1: views (the pool warms), 2 and 3: staged
            mgr.save(step, {"state": state(step)})
            mgr.wait_until_finished()
        for step in (2, 3):
            got = records(tmp_path, step)
            assert got[FROZEN].get("reused") is True
            assert "reused" not in got[LORA] and got["state/tree.json"].get("reused") is True
            assert inode(tmp_path, step, FROZEN) == inode(tmp_path, 1, FROZEN)
            assert inode(tmp_path, step, LORA) != inode(tmp_path, step - 1, LORA)
            tm = mgr.info(step).telemetry
            assert tm["bytes_written"] < 0.01 * tm["bytes"]
        assert mgr.info(1).telemetry["bytes_written"] == mgr.info(1).telemetry["bytes"]
        assert os.lstat(tmp_path / "checkpoint_3" / FROZEN).st_nlink == 3
        for step in (1, 2, 3):
            assert_tree_equal(host(mgr.restore(step)["state"]), host(state(step)))
        assert all(mgr.verify(step) == [] for step in (1, 2, 3))


def test_off_by_default(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        for step in (1, 2):
            mgr.save(step, {"state": state(step)})
            mgr.wait_until_finished()
        assert inode(tmp_path, 2, FROZEN) != inode(tmp_path, 1, FROZEN)
        assert all("reused" not in r for r in records(tmp_path, 2).values())
        assert mgr.info(2).telemetry["bytes_written"] == mgr.info(2).telemetry["bytes"]


def test_deleting_a_step_never_breaks_the_steps_that_share_its_files(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep=KeepLatest(2), incremental=True) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, {"state": state(step)})
            mgr.wait_until_finished()
        assert mgr.all_steps() == [3, 4]  # retention deleted 1 and 2, whose file 3 and 4 share
        assert records(tmp_path, 4)[FROZEN].get("reused") is True
        assert_tree_equal(host(mgr.restore(3)["state"]), host(state(3)))
        mgr.delete(3)  # by hand too
        assert_tree_equal(host(mgr.restore(4)["state"]), host(state(4)))
        assert mgr.verify(4) == []
    assert os.lstat(tmp_path / "checkpoint_4" / FROZEN).st_nlink == 1


def test_a_damaged_file_of_the_previous_step_is_written_afresh(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with CheckpointManager(tmp_path, incremental=True) as mgr:
        mgr.save(1, {"state": state(1)})
        mgr.wait_until_finished()
        path = tmp_path / "checkpoint_1" / FROZEN
        data = bytearray(path.read_bytes())
        data[100] ^= 0xFF  # same size, other content: the manifest's hash no longer holds
        with open(path, "r+b") as f:
            f.write(data)
        with caplog.at_level(logging.WARNING, logger="cairn"):
            mgr.save(2, {"state": state(2)})
            mgr.wait_until_finished()
        assert "does not hold what its manifest records" in caplog.text
        assert "reused" not in records(tmp_path, 2)[FROZEN]
        assert inode(tmp_path, 2, FROZEN) != inode(tmp_path, 1, FROZEN)
        assert_tree_equal(host(mgr.restore(2)["state"]), host(state(2)))
        with pytest.raises(CorruptCheckpointError, match=r"step 1"):
            mgr.restore(1)


def test_a_file_of_the_previous_step_swapped_for_a_link_is_not_linked(tmp_path: Path) -> None:
    outside = tmp_path / "outside.bin"
    root = tmp_path / "run"
    with CheckpointManager(root, incremental=True) as mgr:
        mgr.save(1, {"state": state(1)})
        mgr.wait_until_finished()
        path = root / "checkpoint_1" / FROZEN
        outside.write_bytes(path.read_bytes())  # the same bytes: only the link is wrong
        path.unlink()
        path.symlink_to(outside)
        mgr.save(2, {"state": state(2)})
        mgr.wait_until_finished()
        made = os.lstat(root / "checkpoint_2" / FROZEN)
        assert made.st_nlink == 1 and made.st_ino != os.lstat(outside).st_ino
        assert os.lstat(outside).st_nlink == 1
        assert "reused" not in records(root, 2)[FROZEN]
        assert_tree_equal(host(mgr.restore(2)["state"]), host(state(2)))


def test_a_new_process_reads_a_file_once_before_linking_it(tmp_path: Path) -> None:
    """Files this process did not write are hashed before their first link (then known)."""
    from cairn.handlers._files import disk  # where LocalDestination links known files

    with CheckpointManager(tmp_path, incremental=True) as mgr:
        mgr.save(1, {"state": state(1)})
        mgr.wait_until_finished()
    disk._KNOWN.clear()  # as after a restart
    reads = []
    real = disk._hash_fd

    def counting(fd: int, hashes: Any = None) -> str:
        reads.append(fd)
        return real(fd, hashes)

    disk._hash_fd = counting  # type: ignore[assignment]
    try:
        with CheckpointManager(tmp_path, incremental=True) as mgr:
            for step in (2, 3):
                mgr.save(step, {"state": state(step)})
                mgr.wait_until_finished()
    finally:
        disk._hash_fd = real  # type: ignore[assignment]
    first = len(reads)
    assert first >= 1  # step 2 read step 1's frozen chunk (and the small files it shares)
    assert inode(tmp_path, 3, FROZEN) == inode(tmp_path, 1, FROZEN)
    assert len(reads) == first  # step 3 knew them all: nothing read again
    with pytest.raises(TypeError, match="incremental"):
        CheckpointManager(tmp_path / "x", incremental="yes")  # type: ignore[arg-type]
    assert not (tmp_path / "x").exists()


def test_numpy_state_and_save_dtype(tmp_path: Path) -> None:
    from cairn.handlers import TrainStateHandler

    tree = {"w": np.linspace(0, 1, 1 << 18, dtype=np.float32), "b": np.ones(4, np.float32)}
    handler = TrainStateHandler(save_dtype=jnp.bfloat16, layout="zarr")
    with CheckpointManager(tmp_path, incremental=True, handlers={"state": handler}) as mgr:
        mgr.save(1, {"state": tree})
        mgr.save(2, {"state": {**tree, "b": tree["b"] * 2}})
        mgr.wait_until_finished()
        w, b = "state/arrays/0/0", "state/arrays/1/0"  # the leaves in the dict's order
        assert inode(tmp_path, 2, w) == inode(tmp_path, 1, w)
        assert inode(tmp_path, 2, b) != inode(tmp_path, 1, b)
        got = mgr.restore(2)["state"]
        np.testing.assert_array_equal(got["w"], tree["w"].astype(jnp.bfloat16).astype(np.float32))


def test_an_unchanged_jax_array_is_neither_copied_nor_hashed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same jax.Array object (immutable) as in the previous save: its chunk files are linked
    from the records of that save, without copying or hashing its bytes."""
    import crc32c

    hashed: list[int] = []
    real = crc32c.crc32c

    def counting(data: Any, value: int = 0) -> int:
        hashed.append(memoryview(data).nbytes)
        return real(data, value)

    frozen = jnp.arange(1 << 18, dtype=jnp.float32)
    with CheckpointManager(tmp_path, incremental=True) as mgr:
        for step in (1, 2, 3):
            if step == 3:
                monkeypatch.setattr(crc32c, "crc32c", counting)
            mgr.save(step, {"state": {"frozen": frozen, "lora": jnp.full(1000, float(step))}})
            mgr.wait_until_finished()
        assert 0 < sum(hashed) < 10_000  # the lora chunk and the manifest, not the 1 MiB leaf
        assert inode(tmp_path, 3, FROZEN) == inode(tmp_path, 1, FROZEN)
        assert records(tmp_path, 3)[FROZEN]["reused"] is True
        got = host(mgr.restore(3)["state"])
        np.testing.assert_array_equal(got["frozen"], np.asarray(frozen))
        assert mgr.verify(3) == []


def test_an_unchanged_array_whose_old_file_is_damaged_is_written_from_memory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    frozen = jnp.arange(1 << 18, dtype=jnp.float32)
    with CheckpointManager(tmp_path, incremental=True) as mgr:
        for step in (1, 2):
            mgr.save(step, {"state": {"frozen": frozen, "lora": jnp.full(1000, float(step))}})
            mgr.wait_until_finished()
        path = tmp_path / "checkpoint_2" / FROZEN  # also step 1's: the same inode
        data = bytearray(path.read_bytes())
        data[5] ^= 0x40
        with open(path, "r+b") as f:
            f.write(data)
        with caplog.at_level(logging.WARNING, logger="cairn"):
            mgr.save(3, {"state": {"frozen": frozen, "lora": jnp.full(1000, 3.0)}})
            mgr.wait_until_finished()
        assert "does not hold what its manifest records" in caplog.text
        assert "reused" not in records(tmp_path, 3)[FROZEN]
        assert inode(tmp_path, 3, FROZEN) != inode(tmp_path, 2, FROZEN)
        np.testing.assert_array_equal(
            np.asarray(mgr.restore(3)["state"]["frozen"]), np.asarray(frozen)
        )
        assert mgr.verify(3) == [] and mgr.verify(2) != []


def test_a_file_swapped_between_its_check_and_its_link_is_not_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The previous step's chunk is replaced (same size, other bytes, another inode) after it
    was checked and just before the link is made: the link names the new inode, so it is
    undone and the chunk is written from memory."""
    with CheckpointManager(tmp_path, incremental=True) as mgr:
        mgr.save(1, {"state": state(1)})
        mgr.wait_until_finished()
        real_link = os.link
        swapped = []

        def swap_then_link(src: Any, dst: Any, **kwargs: Any) -> None:
            if str(src).endswith(FROZEN) and not swapped:
                data = bytearray(Path(src).read_bytes())
                data[0] ^= 1
                Path(src).unlink()
                Path(src).write_bytes(data)
                swapped.append(src)
            real_link(src, dst, **kwargs)

        monkeypatch.setattr(os, "link", swap_then_link)
        mgr.save(2, {"state": state(2)})
        mgr.wait_until_finished()
        monkeypatch.undo()
        assert swapped
        assert "reused" not in records(tmp_path, 2)[FROZEN]
        assert os.lstat(tmp_path / "checkpoint_2" / FROZEN).st_nlink == 1
        assert_tree_equal(host(mgr.restore(2)["state"]), host(state(2)))
        assert mgr.verify(2) == []


def test_linked_files_are_not_fsynced_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A link's content is durable since the step it comes from was committed: the commit
    fsyncs the files it wrote and every directory, not the linked files."""
    from cairn.manager._storage import posix as _posix

    synced: list[str] = []
    real = _posix.fsync_path

    def counting(path: str, *, directory: bool = False) -> None:
        synced.append(os.fspath(path))
        real(path, directory=directory)

    monkeypatch.setattr(_posix, "fsync_path", counting)
    with CheckpointManager(tmp_path, incremental=True) as mgr:
        for step in (1, 2):
            synced.clear()
            mgr.save(step, {"state": state(step)})
            mgr.wait_until_finished()
            names = {p.split(".tmp-")[-1].partition("/")[2] for p in synced if ".tmp-" in p}
            assert (FROZEN in names) == (step == 1), (step, sorted(names))
            assert LORA in names and "state/arrays/0" in names  # written; a directory
        assert_tree_equal(host(mgr.restore(2)["state"]), host(state(2)))


def test_known_files_keep_the_newest() -> None:
    """The bounded registry drops its oldest entries first; one put again counts as new."""
    from cairn.handlers.io import KnownFiles

    known = KnownFiles(capacity=3)
    for key in "abc":
        known.put(key, key.upper())
    known.put("a", "A2")  # a is the newest now
    known.put("d", "D")  # b, the oldest, goes
    assert [known.get(k) for k in "abcd"] == ["A2", None, "C", "D"] and len(known) == 3
