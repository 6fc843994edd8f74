"""``cairn.manager.orbax.CheckpointManager``: orbax-checkpoint's CheckpointManager, written by
cairn (docs/migrating-from-orbax.md).

Change ``CheckpointManager = ocp.CheckpointManager`` to
``from cairn.manager.orbax import CheckpointManager``; the constructor, Orbax's
``CheckpointManagerOptions`` and ``ocp.args`` objects, return values and errors stay. Steps are
cairn steps (crash-safe commit, checksums, cairn's CLI); Orbax steps already in the directory are
listed and restored in place, by Orbax.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

from cairn.handlers.errors import (
    CorruptCheckpointError,
    StepNotFoundError,
)
from cairn.handlers.errors import StepAlreadyExistsError as _CairnStepExists
from cairn.manager._core.manager import CheckpointManager as _Manager
from cairn.manager._surfaces.orbax import args as A
from cairn.manager._surfaces.orbax import foreign, modes, records
from cairn.manager._surfaces.orbax.modes import DEFAULT_ITEM_NAME
from cairn.manager._surfaces.orbax.policies import Doomed, check_options, decisions, preservation
from cairn.manager.errors import CommitError

ocp = A.ocp
log = logging.getLogger("cairn")

__all__ = ["CheckpointManager", "StepAlreadyExistsError"]

_SLOW_WAIT_S = 1.0


class StepAlreadyExistsError(_CairnStepExists, ocp.checkpoint_manager.StepAlreadyExistsError):  # type: ignore[name-defined]
    """A forced save of a step that exists: both cairn's and Orbax's error."""


class CheckpointManager:
    """orbax-checkpoint's ``CheckpointManager`` (0.12.8) on cairn's manager.

    Decisions are Orbax's own: the save decision and preservation policies are built from the
    options with Orbax's policy classes (or taken as given), and evaluated over `_checkpoints`,
    this manager's list of Orbax ``CheckpointInfo`` (step, save time, metrics), as Orbax does.
    The writing is cairn's: each save is a cairn step (its items under ``<step>/<item>/``, a
    manifest with checksums, an atomic commit); the steps a save's preservation decision drops
    leave `all_steps()` at once and are deleted by cairn's retention after the step commits
    (`Doomed`), so a crash never loses the newest committed step to a deletion.

    Concurrency: as Orbax's, for one training thread; `wait_until_finished` may be called
    from several threads at once (a lock serialises them).
    """

    def __init__(
        self,
        directory: Any,
        checkpointers: Any = None,
        options: Any = None,
        metadata: Mapping[str, Any] | None = None,
        item_names: Sequence[str] | None = None,
        item_handlers: Any = None,
        logger: Any = None,
        handler_registry: Any = None,
    ) -> None:
        options = ocp.CheckpointManagerOptions() if options is None else options
        if not isinstance(options, ocp.CheckpointManagerOptions):
            raise TypeError(
                f"options must be an orbax.checkpoint.CheckpointManagerOptions, got "
                f"{type(options).__qualname__}"
            )
        check_options(options)
        self._options = options  # read, never changed
        self._default_item, self._fixed, self._kinds = modes.item_modes(
            item_names, item_handlers, handler_registry, checkpointers
        )
        self._save_policy = decisions(options)
        self._preserve = preservation(options)
        self._doomed = Doomed()
        self._restored: dict[str, str] = {}  # item -> kind, learned from restores without args
        self._logger = logger
        self._wait_lock = threading.Lock()
        self._read_only = bool(options.read_only)
        prefix, digits = modes.naming(options)
        where = modes.directory(directory, create=options.create, read_only=self._read_only)
        self._orbax_root = foreign.root_metadata(where)  # an Orbax run's: it was first
        if self._orbax_root is not None:
            metadata = None
        primary = options.multiprocessing_options.primary_host
        self._inner = _Manager(
            where,
            keep=self._doomed,
            step_prefix=prefix,
            step_digits=digits,
            async_save=modes.asynchronous(options, checkpointers),
            read_only=self._read_only,
            metadata=metadata if options.save_root_metadata else None,
            primary_process=0 if primary is None else primary,
            barrier_timeout=modes.barrier_timeout(options),
        )
        self._checkpoints = self._infos(light=bool(options.lightweight_initialize))

    # ------------------------------------------------------------------ properties

    @property
    def directory(self) -> Any:
        epath = A.optional("etils.epath", feature="cairn.manager.orbax")
        return epath.Path(os.fspath(self._inner.directory))

    def __repr__(self) -> str:
        return f"cairn.manager.orbax.CheckpointManager({self._inner!r})"

    # ------------------------------------------------------------------ the steps

    def all_steps(self, read: bool = False) -> list[int]:
        """The steps this manager tracks, ascending (a save in flight included, the steps its
        preservation dropped excluded). `read=True` lists the directory again."""
        if read:
            log.warning("all_steps(read=True) is deprecated; use reload()")
            self.reload()
        return [info.step for info in self._checkpoints]

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | None:
        """The best step by `best_fn` and `best_mode` among the steps with metrics; without
        `best_fn`, the latest step (as Orbax)."""
        best_fn = self._options.best_fn
        if best_fn is None:
            return self.latest_step()
        scored = []
        for info in self._checkpoints:
            if info.metrics:
                with contextlib.suppress(Exception):  # metrics best_fn cannot rank: unranked
                    scored.append((float(best_fn(info.metrics)), info.step))
        if not scored:
            return None
        sign = -1.0 if self._options.best_mode == "min" else 1.0
        return max(scored, key=lambda vs: (sign * vs[0], vs[1]))[1]

    def reload(self) -> None:
        """Read the directory again: another manager's steps, times and metrics."""
        self._inner.reload()
        self._checkpoints = self._infos(light=False)

    def reached_preemption(self, step: int) -> bool:
        """JAX's preemption sync point (jax.distributed's preemption service) was reached at
        `step`; False where the service is off."""
        from jax.experimental import multihost_utils

        try:
            return bool(multihost_utils.reached_preemption_sync_point(step))
        except RuntimeError:
            return False

    def should_save(self, step: int) -> bool:
        """Orbax's order: read-only (a warning), a step at or below the latest, then the policy
        with the save in progress and the preemption as its context."""
        if self._read_only:
            log.warning("%s is read only, save will be skipped", self.directory)
            return False
        step = _step(step)
        latest = self.latest_step()
        if latest is not None and latest >= step:
            return False
        options = self._options
        in_progress = (
            self.is_saving_in_progress()
            if options.enable_should_save_is_saving_in_progress_check
            else False
        )
        context = ocp.checkpoint_managers.DecisionContext(
            is_saving_in_progress=in_progress,
            reached_preemption=self.reached_preemption(step),
            multiprocessing_options=options.multiprocessing_options,
        )
        info = ocp.checkpoint_manager.CheckpointInfo(step=step, time=_now(), metrics=None)
        return bool(
            self._save_policy.should_save(
                info, previous_steps=list(self._checkpoints), context=context
            )
        )

    # ------------------------------------------------------------------ saving

    def save(
        self,
        step: int,
        items: Any = None,
        save_kwargs: Any = None,
        metrics: Any = None,
        force: bool | None = False,
        args: Any = None,
        custom_metadata: Mapping[str, Any] | None = None,
    ) -> bool:
        """Save `args` as `step` if the policy says so (or `force`); True if a save started.

        Orbax's order: the args are checked, then the policy asked (a read-only manager returns
        False with a warning, even with `force`), the previous save waited for, and a step that
        exists raises StepAlreadyExistsError. Metrics, `best_fn`'s value and the items are all
        checked before anything is written."""
        if items is None and args is None:
            raise ValueError("Must provide `args` for `save`.")
        self._default_item.set_if_none(not A.is_composite(args))
        self._check_args(items, args)
        if args is None:  # Orbax's legacy call: items (and save_kwargs) by the items' kinds
            args = self._legacy_args(items, save_kwargs, saving=True)
        step = _step(step)
        if self._read_only:
            log.warning("%s is read only, save will be skipped", self.directory)
            return False
        if not force and not self.should_save(step):
            return False
        self._wait_for_previous()
        if step in self.all_steps():
            raise StepAlreadyExistsError(f"Checkpoint for step {step} already exists.")
        by_name = dict(args.items()) if A.is_composite(args) else {DEFAULT_ITEM_NAME: args}
        if not by_name:
            raise ValueError("args is an empty Composite: give at least one item")
        values, kinds, shardings = {}, {}, {}
        for name, item_args in by_name.items():
            kind = A.kind_of_args(item_args, saving=True)
            self._bind(name, kind, item_args, check_only=True)  # bound once all checks passed
            assert kind is not None
            values[name], kinds[name] = A.save_value(name, kind, item_args), kind
            if kind in A.TREES:
                shardings[name] = A.shardings_of(values[name])
        custom = {} if custom_metadata is None else custom_metadata
        if not isinstance(custom, Mapping):
            raise TypeError(f"custom_metadata must be a mapping, got {type(custom).__qualname__}")
        recorded = None
        if metrics is not None and not self._options.prevent_write_metrics:
            recorded = A.to_json("metrics", metrics)
        info = ocp.checkpoint_manager.CheckpointInfo(step=step, time=_now(), metrics=recorded)
        if recorded is not None and self._options.best_fn is not None:
            _check_best(self._options.best_fn, recorded, step)
        record = {
            "items": kinds,
            "default_item": bool(self._default_item.get()),
            "metrics": A.encode_floats(recorded),
            "time": info.time.timestamp(),
            "custom_metadata": A.encode_floats(A.to_json("custom_metadata", custom)),
            "shardings": {n: s for n, s in shardings.items() if s},
        }
        for name, item_args in by_name.items():
            self._bind(name, kinds[name], item_args)
        kept = self._apply_preservation(info)  # the last check: it dooms steps
        try:
            self._inner.save(
                step,
                values,
                metrics=_numbers(recorded),
                metadata={records.RECORD: record},
                force=True,
            )
        except _CairnStepExists as e:
            self._doomed.settle()
            raise StepAlreadyExistsError(str(e)) from e
        except BaseException:
            self._doomed.settle()
            raise
        self._checkpoints = kept
        self._log("save", step)
        return True

    def _apply_preservation(self, new: Any) -> list[Any]:
        """Orbax's preservation over the tracked steps and the new one: the steps it drops are
        doomed now (cairn's retention deletes them after the new step commits); the kept list
        becomes `_checkpoints` once the save started."""
        candidates = sorted([*self._checkpoints, new], key=lambda i: i.step)
        try:
            flags = self._preserve.should_preserve(
                candidates, context=ocp.checkpoint_managers.PreservationContext()
            )
        except Exception as e:
            raise ValueError(
                f"step {new.step}: the preservation policy failed on the steps' metrics: {e!r}"
            ) from e
        self._doomed.propose(
            {i.step for i, keep in zip(candidates, flags, strict=True) if not keep}, new.step
        )
        return [i for i, keep in zip(candidates, flags, strict=True) if keep]

    def _wait_for_previous(self) -> None:
        started = time.monotonic()
        self.wait_until_finished()
        took = time.monotonic() - started
        if took > _SLOW_WAIT_S:
            log.warning(
                "Waiting for previous save to complete took %f seconds. If this number is "
                "high, consider checkpointing less frequently.",
                took,
            )

    def is_saving_in_progress(self) -> bool:
        return self._inner.is_saving_in_progress()

    def wait_until_finished(self) -> None:
        """Until the save in flight and the deletions after it are done; its error raised once."""
        with self._wait_lock:
            try:
                self._inner.wait_until_finished()
            except CommitError:
                self._resync()
                raise

    def check_for_errors(self) -> None:
        try:
            self._inner.check_for_errors()
        except CommitError:
            self._resync()
            raise

    def _resync(self) -> None:
        """After a failed commit: the tracked steps are those on disk (Orbax instead keeps its
        list without the failed step, and without the steps it meant to delete, until reload)."""
        self._doomed.forget()
        self._checkpoints = self._infos(light=False)

    # ------------------------------------------------------------------ restoring

    def restore(
        self,
        step: int | None,
        items: Any = None,
        restore_kwargs: Any = None,
        directory: Any = None,
        args: Any = None,
    ) -> Any:
        """Restore `step` (None: the latest) with Orbax's `args`: a Composite of the items
        wanted (attribute and key access), or the bare item in default-item mode. Without
        args, every item of the step. A step Orbax wrote is restored by Orbax itself.

        With ``step=None`` a latest step found damaged (CorruptCheckpointError: a file
        missing, truncated or failing its checksum) is passed over, with a warning, for the
        next older one; the error is raised if none restores. A given step's is raised."""
        if directory is not None:
            return self._restore_elsewhere(step, directory, args)
        self._check_args(items, args)
        if step is not None:
            return self._restore_step(_step(step), items, restore_kwargs, args)
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"No steps found in {self.directory}.")
        first: CorruptCheckpointError | None = None
        for candidate in reversed(steps):
            try:
                return self._restore_step(candidate, items, restore_kwargs, args)
            except CorruptCheckpointError as e:
                log.warning(
                    "cairn: the latest step %d is damaged, trying an older one: %s", candidate, e
                )
                first = first or e
        assert first is not None
        raise first

    def _restore_step(self, step: int, items: Any, restore_kwargs: Any, args: Any) -> Any:
        stored = self._stored(step)
        self._default_item.set_if_none(stored.default_item)
        if args is None and (items is not None or restore_kwargs is not None):
            args = self._legacy_args(items, restore_kwargs, saving=False)
        self._check_args(None, args)
        default = bool(self._default_item.get())
        if default:
            if DEFAULT_ITEM_NAME not in stored.items:
                raise ValueError(
                    f"step {step} has no default item; it holds {sorted(stored.items)}"
                )
            wanted = None if args is None else {DEFAULT_ITEM_NAME: args}
        else:
            wanted = None if args is None or not len(args) else dict(args.items())
        restored = self._read(step, stored, wanted)
        self._log("restore", step)
        return restored[DEFAULT_ITEM_NAME] if default else A.composite(restored)

    def _read(
        self, step: int, stored: records.Stored, wanted: dict[str, Any] | None
    ) -> dict[str, Any]:
        if wanted is not None and not stored.foreign:  # Orbax says which items its steps lack
            missing = [name for name in wanted if name not in stored.items]
            if missing:
                raise KeyError(
                    f'Item "{missing[0]}" was not found in the checkpoint. Available items: '
                    f"{sorted(stored.items)}"
                )
        if stored.foreign:
            if wanted is None:  # every item of the user's, by the handler Orbax recorded for it
                handlers = foreign.step_metadata(step, stored.path).item_handlers
                handlers = handlers if isinstance(handlers, Mapping) else {}
                wanted = {
                    n: args
                    for n, typestr in handlers.items()
                    if n != "metrics" and (args := A.restore_args_for(typestr)) is not None
                }
            return foreign.restore(step, stored.path, wanted)
        names = list(stored.items) if wanted is None else list(wanted)
        kinds: dict[str, str | None] = {}
        for name in names:
            item_args = None if wanted is None else wanted[name]
            if item_args is None:
                kind = self._kinds.get(name) or self._restored.get(name)
                if kind is None and wanted is not None:
                    raise ValueError(
                        f"Provided `None` for `CheckpointArgs`, and the `CheckpointHandler` for "
                        f'item "{name}" was not configured. If saving, provide the handler in '
                        "`item_handlers`; if restoring, provide `args` for the item"
                    )
                kinds[name] = kind or stored.items[name]
                if kinds[name] is not None:  # a later restore(args=Composite(name=None)) works
                    self._restored.setdefault(name, kinds[name])  # type: ignore[arg-type]
            else:
                kind = A.kind_of_args(item_args, saving=False)
                self._bind(name, kind, item_args)
                kinds[name] = _compatible(name, kind, stored.items[name])
        given = {n: None if wanted is None else wanted[n] for n in names}
        shardings = {n: stored.shardings.get(n) or {} for n in names}
        skeleton_for = [
            n for n in names if A.needs_skeleton(kinds[n] or "", given[n], shardings[n])
        ]
        skeletons = (
            self._inner.restore(step, {n: A.NEVER for n in skeleton_for}) if skeleton_for else {}
        )
        plans = {
            n: A.item_plan(kinds[n] or "", given[n], skeletons.get(n), shardings[n]) for n in names
        }
        restored = self._inner.restore(step, {n: plan.target for n, plan in plans.items()})
        return {n: plans[n].finish(restored[n]) for n in names}

    def _restore_elsewhere(self, step: int | None, directory: Any, args: Any) -> Any:
        """``restore(step, directory=d)``: a read-only manager of `d` with this one's naming."""
        options = dataclasses.replace(
            self._options,
            read_only=True,
            create=False,
            max_to_keep=None,
            keep_period=None,
            keep_time_interval=None,
            preservation_policy=None,
            best_fn=None,
        )
        with CheckpointManager(directory, options=options) as other:
            other._default_item = modes.DefaultItem(self._default_item.get())
            other._kinds = dict(self._kinds)
            if step is None:
                step = max(other._inner.all_steps(), default=None)
            return other.restore(step, args=args)

    # ------------------------------------------------------------------ metadata and metrics

    def metrics(self, step: int) -> Any:
        """The metrics saved with `step` (also without `best_fn`), or None."""
        try:
            return self._stored(_step(step)).metrics
        except FileNotFoundError:
            return None

    def metadata(self, step: int | None = None) -> Any:
        """None: the directory's ``RootMetadata`` (the `metadata=` the first writer gave);
        a step: its ``StepMetadata`` (item handlers, item metadata, metrics, times,
        `custom_metadata`)."""
        if step is None:
            custom = self._orbax_root
            if custom is None:
                custom = self._inner.metadata() if self._options.save_root_metadata else {}
            return ocp.metadata.RootMetadata(custom_metadata=dict(custom or {}))
        step = _step(step)
        stored = self._stored(step)
        if stored.foreign:
            return foreign.step_metadata(step, stored.path)
        described = self._inner.describe(step)
        trees = [n for n, k in stored.items.items() if k in A.TREES]
        skeletons = self._inner.restore(step, {n: A.NEVER for n in trees}) if trees else {}
        by_item = {
            n: A.tree_metadata(skeletons[n], described[n]) if n in skeletons else described.get(n)
            for n in stored.items
        }
        if self._default_item.get() or (self._default_item.get() is None and stored.default_item):
            known = DEFAULT_ITEM_NAME in {**self._kinds, **self._restored}  # Orbax: None until used
            item_metadata = by_item.get(DEFAULT_ITEM_NAME) if known else None
        else:
            item_metadata = A.composite(by_item)
        return ocp.metadata.StepMetadata(
            item_handlers={n: A.handler_typestr(k) for n, k in stored.items.items() if k},
            item_metadata=item_metadata,
            metrics=dict(stored.metrics) if isinstance(stored.metrics, Mapping) else {},
            init_timestamp_nsecs=int(stored.started_at * 1e9),
            commit_timestamp_nsecs=int(stored.committed_at * 1e9),
            custom_metadata=dict(stored.custom_metadata),
        )

    def item_metadata(self, step: int) -> Any:
        if step is None:
            raise ValueError("step must be given")
        return self.metadata(step).item_metadata

    # ------------------------------------------------------------------ deleting and closing

    def delete(self, step: int) -> None:
        """Delete a tracked step (after the save in flight); a read-only manager logs and
        does nothing; FileNotFoundError for a step not tracked."""
        if self._read_only:
            log.warning("%s is read only, delete will be skipped", self.directory)
            return
        step = _step(step)
        if step not in self.all_steps():
            raise FileNotFoundError(f"Requested deleting a non-existent step: {step}.")
        self._inner.delete(step)
        self._inner.wait_until_finished()
        self._checkpoints = [i for i in self._checkpoints if i.step != step]

    def close(self) -> None:
        self._inner.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._inner.__exit__(typ, exc, tb)

    # ------------------------------------------------------------------ helpers

    def _check_args(self, items: Any, args: Any) -> None:
        """Orbax's argument checks, with its messages."""
        if isinstance(items, ocp.args.CheckpointArgs):
            raise ValueError(
                "Found an instance of `CheckpointArgs` provided for `items`. This may be due "
                "to misuse of the newer API - make sure to specify the argument keyword (e.g. "
                "`args=args`)."
            )
        if args is None:
            return
        if not isinstance(args, ocp.args.CheckpointArgs):
            raise ValueError(f"Expected args of type `CheckpointArgs`; found {type(args)}.")
        default = self._default_item.get()
        if default and A.is_composite(args):
            raise ValueError(
                "Cannot provide `args` of type `Composite` when dealing with a single, unnamed "
                "(default) checkpointable object."
            )
        if default is False and not A.is_composite(args):
            raise ValueError(
                "Must provide `args` of type `Composite` when dealing with multiple "
                "checkpointable objects."
            )

    def _legacy_args(self, items: Any, kwargs: Any, *, saving: bool) -> Any:
        """Orbax's legacy `items` and `save_kwargs`/`restore_kwargs` as args: each item's args
        class is that of its kind (a Checkpointer's handler, `item_handlers`, or first use)."""
        default = bool(self._default_item.get())
        if default:
            items = {} if items is None and not saving else {DEFAULT_ITEM_NAME: items}
            kwargs = {} if kwargs is None else {DEFAULT_ITEM_NAME: kwargs}
        items, kwargs = dict(items or {}), dict(kwargs or {})
        by_name = {}
        for name in sorted(set(items) | set(kwargs)):
            kind = self._kinds.get(name)
            if kind is None:
                raise ValueError(f'Unknown key "{name}" in CompositeCheckpointHandler.')
            cls = A.args_class(kind, saving=saving)
            by_name[name] = cls(items.get(name), **(kwargs.get(name) or {}))
        if default and by_name:
            return by_name[DEFAULT_ITEM_NAME]
        return A.composite(by_name)

    def _bind(
        self, name: str, kind: str | None, item_args: Any, *, check_only: bool = False
    ) -> None:
        """Fix item `name`'s kind on first use (as Orbax registers a handler); an args type of
        another kind, or an item outside `item_names`, is Orbax's ValueError."""
        known = self._kinds.get(name)
        allowed = self._fixed is None or name in self._fixed
        if kind is None or (known is None and not allowed) or (known not in (None, kind)):
            raise ValueError(
                f'Item "{name}" and args "{type(item_args)}" does not match with any registered '
                f"handler! Registered handlers: {dict(sorted(self._kinds.items()))}"
                + ("" if kind is not None else "; cairn has no counterpart of these args")
            )
        if not check_only:
            self._kinds[name] = kind

    def _stored(self, step: int) -> records.Stored:
        try:
            info = self._inner.info(step)  # waits for the step's commit if it is in flight
        except StepNotFoundError:
            raise FileNotFoundError(f"Checkpoint at {self.directory}/{step} not found.") from None
        return records.read(info)

    def _infos(self, *, light: bool) -> list[Any]:
        """Orbax's CheckpointInfo for every step on disk (`light`: no step read, as Orbax's
        `lightweight_initialize`: times are ``datetime.min`` and metrics None)."""
        infos = []
        for step in self._inner.all_steps():
            if light:
                when, metrics = datetime.datetime.min, None
            else:
                try:
                    stored = self._stored(step)
                except CorruptCheckpointError as e:  # listed (its number is taken); restore(None)
                    log.warning("cairn: step %d is damaged: %s", step, e)  # passes over it
                    when, metrics = datetime.datetime.fromtimestamp(0, datetime.timezone.utc), None
                else:
                    when = datetime.datetime.fromtimestamp(stored.started_at, datetime.timezone.utc)
                    metrics = self._rankable(stored.metrics)
            infos.append(
                ocp.checkpoint_manager.CheckpointInfo(step=step, time=when, metrics=metrics)
            )
        return infos

    def _rankable(self, metrics: Any) -> Any:
        """Metrics as the policies see them: None (a step without metrics) where `best_fn`
        cannot rank them (a run that logged other metrics before `best_fn` was set)."""
        best_fn = self._options.best_fn
        if metrics is None or best_fn is None:
            return metrics
        try:
            float(best_fn(metrics))
        except Exception:
            return None
        return metrics

    def _log(self, event: str, step: int) -> None:
        if self._logger is not None:
            self._logger.log_entry(
                {"event_type": event, "step": step, "directory": str(self.directory)}
            )


