"""T5X's train states on cairn: state dicts and templates, placement, T5X's LazyArray, casts,
and reading a cairn step's item ``state`` as T5X restores it."""

from __future__ import annotations

import math
import os
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from cairn.handlers import LazyArray as _StoredLazy
from cairn.handlers import TrainStateRestore
from cairn.handlers.errors import MismatchError
from cairn.manager._core.manager import CheckpointManager
from cairn.manager._core.validate import as_step

STATE, DATASET = "state", "dataset"

PathLike = str | os.PathLike[str]

# ---------------------------------------------------------------------------- train states


def _state_dict(train_state: Any, what: str = "train_state") -> dict[str, Any]:
    """T5X's state-dict layout for any accepted train state (see `Checkpointer`)."""
    if callable(getattr(train_state, "state_dict", None)) and callable(
        getattr(train_state, "restore_state", None)
    ):
        return dict(train_state.state_dict())  # a T5X TrainState
    if isinstance(train_state, Mapping):
        if isinstance(train_state.get("state"), Mapping) and "step" in train_state["state"]:
            return dict(train_state)  # already a T5X state dict
        if "step" not in train_state:
            raise ValueError(
                f"{what}: a dict train state needs a 'step' entry (and 'params' or 'target', "
                f"'opt_state'); it has {sorted(map(str, train_state))}"
            )
        params_key = "params" if "params" in train_state else "target"
        if params_key not in train_state:
            raise ValueError(f"{what}: a dict train state needs 'params' (or 'target')")
        rest = {k: v for k, v in train_state.items() if k not in ("step", params_key, "opt_state")}
        state = {"step": train_state["step"], "param_states": train_state.get("opt_state")}
        return {"target": train_state[params_key], "state": state, **rest}
    if all(hasattr(train_state, a) for a in ("step", "params", "opt_state")):
        return {  # a flax-style TrainState (struct dataclass with step, params, opt_state)
            "target": train_state.params,
            "state": {"step": train_state.step, "param_states": train_state.opt_state},
        }
    raise TypeError(
        f"{what} must be a T5X TrainState (state_dict/restore_state), a flax-style TrainState "
        f"(step, params, opt_state) or a dict with 'step', 'params' and 'opt_state'; got "
        f"{type(train_state).__qualname__}"
    )


def _rebuild(template: Any, state_dict: Mapping[str, Any]) -> Any:
    """A train state of the template's kind holding `state_dict` (T5X: restore_state)."""
    if callable(getattr(template, "restore_state", None)):
        return template.restore_state(dict(state_dict))
    if isinstance(template, Mapping):
        if isinstance(template.get("state"), Mapping) and "step" in template["state"]:
            return dict(state_dict)
        params_key = "params" if "params" in template else "target"
        rest = {k: v for k, v in state_dict.items() if k not in ("target", "state")}
        out = {
            "step": state_dict["state"]["step"],
            params_key: state_dict["target"],
            "opt_state": state_dict["state"]["param_states"],
            **rest,
        }
        return {k: out[k] for k in template if k in out} | out  # the template's key order
    return template.replace(
        step=state_dict["state"]["step"],
        params=state_dict["target"],
        opt_state=state_dict["state"]["param_states"],
    )


def _step_of(state_dict: Mapping[str, Any]) -> int:
    step = state_dict["state"]["step"]
    if callable(getattr(step, "get", None)) and not isinstance(step, Mapping):
        step = step.get()  # a LazyArray
    return as_step(np.asarray(step), argument="train_state step")


def _is_target(path: Sequence[Any]) -> bool:
    return bool(path) and path[0] == "target"


def _restore_target(train_state: Any, partitioner: Any) -> dict[str, Any]:
    """The state dict to restore into: the template's leaves, placed by the partitioner."""
    template = _state_dict(train_state)
    if partitioner is None:
        return template
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    if callable(getattr(partitioner, "get_mesh_axes", None)) and hasattr(partitioner, "mesh"):
        mesh, specs = partitioner.mesh, _state_dict(partitioner.get_mesh_axes(train_state))
    elif (
        isinstance(partitioner, tuple)
        and len(partitioner) == 2
        and isinstance(partitioner[0], jax.sharding.Mesh)
    ):
        mesh, specs = partitioner[0], _state_dict(partitioner[1], "partitioner")
    else:
        mesh, specs = None, _state_dict(partitioner, "partitioner")

    def is_spec(x: Any) -> bool:
        return x is None or isinstance(x, (PartitionSpec, jax.sharding.Sharding))

    flat_specs = {
        jax.tree_util.keystr(p): s
        for p, s in jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]
    }

    def place(path: Any, leaf: Any) -> Any:
        spec = flat_specs.get(jax.tree_util.keystr(path))
        if spec is None or not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            return leaf
        if isinstance(spec, PartitionSpec):
            if mesh is None:
                raise TypeError(
                    "partitioner: PartitionSpecs need a mesh; pass (mesh, specs) or a T5X "
                    "partitioner with .mesh and get_mesh_axes()"
                )
            spec = NamedSharding(mesh, spec)
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=spec)

    return jax.tree_util.tree_map_with_path(place, template)


