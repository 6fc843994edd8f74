"""The pytree structure both array handlers store in ``tree.json``, and how it is read back.

A node is a small JSON object: containers carry their keys and children, scalars their value, and
array leaves whatever the handler's leaf function records (always ``t``, ``shape`` and ``dtype``).
Keys are arbitrary strings and never become paths. With ``pytrees=True`` namedtuples and any node
type registered with ``jax.tree_util`` (dataclasses, flax structs) are kept as such, with their
keys; without a target they come back as dicts, with a target as the target's own types.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any, TypeGuard

import numpy as np

from cairn.handlers._files import StoredItem, check_relative, parse_json
from cairn.handlers.errors import CorruptCheckpointError, MismatchError

__all__ = ["KeyPath", "decode", "encode", "is_arraylike", "keystr", "load_tree", "walk_leaves"]

TREE = "tree.json"
KeyPath = tuple[str | int, ...]
EncodeLeaf = Callable[[Any, KeyPath], dict[str, Any]]
ReadLeaf = Callable[[Mapping[str, Any], Any, KeyPath], Any]  # (node, target leaf or NONE, path)
NONE: Any = object()  # "no target", distinct from a target that is None


def keystr(path: KeyPath) -> str:
    """A key path as Python indexing, e.g. ``['params']['dense/kernel'][0]``; the root is ``<root>``."""
    return "".join(f"[{k!r}]" for k in path) or "<root>"


def is_arraylike(x: Any) -> bool:
    return isinstance(x, (np.ndarray, np.generic)) or (
        hasattr(x, "__array__") and hasattr(x, "shape")
    )


_SCALARS: dict[str, Callable[[Any], Any]] = {
    "none": lambda v: None,
    "bool": bool,
    "int": int,
    "float": float,
    "complex": lambda v: complex(v[0], v[1]),
    "str": str,
}
_CONTAINERS = ("dict", "list", "tuple", "namedtuple", "custom")


def encode(obj: Any, leaf: EncodeLeaf, *, pytrees: bool = False, path: KeyPath = ()) -> Any:
    """The JSON node for `obj`; array-likes go through `leaf`. TypeError names the key path."""
    if is_arraylike(obj):  # first: np.float64 is also a float
        return leaf(obj, path)
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
        children = [encode(obj[k], leaf, pytrees=pytrees, path=(*path, k)) for k in keys]
        return {"t": "dict", "k": keys, "c": children}
    if pytrees and isinstance(obj, tuple) and hasattr(obj, "_fields"):
        fields = list(obj._fields)
        children = [
            encode(v, leaf, pytrees=True, path=(*path, f)) for f, v in zip(fields, obj, strict=True)
        ]
        return {"t": "namedtuple", "type": _type_name(obj), "k": fields, "c": children}
    if isinstance(obj, (list, tuple)):
        kind = "list" if isinstance(obj, list) else "tuple"
        children = [encode(v, leaf, pytrees=pytrees, path=(*path, i)) for i, v in enumerate(obj)]
        return {"t": kind, "c": children}
    if pytrees and "jax" in sys.modules:
        keyed = _flatten_custom(obj)
        if keyed is not None:
            keys = [_key_name(k) for k, _ in keyed]
            children = [
                encode(v, leaf, pytrees=True, path=(*path, k))
                for k, (_, v) in zip(keys, keyed, strict=True)
            ]
            return {"t": "custom", "type": _type_name(obj), "k": keys, "c": children}
    raise TypeError(f"leaf at {keystr(path)} is a {type(obj).__qualname__}, which cannot be stored")


def _type_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _flatten_custom(obj: Any) -> list[tuple[Any, Any]] | None:
    from jax import tree_util

    flat = tree_util.default_registry.flatten_one_level_with_keys(obj)
    return None if flat is None else list(flat[0])


def _key_name(key: Any) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def load_tree(stored: StoredItem) -> Any:
    """The verified ``tree.json`` of an item, checked node by node (`check_tree`)."""
    where = stored.describe_file(TREE)
    tree = parse_json(stored.read_bytes(TREE), where)
    try:
        check_tree(tree)
    except (TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{where}: {e}") from None
    return tree


MAX_DEPTH = 100  # nesting levels of a tree.json (decoding recurses once per level)
MAX_RANK = 32  # dimensions of an array leaf (NumPy's limit is 64)
_SCALAR_TYPES: dict[str, tuple[type, ...]] = {
    "bool": (bool,),
    "int": (int,),
    "float": (int, float),
    "str": (str,),
}


def check_tree(tree: Any) -> None:
    """Every node of a tree read from disk has the fields and types `encode` writes; ValueError
    or TypeError naming the key path otherwise. Array leaves: a known `kind`, a shape of ints
    >= 0, a dtype from the allow-list (`check_dtype_name`), each leaf's `f` used once."""
    files: set[str] = set()
    todo: list[tuple[Any, KeyPath]] = [(tree, ())]
    while todo:
        node, path = todo.pop()
        try:
            _check_node(node, path, files, todo)
        except (TypeError, ValueError) as e:  # the key path is spelled out only for a message
            raise type(e)(f"at {keystr(path)}: {e}") from None


