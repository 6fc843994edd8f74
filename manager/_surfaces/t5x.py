"""T5X's checkpoint API on top of CheckpointManager (public as cairn.manager.t5x).

Names, signatures and documented behaviour follow ``t5x.checkpoints``; the differences (saves are
asynchronous, atomic and verified; step 0 is a step; an existing step is reported, not silently
skipped on some hosts; `keep_dataset_checkpoints` and `save_dtype` work in the Orbax-style
wrapper) are listed in docs/migrating-from-t5x.md. The on-disk format is cairn's: a step is
``checkpoint_<step>/`` with the train state as item ``state`` (T5X's state-dict layout:
``{"target": params, "state": {"step", "param_states"}, ...}``) and the dataset iterator as item
``dataset`` (one file per process).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import struct
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import crc32c
import numpy as np

from cairn.handlers import LazyArray as _StoredLazy
from cairn.handlers import TfDataIteratorHandler, TrainStateHandler, TrainStateRestore
from cairn.handlers import handler_for as _handler_for
from cairn.handlers.errors import (
    CairnError,
    CorruptCheckpointError,
    ItemNotFoundError,
    MismatchError,
    StepAlreadyExistsError,
    SupersededError,
)
from cairn.handlers.io import open_regular, read_no_follow
from cairn.manager._core import takeover
from cairn.manager._core.manager import CheckpointManager
from cairn.manager._core.policies import (
    AnyOf,
    AtSteps,
    EveryNSteps,
    KeepAll,
    KeepEvery,
    KeepLatest,
    KeepPolicy,
    StepView,
)
from cairn.manager._core.validate import as_step
from cairn.manager._format import MANIFEST, Manifest
from cairn.manager._layouts import t5x as legacy  # existing T5X runs: T5X's own layouts
from cairn.manager._surfaces.t5x_foreign import load_foreign, restore_foreign

log = logging.getLogger("cairn")

STATE, DATASET, PREFIX = "state", "dataset", "checkpoint"
PINNED = "PINNED"  # T5X's checkpoint_utils.pin_checkpoint: a step holding this file is kept
_STEP_DIR = re.compile(r"checkpoint_([0-9]+)")

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


def _check_keep(value: Any, what: str) -> int | None:
    if value is None or value == 0:
        return None  # T5X: None or 0 keeps everything
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be None or a non-negative int, got {value!r}")
    return value


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


# ---------------------------------------------------------------------------- directories


def get_checkpoint_dir(
    checkpoints_dir: PathLike, step: int, step_format_fixed_length: int | None = None
) -> str:
    """``<checkpoints_dir>/checkpoint_<step>``, the step zero-padded to a fixed length if given."""
    step = as_step(step)
    if step_format_fixed_length is None:
        name = f"{PREFIX}_{step}"
    else:
        if (
            isinstance(step_format_fixed_length, bool)
            or not isinstance(step_format_fixed_length, int)
            or step_format_fixed_length < 1
        ):
            raise ValueError(
                "step_format_fixed_length must be None or a positive int, got "
                f"{step_format_fixed_length!r}"
            )
        name = f"{PREFIX}_{step:0{step_format_fixed_length}d}"
    return os.path.join(os.fspath(checkpoints_dir), name)


def get_step_from_checkpoint_dir(checkpoints_dir: PathLike) -> tuple[str, int]:
    """``(parent directory, step)`` of a path ``.../checkpoint_<step>`` (T5X's order)."""
    text = os.fspath(checkpoints_dir).rstrip("/")
    parent, name = os.path.split(text)
    match = _STEP_DIR.fullmatch(name)
    if match is None:
        raise ValueError(
            f"Found improperly formatted checkpoint directory: {checkpoints_dir!s} "
            "(expected a name checkpoint_<step>)"
        )
    return parent, int(match.group(1))


def _committed(checkpoints_dir: PathLike) -> dict[int, Path]:
    """Committed step directories (named checkpoint_<digits>, holding a manifest) by step."""
    root = Path(os.fspath(checkpoints_dir))
    takeover.settle_writer(os.path.realpath(root))  # read your writes: T5X's save is synchronous
    found: dict[int, Path] = {}
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return found
    for entry in entries:
        match = _STEP_DIR.fullmatch(entry.name)
        if match and entry.is_dir() and os.path.isfile(os.path.join(entry.path, MANIFEST)):
            found.setdefault(int(match.group(1)), Path(entry.path))
    # existing T5X runs (manager/_layouts/t5x.py): steps T5X wrote count too, read-only
    for step, step_dir in legacy.t5x_steps(root).items():
        found.setdefault(step, step_dir)
    return found


def all_steps(checkpoints_dir: PathLike) -> list[int]:
    """Committed steps in `checkpoints_dir`, ascending (temporary directories never count)."""
    return sorted(_committed(checkpoints_dir))


def latest_step(checkpoints_dir: PathLike) -> int | None:
    """The newest committed step, or None (step 0 is a step)."""
    steps = all_steps(checkpoints_dir)
    return steps[-1] if steps else None


def all_dataset_checkpoint_steps(checkpoints_dir: PathLike) -> list[int]:
    """Committed steps that still hold the dataset iterator (not dropped by retention)."""
    steps = []
    for step, path in sorted(_committed(checkpoints_dir).items()):
        if not os.path.lexists(path / MANIFEST):  # a step T5X wrote: its train_ds-* files
            if legacy.has_dataset(path):
                steps.append(step)
            continue
        try:
            manifest = Manifest.from_bytes(read_no_follow(path / MANIFEST), str(path / MANIFEST))
        except (OSError, CairnError):
            continue
        entry = manifest.items.get(DATASET)
        if entry is not None and not entry.dropped:
            steps.append(step)
    return steps


def find_checkpoint(path: PathLike, step: int | None = None) -> str:
    """The manifest file of a checkpoint (cairn's counterpart of T5X's ``checkpoint`` file).

    `path` may be a model directory (then the checkpoint of `step`, or the latest one), a
    checkpoint directory ``checkpoint_<step>``, or its manifest file. ValueError if none is there.
    """
    text = os.fspath(path)
    candidate = Path(text)
    if candidate.is_dir():
        if _STEP_DIR.fullmatch(candidate.name) and step is None:
            takeover.settle_writer(os.path.realpath(candidate.parent))  # read your writes
            # a checkpoint directory itself
        else:
            if step is None:
                step = latest_step(candidate)
                if step is None:
                    raise ValueError(f"Path is not a valid checkpoint: {text} (no checkpoints)")
            found = _committed(candidate).get(as_step(step))
            candidate = found if found is not None else Path(get_checkpoint_dir(candidate, step))
        candidate = candidate / legacy.checkpoint_file(candidate)  # T5X's: its `checkpoint`
    if not candidate.is_file() or candidate.name != legacy.checkpoint_file(candidate.parent):
        raise ValueError(f"Path is not a valid checkpoint: {candidate}")
    return str(candidate)


def _open_step(path: PathLike, step: int | None = None) -> tuple[CheckpointManager, int]:
    """A read-only manager on the directory holding the checkpoint, and its step."""
    manifest = Path(find_checkpoint(path, step))
    parent, found = get_step_from_checkpoint_dir(manifest.parent)
    return CheckpointManager(parent, read_only=True), found


def load_t5x_checkpoint(
    path: PathLike,
    step: int | None = None,
    state_transformation_fns: Sequence[Callable[..., Any]] = (),
    remap: bool = True,
    restore_dtype: Any = None,
    lazy_parameters: bool = False,
) -> dict[str, Any]:
    """Load a checkpoint's train state as a nested dict, without an optimizer or a template.

    Leaves come back as they were saved: NumPy arrays, or ``jax.Array`` on the default device for
    leaves saved from ``jax.Array``.

    The dict has T5X's layout (``{"target": ..., "state": {"step", "param_states"}}``).
    `state_transformation_fns` run in order as ``fn(state_dict, {})`` when `remap` is True (as
    T5X; `remap=False` skips them). Leaves keep the dtype saved in the checkpoint;
    `restore_dtype` casts every array of ``target`` (integer ones too, as T5X).
    `lazy_parameters` returns every leaf as a LazyArray that reads on ``.get()``.
    """
    fns = _check_fns(state_transformation_fns, "state_transformation_fns")
    if not isinstance(remap, bool) or not isinstance(lazy_parameters, bool):
        raise TypeError("remap and lazy_parameters must be bools")
    mgr, found = _open_step(path, step)
    with mgr:
        # existing T5X runs (manager/_layouts/t5x.py): a step in T5X's legacy or Orbax layout
        foreign = load_foreign(
            mgr,
            found,
            state_item=STATE,
            fns=fns if remap else (),
            restore_dtype=restore_dtype,
            cast=_is_target,
            lazy=lazy_parameters,
        )
        if foreign is not None:
            return foreign
        transforms = [lambda state, target, fn=fn: fn(state, {}) for fn in fns] if remap else []
        restored = _read_state(
            mgr,
            found,
            template=None,
            transforms=transforms,
            fallback_state=None,
            lazy=lazy_parameters,
            restore_dtype=None if restore_dtype is None else np.dtype(restore_dtype),
        )
    if restore_dtype is not None and "target" not in restored:
        raise ValueError(
            f"restore_dtype={restore_dtype} was specified, but no `target` parameters were loaded."
        )
    return restored


# ---------------------------------------------------------------------------- TensorBoard metrics


def _event_files(run: Path) -> list[Path]:
    """The event files of a run directory (``*tfevents*`` entries that are not directories)."""
    try:
        with os.scandir(run) as entries:
            return sorted(
                Path(e.path)
                for e in entries
                if "tfevents" in e.name and not e.is_dir(follow_symlinks=False)
            )
    except OSError:  # no such run directory
        return []


def populate_metrics_for_steps(
    checkpoints_dir: PathLike, metric_name: str, steps: Iterable[int]
) -> dict[int, float]:
    """Read ``{run}/{tag}`` from the TensorBoard event files under `checkpoints_dir`, for `steps`.

    The run is the longest leading part of `metric_name` that is a directory of event files under
    `checkpoints_dir` (T5X's model directory: ``train``, ``inference_eval/...``). Every event is
    read (no sampling), scalar (``simple_value``) and tensor summaries alike; when a step was
    written twice (a restarted run), the later event wins. Returns ``{step: value}`` for the steps
    found, as floats.

    Event files are read as untrusted input (see `_EventCache`): a damaged or crafted record,
    a value that is not a finite number, a link or a FIFO named like an event file are ignored
    with a warning.
    """
    if not isinstance(metric_name, str) or not metric_name.strip("/"):
        raise ValueError(
            f"metric_name must be '{{run}}/{{tag}}' (e.g. 'train/accuracy'), got {metric_name!r}"
        )
    wanted = {as_step(s) for s in steps}
    root, parts = Path(os.fspath(checkpoints_dir)), metric_name.strip("/").split("/")
    for cut in range(len(parts) - 1, 0, -1):
        run, tag = root.joinpath(*parts[:cut]), "/".join(parts[cut:])
        files = _event_files(run)
        if files:
            break
    else:
        return {}
    found: dict[int, tuple[float, float]] = {}
    for file in files:
        for step, (wall_time, number) in _EVENTS.values(file, tag).items():
            if step in wanted and (step not in found or wall_time >= found[step][0]):
                found[step] = (wall_time, number)
    return {step: value for step, (_, value) in sorted(found.items())}


_HEADER = 12  # a TFRecord: uint64 length, uint32 masked CRC-32C of it, data, its masked CRC


def _masked_crc(data: bytes | memoryview) -> int:
    """TFRecord's checksum: a CRC-32C, rotated and offset ("masked")."""
    crc = crc32c.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _event_value(value: Any) -> float | None:
    """The number in a summary value: its simple_value, or a tensor of one real element; None for
    anything else (histograms, text, a tensor of several elements, a malformed tensor)."""
    if value.HasField("simple_value"):
        return float(value.simple_value)
    if not value.HasField("tensor"):
        return None
    if any(d.size != 1 for d in value.tensor.tensor_shape.dim):  # a crafted shape allocates
        return None
    from tensorboard.util import tensor_util

    try:
        array = tensor_util.make_ndarray(value.tensor)
    except (TypeError, ValueError, KeyError) as e:  # content that does not match its dtype
        log.warning("cairn: ignoring a malformed tensor summary %r: %s", value.tag, e)
        return None
    if array.size == 1 and array.dtype.kind in "fiub":
        return float(array.reshape(()))
    return None


@dataclasses.dataclass
class _EventFile:
    """How far one event file has been read, and the values found so far (tag -> step ->
    (wall_time, value))."""

    identity: tuple[int, int]  # (device, inode): a file replaced under the same name is new
    offset: int = 0
    damaged: bool = False  # a record failed its checksum: the rest of the file is ignored
    warned_at: int = -1  # the offset of an incomplete last record already warned about
    by_tag: dict[str, dict[int, tuple[float, float]]] = dataclasses.field(default_factory=dict)

    def read(self, fd: int, size: int, file: Path) -> None:
        """Read the records after `offset`, each checked against its CRCs before it is parsed,
        and never more bytes than the file holds (a length field is trusted only that far)."""
        from google.protobuf.message import DecodeError
        from tensorboard.compat.proto import event_pb2

        while not self.damaged and self.offset + _HEADER <= size:
            header = os.pread(fd, _HEADER, self.offset)
            length, length_crc = struct.unpack("<QI", header)
            if _masked_crc(header[:8]) != length_crc:
                self._damaged(file, "its length field fails its checksum")
                return
            if length + 4 > size - self.offset - _HEADER:
                if self.warned_at != self.offset:  # once: it may be a record being written
                    self.warned_at = self.offset
                    log.warning(
                        "cairn: event file %s: the record at byte %d says %d bytes, past the end "
                        "of the file (%d bytes); it is read again when the file grows",
                        file,
                        self.offset,
                        length,
                        size,
                    )
                return
            data = memoryview(os.pread(fd, length + 4, self.offset + _HEADER))
            if len(data) < length + 4:  # truncated meanwhile
                return
            if _masked_crc(data[:length]) != struct.unpack("<I", data[length:])[0]:
                self._damaged(file, "its data fails its checksum")
                return
            self.offset += _HEADER + length + 4
            try:
                event = event_pb2.Event.FromString(data[:length])
            except DecodeError as e:
                log.warning(
                    "cairn: event file %s: ignoring a record that is not an event: %s", file, e
                )
                continue
            self._add(event, file)

    def _add(self, event: Any, file: Path) -> None:
        for value in event.summary.value:
            number = _event_value(value)
            if number is None:
                continue
            if not (math.isfinite(number) and math.isfinite(event.wall_time)):
                log.warning(
                    "cairn: event file %s: ignoring %r at step %d: value %r, wall_time %r",
                    file,
                    value.tag,
                    event.step,
                    number,
                    event.wall_time,
                )
                continue
            steps = self.by_tag.setdefault(value.tag, {})
            old = steps.get(event.step)
            if old is None or event.wall_time >= old[0]:  # a step written twice: the later
                steps[event.step] = (event.wall_time, number)

    def _damaged(self, file: Path, why: str) -> None:
        self.damaged = True
        log.warning(
            "cairn: event file %s: ignoring the rest of it from byte %d: %s", file, self.offset, why
        )


class _EventCache:
    """Values read from TensorBoard event files, by file and tag, read incrementally.

    SaveBestCheckpointer asks at every retention; re-reading whole event files each time (as T5X
    does) costs O(history) per save. Each file's position is kept, so each call reads only the
    events appended since the last. A file replaced (another inode, or shorter) is read afresh.
    The records are read here, not by TensorBoard's loader: TensorFlow's record reader allocates
    whatever a record's length field says (a length of 2**60 kills the process with SIGSEGV).
    Threads: the commit thread and the caller's may both ask; one lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._files: dict[str, _EventFile] = {}

    def values(self, file: Path, tag: str) -> dict[int, tuple[float, float]]:
        key = str(file)
        with self._lock:
            try:
                fd = open_regular(file)  # a link is not followed, a FIFO does not block
            except (OSError, CorruptCheckpointError) as e:
                log.warning("cairn: ignoring event file %s: %s", file, e)
                self._files.pop(key, None)
                return {}
            try:
                info = os.fstat(fd)
                state = self._files.get(key)
                identity = (info.st_dev, info.st_ino)
                if state is None or state.identity != identity or info.st_size < state.offset:
                    state = self._files[key] = _EventFile(identity)
                state.read(fd, info.st_size, file)
            finally:
                os.close(fd)
            return dict(state.by_tag.get(tag, {}))


_EVENTS = _EventCache()


def _check_metric_name(value: Any, what: str) -> str:
    """A metric to monitor: ``{run}/{tag}``. As in T5X, a name with no run (``"loss"``) is
    accepted and never found, so no step has a value for it; a warning says so."""
    if not isinstance(value, str) or not value.strip("/"):
        raise ValueError(f"{what} must be '{{run}}/{{tag}}' (e.g. 'train/loss'), got {value!r}")
    if "/" not in value.strip("/"):
        log.warning(
            "cairn: %s=%r names no run ('{run}/{tag}', e.g. 'train/%s'): no step will have a "
            "value for it, so retention treats every step as one without metrics (as T5X does)",
            what,
            value,
            value.strip("/"),
        )
    return value


@dataclasses.dataclass(frozen=True)
class _KeepBestFromEvents:
    """SaveBestCheckpointer's retention: the latest step, the `n` best by a TensorBoard metric,
    steps that are multiples of `force_keep_period`, and (if `keep_without_metrics`) every step
    whose metric has not been written yet. NaN counts as missing."""

    n: int
    metric: str
    mode: Literal["min", "max"]
    keep_without_metrics: bool
    force_keep_period: int | None
    logdir: str

    def keep(self, steps: Sequence[StepView]) -> set[int]:
        ordered = sorted(v.step for v in steps)
        if not ordered:
            return set()
        latest = ordered[-1]
        period = self.force_keep_period
        forced = {s for s in ordered if period and s % period == 0}
        candidates = [s for s in ordered[:-1] if s not in forced]
        if len(candidates) <= self.n:
            return set(ordered)
        metrics = {
            s: v
            for s, v in populate_metrics_for_steps(self.logdir, self.metric, candidates).items()
            if not math.isnan(v)
        }
        without = {s for s in candidates if s not in metrics}
        pool = [s for s in candidates if s in metrics or not self.keep_without_metrics]
        worst = math.inf if self.mode == "min" else -math.inf
        sign = 1.0 if self.mode == "min" else -1.0
        pool.sort(key=lambda s: (sign * metrics.get(s, worst), -s))  # best first, newer on ties
        kept = {latest, *forced, *pool[: self.n]}
        return kept | without if self.keep_without_metrics else kept


# ---------------------------------------------------------------------------- checkpointers


def _check_dtype(value: Any, what: str) -> np.dtype | None:
    if value is None:
        return None
    try:
        return np.dtype(value)
    except TypeError as e:
        raise TypeError(f"{what} must be None or a dtype, got {value!r}") from e


class _LiveKeep:
    """The keep policy a T5X checkpointer gives its manager: it asks the checkpointer at every
    retention (so ``checkpointer.keep = 1`` takes effect at the next save), and never drops a
    step pinned with T5X's ``checkpoint_utils.pin_checkpoint`` (a ``PINNED`` file in the step
    directory; a pinned step still counts towards `keep`, as in T5X). `item` None: whole steps;
    else the dataset iterator item (`keep_dataset_checkpoints`)."""

    def __init__(self, owner: _T5XCheckpointing, item: str | None) -> None:
        self._owner, self._item = owner, item

    def keep(self, steps: Sequence[StepView]) -> set[int]:
        if self._item is None:
            policy = self._owner._current_keep()
        else:
            n = _check_keep(self._owner.keep_dataset_checkpoints, "keep_dataset_checkpoints")
            policy = KeepLatest(n) if n else KeepAll()
        return set(policy.keep(steps)) | self._owner._pinned({v.step for v in steps})

    def __repr__(self) -> str:
        what = "steps" if self._item is None else f"item {self._item!r}"
        return f"T5X retention of {what} in {self._owner.checkpoints_dir!r} (PINNED kept)"


class DatasetCheckpointHandler(TfDataIteratorHandler):
    """T5X's name for the tf.data iterator handler: cairn's TfDataIteratorHandler.

    `checkpoint_filename` (T5X: ``train_ds-XXX-of-YYY``) is kept for compatibility; cairn names
    the files of an iterator item ``process_<i>-of-<n>.tfdata``, one per process.
    """

    def __init__(self, checkpoint_filename: str = "train_ds") -> None:
        super().__init__()
        if not isinstance(checkpoint_filename, str) or not checkpoint_filename:
            raise ValueError(
                f"checkpoint_filename must be a non-empty str, got {checkpoint_filename!r}"
            )
        self.checkpoint_filename = checkpoint_filename


class _T5XCheckpointing:
    """What Checkpointer, SaveBestCheckpointer and the Orbax-style wrapper share: a
    CheckpointManager writing item "state" (T5X's state dict) and item "dataset"."""

    def __init__(
        self,
        train_state: Any,
        partitioner: Any,
        checkpoints_dir: PathLike,
        dataset_iterator: Any,
        *,
        save_policy: Any,
        keep: Callable[[], KeepPolicy],
        keep_dataset_checkpoints: int | None,
        save_dtype: Any,
        restore_dtype: Any,
    ) -> None:
        self._template = train_state
        _state_dict(train_state)  # a TypeError/ValueError now, not at the first save
        self._partitioner = partitioner
        if dataset_iterator is not None:
            _handler_for(dataset_iterator)  # TypeError if no handler saves it
        self._dataset_iterator = dataset_iterator
        self._handler = TrainStateHandler(save_dtype_where=_is_target)
        self.save_dtype = save_dtype
        self.restore_dtype = restore_dtype
        self.keep_dataset_checkpoints = keep_dataset_checkpoints
        self._save_policy = save_policy
        self._current_keep = keep  # asked at every retention: attributes set later count
        self._dir = os.fspath(checkpoints_dir)
        self._manager = self._open()

    def _open(self) -> CheckpointManager | None:
        # checkpoints_dir="" is T5X's restore-only checkpointer: it restores by path, never saves.
        if self._dir == "":
            return None
        return CheckpointManager(
            self._dir,
            save=self._save_policy,
            keep=_LiveKeep(self, None),
            keep_items={DATASET: _LiveKeep(self, DATASET)},
            handlers={STATE: self._handler},
            step_prefix=PREFIX,
        )

    # T5X's documented attributes: each may be set after construction and takes effect.

    @property
    def checkpoints_dir(self) -> str:
        return self._dir

    @checkpoints_dir.setter
    def checkpoints_dir(self, value: PathLike) -> None:
        if not isinstance(value, (str, os.PathLike)):
            raise TypeError(f"checkpoints_dir must be a path, got {value!r}")
        new = os.fspath(value)
        if new == self._dir:
            return
        if self._manager is not None:
            self._manager.close()  # pending saves land in the old directory first
        self._dir, self._manager = new, None
        self._manager = self._open()

    @property
    def save_dtype(self) -> np.dtype | None:
        return self._handler.save_dtype

    @save_dtype.setter
    def save_dtype(self, value: Any) -> None:
        self._handler.save_dtype = _check_dtype(value, "save_dtype")

    @property
    def restore_dtype(self) -> np.dtype | None:
        return self._restore_dtype

    @restore_dtype.setter
    def restore_dtype(self, value: Any) -> None:
        self._restore_dtype = _check_dtype(value, "restore_dtype")

    @property
    def keep_dataset_checkpoints(self) -> int | None:
        return self._keep_dataset_checkpoints

    @keep_dataset_checkpoints.setter
    def keep_dataset_checkpoints(self, value: int | None) -> None:
        _check_keep(value, "keep_dataset_checkpoints")
        self._keep_dataset_checkpoints = value

    def _pinned(self, steps: set[int]) -> set[int]:
        """The steps among `steps` pinned by T5X's checkpoint_utils.pin_checkpoint."""
        return {s for s in steps if os.path.exists(os.path.join(self._step_dir(s), PINNED))}

    def _step_dir(self, step: int) -> str:
        return get_checkpoint_dir(self._dir, step)

    @property
    def manager(self) -> CheckpointManager:
        """The CheckpointManager underneath (metrics, info, record_metrics, ...)."""
        if self._manager is None:
            raise ValueError(
                "this checkpointer has checkpoints_dir='': it only restores by path, and saves "
                "nothing"
            )
        return self._manager

    def _wait(self) -> None:
        if self._manager is not None:
            self._manager.wait_until_finished()

    def _save(
        self, train_state: Any, state_transformation_fns: Sequence[Callable[..., Any]], force: bool
    ) -> bool:
        fns = _check_fns(state_transformation_fns, "state_transformation_fns")
        state_dict = _call_save_fns(fns, _state_dict(train_state))
        # T5X saves states holding LazyArrays (a lazily restored one, say): read them now
        state_dict = _map_leaves(
            state_dict, lambda _, x: x.get() if isinstance(x, (LazyArray, _StoredLazy)) else x
        )
        step = _step_of(state_dict)
        items: dict[str, Any] = {STATE: state_dict}
        if self._dataset_iterator is not None:
            items[DATASET] = self._dataset_iterator
        try:
            return self.manager.save(step, items, force=force)
        except SupersededError as e:
            raise SupersededError(
                f"{type(self).__name__}.save(step {step}): another writable checkpointer (or "
                f"CheckpointManager) of {self._dir} in this process took over; this one only "
                "restores and lists now. Save through the newest one; nothing was written."
            ) from e

    def _restore(
        self,
        step: int | None,
        path: PathLike | None,
        state_transformation_fns: Sequence[Callable[..., Any]],
        fallback_state: Any,
        lazy_parameters: bool,
    ) -> Any:
        if step is not None and path is not None:
            raise ValueError("At most one of `step` or `path` may be provided.")
        fns = _check_fns(state_transformation_fns, "state_transformation_fns")
        if not isinstance(lazy_parameters, bool):
            raise TypeError(f"lazy_parameters must be a bool, got {lazy_parameters!r}")
        self._wait()  # pending saves land first
        mgr, own = self._manager, True
        if path is not None:
            manifest = Path(find_checkpoint(path))  # ValueError: not a valid checkpoint
            parent, step = get_step_from_checkpoint_dir(manifest.parent)
            if mgr is None or Path(parent).resolve() != Path(self.checkpoints_dir).resolve():
                mgr, own = CheckpointManager(parent, read_only=True), False
        elif mgr is None:
            raise ValueError(f"No checkpoints found in {self.checkpoints_dir!r}: give a path.")
        elif step is None:
            step = mgr.latest_step()
            if step is None:
                raise ValueError(f"No checkpoints found in {self.checkpoints_dir}.")
        else:
            step = as_step(step)
            if step not in mgr.all_steps():
                raise ValueError(
                    f"Checkpoint for step {step} does not exist in {self.checkpoints_dir} "
                    f"(steps: {mgr.all_steps()})"
                )
        try:
            # existing T5X runs (manager/_layouts/t5x.py): a step in T5X's legacy or Orbax layout
            foreign = restore_foreign(
                mgr,
                step,
                _restore_target(self._template, self._partitioner),
                state_item=STATE,
                dataset_item=DATASET,
                dataset_iterator=self._dataset_iterator,
                restore_dtype=self.restore_dtype,
                cast=_is_target,
                transforms=list(fns),
                fallback_state=None if fallback_state is None else _state_dict(fallback_state),
                lazy=lazy_parameters,
            )
            if foreign is not None:
                return _rebuild(self._template, foreign)
            dataset = None
            if self._dataset_iterator is not None:
                saved = mgr.info(step).items.get(DATASET)
                if saved is None or saved.dropped:
                    raise ItemNotFoundError(
                        f"step {step} has no dataset iterator (dropped by keep_dataset_checkpoints "
                        "or never saved); restore it with a Checkpointer without dataset_iterator"
                    )
                dataset = self._dataset_iterator
            template = _state_dict(self._template)
            state_dict = _read_state(
                mgr,
                step,
                template=_restore_target(self._template, self._partitioner),
                transforms=[_with_target(fn, template) for fn in fns],
                fallback_state=None if fallback_state is None else _state_dict(fallback_state),
                lazy=lazy_parameters,
                restore_dtype=self.restore_dtype,
                dataset=dataset,
            )
        finally:
            if not own:
                mgr.close()
        return _rebuild(self._template, state_dict)

    def latest_step(self) -> int | None:
        """The newest committed step (pending saves first), or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """Committed steps, ascending (pending saves first)."""
        self._wait()
        return [] if self._manager is None else self._manager.all_steps()

    def all_dataset_checkpoint_steps(self) -> list[int]:
        """Steps that still hold the dataset iterator, ascending."""
        self._wait()
        return [] if self._manager is None else all_dataset_checkpoint_steps(self.checkpoints_dir)

    def wait_until_finished(self) -> None:
        """Block until pending saves (and the retention after them) are done."""
        self._wait()

    def close(self) -> None:
        """Finish pending saves and release the directory."""
        if self._manager is not None:
            self._manager.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Checkpointer(_T5XCheckpointing):
    """T5X's Checkpointer: saves a train state (and a dataset iterator) and restores it.

    `train_state` (the template: its structure, shapes, dtypes and placement) is one of: a T5X
    TrainState (``state_dict()``/``restore_state()``); a flax-style TrainState with ``step``,
    ``params`` and ``opt_state`` (rebuilt with ``.replace``); or a dict with ``step``, ``params``
    (or ``target``) and ``opt_state`` (other keys are saved as they are). Arrays may be concrete
    or ``jax.ShapeDtypeStruct``. `partitioner`: None (restore where the template's arrays are),
    a pytree of ``jax.sharding.Sharding`` shaped like the train state, ``(mesh, specs)`` with a
    pytree of PartitionSpecs, or a T5X partitioner (``.mesh`` and ``get_mesh_axes(state)``).

    `keep`: how many steps to keep (None or 0: all). `keep_dataset_checkpoints`: how many steps
    keep the dataset iterator. `save_dtype`/`restore_dtype` cast the floating params
    (``target``) only, as T5X. Saves are asynchronous: `save` returns once the state is captured;
    `restore`, `all_steps`, `latest_step` and `wait_until_finished` wait for pending saves.
    """

    def __init__(
        self,
        train_state: Any,
        partitioner: Any,
        checkpoints_dir: PathLike,
        dataset_iterator: Any = None,
        *,
        keep: int | None = None,
        save_dtype: Any = np.float32,
        restore_dtype: Any = None,
        keep_dataset_checkpoints: int | None = None,
    ) -> None:
        self.keep = keep
        super().__init__(
            train_state,
            partitioner,
            checkpoints_dir,
            dataset_iterator,
            save_policy=EveryNSteps(1),
            keep=self._keep_policy,
            keep_dataset_checkpoints=keep_dataset_checkpoints,
            save_dtype=save_dtype,
            restore_dtype=restore_dtype,
        )

    @property
    def keep(self) -> int | None:
        return self._keep

    @keep.setter
    def keep(self, value: int | None) -> None:
        _check_keep(value, "keep")
        self._keep = value

    def _keep_policy(self) -> KeepPolicy:
        return KeepLatest(self.keep) if self.keep else KeepAll()

    def save(
        self,
        train_state: Any,
        state_transformation_fns: Sequence[Callable[..., Any]] = (),
        *,
        concurrent_gb: int = 128,
    ) -> bool:
        """Save `train_state` as the step it holds; returns False (and logs) if that step exists.

        `state_transformation_fns` run in order on the state dict before it is captured.
        `concurrent_gb` is accepted for compatibility: cairn bounds the bytes in flight itself.
        """
        if isinstance(concurrent_gb, bool) or not isinstance(concurrent_gb, (int, float)):
            raise TypeError(f"concurrent_gb must be a number, got {concurrent_gb!r}")
        if not concurrent_gb > 0:
            raise ValueError(f"concurrent_gb must be positive, got {concurrent_gb!r}")
        try:
            return self._save(train_state, state_transformation_fns, force=True)
        except StepAlreadyExistsError as e:  # T5X's train loop saves the restored step again
            log.info("cairn.t5x: skipping the save: %s", e)
            return False

    def restore(
        self,
        step: int | None = None,
        path: PathLike | None = None,
        state_transformation_fns: Sequence[Callable[..., Any]] = (),
        fallback_state: Any = None,
        lazy_parameters: bool = False,
    ) -> Any:
        """Restore the latest step, a given `step`, or the checkpoint at `path` (any directory).

        ValueError if both `step` and `path` are given, if the step or path does not exist, or if
        there is no checkpoint. `state_transformation_fns` run in order as ``fn(state_dict,
        target_state_dict)`` on the state read; `fallback_state` supplies what the checkpoint
        lacks (the union must match the template); `lazy_parameters` returns LazyArrays. The
        dataset iterator, if given, is restored in place. Returns a train state like the template.
        """
        return self._restore(step, path, state_transformation_fns, fallback_state, lazy_parameters)


class SaveBestCheckpointer(Checkpointer):
    """A Checkpointer that keeps the latest step plus the `keep` best by a TensorBoard metric.

    `metric_name_to_monitor` is ``{run}/{tag}``; the events are read from the TensorBoard files in
    ``<checkpoints_dir>/<run>/`` (all events, scalar or tensor summaries). Steps whose multiple of
    `force_keep_period` are always kept; steps without a metric yet are kept while
    `keep_checkpoints_without_metrics` (else deleted first). With `keep` None nothing is deleted.
    """

    def __init__(
        self,
        train_state: Any,
        partitioner: Any,
        checkpoints_dir: PathLike,
        dataset_iterator: Any = None,
        *,
        keep: int | None = None,
        save_dtype: Any = np.float32,
        restore_dtype: Any = None,
        metric_name_to_monitor: str = "train/accuracy",
        metric_mode: str = "max",
        keep_checkpoints_without_metrics: bool = True,
        force_keep_period: int | None = None,
        keep_dataset_checkpoints: int | None = None,
    ) -> None:
        self.metric_name_to_monitor = metric_name_to_monitor
        self.metric_mode = metric_mode
        self.keep_checkpoints_without_metrics = keep_checkpoints_without_metrics
        self.force_keep_period = force_keep_period
        super().__init__(
            train_state,
            partitioner,
            checkpoints_dir,
            dataset_iterator,
            keep=keep,
            save_dtype=save_dtype,
            restore_dtype=restore_dtype,
            keep_dataset_checkpoints=keep_dataset_checkpoints,
        )

    @property
    def metric_name_to_monitor(self) -> str:
        return self._metric_name_to_monitor

    @metric_name_to_monitor.setter
    def metric_name_to_monitor(self, value: str) -> None:
        self._metric_name_to_monitor = _check_metric_name(value, "metric_name_to_monitor")

    @property
    def metric_mode(self) -> str:
        return self._metric_mode

    @metric_mode.setter
    def metric_mode(self, value: str) -> None:
        if value not in ("max", "min"):
            raise ValueError(f"Unsupported `metric_mode`: {value!r} (use 'max' or 'min')")
        self._metric_mode = value

    @property
    def keep_checkpoints_without_metrics(self) -> bool:
        return self._keep_checkpoints_without_metrics

    @keep_checkpoints_without_metrics.setter
    def keep_checkpoints_without_metrics(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"keep_checkpoints_without_metrics must be a bool, got {value!r}")
        self._keep_checkpoints_without_metrics = value

    @property
    def force_keep_period(self) -> int | None:
        return self._force_keep_period

    @force_keep_period.setter
    def force_keep_period(self, value: int | None) -> None:
        if value is not None:
            KeepEvery(steps=value)  # validates: a positive int
        self._force_keep_period = value

    def _keep_policy(self) -> KeepPolicy:
        if not self.keep:
            return KeepAll()
        return _KeepBestFromEvents(
            self.keep,
            self.metric_name_to_monitor,
            self.metric_mode,  # type: ignore[arg-type]
            self.keep_checkpoints_without_metrics,
            self.force_keep_period,
            self.checkpoints_dir,
        )


class OrbaxCheckpointManagerInterface(_T5XCheckpointing):
    """T5X's wrapper of Orbax's CheckpointManager, on cairn; every option takes effect.

    `period` and `checkpoint_steps` decide `should_save` (``step % period == 0`` or a listed step,
    absolute steps as Orbax); `keep` steps are kept (the best by `metric_name_to_monitor` if given,
    read from TensorBoard events as SaveBestCheckpointer, else the newest), plus multiples of
    `force_keep_period`; `keep_dataset_checkpoints` newest steps keep the dataset iterator;
    `save_dtype`/`restore_dtype` cast the params.
    """

    def __init__(
        self,
        directory: PathLike,
        train_state: Any,
        partitioner: Any,
        dataset_iterator: Any = None,
        save_dtype: Any = None,
        restore_dtype: Any = None,
        keep: int | None = None,
        period: int = 1,
        checkpoint_steps: Iterable[int] | None = None,
        keep_dataset_checkpoints: int | None = None,
        force_keep_period: int | None = None,
        metric_name_to_monitor: str | None = None,
        metric_mode: str = "max",
        keep_checkpoints_without_metrics: bool = True,
    ) -> None:
        save_policy: Any = EveryNSteps(period)
        if checkpoint_steps is not None:
            save_policy = AnyOf(save_policy, AtSteps(checkpoint_steps))
        keep_n = _check_keep(keep, "keep")
        if metric_mode not in ("max", "min"):
            raise ValueError(f"Unsupported `metric_mode`: {metric_mode!r} (use 'max' or 'min')")
        if metric_name_to_monitor is not None:
            _check_metric_name(metric_name_to_monitor, "metric_name_to_monitor")
        policy: KeepPolicy = KeepAll()
        if keep_n and metric_name_to_monitor:
            policy = _KeepBestFromEvents(
                keep_n,
                metric_name_to_monitor,
                metric_mode,  # type: ignore[arg-type]
                bool(keep_checkpoints_without_metrics),
                force_keep_period,
                os.fspath(directory),
            )
        elif keep_n:
            policy = KeepLatest(keep_n)
            if force_keep_period is not None:
                policy = AnyOf(policy, KeepEvery(steps=force_keep_period))
        super().__init__(
            train_state,
            partitioner,
            directory,
            dataset_iterator,
            save_policy=save_policy,
            keep=lambda: policy,
            keep_dataset_checkpoints=keep_dataset_checkpoints,
            save_dtype=save_dtype,
            restore_dtype=restore_dtype,
        )

    @property
    def directory(self) -> str:
        return self.checkpoints_dir

    def should_save(self, step: int) -> bool:
        """Whether `period`/`checkpoint_steps` ask for `step` (False at or below the newest)."""
        return self.manager.should_save(step)

    def save(
        self,
        train_state: Any,
        state_transformation_fns: Sequence[Callable[..., Any]] = (),
        force: bool = True,
    ) -> bool:
        """Save if `force` or `should_save(step)`; True if a save started. An existing step
        raises StepAlreadyExistsError, as Orbax (T5X checks all_steps() first)."""
        return self._save(train_state, state_transformation_fns, force=force)

    def restore(
        self,
        step: int | None = None,
        path: PathLike | None = None,
        fallback_state: Any = None,
        state_transformation_fns: Sequence[Callable[..., Any]] = (),
        lazy_parameters: bool = False,
    ) -> Any:
        """Restore a step, a path, or (neither) the latest step; see Checkpointer.restore."""
        return self._restore(step, path, state_transformation_fns, fallback_state, lazy_parameters)
