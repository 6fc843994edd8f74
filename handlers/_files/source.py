"""Reading a step's files: the `Source` protocol, `LocalSource` (a directory, no link followed) and
`StoredItem`, what a handler's restore gets, whose reads are checked against the manifest.
"""

from __future__ import annotations

import abc
import bisect
import concurrent.futures
import contextlib
import dataclasses
import errno
import functools
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

from cairn.handlers._files.localio import open_regular
from cairn.handlers._files.records import NOT_THE_CHUNK, FileRecord, check_relative, content_hash
from cairn.handlers.errors import CorruptCheckpointError

PROBE_MIN = 1 << 20  # files of an object store whose size `StoredItem.check_files` checks


@functools.cache
def _physical_memory() -> int:
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        return 1 << 34


_IOV_MAX = 1024  # buffers one preadv takes (Linux's UIO_MAXIOV)


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

    def view(self, relpath: str, offset: int, nbytes: int) -> memoryview | None:
        """`nbytes` bytes of the file from `offset`, as memory the source holds and keeps
        unchanged (not a copy), or None where it holds none: every source but `MemorySource`."""
        return None

    def hashed(self, relpath: str) -> bool:
        """Whether the file's whole content was checked against its record already, in the
        memory `view` gives (a part's file hashed as it arrived): its reads need no check."""
        return False

    @abc.abstractmethod
    def local_directory(self, relpaths: Sequence[str]) -> Path:
        """A local directory holding (at least) `relpaths`: the item's own on disk, a
        download of them for an object store (unverified; check what is read)."""

    def release(self) -> None:
        """Free what `local_directory` made for this source (a download), once the restore that
        used it is done; nothing by default. The manager calls it after each item's restore."""
        return


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


class MemorySource(Source):
    """An item's files held in memory (a part sent back for a restore): a handler reads them as
    it reads a directory's, every read a copy out of them, checked by the reader as any other."""

    def __init__(
        self, files: Mapping[str, memoryview], where: str, hashed: Iterable[str] = ()
    ) -> None:
        """`hashed`: the files whose whole content was checked against the records the reader
        holds (`Source.hashed`)."""
        self._files, self._where = files, where
        self._hashed = frozenset(hashed)
        self._local: Path | None = None

    def describe(self, relpath: str) -> str:
        return f"{self._where}/{relpath}"

    def _view(self, relpath: str) -> memoryview:
        view = self._files.get(relpath)
        if view is None:
            raise FileNotFoundError(self.describe(relpath))
        return view

    def size(self, relpath: str) -> int:
        return self._view(relpath).nbytes

    def read(self, relpath: str, size: int) -> bytes:
        return bytes(self._view(relpath)[: size + 1])

    def read_at(self, relpath: str, size: int, offset: int, nbytes: int) -> bytes:
        return bytes(self._view(relpath)[offset : offset + nbytes])

    def readinto_at(
        self, relpath: str, size: int, offset: int, buffers: Sequence[memoryview]
    ) -> int:
        total = sum(memoryview(b).nbytes for b in buffers)
        return _scatter(self._view(relpath)[offset : offset + total], buffers)

    def view(self, relpath: str, offset: int, nbytes: int) -> memoryview | None:
        data = self._view(relpath)
        return data[offset : offset + nbytes] if offset + nbytes <= data.nbytes else None

    def hashed(self, relpath: str) -> bool:
        return relpath in self._hashed

    def readinto(self, relpath: str, buffers: Sequence[memoryview]) -> int:
        view = self._view(relpath)
        return self.readinto_at(relpath, view.nbytes, 0, buffers) + (
            view.nbytes > sum(memoryview(b).nbytes for b in buffers)
        )

    def local_directory(self, relpaths: Sequence[str] = ()) -> Path:
        """The files written into a private temporary directory (`release` removes it), for
        handlers that read through a library that wants a path."""
        if self._local is None:
            self._local = Path(tempfile.mkdtemp(prefix="cairn-part-"))
        for relpath in relpaths:
            check_relative(relpath)
            target = self._local / relpath
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(self._view(relpath))
        return self._local

    def release(self) -> None:
        if self._local is not None:
            shutil.rmtree(self._local, ignore_errors=True)
            self._local = None


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
        nbytes = sum(v.nbytes for v in views)
        record = self._range(relpath, offset, nbytes)
        with self._reading(relpath):
            got = self.source.readinto_at(relpath, record.size, offset, views)
        if got != nbytes:
            raise CorruptCheckpointError(
                f"{self.describe_file(relpath)} ends before byte {offset + nbytes}"
            )

    def view_range(self, relpath: str, offset: int, nbytes: int) -> memoryview | None:
        """`nbytes` bytes from byte `offset` of a recorded file as the memory its source holds
        them in (`Source.view`: a part sent back by a peer), not copied; None where the source
        holds none (read them with `read_range`). The caller checks the content."""
        self._range(relpath, offset, nbytes)
        with self._reading(relpath):
            return self.source.view(relpath, offset, nbytes)

    def _range(self, relpath: str, offset: int, nbytes: int) -> FileRecord:
        """The file's record, where the range lies within its recorded size."""
        record = self._record(relpath)
        if offset < 0 or offset + nbytes > record.size:
            raise CorruptCheckpointError(
                f"{self.describe_file(relpath)}: bytes {offset}..{offset + nbytes} are outside "
                f"its {record.size} bytes"
            )
        return record

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
