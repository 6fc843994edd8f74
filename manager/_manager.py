"""CheckpointManager: when to save, the commit thread, retention, metrics, restore."""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.thread  # registers its shutdown hook before ours (see _finish_at_exit)
import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import logging
import os
import shutil
import stat
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, Literal, TypeVar

from cairn.handlers import Handler, StoredItem, handler_by_id, handler_for
from cairn.handlers._files import lower_thread_priority, read_no_follow, writing_as
from cairn.handlers.errors import (
    CommitError,
    CorruptCheckpointError,
    DirectoryLockedError,
    ItemNotFoundError,
    MismatchError,
    ReadOnlyError,
    StepAlreadyExistsError,
    StepNotFoundError,
    UnsupportedFormatError,
)
from cairn.manager import _commit, _objectstore, _telemetry
from cairn.manager._format import (
    LOCK,
    MANIFEST,
    METRICS,
    ItemEntry,
    Manifest,
    StepNames,
    check_metadata,
    check_metrics,
    load_checked,
)
from cairn.manager._multihost import SINGLE, Processes
from cairn.manager._policies import (
    AnyOf,
    AtSteps,
    EveryNSteps,
    KeepAll,
    KeepPolicy,
    SaveContext,
    SavePolicy,
    StepView,
    checked_should_save,
    find_keep_best,
    find_on_preemption,
    policy_kind,
    steps_to_delete,
)
from cairn.manager._preemption import PreemptionWatch
from cairn.manager._validate import as_step, check_item_name, check_items

log = logging.getLogger("cairn")
T = TypeVar("T")
# How often a read starts over because the step's manifest changed under it (each change is an
# item dropped by the writer's retention, so a step changes at most once per item).
_REREADS = 8


