"""NumpyTreeHandler: nested dicts, lists and tuples of NumPy arrays and scalars.

Layout of one item::

    tree.json          the structure: containers, keys, scalar values, and for arrays the file name
    arrays/<i>.npy     leaf i, in NumPy's .npy format (no pickles)

Dict keys are arbitrary strings (``/``, ``.``, spaces...); they live only in ``tree.json`` and never
become path components. Anything with ``__array__`` (a jax.Array, say) is stored as a NumPy array.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cairn.handlers._files import ChecksummedFile, FileRecord, StoredItem, write_file
from cairn.handlers.errors import CorruptCheckpointError, MismatchError

__all__ = ["NumpyTreeHandler", "keystr"]

_TREE = "tree.json"
KeyPath = tuple[str | int, ...]


def keystr(path: KeyPath) -> str:
    """A key path as Python indexing, e.g. ``['params']['dense/kernel'][0]``; the root is ``<root>``."""
    return "".join(f"[{k!r}]" for k in path) or "<root>"


def _is_arraylike(x: Any) -> bool:
    return isinstance(x, np.ndarray) or (hasattr(x, "__array__") and hasattr(x, "shape"))


class _TreeSnapshot:
    def __init__(self, tree: Any, arrays: list[np.ndarray]) -> None:
        self._tree = tree
        self._arrays = arrays

    def write(self, directory: Path) -> Sequence[FileRecord]:
        records = []
        for i, arr in enumerate(self._arrays):
            with ChecksummedFile(directory, f"arrays/{i}.npy") as f:
                np.lib.format.write_array(f, arr, allow_pickle=False)
            records.append(f.record)
        records.append(write_file(directory, _TREE, json.dumps(self._tree).encode()))
        return records


class NumpyTreeHandler:
    """Stores a pytree of NumPy arrays and scalars: the default handler for dict/list/tuple items.

    Snapshot: every array is copied on the caller thread (``np.array(x, copy=True)``), so the caller
    may mutate or donate its arrays as soon as `save()` returns; scalars and the structure are
    captured as values. Leaves: ``np.ndarray`` (any non-object dtype) and array-likes, NumPy
    scalars, Python ``bool``/``int``/``float``/``complex``/``str`` and ``None``.

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
        tree = _encode(obj, (), arrays)
        return _TreeSnapshot(tree, arrays)

    def restore(self, stored: StoredItem, target: Any = None) -> Any:
        tree = _load_tree(stored)

        def leaf(node: Mapping[str, Any]) -> Any:
            arr = _read_array(stored, node["f"], node["dtype"])
            return arr[()] if node["t"] == "npscalar" else arr

        if target is None:
            return _decode(tree, (), leaf)
        return _decode_into(tree, target, (), leaf)

    def describe(self, stored: StoredItem) -> dict[str, Any]:
        leaves: list[dict[str, Any]] = []
        _walk_leaves(_load_tree(stored), (), leaves)
        return {
            "kind": "numpy-tree",
            "leaves": leaves,
            "bytes": sum(r.size for r in stored.files.values()),
        }

    def __repr__(self) -> str:
        return "NumpyTreeHandler()"


def _encode(obj: Any, path: KeyPath, arrays: list[np.ndarray]) -> Any:
    if isinstance(obj, np.generic) or _is_arraylike(obj):  # first: np.float64 is a float
        arr = np.array(obj, copy=True)
        if arr.dtype.hasobject:
            raise TypeError(f"array at {keystr(path)} has dtype object, which cannot be stored")
        arrays.append(arr)
        kind = "npscalar" if isinstance(obj, np.generic) else "array"
        return {
            "t": kind,
            "f": f"arrays/{len(arrays) - 1}.npy",
            "shape": list(arr.shape),
            "dtype": dtype_name(arr.dtype),
        }
    if obj is None:
        return {"t": "none"}
    if isinstance(obj, bool):
        return {"t": "bool", "v": obj}
    if isinstance(obj, int):
        return {"t": "int", "v": int(obj)}
    if isinstance(obj, float):
        return {"t": "float", "v": float(obj)}
    if isinstance(obj, complex):
        return {"t": "complex", "v": [obj.real, obj.imag]}
    if isinstance(obj, str):
        return {"t": "str", "v": obj}
    if isinstance(obj, Mapping):
        keys = list(obj)
        for k in keys:
            if not isinstance(k, str):
                raise TypeError(
                    f"dict key {k!r} at {keystr(path)} is a {type(k).__qualname__}; "
                    "pytree dict keys must be strings"
                )
        return {"t": "dict", "k": keys, "c": [_encode(obj[k], (*path, k), arrays) for k in keys]}
    if isinstance(obj, (list, tuple)):
        kind = "list" if isinstance(obj, list) else "tuple"
        return {"t": kind, "c": [_encode(v, (*path, i), arrays) for i, v in enumerate(obj)]}
    raise TypeError(
        f"leaf at {keystr(path)} is a {type(obj).__qualname__}, which NumpyTreeHandler cannot store"
    )


def _load_tree(stored: StoredItem) -> Any:
    try:
        return json.loads(stored.read_bytes(_TREE))
    except json.JSONDecodeError as e:
        raise CorruptCheckpointError(f"{stored.describe_file(_TREE)} does not parse: {e}") from None


def dtype_name(dtype: np.dtype) -> str:
    """How a dtype is written down: NumPy's own string (``<f4``), or the ml_dtypes name (``bfloat16``)."""
    return dtype.name if dtype.kind == "V" and dtype.name in _ml_dtype_names() else dtype.str


