"""Orbax's save and keep decisions for the drop-in: built from ``CheckpointManagerOptions``
with Orbax's own policy classes, so that every option means what it means in Orbax, and the
cairn keep policy (`Doomed`) through which cairn's retention carries them out."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from cairn.manager._core.policies import StepView
from cairn.manager._surfaces.orbax.args import ocp

log = logging.getLogger("cairn")

_REFUSED = {
    "todelete_full_path": "renaming deleted steps on GCS hierarchical namespaces",
    "enable_per_process_directory_creation": "one directory per process",
}


def check_options(options: Any) -> None:
    """Refuse, with a message naming the option, what would change behaviour here unseen:
    options cairn has no counterpart for, and values Orbax itself would fail on later."""
    for name, what in _REFUSED.items():
        if getattr(options, name, None):
            raise ValueError(f"options.{name}: {what} is not supported by cairn.manager.orbax")
    interval = options.save_interval_steps
    if (
        not options.read_only
        and interval is not None
        and interval <= 0
        and (options.save_decision_policy is None and options.should_save_fn is None)
    ):
        raise ValueError(
            f"options.save_interval_steps={interval}: must be a positive number of steps, or "
            "None for no interval (Orbax divides by it at the first save)"
        )
    async_options = options.async_options
    for name in ("post_finalization_callback", "barrier_sync_fn"):
        if async_options is not None and getattr(async_options, name, None) is not None:
            raise ValueError(
                f"options.async_options.{name} is not supported by cairn.manager.orbax"
            )
    if getattr(options.file_options, "path_permission_mode", None) is not None:
        raise ValueError(
            "options.file_options.path_permission_mode is not supported by cairn.manager.orbax: "
            "cairn creates directories and files with the process's umask"
        )
    if options.multiprocessing_options.active_processes is not None:
        raise ValueError(
            "options.multiprocessing_options.active_processes is not supported by "
            "cairn.manager.orbax: every process of the jax.distributed run takes part"
        )
    if options.todelete_subdir is not None:
        log.warning(
            "cairn.manager.orbax: options.todelete_subdir=%r: deleted steps are removed, not "
            "moved there (cairn renames a step into its trash, then removes it)",
            options.todelete_subdir,
        )


def decisions(options: Any) -> Any:
    """Orbax's save decision: `save_decision_policy`, else what the options ask for (cm.py's
    default: `should_save_fn` and preemption; or the interval, `save_on_steps`, preemption and
    the initial save)."""
    if options.save_decision_policy is not None:
        return options.save_decision_policy
    p = ocp.checkpoint_managers
    if options.should_save_fn is not None:
        fn = options.should_save_fn
        return p.AnySavePolicy([_ShouldSaveFn(fn), p.PreemptionCheckpointingPolicy()])
    chosen: list[Any] = []
    if options.save_interval_steps:
        chosen.append(p.FixedIntervalPolicy(options.save_interval_steps))
    if options.save_on_steps:
        chosen.append(p.SpecificStepsPolicy(options.save_on_steps))
    chosen += [p.PreemptionCheckpointingPolicy(), p.InitialSavePolicy()]
    return p.AnySavePolicy(chosen)


class _ShouldSaveFn:
    """`should_save_fn(step, last_saved_step)` as a save decision policy."""

    def __init__(self, fn: Any) -> None:
        self._fn = fn

    def should_save(self, step: Any, previous_steps: Sequence[Any], *, context: Any) -> bool:
        del context
        return bool(self._fn(step.step, previous_steps[-1].step if previous_steps else None))


def preservation(options: Any) -> Any:
    """Orbax's preservation: `preservation_policy` (alone: Orbax refuses it beside the keep
    options), else `keep_period`, `keep_time_interval` and `max_to_keep` (ranked by `best_fn`
    when given)."""
    p = ocp.checkpoint_managers
    keeps = (options.max_to_keep, options.keep_period, options.keep_time_interval)
    if options.preservation_policy is not None:
        if any(k is not None for k in keeps):
            raise ValueError(
                "`preservation_policy` and `delete options` are mutually exclusive - do not use "
                "together."
            )
        return options.preservation_policy
    if options.best_mode not in ("min", "max"):
        raise ValueError(f"options.best_mode must be 'min' or 'max', got {options.best_mode!r}")
    chosen: list[Any] = []
    if options.keep_period is not None:
        chosen.append(p.EveryNSteps(options.keep_period))
    if options.keep_time_interval is not None:
        seconds = int(options.keep_time_interval.total_seconds())
        chosen.append(p.EveryNSeconds(interval_secs=seconds))
    if options.best_fn is not None:
        chosen.append(
            p.BestN(
                get_metric_fn=options.best_fn,
                reverse=options.best_mode == "min",
                n=options.max_to_keep,
                keep_checkpoints_without_metrics=options.keep_checkpoints_without_metrics,
            )
        )
    else:
        chosen.append(p.LatestN(n=options.max_to_keep))
    return p.AnyPreservationPolicy(chosen)


class Doomed:
    """cairn's keep policy for the drop-in: every step, except those a save's preservation
    decision dropped, which cairn's retention deletes after the commit of that save.

    Threads: `propose`, `settle` and `forget` on the caller's thread, `keep` on cairn's commit
    thread; a lock guards the set. The caller proposes only once the previous save and its
    retention are done (Orbax's save waits for it), so a proposal never races a deletion."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps: set[int] = set()
        self._proposed: set[int] = set()

    def propose(self, steps: set[int], saving: int) -> None:
        """The steps the save of `saving` drops (perhaps `saving` itself: max_to_keep=0)."""
        with self._lock:
            self._steps.discard(saving)  # a number saved again after its step was deleted
            self._proposed = steps - self._steps
            self._steps |= steps

    def settle(self) -> None:
        """The save failed before it was handed over: its proposal is withdrawn."""
        with self._lock:
            self._steps -= self._proposed
            self._proposed = set()

    def forget(self) -> None:
        """A commit failed: nothing is doomed; the next save decides again from the disk."""
        with self._lock:
            self._steps.clear()
            self._proposed = set()

    def keep(self, steps: Sequence[StepView]) -> set[int]:
        with self._lock:
            return {v.step for v in steps if v.step not in self._steps}
