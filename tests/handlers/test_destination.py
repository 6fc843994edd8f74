"""Destination and Source: what a write phase may return, and what a read may trust."""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from cairn.handlers import ChecksummedFile, FileRecord, LocalDestination, LocalSource, StoredItem
from cairn.handlers._files import content_hash
from cairn.handlers.errors import CorruptCheckpointError


def test_records_must_be_what_was_written(tmp_path: Path) -> None:
    dest = LocalDestination(tmp_path / "item")
    good = dest.write_file("a", [b"ab", memoryview(b"cd")])
    assert good == FileRecord("a", 4, xxh3_128=content_hash(b"abcd"))
    assert (tmp_path / "item" / "a").read_bytes() == b"abcd"
    assert dest.finish("h", [good]) == (good,)
    assert dest.finish("h", [FileRecord("a", 4)]) == (good,)  # the hash is filled in
    with pytest.raises(ValueError, match="it wrote 4"):
        dest.finish("h", [FileRecord("a", 5, xxh3_128=good.xxh3_128)])
    with pytest.raises(ValueError, match="not the one of the bytes it wrote"):
        dest.finish("h", [FileRecord("a", 4, xxh3_128=content_hash(b"abce"))])
    with pytest.raises(ValueError, match="did not write"):
        dest.finish("h", [FileRecord("b", 1, xxh3_128=content_hash(b"b"))])
    with pytest.raises(ValueError, match="twice"):
        dest.finish("h", [good, good])
    with pytest.raises(TypeError, match="not a FileRecord"):
        dest.finish("h", ["a"])  # type: ignore[list-item]


def test_the_hash_follows_the_write_unless_a_reuse_needs_it(tmp_path: Path) -> None:
    """A commit hashes each file once it is stored (its writes start at once, the hashing
    comes later, off the train step right after save()); an incremental save hashes first,
    to link a previous file of the same content instead of writing it."""
    events: list[str] = []

    class Recording(LocalDestination):
        def _put(self, relpath: str, pieces: list[memoryview]) -> None:
            events.append(f"put {relpath}")
            super()._put(relpath, pieces)

    def hashed(data: bytes, name: str) -> Callable[[], str]:
        def digest() -> str:
            events.append(f"hash {name}")
            return content_hash(data)

        return digest

    first = Recording(tmp_path / "1")
    record = first.write_file("a", b"abcd", xxh3_128=hashed(b"abcd", "a"))
    assert record == FileRecord("a", 4, xxh3_128=content_hash(b"abcd"))
    first.write_file("b", b"efgh")  # hashed by the destination, also after the write
    assert first.finish("h", [record]) == (record,)
    assert events == ["put a", "hash a", "put b"]
    assert first.finish("h", [FileRecord("b", 4)])[0].xxh3_128 == content_hash(b"efgh")

    events.clear()
    second = Recording(tmp_path / "2")
    second.reuse(LocalSource(tmp_path / "1"), [record])
    again = second.write_file("a", b"abcd", xxh3_128=hashed(b"abcd", "a"))
    changed = second.write_file("c", b"wxyz", xxh3_128=hashed(b"wxyz", "c"))
    assert again.reused and not changed.reused
    assert events == ["hash a", "hash c", "put c"]  # "a" linked, never written


def test_paths_are_written_once_and_inside(tmp_path: Path) -> None:
    dest = LocalDestination(tmp_path / "item")
    dest.write_file("x/y", b"1")
    with pytest.raises(ValueError, match="written twice"):
        dest.write_file("x/y", b"2")
    for bad in ("../z", "/abs", "a//b", "a/./b", ""):
        with pytest.raises(ValueError, match="relative"):
            dest.write_file(bad, b"")
    assert not (tmp_path / "z").exists()


def test_a_file_never_closed_is_refused(tmp_path: Path) -> None:
    dest = LocalDestination(tmp_path / "item")
    f = dest.create("open")
    f.write(b"half")
    with pytest.raises(ValueError, match="never closed"):
        dest.finish("h", [FileRecord("open", 4, xxh3_128=content_hash(b"half"))])
    f.close()
    assert dest.finish("h", [f.record]) == (f.record,)