@dataclasses.dataclass(frozen=True)
class ItemInfo:
    """One item of a committed step, as its manifest describes it."""

    handler: str
    version: int
    bytes: int
    files: tuple[str, ...]
    dropped: bool


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What `CheckpointManager.info(step)` returns.

    `telemetry` holds ``blocked_s`` (time save() held the caller), ``write_s`` (item writes on the
    commit thread), ``bytes``, and, for steps this manager saved, ``commit_s`` (commit thread start
    to rename done, retention excluded) and ``bytes_per_s``, and for steps it restored,
    ``restore_s`` (the last restore). With ``tensorboard_dir=`` the same figures are written as
    TensorBoard scalars under Orbax's names (``/jax/checkpoint/write/blocking_duration_secs``, ...).
    """

    step: int
    path: Path | str  # a URL for a step in an object store
    started_at: float
    committed_at: float
    items: Mapping[str, ItemInfo]
    metrics: Mapping[str, float]
    metadata: Mapping[str, Any]
    telemetry: Mapping[str, float]

    @property
    def bytes(self) -> int:
        return sum(i.bytes for i in self.items.values())


@dataclasses.dataclass
class _Step:
    """A committed step as the manager knows it: its manifest, or why it is unreadable."""

    manifest: Manifest | None
    error: Exception | None = None
    late_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    foreign: bool = False  # written by orbax-checkpoint: read-only for cairn

    @property
    def metrics(self) -> dict[str, float]:
        base = dict(self.manifest.metrics) if self.manifest else {}
        return {**base, **self.late_metrics}


class CheckpointManager:
    """Saves steps of a training run into one directory and brings them back.

    Typical use::

        with CheckpointManager(workdir, save=EveryNSteps(1000), keep=KeepLatest(3)) as mgr:
            state = mgr.restore()["state"] if mgr.latest_step() is not None else init()
            for step in ...:
                if mgr.should_save(step):
                    mgr.save(step, {"state": state}, metrics={"loss": loss})

    Concurrency: call the public methods from one thread (the training loop); the manager is not
    thread-safe. Each manager owns one commit thread ("cairn-commit"), which runs the write phase of
    saves, the commit, retention, `record_metrics`, `delete` and `reload` -- every change to the
    directory -- in submission order, so they never interleave. `save()` returns after the
    snapshot phase; at most `max_pending` saves are in flight, and a further save waits (counted as
    blocked time). State shared with the commit thread (known steps, steps in flight, errors) is
    guarded by one lock. An error on the commit thread is kept and raised once, as CommitError with
    the original chained, by the next `save`, `wait_until_finished`, `check_for_errors` or `close`.
    A deleted step leaves the directory's listing on the commit thread (renamed to ``.trash-*``);
    a second thread ("cairn-reclaim") then frees its space, and `close` waits for it. Background
    threads run at a lower CPU priority (nice 10), so a training step on busy cores goes first.

    Processes: one writable manager per directory, enforced by an advisory lock on
    ``<directory>/.cairn.lock`` (DirectoryLockedError otherwise); any number of
    ``read_only=True`` managers may read alongside it.
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
        storage_options: Mapping[str, Any] | None = None,
        tensorboard_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        target = _check_directory(directory)
        self._root: Path = target if isinstance(target, Path) else Path()  # set below for URLs
        self._options = _objectstore.StorageOptions.from_mapping(storage_options)
        self._save_policy: SavePolicy = EveryNSteps(1) if save is None else save
        if policy_kind(self._save_policy) != "save":
            raise TypeError(
                f"save= must be a save policy (EveryNSteps, AtSteps, ...), got {save!r}"
            )
        self._keep: KeepPolicy = KeepAll() if keep is None else keep
        if policy_kind(self._keep) != "keep":
            raise TypeError(
                f"keep= must be a keep policy (KeepLatest, KeepBest, ...), got {keep!r}"
            )
        self._keep_items = _check_keep_items(keep_items)
        self._handlers = _check_handlers(handlers)
        self._best = _check_best(best)
        self._names = StepNames(step_prefix, step_digits)
        for flag, value in (("async_save", async_save), ("read_only", read_only)):
            if not isinstance(value, bool):
                raise TypeError(f"{flag} must be a bool, got {value!r}")
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending must be a positive int, got {max_pending!r}")
        if (
            isinstance(barrier_timeout, bool)
            or not isinstance(barrier_timeout, (int, float))
            or not barrier_timeout > 0
        ):
            raise ValueError(
                f"barrier_timeout must be a positive number of seconds, got {barrier_timeout!r}"
            )
        self._async = async_save
        self._read_only = read_only
        if tensorboard_dir is not None and not isinstance(tensorboard_dir, (str, os.PathLike)):
            raise TypeError(f"tensorboard_dir must be a path, got {tensorboard_dir!r}")
        self._timeout = float(barrier_timeout)
        # Writers of a jax.distributed run coordinate; readers need not, but restore each
        # process's own per-process data (iterator positions).
        self._procs = SINGLE if read_only else Processes.detect()
        self._me = Processes.detect() if read_only else self._procs
        self._calls = 0  # collective calls so far: the same sequence on every process

        self._lock = threading.Lock()
        self._steps: dict[int, _Step] = {}
        self._inflight: set[int] = set()
        self._errors: list[tuple[str, BaseException]] = []
        self._commit_telemetry: dict[int, dict[str, float]] = {}
        self._restore_telemetry: dict[int, float] = {}
        self._slots = threading.BoundedSemaphore(max_pending)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._reclaimer: concurrent.futures.ThreadPoolExecutor | None = None
        self._dir_lock: _DirectoryLock | None = None
        self._lease: _objectstore.Lease | None = None
        self._closed = False
        self._store: _objectstore.ObjectStore | None = None
        self._where = str(self._root)
        if isinstance(target, str):  # an object store: a local staging directory for files
            if self._procs.count > 1:
                raise ValueError(
                    f"directory {target!r}: object stores are single-process in this version"
                )
            self._store = _objectstore.ObjectStore(target, self._options)
            self._where = self._store.url
            self._root = Path(tempfile.mkdtemp(prefix="cairn-staging-"))
            self._local = weakref.finalize(self, shutil.rmtree, self._root, True)

        primary = self._procs.primary
        if self._store is not None:
            if not read_only:
                self._lease = _objectstore.Lease(self._store)
        elif not read_only and primary:
            try:
                self._root.mkdir(parents=True, exist_ok=True)
                self._dir_lock = _DirectoryLock(self._root)
            except OSError as e:
                if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                    raise
                raise ReadOnlyError(
                    f"{self._root} cannot be written ({e.strerror}); open it with "
                    "read_only=True to read its checkpoints"
                ) from e
        try:
            if not read_only and primary and self._store is None:
                _commit.clean_leftovers(self._root, self._names)
            run = uuid.uuid4().hex if primary else None
            opened = _OPENED[str(self._root)] = _OPENED.get(str(self._root), 0) + 1
            key = (
                f"cairn/open/{opened}:{self._root}"  # the same on every process, unique per manager
            )
            self._run = (
                self._procs.broadcast(key, run, self._timeout)
                if self._procs.count > 1
                else run or ""
            )
            self._procs.barrier(f"cairn/{self._run}/opened", self._timeout)  # after the cleanup
            self._steps = self._scan(clean=not read_only)
            if self._store is not None and not read_only:  # a crash inside a drop_item
                _objectstore.remove_dropped(
                    self._store,
                    {
                        self._names.format(step): [
                            n for n, e in rec.manifest.items.items() if e.dropped
                        ]
                        for step, rec in self._steps.items()
                        if rec.manifest is not None
                    },
                )
            if not read_only and primary and self._store is None:  # a crash between drop and trash
                for step, rec in self._steps.items():
                    if rec.manifest is not None:
                        _commit.remove_dropped(self._root / self._names.format(step), rec.manifest)
        except BaseException:
            if self._dir_lock is not None:
                self._dir_lock.release()
            if self._lease is not None:
                self._lease.release()
            raise
        if not read_only and async_save:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="cairn-commit", initializer=lower_thread_priority
            )
            _OPEN_WRITERS.add(self)
        # Deleted steps are renamed to trash on the commit thread; freeing their space is slow on
        # some filesystems (seconds per GiB with online discard), so it happens here, off that path.
        self._reclaimer = (
            None
            if read_only
            else concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="cairn-reclaim", initializer=lower_thread_priority
            )
        )
        self._telemetry = _telemetry.Telemetry(tensorboard_dir)
        newest = self._newest_intact()
        self._last_save_time = newest.manifest.started_at if newest and newest.manifest else None
        preemption = [] if read_only else find_on_preemption(self._save_policy)
        self._preemption = (
            PreemptionWatch([s for p in preemption for s in p.signals]) if preemption else None
        )
        self._preemption_asked: int | None = None

    # ------------------------------------------------------------------ properties

    @property
    def directory(self) -> Path | str:
        """The checkpoint directory: a Path, or the URL of an object-store directory."""
        return self._where if self._store is not None else self._root

    @property
    def read_only(self) -> bool:
        return self._read_only

    def __repr__(self) -> str:
        mode = "read_only" if self._read_only else ("async" if self._async else "sync")
        return f"CheckpointManager({self._where!r}, {mode}, steps={self.all_steps()})"

    def _collective(self, what: str) -> str:
        """A name for the next collective call, the same on every process (they call alike)."""
        self._calls += 1
        return f"cairn/{self._run}/{what}/{self._calls}"

    # ------------------------------------------------------------------ saving

    def should_save(self, step: Any) -> bool:
        """Whether the save policy wants `step` saved; False for steps at or below the newest."""
        step = as_step(step)
        with self._lock:
            known = set(self._steps) | self._inflight
        if step in known or (known and step <= max(known)):
            return False
        preempted = self._preemption is not None and self._preemption.reached(step)
        if preempted:
            self._preemption_asked = step  # reached_preemption(step) may now say stop
        context = SaveContext(
            latest_step=max(known) if known else None,
            last_save_time=self._last_save_time,
            now=time.time(),
            preempted=preempted,
        )
        if self._procs.count == 1 or not _uses_time(self._save_policy):
            return checked_should_save(self._save_policy, step, context)
        # Clocks differ between hosts: the primary decides, everyone follows.
        mine = (
            str(checked_should_save(self._save_policy, step, context))
            if self._procs.primary
            else None
        )
        return self._procs.broadcast(self._collective("should_save"), mine, self._timeout) == "True"

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
        Raises StepAlreadyExistsError for a committed or in-flight step, with or without `force`.
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
                handlers[name] = self._handlers.get(name) or handler_for(obj)
        with self._lock:
            if step in self._steps or step in self._inflight:
                state = "committed" if step in self._steps else "being committed"
                raise StepAlreadyExistsError(f"step {step} is already {state} in {self._root}")
        if not force and not self.should_save(step):
            return False

        waited = time.monotonic()
        self._slots.acquire()  # at most max_pending saves in flight
        waited = time.monotonic() - waited
        if waited > 0.001:
            log.info(
                "cairn: save of step %d waited %.1f ms for a pending commit", step, waited * 1e3
            )
        try:
            self.check_for_errors()  # the commit we waited for may have failed
            snapshots = {}
            for name, obj in items.items():
                with _naming_item(name):
                    snapshots[name] = (handlers[name], handlers[name].snapshot(obj))
        except BaseException:
            self._slots.release()
            raise
        self._last_save_time = started_at
        tmp_name = None
        if self._procs.count > 1:  # every process writes into the same temporary directory
            digest = hashlib.md5(self._collective("save").encode()).hexdigest()
            tmp_name = f"{self._names.format(step)}.tmp-{digest}"
        job = _commit.SaveJob(
            tmp_name=tmp_name,
            step=step,
            snapshots=snapshots,
            metrics=metrics,
            metadata=metadata,
            started_at=started_at,
            blocked_s=time.monotonic() - entered,
        )
        with self._lock:
            self._inflight.add(step)
        if self._executor is None:
            self._run_save(job, reraise=True)
            return True
        try:
            self._executor.submit(self._run_save, job, reraise=False)
        except BaseException:  # e.g. called from an atexit hook after interpreter shutdown began
            with self._lock:
                self._inflight.discard(step)
            self._slots.release()
            raise
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
        if self._procs.count == 1 or self._preemption.synchronised:
            return mine
        decided = str(mine) if self._procs.primary else None
        return (
            self._procs.broadcast(self._collective("preempted"), decided, self._timeout) == "True"
        )

    def _run_save(self, job: _commit.SaveJob, *, reraise: bool) -> None:
        """Commit thread: commit one step, then apply retention. Errors are kept for the caller.

        With several processes the primary commits and applies retention, then tells the others
        the outcome; they read the directory again.
        """
        t0 = time.monotonic()
        procs, outcome_key = self._procs, f"cairn/{job.tmp_name}/outcome"
        try:
            try:
                manifest: Manifest | None
                if self._store is not None:
                    manifest = _objectstore.commit_step(
                        self._store, self._root, self._names, job, self._lease
                    )
                else:
                    manifest = _commit.commit_step(
                        self._root, self._names, job, procs, timeout_s=self._timeout
                    )
                if manifest is None:  # not the primary: wait for its word
                    outcome = procs.broadcast(outcome_key, None, self._timeout)
                    if outcome != "ok":
                        raise RuntimeError(
                            f"the primary process did not commit step {job.step}: {outcome}"
                        )
                    steps = self._scan()
                    with self._lock:
                        self._steps = steps
                        self._inflight.discard(job.step)
                    procs.barrier(f"{outcome_key}/read", self._timeout)  # see below
                    return
            except BaseException as e:
                if procs.count > 1 and procs.primary:
                    with contextlib.suppress(Exception):
                        procs.broadcast(outcome_key, f"{type(e).__name__}: {e}", self._timeout)
                with self._lock:
                    self._inflight.discard(job.step)
                if not reraise:
                    self._keep_error(f"the commit of step {job.step}", e)
                self._adopt_if_on_disk(job.step)  # e.g. the rename happened, its fsync failed
                if reraise:
                    raise
                return
            commit_s = time.monotonic() - t0
            size = manifest.telemetry.get("bytes", 0.0)
            with self._lock:
                self._steps[job.step] = _Step(manifest)
                self._inflight.discard(job.step)
                self._commit_telemetry[job.step] = {
                    "commit_s": commit_s,
                    "bytes_per_s": size / commit_s if commit_s > 0 else 0.0,
                }
            log.info(
                "cairn: committed step %d: blocked %.1f ms, commit %.1f ms, %.0f bytes",
                job.step,
                job.blocked_s * 1e3,
                commit_s * 1e3,
                size,
            )
            with contextlib.suppress(Exception):  # telemetry never fails a commit
                self._telemetry.committed(job.step, job.blocked_s, commit_s, size)
            try:
                self._apply_retention()
            except Exception as e:
                if reraise:
                    raise
                self._keep_error(f"retention after step {job.step}", e)
            finally:
                if procs.count > 1:  # committed; retention done or failed on its own
                    procs.broadcast(outcome_key, "ok", self._timeout)
                    # The next change (a delete, another commit's retention) waits until the
                    # others have read the directory, or they could see a step half gone.
                    procs.barrier(f"{outcome_key}/read", self._timeout)
        finally:
            self._slots.release()

    def _keep_error(self, what: str, error: BaseException) -> None:
        log.error("cairn: %s failed: %r", what, error)
        with self._lock:
            self._errors.append((what, error))

    def _apply_retention(self) -> None:
        """Commit thread: delete the committed steps the keep policy does not keep."""
        with self._lock:
            views = [
                StepView(s, rec.manifest.started_at, rec.metrics)
                for s, rec in self._steps.items()
                if rec.manifest is not None and not rec.foreign  # Orbax steps are never touched
            ]
        failures = []
        for step in steps_to_delete(views, self._keep):
            log.info("cairn: retention deletes step %d", step)
            try:
                self._delete_now(step)
            except OSError as e:  # one bad step must not stop retention for the others
                failures.append((step, e))
        for item, policy in self._keep_items.items():
            with self._lock:
                holding = [
                    StepView(s, rec.manifest.started_at, rec.metrics)
                    for s, rec in self._steps.items()
                    if rec.manifest is not None
                    and not rec.foreign
                    and item in rec.manifest.items
                    and not rec.manifest.items[item].dropped
                ]
            for step in steps_to_delete(holding, policy):
                log.info("cairn: retention drops item %r of step %d", item, step)
                try:
                    self._drop_item_now(step, item)
                except OSError as e:
                    failures.append((step, e))
        if failures:
            step, first = failures[0]
            raise OSError(
                f"retention could not delete steps {[s for s, _ in failures]}: step {step}: {first}"
            ) from first

    def _delete_now(self, step: int) -> None:
        if self._store is not None:
            _objectstore.delete_step(self._store, self._names.format(step))
            with self._lock:
                self._steps.pop(step, None)
                self._commit_telemetry.pop(step, None)
            return
        try:
            trash = _commit.delete_step(self._root, self._names.format(step))
        finally:
            if not (self._root / self._names.format(step)).exists():  # gone, whoever removed it
                with self._lock:
                    self._steps.pop(step, None)
                    self._commit_telemetry.pop(step, None)
        if trash is not None and self._reclaimer is not None:
            self._reclaimer.submit(_commit.remove_trash, trash)

    def _drop_item_now(self, step: int, item: str) -> None:
        with self._lock:
            rec = self._steps[step]
        assert rec.manifest is not None
        if self._store is not None:
            new = _objectstore.drop_item(self._store, self._names.format(step), rec.manifest, item)
            with self._lock:
                rec.manifest = new
            return
        manifest, trash = _commit.drop_item(
            self._root / self._names.format(step), rec.manifest, item
        )
        with self._lock:
            rec.manifest = manifest
        if trash is not None and self._reclaimer is not None:
            self._reclaimer.submit(_commit.remove_trash, trash)

    def _together(self, what: str, fn: Callable[[], None]) -> Callable[[], None]:
        """`fn` (which changes the directory only on the primary), then, with several processes,
        a barrier after which the others read the directory again, and a second one so the
        primary's next change cannot race with that reading. Call on the caller thread."""
        if self._procs.count == 1:
            return fn
        barrier = self._collective(what)

        def run() -> None:
            try:
                fn()
            finally:
                self._procs.barrier(f"{barrier}/changed", self._timeout)
                if not self._procs.primary:
                    steps = self._scan()
                    with self._lock:
                        self._steps = steps
                # and the primary changes nothing more until everyone has read the directory
                self._procs.barrier(f"{barrier}/read", self._timeout)

        return run

    def _on_commit_thread(self, fn: Callable[[], T]) -> T:
        """Run `fn` after every pending commit, on the commit thread when there is one."""
        if self._closed:
            raise RuntimeError(f"this manager of {self._root} is closed")
        if self._executor is None:
            return fn()
        return self._executor.submit(fn).result()

    # ------------------------------------------------------------------ waiting and errors

    def wait_until_finished(self) -> None:
        """Block until pending commits and the retention after them are done; raise their error."""
        self._drain()
        self.check_for_errors()

    def check_for_errors(self) -> None:
        """Raise CommitError (once) if a background commit or retention failed since the last call."""
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            what, first = errors[0]
            more = (
                f" (and {len(errors) - 1} later failures: {[w for w, _ in errors[1:]]})"
                if len(errors) > 1
                else ""
            )
            raise CommitError(f"{what} failed: {type(first).__name__}: {first}{more}") from first

    def close(self) -> None:
        """Wait for pending commits, release the directory; raise a pending commit error if any."""
        if self._closed:
            return
        try:
            self.wait_until_finished()
        finally:
            self._closed = True
            if self._preemption is not None:
                self._preemption.close()
            self._telemetry.close()
            for pool in (self._executor, self._reclaimer):
                if pool is not None:
                    pool.shutdown(wait=True)
            if self._dir_lock is not None:
                self._dir_lock.release()
            if self._lease is not None:
                self._lease.release()
            if self._store is not None:
                self._local()  # the staging directory and download cache

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

    def all_steps(self) -> list[int]:
        """Committed steps, sorted (a damaged step is listed too; `restore` tells it apart)."""
        with self._lock:
            return sorted(self._steps)

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
        self._drain()  # pending commits (and the retention after them) land first, as in T5X
        if isinstance(step, str):
            if step != "best":
                raise ValueError(f"step must be None, 'best' or an integer, got {step!r}")
            best = self.best_step()
            if best is None:
                metric, _ = self._best_rule()
                raise StepNotFoundError(f"no step in {self._root} has metric {metric!r}")
            return self._restore_step(best, wanted)
        if step is not None:
            step = as_step(step)
            if step not in self.all_steps():
                raise StepNotFoundError(self._missing(step))
            return self._restore_step(step, wanted)
        candidates = self.all_steps()[::-1]
        if not candidates:
            raise StepNotFoundError(f"no committed step in {self._root}")
        newest_error: CorruptCheckpointError | None = None
        for s in candidates:
            try:
                return self._restore_step(s, wanted)
            except StepNotFoundError:
                continue  # deleted by another manager's retention meanwhile: try the next
            except CorruptCheckpointError as e:
                if not fallback:
                    raise
                newest_error = newest_error or e
                log.warning("cairn: step %d is damaged, falling back to an older step: %s", s, e)
        if newest_error is None:
            raise StepNotFoundError(f"every step of {self._root} was deleted while being read")
        raise CorruptCheckpointError(
            f"every step in {self._root} is damaged ({candidates}); the newest: {newest_error}"
        ) from newest_error

    def _restore_step(self, step: int, wanted: dict[str, Any] | None) -> dict[str, Any]:
        t0 = time.monotonic()
        restored = self._read_items(step, wanted)
        seconds = time.monotonic() - t0
        with self._lock:
            self._restore_telemetry[step] = seconds
        log.info("cairn: restored step %d in %.1f ms", step, seconds * 1e3)
        with contextlib.suppress(Exception):
            self._telemetry.restored(step, seconds)
        return restored

    def _read_items(self, step: int, wanted: dict[str, Any] | None) -> dict[str, Any]:
        """The wanted items of a step (None: every item it has), read with the manifest this
        manager holds, which a writer's retention may have changed since: after the reads, and
        after a read that fails, the manifest is read again. A step gone is StepNotFoundError; if
        an item read was dropped meanwhile, the reads start over with the new manifest (a named
        item is then ItemNotFoundError); only damage under an unchanged manifest is damage."""
        for _ in range(_REREADS):
            manifest = self._manifest(step)
            items = (
                wanted
                if wanted is not None
                else {n: None for n, e in manifest.items.items() if not e.dropped}
            )
            try:
                restored = self._read_once(step, manifest, items)
            except CorruptCheckpointError:
                if not self._reread_manifest(step, manifest, items):
                    raise
                continue
            # A read racing with a drop can also find nothing and say nothing (TensorStore
            # reads a missing chunk as fill values): what was read counts only if it stayed.
            if not self._reread_manifest(step, manifest, items):
                return restored
        raise CorruptCheckpointError(
            f"step {step} in {self._where} changed {_REREADS} times while being read"
        )

    def _read_once(self, step: int, manifest: Manifest, wanted: dict[str, Any]) -> dict[str, Any]:
        for name in wanted:
            entry = manifest.items.get(name)
            if entry is None:
                raise ItemNotFoundError(
                    f"step {step} has no item {name!r}; it has {sorted(manifest.items)}"
                )
            if entry.dropped:
                raise ItemNotFoundError(f"item {name!r} of step {step} was dropped by retention")
        step_dir = self._root / self._names.format(step)
        if self._store is not None:
            step_dir = self._fetch(step, manifest, list(wanted))
        restored = {}
        for name, target in wanted.items():
            entry = manifest.items[name]
            handler = self._handlers.get(name) or handler_by_id(entry.handler)
            if handler.id != entry.handler:
                raise MismatchError(
                    f"item {name!r} of step {step} was written by handler {entry.handler!r}, "
                    f"but handlers= gives {handler.id!r} for it"
                )
            if entry.version > handler.version:
                raise UnsupportedFormatError(
                    f"item {name!r} of step {step} was written by {entry.handler!r} version "
                    f"{entry.version}; this cairn has version {handler.version}"
                )
            stored = StoredItem(step_dir / name, {f.path: f for f in entry.files}, step, name)
            stored.check_files()  # a missing or truncated file fails before any parsing
            try:
                with writing_as(self._me.index, self._me.count):  # per-process data: this one's
                    restored[name] = handler.restore(stored, target)
            except FileNotFoundError as e:  # a file vanished after check_files
                raise CorruptCheckpointError(
                    f"step {step}, item {name!r}: {e.filename or e} is missing"
                ) from None
        return restored

    def _fetch(self, step: int, manifest: Manifest, items: list[str]) -> Path:
        """The local copy of a remote step's items (downloaded on first use)."""
        assert self._store is not None
        name = self._names.format(step)
        try:
            return _objectstore.fetch(self._store, name, manifest, items, self._root / "cache")
        except FileNotFoundError as e:
            if _objectstore.read_manifest(self._store, name) is None:
                with self._lock:
                    self._steps.pop(step, None)
                raise StepNotFoundError(f"step {step} was deleted from {self._where}") from None
            raise CorruptCheckpointError(f"step {step}: {e} is missing") from None

    def _reread_manifest(self, step: int, used: Manifest, items: Iterable[str]) -> bool:
        """Read a step's manifest from disk again after reading `items` with `used`: True if
        one of them changed meanwhile (the writer's per-item retention dropped it), the step's
        record then holding the new manifest; StepNotFoundError if the step was deleted."""
        name = self._names.format(step)
        if self._store is not None:
            data = _objectstore.read_manifest(self._store, name)
            where = f"{self._where}/{name}"
            fresh = None if data is None else self._parse_step(step, where, data, None)
        else:
            fresh = self._read_step(step, self._root / name)
            if fresh.manifest is None and not os.path.lexists(self._root / name):
                fresh = None
        if fresh is None:
            with self._lock:
                self._steps.pop(step, None)
            raise StepNotFoundError(f"step {step} was deleted from {self._where} while being read")
        if fresh.manifest is not None and all(
            fresh.manifest.items.get(n) == used.items.get(n) for n in items
        ):
            return False
        with self._lock:
            rec = self._steps.get(step)
            if rec is not None:  # its late metrics stay: they are another file
                rec.manifest, rec.error = fresh.manifest, fresh.error
        return True

    def _record(self, step: int) -> tuple[_Step, Manifest]:
        """The step's record and manifest, read once; raises the step's own error if unreadable."""
        with self._lock:
            rec = self._steps.get(step)
        if rec is None:
            raise StepNotFoundError(self._missing(step))
        if rec.manifest is None:
            assert rec.error is not None
            raise type(rec.error)(str(rec.error))
        return rec, rec.manifest

    def _manifest(self, step: int) -> Manifest:
        return self._record(step)[1]

    def _missing(self, step: int) -> str:
        steps = self.all_steps()
        shown = steps if len(steps) <= 10 else [*steps[:3], "...", *steps[-5:]]
        with self._lock:
            failed = any(what == f"the commit of step {step}" for what, _ in self._errors)
        note = "; its background commit failed (see check_for_errors())" if failed else ""
        return f"step {step} is not committed in {self._where} (committed: {shown}){note}"

    def _wait_if_inflight(self, step: int) -> None:
        with self._lock:
            inflight = step in self._inflight
        if inflight:
            self._drain()

    def _drain(self) -> None:
        """Wait until the commit thread is idle; its errors stay for the next save/wait/close."""
        if self._executor is not None and not self._closed:
            self._executor.submit(lambda: None).result()  # FIFO: every earlier job has finished

    def verify(self, step: Any, *, progress: Callable[[int], None] | None = None) -> list[str]:
        """Read every file of a committed step and check it; returns the problems found (none:
        the step is intact). Each names the file: missing, truncated, failing its checksum, a
        link, or an unreadable manifest or ``metrics.json``. `progress(n)` is called with the
        bytes of each file checked. Files that a writer's retention dropped while they were
        being checked are no problem: the step is checked again under its new manifest."""
        step = as_step(step)
        self._wait_if_inflight(step)
        for _ in range(_REREADS):
            with self._lock:
                rec = self._steps.get(step)
            if rec is None:
                raise StepNotFoundError(self._missing(step))
            if rec.manifest is None:
                return [str(rec.error)]
            manifest = rec.manifest
            live = [n for n, e in manifest.items.items() if not e.dropped]
            step_dir = self._root / self._names.format(step)
            if self._store is not None:
                try:
                    step_dir = self._fetch(step, manifest, live)
                except CorruptCheckpointError as e:
                    if not self._reread_manifest(step, manifest, live):
                        return [str(e)]
                    continue
            problems = []
            for name in live:
                entry = manifest.items[name]
                stored = StoredItem(step_dir / name, {f.path: f for f in entry.files}, step, name)
                for record in entry.files:
                    try:
                        stored.read_bytes(record.path)
                    except CorruptCheckpointError as e:
                        problems.append(str(e))
                    except OSError as e:
                        problems.append(f"{stored.describe_file(record.path)} cannot be read: {e}")
                    if progress is not None:
                        progress(record.size)
            metrics = step_dir / METRICS
            if self._store is None and os.path.lexists(metrics):
                try:
                    load_checked(read_no_follow(metrics), str(metrics))
                except (CorruptCheckpointError, OSError) as e:
                    problems.append(f"step {step}: {e}")
            if not (self._reread_manifest(step, manifest, live) and problems):
                return problems
        raise CorruptCheckpointError(
            f"step {step} in {self._where} changed {_REREADS} times while being verified"
        )

    def describe(self, step: Any) -> dict[str, dict[str, Any]]:
        """What each item of a committed step holds, from its handler's ``describe``: for array
        trees every leaf with its key path, shape and dtype, and the bytes. Dropped items are
        reported as such."""
        step = as_step(step)
        self._wait_if_inflight(step)
        manifest = self._manifest(step)
        step_dir = self._root / self._names.format(step)
        live = [n for n, e in manifest.items.items() if not e.dropped]
        if self._store is not None:
            step_dir = self._fetch(step, manifest, live)
        out: dict[str, dict[str, Any]] = {}
        for name, entry in manifest.items.items():
            if entry.dropped:
                out[name] = {"kind": "dropped", "handler": entry.handler}
                continue
            stored = StoredItem(step_dir / name, {f.path: f for f in entry.files}, step, name)
            handler = self._handlers.get(name) or handler_by_id(entry.handler)
            out[name] = {"handler": entry.handler, **handler.describe(stored)}
        return out

    def info(self, step: Any) -> StepInfo:
        """The manifest of a committed step: items, metrics, user metadata, times, telemetry."""
        step = as_step(step)
        self._wait_if_inflight(step)
        rec, manifest = self._record(step)
        with self._lock:
            metrics = rec.metrics
            telemetry = {**manifest.telemetry, **self._commit_telemetry.get(step, {})}
            if step in self._restore_telemetry:
                telemetry["restore_s"] = self._restore_telemetry[step]
        return StepInfo(
            step=step,
            path=(
                f"{self._where}/{self._names.format(step)}"
                if self._store is not None
                else self._root / self._names.format(step)
            ),
            started_at=manifest.started_at,
            committed_at=manifest.committed_at,
            items={
                name: ItemInfo(
                    e.handler, e.version, e.bytes, tuple(f.path for f in e.files), e.dropped
                )
                for name, e in manifest.items.items()
            },
            metrics=metrics,
            metadata=manifest.metadata,
            telemetry=telemetry,
        )

    # ------------------------------------------------------------------ metrics

    def metrics(self, step: Any) -> dict[str, float]:
        """The metrics of a step: those given to save, updated by record_metrics (later wins)."""
        step = as_step(step)
        self._wait_if_inflight(step)
        rec, _ = self._record(step)
        with self._lock:
            return rec.metrics

    def record_metrics(self, step: Any, metrics: Mapping[str, Any]) -> None:
        """Merge late metrics (say, from an evaluation) into a committed step's ``metrics.json``.

        Waits for a commit of `step` still in flight; StepNotFoundError for an unknown step.
        Retention runs again afterwards, so KeepBest sees the new values.
        """
        self._check_writable("record_metrics")
        step = as_step(step)
        new = check_metrics(metrics)
        with self._lock:
            if step in self._steps and self._steps[step].foreign:
                raise ReadOnlyError(
                    f"step {step} was written by orbax-checkpoint; cairn does not change it"
                )

        def update() -> None:
            with self._lock:
                rec = self._steps.get(step)
            if rec is None:
                raise StepNotFoundError(self._missing(step))
            if rec.manifest is None:
                self._manifest(step)  # raises the step's own error
            merged = {**rec.late_metrics, **new}
            if self._store is not None:
                _objectstore.write_metrics(self._store, self._names.format(step), merged)
            elif self._procs.primary:
                _commit.write_metrics(self._root / self._names.format(step), merged)
            with self._lock:
                rec.late_metrics = merged
            if self._procs.primary:
                self._apply_retention()

        self._on_commit_thread(self._together("record_metrics", update))

    def best_step(self) -> int | None:
        """The intact step with the best value of the `best=` metric (or the KeepBest one)."""
        metric, mode = self._best_rule()
        with self._lock:
            scored = [
                (s, rec.metrics[metric])
                for s, rec in self._steps.items()
                if rec.manifest is not None
                and metric in rec.metrics
                and rec.metrics[metric] == rec.metrics[metric]
            ]
        if not scored:
            return None
        sign = 1.0 if mode == "min" else -1.0
        return min(scored, key=lambda sv: (sign * sv[1], -sv[0]))[0]

    def _best_rule(self) -> tuple[str, str]:
        if self._best is not None:
            return self._best
        bests = find_keep_best(self._keep)
        if len(bests) == 1:
            return bests[0].metric, bests[0].mode
        raise ValueError(
            "best_step() needs best=(metric, mode) or exactly one KeepBest in keep=; "
            f"keep={self._keep!r}"
        )

    # ------------------------------------------------------------------ changing the directory

    def delete(self, step: Any) -> None:
        """Delete a committed step (after pending commits): rename to trash, then remove."""
        self._check_writable("delete")
        step = as_step(step)

        with self._lock:
            foreign = step in self._steps and self._steps[step].foreign
        if foreign:
            raise ReadOnlyError(
                f"step {step} was written by orbax-checkpoint; cairn does not change it"
            )

        def remove() -> None:
            with self._lock:
                known = step in self._steps
            if not known:
                raise StepNotFoundError(self._missing(step))
            if self._procs.primary:
                self._delete_now(step)

        self._on_commit_thread(self._together("delete", remove))

    def reload(self) -> None:
        """Read the directory again (after pending commits), e.g. to see another writer's steps."""
        steps = self._on_commit_thread(self._scan)
        with self._lock:
            self._steps = steps

    def _check_writable(self, what: str) -> None:
        if self._read_only:
            raise ReadOnlyError(
                f"{what}: this manager of {self._root} was opened with read_only=True"
            )
        if self._closed:
            raise RuntimeError(f"{what}: this manager of {self._root} is closed")

    def _scan(self, *, clean: bool = False) -> dict[int, _Step]:
        """Every committed step on disk, with its manifest or the reason it cannot be read.

        In an object store, a step prefix without a manifest is absent; with `clean` (a writer
        starting) its objects, left by a writer that died before its commit, are deleted."""
        if self._store is not None:
            committed, leftovers = _objectstore.scan(self._store, self._names)
            if clean:
                for name in leftovers:
                    log.info("cairn: removing uncommitted %s/%s", self._where, name)
                    _objectstore.remove_leftover(self._store, name)
            return {
                step: self._parse_step(step, f"{self._where}/{self._names.format(step)}", *data)
                for step, data in committed.items()
            }
        steps: dict[int, _Step] = {}
        try:
            entries = list(os.scandir(self._root))
        except FileNotFoundError:
            return steps
        for entry in entries:
            step = self._names.parse(entry.name)
            if step is None:
                continue
            if entry.is_symlink():  # never followed: it could lead anywhere
                error = CorruptCheckpointError(
                    f"step {step} at {entry.path} is a symbolic link; cairn does not follow links "
                    "to step directories"
                )
                steps[step] = _Step(None, error)
            elif entry.is_dir(follow_symlinks=False):
                rec = self._read_step(step, Path(entry.path))
                if rec.manifest is not None or os.path.lexists(entry.path):
                    steps[step] = rec  # else: deleted (by the writer's retention) while listed
        return steps

    def _parse_step(
        self, step: int, path: str, manifest_bytes: bytes, metrics_bytes: bytes | None
    ) -> _Step:
        """A remote step from its manifest and metrics.json bytes."""
        where = f"manifest {path}/{MANIFEST} of step {step}"
        try:
            manifest = Manifest.from_bytes(manifest_bytes, where)
        except (CorruptCheckpointError, UnsupportedFormatError) as e:
            return _Step(None, e)
        if manifest.step != step:
            return _Step(None, CorruptCheckpointError(f"{where} says step {manifest.step}"))
        late: dict[str, float] = {}
        if metrics_bytes is not None:
            try:
                late = check_metrics(load_checked(metrics_bytes, f"{path}/{METRICS}")["metrics"])
            except (CorruptCheckpointError, KeyError, TypeError) as e:
                log.warning("cairn: ignoring unreadable %s/%s: %s", path, METRICS, e)
        return _Step(manifest, late_metrics=late)

    def _read_step(self, step: int, path: Path) -> _Step:
        where = f"manifest {path / MANIFEST} of step {step}"
        try:
            manifest = Manifest.from_bytes(_read_file(path / MANIFEST, where), where)
        except FileNotFoundError:
            try:
                orbax = _orbax_step(step, path)
            except FileNotFoundError:  # the step was deleted while being listed
                orbax = None
            if orbax is not None:
                return _Step(orbax, foreign=True)
            missing = f"step {step} at {path} has no manifest: {path / MANIFEST} is missing"
            return _Step(None, CorruptCheckpointError(missing))
        except (CorruptCheckpointError, UnsupportedFormatError) as e:
            return _Step(None, e)
        if manifest.step != step:
            error = CorruptCheckpointError(f"{where} says step {manifest.step}")
            return _Step(None, error)
        late: dict[str, float] = {}
        try:
            data = read_no_follow(path / METRICS)
            late = check_metrics(load_checked(data, str(path / METRICS))["metrics"])
        except FileNotFoundError:
            pass  # no late metrics
        except (CorruptCheckpointError, KeyError, TypeError, OSError) as e:
            log.warning(
                "cairn: ignoring unreadable %s (the manifest's metrics stand): %s",
                path / METRICS,
                e,
            )
        return _Step(manifest, late_metrics=late)

    def _adopt_if_on_disk(self, step: int) -> None:
        """After a failed commit, list the step if it is on disk anyway, so all_steps() stays true."""
        path = self._root / self._names.format(step)
        if self._store is not None:
            name = self._names.format(step)
            data = _objectstore.read_manifest(self._store, name)
            if data is not None:
                rec = self._parse_step(step, f"{self._where}/{name}", data, None)
                with self._lock:
                    self._steps[step] = rec
            return
        try:
            if path.is_dir():
                rec = self._read_step(step, path)
                with self._lock:
                    self._steps[step] = rec
        except Exception as e:  # never hide the commit's own error behind this one
            log.error("cairn: could not read back step %d after its failed commit: %r", step, e)

    def _newest_intact(self) -> _Step | None:
        for step in sorted(self._steps, reverse=True):
            if self._steps[step].manifest is not None:
                return self._steps[step]
        return None


