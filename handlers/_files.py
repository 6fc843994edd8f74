"""Files with checksums computed while writing, verified reads, and fsync helpers.

A handler's write phase returns one `FileRecord` per file it wrote; the manager puts them in the
manifest, and `StoredItem.read_bytes` checks size and crc32c on the way back in. The checksum is
always computed from the bytes as they are written, never by reading the file again.
"""

from __future__ import annotations

import abc
import bisect
import concurrent.futures
import contextlib
import contextvars
import ctypes
import dataclasses
import errno
import fcntl
import functools
import json
import logging
import numbers
import os
import re
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeGuard

import crc32c
import numpy as np
import xxhash

from cairn.handlers.errors import CorruptCheckpointError

__all__ = [
    "ChecksummedFile",
    "Destination",
    "FileRecord",
    "LocalDestination",
    "LocalSource",
    "Source",
    "StoredItem",
    "WriteBudget",
    "as_destination",
    "check_relative",
    "content_hash",
    "fsync_dir",
    "fsync_path",
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


log = logging.getLogger("cairn")

CONTENT_HASH = "xxh3_128"
_HEX128 = re.compile(r"[0-9a-f]{32}")


NOT_THE_CHUNK = "is not the chunk the index records (its content hash differs)"
PROBE_MIN = 1 << 20  # files of an object store whose size `StoredItem.check_files` checks


@functools.cache
def _physical_memory() -> int:
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        return 1 << 34


def content_hash(data: bytes | bytearray | memoryview) -> str:
    """The 128-bit content hash a format-2 file record carries: XXH3-128, 32 lowercase hex digits."""
    return xxhash.xxh3_128_hexdigest(data)


def hash_file(path: Path) -> str:
    """`content_hash` of a file, read in 4 MiB pieces (for files a handler did not write itself)."""
    fd = open_regular(path)
    try:
        return _hash_fd(fd)
    finally:
        os.close(fd)


@dataclasses.dataclass(frozen=True)
class FileRecord:
    """One file a handler wrote: its path relative to the item's directory, its size, and what
    identifies its content.

    `xxh3_128` is the XXH3-128 hash of the file's bytes (32 hex digits), which every record of a
    format-2 manifest carries (`ChecksummedFile` and `write_file` compute it while writing).
    `crc32c` is what format-1 manifests recorded: a CRC-32C of the whole file. A handler that
    returns a record without a hash gets one computed by the manager, which then reads the file.
    `reused` says the file was not written by this save: the previous step had the same content,
    and the file is a hard link to that step's (see `Destination.reuse`); readers need not care.
    """

    path: str
    size: int
    crc32c: int | None = None
    xxh3_128: str | None = dataclasses.field(default=None, kw_only=True)
    reused: bool = dataclasses.field(default=False, kw_only=True)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path, "size": self.size}
        if self.crc32c is not None:
            out["crc32c"] = self.crc32c
        if self.xxh3_128 is not None:
            out[CONTENT_HASH] = self.xxh3_128
        if self.reused:
            out["reused"] = True
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
        reused = obj.get("reused", False)
        if not isinstance(reused, bool):
            raise ValueError(f"file record {path!r}: reused {reused!r:.40} is not true or false")
        check_relative(path)  # a crafted manifest must not make restore read outside the step
        return cls(path, size, crc, xxh3_128=digest, reused=reused)

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
_CONTROL = re.compile("[\x00-\x1f\x7f]")
_IOV_MAX = 1024  # buffers one preadv takes (Linux's UIO_MAXIOV)


def check_relative(relpath: str) -> None:
    """A path inside an item: `/`-separated plain names (no empty, `.` or `..` part, no NUL or
    control character, none longer than a filesystem allows, none that no filesystem can
    name: a lone surrogate such as JSON's ``"\ud800"`` has no bytes). ValueError otherwise."""
    try:  # UTF-8 (surrogateescape): b"/" is in no other character's bytes, so these are the parts
        encoded = os.fsencode(relpath).split(b"/") if isinstance(relpath, str) else None
    except UnicodeEncodeError:  # a lone surrogate
        encoded = None
    if (
        not relpath
        or encoded is None
        or any(len(p) > _NAME_LIMIT or p in (b"", b".", b"..") for p in encoded)
        or _CONTROL.search(relpath)
    ):
        raise ValueError(
            f"file path {relpath!r:.300} must be relative, of plain names (no '.', '..', empty "
            "parts, control characters or lone surrogates)"
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


Buffer = bytes | bytearray | memoryview


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


def write_file(root: Path | Destination, relpath: str, data: Buffer) -> FileRecord:
    """Write `data` to `root/relpath` (which must not exist) and return its record.

    `root` is a write phase's `Destination` (the file goes wherever the checkpoint is: a
    directory, a bucket) or a local directory."""
    if isinstance(root, Destination):
        return root.write_file(relpath, data)
    with ChecksummedFile(root, relpath) as f:
        f.write(data)
    return f.record


BACKGROUND_NICE = 19

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
    """Lower the calling thread's CPU and I/O priority (Linux: each thread has its own), and
    give the kernel its Python name, so that ``top -H`` shows which cairn thread uses the CPU.

    cairn's background threads (commit, chunk writers, reclaim, staging) call this when they
    start, so that on a machine whose cores the training step keeps busy, the step gets the CPU
    first and the checkpoint takes the rest: nice `nice`, and the lowest best-effort I/O level.
    A no-op where threads cannot be reprioritised.
    """
    if not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), nice))
    set_io_priority(tid, BACKGROUND_IO_LEVEL)
    # The thread's name in the kernel too (top -H, /proc/<pid>/task/*/comm): 15 bytes at most.
    name = threading.current_thread().name.encode()[:15]
    _libc().prctl(_PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)