def _check_node(node: Any, path: KeyPath, files: set[str], todo: list[tuple[Any, KeyPath]]) -> None:
    """One node of `check_tree`; its children go to `todo`."""
    if len(path) > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
    if not isinstance(node, dict) or not isinstance(node.get("t"), str):
        raise TypeError("a node must be an object with a type 't'")
    t = node["t"]
    if t in ("dict", "namedtuple", "custom"):
        keys, children = node.get("k"), node.get("c")
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise TypeError("'k' must be a list of str")
        if not isinstance(children, list) or len(children) != len(keys):
            raise TypeError("'c' must be a list as long as 'k'")
        if len(set(keys)) != len(keys):
            raise ValueError("a key appears twice")
        todo += [(c, (*path, k)) for k, c in zip(keys, children, strict=True)]
    elif t in ("list", "tuple"):
        children = node.get("c")
        if not isinstance(children, list):
            raise TypeError("'c' must be a list")
        todo += [(c, (*path, i)) for i, c in enumerate(children)]
    elif t in _SCALAR_TYPES:
        v = node.get("v")
        if not isinstance(v, _SCALAR_TYPES[t]) or (t != "bool" and isinstance(v, bool)):
            raise TypeError(f"a {t} node holds {v!r:.40}")
    elif t == "complex":
        v = node.get("v")
        if not (
            isinstance(v, list)
            and len(v) == 2
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)
        ):
            raise TypeError(f"a complex node holds {v!r:.40}")
    elif t in ("array", "npscalar"):
        _check_array_node(node, files)
    elif t != "none":
        raise ValueError(f"unknown node type {t!r:.40}")


#: What typed PRNG keys a train state may hold (``"prng"`` of an array node: the stored array
#: is their key data, uint32): the implementations jax.random names.
PRNG_IMPLS = frozenset({"threefry2x32", "rbg", "unsafe_rbg"})


def _check_array_node(node: dict[str, Any], files: set[str]) -> None:
    prng = node.get("prng")
    if prng is not None and (
        not isinstance(prng, str) or prng not in PRNG_IMPLS or node.get("dtype") != "<u4"
    ):
        raise ValueError(f"PRNG keys {prng!r:.40} of {node.get('dtype')!r:.20}: not what jax keeps")
    f, shape = node.get("f"), node.get("shape")
    if not isinstance(f, str) or f in files:
        raise ValueError(f"leaf file {f!r:.80} is missing or used twice")
    check_relative(f)
    files.add(f)
    if not _int_list(shape, 0) or len(shape) > MAX_RANK:
        raise ValueError(f"shape {shape!r:.80} is not a list of ints >= 0")
    if node["t"] == "npscalar" and shape:
        raise ValueError(f"a NumPy scalar has shape {shape!r:.80}")
    for key in ("dtype", "saved_from"):
        if key in node or key == "dtype":
            check_dtype_name(node.get(key), key)
    if "chunk" in node:
        chunk = node["chunk"]
        if not _int_list(chunk, 1) or len(chunk) != len(shape):
            raise ValueError(f"chunk {chunk!r:.80} is not a list of ints >= 1 of rank {len(shape)}")


def _int_list(value: Any, least: int) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(
        isinstance(n, int) and not isinstance(n, bool) and least <= n < 2**62 for n in value
    )


def check_dtype_name(name: Any, what: str) -> np.dtype:
    """The dtype a stored name stands for, if it is one an array handler writes: booleans,
    integers, floats and complex numbers (NumPy's and the ml_dtypes ones). ValueError otherwise
    (an object or string dtype must never come from disk)."""
    if isinstance(name, str) and (name in _ML_DTYPES or len(name) <= 8):
        try:
            dtype = dtype_from_name(name)
        except ValueError:
            pass
        else:
            if name in _ML_DTYPES or (dtype.kind in "biufc" and dtype.str == name):
                return dtype
    raise ValueError(f"{what} {name!r:.40} is not a stored dtype (numbers and booleans only)")