@contextlib.contextmanager
def _naming_item(name: str) -> Iterator[None]:
    """Prefix a TypeError/ValueError raised for one item with the item's name."""
    try:
        yield
    except (TypeError, ValueError) as e:
        if type(e) in (TypeError, ValueError, MismatchError):
            raise type(e)(f"item {name!r}: {e}") from e
        raise


_OPENED: dict[
    str, int
] = {}  # writable managers opened per directory in this process (collective keys)


_OPEN_WRITERS: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()


def _finish_at_exit() -> None:
    """Let the commits of managers never closed land before the interpreter shuts down.

    Registered with threading's pre-shutdown hooks, which run (newest first) before
    concurrent.futures refuses new work; a commit's write phase may still start thread pools.
    Errors are logged by the commit thread; nothing is raised here.
    """
    for mgr in list(_OPEN_WRITERS):
        if not mgr._closed and mgr._executor is not None:
            with contextlib.suppress(Exception):
                mgr._drain()


_register_before_shutdown = getattr(threading, "_register_atexit", None)
if _register_before_shutdown is not None:
    _register_before_shutdown(_finish_at_exit)


def _orbax_step(step: int, path: Path) -> Manifest | None:
    """A read-only manifest for a step directory orbax-checkpoint wrote, or None if it is not one.

    Orbax marks a finished step with ``commit_success.txt`` and describes it in
    ``_CHECKPOINT_METADATA`` (item handlers, metrics, times); older versions only renamed it
    into place, so a directory whose items Orbax would read counts too.

    The directory is a stranger's: no link in it is followed, an item directory whose name a
    save would refuse is left out, and metadata that cannot be read or has the wrong types is
    ignored, field by field, with a warning, so one odd Orbax step never hides the others.
    """
    import math
    import stat

    from cairn.handlers._files import parse_json
    from cairn.handlers._orbax import COMMIT_SUCCESS, STEP_METADATA, orbax_items, read_metadata
    from cairn.manager._format import item_name_problem

    where = f"Orbax step {step} at {path}"
    try:
        found = orbax_items(path)
        mtime = os.lstat(path).st_mtime
    except FileNotFoundError:
        raise  # deleted while listed
    except OSError as e:
        log.warning("cairn: ignoring %s: it cannot be listed: %s", where, e)
        return None
    items = {}
    for name, kind in found.items():
        problem = item_name_problem(name)
        if problem is None:
            items[name] = ItemEntry(kind, 1, ())
        else:
            log.warning("cairn: %s: ignoring an item directory: %s", where, problem)

    def read_object(relpath: str) -> dict[str, Any]:
        """The JSON object in `relpath`; {} if missing, unreadable or not an object."""
        try:
            obj = parse_json(read_metadata(path, relpath), str(path / relpath))
        except FileNotFoundError:
            return {}
        except (OSError, CorruptCheckpointError) as e:
            log.warning("cairn: %s: ignoring its %s: %s", where, relpath, e)
            return {}
        if not isinstance(obj, dict):
            log.warning("cairn: %s: ignoring its %s: not a JSON object", where, relpath)
            return {}
        return obj

    meta = read_object(STEP_METADATA)
    marked = bool(meta)
    with contextlib.suppress(OSError):  # commit_success.txt: a regular file, not a link to one
        marked = marked or stat.S_ISREG(os.lstat(path / COMMIT_SUCCESS).st_mode)
    if not items or not (marked or any(e.handler == "orbax.pytree" for e in items.values())):
        return None
    raw = meta.get("metrics")
    if not isinstance(raw, dict):
        if raw is not None:
            log.warning("cairn: %s: ignoring its %s metrics: not an object", where, STEP_METADATA)
        raw = {}
    if not raw:
        raw = read_object("metrics/metrics")
    metrics: dict[str, float] = {}
    for key, value in raw.items():
        try:
            number = check_metrics({key: value})[key]
        except TypeError:
            number = math.nan
        if math.isfinite(number):
            metrics[key] = number
    if len(metrics) < len(raw):
        ignored = sorted(set(raw) - set(metrics))
        log.warning("cairn: %s: ignoring metrics that are not finite numbers: %s", where, ignored)

    def seconds(key: str) -> float:
        """A timestamp in nanoseconds as seconds; the directory's mtime if absent or odd."""
        value = meta.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63:
            return value / 1e9
        if value is not None:
            log.warning("cairn: %s: ignoring %s %.40r (not an int of ns)", where, key, value)
        return mtime

    try:
        custom = check_metadata(meta.get("custom_metadata") or {})
    except (TypeError, RecursionError) as e:
        log.warning("cairn: %s: ignoring its custom_metadata: %s", where, e)
        custom = {}
    return Manifest(
        step=step,
        items=items,
        started_at=seconds("init_timestamp_nsecs"),
        committed_at=seconds("commit_timestamp_nsecs"),
        metrics=metrics,
        metadata={"format": "orbax", "custom_metadata": custom},
    )