# ioprio_set(2) / ioprio_get(2): no libc wrapper, so the raw system call (numbers per architecture).
_IOPRIO_SYSCALLS = {"x86_64": (251, 252), "aarch64": (30, 31), "ppc64le": (273, 274)}
_IOPRIO_CLASS_BE, _IOPRIO_CLASS_SHIFT, _IOPRIO_WHO_PROCESS = 2, 13, 1
BACKGROUND_IO_LEVEL = 7  # the lowest best-effort level: after the trainer's reads and writes


_PR_SET_NAME = 15


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def set_io_priority(tid: int, level: int) -> bool:
    """Put thread `tid` in the best-effort I/O class at `level` (0 first .. 7 last); whether it
    took. I/O schedulers that weigh priorities (BFQ, CFQ) serve its reads and writes after those
    of threads at the default level 4; others ignore it."""
    numbers = _IOPRIO_SYSCALLS.get(os.uname().machine)
    if numbers is None or not sys.platform.startswith("linux"):
        return False
    value = (_IOPRIO_CLASS_BE << _IOPRIO_CLASS_SHIFT) | level
    return int(_libc().syscall(numbers[0], _IOPRIO_WHO_PROCESS, tid, value)) == 0


def io_priority(tid: int) -> tuple[int, int] | None:
    """(class, level) of thread `tid`'s I/O priority, or None where it cannot be read."""
    numbers = _IOPRIO_SYSCALLS.get(os.uname().machine)
    if numbers is None or not sys.platform.startswith("linux"):
        return None
    value = int(_libc().syscall(numbers[1], _IOPRIO_WHO_PROCESS, tid))
    if value < 0:
        return None
    return value >> _IOPRIO_CLASS_SHIFT, value & ((1 << _IOPRIO_CLASS_SHIFT) - 1)


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


Pieces = Buffer | Sequence[Buffer]


def _views(data: Pieces) -> list[memoryview]:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return [memoryview(data).cast("B")]
    return [memoryview(piece).cast("B") for piece in data]