def decode(
    node: Mapping[str, Any], read_leaf: ReadLeaf, target: Any = NONE, path: KeyPath = ()
) -> Any:
    """Rebuild the value of `node`: as saved, or (given `target`) in the target's shape and types.

    Containers must agree with the target in kind, keys and length, else MismatchError naming the
    key path; array nodes go to `read_leaf(node, target_leaf, path)`, which checks the rest. A
    target leaf of None means "as saved" for that leaf.
    """
    t = node["t"]
    if target is NONE or target is None:
        if t in _SCALARS:
            return _SCALARS[t](node.get("v"))
        if t in ("dict", "namedtuple", "custom"):
            return {
                k: decode(c, read_leaf, NONE, (*path, k))
                for k, c in zip(node["k"], node["c"], strict=True)
            }
        if t in ("list", "tuple"):
            children = [decode(c, read_leaf, NONE, (*path, i)) for i, c in enumerate(node["c"])]
            return children if t == "list" else tuple(children)
        if t in ("array", "npscalar"):
            return read_leaf(node, NONE, path)
        raise CorruptCheckpointError(f"unknown node type {t!r} at {keystr(path)} in {TREE}")
    if isinstance(target, Mapping):  # also for a namedtuple or registered node: by field name
        by_key = _match_keys(
            node, list(target), path, "a dict", ok=("dict", "namedtuple", "custom")
        )
        return like(
            target, {k: decode(by_key[k], read_leaf, target[k], (*path, k)) for k in target}
        )
    if isinstance(target, tuple) and hasattr(target, "_fields") and t not in ("list", "tuple"):
        fields = _match_keys(
            node, list(target._fields), path, "a namedtuple", ok=("namedtuple", "dict", "custom")
        )
        values = [
            decode(fields[f], read_leaf, v, (*path, f))
            for f, v in zip(target._fields, target, strict=True)
        ]
        return type(target)(*values)
    if isinstance(target, (list, tuple)):
        if t not in ("list", "tuple"):
            raise MismatchError(
                f"at {keystr(path)}: the target is a {type(target).__qualname__}, the checkpoint a {t}"
            )
        if len(node["c"]) != len(target):
            raise MismatchError(
                f"at {keystr(path)}: the target has {len(target)} entries, the checkpoint {len(node['c'])}"
            )
        values = [
            decode(c, read_leaf, v, (*path, i))
            for i, (c, v) in enumerate(zip(node["c"], target, strict=True))
        ]
        if isinstance(target, list):
            return values
        return type(target)(*values) if hasattr(target, "_fields") else tuple(values)
    keyed = flatten_custom(target)
    if keyed is not None:
        keys = [k for k, _ in keyed]
        what = f"a {type(target).__qualname__}"
        by_key = _match_keys(node, keys, path, what, ok=("custom", "dict", "namedtuple"))
        values = [decode(by_key[k], read_leaf, v, (*path, k)) for k, v in keyed]
        return unflatten_custom(target, values)
    if t in _CONTAINERS:
        raise MismatchError(
            f"at {keystr(path)}: the target is a leaf ({type(target).__qualname__}), the checkpoint a {t}"
        )
    if t in ("array", "npscalar"):
        return read_leaf(node, target, path)
    if hasattr(target, "shape") and hasattr(target, "dtype"):
        raise MismatchError(f"at {keystr(path)}: the target is an array, the checkpoint a {t}")
    return _SCALARS[t](node.get("v"))


def like(target: Mapping[str, Any], values: dict[str, Any]) -> Any:
    """`values` as the target's mapping type (OrderedDict, FrozenDict...) when it can be built so."""
    if type(target) is dict:
        return values
    try:
        return type(target)(values)  # type: ignore[call-arg]
    except Exception:
        return values


def flatten_custom(obj: Any) -> list[tuple[str, Any]] | None:
    """(key, child) pairs of a jax-registered pytree node, or None for anything else."""
    if "jax" not in sys.modules or is_arraylike(obj) or hasattr(obj, "dtype"):
        return None
    keyed = _flatten_custom(obj)
    return None if keyed is None else [(_key_name(k), v) for k, v in keyed]


def unflatten_custom(target: Any, children: list[Any]) -> Any:
    """A node of the target's type (and static data) with new children."""
    from jax import tree_util

    one_level = tree_util.tree_structure(target, is_leaf=lambda x: x is not target)
    return tree_util.tree_unflatten(one_level, children)


