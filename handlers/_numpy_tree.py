"""NumpyTreeHandler: nested dicts, lists and tuples of NumPy arrays and scalars.

Layout of one item::

    tree.json          the structure: containers, keys, scalar values, and for arrays the file name
    arrays/<i>.npy     leaf i, in NumPy's .npy format (no pickles)

Dict keys are arbitrary strings (``/``, ``.``, spaces...); they live only in ``tree.json`` and never
become path components. Anything with ``__array__`` (a jax.Array, say) is stored as a NumPy array.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cairn.handlers._files import (
    Destination,
    FileRecord,
    StoredItem,
    as_destination,
    writing_process,
)
from cairn.handlers._tree import (
    NONE,
    TREE,
    KeyPath,
    check_leaf,
    decode,
    describe_tree,
    dtype_from_name,
    dtype_name,
    encode,
    keystr,
    load_tree,
    walk_leaves,
)
from cairn.handlers.errors import CorruptCheckpointError

__all__ = ["NumpyTreeHandler"]


class _TreeSnapshot:
    def __init__(self, tree: Any, arrays: list[np.ndarray]) -> None:
        self._tree = tree
        self._arrays = arrays

    def write(self, dest: Destination | Path) -> Sequence[FileRecord]:
        dest = as_destination(dest)
        if writing_process()[0] != 0:
            return []  # host values, the same on every process: the primary writes them
        records = []
        for i, arr in enumerate(self._arrays):
            with dest.create(f"arrays/{i}.npy") as f:
                np.lib.format.write_array(f, arr, allow_pickle=False)
            records.append(f.record)
        records.append(dest.write_file(TREE, json.dumps(self._tree).encode()))
        return records


class NumpyTreeHandler:
    """Stores a pytree of NumPy arrays and scalars: the default handler for dict/list/tuple items.

    Snapshot: every array is copied on the caller thread (``np.array(x, copy=True)``), so the caller
    may mutate or donate its arrays as soon as `save()` returns; scalars and the structure are
    captured as values. Leaves: ``np.ndarray`` (any non-object dtype, ml_dtypes included) and
    array-likes, NumPy scalars, Python ``bool``/``int``/``float``/``complex``/``str`` and ``None``.

    Restore without a target rebuilds the tree as saved (dicts, lists and tuples; arrays as
    ``np.ndarray``). With a target, containers must match in kind, keys and length and array
    leaves in shape and dtype, else MismatchError names the key path; a target leaf may be an
    array or anything with ``shape`` and ``dtype`` (e.g. ``jax.ShapeDtypeStruct``), and namedtuples
    in the target come back as namedtuples.
    """

    id = "cairn.numpy_tree"
    version = 1

    def snapshot(self, obj: Any) -> _TreeSnapshot:
        arrays: list[np.ndarray] = []

        def leaf(x: Any, path: KeyPath) -> dict[str, Any]:
            arr = np.array(x, copy=True)
            if arr.dtype.hasobject:
                raise TypeError(f"array at {keystr(path)} has dtype object, which cannot be stored")
            arrays.append(arr)
            return {
                "t": "npscalar" if isinstance(x, np.generic) else "array",
                "f": f"arrays/{len(arrays) - 1}.npy",
                "shape": list(arr.shape),
                "dtype": dtype_name(arr.dtype),
            }

        return _TreeSnapshot(encode(obj, leaf), arrays)

    def restore(self, stored: StoredItem, target: Any = None) -> Any:
        def read_leaf(node: Mapping[str, Any], target_leaf: Any, path: KeyPath) -> Any:
            check_leaf(node, target_leaf, path)
            arr = _read_array(stored, node["f"], node["dtype"], node["shape"])
            return arr[()] if node["t"] == "npscalar" else arr

        return decode(load_tree(stored), read_leaf, NONE if target is None else target)

    def describe(self, stored: StoredItem) -> dict[str, Any]:
        return describe_tree(stored, "numpy-tree")

    def check(self, stored: StoredItem) -> None:
        """What a restore checks before it takes a leaf's data: ``tree.json``, and each leaf's
        ``.npy`` file listed, with a header that agrees with ``tree.json`` and with the file's
        recorded size; CorruptCheckpointError naming the file otherwise. ``verify`` calls it
        after checking every file's content, so a step it calls intact is one a restore takes."""
        for _, node in walk_leaves(load_tree(stored)):
            if node["t"] not in ("array", "npscalar"):
                continue
            relpath = node["f"]
            record = stored.files.get(relpath)
            if record is None:
                raise CorruptCheckpointError(
                    f"{stored.describe_file(relpath)} is not in the manifest"
                )
            head = bytearray(min(record.size, _HEADER_BYTES))
            stored.read_range(relpath, 0, memoryview(head))
            _npy_layout(
                head, record.size, stored.describe_file(relpath), node["dtype"], node["shape"]
            )

    def __repr__(self) -> str:
        return "NumpyTreeHandler()"


def _read_array(stored: StoredItem, relpath: str, dtype: str, shape: list[int]) -> np.ndarray:
    """One verified ``.npy`` file as an array of `dtype`, its header checked against the bytes
    that follow it before anything is allocated (NumPy's reader would allocate what the header
    says)."""
    data = stored.read_bytes(relpath)
    offset, stored_dtype, fortran = _npy_layout(
        data, len(data), stored.describe_file(relpath), dtype, shape
    )
    count = int(np.prod(shape, dtype=object)) if shape else 1
    arr = np.frombuffer(data, stored_dtype, count=count, offset=offset)
    arr = arr.reshape(shape, order="F" if fortran else "C").copy()
    want = dtype_from_name(dtype)
    return arr if arr.dtype == want else arr.view(want)  # .npy stores ml_dtypes as raw void


# NumPy refuses headers past 10,000 bytes (max_header_size); with the magic and the length.
_HEADER_BYTES = 10_000 + 12


def _npy_layout(
    head: bytes | bytearray, size: int, where: str, dtype: str, shape: list[int]
) -> tuple[int, np.dtype, bool]:
    """Where the data of a ``.npy`` file of `size` bytes starts, its dtype as stored and whether
    it is in Fortran order, from `head` (its first bytes, the header among them), checked
    against ``tree.json``'s `dtype` and `shape` and against `size`."""
    f = io.BytesIO(head)
    try:
        version = np.lib.format.read_magic(f)
        read_header = (
            np.lib.format.read_array_header_1_0
            if version == (1, 0)
            else np.lib.format.read_array_header_2_0
        )
        header_shape, fortran, stored_dtype = read_header(f)
    except (ValueError, TypeError, SyntaxError) as e:
        raise CorruptCheckpointError(f"{where}: not a .npy file NumPy reads: {e}") from None
    want = dtype_from_name(dtype)
    if list(header_shape) != shape:
        raise CorruptCheckpointError(f"{where}: shape {header_shape} where tree.json says {shape}")
    count = int(np.prod(shape, dtype=object)) if shape else 1
    if stored_dtype.hasobject or stored_dtype.itemsize != want.itemsize:
        raise CorruptCheckpointError(f"{where}: dtype {stored_dtype} where tree.json says {dtype}")
    if count * want.itemsize != size - f.tell():
        raise CorruptCheckpointError(
            f"{where}: its header says shape {header_shape}, which its {size - f.tell()} bytes "
            "of data do not hold"
        )
    return f.tell(), stored_dtype, fortran