class Destination(abc.ABC):
    """Where one item's write phase puts its files: a directory on disk, a prefix in a bucket.

    A snapshot's ``write(dest)`` creates its files with `write_file` (whole contents, given as
    one buffer or as pieces, written without joining them) or `create` (a file written
    piecewise), each of which returns the file's `FileRecord`, its content hash computed from
    the bytes as they go out. Where the checkpoint lives is the storage's business: the same
    write phase writes into a temporary directory on disk or straight into an object store.

    A handler that can only write through a library that wants a path may use the destination
    as one (``os.fspath(dest)``, ``dest / "name"``): that is a local directory, the item's own
    on disk; for an object store, a staging directory whose files the manager uploads after the
    write phase, so they cost local disk and memory for their size.

    Threads: `write_file` and `create` may be called from several threads at once (a handler's
    writer pool); each path is written once.
    """

    def __init__(self) -> None:
        self._written: dict[str, FileRecord] = {}
        self._written_lock = threading.Lock()
        self._reusable: dict[tuple[int, str], str] = {}
        self._reuse_source: Source | None = None
        self._reuse_records: dict[str, FileRecord] = {}
        self._incremental = False

    def reuse(self, source: Source | None, records: Iterable[FileRecord] = ()) -> None:
        """An incremental save: let `write_file` reuse the files of the previous step's item
        (`source`, `records`: its manifest's; None for the first save, which has none): a file
        whose size and content hash are those of one of them is not written but linked to it
        (where the destination can: `LocalDestination` makes a hard link), and its record says
        ``reused``. What is compared is the hash of the bytes handed to `write_file`, never a
        timestamp; the previous file must still be a regular file of its recorded size, inside
        its step, or the bytes are written as usual."""
        self._reusable = {(r.size, r.xxh3_128): r.path for r in records if r.xxh3_128}
        self._reuse_source = source
        self._reuse_records = {r.path: r for r in records}
        self._incremental = True

    def previous(self) -> StoredItem | None:
        """In an incremental save, the previous step's item (to read what it recorded, checked
        against its manifest as any restore reads), or None."""
        if self._reuse_source is None:
            return None
        return StoredItem(self._reuse_source, self._reuse_records)

    def link_known(
        self, relpath: str, size: int, digest: str, ranges: Ranges = ()
    ) -> FileRecord | None:
        """Make `relpath` the previous step's file of this size and content hash without being
        given its bytes (a caller that knows them unchanged: the same immutable array as when it
        wrote them); its record, or None where the previous step has no such file or it cannot
        be linked (nothing is made then, and the caller writes the bytes).

        `ranges` are parts of the file that must hold content of their own, (name, offset,
        bytes, XXH3-128), as an index read from the checkpoint says (the train state's packs):
        they are checked on the same read as the whole file, whether or not this process knows
        the file, and the file is linked only if every one holds (else a warning names it)."""
        if (size, digest) not in self._reusable:
            return None
        self._reserve(relpath)
        linked = False
        try:
            linked = self._reuse_file(relpath, size, digest, ranges)
        finally:
            with self._written_lock:
                if linked:
                    record = FileRecord(relpath, size, xxh3_128=digest, reused=True)
                    self._written[relpath] = record
                else:
                    del self._written[relpath]  # the caller may write it
        return record if linked else None

    def _reuse_file(self, relpath: str, size: int, digest: str, ranges: Ranges = ()) -> bool:
        """Whether `relpath` is now a link to a file of the previous step with this content."""
        source_relpath = self._reusable.get((size, digest))
        source = self._reuse_source
        if source_relpath is None or source is None:
            return False
        return self._link(relpath, source, source_relpath, size, digest, ranges)

    def _link(
        self,
        relpath: str,
        source: Source,
        source_relpath: str,
        size: int,
        digest: str,
        ranges: Ranges = (),
    ) -> bool:
        """Make `relpath` the previous step's file `source_relpath` (`size` bytes, content hash
        `digest`, holding `ranges`: see `link_known`) without writing it (a hard link on disk,
        a server-side copy in a bucket); False where that cannot be done (then the caller
        writes)."""
        return False

    def _wrote(self, relpath: str, size: int, digest: str, stored: Any) -> None:
        """`write_file` wrote `relpath` with this content in an incremental save (`stored`: what
        `_put` returned), so that the next save may reuse it without reading it."""
        return None

    @abc.abstractmethod
    def _put(self, relpath: str, pieces: list[memoryview]) -> Any:
        """Store one whole file (its pieces in order) under `relpath`; anything `_wrote` needs
        to know the stored file by later (an object store's generation), or None."""

    @abc.abstractmethod
    def local_directory(self) -> Path:
        """A local directory for files written through paths (see the class docstring)."""

    @abc.abstractmethod
    def describe(self, relpath: str) -> str:
        """Where `relpath` goes, for messages (a path or a URL)."""

    #: the commit's write budget (``max_write_bytes_per_s``), if any; set by the manager.
    budget: WriteBudget | None = None
    #: how many files a handler had best write at once here (TrainStateHandler's default
    #: `threads`): each write to an object store holds a joined copy of its file until the PUT
    #: returns, so 2; a local disk written with O_DIRECT waits on the device, so 4 (see it).
    writers: int = 2
    #: the largest pack of the train state's packed layout here: each PUT in flight holds a
    #: joined copy (and TensorStore about two more), so 16 MiB on an object store; 64 MiB on
    #: disk, where a pack is written from the staging pool without a copy.
    pack_bytes: int = 16 << 20

    def write_file(
        self, relpath: str, data: Pieces, *, xxh3_128: str | Callable[[], str] | None = None
    ) -> FileRecord:
        """Write a whole file (which must not exist yet) and return its record.

        `xxh3_128` is the content hash of exactly these bytes, or a function that computes it
        (the train state's packs hash their chunks in the same pass), when the caller has its
        own way; the destination hashes the bytes itself otherwise. A wrong one makes the step
        fail its check on restore, never pass it.

        The hash is computed once the bytes are stored, unless an incremental save needs it
        first (to find a file of the previous step with the same content): a commit's hashing
        then follows its writes instead of coming before all of them, so the train step right
        after ``save()`` does not meet every writer thread hashing at once.
        """
        self._reserve(relpath)
        views = _views(data)
        size = sum(v.nbytes for v in views)

        def digest() -> str:
            if isinstance(xxh3_128, str):
                return xxh3_128
            if xxh3_128 is not None:
                return xxh3_128()
            hashed = xxhash.xxh3_128()
            for view in views:
                hashed.update(view)
            return hashed.hexdigest()

        known = digest() if self._incremental else None
        reused = known is not None and self._reuse_file(relpath, size, known)
        if not reused:
            if self.budget is not None:
                self.budget.take(size)
            stored = self._put(relpath, views)
            if known is None:
                known = digest()
            if self._incremental:  # the next save may link it unread
                self._wrote(relpath, size, known, stored)
        record = FileRecord(relpath, size, xxh3_128=known, reused=reused)
        with self._written_lock:
            self._written[relpath] = record
        return record

    def create(self, relpath: str) -> ChecksummedFile | BufferedFile:
        """A file to write piece by piece; a context manager whose `record` is valid once closed.

        This default keeps the pieces in memory and stores them at close (object stores write
        an object whole); a destination on disk streams them instead."""
        self._reserve(relpath)
        return BufferedFile(relpath, self._put_buffered)

    def _put_buffered(self, relpath: str, pieces: list[memoryview], record: FileRecord) -> None:
        self._put(relpath, pieces)
        with self._written_lock:
            self._written[relpath] = record

    def _reserve(self, relpath: str) -> None:
        check_relative(relpath)
        with self._written_lock:
            if relpath in self._written:
                raise ValueError(f"{self.describe(relpath)} is written twice")
            self._written[relpath] = _PENDING

    def finish(self, handler_id: str, records: Sequence[FileRecord]) -> tuple[FileRecord, ...]:
        """The write phase returned `records`: check that they name distinct files it really
        wrote, at the sizes it wrote, and return them each with a content hash.

        A file not written through `write_file` or `create` must be in `local_directory()` (a
        handler that wrote through a path); it is hashed there (the one time cairn reads back a
        file it wrote) and, for a remote destination, uploaded."""
        seen: set[str] = set()
        out = []
        for record in records:
            if not isinstance(record, FileRecord):
                raise TypeError(f"handler {handler_id!r} returned {record!r}, not a FileRecord")
            if record.path in seen:
                raise ValueError(f"handler {handler_id!r} returned {record.path!r} twice")
            seen.add(record.path)
            check_relative(record.path)
            with self._written_lock:
                written = self._written.get(record.path)
            if written is _PENDING:
                raise ValueError(
                    f"handler {handler_id!r} returned {record.path!r}, whose file it never closed"
                )
            if written is None:
                out.append(self._adopt(handler_id, record))
                continue
            if record.size != written.size:
                raise ValueError(
                    f"handler {handler_id!r} says {record.path!r} has {record.size} bytes, "
                    f"it wrote {written.size}"
                )
            if record.xxh3_128 is not None and record.xxh3_128 != written.xxh3_128:
                raise ValueError(
                    f"handler {handler_id!r} gives {record.path!r} a {CONTENT_HASH} that is not "
                    "the one of the bytes it wrote"
                )
            out.append(
                dataclasses.replace(record, xxh3_128=written.xxh3_128, reused=written.reused)
            )
        return tuple(out)

    def _adopt(self, handler_id: str, record: FileRecord) -> FileRecord:
        """A file the handler wrote into `local_directory()` itself (checked, hashed, kept)."""
        path = self.local_directory() / record.path
        if not path.is_file() or path.is_symlink():
            raise ValueError(
                f"handler {handler_id!r} returned {record.path!r}, which it did not write"
            )
        size = path.stat().st_size
        if size != record.size:
            raise ValueError(
                f"handler {handler_id!r} says {record.path!r} has {record.size} bytes, "
                f"the file has {size}"
            )
        if record.xxh3_128 is None:
            record = dataclasses.replace(record, xxh3_128=hash_file(path))
        self._upload_staged(path, record)
        return record

    def _upload_staged(self, path: Path, record: FileRecord) -> None:
        """Store a file written into the local directory (nothing to do when that is the item's
        own directory)."""
        del path, record

    def __fspath__(self) -> str:
        return os.fspath(self.local_directory())

    def __truediv__(self, other: str | os.PathLike[str]) -> Path:
        return self.local_directory() / other


