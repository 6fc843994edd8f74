"""Orbax's `args` objects as cairn items and restore targets, and cairn's results as Orbax's.

Every item has a *kind*, the Orbax handler family its args belong to: ``standard``, ``pytree``
(both saved by cairn's TrainStateHandler), ``json`` (JsonHandler), ``array`` and ``grain``
(GrainIteratorHandler). A save records each item's kind in the step's metadata, so that a new
manager restores an item without args as Orbax does.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from cairn.handlers import JsonHandler, TrainStateRestore, handler_by_id, register
from cairn.handlers.io import optional

ocp = optional("orbax.checkpoint", feature="cairn.manager.orbax.CheckpointManager")
jax = optional("jax", feature="cairn.manager.orbax.CheckpointManager")

TREES = ("standard", "pytree")

_SAVE: dict[type, str] = {
    ocp.args.StandardSave: "standard",
    ocp.args.PyTreeSave: "pytree",
    ocp.args.JsonSave: "json",
    ocp.args.ArraySave: "array",
}
_RESTORE: dict[type, str] = {
    ocp.args.StandardRestore: "standard",
    ocp.args.PyTreeRestore: "pytree",
    ocp.args.JsonRestore: "json",
    ocp.args.ArrayRestore: "array",
}
_HANDLERS: dict[type, str] = {
    ocp.StandardCheckpointHandler: "standard",
    ocp.PyTreeCheckpointHandler: "pytree",
    ocp.JsonCheckpointHandler: "json",
    ocp.ArrayCheckpointHandler: "array",
}
_GRAIN_MODULE = "grain._src.python.checkpoint"


def _grain(cls: type, name: str) -> bool:
    """Grain's PyGrainCheckpointSave / Restore / Handler, told apart without importing grain."""
    return cls.__module__.startswith(_GRAIN_MODULE) and cls.__name__ == name


def kind_of_args(args: Any, *, saving: bool) -> str | None:
    """The kind of an Orbax args object (a subclass counts as its class), else None."""
    table = _SAVE if saving else _RESTORE
    for cls in type(args).__mro__:
        if cls in table:
            return table[cls]
        if _grain(cls, "CheckpointSave" if saving else "CheckpointRestore"):
            return "grain"
    return None


def kind_of_handler(handler: Any) -> str | None:
    """The kind of an Orbax handler (a subclass counts as its class; a legacy Checkpointer
    wraps a handler whose args Orbax does not know, and the wrapped one counts)."""
    if type(handler).__name__.endswith("LegacyCheckpointHandlerWrapper"):
        handler = getattr(handler, "_handler", handler)
    for cls in type(handler).__mro__:
        if cls in _HANDLERS:
            return _HANDLERS[cls]
        if _grain(cls, "CheckpointHandler"):
            return "grain"
    return None


def args_class(kind: str, *, saving: bool) -> type:
    """Orbax's args class of `kind` (legacy calls, which give items without args)."""
    if kind == "grain":
        grain = optional("grain.python", feature="a grain iterator item")
        return grain.PyGrainCheckpointSave if saving else grain.PyGrainCheckpointRestore
    table = _SAVE if saving else _RESTORE
    return next(cls for cls, k in table.items() if k == kind)


def handler_typestr(kind: str) -> str:
    """The Orbax handler class a step's metadata names for items of `kind`."""
    for cls, k in _HANDLERS.items():
        if k == kind:
            return f"{cls.__module__}.{cls.__qualname__}"
    return f"{_GRAIN_MODULE}.handler.CheckpointHandler"


def is_composite(args: Any) -> bool:
    return isinstance(args, ocp.args.Composite)


def composite(items: Mapping[str, Any]) -> Any:
    return ocp.args.Composite(**items)


# JSON items go to cairn's JsonHandler: these private types pick it (`handler_for` walks the
# MRO), and the manifest records the JsonHandler's id, so any reader restores them.
class _JsonDict(dict):
    pass


class _JsonList(list):
    pass


register(handler_by_id(JsonHandler.id), _JsonDict, _JsonList)


def save_value(name: str, kind: str, args: Any) -> Any:
    """What cairn saves for item `name`: TypeError or ValueError (nothing written) for what
    cairn would store otherwise than Orbax."""
    item = args.item
    if kind in TREES:
        save_args = getattr(args, "save_args", None)
        if save_args is not None:
            for leaf in jax.tree_util.tree_leaves(
                save_args, is_leaf=lambda x: isinstance(x, ocp.SaveArgs)
            ):
                if isinstance(leaf, ocp.SaveArgs) and leaf.dtype is not None:
                    raise ValueError(
                        f"item {name!r}: save_args casts to {leaf.dtype}; cairn saves arrays in "
                        "their own dtype: cast them before saving, or save through "
                        "cairn.handlers.TrainStateHandler(save_dtype=...)"
                    )
        return item
    if kind == "json":
        if isinstance(item, Mapping):
            return _JsonDict(item)
        if isinstance(item, list):
            return _JsonList(item)
        raise TypeError(f"item {name!r}: JsonSave takes a mapping, got {type(item).__qualname__}")
    if kind == "array" and not (hasattr(item, "shape") and hasattr(item, "dtype")):
        raise TypeError(f"item {name!r}: ArraySave takes an array, got {type(item).__qualname__}")
    return item