def _call_save_fns(fns: Sequence[Callable[..., Any]], state_dict: dict[str, Any]) -> Any:
    """T5X save transformations: ``fn(state_dict, parameter_infos) -> (state_dict, infos)``;
    cairn has no parameter infos, so they get None (and may return the state dict alone)."""
    for fn in fns:
        out = fn(state_dict, None)
        state_dict = out[0] if isinstance(out, tuple) else out
    return state_dict


def _check_fns(fns: Any, what: str) -> tuple[Callable[..., Any], ...]:
    if isinstance(fns, (str, bytes)) or not isinstance(fns, Iterable):
        raise TypeError(f"{what} must be a sequence of functions, got {fns!r}")
    fns = tuple(fns)
    for fn in fns:
        if not callable(fn):
            raise TypeError(f"{what} must hold functions, got {fn!r}")
    return fns


# ---------------------------------------------------------------------------- restoring as T5X


class LazyArray:
    """T5X's LazyArray: a leaf that reads its value on ``get()`` (``lazy_parameters=True``).

    `shape` and `dtype` are known without reading; ``astype(dtype)`` returns another LazyArray
    that casts when read; ``get()`` reads again on every call (nothing is cached, as T5X), and
    ``get_async()`` reads on a thread and returns an asyncio future. Every leaf of a lazily
    restored state is one, 0-d ones (``step``, scalar optimizer states) included.
    """

    def __init__(self, shape: Sequence[int], dtype: Any, get_fn: Callable[[], Any]) -> None:
        if not callable(get_fn):
            raise TypeError(f"LazyArray: get_fn must be callable, got {get_fn!r}")
        self._shape = tuple(int(d) for d in shape)
        self._dtype = np.dtype(dtype)
        self._get_fn = get_fn

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self._shape) * self._dtype.itemsize

    def astype(self, dtype: Any) -> LazyArray:
        return type(self)(self._shape, dtype, self._get_fn)

    def get(self) -> np.ndarray:
        arr = np.asarray(self._get_fn())
        return arr if arr.dtype == self._dtype else arr.astype(self._dtype)

    def get_async(self) -> Any:
        import asyncio

        return asyncio.wrap_future(_lazy_pool().submit(self.get))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        arr = self.get()
        return arr if dtype is None else arr.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={self.shape}, dtype={self.dtype})"


_POOL: list[Any] = []
_POOL_LOCK = threading.Lock()


def _lazy_pool() -> Any:
    with _POOL_LOCK:
        if not _POOL:
            from concurrent.futures import ThreadPoolExecutor

            _POOL.append(ThreadPoolExecutor(thread_name_prefix="cairn-t5x-lazy"))
        return _POOL[0]


_NUMBERS = (bool, int, float, complex, np.generic)


