"""A local tier's part sent back for a restore, read from memory: the part as `post.Post`
sends it (`Local._payload`: the manifest, then each file opened on the disk), received as its
pieces, checked against its manifest and restored by the manager's handlers from memory
(`Reader.restore_part`, `MemorySource`), bit-exact; a damaged, short, missing or extra file is
refused (as from a directory), and again by the part's commit; a handler that reads through a path gets a private directory,
removed after its restore."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
import xxhash
from support.iterutil import Shuffled
from test_local_tier import check, items, manager, run, state

from cairn.handlers import LocalDestination, StoredItem, write_file
from cairn.handlers._train_state import read
from cairn.handlers.io import MemorySource, aligned_empty
from cairn.manager import CorruptCheckpointError
from cairn.manager._core import replicas
from cairn.manager._core.post import FilePiece, Received, _layout
from cairn.manager._format import PART, Manifest


def received(mgr: Any, step: int) -> tuple[Manifest, replicas.Files]:
    """This process's own part of `step` as its holder would send it, and as it arrives."""
    local = mgr._local
    pieces = []
    for piece in local._payload(local.inner, step):
        if isinstance(piece, FilePiece):  # as the receiver gets it: the file's bytes
            pieces.append(memoryview(os.pread(piece.fd, piece.size + 1, 0)))
            os.close(piece.fd)
        else:
            pieces.append(memoryview(piece))
    return local._received(0, step, pieces)


def test_a_part_sent_back_restores_from_memory_bit_exact(tmp_path: Path) -> None:
    with manager(tmp_path) as mgr:
        run(mgr, range(1, 7))
        manifest, files = received(mgr, 6)
        replicas.check_files(files, manifest, content=True)
        wanted = {"state": None, "data": Shuffled(seed=3)}
        restored = mgr._local.inner._reader.restore_part(manifest, files, wanted)
        check(restored, 6)
        # a received part commits as its owner committed it, but for the holder in its record
        job = replicas.received_job(manifest, files, holder=3)
        assert sorted(job.snapshots) == sorted(items(6)) and job.step == 6
        assert manifest.metadata[PART]["holder"] == 0
        assert job.metadata[PART] == {**manifest.metadata[PART], "holder": 3}
        bare = dataclasses.replace(manifest, metadata={})
        with pytest.raises(CorruptCheckpointError, match="step 6 has no part record"):
            replicas.received_job(bare, files, holder=3)


