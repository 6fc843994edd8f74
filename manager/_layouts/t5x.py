"""Steps a T5X job already wrote, read in place and never changed (cairn.manager.t5x uses it).

Local directories only: T5X's legacy layout is read from a POSIX path (its arrays through
TensorStore's ``file`` kvstore), not through the `base.StepView` that object stores provide, so
a T5X legacy step in a bucket is not found (a CheckpointManager on a bucket does list a T5X step
in Orbax's layout, as any Orbax step; `t5x_steps` here reads local directories only).

T5X's own ("legacy") layout, as ``t5x/checkpoints.py`` writes it::

    checkpoint_<step>/                  committed by renaming checkpoint_<step>.tmp-<time>
      checkpoint                        msgpack (flax serialization) of
                                        {"version": 3, "optimizer": <state dict>}
      target.encoder.layers_0.kernel/   a zarr array (gzip) written with TensorStore
      train_ds-000-of-001.*             the tf.data iterator (tf.train.Checkpoint)

Small leaves sit in the msgpack file itself (flax's ext types: 1 an ndarray, 2 a complex, 3 a
NumPy scalar, each ndarray ``(shape, dtype name, bytes)``); a partitioned leaf is replaced there
by the TensorStore spec it was written with, a dict with ``driver``, ``kvstore`` and
``metadata`` whose path is relative to the step directory.

Everything in such a step is a stranger's data: the msgpack file is parsed with bounds (no
ext type but flax's three, numeric dtypes only, a buffer that matches its shape), and a spec
is never handed to TensorStore as it is. cairn builds its own spec from it: the ``zarr``
driver, the ``file`` kvstore, and a path that must be relative, of plain names, inside the step
directory, with no link on the way and nothing but directories and regular files in the array's
directory. A spec naming any other driver, an absolute path, ``..`` or a kvstore other than
T5X's own (``file``/``gfile``, or ``gcs`` with a relative path, which T5X itself reads from the
step directory when the checkpoint was copied off GCS) is refused with CorruptCheckpointError
naming the file and the key path.

Restoring into a template follows T5X's Checkpointer: transformations, then `fallback_state`,
then every leaf of the template is looked up by its key path; a missing one or a shape that
differs raises (T5X's message); the params (``target``) are cast to `restore_dtype` if given,
every other leaf keeps the dtype the checkpoint has.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import os
import re
import stat
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cairn.handlers.errors import CorruptCheckpointError, MismatchError
from cairn.handlers.io import dtype_from_name, dtype_name, read_no_follow, within
from cairn.manager._format import StepNames

log = logging.getLogger("cairn")

CHECKPOINT_FILE = "checkpoint"
MANIFEST = "_CHECKPOINT.json"  # cairn's manifest: a step that has one is cairn's, not T5X's
VERSIONS = (2, 3)  # T5X writes 3 since 2021; 2 differs only in how bfloat16 went to TensorStore
NAMES = StepNames("checkpoint")  # T5X's step names, as its checkpointer's manager parses them
_EXT_NDARRAY, _EXT_COMPLEX, _EXT_NPSCALAR = 1, 2, 3
_CHUNKED = "__msgpack_chunked_array__"  # flax splits arrays over 1 GiB into these
_KVSTORES = ("file", "gfile", "gcs")
_READERS = 8  # arrays read at once (TensorStore parallelises within an array too)
_MAX_DEPTH = 256  # a state dict is a few levels deep; bounds the walk (no RecursionError)  # T5X maps gcs to the step directory when reading locally


# ---------------------------------------------------------------------------- finding steps


def is_legacy_step(path: Path) -> bool:
    """Whether `path` is a committed T5X step: a real directory holding a regular ``checkpoint``
    file and no cairn manifest (links are never followed)."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return False
        if os.path.lexists(path / MANIFEST):
            return False
        return stat.S_ISREG(os.lstat(path / CHECKPOINT_FILE).st_mode)
    except OSError:
        return False