def _read_file(path: Path, where: str) -> bytes:
    """A file cairn reads whole from a step (manifest, metrics.json): FileNotFoundError if it is
    absent, CorruptCheckpointError naming `where` if it is a link, not a regular file, or
    unreadable."""
    try:
        return read_no_follow(path)
    except FileNotFoundError:
        raise
    except (OSError, CorruptCheckpointError) as e:
        raise CorruptCheckpointError(f"{where} cannot be read: {e}") from None


def _uses_time(policy: Any) -> bool:
    """Whether a save policy looks at the clock (so processes could disagree)."""
    if isinstance(policy, AnyOf):
        return any(_uses_time(p) for p in policy.policies)
    return not isinstance(policy, (EveryNSteps, AtSteps))


def _check_directory(directory: Any) -> Path | str:
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must be a str or path, got {type(directory).__qualname__}")
    text = os.fspath(directory)
    if not isinstance(text, str) or not text:
        raise ValueError(f"directory must be a non-empty path, got {directory!r}")
    if _objectstore.is_url(text):
        if not text.startswith(("s3://", "gs://")):
            raise ValueError(
                f"directory {text!r}: object stores are s3://bucket/prefix or gs://bucket/prefix"
            )
        return text
    path = Path(text).absolute()
    if path.exists() and not path.is_dir():
        raise ValueError(f"directory {str(path)!r} exists and is not a directory")
    return path


