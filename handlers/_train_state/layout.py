"""Chunk geometry and stored bytes: how a leaf is cut into chunks (`_choose_chunk`; the keys and
rows of a piece's chunks), each chunk's bytes as stored (`_raw`, and their content hash cast a
piece at a time, `_cast_digest`), and the zarr v3 metadata of a leaf (the zarr layout's
``zarr.json``)."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import xxhash

_MiB = 1 << 20


def _size(shape: Sequence[int]) -> int:
    return math.prod(int(n) for n in shape)


def _full_index(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(
        slice(s.start or 0, n if s.stop is None else s.stop)
        for s, n in zip(index, shape, strict=True)
    )


@functools.lru_cache(maxsize=4096)  # a pure function of a few numbers, asked per leaf per save
def _choose_chunk(
    region_shape: tuple[int, ...], itemsize: int, chunk_bytes: int, *, whole_rows: bool
) -> tuple[int, ...]:
    """The piece's own shape, split along axis 0 into parts of at most `chunk_bytes`.

    Parts are equal (a divisor of the rows) so chunks never straddle two processes' shards. When
    the piece spans the whole first axis (`whole_rows`) and no divisor is near the bound (a prime
    row count, say), chunks of the bound are used and the last one is padded, as zarr requires.
    """
    if not region_shape:
        return ()
    rows = region_shape[0]
    row_bytes = max(1, itemsize * math.prod(region_shape[1:]))
    if rows <= 1 or rows * row_bytes <= chunk_bytes:
        return tuple(max(1, n) for n in region_shape)
    cap = max(1, chunk_bytes // row_bytes)
    best = max(d for d in _divisors(rows) if d <= cap)
    if whole_rows and best * 4 < cap:
        best = cap
    return (best, *(max(1, n) for n in region_shape[1:]))


def _divisors(n: int) -> Iterator[int]:
    i = 1
    while i * i <= n:
        if n % i == 0:
            yield i
            yield n // i
        i += 1


def _chunk_parts(
    region: tuple[slice, ...], data: np.ndarray, chunk: tuple[int, ...]
) -> Iterator[tuple[str, np.ndarray]]:
    """(chunk key, view of its rows of `data`) for each chunk of a piece that starts on a chunk
    boundary; the last part may have fewer rows than the chunk (see _choose_chunk)."""
    if not chunk:
        yield "0", data.reshape(())
        return
    if data.size == 0:  # nothing to store: zarr reads absent chunks as the fill value
        return
    origin = [s.start or 0 for s in region]
    step = chunk[0]
    for r0 in range(0, data.shape[0], step):
        coords = [
            (origin[0] + r0) // step,
            *(o // c for o, c in zip(origin[1:], chunk[1:], strict=True)),
        ]
        yield ".".join(map(str, coords)), data[r0 : r0 + step]


def _chunks_of(
    region: tuple[slice, ...], data: np.ndarray, chunk: tuple[int, ...]
) -> Iterator[tuple[str, np.ndarray]]:
    """(chunk key, contiguous data) for each chunk of a piece, the edge chunk padded."""
    for key, part in _chunk_parts(region, data, chunk):
        if chunk and part.shape[0] < chunk[0]:  # the padded edge chunk (see _choose_chunk)
            padded = np.zeros((chunk[0], *part.shape[1:]), part.dtype)
            padded[: part.shape[0]] = part
            part = padded
        yield key, part


def _zarr_metadata(
    shape: tuple[int, ...], dtype: np.dtype, chunk: tuple[int, ...]
) -> dict[str, Any]:
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": _zarr_dtype(dtype),
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk)}},
        "chunk_key_encoding": {"name": "v2", "configuration": {"separator": "."}},
        "fill_value": _zarr_fill(dtype),
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
    }


def _zarr_dtype(dtype: np.dtype) -> str:
    if dtype.kind == "b":
        return "bool"
    return dtype.name  # int8..uint64, float16..float64, complex64/128, bfloat16, float8_*


def _zarr_fill(dtype: np.dtype) -> Any:
    if dtype.kind == "b":
        return False
    if dtype.kind == "c":
        return [0.0, 0.0]
    if dtype.kind in "iu":
        return 0
    return 0.0


def _raw(part: np.ndarray, want: np.dtype) -> np.ndarray:
    """A chunk's bytes as stored: cast to `want` if it differs, contiguous, as uint8."""
    data = part.astype(want) if part.dtype != want else part
    return np.ascontiguousarray(data).reshape(-1).view(np.uint8)  # ml_dtypes lack buffers


_CAST_PIECE = 4 * _MiB  # of a view cast to be hashed (an incremental save with save_dtype)


def _cast_digest(part: np.ndarray, want: np.dtype) -> str:
    """The content hash of `part` as stored (cast to `want`), cast `_CAST_PIECE` bytes of rows
    at a time: no cast copy of the whole chunk is held."""
    if not part.ndim:
        return xxhash.xxh3_128_hexdigest(memoryview(_raw(part, want)))  # type: ignore[arg-type]
    row = max(1, part[:1].size * max(part.dtype.itemsize, want.itemsize))
    rows = max(1, _CAST_PIECE // row)
    hashed = xxhash.xxh3_128()
    for at in range(0, part.shape[0], rows):
        hashed.update(memoryview(_raw(part[at : at + rows], want)))  # type: ignore[arg-type]
    return hashed.hexdigest()
