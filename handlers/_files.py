"""Files with checksums computed while writing, verified reads, and fsync helpers.

A handler's write phase returns one `FileRecord` per file it wrote; the manager puts them in the
manifest, and `StoredItem.read_bytes` checks size and crc32c on the way back in. The checksum is
always computed from the bytes as they are written, never by reading the file again.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import dataclasses
import functools
import os
import stat
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import crc32c

from cairn.handlers.errors import CorruptCheckpointError

__all__ = [
    "ChecksummedFile",
    "FileRecord",
    "StoredItem",
    "check_relative",
    "fsync_dir",
    "lower_thread_priority",
    "read_no_follow",
    "write_file",
    "writing_as",
    "writing_process",
]


@dataclasses.dataclass(frozen=True)
class FileRecord:
    """One file a handler wrote: its path relative to the item's directory, size and crc32c."""

    path: str
    size: int
    crc32c: int

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "crc32c": self.crc32c}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> FileRecord:
        path, size, crc = obj["path"], obj["size"], obj["crc32c"]
        if not isinstance(path, str) or not isinstance(size, int) or not isinstance(crc, int):
            raise TypeError(f"malformed file record {dict(obj)!r}")
        check_relative(path)  # a crafted manifest must not make restore read outside the step
        return cls(path, size, crc)


def check_relative(relpath: str) -> None:
    parts = relpath.split("/")
    if not relpath or relpath.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(
            f"file path {relpath!r} must be relative, without '.', '..' or empty parts"
        )


class ChecksummedFile:
    """A binary file opened for writing that tracks its size and crc32c as bytes go through.

    Use as a context manager; `record` is valid after it closes. It does not fsync: the manager
    fsyncs the whole temporary tree once, after every item is written.
    """

    def __init__(self, root: Path, relpath: str) -> None:
        check_relative(relpath)
        self._relpath = relpath
        path = root / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "xb")  # noqa: SIM115 - closed by close()/__exit__
        self._crc = 0
        self._size = 0
        self._record: FileRecord | None = None

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        self._crc = crc32c.crc32c(view, self._crc)
        self._size += view.nbytes
        return self._file.write(view)

    def close(self) -> None:
        if self._record is None:
            self._file.close()
            self._record = FileRecord(self._relpath, self._size, self._crc)

    @property
    def record(self) -> FileRecord:
        if self._record is None:
            raise RuntimeError(f"{self._relpath}: record asked before the file was closed")
        return self._record

    def __enter__(self) -> ChecksummedFile:
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def write_file(root: Path, relpath: str, data: bytes) -> FileRecord:
    """Write `data` to `root/relpath` (which must not exist) and return its record."""
    with ChecksummedFile(root, relpath) as f:
        f.write(data)
    return f.record


BACKGROUND_NICE = 10

_WRITING_PROCESS: contextvars.ContextVar[tuple[int, int]] = contextvars.ContextVar(
    "cairn_writing_process", default=(0, 1)
)


def writing_process() -> tuple[int, int]:
    """(index, count) of the process whose write phase is running; (0, 1) outside multi-process.

    In a multi-process save every process runs each item's write phase into the same directory.
    A handler writes its per-process files (its shards) everywhere, and files that every process
    would write alike (structure, metadata) only where the index is 0, the primary.
    """
    return _WRITING_PROCESS.get()


@contextlib.contextmanager
def writing_as(index: int, count: int) -> Iterator[None]:
    """Run write phases as process `index` of `count` (set by the manager)."""
    token = _WRITING_PROCESS.set((index, count))
    try:
        yield
    finally:
        _WRITING_PROCESS.reset(token)


def lower_thread_priority(nice: int = BACKGROUND_NICE) -> None:
    """Lower the calling thread's CPU priority (Linux: each thread has its own nice value).

    cairn's background threads (commit, chunk writers, reclaim) call this when they start, so that
    on a machine whose cores the training step keeps busy, the step gets the CPU first and the
    checkpoint takes the rest. A no-op where threads cannot be reprioritised.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), nice))
    except OSError:
        pass


def read_no_follow(path: Path) -> bytes:
    """The bytes of a regular file; OSError (ELOOP) if `path` itself is a symbolic link."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as f:
        return f.read()


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (new names, renames) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclasses.dataclass(frozen=True)
class StoredItem:
    """What a handler's restore and describe get: one item of one committed step.

    `files` maps each path (relative to `directory`) to the record the write phase returned;
    `read_bytes` verifies against it and raises CorruptCheckpointError naming step, item and file.
    """

    directory: Path
    files: Mapping[str, FileRecord]
    step: int | None = None
    name: str = ""

    def describe_file(self, relpath: str) -> str:
        where = f"step {self.step}, " if self.step is not None else ""
        return f"{where}item {self.name!r}, file {self.directory / relpath}"

    def check_files(self, prefix: str = "") -> None:
        """Every recorded file under `prefix` exists with its recorded size (a stat, no read).

        For files a reader does not verify itself: a missing zarr chunk would read as zeros.
        A symbolic link anywhere on the way (the item directory, a subdirectory, the file) is
        refused: a checkpoint is read from inside its own directory only.
        """
        names = self._sorted_names
        for relpath in names[bisect.bisect_left(names, prefix) :]:
            if not relpath.startswith(prefix):
                break
            record = self.files[relpath]
            try:
                size = self._lstat(relpath).st_size
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{self.describe_file(relpath)} is missing") from None
            if size != record.size:
                raise CorruptCheckpointError(
                    f"{self.describe_file(relpath)} has {size} bytes, the manifest says {record.size}"
                )

    @functools.cached_property
    def _sorted_names(self) -> list[str]:
        return sorted(self.files)

    @functools.cached_property
    def _real_dirs(self) -> set[str]:
        return set()  # relative directories already checked not to be links ("" is the item)

    def _lstat(self, relpath: str) -> os.stat_result:
        """lstat of a file, after checking that neither it nor a directory above it, up to and
        including the item directory, is a symbolic link (CorruptCheckpointError if one is)."""
        parts = relpath.split("/")
        for depth in range(len(parts)):
            rel = "/".join(parts[:depth])
            if rel in self._real_dirs:
                continue
            path = self.directory / rel if rel else self.directory
            try:
                is_link = stat.S_ISLNK(os.lstat(path).st_mode)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{self.describe_file(relpath)} is missing") from None
            if is_link:
                raise CorruptCheckpointError(
                    f"{self.describe_file(relpath)}: {path} is a symbolic link; cairn reads a "
                    "checkpoint only from inside its directory"
                )
            self._real_dirs.add(rel)
        info = os.lstat(self.directory / relpath)
        if stat.S_ISLNK(info.st_mode):
            raise CorruptCheckpointError(
                f"{self.describe_file(relpath)} is a symbolic link; cairn reads a checkpoint only "
                "from inside its directory"
            )
        return info

    def read_bytes(self, relpath: str) -> bytes:
        record = self.files.get(relpath)
        if record is None:
            raise CorruptCheckpointError(f"{self.describe_file(relpath)} is not in the manifest")
        try:
            self._lstat(relpath)
            data = read_no_follow(self.directory / relpath)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{self.describe_file(relpath)} is missing") from None
        if len(data) != record.size:
            raise CorruptCheckpointError(
                f"{self.describe_file(relpath)} has {len(data)} bytes, the manifest says {record.size}"
            )
        crc = crc32c.crc32c(data)
        if crc != record.crc32c:
            raise CorruptCheckpointError(
                f"{self.describe_file(relpath)} fails its crc32c check "
                f"(got {crc:#010x}, the manifest says {record.crc32c:#010x})"
            )
        return data