@pytest.mark.parametrize("damage", ["flip", "short", "missing", "extra"])
def test_a_damaged_part_is_refused_by_its_restore_and_its_commit(
    tmp_path: Path, damage: str
) -> None:
    """A part's files are checked as a directory's are: a missing or extra file before
    anything is read (`check_files`), a short one before its item is parsed, a flipped byte
    as it is read; and the commit of the part into its owner's directory checks every file's
    content again as it writes it."""
    with manager(tmp_path) as mgr:
        run(mgr, range(1, 4))
        manifest, files = received(mgr, 3)
        item, paths = next((i, p) for i, p in files.items() if p)
        path = max(paths, key=lambda p: paths[p].nbytes)
        data = bytearray(paths[path])
        if damage == "flip":
            data[len(data) // 2] ^= 1
            paths[path] = memoryview(data)
        elif damage == "short":
            paths[path] = memoryview(data[:-1])
        elif damage == "missing":
            del paths[path]
        else:
            paths["stray.bin"] = memoryview(b"x")
        wanted = {"state": None, "data": Shuffled(seed=3)}
        with pytest.raises(
            CorruptCheckpointError, match=re.escape(path) if damage != "extra" else "stray.bin"
        ):
            replicas.check_files(files, manifest, content=False)
            mgr._local.inner._reader.restore_part(manifest, files, wanted)
        if damage in ("flip", "short"):
            job = replicas.received_job(manifest, files, holder=3)
            with pytest.raises(CorruptCheckpointError, match=f"file {path} of a received part"):
                job.snapshots[item][1].write(LocalDestination(tmp_path / "held"))


def in_pages(files: replicas.Files) -> tuple[np.ndarray, replicas.Files]:
    """The files of a part copied into one buffer, each on a page, as `post.Post` receives
    them: the buffer, and the files as views of it."""
    at, total = _layout([v.nbytes for paths in files.values() for v in paths.values()])
    buffer = aligned_empty((total,), np.dtype(np.uint8))
    held: replicas.Files = {}
    for (item, path, view), a in zip(
        [(i, p, v) for i, paths in files.items() for p, v in paths.items()], at, strict=True
    ):
        buffer[a : a + view.nbytes] = np.frombuffer(view, np.uint8)
        held.setdefault(item, {})[path] = buffer[a : a + view.nbytes].data
    return buffer, held


@pytest.mark.parametrize("hashed", [False, True])
@pytest.mark.parametrize("damage", [False, True])
def test_a_part_in_memory_becomes_the_restored_jax_arrays_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: bool, hashed: bool
) -> None:
    """A JAX leaf whose chunk a part held in memory (as received, on a page) is restored as
    that memory, not a copy of it (JAX adopts it on CPU), after its hash is checked: a flipped
    byte there is refused, naming the chunk and its pack. A NumPy leaf is copied out. With
    `hashed`, each file's digest as it arrived (`post.Received`): a file whose digest is its
    record's is not hashed again, and one whose is not (the flipped byte came so) is checked
    chunk by chunk, as without."""
    with manager(tmp_path) as mgr:
        run(mgr, range(1, 7))
        manifest, files = received(mgr, 6)
        buffer, held = in_pages(files)
        low, high = buffer.ctypes.data, buffer.ctypes.data + buffer.nbytes
        w = np.asarray(state(6)["w"]).tobytes()
        if damage:
            at = buffer.tobytes().index(w) + len(w) // 2
            buffer[at] ^= 1
        views = [v for paths in held.values() for v in paths.values()]
        part = Received(views, [xxhash.xxh3_128_hexdigest(v) for v in views])
        whole = replicas.hashed_whole(held, manifest, part) if hashed else None
        checks: list[Any] = []
        if not damage:  # count the chunk checks (a damaged chunk's runs for real)
            monkeypatch.setattr(read, "check_packed_chunks", checks.append)
        wanted = {"state": None, "data": Shuffled(seed=3)}
        reader = mgr._local.inner._reader
        if damage:
            if whole is not None:  # every file but the damaged one
                assert len(whole["state"]) == len(held["state"]) - 1
            with pytest.raises(
                CorruptCheckpointError,
                match=r"packs/.*chunk arrays/\d+/0\.0 \(leaf \['w'\]\) is not the chunk",
            ):
                reader.restore_part(manifest, held, wanted, whole)
            return
        restored = reader.restore_part(manifest, held, wanted, whole)
        check(restored, 6)
        assert low <= restored["state"]["w"].unsafe_buffer_pointer() < high
        b = restored["state"]["b"]
        assert b.flags.writeable and not low <= b.ctypes.data < high
        assert len(checks) == (0 if hashed else 1)  # w's chunk: hashed as it came, or now
        # training donates the restored arrays: JAX writes its outputs elsewhere, and the part,
        # committed afterwards from the same memory, still hashes as its manifest says
        step = jax.jit(lambda x: x * 2 + 1, donate_argnums=0)
        w = restored["state"]["w"]
        for _ in range(3):
            w = step(w)
        np.testing.assert_array_equal(np.asarray(w), np.asarray(state(6)["w"]) * 8 + 7)
        job = replicas.received_job(manifest, held, holder=0)
        for item, (_, part_files) in job.snapshots.items():
            part_files.write(LocalDestination(tmp_path / "committed" / item))


def test_a_part_that_does_not_hold_together_is_refused() -> None:
    header = b'{"manifest": "{}", "files": [["state", "a"], ["state", "a"]]}'
    for pieces, match in (
        ([], "no header"),
        ([memoryview(b"[1]")], "header"),
        ([memoryview(header), memoryview(b"1")], "1 files, the header lists"),
        ([memoryview(header), memoryview(b"1"), memoryview(b"2")], "comes twice"),
    ):
        with pytest.raises(CorruptCheckpointError, match=match):
            replicas.unpack_part(pieces)


def test_a_memory_source_reads_as_a_directory_does(tmp_path: Path) -> None:
    """Reads are checked against the records as from a directory; `directory` writes the files
    into a private directory that the release removes."""
    content = np.arange(1000, dtype=np.uint8).tobytes()
    record = write_file(tmp_path, "sub/data.bin", content)  # its size and content hash
    source = MemorySource({"sub/data.bin": memoryview(content)}, "a received part")
    stored = StoredItem(source, {"sub/data.bin": record}, 3, "state")
    stored.check_files()
    assert stored.read_bytes("sub/data.bin") == content
    buffer = bytearray(10)
    stored.read_range("sub/data.bin", 990, memoryview(buffer))
    assert bytes(buffer) == content[990:]
    whole = [bytearray(600), bytearray(400)]
    stored.read_into("sub/data.bin", [memoryview(b) for b in whole])
    assert b"".join(whole) == content
    directory = stored.directory
    assert (directory / "sub" / "data.bin").read_bytes() == content
    source.release()
    assert not directory.exists()
    wrong = StoredItem(source, {"other.bin": record}, 3, "state")
    with pytest.raises(CorruptCheckpointError, match=r"other\.bin is missing"):
        wrong.read_bytes("other.bin")