def legacy_steps(root: Path) -> dict[int, Path]:
    """T5X steps in `root` by step: ``checkpoint_<step>`` directories with a ``checkpoint`` file
    (T5X's own ``all_steps`` glob); its in-progress ``checkpoint_<step>.tmp-<time>`` never
    count, nor zero-padded names (``step_format_fixed_length``), which the manager does not
    list either, so that every listing here agrees with the checkpointer's."""
    found: dict[int, Path] = {}
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return found
    for entry in entries:
        step = NAMES.parse(entry.name)
        if step is not None and is_legacy_step(Path(entry.path)):
            found.setdefault(step, Path(entry.path))
    return found


# ---------------------------------------------------------------------------- the msgpack file


def _numeric(dtype: np.dtype) -> bool:
    """Booleans, integers, floats (bfloat16 and the other ml_dtypes too), complex numbers."""
    return not dtype.hasobject and (dtype.kind in "biufc" or dtype_name(dtype) != dtype.str)


def _ndarray(data: bytes, file: Path) -> np.ndarray:
    """flax's ndarray encoding, checked: ``(shape, dtype name, C-order bytes)``."""
    import msgpack

    try:
        shape, name, buffer = msgpack.unpackb(data, raw=True)
        if isinstance(name, bytes):
            name = name.decode("ascii")
        if not isinstance(name, str) or not isinstance(buffer, bytes):
            raise TypeError("not (shape, dtype name, bytes)")
        if not isinstance(shape, (list, tuple)) or not all(
            isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**63 for n in shape
        ):
            raise TypeError(f"shape {shape!r:.100}")
        dtype = dtype_from_name(name)
    except (ValueError, TypeError, LookupError, AttributeError) as e:
        raise CorruptCheckpointError(f"{file}: a malformed array in the msgpack file: {e}") from e
    if not _numeric(dtype):
        raise CorruptCheckpointError(f"{file}: an array of dtype {dtype} (numbers only)")
    if math.prod(shape) * dtype.itemsize != len(buffer):
        raise CorruptCheckpointError(
            f"{file}: an array of shape {tuple(shape)} and dtype {dtype} holds {len(buffer)} bytes"
        )
    return np.frombuffer(buffer, dtype=dtype).reshape(shape).copy()


def _index(key: Any) -> int | None:
    """A list index written as a map key ("0", "12"), or None: not a string of at most 18 ASCII
    digits ("²" is a digit to `str.isdigit` and not to `int`; 5,000 digits are too many)."""
    ok = isinstance(key, str) and 0 < len(key) <= 18 and key.isascii() and key.isdigit()
    return int(key) if ok else None


def _unchunk(node: Mapping[str, Any], file: Path, where: str) -> np.ndarray:
    chunks, shape = node.get("chunks"), node.get("shape")
    if not isinstance(chunks, Mapping) or not isinstance(shape, (list, tuple)) or not chunks:
        raise CorruptCheckpointError(f"{file}: a malformed chunked array at {where}")
    order = {_index(k): k for k in chunks}
    if None in order or sorted(order) != list(range(len(chunks))):  # type: ignore[type-var]
        raise CorruptCheckpointError(
            f"{file}: the chunked array at {where} has chunks named other than 0..{len(chunks) - 1}"
        )
    parts = [chunks[order[i]] for i in range(len(chunks))]
    if not all(isinstance(p, np.ndarray) for p in parts):
        raise CorruptCheckpointError(f"{file}: a chunked array at {where} holds a non-array")
    try:
        return np.concatenate([p.reshape(-1) for p in parts]).reshape(shape)
    except (ValueError, TypeError) as e:
        raise CorruptCheckpointError(f"{file}: the chunked array at {where}: {e}") from e


def _parse(data: bytes, file: Path) -> Any:
    import msgpack

    def ext_hook(code: int, payload: bytes) -> Any:
        if code == _EXT_NDARRAY:
            return _ndarray(payload, file)
        if code == _EXT_NPSCALAR:
            return _ndarray(payload, file)[()]
        if code == _EXT_COMPLEX:
            try:
                real, imag = msgpack.unpackb(payload)
                return complex(real, imag)
            except (ValueError, TypeError) as e:
                raise CorruptCheckpointError(f"{file}: a malformed complex number: {e}") from e
        raise CorruptCheckpointError(f"{file}: unknown msgpack ext type {code} (not flax's)")

    try:
        return msgpack.unpackb(data, ext_hook=ext_hook, raw=False, strict_map_key=True)
    except CorruptCheckpointError:
        raise
    except Exception as e:  # truncated, extra data, a map key that is not a str, too deep, ...
        raise CorruptCheckpointError(
            f"{file} is not a T5X checkpoint file (msgpack): {type(e).__name__}: {e!s:.200}"
        ) from e