# ------------------------------------------------------------------ restoring pytrees

_MISMATCH = "User-provided restore item and on-disk value metadata tree structures do not match: {}"
Key = tuple[str, ...]


def _norm(path: tuple[Any, ...]) -> Key:
    """A key path as strings, whether it came from jax (DictKey, GetAttrKey, SequenceKey...)
    or from cairn's stored tree (str keys, int indices)."""
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                k = getattr(k, attr)
                break
        out.append(str(k))
    return tuple(out)


def _leaves(tree: Any, is_leaf: Callable[[Any], bool]) -> tuple[list[tuple[Key, Any]], Any]:
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [(_norm(p), leaf) for p, leaf in flat], treedef


def _user_leaf(x: Any) -> bool:
    return x is None or x is ocp.PLACEHOLDER or isinstance(x, ocp.RestoreArgs)


@dataclasses.dataclass(frozen=True)
class _Placed:
    """A cairn target leaf that says only where the array goes (its sharding)."""

    sharding: Any


@dataclasses.dataclass(frozen=True)
class _Want:
    """How one leaf the user asked for comes back."""

    sharding: Any = None
    restore_type: Any = None
    dtype: Any = None
    shape: tuple[int, ...] | None = None


def _want(leaf: Any, args: Any) -> _Want:
    """From the item's leaf (an array or ShapeDtypeStruct, or a structure-only object) and
    its RestoreArgs (ArrayRestoreArgs: a sharding, or a mesh and axes)."""
    sharding = getattr(leaf, "sharding", None)
    dtype = getattr(leaf, "dtype", None)
    shape = getattr(leaf, "shape", None)
    restore_type: Any = None
    if isinstance(leaf, np.ndarray):
        restore_type = np.ndarray
    elif isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
        restore_type = jax.Array
    elif isinstance(leaf, (bool, int, float, complex)):  # a Python scalar comes back as one
        restore_type, dtype, shape = type(leaf), None, None
    if isinstance(args, ocp.RestoreArgs):
        restore_type = args.restore_type or restore_type
        dtype = args.dtype if args.dtype is not None else dtype
        if isinstance(args, ocp.ArrayRestoreArgs):
            if args.sharding is not None:
                sharding = args.sharding
            elif args.mesh is not None:
                axes = args.mesh_axes
                spec = axes if isinstance(axes, jax.sharding.PartitionSpec) else None
                if spec is None:
                    spec = jax.sharding.PartitionSpec(*(axes or ()))
                sharding = jax.sharding.NamedSharding(args.mesh, spec)
            if args.global_shape is not None:
                shape = tuple(args.global_shape)
    if sharding is not None and not isinstance(sharding, jax.sharding.Sharding):
        sharding = None  # a ShapeDtypeStruct's sharding may be a placeholder; read as saved
    return _Want(sharding, restore_type, dtype, None if shape is None else tuple(shape))


def _finish_leaf(value: Any, want: _Want, key: Key) -> Any:
    if want.shape is not None and hasattr(value, "shape") and tuple(value.shape) != want.shape:
        raise ValueError(
            f"at {'/'.join(key)}: shape {tuple(value.shape)} in the checkpoint, {want.shape} "
            "requested"
        )
    rt = want.restore_type
    if rt in (int, float, bool, complex):
        return rt(np.asarray(value).item())
    if want.dtype is not None and hasattr(value, "astype") and value.dtype != want.dtype:
        value = value.astype(want.dtype)
    if rt is np.ndarray:
        return np.asarray(value)
    if isinstance(value, (int, float, bool)) and want.dtype is not None:
        value = np.asarray(value, dtype=want.dtype)
    as_jax = rt is jax.Array or want.sharding is not None
    if as_jax and not isinstance(value, jax.Array):
        value = jax.device_put(value, want.sharding) if want.sharding else jax.device_put(value)
    return value


@dataclasses.dataclass
class Plan:
    """An item's target for cairn's restore, and what turns cairn's result into Orbax's."""

    target: Any
    finish: Callable[[Any], Any]


def _same(x: Any) -> Any:
    return x


NEVER = TrainStateRestore(None, where=lambda path: False)  # the stored tree, no array read


