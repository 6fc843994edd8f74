"""A manager's options, each checked when the manager is built (before anything is opened)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from cairn.handlers import Handler
from cairn.handlers.io import WriteBudget
from cairn.manager._core.policies import (
    EveryNSteps,
    KeepAll,
    KeepPolicy,
    SavePolicy,
    find_keep_best,
    policy_kind,
)
from cairn.manager._core.tiers import LocalTier
from cairn.manager._core.validate import (
    check_barrier_timeout,
    check_best,
    check_flag,
    check_handlers,
    check_keep_items,
    check_max_pending,
    check_max_staging_bytes,
    check_primary_process,
)
from cairn.manager._format import StepNames, check_metadata
from cairn.manager._storage.base import check_directory


@dataclasses.dataclass(frozen=True)
class Options:
    """`CheckpointManager`'s keyword arguments, checked (`Options.check`), in the order the
    constructor names them; each error names the argument and the value."""

    directory: Path | str
    save: SavePolicy
    keep: KeepPolicy
    keep_items: dict[str, KeepPolicy]
    handlers: dict[str, Handler]
    best: tuple[str, Literal["min", "max"]] | None
    names: StepNames
    async_save: bool
    read_only: bool
    max_pending: int
    barrier_timeout: float
    incremental: bool
    writer_process: bool  # writer="process" for a writable, asynchronous manager
    max_staging_bytes: int | None
    zero_copy: bool
    budget: WriteBudget | None
    metadata: dict[str, Any] | None
    tensorboard_dir: str | os.PathLike[str] | None
    primary_process: int
    storage_options: Mapping[str, Any] | None
    local: LocalTier | None = None

    @property
    def best_rule(self) -> tuple[str, str] | None:
        """The best-step rule, if the manager has one: `best=`, or its one KeepBest."""
        if self.best is not None:
            return self.best
        bests = find_keep_best(self.keep)
        return (bests[0].metric, bests[0].mode) if len(bests) == 1 else None

    def required_best_rule(self) -> tuple[str, str]:
        rule = self.best_rule
        if rule is not None:
            return rule
        raise ValueError(
            "best_step() needs best=(metric, mode) or exactly one KeepBest in keep=; "
            f"keep={self.keep!r}"
        )

    @classmethod
    def check(
        cls,
        directory: Any,
        *,
        save: Any,
        keep: Any,
        keep_items: Any,
        handlers: Any,
        best: Any,
        step_prefix: Any,
        step_digits: Any,
        async_save: Any,
        max_pending: Any,
        read_only: Any,
        barrier_timeout: Any,
        primary_process: Any,
        storage_options: Any,
        tensorboard_dir: Any,
        metadata: Any,
        zero_copy: Any,
        max_staging_bytes: Any,
        max_write_bytes_per_s: Any,
        incremental: Any,
        writer: Any,
        local: Any = None,
    ) -> Options:
        target = check_directory(directory)
        if writer not in ("thread", "process"):
            raise ValueError(f"writer must be 'thread' or 'process', got {writer!r}")
        save = EveryNSteps(1) if save is None else save
        if policy_kind(save) != "save":
            raise TypeError(
                f"save= must be a save policy (EveryNSteps, AtSteps, ...), got {save!r}"
            )
        keep = KeepAll() if keep is None else keep
        if policy_kind(keep) != "keep":
            raise TypeError(
                f"keep= must be a keep policy (KeepLatest, KeepBest, ...), got {keep!r}"
            )
        keep_items = check_keep_items(keep_items)
        handlers = check_handlers(handlers)
        best = check_best(best)
        names = StepNames(step_prefix, step_digits)
        async_save = check_flag("async_save", async_save)
        read_only = check_flag("read_only", read_only)
        max_pending = check_max_pending(max_pending)
        barrier_timeout = check_barrier_timeout(barrier_timeout)
        incremental = check_flag("incremental", incremental)
        if writer == "process":
            _check_writer_process_options(async_save, zero_copy, incremental)
        if local is not None:
            _check_local(local, read_only)
        max_staging_bytes = check_max_staging_bytes(max_staging_bytes)
        zero_copy = check_flag("zero_copy", zero_copy)
        budget = None if max_write_bytes_per_s is None else WriteBudget(max_write_bytes_per_s)
        try:
            metadata = None if metadata is None else check_metadata(metadata)
        except TypeError as e:
            raise TypeError(f"metadata= (the directory's metadata): {e}") from None
        if tensorboard_dir is not None and not isinstance(tensorboard_dir, (str, os.PathLike)):
            raise TypeError(f"tensorboard_dir must be a path, got {tensorboard_dir!r}")
        return cls(
            directory=target,
            save=save,
            keep=keep,
            keep_items=keep_items,
            handlers=handlers,
            best=best,
            names=names,
            async_save=async_save,
            read_only=read_only,
            max_pending=max_pending,
            barrier_timeout=barrier_timeout,
            incremental=incremental,
            writer_process=writer == "process" and not read_only and async_save,
            max_staging_bytes=max_staging_bytes,
            zero_copy=zero_copy,
            budget=budget,
            metadata=metadata,
            tensorboard_dir=tensorboard_dir,
            primary_process=check_primary_process(primary_process),
            storage_options=storage_options,
            local=local,
        )


def _check_writer_process_options(async_save: Any, zero_copy: Any, incremental: Any) -> None:
    """The options writer="process" cannot go with (the others are checked on their own)."""
    if async_save is False:
        raise ValueError("writer='process' commits in the background; it needs async_save=True")
    if zero_copy is True:
        raise ValueError(
            "writer='process' copies the state into shared memory, which the writer process "
            "reads; zero_copy=True (views of the trainer's arrays) cannot go with it"
        )
    if incremental is True:
        raise ValueError("incremental=True cannot go with writer='process' yet")


def _check_local(local: Any, read_only: Any) -> None:
    """local= (a LocalTier), and the option it cannot go with. writer="process" and
    incremental=True apply to the persistent tier; the local tier's parts are committed in
    this process, each whole (docs/multitier.md)."""
    if not isinstance(local, LocalTier):
        raise TypeError(f"local= must be a LocalTier or None, got {local!r}")
    if read_only is True:
        raise ValueError("local= is the writing manager's: a read_only=True manager takes none")