def _as_t5x_lazy(leaf: Any) -> Any:
    """A restored leaf as T5X's LazyArray (arrays and numbers; strings and None stay)."""
    if isinstance(leaf, LazyArray):
        return leaf
    if isinstance(leaf, _StoredLazy):
        return LazyArray(leaf.shape, leaf.dtype, leaf.get)
    if isinstance(leaf, _NUMBERS) or (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
        value = leaf
        return LazyArray(np.shape(value), np.asarray(value).dtype, lambda: value)
    return leaf


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _map_leaves(
    tree: Any, fn: Callable[[tuple[str, ...], Any], Any], path: tuple[str, ...] = ()
) -> Any:
    """`fn(names, leaf)` over the leaves of a pytree (dicts, lists, tuples, namedtuples and
    JAX-registered nodes), keeping its containers; None stays None."""
    if tree is None:
        return None
    if isinstance(tree, Mapping):
        out = {k: _map_leaves(v, fn, (*path, str(k))) for k, v in tree.items()}
        maker: Any = type(tree)
        try:
            return maker(out)
        except TypeError:
            return out
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(
            *[_map_leaves(v, fn, (*path, f)) for f, v in zip(tree._fields, tree, strict=True)]
        )
    if isinstance(tree, (list, tuple)):
        values = [_map_leaves(v, fn, (*path, str(i))) for i, v in enumerate(tree)]
        return values if isinstance(tree, list) else tuple(values)
    if "jax" in sys.modules and not hasattr(tree, "dtype") and not isinstance(tree, _StoredLazy):
        from jax import tree_util

        flat = tree_util.default_registry.flatten_one_level_with_keys(tree)
        if flat is not None:
            children = [_map_leaves(v, fn, (*path, _key_name(k))) for k, v in flat[0]]
            one_level = tree_util.tree_structure(tree, is_leaf=lambda x: x is not tree)
            return tree_util.tree_unflatten(one_level, children)
    return fn(path, tree)


def _leaves(tree: Any) -> dict[tuple[str, ...], Any]:
    found: dict[tuple[str, ...], Any] = {}

    def add(path: tuple[str, ...], leaf: Any) -> Any:
        found[path] = leaf
        return leaf

    _map_leaves(tree, add)
    return found


def _check_shapes(state: Any, template: Any) -> None:
    """T5X's check and message: every array of the template has its shape in the checkpoint."""
    read = _leaves(state)
    for path, want in _leaves(template).items():
        have: Any = read.get(path)
        if not (hasattr(want, "shape") and hasattr(have, "shape")):
            continue
        if tuple(have.shape) != tuple(want.shape):
            name = "/".join(path)
            raise MismatchError(
                f"Shape of `{name}` in checkpoint {tuple(have.shape)} does not match expected "
                f"{tuple(want.shape)}."
            )


def _cast_leaf(leaf: Any, dtype: np.dtype) -> Any:
    """T5X's ``_cast``: arrays (and LazyArrays) not of `dtype` are cast; Python numbers and
    strings are left alone."""
    if isinstance(leaf, (bool, int, float, complex, str, bytes)) or not hasattr(leaf, "dtype"):
        return leaf
    if np.dtype(leaf.dtype) == dtype:
        return leaf
    return leaf.astype(dtype)


def _read_as(dtype: np.dtype) -> Callable[[Any, Any], Any]:
    """Make a not yet read leaf cast to `dtype` when read (no second copy in memory)."""

    def retype(_: Any, leaf: Any) -> Any:
        if isinstance(leaf, _StoredLazy):
            leaf.dtype = dtype
        return leaf

    return retype


def _cast_target(state: dict[str, Any], dtype: np.dtype | None) -> dict[str, Any]:
    if dtype is None or "target" not in state:
        return state
    return {**state, "target": _map_leaves(state["target"], lambda _, x: _cast_leaf(x, dtype))}


def _with_target(fn: Callable[..., Any], target: Any) -> Callable[[Any, Any], Any]:
    """A restore transformation called as T5X calls it: ``fn(state_dict, target_state_dict)``."""
    return lambda state, _: fn(state, target)


class _AnyLeaf:
    """Where the template has a leaf, while the checkpoint's structure is matched against it:
    no shape or dtype, so they are checked here with T5X's message, and dtypes come from the
    checkpoint."""


_ANY = _AnyLeaf()


def _read_state(
    mgr: CheckpointManager,
    step: int,
    *,
    template: dict[str, Any] | None,
    transforms: Sequence[Callable[[Any, Any], Any]],
    fallback_state: Any,
    lazy: bool,
    restore_dtype: np.dtype | None,
    dataset: Any = None,
) -> dict[str, Any]:
    """The train state of `step` as T5X restores it.

    First the checkpoint is opened lazily (nothing read but its structure): the transforms run,
    the fallback fills the gaps, the result takes the template's structure, and each array's
    shape is checked against the template's (T5X's message). Leaves keep the dtype saved in the
    checkpoint (T5X: the template gives structure, shapes and placement, not dtypes);
    `restore_dtype` casts every array of ``target`` as it is after the transforms, integer ones
    too, while reading. Lazily, every leaf is a LazyArray; else all leaves are read at once,
    placed as the template's (or the partitioner's) arrays.
    """
    skeleton = None if template is None else _map_leaves(template, lambda _, x: _ANY)
    opened = TrainStateRestore(
        skeleton,
        transforms=[*transforms, lambda state, _: state],  # always the path without dtype checks
        fallback_state=fallback_state,
        lazy=True,
    )
    state: dict[str, Any] = mgr.restore(step, {STATE: opened})[STATE]
    if template is not None:
        _check_shapes(state, template)
    if restore_dtype is not None and isinstance(state, Mapping) and "target" in state:
        # where the transforms put them (as T5X): the params are cast as they are read
        state = {**state, "target": _map_leaves(state["target"], _read_as(restore_dtype))}
    if lazy:
        if dataset is not None:
            mgr.restore(step, {DATASET: dataset})
        state = _map_leaves(state, lambda _, x: _as_t5x_lazy(x))
    else:
        items: dict[str, Any] = {
            STATE: TrainStateRestore(template, transforms=[lambda _s, _t: state])
        }
        if dataset is not None:
            items[DATASET] = dataset
        state = mgr.restore(step, items)[STATE]
    return _cast_target(state, restore_dtype)
