"""The packed layout of a train state: chunks in a few large files, found through an index.

Layout of one item (``TrainStateHandler(layout="packed")``, docs/format.md)::

    tree.json                   as in the zarr layout (each leaf's `f` names its chunks)
    packs/<p>.<save>.<n>        process p's chunks, one after the other (zeros between some)
    packs/index.<p>.json        for each chunk process p wrote: pack, offset, bytes, XXH3-128

A chunk is named as in the zarr layout (``arrays/<i>/<c0>.<c1>``, a *virtual* path: no such
file exists) and holds the raw little-endian bytes, without the zarr layout's crc32c tail. The
manifest records each pack and index file whole, as every file; the index binds each chunk's
bytes to its place (its content hash), so a restore that reads part of a pack checks what it
reads. A pack holds whole chunks, up to `Destination.pack_bytes` (64 MiB on disk, 16 MiB in a
bucket; one larger chunk has a pack of its own).

Why: a step of the zarr layout is two files and a directory per leaf; creating, writing and
syncing them cost a commit more than the bytes do for states of many small leaves. A packed step
is about ``state / PACK_BYTES`` files, each written in one piece (``O_DIRECT`` from the staging
pool on disk), and an incremental save links whole packs of the previous step.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import json
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import xxhash

from cairn.handlers._files import NOT_THE_CHUNK, Destination, FileRecord, StoredItem, parse_json
from cairn.handlers._staging import PAGE, round_up
from cairn.handlers.errors import CorruptCheckpointError

PACKS = "packs/"
PACK_BYTES = 64 << 20  # the largest pack on disk (`Destination.pack_bytes`; 16 MiB in a bucket)
_MiB = 1 << 20
_HASH_BLOCK = 16 * _MiB  # see write_pack
_HOLD_GIL_UP_TO = _MiB  # a chunk this small is hashed without letting go of the GIL (_update)
_GIL_SLICE = 64 << 10
_INDEX = re.compile(r"packs/index\.(0|[1-9][0-9]{0,8})\.json")
_HEX = re.compile(r"[0-9a-f]{32}")


@dataclasses.dataclass(frozen=True)
class Packed:
    """Where one chunk is: `nbytes` bytes at `offset` of the pack file `pack` (whose manifest
    record is `pack_record`, what an incremental save links), with content hash `xxh3_128`."""

    pack_record: FileRecord
    offset: int
    nbytes: int
    xxh3_128: str

    @property
    def pack(self) -> str:
        return self.pack_record.path


def index_name(process: int) -> str:
    return f"{PACKS}index.{process}.json"


def is_packed(stored: StoredItem) -> bool:
    """Whether an item is in the packed layout (its manifest lists an index file)."""
    return any(_INDEX.fullmatch(path) for path in stored.files)


# --------------------------------------------------------------------------- writing


@dataclasses.dataclass
class _Pack:
    """One pack being assembled: its pieces and its chunks (vpath, offset, bytes)."""

    pieces: list[memoryview] = dataclasses.field(default_factory=list)
    chunks: list[tuple[str, int, int]] = dataclasses.field(default_factory=list)  # vpath, at, n
    size: int = 0
    keep: list[Any] = dataclasses.field(default_factory=list)  # arrays the pieces view

    def add(self, vpath: str, data: memoryview) -> None:
        """Append a chunk, tight (only staged chunks, written with O_DIRECT, need alignment)."""
        self.pieces.append(data)
        self.chunks.append((vpath, self.size, data.nbytes))
        self.size += data.nbytes


def group(sizes: Sequence[tuple[Any, int]], limit: int = PACK_BYTES) -> list[list[Any]]:
    """Consecutive items (each with its bytes) in groups of at most `limit` bytes (4 KiB
    aligned), a larger item alone."""
    groups: list[list[Any]] = []
    total = 0
    for item, nbytes in sizes:
        if not groups or (total and round_up(total) + nbytes > limit):
            groups.append([])
            total = 0
        groups[-1].append(item)
        total = round_up(total) + nbytes
    return groups


def group_staged(
    staged: Sequence[tuple[str, int, int]], limit: int
) -> list[list[tuple[str, int, int]]]:
    """Staged chunks (path, slab offset, bytes; in slab order) in packs of at most `limit`
    bytes of the slab each (one larger chunk alone). With `limit` the `PACK_BYTES` that the
    train state's staging used (`_train_state.staging._stage_layout`), each pack starts where staging
    put a page boundary, or where a chunk before it was left out (an unchanged chunk of an
    incremental save)."""
    packs: list[list[tuple[str, int, int]]] = []
    start = 0
    for chunk in staged:
        at, nbytes = chunk[1], chunk[2]
        if not packs or at + nbytes - start > limit:
            packs.append([])
            start = at
        packs[-1].append(chunk)
    return packs


def staged_pack(slab: np.ndarray, chunks: Sequence[tuple[str, int, int]]) -> _Pack:
    """A pack of staged chunks (vpath, slab offset, bytes; in slab order): spans of the slab,
    chunks that follow each other in the slab (at most a page apart) in one span, so that a
    pack of a whole save is written from the slab in one piece, with O_DIRECT up to its last
    whole page where its first chunk starts on a page. The bytes between two chunks go into the
    pack as the slab holds them: zeros (staging zeroed them), or a chunk this pack leaves out
    (another process's replica of it, or unchanged, kept where an earlier step put it). The
    slab is only read: the writers of each tier a snapshot feeds read it at once."""
    pack = _Pack()
    spans: list[list[int]] = []  # [start, end) in the slab
    for vpath, at, nbytes in chunks:
        if spans and 0 <= at - spans[-1][1] <= PAGE:
            pack.size += at - spans[-1][1]
            spans[-1][1] = at
        else:
            spans.append([at, at])
        pack.chunks.append((vpath, pack.size, nbytes))
        pack.size += nbytes
        spans[-1][1] = at + nbytes
    pack.pieces = [memoryview(slab[a:b]) for a, b in spans]  # type: ignore[arg-type]
    return pack


def write_pack(
    dest: Destination, name: str, pack: _Pack, digests: Mapping[str, str] | None = None
) -> tuple[FileRecord, dict[str, Packed]]:
    """Write `pack` as one file, and hash each chunk (unless `digests` has it) and the whole
    pack in one pass: after the write, unless the destination needs the hash first (see
    `Destination.write_file`).

    The pass goes a window of `_HASH_BLOCK` bytes at a time: the chunks' parts in the window,
    then the window whole for the pack's hash, while it is still in the cache. Each hash call
    on more than about 100 KB lets go of the GIL, and getting it back costs up to the switch
    interval (5 ms) while the training loop runs Python; so the calls are few and large: one
    per chunk and window it touches and one per window (not one per megabyte, nor one per chunk
    for the pack's hash), and a chunk of at most a megabyte is hashed in slices that keep the
    GIL (`_update`)."""
    known = digests or {}
    found: list[tuple[str, int, int, str]] = []

    def hash_pass() -> str:
        whole = xxhash.xxh3_128()
        flat = _Flat(pack.pieces)
        running = {v: xxhash.xxh3_128() for v, _, _ in pack.chunks if v not in known}
        chunks = pack.chunks  # in pack order, apart
        first = 0  # the first chunk that ends after this window's start
        for lo in range(0, pack.size, _HASH_BLOCK):
            hi = min(pack.size, lo + _HASH_BLOCK)
            for vpath, at, nbytes in itertools.islice(chunks, first, None):
                if at >= hi:
                    break
                if vpath in running:
                    for block in flat.blocks(max(at, lo), min(at + nbytes, hi)):
                        _update(running[vpath], block, hold=nbytes <= _HOLD_GIL_UP_TO)
                if at + nbytes <= hi:
                    first += 1
            for block in flat.blocks(lo, hi):
                whole.update(block)
        for vpath, at, nbytes in chunks:
            digest = known[vpath] if vpath in known else running[vpath].hexdigest()
            found.append((vpath, at, nbytes, digest))
        return whole.hexdigest()

    record = dest.write_file(name, pack.pieces, xxh3_128=hash_pass)
    return record, {vpath: Packed(record, at, n, hexdigest) for vpath, at, n, hexdigest in found}


def _update(digest: Any, block: memoryview, *, hold: bool) -> None:
    """`digest.update(block)`; with `hold`, in slices small enough that python-xxhash keeps the
    GIL (it lets go above about 100 KB), so that a small chunk's hash takes it over no more
    than once: each slice takes a few microseconds, and the GIL taken back costs up to 5 ms."""
    if not hold:
        digest.update(block)
        return
    for at in range(0, block.nbytes, _GIL_SLICE):
        digest.update(block[at : at + _GIL_SLICE])


class _Flat:
    """Byte ranges of a list of pieces, as views of at most `_HASH_BLOCK` bytes."""

    def __init__(self, pieces: Sequence[memoryview]) -> None:
        self.pieces = pieces
        self.starts = list(itertools.accumulate((p.nbytes for p in pieces), initial=0))

    def blocks(self, lo: int, hi: int) -> list[memoryview]:
        out = []
        i = bisect.bisect_right(self.starts, lo) - 1  # not NumPy's: it lets go of the GIL
        while lo < hi and i < len(self.pieces):
            piece, base = self.pieces[i], self.starts[i]
            end = min(hi, base + piece.nbytes)
            for b in range(lo, end, _HASH_BLOCK):
                out.append(piece[b - base : min(end, b + _HASH_BLOCK) - base])
            lo = end
            i += 1
        return out


def save_token() -> str:
    """The part of a save's pack names that no other save has (a linked pack of an earlier step
    keeps its name beside this save's own)."""
    return uuid.uuid4().hex[:12]


def write_index(dest: Destination, process: int, placed: Mapping[str, Packed]) -> FileRecord:
    chunks = {
        vpath: [p.pack, p.offset, p.nbytes, p.xxh3_128] for vpath, p in sorted(placed.items())
    }
    return dest.write_file(index_name(process), json.dumps({"chunks": chunks}).encode())


# --------------------------------------------------------------------------- reading


def load_index(stored: StoredItem, process: int | None = None) -> dict[str, Packed]:
    """Every chunk of a packed item (vpath -> where it is), from all processes' index files (or
    process `process`'s), each checked against its record and entry by entry: a pack the
    manifest lists under ``packs/``, a range inside its recorded size, a content hash; no chunk
    listed twice."""
    out: dict[str, Packed] = {}
    wanted = None if process is None else index_name(process)
    for relpath in sorted(p for p in stored.files if _INDEX.fullmatch(p)):
        if wanted is not None and relpath != wanted:
            continue
        where = stored.describe_file(relpath)
        index = parse_json(stored.read_bytes(relpath), where)
        chunks = index.get("chunks") if isinstance(index, dict) else None
        if not isinstance(chunks, dict):
            raise CorruptCheckpointError(f"{where}: not an index of chunks")
        for vpath, entry in chunks.items():
            if vpath in out:
                raise CorruptCheckpointError(f"{where}: chunk {vpath!r} is listed twice")
            out[vpath] = _entry(stored, where, vpath, entry)
    return out


def chunks_by_pack(stored: StoredItem) -> dict[str, list[tuple[str, int, int, str]]]:
    """For ``verify``: each pack of a packed item and the chunks its indexes place in it, as
    `StoredItem.check_file` takes them (vpath, offset, bytes, XXH3-128; in offset order); {}
    for an item of another layout. CorruptCheckpointError where an index does not load
    (`load_index`)."""
    out: dict[str, list[tuple[str, int, int, str]]] = {}
    if is_packed(stored):
        for vpath, p in load_index(stored).items():
            out.setdefault(p.pack, []).append((vpath, p.offset, p.nbytes, p.xxh3_128))
    for chunks in out.values():
        chunks.sort(key=lambda c: c[1])
    return out


def _entry(stored: StoredItem, where: str, vpath: str, entry: Any) -> Packed:
    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: chunk {vpath!r}: {why}")

    if not (isinstance(entry, list) and len(entry) == 4):
        raise bad("not [pack, offset, bytes, xxh3_128]")
    pack, offset, nbytes, digest = entry
    if not isinstance(pack, str) or not pack.startswith(PACKS) or _INDEX.fullmatch(pack):
        raise bad(f"{pack!r} is not a pack")
    record = stored.files.get(pack)
    if record is None:
        raise bad(f"its pack {pack!r} is not in the manifest")
    for value in (offset, nbytes):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise bad(f"{value!r} is not a byte count")
    if offset + nbytes > record.size:
        raise bad(f"bytes {offset}..{offset + nbytes} are outside {pack!r} ({record.size} bytes)")
    if not isinstance(digest, str) or not _HEX.fullmatch(digest):
        raise bad(f"{digest!r} is not an XXH3-128 hex digest")
    return Packed(record, offset, nbytes, digest)


def read_chunks(
    stored: StoredItem, parts: Sequence[tuple[Packed, memoryview, Callable[[], str]]]
) -> None:
    """Read chunks of one pack, in the order of their offsets (`runs` makes such lists), into
    their buffers with one read, and check each against its content hash; CorruptCheckpointError
    naming the chunk (what the function beside it says) otherwise. The bytes between two chunks (a
    chunk's alignment) are read into a scratch buffer."""
    _read_run(stored, [(packed, dest) for packed, dest, _ in parts])
    check_chunks(parts)


def check_chunks(parts: Sequence[tuple[Packed, memoryview, Callable[[], str]]]) -> None:
    """Check each chunk's bytes against its content hash; CorruptCheckpointError naming the
    chunk (what the function beside it says) otherwise."""
    for packed, dest, describe in parts:
        if not _holds(packed, dest):
            raise CorruptCheckpointError(f"{describe()} {NOT_THE_CHUNK}")


def _read_run(stored: StoredItem, parts: Sequence[tuple[Packed, memoryview]]) -> None:
    """`read_chunks`'s one read: the chunks of a run into their buffers."""
    buffers: list[memoryview] = []
    at = parts[0][0].offset
    for packed, dest in parts:
        if packed.offset < at:
            raise ValueError(f"chunks overlap or are out of order at byte {packed.offset}")
        if packed.offset > at:
            buffers.append(memoryview(bytearray(packed.offset - at)))
        buffers.append(dest)
        at = packed.offset + packed.nbytes
    stored.read_range(parts[0][0].pack, parts[0][0].offset, buffers)


def _holds(packed: Packed, data: memoryview) -> bool:
    """Whether `data` is the chunk `packed` records (its content hash)."""
    digest = xxhash.xxh3_128()
    _update(digest, data, hold=packed.nbytes <= _HOLD_GIL_UP_TO)
    return bool(digest.hexdigest() == packed.xxh3_128)


_RUN_BYTES = 4 * _MiB  # the most one read of several chunks takes (`runs`)
_RUN_GAP = 64 << 10  # the most bytes between two chunks that one read skips over


def runs(parts: Sequence[tuple[Packed, Any]]) -> list[list[tuple[Packed, Any]]]:
    """`parts` (a chunk and whatever goes with it) as lists that `read_chunks` reads at once:
    chunks of one pack in the order of their offsets, each list at most `_RUN_BYTES` (or a
    single larger chunk) with at most `_RUN_GAP` bytes between two of its chunks. A restore of
    many small leaves then makes a few reads, not one (and an open, and a request on an object
    store) per chunk."""
    out: list[list[tuple[Packed, Any]]] = []
    end = size = 0
    for part in sorted(parts, key=lambda p: (p[0].pack, p[0].offset)):
        packed = part[0]
        if (
            out
            and out[-1][0][0].pack == packed.pack
            and 0 <= packed.offset - end <= _RUN_GAP
            and size + packed.offset - end + packed.nbytes <= _RUN_BYTES
        ):
            out[-1].append(part)
            size += packed.offset - end + packed.nbytes
        else:
            out.append([part])
            size = packed.nbytes
        end = packed.offset + packed.nbytes
    return out
