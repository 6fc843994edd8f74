"""A restored state: `LazyArray` leaves, read for their targets (with their shardings, as jax or
NumPy arrays, PRNG keys) by `_materialize`; the subtree, fallback state and alignment with the
target of T5X-style restores."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from cairn.handlers._optional import optional
from cairn.handlers._train_state.layout import _full_index
from cairn.handlers._train_state.prng import _Keys
from cairn.handlers._train_state.read import _Batch, _LeafReader, _read_pool
from cairn.handlers._tree import KeyPath, flatten_custom, keystr, like, unflatten_custom
from cairn.handlers.errors import MismatchError


class LazyArray:
    """A leaf of a restored train state that reads its data on first use (``get()``, ``np.asarray``).

    `shape` and `dtype` are known without reading. ``get()`` returns an ``np.ndarray`` (cast to the
    restore dtype, if any) and caches nothing, as T5X's LazyArray.
    """

    def __init__(self, reader: _LeafReader, dtype: np.dtype, keys: _Keys | None = None) -> None:
        self._reader = reader
        self._keys = keys
        self.shape: tuple[int, ...] = reader.shape if keys is None else keys.shape
        self.dtype: Any = dtype if keys is None else keys.dtype
        self._read_dtype = dtype  # of the stored data (uint32 key data for keys)
        self.path = reader.path

    def get(self) -> Any:
        """An ``np.ndarray``; for typed PRNG keys, a jax key array."""
        data = self._reader.read().result().astype(self._read_dtype, copy=False)
        return data if self._keys is None else self._keys.wrap(data)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        arr = self.get()
        return arr if dtype is None else arr.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"LazyArray({keystr(self.path)}, shape={self.shape}, dtype={self.dtype})"


class _Scalar:
    """A NumPy scalar leaf, read like an array and returned as a scalar."""

    def __init__(self, reader: _LeafReader, dtype: np.dtype) -> None:
        self.reader, self.dtype = reader, dtype
        self.shape = reader.shape

    def get(self) -> Any:
        return self.reader.read().result().astype(self.dtype, copy=False)[()]


def _is_lazy(x: Any) -> bool:
    return isinstance(x, (LazyArray, _Scalar))


def _map_with_target(
    tree: Any, target: Any, fn: Callable[[Any, Any], Any], is_leaf: Callable[[Any], bool] = _is_lazy
) -> Any:
    """Map `fn(leaf, target_leaf)` over the leaves of `tree`, walking `target` alongside (or None)."""
    if is_leaf(tree):
        return fn(tree, target)
    if isinstance(tree, Mapping):
        return like(
            tree, {k: _map_with_target(v, _child(target, k), fn, is_leaf) for k, v in tree.items()}
        )
    if isinstance(tree, (list, tuple)):
        values = [_map_with_target(v, _child(target, i), fn, is_leaf) for i, v in enumerate(tree)]
        if isinstance(tree, list):
            return values
        return type(tree)(*values) if hasattr(tree, "_fields") else tuple(values)
    keyed = flatten_custom(tree)
    if keyed is not None:
        return unflatten_custom(
            tree, [_map_with_target(v, _child(target, k), fn, is_leaf) for k, v in keyed]
        )
    return tree


def _child(target: Any, key: str | int) -> Any:
    if target is None:
        return None
    if isinstance(target, Mapping):
        return target.get(key)
    if isinstance(target, (list, tuple)) and isinstance(key, int):
        return target[key] if key < len(target) else None
    return getattr(target, key, None) if isinstance(key, str) else None


def _materialize(state: Any, target: Any) -> Any:
    """Read every lazy leaf: check every leaf's metadata first, then start all reads, then wait.
    The checks run on the read pool where each is a request (the zarr layout's ``zarr.json`` on
    an object store), on this thread otherwise: a task each would cost more than the check."""
    readers: list[_LeafReader] = []
    _map_with_target(
        state,
        None,
        lambda leaf, _: readers.append(
            leaf._reader if isinstance(leaf, LazyArray) else leaf.reader
        ),
    )
    remote = []
    for reader in readers:
        if reader.index is None and not reader.stored.source.cheap_size:
            remote.append(reader)
        else:
            reader.check()
    for _ in _read_pool().map(_LeafReader.check, remote):
        pass
    batch = _Batch()
    started = _map_with_target(state, target, lambda leaf, t: _start_read(leaf, t, batch))
    batch.start()
    return _map_with_target(started, None, lambda finish, _: finish(), is_leaf=callable)


def _start_read(leaf: Any, target: Any, batch: _Batch) -> Callable[[], Any]:
    """Start reading `leaf` for `target` (or add its chunks to `batch`); the returned function
    waits and assembles."""
    if isinstance(leaf, _Scalar):
        future = leaf.reader.read(batch=batch)
        return lambda: future.result().astype(leaf.dtype, copy=False)[()]
    reader, dtype, keys = leaf._reader, leaf._read_dtype, leaf._keys
    wrap = keys.wrap if keys is not None else lambda data: data
    sharding = getattr(target, "sharding", None)
    if sharding is not None and "jax" in sys.modules:
        jax = optional("jax", feature="a JAX train state")

        # Keys' data has the keys' shape and more: a sharding of the keys shards it alike.
        index_map = sharding.addressable_devices_indices_map(reader.shape)
        futures = {
            d: reader.read(_full_index(idx, reader.shape) if idx else (), batch, share=True)
            for d, idx in index_map.items()
        }

        def assemble() -> Any:
            arrays = [
                jax.device_put(f.result().astype(dtype, copy=False), d) for d, f in futures.items()
            ]
            return wrap(jax.make_array_from_single_device_arrays(reader.shape, sharding, arrays))

        return assemble
    jax_module = sys.modules.get("jax")
    if target is None:
        as_jax = reader.node.get("kind") == "jax"
    else:
        as_jax = jax_module is not None and isinstance(
            target, (jax_module.Array, jax_module.ShapeDtypeStruct)
        )
    future = reader.read(batch=batch, share=as_jax and keys is None)  # to JAX: never written

    def finish() -> Any:
        arr = future.result().astype(dtype, copy=False)
        if keys is not None:
            return keys.wrap(arr)
        if as_jax:
            jax = optional("jax", feature="a JAX train state")

            return jax.device_put(arr)
        return arr

    return finish


def _subtree(tree: Mapping[str, Any], key: str | int, whole: tuple[str | int, ...]) -> Any:
    if tree["t"] in ("dict", "namedtuple", "custom") and key in tree["k"]:
        return tree["c"][tree["k"].index(key)]
    if tree["t"] in ("list", "tuple") and isinstance(key, int) and 0 <= key < len(tree["c"]):
        return tree["c"][key]
    raise MismatchError(f"subtree {keystr(whole)}: the checkpoint has no key {key!r} there")


def _fill_from(state: Any, fallback: Any, target: Any) -> Any:
    """T5X's fallback_state: keys the (transformed) checkpoint lacks come from `fallback`."""
    if isinstance(fallback, Mapping):
        merged = dict(state) if isinstance(state, Mapping) else {}
        for key, value in fallback.items():
            if key in merged:
                merged[key] = _fill_from(merged[key], value, None)
            else:
                merged[key] = value
        return merged
    return state


