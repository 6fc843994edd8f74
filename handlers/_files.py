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
import json
import os
import re
import stat
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TypeGuard

import crc32c
import xxhash

from cairn.handlers.errors import CorruptCheckpointError

__all__ = [
    "ChecksummedFile",
    "FileRecord",
    "StoredItem",
    "check_relative",
    "content_hash",
    "fsync_dir",
    "hash_file",
    "lower_thread_priority",
    "open_regular",
    "parse_json",
    "read_no_follow",
    "within",
    "write_file",
    "writing_as",
    "writing_process",
]


CONTENT_HASH = "xxh3_128"
_HEX128 = re.compile(r"[0-9a-f]{32}")


def content_hash(data: bytes | bytearray | memoryview) -> str:
    """The 128-bit content hash a format-2 file record carries: XXH3-128, 32 lowercase hex digits."""
    return xxhash.xxh3_128_hexdigest(data)


def hash_file(path: Path) -> str:
    """`content_hash` of a file, read in 4 MiB pieces (for files a handler did not write itself)."""
    digest = xxhash.xxh3_128()
    with os.fdopen(open_regular(path), "rb") as f:
        while piece := f.read(1 << 22):
            digest.update(piece)
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class FileRecord:
    """One file a handler wrote: its path relative to the item's directory, its size, and what
    identifies its content.

    `xxh3_128` is the XXH3-128 hash of the file's bytes (32 hex digits), which every record of a
    format-2 manifest carries (`ChecksummedFile` and `write_file` compute it while writing).
    `crc32c` is what format-1 manifests recorded: a CRC-32C of the whole file. A handler that
    returns a record without a hash gets one computed by the manager, which then reads the file.
    """

    path: str
    size: int
    crc32c: int | None = None
    xxh3_128: str | None = dataclasses.field(default=None, kw_only=True)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path, "size": self.size}
        if self.crc32c is not None:
            out["crc32c"] = self.crc32c
        if self.xxh3_128 is not None:
            out[CONTENT_HASH] = self.xxh3_128
        return out

    @classmethod
    def from_json(cls, obj: Any) -> FileRecord:
        """A record read from a manifest; ValueError (or TypeError) for anything malformed."""
        if not isinstance(obj, Mapping):
            raise TypeError(f"a file record must be an object, got {obj!r:.80}")
        path, size = obj.get("path"), obj.get("size")
        crc, digest = obj.get("crc32c"), obj.get(CONTENT_HASH)
        if not isinstance(path, str) or not _is_int(size) or not 0 <= size < 2**63:
            raise ValueError(f"malformed file record {dict(obj)!r:.200}")
        if crc is not None and not (_is_int(crc) and 0 <= crc < 2**32):
            raise ValueError(
                f"file record {path!r}: crc32c {crc!r:.40} is not a 32-bit unsigned int"
            )
        if digest is not None and not (isinstance(digest, str) and _HEX128.fullmatch(digest)):
            raise ValueError(
                f"file record {path!r}: {CONTENT_HASH} {digest!r:.60} is not 32 hex digits"
            )
        if crc is None and digest is None:
            raise ValueError(f"file record {path!r} has no checksum")
        check_relative(path)  # a crafted manifest must not make restore read outside the step
        return cls(path, size, crc, xxh3_128=digest)

    def check(self, data: bytes | bytearray | memoryview, where: str) -> None:
        """CorruptCheckpointError (naming `where`) unless `data` is this file's content."""
        if len(data) != self.size:
            raise CorruptCheckpointError(
                f"{where} has {len(data)} bytes, the manifest says {self.size}"
            )
        if self.xxh3_128 is not None:
            got = content_hash(data)
            if got != self.xxh3_128:
                raise CorruptCheckpointError(
                    f"{where} is not the file the manifest records (its {CONTENT_HASH} is {got}, "
                    f"the manifest says {self.xxh3_128})"
                )
        elif self.crc32c is not None:
            crc = crc32c.crc32c(data)
            if crc != self.crc32c:
                raise CorruptCheckpointError(
                    f"{where} fails its crc32c check "
                    f"(got {crc:#010x}, the manifest says {self.crc32c:#010x})"
                )