def as_destination(target: Destination | str | os.PathLike[str]) -> Destination:
    """A write phase's argument as a `Destination`: a local directory given as a path (a test,
    or code that calls a snapshot's write itself) becomes a `LocalDestination`."""
    return target if isinstance(target, Destination) else LocalDestination(target)


_PENDING = FileRecord("", 0, xxh3_128="0" * 32)  # a path reserved, its file not yet closed


class BufferedFile:
    """A file written piecewise into memory and handed to `store(relpath, pieces, record)` whole
    when it closes (the way to write one object into an object store). Tracks size and hash."""

    def __init__(
        self, relpath: str, store: Callable[[str, list[memoryview], FileRecord], None]
    ) -> None:
        self._relpath, self._store = relpath, store
        self._pieces: list[memoryview] = []
        self._hash = xxhash.xxh3_128()
        self._record: FileRecord | None = None

    def write(self, data: Buffer) -> int:
        view = memoryview(bytes(data))  # the caller may reuse its buffer
        self._hash.update(view)
        self._pieces.append(view)
        return view.nbytes

    def close(self) -> None:
        if self._record is None:
            size = sum(p.nbytes for p in self._pieces)
            self._record = FileRecord(self._relpath, size, xxh3_128=self._hash.hexdigest())
            self._store(self._relpath, self._pieces, self._record)
            self._pieces = []

    @property
    def record(self) -> FileRecord:
        if self._record is None:
            raise RuntimeError(f"{self._relpath}: record asked before the file was closed")
        return self._record

    def __enter__(self) -> BufferedFile:
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if typ is None:
            self.close()


class LocalDestination(Destination):
    """An item's directory on a local filesystem (created if absent). Files are written with
    ``writev`` straight from the caller's buffers; nothing is fsynced here (the storage makes
    the whole step durable once, after every item is written).

    A file whose first buffers start on page boundaries and span at least `DIRECT_MIN` bytes
    each (the train state's staged chunks and packs) is written with ``O_DIRECT`` buffer by
    buffer while each is whole pages, the last up to its last whole page, from that memory to
    the disk without a copy through the page cache, and the rest (under a page, plus the other
    buffers) through the page cache. Where the filesystem refuses
    ``O_DIRECT`` (ramfs, some network filesystems) every byte goes through the page cache.
    """

    writers = 4  # measured at 1 GiB here: the commit took 0.88 s with 4, 1.02 s with 2
    pack_bytes = 64 << 20

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        super().__init__()
        self.directory = Path(directory)
        self._made: set[str] = set()
        self._made_lock = threading.Lock()
        #: the files `_link` made: links to a committed step's files, whose content is durable
        self.linked: list[str] = []

    def local_directory(self) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        return self.directory

    def describe(self, relpath: str) -> str:
        return str(self.directory / relpath)

    def _parent(self, relpath: str) -> None:
        parent = os.path.dirname(relpath)
        with self._made_lock:
            if parent not in self._made:
                os.makedirs(self.directory / parent, exist_ok=True)
                self._made.add(parent)

    def _open(self, relpath: str) -> int:
        self._parent(relpath)
        return os.open(self.directory / relpath, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)

    def _link(
        self,
        relpath: str,
        source: Source,
        source_relpath: str,
        size: int,
        digest: str,
        ranges: Ranges = (),
    ) -> bool:
        """A hard link to the previous step's file, if it is a regular file of `size` bytes,
        inside its step (no link on the way, `LocalSource.open`), whose content is `digest`
        and holds `ranges`, owned by this user and writable by no one else (others could change
        it under every step that shares it: a hard link to a file outside the root, say).

        The content is trusted without reading it only for a file this process wrote (or read
        and hashed) before, unchanged since (same device, inode, size and mtime: `_KNOWN`),
        and given no `ranges`; any other file is read and hashed once first, so a damaged file
        of an older step is written afresh rather than passed on to every later step. The link is made by name,
        then checked to be the very file that was checked (same inode, not a link; the checked
        file is held open meanwhile, so its inode number cannot pass to another file): a file
        swapped in between is unlinked again. False, and nothing left, where any of it fails:
        another filesystem, too many links (ext4 allows 65,000), a previous step gone or
        damaged; the caller then writes the bytes."""
        if not isinstance(source, LocalSource):
            return False
        try:
            fd = source.open(source_relpath, size)
        except (OSError, CorruptCheckpointError):
            return False
        try:  # the descriptor stays open until the link is checked: its inode cannot be reused
            checked = os.fstat(fd)
            key = (checked.st_dev, checked.st_ino)
            if checked.st_uid != os.geteuid() or checked.st_mode & 0o022:
                # cairn writes 0o644 files as this user: one that another user owns, or that
                # others may write, can change under every step that would share it
                log.warning(
                    "cairn: %s is owned by uid %d with mode %s; this save writes it afresh "
                    "rather than sharing a file that others may change",
                    source.describe(source_relpath),
                    checked.st_uid,
                    stat.filemode(checked.st_mode),
                )
                return False
            if ranges or _KNOWN.get(key) != (checked.st_mtime_ns, size, digest):
                hashes = RangeHashes(ranges)
                _hash_fd(fd, hashes)
                if not hashes.hold(digest, source.describe(source_relpath)):
                    return False
                _KNOWN.put(key, (checked.st_mtime_ns, size, digest))
            target = self.directory / relpath
            self._parent(relpath)
            os.link(source.directory / source_relpath, target, follow_symlinks=False)
        except FileExistsError:
            raise
        except OSError:
            return False
        finally:
            os.close(fd)
        made = os.lstat(target)
        if not stat.S_ISREG(made.st_mode) or (made.st_dev, made.st_ino) != key:
            os.unlink(target)
            return False
        with self._made_lock:
            self.linked.append(relpath)
        return True

    def _wrote(self, relpath: str, size: int, digest: str, stored: Any) -> None:
        info = os.lstat(self.directory / relpath)
        _KNOWN.put((info.st_dev, info.st_ino), (info.st_mtime_ns, size, digest))

    def _put(self, relpath: str, pieces: list[memoryview]) -> None:
        fd = self._open(relpath)
        try:
            views = [v for v in pieces if v.nbytes]
            while views and _direct_candidate(views[0]):  # page-aligned spans, in whole pages
                whole = views[0].nbytes - views[0].nbytes % DIRECT_ALIGN
                done = _write_direct(fd, views[0][:whole])
                views[0] = views[0][done:]
                if views[0].nbytes:  # a tail under a page, or O_DIRECT refused: buffered now
                    break
                views.pop(0)
            while views:
                n = os.writev(fd, views[:1024])
                while views and n >= views[0].nbytes:
                    n -= views[0].nbytes
                    views.pop(0)
                if views and n:
                    views[0] = views[0][n:]
        finally:
            os.close(fd)

    def create(self, relpath: str) -> ChecksummedFile | BufferedFile:
        self._reserve(relpath)
        with self._made_lock:
            self._made.add(os.path.dirname(relpath))
        return _TrackedFile(self, relpath)


