"""Writes a step in T5X's own ("legacy") layout, as t5x/checkpoints.py does, for the tests.

Followed from google-research/t5x ``t5x/checkpoints.py`` (``Checkpointer.save``,
``_write_state_to_tensorstore``, ``_get_parameter_infos``) and flax's ``serialization``
(``msgpack_serialize``, ``_msgpack_ext_pack``, ``_chunk_array_leaves_in_place``), without
importing either (neither is installed here):

- the step is written into ``checkpoint_<step>.tmp-<int32 time>`` and renamed to
  ``checkpoint_<step>`` once the ``checkpoint`` file is in it;
- a partitioned leaf (here: chosen by `partitioned`) is written with TensorStore to a zarr array
  (gzip, chunks from T5X's greedy chooser) at the relative path ``'/'.join(key path)`` with
  ``/`` replaced by ``.``; in the msgpack file its place holds the spec's JSON
  (``ts.Spec(spec).to_json()``: driver zarr, dtype, kvstore file + relative path, metadata);
- ``target`` leaves are cast to `save_dtype` (a partitioned one through TensorStore's cast
  driver, as T5X, so its spec says the saved dtype);
- every other leaf goes into the msgpack file: ndarrays and jax arrays as ext type 1
  ``(shape, dtype name, bytes)``, NumPy scalars as ext type 3, complex numbers as ext type 2;
  arrays over `chunk_bytes` are split into ``__msgpack_chunked_array__`` dicts;
- the file is ``msgpack({"version": 3, "optimizer": state_dict})``;
- a tf.data iterator goes to ``train_ds-000-of-001`` through ``tf.train.Checkpoint(ds=it)``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

VERSION = 3
MAX_CHUNK_BYTES = 2**30  # flax's MAX_CHUNK_SIZE


def _ndarray_to_bytes(arr: np.ndarray) -> bytes:
    arr = np.asarray(arr)
    return msgpack.packb((arr.shape, arr.dtype.name, arr.tobytes("C")), use_bin_type=True)


def _ext_pack(x: Any) -> Any:
    if isinstance(x, np.ndarray) or type(x).__module__.startswith("jax"):
        return msgpack.ExtType(1, _ndarray_to_bytes(np.asarray(x)))
    if isinstance(x, np.generic):
        return msgpack.ExtType(3, _ndarray_to_bytes(np.asarray(x)))
    if isinstance(x, complex):
        return msgpack.ExtType(2, msgpack.packb((x.real, x.imag)))
    return x


def _chunk(tree: Any, chunk_bytes: int) -> Any:
    """flax's _chunk_array_leaves_in_place: arrays over chunk_bytes become chunked dicts."""
    if isinstance(tree, dict):
        return {k: _chunk(v, chunk_bytes) for k, v in tree.items()}
    if isinstance(tree, np.ndarray) and tree.size and tree.nbytes > chunk_bytes:
        flat = tree.reshape(-1)
        per = max(1, chunk_bytes // tree.itemsize)
        pieces = [flat[i : i + per] for i in range(0, flat.size, per)]
        return {
            "__msgpack_chunked_array__": True,
            "shape": list(tree.shape),
            "chunks": {str(i): p for i, p in enumerate(pieces)},
        }
    return tree


def msgpack_bytes(tree: Any, chunk_bytes: int = MAX_CHUNK_BYTES) -> bytes:
    """flax.serialization.msgpack_serialize of a state dict."""
    return msgpack.packb(_chunk(tree, chunk_bytes), default=_ext_pack, strict_types=True)


def _choose_chunk_shape(write_shape: tuple[int, ...], target_elements: int) -> list[int]:
    """T5X's greedy chunk chooser: halve the largest dimension's divisors until it fits."""
    factors = [[i for i in range(1, n + 1) if n % i == 0] or [1] for n in write_shape]
    while int(np.prod([f[-1] for f in factors])) > target_elements:
        dim = max(range(len(factors)), key=lambda i: factors[i][-1])
        if factors[dim][-1] <= 1:
            break
        factors[dim].pop()
    return [f[-1] for f in factors]


def _flatten(tree: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    out: dict[tuple[str, ...], Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            out.update(_flatten(value, (*prefix, key)))
        else:
            out[(*prefix, key)] = value
    return out


def _unflatten(flat: Mapping[tuple[str, ...], Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def write_legacy_step(
    root: Path,
    state_dict: Mapping[str, Any],
    *,
    step: int | None = None,
    partitioned: Callable[[tuple[str, ...], np.ndarray], bool] = lambda path, arr: arr.ndim >= 2,
    save_dtype: Any = np.float32,
    dataset_iterator: Any = None,
    chunk_bytes: int = MAX_CHUNK_BYTES,
    target_chunk_bytes: int = 64 * 1024 * 1024,
    version: int = VERSION,
    commit: bool = True,
) -> Path:
    """Write `state_dict` (T5X's ``{"target": ..., "state": {"step", "param_states"}}``) as T5X's
    Checkpointer.save would; returns the step directory (the .tmp one if not `commit`)."""
    import tensorstore as ts

    if step is None:
        step = int(np.asarray(state_dict["state"]["step"]))
    final_dir = Path(root) / f"checkpoint_{step}"
    tmp_dir = Path(f"{final_dir}.tmp-{int(np.int32(time.time()))}")
    if final_dir.exists():
        return final_dir  # T5X: "Skipping save checkpoint for step ..."
    tmp_dir.mkdir(parents=True)
    written: dict[tuple[str, ...], Any] = {}
    for path, value in _flatten(state_dict).items():
        is_target = path[0] == "target"
        is_array = isinstance(value, np.ndarray) or type(value).__module__.startswith("jax")
        if not is_array or not partitioned(path, np.asarray(value)):
            if is_target and save_dtype is not None and is_array:
                value = np.asarray(value).astype(save_dtype)
            written[path] = value
            continue
        arr = np.asarray(value)
        name = "/".join(path).replace("/", ".")
        chunks = _choose_chunk_shape(arr.shape, max(1, target_chunk_bytes // arr.dtype.itemsize))
        spec = {
            "driver": "zarr",
            "dtype": np.dtype(arr.dtype).name,
            "kvstore": {"driver": "file", "path": name},
            "metadata": {"compressor": {"id": "gzip"}, "shape": arr.shape, "chunks": chunks},
        }
        cast = is_target and save_dtype is not None
        if cast:
            spec["dtype"] = np.dtype(save_dtype).name
        relative = ts.Spec(spec).to_json()
        absolute = ts.Spec(spec).to_json()
        absolute["kvstore"]["path"] = os.path.join(tmp_dir, absolute["kvstore"]["path"])
        if cast:
            absolute = {"base": absolute, "driver": "cast", "dtype": np.dtype(arr.dtype).name}
        store = ts.open(absolute, create=True, open=True).result()
        store.write(arr).result()
        written[path] = relative
    if dataset_iterator is not None:
        import tensorflow as tf

        tf.train.Checkpoint(ds=dataset_iterator).write(str(tmp_dir / "train_ds-000-of-001"))
    body = msgpack_bytes({"version": version, "optimizer": _unflatten(written)}, chunk_bytes)
    (tmp_dir / "checkpoint").write_bytes(body)
    if not commit:
        return tmp_dir
    os.rename(tmp_dir, final_dir)
    return final_dir