def _is_spec(node: Any) -> bool:
    """T5X's test for a TensorStore spec among the state dict's nodes."""
    return isinstance(node, dict) and {"driver", "kvstore", "metadata"} <= set(node)


# ---------------------------------------------------------------------------- TensorStore arrays


class LegacyArray:
    """A leaf T5X wrote with TensorStore, read on ``get()`` (T5X's LazyArray surface: `shape`,
    `dtype`, ``get()``, ``np.asarray``). The spec was checked when the file was read."""

    def __init__(self, step_dir: Path, relpath: str, spec: Mapping[str, Any], where: str) -> None:
        self.step_dir, self.relpath, self.where = step_dir, relpath, where
        meta = spec.get("metadata")
        shape = meta.get("shape") if isinstance(meta, Mapping) else None
        if not isinstance(shape, (list, tuple)) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
        ):
            raise CorruptCheckpointError(f"{where}: the spec's metadata has no valid shape")
        self.shape: tuple[int, ...] = tuple(shape)
        name = spec.get("dtype")  # T5X always writes it: without it a leaf would be float64
        if name is None:
            raise CorruptCheckpointError(f"{where}: the spec has no dtype")
        try:
            self.dtype: np.dtype = dtype_from_name(name)
        except ValueError as e:  # any name at all (dtype_from_name's ValueError)
            raise CorruptCheckpointError(f"{where}: {e}") from None
        if not _numeric(self.dtype):
            raise CorruptCheckpointError(f"{where}: dtype {self.dtype} (numbers only)")

    def _check_tree(self) -> Path:
        """The array's directory, after checking that it is inside the step and holds only
        directories and regular files (TensorStore would follow a link and block on a FIFO)."""
        path = within(self.step_dir, self.relpath, what=self.where)
        pending = [path]
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                raise CorruptCheckpointError(f"{self.where}: {path} is not a directory")
            while pending:
                with os.scandir(pending.pop()) as entries:
                    for entry in entries:
                        if entry.is_dir(follow_symlinks=False):
                            pending.append(Path(entry.path))
                        elif not entry.is_file(follow_symlinks=False):
                            raise CorruptCheckpointError(
                                f"{self.where}: {entry.path} is a link or not a regular file"
                            )
        except FileNotFoundError as e:
            raise CorruptCheckpointError(
                f"{self.where}: the array {e.filename} is missing"
            ) from None
        except OSError as e:
            raise CorruptCheckpointError(f"{self.where}: {path} cannot be read: {e}") from None
        return path

    def get(self) -> np.ndarray:
        import tensorstore as ts

        path = self._check_tree()
        spec: dict[str, Any] = {
            "driver": "zarr",
            "kvstore": {"driver": "file", "path": str(path)},
        }
        try:
            store = ts.open(spec, open=True, read=True).result()
        except Exception as e:  # .zarray missing or malformed
            raise CorruptCheckpointError(
                f"{self.where}: TensorStore cannot open {path}: {e!s:.300}"
            ) from e
        if tuple(store.shape) != self.shape:
            raise CorruptCheckpointError(
                f"{self.where}: {path} has shape {tuple(store.shape)}, the checkpoint file says "
                f"{self.shape}"
            )
        stored = np.dtype(store.dtype.numpy_dtype)
        nbytes = math.prod(self.shape) * stored.itemsize
        if nbytes > _memory_bytes():
            raise CorruptCheckpointError(
                f"{self.where}: {path} says shape {self.shape} of {stored} ({nbytes} bytes), "
                "more than this machine's memory"
            )
        if stored != self.dtype:
            raise CorruptCheckpointError(
                f"{self.where}: {path} has dtype {stored}, the checkpoint file says {self.dtype}"
            )
        try:
            return np.asarray(store.read().result())
        except Exception as e:  # a damaged chunk
            raise CorruptCheckpointError(
                f"{self.where}: TensorStore cannot read {path}: {e!s:.300}"
            ) from e

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        arr = self.get()
        return arr if dtype is None else arr.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"LegacyArray({self.relpath!r}, shape={self.shape}, dtype={self.dtype})"