def test_a_file_written_through_the_path_is_adopted(tmp_path: Path) -> None:
    """Code that treats the destination as a directory (older handlers) still works."""
    dest = LocalDestination(tmp_path / "item")
    with ChecksummedFile(dest, "legacy") as f:
        f.write(b"old style")
    (dest / "plain").write_bytes(b"no record")
    records = dest.finish("h", [f.record, FileRecord("plain", 9)])
    assert records[1].xxh3_128 == content_hash(b"no record")
    assert os.fspath(dest) == str(tmp_path / "item")


def test_many_threads_write_through_one_destination(tmp_path: Path) -> None:
    dest = LocalDestination(tmp_path / "item")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        records = list(pool.map(lambda i: dest.write_file(f"d{i % 7}/{i}", bytes([i])), range(200)))
    assert dest.finish("h", records) == tuple(records)
    assert sorted(p.name for p in (tmp_path / "item").rglob("*") if p.is_file()) == sorted(
        str(i) for i in range(200)
    )


def test_reads_never_take_more_than_the_manifest_says(tmp_path: Path) -> None:
    dest = LocalDestination(tmp_path / "item")
    record = dest.write_file("f", b"0123456789")
    stored = StoredItem(LocalSource(tmp_path / "item"), {"f": record}, 3, "x")
    assert stored.read_bytes("f") == b"0123456789"
    buffers = [memoryview(bytearray(4)), memoryview(bytearray(6))]
    stored.read_into("f", buffers)
    assert bytes(buffers[0]) + bytes(buffers[1]) == b"0123456789"
    (tmp_path / "item" / "f").write_bytes(b"0123456789" + b"x" * (1 << 20))  # it grew
    for read in (lambda: stored.read_bytes("f"), lambda: stored.read_into("f", buffers)):
        with pytest.raises(CorruptCheckpointError, match=r"step 3, item 'x'.*bytes"):
            read()
    (tmp_path / "item" / "f").unlink()
    with pytest.raises(CorruptCheckpointError, match="is missing"):
        stored.read_bytes("f")
    with pytest.raises(CorruptCheckpointError, match="not in the manifest"):
        stored.read_bytes("g")


def test_what_is_read_is_checked_on_its_descriptor(tmp_path: Path) -> None:
    """`check_files` of the whole item is done once (a leaf's check of its part is then not
    repeated), but every read checks the file it opened: swapped after the check for a link, a
    FIFO, a longer file, or a directory made a file, it fails naming the file and reads nothing."""
    item = tmp_path / "item"
    dest = LocalDestination(item)
    records = {p: dest.write_file(p, b"0123456789") for p in ("a/f", "a/g", "b/h")}
    stored = StoredItem(LocalSource(item), records, 3, "x")
    stored.check_files()
    (item / "a" / "g").unlink()
    stored.check_files("a/")  # done already, for the whole item
    assert stored.read_bytes("a/f") == b"0123456789"
    outside = tmp_path / "outside"
    outside.write_bytes(b"9876543210")
    buffers = [memoryview(bytearray(10))]
    for swap, message in (
        (lambda p: p.symlink_to(outside), "a/f is a symbolic link"),
        (lambda p: os.mkfifo(p), "a/f is not a regular file"),
        (lambda p: p.write_bytes(b"0123456789!"), "a/f has 11 bytes, the manifest says 10"),
    ):
        (item / "a" / "f").unlink()
        swap(item / "a" / "f")
        for read in (lambda: stored.read_bytes("a/f"), lambda: stored.read_into("a/f", buffers)):
            with pytest.raises(CorruptCheckpointError, match=rf"step 3, item 'x'.*{message}"):
                read()
        assert bytes(buffers[0]) == bytes(10)
    for p in (item / "b" / "h", item / "b"):
        (p.unlink if p.is_file() else p.rmdir)()
    (item / "b").write_bytes(b"")
    with pytest.raises(CorruptCheckpointError, match=r"b/h: a directory on its way is not a"):
        stored.read_bytes("b/h")
    (item / "a" / "f").unlink()
    (item / "a" / "f").write_bytes(b"0123456789")
    fresh = StoredItem(LocalSource(item), records, 3, "x")
    with pytest.raises(CorruptCheckpointError, match=r"a/g is missing"):
        fresh.check_files("a/")  # a new item's leaf check does check