def tree_plan(args: Any, skeleton: Any) -> Plan:
    """A pytree item's restore: `skeleton` is the stored tree with its arrays left unread
    (restored with `NEVER`). The user's `item` (or, without one, `restore_args`) gives the
    structure; its leaves and RestoreArgs say where and as what each leaf comes back;
    ``...`` (PLACEHOLDER) leaves are not read; with ``partial_restore`` the stored leaves the
    item lacks are not read either. Any other difference of structure is Orbax's ValueError."""
    item = getattr(args, "item", None)
    restore_args = getattr(args, "restore_args", None)
    if item is None and restore_args is None:
        return Plan(None, _same)
    user, treedef = _leaves(item if item is not None else restore_args, _user_leaf)
    per_leaf: dict[Key, Any] = {}
    if item is not None and restore_args is not None:
        flat, _ = _leaves(restore_args, _user_leaf)
        per_leaf = dict(flat)
        lacking = sorted(k for k, leaf in user if leaf is not ocp.PLACEHOLDER and k not in per_leaf)
        if lacking:  # a misspelled key, a prefix tree: Orbax's pytree structure error
            raise ValueError(
                "restore_args does not have the structure of the item: no RestoreArgs at "
                f"{['/'.join(k) or '<root>' for k in lacking[:5]]}"
            )
    stored, _ = _leaves(skeleton, lambda x: x is None)
    have = {k for k, _ in stored}
    wants: dict[Key, _Want] = {}
    for key, leaf in user:
        if key not in have:
            raise ValueError(
                _MISMATCH.format(f"{'/'.join(key) or '<root>'} is not in the checkpoint")
            )
        if leaf is not ocp.PLACEHOLDER:
            args_leaf = per_leaf.get(key, leaf if item is None else None)
            wants[key] = _want(None if item is None else leaf, args_leaf)
    extra = have - {k for k, _ in user}
    if extra and not getattr(args, "partial_restore", False):
        raise ValueError(
            _MISMATCH.format(
                f"the checkpoint also holds {sorted('/'.join(k) for k in extra)[:5]}; pass "
                "partial_restore=True to restore only what the item names"
            )
        )

    def target_leaf(path: tuple[Any, ...], _: Any) -> Any:
        want = wants.get(_norm(path))
        return None if want is None or want.sharding is None else _Placed(want.sharding)

    target = jax.tree_util.tree_map_with_path(target_leaf, skeleton, is_leaf=lambda x: x is None)
    wanted = set(wants)
    restore = TrainStateRestore(target, where=lambda path: _norm(path) in wanted)

    def finish(restored: Any) -> Any:
        got = dict(_leaves(restored, lambda x: x is None)[0])
        values = [
            ocp.PLACEHOLDER if leaf is ocp.PLACEHOLDER else _finish_leaf(got[k], wants[k], k)
            for k, leaf in user
        ]
        return jax.tree_util.tree_unflatten(treedef, values)

    return Plan(restore, finish)


def shardings_of(tree: Any) -> dict[str, Any]:
    """Each ``jax.Array`` leaf's NamedSharding (mesh axes, device ids, partition spec), keyed
    by its key path, for a restore without args to place the arrays as saved (Orbax reads its
    ``_sharding`` file for that)."""
    out = {}
    flat, _ = _leaves(tree, lambda x: x is None)
    for key, leaf in flat:
        sharding = getattr(leaf, "sharding", None)
        if isinstance(leaf, jax.Array) and isinstance(sharding, jax.sharding.NamedSharding):
            mesh = sharding.mesh
            out[_json_key(key)] = {
                "axes": [[str(n), int(size)] for n, size in mesh.shape.items()],
                "devices": [int(d.id) for d in mesh.devices.flat],
                "spec": [list(p) if isinstance(p, tuple) else p for p in sharding.spec],
            }
    return out


def _json_key(key: Key) -> str:
    return "/".join(k.replace("%", "%25").replace("/", "%2F") for k in key)


def _saved_sharding(record: Any) -> Any:
    """The NamedSharding `shardings_of` recorded, on this run's devices; None (read onto one
    device) if this run lacks a device it was saved on, or the record is odd."""
    try:
        by_id = {d.id: d for d in jax.devices()}
        devices = [by_id[int(i)] for i in record["devices"]]
        names = [str(n) for n, _ in record["axes"]]
        shape = [int(size) for _, size in record["axes"]]
        mesh = jax.sharding.Mesh(np.array(devices, dtype=object).reshape(shape), names)
        spec = [tuple(p) if isinstance(p, list) else p for p in record["spec"]]
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
    except Exception:  # a record this manager did not write: read onto one device
        return None