def _align(state: Any, target: Any, path: KeyPath) -> Any:
    """After transforms/fallback: give the state the target's structure and types, checking shapes.

    The state comes from a restore without target, so namedtuples and custom nodes are dicts there.
    """
    if isinstance(target, Mapping):
        by_key = _by_keys(state, list(target), path)
        return like(target, {k: _align(by_key[k], target[k], (*path, k)) for k in target})
    if isinstance(target, tuple) and hasattr(target, "_fields") and isinstance(state, Mapping):
        fields = _by_keys(state, list(target._fields), path)
        return type(target)(
            *[_align(fields[f], t, (*path, f)) for f, t in zip(target._fields, target, strict=True)]
        )
    if isinstance(target, (list, tuple)):
        if not isinstance(state, (list, tuple)) or len(state) != len(target):
            raise MismatchError(
                f"at {keystr(path)}: the target has {len(target)} entries, the restored state "
                f"is a {type(state).__qualname__} of {len(state) if isinstance(state, (list, tuple)) else '-'}"
            )
        values = [
            _align(s, t, (*path, i)) for i, (s, t) in enumerate(zip(state, target, strict=True))
        ]
        if isinstance(target, list):
            return values
        return type(target)(*values) if hasattr(target, "_fields") else tuple(values)
    keyed = flatten_custom(target)
    if keyed is not None:
        if isinstance(state, Mapping):
            by_key = _by_keys(state, [k for k, _ in keyed], path)
            return unflatten_custom(target, [_align(by_key[k], t, (*path, k)) for k, t in keyed])
        state_keyed = flatten_custom(state) or []
        if [k for k, _ in state_keyed] != [k for k, _ in keyed]:
            raise MismatchError(
                f"at {keystr(path)}: the restored state does not match the target's {type(target).__qualname__}"
            )
        return unflatten_custom(
            target,
            [_align(s, t, (*path, k)) for (k, t), (_, s) in zip(keyed, state_keyed, strict=True)],
        )
    if (
        hasattr(target, "shape")
        and hasattr(state, "shape")
        and tuple(target.shape) != tuple(state.shape)
    ):
        raise MismatchError(
            f"at {keystr(path)}: shape {tuple(state.shape)} in the restored state, "
            f"{tuple(target.shape)} in the target"
        )
    return state


def _by_keys(state: Any, keys: list[str], path: KeyPath) -> Mapping[str, Any]:
    if not isinstance(state, Mapping):
        raise MismatchError(
            f"at {keystr(path)}: the target has keys {keys}, the restored state is a {type(state).__qualname__}"
        )
    missing = sorted(set(keys) - set(state))
    extra = sorted(set(state) - set(keys))
    if missing or extra:
        raise MismatchError(
            f"at {keystr(path)}: keys differ after transforms and fallback; only in the target: "
            f"{missing}, only in the restored state: {extra}"
        )
    return state