def _check_keep_items(keep_items: Any) -> dict[str, KeepPolicy]:
    if keep_items is None:
        return {}
    if not isinstance(keep_items, Mapping):
        raise TypeError(
            f"keep_items must be a mapping of item name to keep policy, got {keep_items!r}"
        )
    for name, policy in keep_items.items():
        check_item_name(name)
        if policy_kind(policy) != "keep":
            raise TypeError(
                f"keep_items[{name!r}] must be a keep policy (KeepLatest, ...), got {policy!r}"
            )
    return dict(keep_items)


def _check_handlers(handlers: Any) -> dict[str, Handler]:
    if handlers is None:
        return {}
    if not isinstance(handlers, Mapping):
        raise TypeError(f"handlers must be a mapping of item name to handler, got {handlers!r}")
    out = {}
    for name, handler in handlers.items():
        check_item_name(name)
        for attr in ("snapshot", "restore", "describe"):
            if not callable(getattr(handler, attr, None)):
                raise TypeError(f"handlers[{name!r}] = {handler!r} has no {attr}() method")
        if not isinstance(getattr(handler, "id", None), str) or not isinstance(
            getattr(handler, "version", None), int
        ):
            raise TypeError(
                f"handlers[{name!r}] = {handler!r} needs a str `id` and an int `version`"
            )
        out[name] = handler
    return out