def _memory_bytes() -> int:
    """Physical memory: no array that would not fit is read (a crafted shape is refused)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 2**62


def _array_path(spec: Mapping[str, Any], where: str) -> str:
    """The relative path of a spec's array; CorruptCheckpointError for anything T5X never
    writes: another driver or kvstore, an absolute path, ``..``."""
    if spec.get("driver") != "zarr":
        raise CorruptCheckpointError(
            f"{where}: TensorStore driver {spec.get('driver')!r:.50} (T5X writes zarr only)"
        )
    kvstore = spec.get("kvstore")
    if not isinstance(kvstore, Mapping):
        raise CorruptCheckpointError(f"{where}: the spec's kvstore is not an object")
    if kvstore.get("driver") not in _KVSTORES:
        raise CorruptCheckpointError(
            f"{where}: kvstore driver {kvstore.get('driver')!r:.50} refused: cairn reads T5X "
            "arrays only from the step directory (file, gfile, or gcs with a relative path)"
        )
    relpath = kvstore.get("path", spec.get("path"))  # TensorStore < 0.1.14 had it at the top
    if not isinstance(relpath, str) or not relpath:
        raise CorruptCheckpointError(f"{where}: the spec has no path")
    if relpath.startswith(("/", "\\")) or "://" in relpath or re.match(r"[A-Za-z]:", relpath):
        raise CorruptCheckpointError(
            f"{where}: absolute array path {relpath!r:.200} refused: T5X writes paths relative "
            "to the step directory, and cairn reads nothing outside it"
        )
    parts = relpath.rstrip("/").split("/")
    if any(p in ("..", ".", "") or "\\" in p for p in parts):
        raise CorruptCheckpointError(
            f"{where}: array path {relpath!r:.200} refused: it leaves the step directory or is "
            "not plain names"
        )
    return "/".join(parts)


def read_legacy(step_dir: Path) -> dict[str, Any]:
    """The state dict of a T5X step: nested dicts whose leaves are NumPy arrays or scalars (from
    the msgpack file), `LegacyArray` (TensorStore, read on ``get()``), None or plain values.

    CorruptCheckpointError naming the file for anything malformed or hostile; every spec is
    checked here, before any array is read."""
    file = step_dir / CHECKPOINT_FILE
    try:
        data = read_no_follow(file)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{file} is missing") from None
    except OSError as e:
        raise CorruptCheckpointError(f"{file} cannot be read: {e}") from e
    if data.startswith(b"model_checkpoint_path"):
        raise CorruptCheckpointError(
            f"{file} is a TensorFlow checkpoint, not a T5X one (T5X: restore_from_tf_checkpoint)"
        )
    contents = _parse(data, file)
    if not isinstance(contents, dict):
        raise CorruptCheckpointError(f"{file}: not a msgpack map")
    version = contents.get("version", 0)
    if version not in VERSIONS or not isinstance(contents.get("optimizer"), dict):
        raise CorruptCheckpointError(
            f"{file}: T5X checkpoint version {version!r:.20} with 'optimizer' "
            f"{type(contents.get('optimizer')).__name__}; cairn reads versions {VERSIONS}"
        )

    def walk(node: Any, path: tuple[str, ...]) -> Any:
        where = f"{file} at {'/'.join(path) or '<root>'}"
        if len(path) > _MAX_DEPTH:
            raise CorruptCheckpointError(f"{where}: nested deeper than {_MAX_DEPTH} levels")
        if isinstance(node, dict) and not all(isinstance(k, str) for k in node):
            raise CorruptCheckpointError(f"{where}: a map key that is not a string")
        if _is_spec(node):
            return LegacyArray(step_dir, _array_path(node, where), node, where)
        if isinstance(node, dict):
            if node.get(_CHUNKED) is True:
                return _unchunk(node, file, where)
            return {k: walk(v, (*path, k)) for k, v in node.items()}
        if isinstance(node, list):  # flax writes dicts; a list is taken as it is
            return [walk(v, (*path, str(i))) for i, v in enumerate(node)]
        return node

    out: dict[str, Any] = walk(contents["optimizer"], ())
    return out


# ---------------------------------------------------------------------------- restoring


class _Cast:
    """A lazy leaf (a LegacyArray or an in-memory value) with the dtype it will come back in."""

    def __init__(self, source: Any, dtype: np.dtype | None) -> None:
        self.source, self.shape = (
            source,
            tuple(np.shape(source) if not _lazy(source) else source.shape),
        )
        base = source.dtype if _lazy(source) else np.asarray(source).dtype
        self.dtype = np.dtype(dtype) if dtype is not None else base

    def get(self) -> Any:
        value = self.source.get() if _lazy(self.source) else self.source
        arr = np.asarray(value)
        if arr.dtype != self.dtype:
            arr = arr.astype(self.dtype)
        return arr

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        arr = self.get()
        return arr if dtype is None else arr.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"LazyArray(shape={self.shape}, dtype={self.dtype})"


def _lazy(x: Any) -> bool:
    return isinstance(x, (LegacyArray, _Cast))


def _key(entry: Any) -> str:
    for attr in ("key", "idx", "name"):  # DictKey, SequenceKey, GetAttrKey
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def _lookup(state: Any, keys: Sequence[str]) -> tuple[bool, Any]:
    node = state
    for k in keys:
        if isinstance(node, Mapping) and k in node:
            node = node[k]
        elif isinstance(node, (list, tuple)) and (i := _index(k)) is not None and i < len(node):
            node = node[i]
        elif (
            not isinstance(node, (Mapping, list, tuple))
            and not hasattr(node, "shape")  # never an array's attribute (`T`, `real`, ...)
            and hasattr(node, k)
        ):
            node = getattr(node, k)
        else:
            return False, None
    return True, node


def _merge(state: Any, fallback: Any) -> Any:
    """T5X's fallback_state: keys the (transformed) checkpoint lacks come from `fallback`."""
    if isinstance(fallback, Mapping):
        merged = dict(state) if isinstance(state, Mapping) else {}
        for key, value in fallback.items():
            merged[key] = _merge(merged[key], value) if key in merged else value
        return merged
    return state