DIRECT_ALIGN = 4096  # O_DIRECT wants address, offset and length in multiples of the block size
DIRECT_MIN = 1 << 20  # smaller files gain nothing from it
# One write() call, the unit of a short write. Each call lets go of the GIL, and a training loop
# busy in Python gives it back only after up to 5 ms: 32 MiB took a 256 MiB commit beside such a
# loop from 0.69 to 0.56 s (8 MiB before; idle: the same).
_DIRECT_PIECE = 32 << 20
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_NO_DIRECT_DEVICES: set[int] = set()  # filesystems that refused O_DIRECT once


class KnownFiles:
    """What this process knows of files it wrote or read (for incremental saves: a file known
    unchanged is reused without reading it), at most `capacity` entries: the oldest go first,
    so the newest step's files, the ones the next save reuses, stay. Thread-safe."""

    def __init__(self, capacity: int = 1 << 17) -> None:  # some tens of MB at most
        self._entries: dict[Any, Any] = {}
        self._capacity = capacity
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any:
        return self._entries.get(key)

    def put(self, key: Any, value: Any) -> None:
        with self._lock:
            self._entries.pop(key, None)  # to the end: the newest
            self._entries[key] = value
            if len(self._entries) > self._capacity:
                del self._entries[next(iter(self._entries))]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


# Files whose content this process knows (it wrote or hashed them): (device, inode) ->
# (mtime_ns, size, content hash). An incremental save links such a file without reading it.
_KNOWN = KnownFiles()


Ranges = Sequence[tuple[str, int, int, str]]  # (name, offset, bytes, XXH3-128) of a file's bytes


class RangeHashes:
    """The content hash of a file and of `ranges` of it (see `Destination.link_known`), fed
    the file's bytes in order, a block at a time (ranges may overlap: an index that lies)."""

    def __init__(self, ranges: Ranges = ()) -> None:
        self.whole = xxhash.xxh3_128()
        self.ranges = sorted(ranges, key=lambda r: r[1])
        self._parts = [xxhash.xxh3_128() for _ in self.ranges]
        self._at = self._first = 0  # bytes fed; the first range that may not have ended

    def update(self, block: memoryview) -> None:
        lo, hi = self._at, self._at + block.nbytes
        self.whole.update(block)
        for i in range(self._first, len(self.ranges)):
            _, offset, nbytes, _ = self.ranges[i]
            if offset >= hi:
                break
            a, b = max(offset, lo), min(offset + nbytes, hi)
            if a < b:
                self._parts[i].update(block[a - lo : b - lo])
        while self._first < len(self.ranges) and sum(self.ranges[self._first][1:3]) <= hi:
            self._first += 1
        self._at = hi

    def hold(self, digest: str, where: str) -> bool:
        """Whether the bytes fed hash to `digest` and each range to its own; a warning naming
        `where` (the file) and what does not hold, otherwise."""
        if self.whole.hexdigest() != digest:
            log.warning(
                "cairn: %s does not hold what its manifest records; this save writes the file "
                "afresh",
                where,
            )
            return False
        for (name, offset, nbytes, want), got in zip(self.ranges, self._parts, strict=True):
            if offset + nbytes > self._at or got.hexdigest() != want:
                log.warning(
                    "cairn: %s, chunk %s (bytes %d..%d) %s; this save writes the chunks that "
                    "the step's index places in that file afresh",
                    where,
                    name,
                    offset,
                    offset + nbytes,
                    NOT_THE_CHUNK,
                )
                return False
        return True


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


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, np.uint8).__array_interface__["data"][0])


def _direct_candidate(view: memoryview) -> bool:
    return bool(_O_DIRECT) and view.nbytes >= DIRECT_MIN and _address(view) % DIRECT_ALIGN == 0


def _write_direct(fd: int, view: memoryview) -> int:
    """Write `view` (page aligned, whole pages) at the start of `fd` with ``O_DIRECT``; the bytes
    written, short of all of them where the filesystem refuses it (then ``O_DIRECT`` is off
    again and the caller writes the rest through the page cache)."""
    device = os.fstat(fd).st_dev
    if device in _NO_DIRECT_DEVICES:
        return 0
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | _O_DIRECT)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
        _NO_DIRECT_DEVICES.add(device)
        return 0
    done = 0
    try:
        while done < view.nbytes:
            n = os.write(fd, view[done : done + _DIRECT_PIECE])
            done += n
            if n % DIRECT_ALIGN:  # a short write off a block boundary: the rest goes buffered
                break
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        _NO_DIRECT_DEVICES.add(device)  # refused at the first write (some filesystems do)
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    return done