def _match_keys(
    node: Mapping[str, Any],
    keys: list[str],
    path: KeyPath,
    what: str,
    ok: tuple[str, ...] = ("dict",),
) -> dict[str, Any]:
    if node["t"] not in ok:
        raise MismatchError(
            f"at {keystr(path)}: the target is {what}, the checkpoint a {node['t']}"
        )
    stored = list(node["k"])
    if set(stored) != set(keys):
        missing = sorted(set(keys) - set(stored))
        extra = sorted(set(stored) - set(keys))
        raise MismatchError(
            f"at {keystr(path)}: keys differ; only in the target: {missing}, only in the checkpoint: {extra}"
        )
    return dict(zip(stored, node["c"], strict=True))


def check_leaf(
    node: Mapping[str, Any],
    target: Any,
    path: KeyPath,
    *,
    dtype: np.dtype | None = None,
    check_dtype: bool = True,
) -> None:
    """Shape and dtype (`dtype`, else the stored one) against a target leaf; MismatchError names both."""
    if (
        target is NONE
        or target is None
        or not (hasattr(target, "shape") and hasattr(target, "dtype"))
    ):
        return
    want_shape, have_shape = tuple(target.shape), tuple(node["shape"])
    if want_shape != have_shape:
        raise MismatchError(
            f"at {keystr(path)}: shape {have_shape} in the checkpoint, {want_shape} in the target"
        )
    have = dtype if dtype is not None else dtype_from_name(node["dtype"])
    if check_dtype and np.dtype(target.dtype) != have:
        raise MismatchError(
            f"at {keystr(path)}: dtype {have} in the checkpoint, {np.dtype(target.dtype)} in the target"
        )


def describe_tree(stored: StoredItem, kind: str) -> dict[str, Any]:
    """What both array handlers' describe() return: every leaf with its key path, and the bytes."""
    leaves = []
    for path, node in walk_leaves(load_tree(stored)):
        if node["t"] in ("array", "npscalar"):
            fields = {k: node[k] for k in ("shape", "dtype", "chunk", "prng") if k in node}
            leaves.append({"path": keystr(path), **fields})
        else:
            leaves.append({"path": keystr(path), "value": node.get("v"), "type": node["t"]})
    return {"kind": kind, "leaves": leaves, "bytes": sum(r.size for r in stored.files.values())}


def walk_leaves(
    node: Mapping[str, Any], path: KeyPath = ()
) -> list[tuple[KeyPath, Mapping[str, Any]]]:
    """Every leaf node (arrays and scalars) with its key path, in storage order."""
    if node["t"] in ("dict", "namedtuple", "custom"):
        out = []
        for k, c in zip(node["k"], node["c"], strict=True):
            out += walk_leaves(c, (*path, k))
        return out
    if node["t"] in ("list", "tuple"):
        out = []
        for i, c in enumerate(node["c"]):
            out += walk_leaves(c, (*path, i))
        return out
    return [(path, node)]


# ---------------------------------------------------------------------------- dtypes

_ML_DTYPES = frozenset(
    {
        "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
        "float8_e4m3b11fnuz", "float8_e3m4", "float8_e4m3", "float8_e8m0fnu", "float4_e2m1fn",
        "float6_e2m3fn", "float6_e3m2fn", "int2", "int4", "uint2", "uint4",
    }
)  # fmt: skip


def dtype_name(dtype: np.dtype) -> str:
    """How a dtype is written down: NumPy's own string (``<f4``), or the ml_dtypes name (``bfloat16``)."""
    return dtype.name if dtype.kind == "V" and dtype.name in _ML_DTYPES else dtype.str


#: Longer than any name `dtype_name` writes: a longer one read from a file is not parsed.
_MAX_DTYPE_NAME = 32


def dtype_from_name(name: str) -> np.dtype:
    """The dtype `dtype_name` wrote as `name`, or any other name NumPy parses (``"float32"``).

    A name read from a file may be anything, and NumPy's parser raises TypeError, ValueError or
    SyntaxError by the string (``"bogus"``, ``"(2147483648,)f8"``, ``"(1,2"``): every name that
    is no dtype, and anything not a str, is ValueError here. Whether the dtype is one a reader
    takes is its own check (`check_dtype_name`: numbers and booleans)."""
    if not isinstance(name, str) or not 0 < len(name) <= _MAX_DTYPE_NAME:
        raise ValueError(f"dtype {name!r:.40} is not a dtype's name")
    if name in _ML_DTYPES:
        import ml_dtypes  # a dependency of jax; needed only for bfloat16 and friends

        try:
            return np.dtype(getattr(ml_dtypes, name))
        except AttributeError:
            raise ValueError(f"dtype {name!r}: not in this ml_dtypes") from None
    try:
        return np.dtype(name)
    except Exception as e:  # TypeError, ValueError, SyntaxError (ast.literal_eval), ...
        raise ValueError(f"dtype {name!r:.40} is not understood: {e!s:.100}") from None