def _materialize(leaf: Any, template: Any) -> Any:
    value = leaf.get() if _lazy(leaf) else leaf
    sharding = getattr(template, "sharding", None)
    jax_mod = sys.modules.get("jax")
    if jax_mod is not None and (
        sharding is not None or isinstance(template, (jax_mod.Array, jax_mod.ShapeDtypeStruct))
    ):
        return jax_mod.device_put(np.asarray(value), sharding)
    return value


def restore_into(
    saved: Mapping[str, Any],
    template: Any,
    *,
    restore_dtype: Any = None,
    cast: Callable[[tuple[str, ...]], bool],
    transforms: Sequence[Callable[[Any, Any], Any]] = (),
    fallback_state: Any = None,
    lazy: bool = False,
    where: str,
) -> Any:
    """`saved` (a state dict read from a T5X step) in the template's structure.

    Each leaf of `template` (arrays, ``jax.ShapeDtypeStruct`` with or without shardings) is
    looked up by its key path in the transformed, fallback-filled state; a missing key or a
    shape that differs raises MismatchError (T5X's message for shapes). Leaves selected by
    `cast` come back in `restore_dtype` if given; every other leaf in the checkpoint's dtype.
    `lazy`: every leaf comes back with ``get()`` instead of read.
    """
    import jax

    state: Any = saved
    for fn in transforms:
        state = fn(state, template)
    if fallback_state is not None:
        state = _merge(state, fallback_state)
    flat, treedef = jax.tree_util.tree_flatten_with_path(template)
    out: list[Any] = []
    for path, target in flat:
        keys = tuple(_key(p) for p in path)
        name = "/".join(keys)
        found, leaf = _lookup(state, keys)
        if not found:
            raise MismatchError(f"{where}: `{name}` is not in the checkpoint")
        if isinstance(leaf, (Mapping, list)) and not _lazy(leaf):
            raise MismatchError(f"{where}: `{name}` is a subtree in the checkpoint, not an array")
        if isinstance(leaf, (str, bytes)) and hasattr(target, "shape"):
            raise MismatchError(
                f"{where}: `{name}` is {type(leaf).__name__} {leaf!r:.80} in the checkpoint, not "
                "an array (cairn reads T5X's arrays from the msgpack file or TensorStore only)"
            )
        if leaf is None or isinstance(leaf, (str, bytes)):
            out.append(leaf)
            continue
        shape = leaf.shape if _lazy(leaf) else np.shape(leaf)
        expected = getattr(target, "shape", None)
        if expected is not None and tuple(shape) != tuple(expected):
            raise MismatchError(
                f"Shape of `{name}` in checkpoint {tuple(shape)} does not match expected "
                f"{tuple(expected)}. ({where})"
            )
        dtype = restore_dtype if restore_dtype is not None and cast(keys) else None
        lazy_leaf = _Cast(leaf, dtype)
        out.append(lazy_leaf if lazy else (lazy_leaf, target))
    if not lazy:  # every shape was checked above; now read the arrays, several at a time
        pending = [i for i, x in enumerate(out) if isinstance(x, tuple)]
        with concurrent.futures.ThreadPoolExecutor(_READERS, "cairn-t5x-read") as pool:
            values = list(pool.map(lambda i: _materialize(*out[i]), pending))
        for i, value in zip(pending, values, strict=True):
            out[i] = value
    return jax.tree_util.tree_unflatten(treedef, out)


