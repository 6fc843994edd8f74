"""T5X's OrbaxCheckpointManagerInterface (its wrapper of Orbax's CheckpointManager), on cairn."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from cairn.manager._core.policies import (
    AnyOf,
    AtSteps,
    EveryNSteps,
    KeepAll,
    KeepEvery,
    KeepLatest,
    KeepPolicy,
)
from cairn.manager._surfaces.t5x.checkpointers import _check_keep, _T5XCheckpointing
from cairn.manager._surfaces.t5x.state import PathLike
from cairn.manager._surfaces.t5x.tfevents import _check_metric_name, _KeepBestFromEvents


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
