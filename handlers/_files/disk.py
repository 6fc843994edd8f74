"""A step's item on a local disk being written: `LocalDestination` (``writev``, ``O_DIRECT`` for
large aligned buffers, hard links to the previous step's unchanged files) and `KnownFiles`, what
this process knows of files it wrote or hashed.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import math
import mmap
import os
import stat
import threading
from pathlib import Path
from typing import Any

import numpy as np

from cairn.handlers._files.destination import BufferedFile, Destination
from cairn.handlers._files.localio import ChecksummedFile, _hash_fd
from cairn.handlers._files.records import RangeHashes, Ranges
from cairn.handlers._files.source import LocalSource, Source
from cairn.handlers._files.threads import _libc
from cairn.handlers.errors import CorruptCheckpointError

log = logging.getLogger("cairn")


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

    def __init__(self, directory: str | os.PathLike[str], pool: PagePool | None = None) -> None:
        super().__init__()
        self.directory = Path(directory)
        self._pool = pool
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

    def _target(self, relpath: str) -> Path:
        self._parent(relpath)
        return self.directory / relpath

    def _open(self, relpath: str) -> int:
        return os.open(self._target(relpath), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)

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
        size = sum(v.nbytes for v in pieces)
        fd = self._pool.take(size, self._target(relpath)) if self._pool is not None else None
        if fd is None:
            fd = self._open(relpath)
        try:
            if self._pool is not None:
                os.ftruncate(fd, size)  # a file written over: its length is this one's
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


class PagePool:
    """The files of deleted steps on a RAM disk, kept for the next steps' files to be written
    over (`LocalDestination`): a tmpfs file's pages are memory, and writing over them spares
    the kernel allocating, zeroing and charging fresh pages for every save and freeing the
    deleted step's (0.25 s against 0.17 s and 0.05 s for 512 MiB here, idle). Only files this
    process may own alone go in (`keep`); the pool holds the files of the last step deleted
    (others unused by then are removed), in `directory`, which the storage removes at its open.
    Thread-safe: the reclaim thread keeps, writer threads take."""

    MIN_BYTES = 1 << 20  # smaller files: not worth a rename

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._files: list[tuple[int, str]] = []  # (size, path), sorted

    def keep(self, deleted: Path) -> None:
        """Move the files of the deleted step `deleted` (renamed out of the steps: no reader
        looks there) that may be written over into the pool: regular files of at least
        `MIN_BYTES`, with no other link (a link elsewhere would change with them), owned by
        this user and writable by no one else. The rest stays for the caller to remove."""
        self.directory.mkdir(exist_ok=True)
        with self._lock:
            stale, self._files = self._files, []
        for _, path in stale:
            _unlink_quietly(path)
        kept: list[tuple[int, str]] = []
        for top, _, names in os.walk(deleted):  # never into a link to a directory
            for name in names:
                path = os.path.join(top, name)
                try:
                    info = os.lstat(path)
                    if (
                        not stat.S_ISREG(info.st_mode)
                        or info.st_nlink != 1
                        or info.st_size < self.MIN_BYTES
                        or info.st_uid != os.geteuid()
                        or info.st_mode & 0o022
                    ):
                        continue
                    pooled = str(self.directory / f"{len(kept)}.{info.st_ino}")
                    os.rename(path, pooled)
                except OSError as e:  # left where it is, for the caller to remove
                    log.warning("cairn: %s is freed, not written over: %s", path, e)
                    continue
                kept.append((info.st_size, pooled))
        with self._lock:
            self._files = sorted(kept)

    def take(self, size: int, target: Path) -> int | None:
        """A file of the pool (the smallest of at least `size` bytes, else the largest) made
        `target` (which must not exist: FileExistsError), open for writing over; None where
        the pool has none or it cannot be used (then nothing was made)."""
        if size < self.MIN_BYTES:
            return None
        with self._lock:
            if not self._files:
                return None
            at = next((i for i, (n, _) in enumerate(self._files) if n >= size), -1)
            _, path = self._files.pop(at)
        try:
            os.link(path, target, follow_symlinks=False)
        except FileExistsError:
            _unlink_quietly(path)
            raise
        except OSError:
            _unlink_quietly(path)
            return None
        _unlink_quietly(path)
        try:
            fd = os.open(target, os.O_WRONLY | os.O_NOFOLLOW)
        except OSError:
            _unlink_quietly(str(target))
            return None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:  # changed meanwhile
            os.close(fd)
            _unlink_quietly(str(target))
            return None
        return fd

    def clear(self) -> None:
        """Free every file of the pool (the manager's close)."""
        with self._lock:
            stale, self._files = self._files, []
        for _, path in stale:
            _unlink_quietly(path)
        with contextlib.suppress(OSError):  # not made, or not empty: the next open removes it
            self.directory.rmdir()


def _unlink_quietly(path: str) -> None:
    """Unlink `path`; one gone already is not said (`keep` may free a file a writer took)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("cairn: could not remove %s: %s", path, e)


def in_memory_directory(directory: Path) -> bool:
    """Whether `directory` is on a RAM disk (tmpfs, ramfs)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return _in_memory_filesystem(fd, os.fstat(fd).st_dev)
    finally:
        os.close(fd)


def as_destination(target: Destination | str | os.PathLike[str]) -> Destination:
    """A write phase's argument as a `Destination`: a local directory given as a path (a test,
    or code that calls a snapshot's write itself) becomes a `LocalDestination`."""
    return target if isinstance(target, Destination) else LocalDestination(target)


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


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype, align: int = DIRECT_ALIGN) -> np.ndarray:
    """An uninitialised array whose data starts on an `align`-byte boundary: a page by default,
    so that a `LocalDestination` writes it with ``O_DIRECT`` (a buffer from ``np.empty`` starts
    16 bytes into its pages, and a 512 MiB file written from one through the page cache cost
    0.9 s of kernel CPU here, against 0.01 s with ``O_DIRECT``)."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def read_direct(fd: int, size: int, into: np.ndarray) -> memoryview:
    """The first `size` bytes of the file `fd`, read into `into` (uint8, page-aligned, at least
    `size` rounded up to a page long: ``O_DIRECT`` reads whole blocks) with ``O_DIRECT``, from
    the disk to this memory with no page of the page cache made for it (a file written with
    ``O_DIRECT`` is not cached, and reading it through the page cache cost 1.3 s of kernel CPU
    per 512 MiB here); through the page cache where the filesystem refuses ``O_DIRECT``.
    EOFError if the file ends first."""
    whole = -(-size // DIRECT_ALIGN) * DIRECT_ALIGN
    if into.nbytes < whole or _address(into.data) % DIRECT_ALIGN:
        raise ValueError(f"{into.nbytes} bytes at {_address(into.data):#x} for a read of {size}")
    flags = _direct_on(fd)  # None once reading through the page cache
    try:
        at, view = 0, into[:whole].data
        while at < size:
            try:
                n = os.preadv(fd, [view[at : at + _DIRECT_PIECE]], at)
            except OSError as e:
                if flags is None or e.errno != errno.EINVAL:
                    raise
                if at == 0:  # refused at the first read (some filesystems do)
                    _NO_DIRECT_DEVICES.add(os.fstat(fd).st_dev)
                fcntl.fcntl(fd, fcntl.F_SETFL, flags)  # (or a short read left `at` off a block)
                flags = None
                continue
            if n == 0:
                raise EOFError(f"the file ended at byte {at} of {size}")
            at += n
    finally:
        if flags is not None:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    return into[:size].data


def resident(fd: int, size: int) -> bool:
    """Whether every page of the first `size` bytes of the file `fd` is in memory: in the page
    cache, or on a RAM disk (tmpfs), whose files are only there. Such a file is sent to a
    socket with ``sendfile`` for the cost of handing its pages over: 0.09-0.15 s of CPU for
    512 MiB on tmpfs here, against 0.35-0.48 s read into memory with `read_direct` first; a file
    that is not would be read into the page cache on the way (1.3 s of kernel CPU per 512 MiB
    here)."""
    try:
        stat = os.fstat(fd)
        if stat.st_size < size:
            return False
        if _in_memory_filesystem(fd, stat.st_dev):  # no page of it to count: 0.09 s per
            return True  # 512 MiB here, beside a restore's reads
        return resident_pages(fd, size) == -(-size // mmap.PAGESIZE)
    except (OSError, ValueError):  # not a file that maps
        return False


_TMPFS_MAGIC, _RAMFS_MAGIC = 0x01021994, 0x858458F6  # linux/magic.h
_IN_MEMORY_DEVICES: dict[int, bool] = {}  # st_dev -> whether a RAM disk (tmpfs, ramfs)


def _in_memory_filesystem(fd: int, device: int) -> bool:
    """Whether the file `fd` (on `device`) is on a RAM disk: its filesystem's type, fstatfs(2),
    asked once per device."""
    known = _IN_MEMORY_DEVICES.get(device)
    if known is None:
        buffer = ctypes.create_string_buffer(256)  # struct statfs: f_type first, a long
        if _libc().fstatfs(fd, buffer) != 0:
            raise OSError(ctypes.get_errno(), "fstatfs")
        kind = ctypes.c_ulong.from_buffer(buffer).value & 0xFFFFFFFF
        known = _IN_MEMORY_DEVICES[device] = kind in (_TMPFS_MAGIC, _RAMFS_MAGIC)
    return known


def resident_pages(fd: int, size: int) -> int:
    """How many pages of the first `size` bytes of the file `fd` are in memory (mincore(2) over
    a mapping of it; nothing is read)."""
    if size <= 0:
        return 0
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mapped:
        data = np.frombuffer(mapped, np.uint8)
        vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
        rc = _libc().mincore(ctypes.c_void_p(data.ctypes.data), ctypes.c_size_t(size), vec)
        del data  # (a mapping closes only once no view of it is left)
    if rc != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return int(np.count_nonzero(np.ctypeslib.as_array(vec) & 1))


def _direct_on(fd: int) -> int | None:
    """Turn ``O_DIRECT`` on for `fd`: its flags before (the caller sets them back), or None
    where its filesystem refuses ``O_DIRECT`` (asked once per device, then remembered)."""
    device = os.fstat(fd).st_dev
    if not _O_DIRECT or device in _NO_DIRECT_DEVICES:
        return None
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | _O_DIRECT)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
        _NO_DIRECT_DEVICES.add(device)
        return None
    return flags


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, np.uint8).__array_interface__["data"][0])


def _direct_candidate(view: memoryview) -> bool:
    return bool(_O_DIRECT) and view.nbytes >= DIRECT_MIN and _address(view) % DIRECT_ALIGN == 0


def _write_direct(fd: int, view: memoryview) -> int:
    """Write `view` (page aligned, whole pages) at the start of `fd` with ``O_DIRECT``; the bytes
    written, short of all of them where the filesystem refuses it (then ``O_DIRECT`` is off
    again and the caller writes the rest through the page cache)."""
    flags = _direct_on(fd)
    if flags is None:
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
        _NO_DIRECT_DEVICES.add(os.fstat(fd).st_dev)  # refused at the first write (some do)
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    return done