def load_legacy(
    saved: Mapping[str, Any],
    *,
    restore_dtype: Any = None,
    cast: Callable[[tuple[str, ...]], bool],
    transforms: Sequence[Callable[[Any, Any], Any]] = (),
    lazy: bool = False,
) -> dict[str, Any]:
    """`saved` without a template (load_t5x_checkpoint): every leaf read (or lazy), the leaves
    selected by `cast` in `restore_dtype` if given."""
    state: Any = saved
    for fn in transforms:
        state = fn(state, None)

    def walk(node: Any, keys: tuple[str, ...]) -> Any:
        if isinstance(node, Mapping) and not _lazy(node):
            return {k: walk(v, (*keys, k)) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, (*keys, str(i))) for i, v in enumerate(node)]
        if node is None or isinstance(node, (str, bytes)):
            return node
        dtype = restore_dtype if restore_dtype is not None and cast(keys) else None
        leaf = _Cast(node, dtype)
        return leaf if lazy else leaf.get()

    out: dict[str, Any] = walk(state, ())
    return out


# ---------------------------------------------------------------------------- the dataset iterator

_TRAIN_DS = re.compile(r"train_ds-([0-9]+)-of-([0-9]+)\.index")


def has_dataset(step_dir: Path) -> bool:
    """Whether a step T5X wrote holds its dataset checkpoint (``train_ds-<i>-of-<n>.index``,
    a regular file), as T5X's ``all_dataset_checkpoint_steps`` finds it."""
    try:
        with os.scandir(step_dir) as entries:
            return any(
                _TRAIN_DS.fullmatch(e.name) is not None and e.is_file(follow_symlinks=False)
                for e in entries
            )
    except OSError:
        return False