def as_saved_plan(skeleton: Any, recorded: Mapping[str, Any]) -> Plan:
    """A pytree restored without a structure: arrays saved with a NamedSharding come back with
    it when this run has the devices they were saved on (as Orbax's restore without args),
    the rest as saved."""

    def target_leaf(path: tuple[Any, ...], _: Any) -> Any:
        record = recorded.get(_json_key(_norm(path)))
        sharding = None if record is None else _saved_sharding(record)
        return None if sharding is None else _Placed(sharding)

    target = jax.tree_util.tree_map_with_path(target_leaf, skeleton, is_leaf=lambda x: x is None)
    return Plan(TrainStateRestore(target), _same)


def item_plan(kind: str, args: Any, skeleton: Any, recorded: Mapping[str, Any]) -> Plan:
    """An item's plan: pytrees by `tree_plan` (without a structure: `as_saved_plan`); a grain
    iterator is moved in place (the iterator given is returned, as Orbax does); JSON and
    arrays come back as saved."""
    if kind in TREES and skeleton is not None and not _has_structure(args):
        return as_saved_plan(skeleton, recorded)
    if args is None:
        return Plan(None, _same)
    if kind in TREES:
        return tree_plan(args, skeleton)
    if kind == "grain":
        return Plan(args.item, _same)
    if kind == "array":
        return Plan(None, np.asarray)
    return Plan(None, _same)


def restore_args_for(typestr: Any) -> Any:
    """Orbax's args that restore, as saved, an item whose handler Orbax recorded as
    `typestr`; None for a handler without such args (grain's needs the iterator)."""
    for cls, kind in _HANDLERS.items():
        if typestr == f"{cls.__module__}.{cls.__qualname__}" or (
            isinstance(typestr, str) and typestr.endswith("." + cls.__name__)
        ):
            return next(c for c, k in _RESTORE.items() if k == kind)()
    return None


def _has_structure(args: Any) -> bool:
    return args is not None and (
        getattr(args, "item", None) is not None or getattr(args, "restore_args", None) is not None
    )


def needs_skeleton(kind: str, args: Any, recorded: Mapping[str, Any]) -> bool:
    """Whether the plan needs the stored tree: for a structure to match, or shardings to apply."""
    return kind in TREES and (_has_structure(args) or bool(recorded))


class TreeMetadata(dict):
    """A pytree item's metadata, as Orbax's: the stored tree (dicts and lists) with a
    ``jax.ShapeDtypeStruct`` for each array and the value of each Python scalar; also as
    ``.tree``, Orbax's attribute."""

    @property
    def tree(self) -> dict[str, Any]:
        return dict(self)


def tree_metadata(skeleton: Any, described: Mapping[str, Any]) -> Any:
    """`TreeMetadata` from the stored tree (`NEVER`) and cairn's description of its leaves."""
    by_path = {leaf.get("path"): leaf for leaf in described.get("leaves", ())}

    def leaf(path: tuple[Any, ...], value: Any) -> Any:
        keys = [getattr(k, "key", getattr(k, "idx", k)) for k in path]
        found = by_path.get("".join(f"[{k!r}]" for k in keys) or "<root>", {})
        if "shape" not in found:
            return value
        try:
            dtype: Any = np.dtype(found["dtype"])
        except TypeError:
            dtype = found["dtype"]
        return jax.ShapeDtypeStruct(tuple(found["shape"]), dtype)

    tree = jax.tree_util.tree_map_with_path(leaf, skeleton, is_leaf=lambda x: x is None)
    return TreeMetadata(tree) if isinstance(tree, Mapping) else tree


_FLOAT = "$float"  # NaN and infinities in a record (JSON has none): {"$float": "nan"}


def encode_floats(value: Any) -> Any:
    """`value` (JSON data) with each non-finite float as ``{"$float": repr}``: a diverged
    run's NaN loss is saved, not refused, and comes back as the float it was."""
    if isinstance(value, float) and not math.isfinite(value):
        return {_FLOAT: repr(value)}
    if isinstance(value, Mapping):
        return {k: encode_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [encode_floats(v) for v in value]
    return value


def decode_floats(value: Any) -> Any:
    if isinstance(value, Mapping):
        if set(value) == {_FLOAT} and value[_FLOAT] in ("nan", "inf", "-inf"):
            return float(value[_FLOAT])
        return {k: decode_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_floats(v) for v in value]
    return value


def to_json(name: str, value: Any) -> Any:
    """`value` with NumPy and JAX scalars and small arrays as Python numbers and lists, for
    metrics; TypeError naming `name` for anything JSON cannot hold."""

    def plain(x: Any) -> Any:
        if isinstance(x, Mapping):
            return {str(k): plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        if isinstance(x, (str, bool, int, float)) or x is None:
            return x
        if hasattr(x, "dtype") and hasattr(x, "shape"):
            return plain(np.asarray(x).tolist())
        raise TypeError(f"{name}: {type(x).__qualname__} is not JSON (a number, str, list, dict)")

    try:
        return plain(value)
    except RecursionError:
        raise TypeError(f"{name} is nested too deeply, or holds itself") from None