def parse_json(data: bytes, where: str) -> Any:
    """JSON read from a checkpoint; CorruptCheckpointError naming `where` for anything that is not
    JSON, is nested deeper than Python's recursion allows, or holds an integer of more digits than
    Python converts: a reader never fails with another exception on a stranger's file."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, int digits
        raise CorruptCheckpointError(
            f"{where} does not parse: {type(e).__name__}: {e!s:.200}"
        ) from None


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


_NAME_LIMIT = 255


def check_relative(relpath: str) -> None:
    """A path inside an item: `/`-separated plain names (no empty, `.` or `..` part, no NUL or
    control character, none longer than a filesystem allows). ValueError otherwise."""
    parts = relpath.split("/") if isinstance(relpath, str) else [""]
    if (
        not relpath
        or any(
            p in ("", ".", "..") or len(p.encode("utf-8", "surrogatepass")) > _NAME_LIMIT
            for p in parts
        )
        or any(ord(c) < 0x20 or c == "\x7f" for c in relpath)
    ):
        raise ValueError(
            f"file path {relpath!r:.300} must be relative, of plain names (no '.', '..', empty "
            "parts or control characters)"
        )


def within(base: Path, relpath: str, *, what: str = "") -> Path:
    """`base/relpath`, the one way cairn turns a name read from a checkpoint into a path.

    `relpath` must pass `check_relative`, and no directory on the way from `base` to the file may
    be a symbolic link (the file itself is opened without following links, or is refused by
    `StoredItem`), so the result is inside `base` whatever the checkpoint says.
    CorruptCheckpointError naming `what` otherwise.
    """
    try:
        check_relative(relpath)
    except ValueError as e:
        raise CorruptCheckpointError(f"{what or base}: {e}") from None
    path = base / relpath
    parent = path.parent
    while parent != base:
        if parent.is_symlink():
            raise CorruptCheckpointError(
                f"{what or base}: {parent} is a symbolic link; cairn reads and writes a "
                "checkpoint only inside its directory"
            )
        parent = parent.parent
    return path


class ChecksummedFile:
    """A binary file opened for writing that tracks its size and content hash as bytes go through.

    Use as a context manager; `record` is valid after it closes. It does not fsync: the manager
    fsyncs the whole temporary tree once, after every item is written.
    """

    def __init__(self, root: Path, relpath: str) -> None:
        check_relative(relpath)
        self._relpath = relpath
        path = root / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "xb")  # noqa: SIM115 - closed by close()/__exit__
        self._hash = xxhash.xxh3_128()
        self._size = 0
        self._record: FileRecord | None = None

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        self._hash.update(view)
        self._size += view.nbytes
        return self._file.write(view)

    def close(self) -> None:
        if self._record is None:
            self._file.close()
            self._record = FileRecord(self._relpath, self._size, xxh3_128=self._hash.hexdigest())

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


def open_regular(path: Path) -> int:
    """A read-only descriptor of a regular file, opened without following a link and without
    blocking (a FIFO would hang a reader); OSError (ELOOP for a link) or CorruptCheckpointError
    (anything that is not a regular file) otherwise. The caller closes it."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CorruptCheckpointError(
                f"{path} is not a regular file (mode {stat.filemode(mode)})"
            )
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_no_follow(path: Path) -> bytes:
    """The bytes of a regular file, through `open_regular`."""
    with os.fdopen(open_regular(path), "rb") as f:
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
            except (FileNotFoundError, NotADirectoryError):
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
            except (FileNotFoundError, NotADirectoryError):
                raise CorruptCheckpointError(f"{self.describe_file(relpath)} is missing") from None
            if is_link:
                raise CorruptCheckpointError(
                    f"{self.describe_file(relpath)}: {path} is a symbolic link; cairn reads a "
                    "checkpoint only from inside its directory"
                )
            self._real_dirs.add(rel)
        try:
            info = os.lstat(self.directory / relpath)
        except NotADirectoryError:  # a directory on the way is a file (or a FIFO)
            raise CorruptCheckpointError(
                f"{self.describe_file(relpath)}: a directory on its way is not a directory"
            ) from None
        if stat.S_ISLNK(info.st_mode):
            raise CorruptCheckpointError(
                f"{self.describe_file(relpath)} is a symbolic link; cairn reads a checkpoint only "
                "from inside its directory"
            )
        if not stat.S_ISREG(info.st_mode):
            raise CorruptCheckpointError(
                f"{self.describe_file(relpath)} is not a regular file "
                f"(mode {stat.filemode(info.st_mode)})"
            )
        return info

    def open_file(self, relpath: str) -> int:
        """A read-only descriptor of a recorded file, after the checks of `check_files`; the
        caller closes it and checks what it reads with ``files[relpath].check``."""
        record = self.files.get(relpath)
        if record is None:
            raise CorruptCheckpointError(f"{self.describe_file(relpath)} is not in the manifest")
        try:
            size = self._lstat(relpath).st_size
            if size != record.size:
                raise CorruptCheckpointError(
                    f"{self.describe_file(relpath)} has {size} bytes, the manifest says {record.size}"
                )
            return open_regular(self.directory / relpath)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{self.describe_file(relpath)} is missing") from None
        except CorruptCheckpointError:
            raise
        except OSError as e:
            raise CorruptCheckpointError(
                f"{self.describe_file(relpath)} cannot be read: {e}"
            ) from None

    def read_bytes(self, relpath: str) -> bytes:
        """The whole content of a recorded file, checked against its record."""
        with os.fdopen(self.open_file(relpath), "rb") as f:
            data = f.read()
        self.files[relpath].check(data, self.describe_file(relpath))
        return data