def restore_dataset(step_dir: Path, iterator: Any, step: int) -> Any:
    """T5X's legacy dataset checkpoint (``train_ds-<shard>-of-<n>``, a tf.train.Checkpoint of the
    iterator) read into `iterator` in place; this process's shard, or the only one there is.
    Its files must be regular files (TensorFlow follows links)."""
    from cairn.handlers import writing_process

    shards: dict[tuple[int, int], str] = {}
    try:
        with os.scandir(step_dir) as entries:
            for entry in entries:
                match = _TRAIN_DS.fullmatch(entry.name)
                if match and entry.is_file(follow_symlinks=False):
                    shards[(int(match.group(1)), int(match.group(2)))] = entry.name[
                        : -len(".index")
                    ]
    except OSError as e:
        raise CorruptCheckpointError(f"T5X step {step} at {step_dir} cannot be listed: {e}") from e
    index, count = writing_process()
    name = shards.get((index, count)) or (next(iter(shards.values())) if len(shards) == 1 else None)
    if name is None:
        from cairn.handlers.errors import ItemNotFoundError

        raise ItemNotFoundError(
            f"T5X step {step} at {step_dir} has no dataset checkpoint train_ds-{index:03}-of-"
            f"{count:03} (found {sorted(shards.values())}); restore it without dataset_iterator"
        )
    with os.scandir(step_dir) as entries:
        for entry in entries:
            if entry.name.startswith(name + ".") and not entry.is_file(follow_symlinks=False):
                raise CorruptCheckpointError(f"{entry.path} is a link or not a regular file")
    if getattr(iterator, "_iterator_resource", None) is None:
        raise MismatchError(
            f"T5X step {step}: its dataset checkpoint {step_dir / name} is a tf.data iterator's; "
            "give iter() of the same pipeline"
        )
    import tensorflow as tf

    try:
        tf.train.Checkpoint(ds=iterator).read(str(step_dir / name)).assert_consumed()
    except AssertionError as e:
        raise MismatchError(f"T5X step {step}: {step_dir / name}: {e}") from e
    except Exception as e:  # tf.errors.OpError: damaged files
        raise CorruptCheckpointError(
            f"T5X step {step}: TensorFlow cannot read {step_dir / name}: {e!s:.300}"
        ) from e
    return iterator


def t5x_steps(root: Path) -> dict[int, Path]:
    """Steps a T5X job wrote in `root`, in either of its layouts, by step: its legacy layout and
    its Orbax layout (``checkpoint_<step>`` directories orbax-checkpoint committed)."""
    from cairn.manager._layouts.base import LocalStepView
    from cairn.manager._layouts.orbax import orbax_step

    found = legacy_steps(root)
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return found
    for entry in entries:
        step = NAMES.parse(entry.name)
        if step is None or step in found or not entry.is_dir(follow_symlinks=False):
            continue
        path = Path(entry.path)
        if os.path.lexists(path / MANIFEST):
            continue
        try:
            if orbax_step(step, LocalStepView(path)) is not None:
                found[step] = path
        except OSError:
            continue
    return dict(sorted(found.items()))


def checkpoint_file(step_dir: Path) -> str:
    """The file that stands for a step directory (T5X's ``find_checkpoint``): T5X's
    ``checkpoint`` in its legacy layout, Orbax's ``_CHECKPOINT_METADATA`` in its Orbax layout
    (if present), else cairn's manifest."""
    if is_legacy_step(step_dir):
        return CHECKPOINT_FILE
    if not os.path.lexists(step_dir / MANIFEST) and os.path.isfile(
        step_dir / "_CHECKPOINT_METADATA"
    ):
        return "_CHECKPOINT_METADATA"
    return MANIFEST


def legacy_manifest(step: int, path: Path) -> Any:
    """A read-only manifest describing a T5X legacy step (as `orbax_step` does for Orbax steps),
    or None if `path` is not one: item ``state`` (handler ``t5x.legacy``), item ``dataset`` when
    T5X's ``train_ds-*`` files are there, times from the directory, ``{"format": "t5x"}``.

    For a storage that lists steps: with it a T5X step is a foreign, read-only step (never
    deleted, never reported damaged) rather than a directory without a manifest."""
    from cairn.manager._format import ItemEntry, Manifest

    if not is_legacy_step(path):
        return None
    try:
        mtime = os.lstat(path / CHECKPOINT_FILE).st_mtime
        with os.scandir(path) as entries:
            has_dataset = any(_TRAIN_DS.fullmatch(e.name) for e in entries)
    except OSError:
        return None
    items = {"state": ItemEntry("t5x.legacy", 1, ())}
    if has_dataset:
        items["dataset"] = ItemEntry("t5x.legacy_dataset", 1, ())
    return Manifest(
        step=step, items=items, started_at=mtime, committed_at=mtime, metadata={"format": "t5x"}
    )
