"""Writing a step's files: the `Destination` a write phase writes through (and what an incremental
save reuses of the previous step), `BufferedFile` and `write_file`.
"""

from __future__ import annotations

import abc
import dataclasses
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import xxhash

from cairn.handlers._files.localio import ChecksummedFile, hash_file
from cairn.handlers._files.records import CONTENT_HASH, Buffer, FileRecord, Ranges, check_relative
from cairn.handlers._files.source import Source, StoredItem
from cairn.handlers._files.threads import WriteBudget

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

    @property
    def incremental(self) -> bool:
        """Whether this is an incremental save's destination (`reuse` was called): what it
        writes, the next incremental save of its directory may reuse."""
        return self._incremental

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


def write_file(root: Path | Destination, relpath: str, data: Buffer) -> FileRecord:
    """Write `data` to `root/relpath` (which must not exist) and return its record.

    `root` is a write phase's `Destination` (the file goes wherever the checkpoint is: a
    directory, a bucket) or a local directory."""
    if isinstance(root, Destination):
        return root.write_file(relpath, data)
    with ChecksummedFile(root, relpath) as f:
        f.write(data)
    return f.record
