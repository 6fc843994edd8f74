"""Reading a stored leaf back: `_LeafReader` checks its metadata and files, then reads it, whole
or by regions (`_Read`, on the read pool); `_Batch` reads the chunks of one restore together."""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
from collections.abc import Callable, Mapping
from typing import Any

import crc32c
import numpy as np
import xxhash

from cairn.handlers._files import StoredItem, aligned_empty, in_parts, parse_json
from cairn.handlers._packs import Packed
from cairn.handlers._packs import check_chunks as check_packed_chunks
from cairn.handlers._packs import read_chunks as read_packed_chunks
from cairn.handlers._packs import runs as packed_runs
from cairn.handlers._train_state.layout import _size, _zarr_metadata
from cairn.handlers._train_state.threads import _shared_pool
from cairn.handlers._tree import TREE, KeyPath, dtype_from_name, dtype_name, keystr
from cairn.handlers.errors import CorruptCheckpointError, PartMismatchError


class _LeafReader:
    """Reads one stored leaf, whole or by slices, from its chunk files.

    Nothing is allocated before the leaf's metadata is checked against the files (`check`):
    ``zarr.json`` must be what this layout writes for the shape, dtype and chunk shape in
    ``tree.json``, and every chunk of the grid must be listed in the manifest at its exact size,
    so an array is never larger than the files that hold it. Each chunk file read is checked
    against its manifest record: its content hash (format 2), which binds the bytes to this
    leaf and chunk, or its crc32c tail (format 1, the zarr codec's check only).

    A region made of whole chunks (the usual case: restoring without a sharding, or with the one
    it was saved with) is read straight into a 64-byte aligned buffer, which JAX adopts without
    a copy on CPU; any other region reads each overlapping chunk whole and copies the overlap.
    """

    def __init__(
        self,
        stored: StoredItem,
        node: Mapping[str, Any],
        path: KeyPath,
        index: Mapping[str, Packed] | None = None,
    ) -> None:
        self.stored, self.node, self.path, self.index = stored, node, path, index
        self.shape = tuple(node["shape"])
        self.dtype = dtype_from_name(node["dtype"])
        self.chunk = tuple(node.get("chunk") or ())
        self._checked = False
        self.part = in_parts()  # one process's part: each chunk is checked as it is read

    def describe(self, relpath: str) -> str:
        return f"{self.stored.describe_file(relpath)} (leaf {keystr(self.path)})"

    def describe_chunk(self, vpath: str, pack: str | None = None) -> str:
        """A chunk of the packed layout, for messages: in its pack file, or in the item."""
        where = self.stored.describe_file(pack) if pack else self.stored._where()[:-2]
        return f"{where}, chunk {vpath} (leaf {keystr(self.path)})"

    def check(self) -> None:
        """Check the leaf's metadata and files (once; before anything is allocated)."""
        if self._checked:
            return
        base = self.node["f"]
        if len(self.chunk) != len(self.shape):
            raise CorruptCheckpointError(
                f"{self.describe(TREE)}: tree.json gives no chunk shape of rank {len(self.shape)}"
            )
        if self.index is not None:
            self._check_packed(base)
            return
        where = self.describe(f"{base}/zarr.json")
        meta = parse_json(self.stored.read_bytes(f"{base}/zarr.json"), where)
        if meta != _zarr_metadata(self.shape, self.dtype, self.chunk):
            raise CorruptCheckpointError(
                f"{where} does not describe the leaf tree.json records (shape {list(self.shape)}, "
                f"dtype {dtype_name(self.dtype)}, chunk {list(self.chunk)})"
            )
        if _size(self.shape) and not self.part:
            grid = [-(-n // c) for n, c in zip(self.shape, self.chunk, strict=True)]
            size = _size(self.chunk) * self.dtype.itemsize + 4
            if _size(grid) > len(self.stored.files):
                raise CorruptCheckpointError(
                    f"{where}: the leaf has {_size(grid)} chunks, the manifest lists "
                    f"{len(self.stored.files)} files for the item"
                )
            for coords in itertools.product(*map(range, grid)):
                relpath = f"{base}/{'.'.join(map(str, coords)) or '0'}"
                record = self.stored.files.get(relpath)
                if record is None or record.size != size:
                    got = "not listed" if record is None else f"listed with {record.size} bytes"
                    raise CorruptCheckpointError(
                        f"{self.describe(relpath)} is {got} in the manifest; the leaf needs it "
                        f"with {size} bytes"
                    )
        self.stored.check_files(f"{base}/")  # present, regular, not links, at those sizes
        self._checked = True

    def _check_packed(self, base: str) -> None:
        """The packed layout: every chunk of the grid in the index, at its exact size (the index
        entries themselves were checked against the manifest by `load_index`)."""
        assert self.index is not None
        if _size(self.shape) and not self.part:
            grid = [-(-n // c) for n, c in zip(self.shape, self.chunk, strict=True)]
            size = _size(self.chunk) * self.dtype.itemsize
            if _size(grid) > len(self.index):
                raise CorruptCheckpointError(
                    f"{self.describe_chunk(base)}: the leaf has {_size(grid)} chunks, the index lists "
                    f"{len(self.index)} for the item"
                )
            for coords in itertools.product(*map(range, grid)):
                vpath = f"{base}/{'.'.join(map(str, coords)) or '0'}"
                where = self.index.get(vpath)
                if where is None or where.nbytes != size:
                    got = "not indexed" if where is None else f"indexed with {where.nbytes} bytes"
                    raise CorruptCheckpointError(
                        f"{self.describe_chunk(vpath)} is {got}; the leaf needs {size} bytes"
                    )
        self.stored.check_files("packs/")  # present, regular, not links, at those sizes
        self._checked = True

    def check_chunk(self, coords: tuple[int, ...]) -> None:
        """A part (`in_parts`): the chunk at `coords`, which a read needs, is there at its
        exact size (`check` looked at every chunk of the grid otherwise)."""
        vpath = self.vpath(coords)
        size = _size(self.chunk) * self.dtype.itemsize
        if self.index is not None:
            where = self.index.get(vpath)
            got = None if where is None else where.nbytes
            what = self.describe_chunk(vpath)
        else:
            record = self.stored.files.get(vpath)
            got, size = (None if record is None else record.size), size + 4
            what = self.describe(vpath)
        if got is None:
            raise PartMismatchError(
                f"{what} is not in this process's part of the step: a part holds the regions "
                "of its process's devices as saved; restore it into the same shardings (or "
                "from the persistent tier)"
            )
        if got != size:
            raise CorruptCheckpointError(f"{what} is held with {got} bytes, not {size}")

    def read(
        self, index: tuple[slice, ...] = (), batch: _Batch | None = None, *, share: bool = False
    ) -> _Read:
        """A future of the data in `index` (whole leaf by default), as np.ndarray; with `batch`,
        the chunks it can read with others wait for ``batch.start()``; with `share`, the array
        may be the memory the source holds the bytes in (`_Read`), for a caller that copies it
        or hands it to JAX, and never writes to it."""
        self.check()
        region = index or tuple(slice(0, n) for n in self.shape)
        return _Read(self, region, batch, share=share)

    def vpath(self, coords: tuple[int, ...]) -> str:
        """The chunk at grid `coords`: its file (zarr layout) or its index entry (packed)."""
        return f"{self.node['f']}/{'.'.join(map(str, coords)) or '0'}"

    def read_chunk(self, coords: tuple[int, ...], dest: np.ndarray) -> None:
        """Read the chunk at grid `coords` into `dest` (C-contiguous, the chunk's full shape) and
        check it against the manifest; CorruptCheckpointError naming the file otherwise."""
        relpath = self.vpath(coords)
        data = memoryview(dest.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
        if self.index is not None:
            where = self.index[relpath]
            describe = functools.partial(self.describe_chunk, relpath, where.pack)
            read_packed_chunks(self.stored, [(where, data, describe)])
            return
        record = self.stored.files[relpath]
        tail = bytearray(4)
        self.stored.read_into(relpath, [data, memoryview(tail)])
        if record.xxh3_128 is not None:
            digest = xxhash.xxh3_128(data)
            digest.update(tail)
            if digest.hexdigest() != record.xxh3_128:
                raise CorruptCheckpointError(
                    f"{self.describe(relpath)} is not the chunk the manifest records "
                    "(its content hash differs)"
                )
        elif crc32c.crc32c(data) != int.from_bytes(tail, "little"):
            raise CorruptCheckpointError(f"{self.describe(relpath)} fails its crc32c check")


def _read_pool() -> concurrent.futures.ThreadPoolExecutor:
    return _shared_pool("cairn-read", 4)


class _Read:
    """One region of a leaf being read on the read pool: a chunk per task, or with a `_Batch`,
    the chunks of the packed layout that land whole in the result in the batch's reads."""

    def __init__(
        self, reader: _LeafReader, region: tuple[slice, ...], batch: _Batch | None, *, share: bool
    ) -> None:
        self._reader = reader
        self._region = region
        self._futures: list[concurrent.futures.Future[None]] = []
        shared = self._shared() if share else None
        if shared is not None:
            self._out = shared
            return
        self._out = aligned_empty(tuple(sl.stop - sl.start for sl in region), reader.dtype, 64)
        if not self._out.size:
            return
        spans = [
            range(sl.start // c, -(-sl.stop // c))
            for sl, c in zip(region, reader.chunk, strict=True)
        ]
        for coords in itertools.product(*spans):
            if reader.part:
                reader.check_chunk(coords)
            dest, inner = self._place(coords)
            if batch is not None and reader.index is not None and inner is None:
                batch.add(self, coords, dest)
            else:
                self._futures.append(_read_pool().submit(self._one, coords))

    def _shared(self) -> np.ndarray | None:
        """The region as the memory its source holds it in, not copied (a part a peer sent
        back, `MemorySource`), where it is one whole chunk of the packed layout that starts on a
        64-byte boundary (as a staged chunk does): its content is checked on the read pool, as a
        read's. JAX adopts such an array on CPU without a copy (it never writes into memory it
        adopted: a donated array is copied), and copies it to an accelerator. A copy from that
        memory into new arrays cost a restore from a peer 0.2 s per 512 MiB here, most of it
        the kernel's faults on fresh pages. None otherwise: read as any region."""
        reader, region = self._reader, self._region
        if reader.index is None or not reader.shape:
            return None
        spans = list(zip(region, reader.chunk, strict=True))
        if any(sl.start % c or sl.stop - sl.start != c for sl, c in spans):
            return None
        coords = tuple(sl.start // c for sl, c in spans)
        if reader.part:
            reader.check_chunk(coords)
        vpath = reader.vpath(coords)
        packed = reader.index[vpath]
        view = reader.stored.view_range(packed.pack, packed.offset, packed.nbytes)
        if view is None:
            return None
        out = np.frombuffer(view, reader.dtype).reshape(reader.chunk)
        if out.ctypes.data % 64:
            return None
        if not reader.stored.source.hashed(packed.pack):  # else its whole pack was checked
            describe = functools.partial(reader.describe_chunk, vpath, packed.pack)
            self._futures.append(
                _read_pool().submit(check_packed_chunks, [(packed, view, describe)])
            )
        return out

    def _place(self, coords: tuple[int, ...]) -> tuple[np.ndarray, tuple[slice, ...] | None]:
        """Where the chunk at `coords` goes in the result, and which part of it goes there (None:
        all of it, a C-contiguous destination it is read into straight)."""
        reader, region = self._reader, self._region
        lo = [k * c for k, c in zip(coords, reader.chunk, strict=True)]
        # The overlap of this chunk with the region, in chunk and in output coordinates.
        inner = tuple(
            slice(max(sl.start, a) - a, min(sl.stop, a + c) - a)
            for sl, a, c in zip(region, lo, reader.chunk, strict=True)
        )
        outer = tuple(
            slice(a + i.start - sl.start, a + i.stop - sl.start)
            for sl, a, i in zip(region, lo, inner, strict=True)
        )
        whole = all(i.start == 0 and i.stop == c for i, c in zip(inner, reader.chunk, strict=True))
        dest = self._out[outer] if reader.shape else self._out.reshape(1)
        return dest, None if whole and dest.flags.c_contiguous else inner

    def _one(self, coords: tuple[int, ...]) -> None:
        reader = self._reader
        dest, inner = self._place(coords)
        if inner is None:
            reader.read_chunk(coords, dest)  # straight into the result
            return
        buffer = np.empty(reader.chunk, reader.dtype)
        reader.read_chunk(coords, buffer)
        dest[...] = buffer[inner]

    def result(self) -> np.ndarray:
        for future in self._futures:
            future.result()
        return self._out


class _Batch:
    """Chunks of the packed layout that reads of one restore want whole, read together: the
    chunks of a pack that lie close are read with one call, then checked one by one
    (`packed_runs`). A restore of a state of many small leaves then costs a few reads, not a
    task, an open and a read (a request, on an object store) per chunk.

    Filled on the calling thread, then `start`ed once: a `_Read` of the batch waits for the
    reads of the runs that hold its chunks."""

    def __init__(self) -> None:
        # Per item read (one, from `_materialize`): its chunks, and what goes with each.
        self._parts: dict[
            int, list[tuple[Packed, tuple[_Read, memoryview, Callable[[], str]]]]
        ] = {}

    def add(self, read: _Read, coords: tuple[int, ...], dest: np.ndarray) -> None:
        reader = read._reader
        assert reader.index is not None
        vpath = reader.vpath(coords)
        packed = reader.index[vpath]
        view = memoryview(dest.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
        describe = functools.partial(reader.describe_chunk, vpath, packed.pack)
        self._parts.setdefault(id(reader.stored), []).append((packed, (read, view, describe)))

    def start(self) -> None:
        for parts in self._parts.values():
            stored = parts[0][1][0]._reader.stored
            for run in packed_runs(parts):
                future = _read_pool().submit(
                    read_packed_chunks, stored, [(p, view, what) for p, (_, view, what) in run]
                )
                for read in {id(r): r for _, (r, _, _) in run}.values():
                    read._futures.append(future)
        self._parts = {}