# ---------------------------------------------------------------------- module helpers


def _now() -> datetime.datetime:
    """Looked up through the module at each call (tests replace ``datetime.datetime``)."""
    return datetime.datetime.now(tz=datetime.timezone.utc)


def _step(step: Any) -> int:
    if getattr(step, "shape", None) == () and hasattr(step, "item"):  # a 0-d NumPy or JAX int
        step = step.item()
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an integer, got {step!r:.80} ({type(step).__qualname__})")
    value = int(step)
    if value < 0:
        raise ValueError(f"step must be >= 0, got {value}")
    return value


def _compatible(name: str, kind: str | None, stored: str | None) -> str | None:
    """A restore's kind against the stored one: the two pytree kinds read each other."""
    if kind is None or stored is None or kind == stored:
        return kind
    if kind in A.TREES and stored in A.TREES:
        return kind
    raise ValueError(f'item "{name}" was saved as {stored} and cannot be restored as {kind}')


def _numbers(metrics: Any) -> dict[str, float] | None:
    """The finite numbers among Orbax metrics, as cairn's metrics (`cairn metrics`, KeepBest)."""
    if not isinstance(metrics, Mapping):
        return None
    out = {}
    for key, value in metrics.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[str(key)] = float(value)
    return out


def _check_best(best_fn: Any, metrics: Any, step: int) -> None:
    """`best_fn` on the new metrics before anything is written (Orbax calls it after)."""
    try:
        value = best_fn(metrics)
        float(value)
    except Exception as e:
        raise ValueError(f"step {step}: best_fn failed on metrics {metrics!r}: {e!r}") from e
