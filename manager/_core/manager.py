"""CheckpointManager: when to save, what to save, and what a trainer reads back. It delegates:
the commit thread and its errors (`committer`), reads (`reading`), retention (`retention`),
the processes of a run (`coordination`), the one writer per directory in a process
(`takeover`), the options (`options`); every byte goes through a `Storage`."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from cairn.handlers import Handler, handler_for
from cairn.handlers.errors import (
    MismatchError,
    ReadOnlyError,
    StepAlreadyExistsError,
    StepNotFoundError,
    SupersededError,
)
from cairn.handlers.io import StagingPool, as_parts, staging_for
from cairn.manager._core import commit as _commit
from cairn.manager._core import exit as _exit
from cairn.manager._core import takeover
from cairn.manager._core.catalog import Catalog
from cairn.manager._core.committer import Committer, Errors, Reclaimer, settle, writer_spec
from cairn.manager._core.coordination import Coordinator
from cairn.manager._core.multihost import SINGLE, Processes
from cairn.manager._core.options import Options
from cairn.manager._core.policies import (
    KeepPolicy,
    LastSave,
    SavePolicy,
    find_on_preemption,
    policy_wants,
    uses_time,
)
from cairn.manager._core.preemption import PreemptionWatch
from cairn.manager._core.reading import ItemInfo, Reader, StepInfo, naming_refusal
from cairn.manager._core.retention import Retention
from cairn.manager._core.telemetry import Telemetry
from cairn.manager._core.tiers import Local, LocalTier, NoLocal
from cairn.manager._core.validate import as_step, check_entry_name, check_items
from cairn.manager._core.writer import pack_job
from cairn.manager._format import check_metadata, check_metrics, dump_checked
from cairn.manager._storage.base import Listed, Storage
from cairn.manager._storage.open import open_storage

__all__ = ["CheckpointManager", "ItemInfo", "StepInfo"]

log = logging.getLogger("cairn")


class CheckpointManager:
    """Saves steps of a training run into one directory and brings them back.

    Typical use::

        with CheckpointManager(workdir, save=EveryNSteps(1000), keep=KeepLatest(3)) as mgr:
            state = mgr.restore()["state"] if mgr.latest_step() is not None else init()
            for step in ...:
                if mgr.should_save(step):
                    mgr.save(step, {"state": state}, metrics={"loss": loss})

    Concurrency: call the public methods from one thread (the training loop); the manager is not
    thread-safe. Every change to the directory (the write and commit of saves, retention,
    `record_metrics`, `delete`, `reload`) runs on the manager's one commit thread, in submission
    order (`Committer`, whose docstring gives the rules: `max_pending`, kept errors raised once
    as CommitError, the reclaim thread, a writer process with ``writer="process"`` and its
    bound, ``barrier_timeout``). `save()` returns after the snapshot phase: arrays are copied
    into the manager's staging pool (`zero_copy=False`), which `close` frees. State shared with
    the commit thread (the `Catalog`, the errors) is guarded by locks. Every byte goes through
    the directory's `Storage` (POSIX, object store, memory); the manager never asks which.

    Processes: one writable manager per directory, enforced by an advisory lock on
    ``<directory>/.cairn.lock`` (a lease object in object stores; DirectoryLockedError
    otherwise); any number of ``read_only=True`` managers may read alongside it.

    In one process, a new writable manager of a directory takes over from the one open there
    (`takeover`): its constructor waits for the old manager's pending commits and retention,
    the old one lets go of the lock or lease and turns read-only (a warning is logged), and a
    later write on it raises SupersededError. The old manager must not be inside a call on
    another thread meanwhile; its reads keep working (`reload` to see the new manager's steps).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        save: SavePolicy | None = None,
        keep: KeepPolicy | None = None,
        keep_items: Mapping[str, KeepPolicy] | None = None,
        handlers: Mapping[str, Handler] | None = None,
        best: tuple[str, Literal["min", "max"]] | None = None,
        step_prefix: str = "checkpoint",
        step_digits: int | None = None,
        async_save: bool = True,
        max_pending: int = 1,
        read_only: bool = False,
        barrier_timeout: float = 300.0,
        primary_process: int = 0,
        storage_options: Mapping[str, Any] | None = None,
        tensorboard_dir: str | os.PathLike[str] | None = None,
        metadata: Mapping[str, Any] | None = None,
        zero_copy: bool = False,
        max_staging_bytes: int | None = None,
        max_write_bytes_per_s: float | None = None,
        incremental: bool = False,
        writer: Literal["thread", "process"] = "thread",
        local: LocalTier | None = None,
    ) -> None:
        o = self._options = Options.check(
            directory,
            save=save,
            keep=keep,
            keep_items=keep_items,
            handlers=handlers,
            best=best,
            step_prefix=step_prefix,
            step_digits=step_digits,
            async_save=async_save,
            max_pending=max_pending,
            read_only=read_only,
            barrier_timeout=barrier_timeout,
            primary_process=primary_process,
            storage_options=storage_options,
            tensorboard_dir=tensorboard_dir,
            metadata=metadata,
            zero_copy=zero_copy,
            max_staging_bytes=max_staging_bytes,
            max_write_bytes_per_s=max_write_bytes_per_s,
            incremental=incremental,
            writer=writer,
            local=local,
        )
        self._names, self._read_only = o.names, o.read_only
        self._staging = StagingPool(
            max_bytes=o.max_staging_bytes,
            zero_copy=o.zero_copy or o.read_only,  # a reader stages nothing, prepares nothing
            remember=o.incremental,
            shared=o.writer_process,
        )
        # Writers of a jax.distributed run coordinate; readers need not, but restore each
        # process's own per-process data (iterator positions).
        procs = SINGLE if o.read_only else Processes.detect(o.primary_process)
        me = Processes.detect(o.primary_process) if o.read_only else procs
        self._storage = storage = open_storage(o.directory, o.storage_options)
        self._where = storage.url
        if procs.count > 1 and not storage.multi_process:
            storage.close()
            raise ValueError(
                f"directory {self._where!r} lives in this process's memory; the other "
                f"{procs.count - 1} processes of this jax.distributed run cannot see it "
                "(use a shared filesystem, s3:// or gs://)"
            )
        self._superseded: str | None = None  # why saves now raise, once a newer manager took over
        self._handing = threading.Lock()  # a save's hand-off to the commit thread; a takeover
        refusal = naming_refusal(storage, o.names) if storage.lists_cheaply else None
        if refusal is not None:  # every process: none may wait for a primary that refused
            storage.close()
            raise ValueError(refusal)
        self._key = storage.identity
        if not o.read_only:
            takeover.take_over(self._key, self)
        else:  # read your writes: wait for what this process's writer accepted
            takeover.settle_writer(self._key)
        self._catalog = catalog = Catalog(journal=procs.count > 1 and procs.primary)
        errors, reclaimer = Errors(), Reclaimer(enabled=not o.read_only)
        self._reader = Reader(storage, o.names, catalog, o.handlers, me, errors.failed)
        self._retention = Retention(
            storage,
            o.names,
            catalog,
            o.keep,
            o.keep_items,
            reclaim=reclaimer,
            retire=procs.count > 1 and storage.shares_deletion,
        )
        self._together = Coordinator(
            procs, o.barrier_timeout, storage, o.names, catalog, self._reader, self._retention
        )
        self._writer = not o.read_only and procs.primary  # holds the lock, cleans, deletes
        self._local: Local | NoLocal = NoLocal()
        try:
            if o.local is not None:  # first: a part a peer sends back is on its way meanwhile
                self._together.hello()
                self._local = Local.open(o.local, self._together, type(self), o)
            _open_directory(storage, o, self._reader, self._together, writer=self._writer)
        except BaseException:
            self._local.abandon()
            if self._writer:
                storage.release()
            storage.close()
            takeover.forget_writer(self._key, self)
            raise
        self._reader.telemetry = self._telemetry = Telemetry(o.tensorboard_dir)
        self._commits = Committer(
            storage=storage,
            names=o.names,
            catalog=catalog,
            reader=self._reader,
            retention=self._retention,
            coordinator=self._together,
            telemetry=self._telemetry,
            errors=errors,
            reclaimer=reclaimer,
            timeout=o.barrier_timeout,
            max_pending=o.max_pending,
            threads=not o.read_only and o.async_save,
            writer_spec=writer_spec(o, procs) if o.writer_process else None,
        )
        if self._commits.executor is not None:
            _exit.finish_before_shutdown(self._commits)
        newest = catalog.newest_intact()
        self._last_save = LastSave()
        if newest is not None and newest.manifest is not None:
            warn = not o.read_only and uses_time(o.save)
            self._last_save.read(newest.manifest.step, newest.manifest.started_at, warn=warn)
        preemption = [] if o.read_only else find_on_preemption(o.save)
        self._preemption = (
            PreemptionWatch([s for p in preemption for s in p.signals]) if preemption else None
        )
        self._preemption_asked: int | None = None

    # ------------------------------------------------------------------ properties

    @property
    def directory(self) -> Path | str:
        """The checkpoint directory: a Path, or the URL of an object-store directory."""
        return self._storage.directory

    @property
    def read_only(self) -> bool:
        return self._read_only

    def __repr__(self) -> str:
        mode = "read_only" if self._read_only else ("async" if self._options.async_save else "sync")
        return f"CheckpointManager({self._where!r}, {mode}, steps={self.all_steps()})"

    # ------------------------------------------------------------------ saving

    def should_save(self, step: Any) -> bool:
        """Whether the save policy (or the local tier's) wants `step` saved; False for steps at
        or below the newest (of that tier)."""
        return any(self._wants(as_step(step), force=False))

    def _wants(self, step: int, *, force: bool) -> tuple[bool, bool]:
        """Whether the persistent tier and the local tier want `step` (`force`: both, where
        the step is not at or below their newest); every process asks alike."""
        local = self._local.wants(step, force=force)
        known = self._catalog.known()
        if force:
            return True, local

        def preempted() -> bool:
            reached = self._preemption is not None and self._preemption.reached(step)
            if reached:
                self._preemption_asked = step  # reached_preemption(step) may now say stop
            return reached

        # Clocks differ between hosts: a time policy is the primary's, for everyone.
        decide = self._together.decide
        policy = self._options.save
        wants = policy_wants(
            policy, step, known, self._last_save, decide, "should_save", preempted=preempted
        )
        return wants, local

    def save(
        self,
        step: Any,
        items: Mapping[str, Any],
        *,
        metrics: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> bool:
        """Save `items` as `step` if the policy says so (or `force`); True if a save started.

        Runs each item's snapshot on this thread, then hands the write and commit to the commit
        thread (or runs them here when ``async_save=False``, raising their errors directly).
        The train state's copies into staging memory run on while the commit starts writing;
        save() returns once they are done, so the caller may then donate or change its arrays.
        As Orbax: without `force` the policy decides first, and says no for a step that is
        committed or in flight (False, logged); with `force` such a step raises
        StepAlreadyExistsError.
        Every argument is checked before anything is captured or written.
        """
        entered, started_at = time.monotonic(), time.time()
        self._check_writable("save")
        self.check_for_errors()
        step = as_step(step)
        items = check_items(items)
        if not items:
            raise ValueError("items is empty: give at least one item, e.g. {'state': state}")
        metrics = check_metrics(metrics) if metrics is not None else {}
        metadata = check_metadata(metadata) if metadata is not None else {}
        if not isinstance(force, bool):
            raise TypeError(f"force must be a bool, got {force!r}")
        handlers = {}
        for name, obj in items.items():
            with _naming_item(name):
                handlers[name] = self._options.handlers.get(name) or handler_for(obj)
        # Orbax's order: the policy first (False for a step that exists), then the step itself.
        persistent, local = self._wants(step, force=force)
        if not (persistent or local):
            if self._catalog.state(step) is not None:
                log.info("cairn: step %d exists in %s; not saved again", step, self._where)
            return False
        state = self._catalog.state(step) if persistent else None
        if state is not None:
            raise StepAlreadyExistsError(f"step {step} is already {state} in {self._where}")

        if persistent:
            self._commits.take_slot(step)  # at most max_pending saves in flight
        snapshots: dict[str, tuple[Handler, Any]] = {}
        try:
            self.check_for_errors()  # the commit we waited for may have failed
            for name, obj in items.items():
                with _naming_item(name), staging_for(self._staging, name), as_parts(local):
                    snapshots[name] = (handlers[name], handlers[name].snapshot(obj))
        except BaseException:
            self._commits.abandon(snapshots, slot=persistent)
            raise
        self._staging.drop_unused(items)  # what a restore prepared for items not saved again
        if persistent:
            self._last_save.started(entered)
        tmp_name = None
        if persistent and self._together.procs.count > 1:  # one temporary directory for all
            digest = hashlib.md5(self._together.collective("save").encode()).hexdigest()
            tmp_name = f"{self._names.format(step)}.tmp-{digest}"
        job = _commit.SaveJob(
            tmp_name=tmp_name,
            step=step,
            snapshots=snapshots,
            metrics=metrics,
            metadata=metadata,
            started_at=started_at,
            blocked_s=time.monotonic() - entered,
            budget=self._options.budget,
            incremental=self._options.incremental,
            settled=threading.Event(),
            best=self._options.best_rule,
        )
        packed, in_process, part = None, self._options.writer_process and persistent, None
        try:
            if self._commits.executor is None or in_process:  # committed here, or sent: copies
                settle(job, entered)
                packed = pack_job(job) if in_process else None
            if local:  # (a synchronous part that fails raises here: the persistent write too)
                part = self._local.save(job, entered, persistent=persistent)
        except BaseException:
            self._commits.abandon(snapshots, slot=persistent)
            raise
        if part is not None and not persistent:
            settle(job, entered, handed=True)
            self._local.finish(part, job)
            return True
        with self._handing:  # a takeover from another thread waits for this save, or refuses it
            if self._superseded is not None:  # a local part being written counts (`share`)
                self._commits.abandon(snapshots, slot=persistent)
                raise SupersededError(f"save: {self._superseded}")
            self._catalog.start(step)
            if self._commits.executor is None:
                self._commits.run_save(job, reraise=True)
            else:
                self._commits.hand_over(job, packed, owner=self)
        settle(job, entered, handed=True)  # the commit writes each span as its copy ends
        if part is not None:
            self._local.finish(part, job)
        if self._preemption is not None and self._preemption.reached(step):
            self.wait_until_finished()  # the job is ending: this step must land before it does
        return True

    def reached_preemption(self, step: Any) -> bool:
        """Whether the job was told to stop (needs ``OnPreemption`` in ``save=``): save, then exit.

        Typical loop: ``if mgr.should_save(step): mgr.save(...)``, then
        ``if mgr.reached_preemption(step): break``. It turns True at the step whose
        `should_save` saw the preemption (and saved), so the loop never stops unsaved: a signal
        that arrives after `should_save(step)` was asked is acted on at the next step. With several processes (and no JAX preemption
        service) the primary decides for everyone, so all stop at the same step.
        """
        step = as_step(step)
        if self._preemption is None:
            return False
        # Stop only after should_save had its chance to save: a signal that arrives between
        # should_save(step) and this call is acted on at the next step, which saves first.
        noticed = self._preemption.reached(step)
        at = self._preemption.reached_at
        mine = noticed and at is not None and (at < step or self._preemption_asked == step)
        if self._preemption.synchronised:
            return mine
        return self._together.decide("preempted", lambda: mine)

    def is_saving_in_progress(self) -> bool:
        """Whether a save is still being written or committed (Orbax's name)."""
        return self._local.busy() or self._catalog.any_in_flight()

    # ------------------------------------------------------------------ waiting and errors

    def wait_until_finished(self) -> None:
        """Block until pending commits and the retention after them are done, and the staging
        memory the next save copies into is ready; raise their error."""
        self._commits.drain()
        self._local.drain()
        self._staging.wait()
        self.check_for_errors()

    def check_for_errors(self) -> None:
        """Raise CommitError (once) if a background commit or retention failed since the last
        call (of either tier)."""
        self._commits.errors.raise_kept()
        self._local.check_for_errors()

    def close(self) -> None:
        """Wait for pending commits, release the directory; raise a pending commit error if any."""
        if self._commits.closed:
            return
        try:
            self.wait_until_finished()
        finally:
            self._commits.closed = True
            self._local.close()
            if self._preemption is not None:
                self._preemption.close()
            self._telemetry.close()
            self._staging.close()
            self._commits.stop()
            if self._writer:
                self._storage.release()
            self._storage.close()
            takeover.forget_writer(self._key, self)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
            return
        try:  # the body's exception goes on; a commit failure is logged, not raised over it
            self.close()
        except Exception as e:
            log.error("cairn: closing after %s: %s", type(exc).__name__, e)
            exc.add_note(f"cairn: also, closing the manager failed: {e}")

    # ------------------------------------------------------------------ reading

    def all_steps(self, tier: Literal["persistent", "local"] | None = None) -> list[int]:
        """Committed steps, sorted (a damaged step is listed too; `restore` tells it apart); of
        one tier, or of both (``local=``: the local steps every process held at the last
        agreement, and those this process committed since)."""
        return self._local.all_steps(self._catalog.steps(), tier)

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def restore(
        self,
        step: Any = None,
        items: Mapping[str, Any] | None = None,
        *,
        fallback: bool = True,
    ) -> dict[str, Any]:
        """Restore a step: the newest intact one (None), ``"best"``, or a given step number.

        `items`: None restores every item without targets; otherwise a mapping of the items wanted
        to a target each (None for no target). Returns ``{name: restored}`` for those items.
        With ``step=None`` a damaged newest step is skipped with a logged warning in favour of the
        next one, unless ``fallback=False``; a given step that is damaged always raises
        CorruptCheckpointError naming the file. An item that a writer's per-item retention drops
        while it is read is not damage: it is left out (items=None), or ItemNotFoundError when
        named. Pending commits finish first (their errors are left for the next save,
        wait_until_finished, check_for_errors or close).
        """
        if not isinstance(fallback, bool):
            raise TypeError(f"fallback must be a bool, got {fallback!r}")
        wanted = None if items is None else check_items(items)
        self._commits.drain()  # pending commits (and the retention after them) land first, as T5X
        if isinstance(step, str):
            if step != "best":
                raise ValueError(f"step must be None, 'best' or an integer, got {step!r}")
            best = self.best_step()
            if best is None:
                metric, _ = self._options.required_best_rule()
                raise StepNotFoundError(f"no step in {self._where} has metric {metric!r}")
            restored = self._reader.restore(best, wanted)
        elif isinstance(self._local, Local):  # one decision of all processes, of either tier
            at = None if step is None else as_step(step)
            persistent = self._catalog.steps()
            restored = self._local.restore(self._reader, persistent, at, wanted, fallback)[1]
        elif step is None:
            restored = self._reader.restore_newest(wanted, fallback)
        else:
            step = as_step(step)
            if step not in self.all_steps():
                raise StepNotFoundError(self._reader.missing(step))
            restored = self._reader.restore(step, wanted)
        _prepare_staging(self._staging, self._options.handlers, restored)  # none if read-only
        return restored

    def verify(
        self,
        step: Any,
        *,
        progress: Callable[[int], None] | None = None,
        checked: dict[tuple[int, ...], str] | None = None,
    ) -> list[str]:
        """Read every file of a committed step and check it; returns the problems found (none:
        the step is intact). Each names the file: missing, truncated, failing its checksum, a
        link, or an unreadable manifest or ``metrics.json``; then each item's handler checks
        what a restore checks before it reads. `progress(n)` is called with the bytes of each
        file checked. Files that a writer's retention dropped while they were being checked are
        no problem: the step is checked again under its new manifest.

        `checked`: a dict to pass to several calls (``cairn verify`` does, for all the steps of
        a directory) so that a file that steps share (an incremental save's hard link) is read
        once (`StoredItem.check_file`)."""
        step = as_step(step)
        self._commits.wait_if_inflight(step)
        return self._reader.verify(step, progress, checked)

    def describe(self, step: Any) -> dict[str, dict[str, Any]]:
        """What each item of a committed step holds, from its handler's ``describe``: for array
        trees every leaf with its key path, shape and dtype, and the bytes. Dropped items are
        reported as such."""
        step = as_step(step)
        self._commits.wait_if_inflight(step)
        return self._reader.describe(step)

    def info(self, step: Any) -> StepInfo:
        """The manifest of a committed step: items, metrics, user metadata, times, telemetry,
        and which tier holds it (a step of both: the persistent one)."""
        step = as_step(step)
        self._commits.wait_if_inflight(step)
        if step not in self._catalog.steps() and step in self._local.steps():
            return self._local.info(step)
        return self._reader.info(step)

    # ------------------------------------------------------------------ metrics

    def metadata(self, step: Any = None) -> dict[str, Any]:
        """The directory's metadata (None: given once as ``metadata=``; the first writable
        manager that gave one saved it, later ones keep it), or a step's ``metadata=``."""
        if step is not None:
            return dict(self.info(step).metadata)
        return self._reader.root_metadata(self._options.metadata)

    def metrics(self, step: Any) -> dict[str, float]:
        """The metrics of a step: those given to save, updated by record_metrics (later wins)."""
        step = as_step(step)
        self._commits.wait_if_inflight(step)
        self._reader.record(step)
        return self._catalog.metrics(step)

    def record_metrics(self, step: Any, metrics: Mapping[str, Any]) -> None:
        """Merge late metrics (say, from an evaluation) into a committed step's ``metrics.json``.

        Waits for a commit of `step` still in flight; StepNotFoundError for an unknown step.
        Retention runs again afterwards, so KeepBest sees the new values.
        """
        self._check_writable("record_metrics")
        step = as_step(step)
        new = check_metrics(metrics)
        self._reader.refuse_foreign(step)

        def update() -> None:
            rec = self._catalog.get(step)
            if rec is None:
                raise StepNotFoundError(self._reader.missing(step))
            if rec.manifest is None:
                self._reader.manifest(step)  # raises the step's own error
            merged = {**rec.late_metrics, **new}
            if self._together.procs.primary:
                body = dump_checked({"metrics": merged})
                self._storage.write_metrics(self._names.format(step), body)
            self._catalog.update(step, late_metrics=merged)
            if self._together.procs.primary:
                self._retention.apply()

        self._commits.on_commit_thread(self._together.together("record_metrics", update))

    def best_step(self) -> int | None:
        """The intact step with the best value of the `best=` metric (or the KeepBest one)."""
        metric, mode = self._options.required_best_rule()
        scored = self._catalog.scored(metric)
        if not scored:
            return None
        sign = 1.0 if mode == "min" else -1.0
        return min(scored, key=lambda sv: (sign * sv[1], -sv[0]))[0]

    # ------------------------------------------------------------------ changing the directory

    def delete(self, step: Any) -> None:
        """Delete a committed step (after pending commits): rename to trash, then remove."""
        self._check_writable("delete")
        step = as_step(step)
        self._reader.refuse_foreign(step)

        def remove() -> None:
            if self._catalog.get(step) is None:
                raise StepNotFoundError(self._reader.missing(step))
            if self._together.procs.primary:
                self._retention.delete(step)

        self._commits.on_commit_thread(self._together.together("delete", remove))

    def delete_directory(self, name: str) -> None:
        """Delete `name`, a directory of the root that is no committed step (one that
        SpeechBrain wrote itself, say), as `delete` does a step: after pending commits, under
        the directory's lock. ValueError if `name` is not one plain entry name, or names cairn's
        own files or a step cairn or orbax-checkpoint committed (`Retention.delete_directory`)."""
        self._check_writable("delete_directory")
        name = check_entry_name(name, self._names)

        def remove() -> None:
            if self._together.procs.primary:
                self._retention.delete_directory(name)

        self._commits.on_commit_thread(self._together.together("delete_directory", remove))

    def reload(self) -> None:
        """Read the directory again (after pending commits), e.g. to see another writer's steps."""
        self._catalog.replace(self._commits.on_commit_thread(self._reader.scan))

    def _check_writable(self, what: str) -> None:
        if self._superseded is not None:
            raise SupersededError(f"{what}: {self._superseded}")
        if self._read_only:
            raise ReadOnlyError(
                f"{what}: this manager of {self._where} was opened with read_only=True"
            )
        if self._commits.closed:
            raise RuntimeError(f"{what}: this manager of {self._where} is closed")


def _prepare_staging(
    pool: StagingPool, handlers: Mapping[str, Handler], restored: Mapping[str, Any]
) -> None:
    """After a restore: the staging memory that each restored state's next save copies into,
    faulted in on a background thread (`StagingPool.prepare`), so that a restarted job's first
    save costs what a later one does. The size comes from the handler's ``staging_bytes``
    (`TrainStateHandler`'s); a state whose size cannot be told is left to its first save."""
    for name, obj in restored.items():
        try:
            handler = handlers.get(name) or handler_for(obj)
            size = getattr(handler, "staging_bytes", None)
            if size is not None:
                pool.prepare(name, size(obj, shared=pool.shared))
        except Exception as e:  # costs the first save a fault-in, never the restore
            log.debug("cairn: no staging memory prepared for item %r: %r", name, e)


def _open_directory(
    storage: Storage, o: Options, reader: Reader, together: Coordinator, *, writer: bool
) -> None:
    """The writer (the primary of a writable manager) locks, cleans up, saves the metadata;
    the primary lists the steps, which every process then knows (`Coordinator.open`); the
    writer finishes what a crash left between an item's drop and the removal of its files."""
    listed = _open_for_writing(storage, o, reader) if writer else None
    refusal = None
    catalog = reader.catalog
    if together.procs.primary:
        catalog.replace(reader.scan(listed))
        if not storage.lists_cheaply and not catalog.steps():  # one more listing
            refusal = naming_refusal(storage, o.names)
    together.open(refusal)
    if writer:
        storage.remove_dropped(
            {
                o.names.format(step): manifest
                for step, manifest in catalog.manifests().items()
                if any(e.dropped for e in manifest.items.values())
            }
        )


def _open_for_writing(storage: Storage, o: Options, reader: Reader) -> list[Listed]:
    """The writer (the primary of a writable manager): lock, clean up, save metadata; the
    committed steps, as the clean-up listed them."""
    storage.acquire()
    if o.writer_process and storage.for_writer_process() is None:
        raise ValueError(
            f"writer='process' cannot commit into {storage.url}: a writer "
            "process cannot reach this process's memory; use writer='thread'"
        )
    listed = storage.clean_leftovers(o.names)
    if o.metadata is not None:
        reader.save_root_metadata(o.metadata)
    return listed


@contextlib.contextmanager
def _naming_item(name: str) -> Iterator[None]:
    """Prefix a TypeError/ValueError raised for one item with the item's name."""
    try:
        yield
    except (TypeError, ValueError) as e:
        if type(e) in (TypeError, ValueError, MismatchError):
            raise type(e)(f"item {name!r}: {e}") from e
        raise