class WriteBudget:
    """A bound on the bytes a commit writes per second (``max_write_bytes_per_s``), shared by
    its writer threads: each file waits for its turn, so a commit takes longer and takes the
    disk and the cores less. Bursts are one file (a chunk of at most ``chunk_bytes``).

    Threads: `take` may be called from any number of threads at once.
    """

    def __init__(self, bytes_per_s: float) -> None:
        rate = float("nan")
        if isinstance(bytes_per_s, numbers.Real) and not isinstance(bytes_per_s, bool):
            with contextlib.suppress(OverflowError):  # an int past float's range: refused too
                rate = float(bytes_per_s)  # NumPy's numbers too
        if not 1 <= rate < float("inf"):  # less than a byte a second: a typo
            raise ValueError(
                "max_write_bytes_per_s must be a number of bytes per second, at least 1, "
                f"got {bytes_per_s!r}"
            )
        self.bytes_per_s = rate
        self._lock = threading.Lock()
        self._next = 0.0  # when the budget has room again (time.monotonic)

    def take(self, nbytes: int) -> None:
        """Wait until `nbytes` may be written without exceeding the rate on average."""
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + nbytes / self.bytes_per_s
        if start > now:
            time.sleep(start - now)


class _TrackedFile(ChecksummedFile):
    """A ChecksummedFile that tells its destination its record when it closes."""

    def __init__(self, dest: LocalDestination, relpath: str) -> None:
        super().__init__(dest.directory, relpath)
        self._dest = dest

    def close(self) -> None:
        if self._record is None:
            super().close()
            with self._dest._written_lock:
                self._dest._written[self._relpath] = self.record


class Source(abc.ABC):
    """Where a restore reads one item's files from: a directory on disk, a prefix in a bucket.

    Reads are bounded by what the manifest says: `read` and `readinto` never take more than
    the expected size plus one byte, so a file that grew (or a crafted one) is found too long
    without being read whole. `StoredItem` turns what they raise into CorruptCheckpointError.
    Threads: every method may be called from several threads at once.
    """

    #: whether `size` is cheap (a stat), so that `StoredItem.check_files` is worth its cost.
    cheap_size: bool = True

    @abc.abstractmethod
    def describe(self, relpath: str) -> str:
        """Where `relpath` is, for messages (a path or a URL)."""

    @abc.abstractmethod
    def size(self, relpath: str) -> int:
        """The file's size; FileNotFoundError if absent, CorruptCheckpointError if it is a link
        or not a regular file."""

    @abc.abstractmethod
    def read(self, relpath: str, size: int) -> bytes:
        """The file's bytes, at most `size` + 1 of them; FileNotFoundError if absent."""

    def readinto(self, relpath: str, buffers: Sequence[memoryview]) -> int:
        """Fill `buffers` in order from the file; the bytes read (at most their total + 1)."""
        data = self.read(relpath, sum(b.nbytes for b in buffers))
        _scatter(data, buffers)
        return len(data)

    def read_at(self, relpath: str, size: int, offset: int, nbytes: int) -> bytes:
        """`nbytes` bytes of the file (of `size` bytes, as the manifest says) from `offset`, or
        fewer where it ends before. This default reads the whole file; sources that can read a
        range do."""
        data = self.read(relpath, size)
        if len(data) != size:
            raise CorruptCheckpointError(
                f"{self.describe(relpath)} has {len(data)} bytes, the manifest says {size}"
            )
        return data[offset : offset + nbytes]

    def readinto_at(
        self, relpath: str, size: int, offset: int, buffers: Sequence[memoryview]
    ) -> int:
        """Fill `buffers` in order from the file (of `size` bytes) at `offset`; the bytes read."""
        data = self.read_at(relpath, size, offset, sum(b.nbytes for b in buffers))
        return _scatter(data, buffers)

    @abc.abstractmethod
    def local_directory(self, relpaths: Sequence[str]) -> Path:
        """A local directory holding (at least) `relpaths`: the item's own on disk, a
        download of them for an object store (unverified; check what is read)."""


