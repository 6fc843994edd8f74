"""`TrainStateHandler`: its snapshot (the capture of a state on the caller thread: views,
device-to-host copies, staging), its restore and check entry points; and `TrainStateRestore`, the
restore options."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from cairn.handlers._files import StoredItem, in_parts
from cairn.handlers._optional import optional
from cairn.handlers._packs import is_packed, load_index
from cairn.handlers._staging import current_staging
from cairn.handlers._train_state.layout import _choose_chunk, _chunk_parts, _full_index, _MiB
from cairn.handlers._train_state.prng import _Keys
from cairn.handlers._train_state.read import _LeafReader
from cairn.handlers._train_state.restore import (
    LazyArray,
    _align,
    _fill_from,
    _map_with_target,
    _materialize,
    _Scalar,
    _subtree,
)
from cairn.handlers._train_state.staging import _Leaf, _stage, _stage_layout, _unchanged
from cairn.handlers._train_state.write import _StateSnapshot
from cairn.handlers._tree import (
    NONE,
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

KeyPathPredicate = Callable[[KeyPath], bool]
Transform = Callable[[Any, Any], Any]


@dataclasses.dataclass(frozen=True)
class TrainStateRestore:
    """Restore options for a TrainStateHandler item; pass it as the item's target.

    ``mgr.restore(items={"state": TrainStateRestore(target, restore_dtype=jnp.bfloat16)})``

    - `target`: a pytree of arrays or ``jax.ShapeDtypeStruct`` (with or without shardings) giving
      the structure, shapes, dtypes and placement of the result; None restores as saved.
    - `restore_dtype`: cast floating leaves selected by `cast` (default: every floating leaf) after
      reading (T5X casts only the params: ``cast=lambda path: path[0] == "params"``).
    - `subtree`: a key path prefix such as ``("params",)``: only that subtree is read and returned
      (the target, if any, is for that subtree).
    - `where`: a key-path predicate: only matching leaves are read; the others come back as the
      target's leaf (or None without a target).
    - `transforms`: functions ``fn(state, target) -> state`` applied in order to the restored state
      (leaves still lazy, so a transform that renames or drops keys reads nothing it drops), as
      T5X's state_transformation_fns.
    - `fallback_state`: after the transforms, leaves the checkpoint lacks are taken from here; the
      union must match the target (T5X).
    - `lazy`: return `LazyArray` leaves that read on first use (T5X's lazy_parameters).
    """

    target: Any = None
    _: dataclasses.KW_ONLY
    restore_dtype: Any = None
    cast: KeyPathPredicate | None = None
    subtree: tuple[str | int, ...] = ()
    where: KeyPathPredicate | None = None
    transforms: Sequence[Transform] = ()
    fallback_state: Any = None
    lazy: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.subtree, tuple):
            raise TypeError(
                f"TrainStateRestore: subtree must be a tuple of keys, got {self.subtree!r}"
            )
        for name in ("cast", "where"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(
                    f"TrainStateRestore: {name} must be a key-path predicate, got {value!r}"
                )
        if not all(callable(fn) for fn in self.transforms):
            raise TypeError(
                f"TrainStateRestore: transforms must be callables, got {self.transforms!r}"
            )
        if self.restore_dtype is not None:
            np.dtype(self.restore_dtype)  # raises TypeError for a bad dtype
        if not isinstance(self.lazy, bool):
            raise TypeError(f"TrainStateRestore: lazy must be a bool, got {self.lazy!r}")


class TrainStateHandler:
    """Saves and restores a training state: any JAX pytree of arrays and scalars, in packs
    (`layout="packed"`, the default) or as zarr3 arrays (`layout="zarr"`).

    What is copied when (the snapshot, inside ``save()``):

    - Inside a manager's ``save()`` whose staging pool has room (unless ``zero_copy=True``;
      the first save of a state maps the pool's memory and faults it in as it copies): every
      leaf, ``jax.Array`` shards (those with ``replica_id == 0``) and NumPy arrays alike, is
      copied chunk by chunk into the pool's page-aligned memory, cast to its stored dtype, on
      two threads, which may still run when `snapshot` returns: the manager's ``save()`` hands
      the commit over, then waits for them (`_StateSnapshot.settle`). The snapshot then holds no
      reference to the arrays: the next train step donates them as usual.
    - Otherwise, ``jax.Array`` leaves are *not* copied on CPU: the snapshot keeps zero-copy host
      views of the addressable shards with ``replica_id == 0``. While such a view exists, JAX
      will not donate the buffer (a donating train step gets fresh buffers instead, silently,
      using more memory until the commit ends), so the checkpoint holds the values at save time.
      As a second line, the write phase fails the commit if a source array was deleted or
      donated meanwhile.
    - On GPU/TPU the snapshot is each shard's device-to-host copy (`_start_transfer`: into
      pinned host memory on GPU), all started before the first is waited for, and kept as it
      is, not staged; with a writer process (a pool of shared slabs), staged all the same, so
      that the job sent to it holds the slab's descriptor, not pickled arrays.
    - ``np.ndarray`` leaves (and other array-likes) are copied, since the caller may change
      them in place; NumPy and Python scalars and the structure are captured as values.

    Write phase (commit thread): packs (or chunk files) are written by `threads` threads at low
    CPU and I/O priority. Staged chunks are hashed as they go out (16 MiB at a time in a pack, a
    megabyte in a zarr chunk file) and written with O_DIRECT where the filesystem allows (a
    pack: spans of the pool's memory); views are written from the arrays' memory, no copy
    unless `save_dtype` casts a leaf, within `max_inflight_bytes` (a pack's casts at once).

    Options: `save_dtype` casts the floating leaves selected by `save_dtype_where` (a key-path
    predicate; default all floating leaves; T5X casts only ``params``) when writing; `chunk_bytes`
    bounds a chunk file. Restore options come through `TrainStateRestore`.
    """

    id = "cairn.train_state"
    version = 2  # what this cairn reads: 1 (the zarr layout) and 2 (the packed layout)

    def __init__(
        self,
        *,
        save_dtype: Any = None,
        save_dtype_where: KeyPathPredicate | None = None,
        chunk_bytes: int = 64 * _MiB,
        max_inflight_bytes: int = 256 * _MiB,
        threads: int | None = None,
        layout: str = "packed",
    ) -> None:
        if layout not in ("zarr", "packed"):
            raise ValueError(
                f"TrainStateHandler: layout must be 'zarr' or 'packed', got {layout!r}"
            )
        self.layout = layout
        self.save_dtype = None if save_dtype is None else np.dtype(save_dtype)
        if save_dtype_where is not None and not callable(save_dtype_where):
            raise TypeError(
                f"save_dtype_where must be a key-path predicate, got {save_dtype_where!r}"
            )
        self.save_dtype_where = save_dtype_where
        for name, value, low in (
            ("chunk_bytes", chunk_bytes, 1),
            ("max_inflight_bytes", max_inflight_bytes, _MiB),
            ("threads", 1 if threads is None else threads, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(
                    f"TrainStateHandler: {name} must be an int >= {low}, got {value!r}"
                )
        self.chunk_bytes = chunk_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.threads = threads

    def __repr__(self) -> str:
        cast = f"save_dtype={self.save_dtype}, " if self.save_dtype is not None else ""
        zarr = ", layout='zarr'" if self.layout == "zarr" else ""
        return f"TrainStateHandler({cast}chunk_bytes={self.chunk_bytes}{zarr})"

    # -------------------------------------------------------------- snapshot (caller thread)

    def snapshot(self, obj: Any) -> _StateSnapshot:
        leaves: list[_Leaf] = []
        jax = sys.modules.get("jax")
        jax_array = jax.Array if jax is not None else ()

        transfers: list[tuple[list[Any], int, Any, Any]] = []  # pieces, at, coming, shard data
        single = jax.sharding.SingleDeviceSharding if jax is not None else ()

        def leaf(x: Any, path: KeyPath) -> dict[str, Any]:
            # Not recursive: a closure that calls itself is a reference cycle, which would keep
            # `leaves`, so views of the arrays (which JAX then will not donate), until a gc pass.
            prng = None
            if isinstance(x, jax_array) and _Keys.of(x.dtype):  # typed PRNG keys: their data
                prng = _Keys.impl_of(x, path)
                x = jax.random.key_data(x)  # type: ignore[union-attr]
            index = len(leaves)
            if isinstance(x, jax_array):
                shape, src_dtype = tuple(x.shape), _storable(np.dtype(x.dtype), path)
                pieces: list[tuple[tuple[slice, ...], np.ndarray]] = []
                zero_copy = False
                secondary: list[tuple[slice, ...]] = []  # held here, replica 0 elsewhere
                for region, data, first in _own_shards(x, shape, single, in_parts()):
                    if not first:
                        secondary.append(region)
                    coming = _start_transfer(data)
                    if coming is not None:  # on an accelerator: copied to the host below
                        transfers.append((pieces, len(pieces), coming, data))
                        pieces.append((region, _COMING))
                        continue
                    view = np.asarray(data)
                    zero_copy |= _shares_buffer(view, data)
                    pieces.append((region, view))
                region_shape = _extent(pieces[0][0]) if pieces else shape
                sources = [x] if zero_copy else []  # only views need the donation check
                shared = bool(x.is_fully_addressable)  # not a global array: every process has it
                owned = not zero_copy  # a device-to-host copy (GPU, TPU, int4) is ours already
                kind = "jax"
            else:
                arr = np.asarray(x)  # copied below: staged, or np.array
                src_dtype = _storable(arr.dtype, path)
                shape, region_shape = arr.shape, arr.shape
                pieces = [(tuple(slice(0, n) for n in shape), arr)]
                sources = []
                shared = True
                owned = False  # the caller's own array: copied before save() returns
                kind = "npscalar" if isinstance(x, np.generic) else "numpy"
            src_dtype, dtype, chunk = self._geometry(path, shape, src_dtype, region_shape)
            leaves.append(_Leaf(index, path, shape, dtype, chunk, pieces, sources, shared, owned))
            if kind == "jax" and secondary:
                leaves[-1].secondary = _chunk_keys(secondary, chunk)
            if kind == "jax":
                leaves[-1].ref = weakref.ref(x)
                regions = tuple(tuple((sl.start, sl.stop) for sl in r) for r, _ in pieces)
                leaves[-1].signature = (
                    path,
                    shape,
                    dtype.str,
                    src_dtype.str,
                    chunk,
                    regions,
                    self.layout,
                )
            node = {
                "t": "npscalar" if kind == "npscalar" else "array",
                "kind": kind,
                "f": f"arrays/{index}",
                "shape": list(shape),
                "dtype": dtype_name(dtype),
                "chunk": list(chunk),
            }
            if dtype != src_dtype:
                node["saved_from"] = dtype_name(src_dtype)
            if prng is not None:
                node["prng"] = prng
            return node

        tree = encode(obj, leaf, pytrees=True)
        for pieces, at, coming, data in transfers:  # every transfer started: wait for each
            try:
                host = np.asarray(coming)
            except Exception:  # a pinned copy NumPy cannot take here: the plain copy, as before
                if coming is data:
                    raise
                host = np.asarray(data)
            if _shares_buffer(host, data):  # the state's own buffer: never keep it as ours
                host = host.copy()
            pieces[at] = (pieces[at][0], host)
        staging = current_staging()
        lease = None
        # Incremental: an unchanged array is neither copied nor hashed, its files are linked.
        # Not in a local tier's part, which links nothing: its write reads its own copy, never
        # the caller's arrays, which the caller may donate once save() returned.
        if staging is not None and staging[0].remembers and not in_parts():
            for kept, files in _unchanged(leaves, staging[0].recall(staging[1])):
                kept.known = files  # linked at write time, or written from these views
        if staging is not None:  # inside a manager's save(): its pool, if it has room
            packed, shared = self.layout == "packed", staging[0].shared
            placed, size = _stage_layout(leaves, packed=packed, owned=shared)
            if any(kept.known is not None for kept in leaves):
                # A slab for the whole state all the same: the next save may change every leaf,
                # and a pool that shrank would fault a new one in then.
                size = _stage_layout(leaves, known=True, packed=packed, owned=shared)[1]
            lease = staging[0].lease(staging[1], size)
        copying = None
        if lease is not None:
            try:
                copying = _stage(placed, lease)
            except BaseException:
                lease.release()
                raise
        for kept in leaves:  # not staged: keep views of jax arrays (see the class docstring)
            if kept.staged is None:
                kept.pieces = [(r, _private(d, kept)) for r, d in kept.pieces]
        previous = None
        if staging is not None and staging[0].remembers and self.layout == "packed":
            previous = staging[0].recall_chunks(staging[1])
        return _StateSnapshot(self, tree, leaves, lease, staging, previous, copying)

    def staging_bytes(self, obj: Any, *, shared: bool = False) -> int:
        """The staging memory a manager's save of `obj` copies into, in bytes (0: none), laid
        out as `snapshot` lays it out, from shapes, dtypes and shardings alone: no array is read,
        copied or moved. After a restore the manager prepares its pool with it, so that the
        first save costs what a later one does. `shared`: a writer process's pool, which also
        stages the host copies of arrays on an accelerator."""
        leaves: list[_Leaf] = []
        jax = sys.modules.get("jax")
        jax_array = jax.Array if jax is not None else ()
        single = jax.sharding.SingleDeviceSharding if jax is not None else ()

        def leaf(x: Any, path: KeyPath) -> dict[str, Any]:
            regions: list[tuple[slice, ...]]
            if isinstance(x, jax_array) and _Keys.of(x.dtype):  # a few bytes: as one piece
                x = jax.eval_shape(jax.random.key_data, x)  # type: ignore[union-attr]
            if isinstance(x, jax_array):
                shape = tuple(x.shape)
                regions = [region for region, _, _ in _own_shards(x, shape, single, False)]
                # host arrays are viewed, then copied into the pool; an accelerator's are
                # copied to the host, which a writer process's pool stages too
                owned = any(d.platform not in _HOST_PLATFORMS for d in x.devices())
            else:  # NumPy arrays, lazily restored leaves, scalars: their shape, nothing read
                arr = x if hasattr(x, "shape") and hasattr(x, "dtype") else np.asarray(x)
                shape, owned = tuple(arr.shape), False
                regions = [tuple(slice(0, n) for n in shape)]
            region_shape = _extent(regions[0]) if regions else shape
            src = _storable(np.dtype(x.dtype), path)
            _, dtype, chunk = self._geometry(path, shape, src, region_shape)
            empty = np.empty((), dtype)  # broadcast to each region's shape: no memory
            pieces = [(r, np.broadcast_to(empty, _extent(r))) for r in regions]
            leaves.append(_Leaf(len(leaves), path, shape, dtype, chunk, pieces, [], True, owned))
            return {}

        encode(obj, leaf, pytrees=True)
        packed = self.layout == "packed"
        return _stage_layout(leaves, known=True, packed=packed, owned=shared)[1]

    def _geometry(
        self,
        path: KeyPath,
        shape: tuple[int, ...],
        src_dtype: np.dtype,
        region_shape: tuple[int, ...],
    ) -> tuple[np.dtype, np.dtype, tuple[int, ...]]:
        """(source dtype, little-endian; stored dtype; chunk shape) of a leaf whose pieces have
        `region_shape`: what `snapshot` and `staging_bytes` lay out alike."""
        src_dtype = src_dtype.newbyteorder("<") if src_dtype.byteorder == ">" else src_dtype
        dtype = self._stored_dtype(path, src_dtype)
        whole_rows = bool(shape) and region_shape[:1] == shape[:1]
        chunk = _choose_chunk(region_shape, dtype.itemsize, self.chunk_bytes, whole_rows=whole_rows)
        return src_dtype, dtype, chunk

    def _stored_dtype(self, path: KeyPath, dtype: np.dtype) -> np.dtype:
        if self.save_dtype is None or not _is_float(dtype):
            return dtype
        if self.save_dtype_where is not None and not self.save_dtype_where(path):
            return dtype
        return self.save_dtype

    # -------------------------------------------------------------- restore (caller thread)

    def restore(self, stored: StoredItem, target: Any = None) -> Any:
        opts = target if isinstance(target, TrainStateRestore) else TrainStateRestore(target)
        tree = load_tree(stored)
        index = load_index(stored) if is_packed(stored) else None
        for key in opts.subtree:
            tree = _subtree(tree, key, opts.subtree)
        prefix = opts.subtree

        def lazy_leaf(node: Mapping[str, Any], target_leaf: Any, path: KeyPath) -> Any:
            full = (*prefix, *path)
            reader = _LeafReader(stored, node, full, index)
            dtype = reader.dtype
            if "prng" in node:  # typed PRNG keys, stored as their key data
                keys = _Keys(node["prng"], reader.shape, full, stored)
                keys.check(target_leaf, path)
                if opts.where is not None and not opts.where(full):
                    return None if target_leaf is NONE else target_leaf
                return LazyArray(reader, dtype, keys)
            saved_from = dtype_from_name(node["saved_from"]) if "saved_from" in node else None
            recast = opts.restore_dtype is not None and _is_float(dtype)
            if recast and (opts.cast is None or opts.cast(full)):
                dtype = np.dtype(opts.restore_dtype)  # the target's dtype is not checked then
                check_leaf(node, target_leaf, path, dtype=None, check_dtype=False)
            else:
                target_dtype = getattr(target_leaf, "dtype", None)  # np.dtype(None) is float64:
                if (
                    saved_from is not None
                    and target_dtype is not None
                    and target_dtype == saved_from
                ):
                    dtype = saved_from  # undo the save_dtype cast
                check_leaf(node, target_leaf, path, dtype=dtype)
            if opts.where is not None and not opts.where(full):
                return None if target_leaf is NONE else target_leaf
            return LazyArray(reader, dtype) if node["t"] == "array" else _Scalar(reader, dtype)

        simple = not opts.transforms and opts.fallback_state is None
        state = decode(tree, lazy_leaf, NONE if opts.target is None or not simple else opts.target)
        for fn in opts.transforms:
            state = fn(state, opts.target)
        if opts.fallback_state is not None:
            state = _fill_from(state, opts.fallback_state, opts.target)
        if not simple and opts.target is not None:
            state = _align(state, opts.target, ())
        if opts.lazy:
            return _map_with_target(
                state, None, lambda x, _: x.get() if isinstance(x, _Scalar) else x
            )
        return _materialize(state, opts.target)

    def describe(self, stored: StoredItem) -> dict[str, Any]:
        return describe_tree(stored, "train-state")

    def check(self, stored: StoredItem) -> None:
        """What a restore of every leaf checks before it allocates anything: ``tree.json`` node
        by node, each leaf's chunks listed (with its ``zarr.json``) or indexed, at their exact
        sizes, the data of typed PRNG keys; CorruptCheckpointError naming the file otherwise.
        ``verify`` calls it after checking every file's content, so a step it calls intact is
        one a restore takes."""
        index = load_index(stored) if is_packed(stored) else None
        for path, node in walk_leaves(load_tree(stored)):
            if node["t"] in ("array", "npscalar"):
                reader = _LeafReader(stored, node, path, index)
                if "prng" in node:
                    _Keys(node["prng"], reader.shape, path, stored)
                reader.check()


def _is_float(dtype: np.dtype) -> bool:
    """NumPy floats and the ml_dtypes ones (bfloat16, float8_*, ...), which NumPy files as void."""
    return dtype.kind == "f" or (dtype.kind == "V" and dtype.name.startswith(("bfloat", "float")))


def _storable(dtype: np.dtype, path: KeyPath) -> np.dtype:
    """Booleans, integers, floats (ml_dtypes included) and complex numbers; TypeError otherwise."""
    if dtype.kind in "biufc" or dtype_name(dtype) != dtype.str:
        return dtype
    raise TypeError(
        f"array at {keystr(path)} has dtype {dtype}, which cannot be stored in a train state "
        "(numbers and booleans only)"
    )


def _private(data: np.ndarray, leaf: _Leaf) -> np.ndarray:
    """`data` as an unstaged snapshot keeps it: little-endian, and a copy unless it is a jax
    array's buffer (kept as a view and checked at write time) or already the snapshot's own."""
    if data.dtype.byteorder == ">":
        return data.astype(data.dtype.newbyteorder("<"))
    return data if leaf.owned or leaf.sources else np.array(data, copy=True)


_COMING = np.empty(0)  # a piece whose device-to-host copy is still running
_PINNED_PLATFORMS = ("gpu",)  # pinned host memory as the target; TPU's is scarce (Orbax's rule)
_HOST_PLATFORMS = ("cpu",)  # whose buffers NumPy views in place


def _extent(region: tuple[slice, ...]) -> tuple[int, ...]:
    return tuple(sl.stop - sl.start for sl in region)


def _own_shards(
    x: Any, shape: tuple[int, ...], single: Any, every: bool
) -> list[tuple[Any, Any, bool]]:
    """(global region, data, whether it is replica 0) of each addressable shard of `x` with
    ``replica_id == 0``, or with `every` (a local tier's part, `in_parts`), of each distinct
    addressable shard, the copy with the lowest replica id; an array on one device is its own
    shard (asked per leaf per save: ``addressable_shards`` builds objects that cost more than
    the rest of a small leaf's snapshot)."""
    if isinstance(x.sharding, single):
        return [(tuple(slice(0, n) for n in shape), x, True)]
    if not every:
        return [
            (_full_index(shard.index, shape), shard.data, True)
            for shard in x.addressable_shards
            if shard.replica_id == 0
        ]
    lowest: dict[tuple[tuple[int, int], ...], Any] = {}
    for shard in x.addressable_shards:
        key = tuple((sl.start, sl.stop) for sl in _full_index(shard.index, shape))
        if key not in lowest or shard.replica_id < lowest[key].replica_id:
            lowest[key] = shard
    return [
        (_full_index(shard.index, shape), shard.data, shard.replica_id == 0)
        for shard in lowest.values()
    ]


def _chunk_keys(regions: list[tuple[slice, ...]], chunk: tuple[int, ...]) -> frozenset[str]:
    """The keys of the chunks that cut `regions` (no data is read: a broadcast view)."""
    empty = np.empty((), np.uint8)
    return frozenset(
        key
        for region in regions
        for key, _ in _chunk_parts(region, np.broadcast_to(empty, _extent(region)), chunk)
    )


def _start_transfer(data: Any) -> Any:
    """For a single-device array on an accelerator, start its device-to-host copy and return
    what `np.asarray` then waits for: a copy in pinned host memory where the platform is one of
    `_PINNED_PLATFORMS` and its device has that memory kind (``jax.device_put`` to it), else
    `data` itself after ``copy_to_host_async``. None for a host (CPU) array: it is viewed in
    place. The snapshot waits for every copy before ``save()`` returns, so a donation after it
    cannot race them.

    Started for every shard of the state before the first is waited for, the copies overlap
    instead of running one after the other as ``np.asarray`` alone would have them."""
    device = getattr(data, "device", None)
    if device is None or device.platform in _HOST_PLATFORMS or data.is_deleted():
        return None
    platform = device.platform
    if platform in _PINNED_PLATFORMS:
        with contextlib.suppress(Exception):  # no such memory kind here: the plain copy
            if any(m.kind == "pinned_host" for m in device.addressable_memories()):
                jax = optional("jax", feature="a JAX train state")
                sharding = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
                return jax.device_put(data, sharding)
    data.copy_to_host_async()
    return data


def _shares_buffer(view: np.ndarray, device_array: Any) -> bool:
    """Whether `view` is the device buffer itself (CPU), rather than a host copy (GPU/TPU, int4)."""
    try:
        return bool(view.size) and view.ctypes.data == device_array.unsafe_buffer_pointer()
    except Exception:  # no pointer to compare: assume a view, so the donation check stays on
        return True
