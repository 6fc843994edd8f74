"""T5X's checkpointers on a CheckpointManager: what they share (`_T5XCheckpointing`: attributes,
saving, restoring cairn's steps and T5X's), Checkpointer, SaveBestCheckpointer, and
DatasetCheckpointHandler."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cairn.handlers import LazyArray as _StoredLazy
from cairn.handlers import TfDataIteratorHandler, TrainStateHandler
from cairn.handlers import handler_for as _handler_for
from cairn.handlers.errors import ItemNotFoundError, StepAlreadyExistsError, SupersededError
from cairn.manager._core.manager import CheckpointManager
from cairn.manager._core.policies import (
    EveryNSteps,
    KeepAll,
    KeepEvery,
    KeepLatest,
    KeepPolicy,
    StepView,
)
from cairn.manager._core.validate import as_step
from cairn.manager._surfaces.t5x.directories import (
    PINNED,
    PREFIX,
    all_dataset_checkpoint_steps,
    find_checkpoint,
    get_checkpoint_dir,
    get_step_from_checkpoint_dir,
)
from cairn.manager._surfaces.t5x.foreign import restore_foreign
from cairn.manager._surfaces.t5x.state import (
    DATASET,
    STATE,
    LazyArray,
    PathLike,
    _call_save_fns,
    _check_fns,
    _is_target,
    _map_leaves,
    _read_state,
    _rebuild,
    _restore_target,
    _state_dict,
    _step_of,
    _with_target,
)
from cairn.manager._surfaces.t5x.tfevents import _check_metric_name, _KeepBestFromEvents

log = logging.getLogger("cairn")


def _check_dtype(value: Any, what: str) -> np.dtype | None:
    if value is None:
        return None
    try:
        return np.dtype(value)
    except TypeError as e:
        raise TypeError(f"{what} must be None or a dtype, got {value!r}") from e


def _check_keep(value: Any, what: str) -> int | None:
    if value is None or value == 0:
        return None  # T5X: None or 0 keeps everything
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be None or a non-negative int, got {value!r}")
    return value


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