def dtype_from_name(name: str) -> np.dtype:
    if name in _ml_dtype_names():
        import ml_dtypes  # a dependency of jax; needed only for bfloat16 and friends

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def _ml_dtype_names() -> frozenset[str]:
    return frozenset(
        {
            "bfloat16",
            "float8_e4m3fn",
            "float8_e4m3fnuz",
            "float8_e5m2",
            "float8_e5m2fnuz",
            "float8_e4m3b11fnuz",
            "float8_e3m4",
            "float8_e4m3",
            "float8_e8m0fnu",
            "float4_e2m1fn",
            "float6_e2m3fn",
            "float6_e3m2fn",
            "int2",
            "int4",
            "uint2",
            "uint4",
        }
    )


def _read_array(stored: StoredItem, relpath: str, dtype: str) -> np.ndarray:
    import io

    data = stored.read_bytes(relpath)
    try:
        arr = np.lib.format.read_array(io.BytesIO(data), allow_pickle=False)
    except ValueError as e:  # checksummed bytes that still do not parse: a bug, but say where
        raise CorruptCheckpointError(f"{stored.describe_file(relpath)}: {e}") from None
    want = dtype_from_name(dtype)
    return arr if arr.dtype == want else arr.view(want)  # .npy stores ml_dtypes as raw void


_SCALARS: dict[str, Callable[[Any], Any]] = {
    "none": lambda v: None,
    "bool": bool,
    "int": int,
    "float": float,
    "complex": lambda v: complex(v[0], v[1]),
    "str": str,
}


def _decode(
    node: Mapping[str, Any], path: KeyPath, leaf: Callable[[Mapping[str, Any]], Any]
) -> Any:
    t = node["t"]
    if t in _SCALARS:
        return _SCALARS[t](node.get("v"))
    if t == "dict":
        return {k: _decode(c, (*path, k), leaf) for k, c in zip(node["k"], node["c"], strict=True)}
    if t in ("list", "tuple"):
        children = [_decode(c, (*path, i), leaf) for i, c in enumerate(node["c"])]
        return children if t == "list" else tuple(children)
    if t in ("array", "npscalar"):
        return leaf(node)
    raise CorruptCheckpointError(f"unknown node type {t!r} at {keystr(path)} in {_TREE}")


def _decode_into(
    node: Mapping[str, Any], target: Any, path: KeyPath, leaf: Callable[[Mapping[str, Any]], Any]
) -> Any:
    t = node["t"]
    if isinstance(target, Mapping):
        if t != "dict":
            raise MismatchError(f"at {keystr(path)}: the target is a dict, the checkpoint a {t}")
        stored_keys = list(node["k"])
        if set(stored_keys) != set(target):
            missing = sorted(set(target) - set(stored_keys))
            extra = sorted(set(stored_keys) - set(target))
            raise MismatchError(
                f"at {keystr(path)}: keys differ; only in the target: {missing}, "
                f"only in the checkpoint: {extra}"
            )
        children = dict(zip(stored_keys, node["c"], strict=True))
        return {k: _decode_into(children[k], target[k], (*path, k), leaf) for k in target}
    if isinstance(target, (list, tuple)):
        if t not in ("list", "tuple"):
            kind = type(target).__qualname__
            raise MismatchError(f"at {keystr(path)}: the target is a {kind}, the checkpoint a {t}")
        if len(node["c"]) != len(target):
            raise MismatchError(
                f"at {keystr(path)}: the target has {len(target)} entries, "
                f"the checkpoint {len(node['c'])}"
            )
        values = [
            _decode_into(c, v, (*path, i), leaf)
            for i, (c, v) in enumerate(zip(node["c"], target, strict=True))
        ]
        if isinstance(target, list):
            return values
        if hasattr(target, "_fields"):  # namedtuple
            return type(target)(*values)
        return tuple(values)
    if t in ("dict", "list", "tuple"):
        raise MismatchError(
            f"at {keystr(path)}: the target is a leaf ({type(target).__qualname__}), "
            f"the checkpoint a {t}"
        )
    if target is None:
        return _decode(node, path, leaf)
    if hasattr(target, "shape") and hasattr(target, "dtype"):
        if t not in ("array", "npscalar"):
            raise MismatchError(f"at {keystr(path)}: the target is an array, the checkpoint a {t}")
        want_shape, want_dtype = tuple(target.shape), np.dtype(target.dtype)
        have_shape, have_dtype = tuple(node["shape"]), dtype_from_name(node["dtype"])
        if want_shape != have_shape:
            raise MismatchError(
                f"at {keystr(path)}: shape {have_shape} in the checkpoint, {want_shape} in the target"
            )
        if want_dtype != have_dtype:
            raise MismatchError(
                f"at {keystr(path)}: dtype {have_dtype} in the checkpoint, {want_dtype} in the target"
            )
    return _decode(node, path, leaf)


def _walk_leaves(node: Mapping[str, Any], path: KeyPath, out: list[dict[str, Any]]) -> None:
    t = node["t"]
    if t == "dict":
        for k, c in zip(node["k"], node["c"], strict=True):
            _walk_leaves(c, (*path, k), out)
    elif t in ("list", "tuple"):
        for i, c in enumerate(node["c"]):
            _walk_leaves(c, (*path, i), out)
    elif t in ("array", "npscalar"):
        out.append({"path": keystr(path), "shape": node["shape"], "dtype": node["dtype"]})
    else:
        out.append({"path": keystr(path), "value": node.get("v"), "type": t})