class LocalSource(Source):
    """An item's directory on a local filesystem. No symbolic link is followed, from the item
    directory down to the file, and anything that is not a regular file is refused."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self._root = str(self.directory)
        self._real_dirs: set[str] = set()  # relative directories known not to be links

    def describe(self, relpath: str) -> str:
        return str(self.directory / relpath)

    def local_directory(self, relpaths: Sequence[str] = ()) -> Path:
        return self.directory

    def _check_dirs(self, relpath: str) -> str:
        """The file's path, after checking that no directory on its way is a link (each
        directory once per source); FileNotFoundError where one is a file."""
        parts = relpath.split("/")
        for depth in range(len(parts)):
            rel = "/".join(parts[:depth])
            if rel in self._real_dirs:
                continue
            path = os.path.join(self._root, rel) if rel else self._root
            try:
                is_link = stat.S_ISLNK(os.lstat(path).st_mode)
            except NotADirectoryError:
                raise FileNotFoundError(relpath) from None
            if is_link:
                raise CorruptCheckpointError(
                    f"{path} is a symbolic link; cairn reads a checkpoint only from inside its "
                    "directory"
                )
            self._real_dirs.add(rel)
        return os.path.join(self._root, relpath)

    def size(self, relpath: str) -> int:
        path = self._check_dirs(relpath)
        try:
            info = os.lstat(path)
        except NotADirectoryError:  # a directory on the way is a file (or a FIFO)
            raise CorruptCheckpointError(
                f"{self.describe(relpath)}: a directory on its way is not a directory"
            ) from None
        if stat.S_ISLNK(info.st_mode):
            raise CorruptCheckpointError(
                f"{self.describe(relpath)} is a symbolic link; cairn reads a checkpoint only "
                "from inside its directory"
            )
        if not stat.S_ISREG(info.st_mode):
            raise CorruptCheckpointError(
                f"{self.describe(relpath)} is not a regular file "
                f"(mode {stat.filemode(info.st_mode)})"
            )
        return info.st_size

    def open(self, relpath: str, size: int) -> int:
        """A read-only descriptor of the file, checked on the descriptor (what is checked is
        what is read) to be a regular file of `size` bytes."""
        path = self._check_dirs(relpath)
        try:
            fd = open_regular(path)
        except NotADirectoryError:
            raise CorruptCheckpointError(
                f"{self.describe(relpath)}: a directory on its way is not a directory"
            ) from None
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise CorruptCheckpointError(
                f"{self.describe(relpath)} is a symbolic link; cairn reads a checkpoint only "
                "from inside its directory"
            ) from None
        found = os.fstat(fd).st_size
        if found != size:
            os.close(fd)
            raise CorruptCheckpointError(
                f"{self.describe(relpath)} has {found} bytes, the manifest says {size}"
            )
        return fd

    def read(self, relpath: str, size: int) -> bytes:
        with os.fdopen(self.open(relpath, size), "rb") as f:
            return f.read(size + 1)

    def readinto(self, relpath: str, buffers: Sequence[memoryview]) -> int:
        views = [memoryview(b).cast("B") for b in buffers]
        fd = self.open(relpath, sum(v.nbytes for v in views))
        try:
            total = 0
            while views:
                n = os.readv(fd, views)
                if n == 0:
                    break
                total += n
                while views and n >= views[0].nbytes:
                    n -= views[0].nbytes
                    views.pop(0)
                if views and n:
                    views[0] = views[0][n:]
            return total + len(os.read(fd, 1))
        finally:
            os.close(fd)

    def readinto_at(
        self, relpath: str, size: int, offset: int, buffers: Sequence[memoryview]
    ) -> int:
        fd = self.open(relpath, size)  # checked on the descriptor: what is read is what is checked
        try:
            views, total = [memoryview(b).cast("B") for b in buffers], 0
            while views:
                n = os.preadv(fd, views[:_IOV_MAX], offset + total)
                if n == 0:
                    break
                total += n
                while views and n >= views[0].nbytes:
                    n -= views[0].nbytes
                    views.pop(0)
                if views and n:
                    views[0] = views[0][n:]
            return total
        finally:
            os.close(fd)


def _scatter(data: bytes | memoryview, buffers: Sequence[memoryview]) -> int:
    """Copy `data` into `buffers` in order, as far as it goes; the bytes copied."""
    flat, at = np.frombuffer(data, np.uint8), 0
    for buffer in buffers:
        n = min(memoryview(buffer).nbytes, flat.size - at)
        # np.copyto releases the GIL (a memoryview slice assignment does not): reads of
        # several chunks at once copy in parallel.
        np.copyto(np.frombuffer(buffer, np.uint8, n), flat[at : at + n])
        at += n
    return at


@dataclasses.dataclass(frozen=True)
class StoredItem:
    """What a handler's restore and describe get: one item of one committed step.

    `files` maps each path (relative to the item) to the record the write phase returned;
    `read_bytes` and `read_into` verify against it and raise CorruptCheckpointError naming
    step, item and file. `source` is where the files are (a `Source`; a local directory given
    as a path is read through `LocalSource`).
    """

    source: Source
    files: Mapping[str, FileRecord]
    step: int | None = None
    name: str = ""
    _checked: set[str] = dataclasses.field(  # the prefixes `check_files` has checked
        default_factory=set, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if not isinstance(self.source, Source):
            object.__setattr__(self, "source", LocalSource(self.source))

    @property
    def directory(self) -> Path:
        """A local directory with the item's files: for handlers that read through a library
        that wants a path. For an object store this downloads every file of the item first;
        prefer `read_bytes` and `read_into`, which read only what is asked."""
        return self.source.local_directory(sorted(self.files))

    def _where(self) -> str:
        return (f"step {self.step}, " if self.step is not None else "") + f"item {self.name!r}: "

    def describe_file(self, relpath: str) -> str:
        return f"{self._where()[:-2]}, file {self.source.describe(relpath)}"

    def _record(self, relpath: str) -> FileRecord:
        record = self.files.get(relpath)
        if record is None:
            raise CorruptCheckpointError(f"{self.describe_file(relpath)} is not in the manifest")
        return record

    @contextlib.contextmanager
    def _reading(self, relpath: str) -> Iterator[None]:
        """What reading a file raises, as CorruptCheckpointError naming the file."""
        try:
            yield
        except (FileNotFoundError, NotADirectoryError):
            raise CorruptCheckpointError(f"{self.describe_file(relpath)} is missing") from None
        except CorruptCheckpointError as e:  # the source's message names the file
            raise CorruptCheckpointError(f"{self._where()}{e}") from None
        except OSError as e:
            raise CorruptCheckpointError(
                f"{self.describe_file(relpath)} cannot be read: {e}"
            ) from None

    def check_files(self, prefix: str = "") -> None:
        """Every recorded file under `prefix` exists with its recorded size (a stat, no read).

        For failing early, before anything is parsed or allocated. A symbolic link anywhere on
        the way (the item directory, a subdirectory, the file) is refused: a checkpoint is read
        from inside its own directory only. Where sizes cost a request each (object stores),
        sizes are checked only when the files under `prefix` say they hold at least half this
        host's memory (what a restore would allocate for them could fail or exhaust it), and
        then only those of at least `PROBE_MIN` bytes, each by reading its last byte (ranged
        GETs, several at once): so a crafted record cannot make a restore allocate what the
        bucket does not hold, and smaller restores make no extra request (every read checks
        size and content anyway).
        """
        if "" in self._checked or prefix in self._checked:
            return
        names = self._sorted_names
        under = []
        for relpath in names[bisect.bisect_left(names, prefix) :]:
            if not relpath.startswith(prefix):
                break
            under.append(relpath)
        if not self.source.cheap_size:
            big = [r for r in under if self.files[r].size >= PROBE_MIN]
            if sum(self.files[r].size for r in under) < _physical_memory() // 2:
                big = []
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                list(pool.map(self._probe, big))
            self._checked.add(prefix)
            return
        for relpath in under:
            record = self.files[relpath]
            with self._reading(relpath):
                size = self.source.size(relpath)
            if size != record.size:
                raise CorruptCheckpointError(
                    f"{self.describe_file(relpath)} has {size} bytes, the manifest says {record.size}"
                )
        self._checked.add(prefix)  # not done again for the next leaf, nor after the item's

    def _probe(self, relpath: str) -> None:
        """A file of a source without cheap sizes holds its recorded size: its last byte."""
        size = self.files[relpath].size
        with self._reading(relpath):
            last = self.source.read_at(relpath, size, size - 1, 1)
        if len(last) != 1:
            raise CorruptCheckpointError(
                f"{self.describe_file(relpath)} is shorter than the manifest's {size} bytes"
            )

    @functools.cached_property
    def _sorted_names(self) -> list[str]:
        return sorted(self.files)

    def open_file(self, relpath: str) -> int:
        """A read-only descriptor of a recorded file in a local directory, after the checks of
        `check_files`; the caller closes it and checks what it reads with
        ``files[relpath].check``. TypeError for a source that is not local: use `read_into`."""
        record = self._record(relpath)
        if not isinstance(self.source, LocalSource):
            raise TypeError(f"{self.describe_file(relpath)} is not on a local filesystem")
        with self._reading(relpath):
            return self.source.open(relpath, record.size)

    def read_bytes(self, relpath: str) -> bytes:
        """The whole content of a recorded file, checked against its record."""
        record = self._record(relpath)
        with self._reading(relpath):
            data = self.source.read(relpath, record.size)
        record.check(data, self.describe_file(relpath))
        return data

    def check_file(
        self,
        relpath: str,
        checked: dict[tuple[int, ...], str] | None = None,
        parts: Sequence[tuple[str, int, int, str]] = (),
    ) -> list[str]:
        """Read a recorded file and check it against its record (CorruptCheckpointError naming
        it). `checked`, a dict kept across calls, lets a local file that several steps share (an
        incremental save's hard link) be read once: a file found intact is noted there by the
        device, inode, size and mtime of the descriptor read, and the same unchanged inode
        recorded with the same content hash is not read again.

        `parts` are ranges of the file that must hold content of their own, (name, offset,
        bytes, XXH3-128): the chunks a pack's index places in it, checked on the same read (and
        noted in `checked` alike). Those that do not hold are returned, each named."""
        record = self._record(relpath)
        key: tuple[int, ...] | None = None
        if checked is None or record.xxh3_128 is None or not isinstance(self.source, LocalSource):
            data = self.read_bytes(relpath)
        else:
            with self._reading(relpath):
                fd = self.source.open(relpath, record.size)
            with os.fdopen(fd, "rb") as f:
                info = os.fstat(fd)
                key = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
                known = checked.get(key) == record.xxh3_128
                if known and all(checked.get((*key, p[1], p[2])) == p[3] for p in parts):
                    return []
                with self._reading(relpath):
                    data = f.read(record.size + 1)
            if not known:
                record.check(data, self.describe_file(relpath))
            checked[key] = record.xxh3_128
        problems = []
        view = memoryview(data)
        for name, offset, nbytes, digest in parts:
            if (
                offset + nbytes > len(data)
                or content_hash(view[offset : offset + nbytes]) != digest
            ):
                problems.append(self.chunk_problem(relpath, name, offset, nbytes))
            elif checked is not None and key is not None:
                checked[(*key, offset, nbytes)] = digest
        return problems

    def chunk_problem(self, relpath: str, name: str, offset: int, nbytes: int) -> str:
        """What `check_file` and the packed layout's checks say of a chunk `name` that bytes
        `offset`..`offset + nbytes` of the pack `relpath` do not hold."""
        return (
            f"{self.describe_file(relpath)}, chunk {name} (bytes {offset}..{offset + nbytes}) "
            f"{NOT_THE_CHUNK}"
        )

    def read_range(
        self, relpath: str, offset: int, buffers: memoryview | Sequence[memoryview]
    ) -> None:
        """Fill `buffers` (one, or several in order) from byte `offset` of a recorded file (a
        range that the manifest's size for the file must hold); the caller checks the content."""
        views = [buffers] if isinstance(buffers, memoryview) else list(buffers)
        record = self._record(relpath)
        nbytes = sum(v.nbytes for v in views)
        if offset < 0 or offset + nbytes > record.size:
            raise CorruptCheckpointError(
                f"{self.describe_file(relpath)}: bytes {offset}..{offset + nbytes} are outside "
                f"its {record.size} bytes"
            )
        with self._reading(relpath):
            got = self.source.readinto_at(relpath, record.size, offset, views)
        if got != nbytes:
            raise CorruptCheckpointError(
                f"{self.describe_file(relpath)} ends before byte {offset + nbytes}"
            )

    def read_into(self, relpath: str, buffers: Sequence[memoryview]) -> None:
        """Read a recorded file into `buffers` (whose sizes add up to the file's) and check its
        size; the caller checks the content (its hash, over the same buffers)."""
        record = self._record(relpath)
        total = sum(memoryview(b).nbytes for b in buffers)
        if total != record.size:
            raise ValueError(
                f"{self.describe_file(relpath)}: buffers of {total} bytes for {record.size}"
            )
        with self._reading(relpath):
            got = self.source.readinto(relpath, buffers)
        if got != record.size:
            raise CorruptCheckpointError(
                f"{self.describe_file(relpath)} has {'more' if got > record.size else got} "
                f"bytes, the manifest says {record.size}"
            )