def _check_best(best: Any) -> tuple[str, Literal["min", "max"]] | None:
    if best is None:
        return None
    if (
        not isinstance(best, tuple)
        or len(best) != 2
        or not isinstance(best[0], str)
        or not best[0]
        or best[1] not in ("min", "max")
    ):
        raise ValueError(f"best must be (metric, 'min' | 'max'), got {best!r}")
    return best[0], best[1]


class _DirectoryLock:
    """An advisory flock on ``<root>/.cairn.lock``, held while a writable manager is open.

    The lock belongs to the open file description, which a forked child would share; children
    close their copy at fork time, so a fork-started worker never keeps the directory locked.
    A manager dropped without close() releases it when garbage-collected.
    """

    _held: ClassVar[weakref.WeakSet[_DirectoryLock]] = weakref.WeakSet()

    def __init__(self, root: Path) -> None:
        path = root / LOCK
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:  # never through a link, never a FIFO or device: the pid is written into this file
            fd = os.open(path, flags, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CorruptCheckpointError(
                    f"{path} is a symbolic link; cairn never follows it (it would overwrite the "
                    "link's target). Remove it and try again"
                ) from None
            if e.errno in (errno.EISDIR, errno.ENXIO, errno.ENOTDIR):
                raise CorruptCheckpointError(
                    f"{path} is not a regular file ({e.strerror}); remove it and try again"
                ) from None
            raise
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise CorruptCheckpointError(
                f"{path} is not a regular file (mode {stat.filemode(mode)}); remove it and try again"
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            who = (
                "this process (a manager not closed?)"
                if holder == str(os.getpid())
                else f"pid {holder}"
            )
            raise DirectoryLockedError(
                f"{root} is held by another writable CheckpointManager in {who}; "
                "open it with read_only=True to read alongside"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd: int | None = fd
        self._finalizer = weakref.finalize(self, os.close, fd)
        _DirectoryLock._held.add(self)

    def release(self) -> None:
        if self._fd is not None:
            self._fd = None
            self._finalizer()  # closes the descriptor once

    @classmethod
    def _forget_in_child(cls) -> None:
        for lock in list(cls._held):
            lock.release()


os.register_at_fork(after_in_child=_DirectoryLock._forget_in_child)
