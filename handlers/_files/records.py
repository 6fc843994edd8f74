"""What identifies a file of a checkpoint: `FileRecord` (path, size, content hash), the content
hash itself (`content_hash`, `RangeHashes` for a file and ranges of it on one read), and the
checks on what is read from a checkpoint (`parse_json`, `check_relative`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

import crc32c
import xxhash

from cairn.handlers.errors import CorruptCheckpointError

log = logging.getLogger("cairn")


CONTENT_HASH = "xxh3_128"
_HEX128 = re.compile(r"[0-9a-f]{32}")


NOT_THE_CHUNK = "is not the chunk the index records (its content hash differs)"


def content_hash(data: bytes | bytearray | memoryview) -> str:
    """The 128-bit content hash a format-2 file record carries: XXH3-128, 32 lowercase hex digits."""
    return xxhash.xxh3_128_hexdigest(data)


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


Buffer = bytes | bytearray | memoryview


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
