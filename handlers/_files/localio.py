"""Local files, read and written safely: no-follow reads of a checkpoint's files (`open_regular`,
`read_no_follow`, `within`), their content hash (`hash_file`), `ChecksummedFile` (hashed as it is
written) and fsync (`fsync_path`, `fsync_dir`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from types import TracebackType

import xxhash

from cairn.handlers._files.records import FileRecord, RangeHashes, check_relative
from cairn.handlers.errors import CorruptCheckpointError


def hash_file(path: Path) -> str:
    """`content_hash` of a file, read in 4 MiB pieces (for files a handler did not write itself)."""
    fd = open_regular(path)
    try:
        return _hash_fd(fd)
    finally:
        os.close(fd)


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

    def __init__(self, root: str | os.PathLike[str], relpath: str) -> None:
        check_relative(relpath)
        root = Path(root)
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


def open_regular(path: str | os.PathLike[str]) -> int:
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


def fsync_path(path: str | os.PathLike[str], *, directory: bool = False) -> None:
    """Flush a file's data and metadata, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (new names, renames) to disk."""
    fsync_path(path, directory=True)


def _hash_fd(fd: int, hashes: RangeHashes | None = None) -> str:
    """The content hash of an open file, read 4 MiB at a time into one buffer (fed to
    `hashes` too, if given)."""
    hashes = hashes or RangeHashes()
    buffer = memoryview(bytearray(4 << 20))
    at = 0
    while n := os.preadv(fd, [buffer], at):
        hashes.update(buffer[:n])
        at += n
    return hashes.whole.hexdigest()
