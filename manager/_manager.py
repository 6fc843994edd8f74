"""CheckpointManager: when to save, the commit thread, retention, metrics, restore."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import pickle
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar

from cairn.handlers import Handler, StoredItem, handler_by_id, handler_for
from cairn.handlers.errors import (
    BarrierTimeoutError,
    CommitError,
    CorruptCheckpointError,
    ItemNotFoundError,
    MismatchError,
    ReadOnlyError,
    StepAlreadyExistsError,
    StepNotFoundError,
    SupersededError,
    UnsupportedFormatError,
)
from cairn.handlers.io import (
    StagingPool,
    WriteBudget,
    check_item,
    chunks_by_pack,
    lower_thread_priority,
    parse_json,
    release_snapshot,
    settle_snapshot,
    staging_for,
    writing_as,
)
from cairn.manager import _commit, _exit, _telemetry
from cairn.manager._catalog import Catalog, StepRecord, apply_retention, read_record
from cairn.manager._format import (
    ROOT_METADATA,
    Manifest,
    StepNames,
    check_metadata,
    check_metrics,
    dump_checked,
)
from cairn.manager._multihost import SINGLE, Processes
from cairn.manager._policies import (
    AnyOf,
    AtSteps,
    EveryNSteps,
    KeepAll,
    KeepPolicy,
    LastSave,
    SaveContext,
    SavePolicy,
    checked_should_save,
    find_keep_best,
    find_on_preemption,
    policy_kind,
)
from cairn.manager._preemption import PreemptionWatch
from cairn.manager._storage import Listed, check_directory, open_storage
from cairn.manager._validate import (
    as_step,
    check_barrier_timeout,
    check_best,
    check_flag,
    check_handlers,
    check_items,
    check_keep_items,
    check_max_pending,
    check_max_staging_bytes,
    check_primary_process,
)
from cairn.manager._writer import WriterProcess, WriterProcessError, pack_job

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
    #: the saving manager's best-step rule, (metric, "min" | "max"), if it had one
    best: tuple[str, str] | None = None

    @property
    def bytes(self) -> int:
        return sum(i.bytes for i in self.items.values())


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
    blocked time). State shared with the commit thread (the `Catalog` of known steps and steps in
    flight; the errors) is guarded by locks. An error on the commit thread is kept and raised
    once, as CommitError with the original chained, by the next `save`, `wait_until_finished`,
    `check_for_errors` or `close`. A deleted step leaves the directory's listing on the commit
    thread (on POSIX renamed to ``.trash-*``); a second thread ("cairn-reclaim") then frees its
    space, and `close` waits for it. `save()` copies arrays into the manager's staging pool
    (`zero_copy=False`), whose memory a "cairn-stage" thread faults in the first time a state of
    a size is saved; `wait_until_finished` and `close` wait for it, and `close` frees the pool.
    Background threads run at a lower CPU and I/O priority (nice 19, best-effort level 7), so a
    training step on busy cores goes first. Every byte goes through the directory's `Storage`
    (POSIX, object store, memory); the manager never asks which one it is.

    With ``writer="process"`` the write phase and the commit of each save run in a writer
    process the manager starts (`_writer.WriterProcess`): `save()` sends the save there before it
    returns, and the commit thread waits for the answers, in order, then applies retention.
    Those waits, and `close`'s wait for the process to exit, have the bound of a barrier
    (``barrier_timeout``): a writer with no sign of life for that long (stopped, stuck on a hung
    filesystem) is killed and the step fails with WriterTimeoutError, kept as any commit error.

    Processes: one writable manager per directory, enforced by an advisory lock on
    ``<directory>/.cairn.lock`` (a lease object in object stores; DirectoryLockedError
    otherwise); any number of ``read_only=True`` managers may read alongside it.

    In one process, a new writable manager of a directory takes over from the one open there
    (T5X and SpeechBrain code builds a second checkpointer on a directory without closing the
    first): its constructor waits for the old manager's pending commits and retention, the old
    one lets go of the lock or lease and turns read-only (a warning is logged), and a later
    write on it raises SupersededError. The old manager must not be inside a call on another
    thread meanwhile; its reads keep working (`reload` to see the new manager's steps).
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
    ) -> None:
        target = check_directory(directory)
        if writer not in ("thread", "process"):
            raise ValueError(f"writer must be 'thread' or 'process', got {writer!r}")
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
        self._keep_items = check_keep_items(keep_items)
        self._handlers = check_handlers(handlers)
        self._best = check_best(best)
        self._names = StepNames(step_prefix, step_digits)
        self._async = check_flag("async_save", async_save)
        self._read_only = check_flag("read_only", read_only)
        self._max_pending = check_max_pending(max_pending)
        self._slots = threading.BoundedSemaphore(self._max_pending)
        self._timeout = check_barrier_timeout(barrier_timeout)
        self._incremental = check_flag("incremental", incremental)
        self._in_process = writer == "process" and not self._read_only and self._async
        if writer == "process":
            _check_writer_process_options(async_save, zero_copy, incremental)
        self._remote: WriterProcess | None = None  # writer="process": the current one
        self._staging = StagingPool(
            max_bytes=check_max_staging_bytes(max_staging_bytes),
            zero_copy=check_flag("zero_copy", zero_copy),
            remember=self._incremental,
            shared=self._in_process,
        )
        self._budget = None if max_write_bytes_per_s is None else WriteBudget(max_write_bytes_per_s)
        try:
            given = None if metadata is None else check_metadata(metadata)
        except TypeError as e:
            raise TypeError(f"metadata= (the directory's metadata): {e}") from None
        if tensorboard_dir is not None and not isinstance(tensorboard_dir, (str, os.PathLike)):
            raise TypeError(f"tensorboard_dir must be a path, got {tensorboard_dir!r}")
        # Writers of a jax.distributed run coordinate; readers need not, but restore each
        # process's own per-process data (iterator positions).
        primary = check_primary_process(primary_process)
        self._procs = SINGLE if read_only else Processes.detect(primary)
        self._me = Processes.detect(primary) if read_only else self._procs
        self._calls = 0  # collective calls so far: the same sequence on every process

        self._storage = open_storage(target, storage_options)
        self._where = self._storage.url
        if self._procs.count > 1 and not self._storage.multi_process:
            self._storage.close()
            raise ValueError(
                f"directory {self._where!r} lives in this process's memory; the other "
                f"{self._procs.count - 1} processes of this jax.distributed run cannot see it "
                "(use a shared filesystem, s3:// or gs://)"
            )
        self._given_metadata = given
        self._superseded: str | None = None  # why saves now raise, once a newer manager took over
        self._handing = threading.Lock()  # a save's hand-off to the commit thread; a takeover
        refusal = self._other_naming() if self._storage.lists_cheaply else None
        if refusal is not None:  # every process: none may wait for a primary that refused
            self._storage.close()
            raise ValueError(refusal)
        self._key = self._storage.identity
        if not read_only:
            _take_over(self._key, self)
        else:
            settle_writer(self._key)  # read your writes: what this process's writer accepted
        self._catalog = Catalog(journal=self._procs.count > 1 and self._procs.primary)
        self._retired: dict[int, Manifest | None] = {}  # primary: retired, shares not yet deleted
        self._errors_lock = threading.Lock()
        self._errors: list[tuple[str, BaseException]] = []
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._reclaimer: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False
        self._writer = not read_only and self._procs.primary  # holds the lock, cleans, deletes
        try:
            if self._writer:
                self._storage.acquire()
                if self._in_process and self._storage.for_writer_process() is None:
                    raise ValueError(
                        f"writer='process' cannot commit into {self._where}: a writer "
                        "process cannot reach this process's memory; use writer='thread'"
                    )
                self._storage.clean_leftovers(self._names)
                if given is not None:
                    self._save_root_metadata(given)
            refusal = None
            if self._procs.primary:
                self._catalog.replace(self._scan())
                if not self._storage.lists_cheaply and not self._catalog.steps():
                    refusal = self._other_naming()  # one more listing, of a directory to refuse
            self._run = self._open_together(refusal)
            if self._writer:  # a crash between an item's drop and the removal of its files
                self._storage.remove_dropped(
                    {
                        self._names.format(step): manifest
                        for step, manifest in self._catalog.manifests().items()
                        if any(e.dropped for e in manifest.items.values())
                    }
                )
        except BaseException:
            if self._writer:
                self._storage.release()
            self._storage.close()
            _forget_writer(self._key, self)
            raise
        if not read_only and async_save:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="cairn-commit", initializer=lower_thread_priority
            )
            _exit.finish_before_shutdown(self)
        # Deleted steps leave the listing on the commit thread; freeing their space is slow on
        # some filesystems (seconds per GiB with online discard), so it happens here, off that path.
        self._reclaimer = (
            None
            if read_only
            else concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="cairn-reclaim", initializer=lower_thread_priority
            )
        )
        self._telemetry = _telemetry.Telemetry(tensorboard_dir)
        newest = self._catalog.newest_intact()
        self._last_save = LastSave()
        if newest is not None and newest.manifest is not None:
            warn = not read_only and _uses_time(self._save_policy)
            self._last_save.read(newest.manifest.step, newest.manifest.started_at, warn=warn)
        preemption = [] if read_only else find_on_preemption(self._save_policy)
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
        mode = "read_only" if self._read_only else ("async" if self._async else "sync")
        return f"CheckpointManager({self._where!r}, {mode}, steps={self.all_steps()})"

    def _open_together(self, refusal: str | None = None) -> str:
        """The run id, drawn by the primary after its clean-up and scan. With several processes
        it broadcasts the id and the steps it found, and every other process reads just those
        steps instead of listing the directory; then all meet. A `refusal` of the primary's
        (`_other_naming`) is raised on every process."""
        run = uuid.uuid4().hex
        if self._procs.count == 1:
            self._refuse(refusal)
            return run
        opened = _OPENED[self._where] = _OPENED.get(self._where, 0) + 1
        key = f"cairn/open/{opened}:{self._where}"  # the same on every process, per manager
        mine = json.dumps({"run": run, "steps": self._catalog.steps(), "refused": refusal})
        told = json.loads(
            self._procs.broadcast(key, mine if self._procs.primary else None, self._timeout)
        )
        self._refuse(told.get("refused"))
        if not self._procs.primary:
            self._catalog.replace(self._read_steps(told["steps"]))
        self._procs.barrier(f"cairn/{told['run']}/opened", self._timeout)
        return str(told["run"])

    def _read_steps(self, steps: Iterable[int]) -> dict[int, StepRecord]:
        """The steps a primary listed, each read again (16 at a time; one may be gone)."""

        def read(step: int) -> Listed | None:
            return self._storage.read_step(self._names, step)

        steps = list(steps)
        if len(steps) < 2:
            found = [read(step) for step in steps]
        else:
            with concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="cairn-read") as pool:
                found = list(pool.map(read, steps))
        return {listed.step: read_record(listed) for listed in found if listed is not None}

    def _collective(self, what: str) -> str:
        """A name for the next collective call, the same on every process (they call alike)."""
        self._calls += 1
        return f"cairn/{self._run}/{what}/{self._calls}"

    # ------------------------------------------------------------------ saving

    def should_save(self, step: Any) -> bool:
        """Whether the save policy wants `step` saved; False for steps at or below the newest."""
        step = as_step(step)
        known = self._catalog.known()
        if step in known or (known and step <= max(known)):
            return False
        preempted = self._preemption is not None and self._preemption.reached(step)
        if preempted:
            self._preemption_asked = step  # reached_preemption(step) may now say stop
        now = time.time()
        context = SaveContext(
            latest_step=max(known) if known else None,
            last_save_time=self._last_save.time(now),
            now=now,
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
                handlers[name] = self._handlers.get(name) or handler_for(obj)
        # Orbax's order: the policy first (False for a step that exists), then the step itself.
        if not force and not self.should_save(step):
            if self._catalog.state(step) is not None:
                log.info("cairn: step %d exists in %s; not saved again", step, self._where)
            return False
        state = self._catalog.state(step)
        if state is not None:
            raise StepAlreadyExistsError(f"step {step} is already {state} in {self._where}")

        waited = time.monotonic()
        self._slots.acquire()  # at most max_pending saves in flight
        waited = time.monotonic() - waited
        if waited > 0.001:
            log.info(
                "cairn: save of step %d waited %.1f ms for a pending commit", step, waited * 1e3
            )
        snapshots: dict[str, tuple[Handler, Any]] = {}
        try:
            self.check_for_errors()  # the commit we waited for may have failed
            for name, obj in items.items():
                with _naming_item(name), staging_for(self._staging, name):
                    snapshots[name] = (handlers[name], handlers[name].snapshot(obj))
        except BaseException:
            self._abandon(snapshots)
            raise
        self._last_save.started(entered)
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
            budget=self._budget,
            incremental=self._incremental,
            settled=threading.Event(),
            best=self._known_best(),
        )
        packed = None
        if self._executor is None or self._in_process:  # committed here, or sent: copies first
            try:
                _settle(job, entered)
                packed = pack_job(job) if self._in_process else None
            except BaseException:
                self._abandon(snapshots)
                raise
        with self._handing:  # a takeover from another thread waits for this save, or refuses it
            if self._superseded is not None:
                self._abandon(snapshots)
                raise SupersededError(f"save: {self._superseded}")
            self._catalog.start(step)
            if self._executor is None:
                self._run_save(job, reraise=True)
                return True
            try:
                remote = self._hand_to_writer(*packed) if packed is not None else None
                self._executor.submit(self._run_save, job, reraise=False, remote=remote)
            except BaseException:  # e.g. from an atexit hook after interpreter shutdown began
                self._catalog.committed(step, None)
                self._abandon(snapshots)
                raise
        _settle(job, entered, handed=True)  # the commit writes each span as its copy ends
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

    def _abandon(self, snapshots: Mapping[str, tuple[Handler, Any]]) -> None:
        """A save that stops before its hand-off: its staging memory and its slot go back."""
        _release(snapshots)
        self._slots.release()

    def _hand_to_writer(self, payload: bytes, fds: list[int]) -> WriterProcess:
        """Caller thread (``writer="process"``): send a packed save job to the writer process,
        starting one if there is none or the last one died; the process it went to."""
        for attempt in (1, 2):
            if self._remote is None or self._remote.dead is not None:
                if self._remote is not None:
                    self._remote.close()
                spec = self._storage.for_writer_process()
                assert spec is not None  # checked at construction
                self._remote = _start_writer(
                    {
                        **spec[0],
                        "step_prefix": self._names.prefix,
                        "step_digits": self._names.digits,
                        "max_pending": self._max_pending,
                        "max_write_bytes_per_s": self._budget.bytes_per_s if self._budget else None,
                        "process_index": self._procs.index,
                        "process_count": self._procs.count,
                        "primary_index": self._procs.primary_index,
                        "barrier_timeout": self._timeout,
                        "retention": _pack_retention(self._keep, self._keep_items),
                    },
                    spec[1],
                )
                self._storage.writer_started(self._remote.pid)
            try:
                self._remote.send(payload, fds)
            except WriterProcessError:
                if attempt == 2:
                    raise
                continue  # it died since its last answer: a new one takes this save
            return self._remote
        raise AssertionError("unreachable")

    def _run_save(
        self, job: _commit.SaveJob, *, reraise: bool, remote: WriterProcess | None = None
    ) -> None:
        """Commit thread: commit one step, then apply retention. Errors are kept for the caller.

        With several processes the primary commits and applies retention, then tells the others
        the outcome; they read the directory again. With a writer process (`remote`) the commit
        is that process's: this thread waits for its answer, then applies retention.
        """
        t0 = time.monotonic()
        procs, outcome_key = self._procs, f"cairn/{job.tmp_name}/outcome"
        if job.incremental:
            job.previous = self._newest_intact_before(job.step)
        try:
            try:
                manifest: Manifest | None
                if remote is not None:
                    try:
                        manifest = remote.result(job.step)
                    finally:
                        _release(job.snapshots)
                else:
                    manifest = _commit.commit_step(
                        self._storage, self._names, job, procs, timeout_s=self._timeout
                    )
                if manifest is None:  # not the primary: wait for its word
                    outcome = procs.broadcast(outcome_key, None, self._timeout)
                    if not outcome.startswith("ok "):
                        raise RuntimeError(
                            f"the primary process did not commit step {job.step}: {outcome}"
                        )
                    self._catalog.committed(job.step, None)
                    self._apply_changes(outcome[3:])
                    procs.barrier(f"{outcome_key}/read", self._timeout)  # see _tell_changes
                    return
            except BaseException as e:
                if procs.count > 1 and procs.primary:
                    with contextlib.suppress(Exception):
                        procs.broadcast(outcome_key, f"{type(e).__name__}: {e}", self._timeout)
                self._catalog.committed(job.step, None)
                if not reraise:
                    self._keep_error(f"the commit of step {job.step}", e)
                self._adopt_if_committed(job.step)  # e.g. the rename happened, its fsync failed
                if reraise:
                    raise
                return
            commit_s = time.monotonic() - t0
            size = manifest.telemetry.get("bytes", 0.0)
            telemetry = {"commit_s": commit_s, "bytes_per_s": size / commit_s if commit_s else 0.0}
            self._catalog.committed(job.step, StepRecord(manifest), telemetry)
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
                    try:
                        self._tell_changes(outcome_key, "ok ")
                        procs.forget(f"cairn/{job.tmp_name}")
                    except BarrierTimeoutError as e:  # the step stays committed
                        if reraise:
                            raise
                        self._keep_error(f"telling the others that step {job.step} committed", e)
        finally:
            self._slots.release()

    def _newest_intact_before(self, step: int) -> tuple[str, Manifest] | None:
        """Commit thread: the newest committed step before `step` whose manifest was read (an
        incremental save links the files it shares with it); retention runs on this thread too,
        so it stays until the save that links to it has committed."""
        for older in reversed(self.all_steps()):
            rec = self._catalog.get(older)
            if older < step and rec is not None and rec.manifest is not None:
                return self._names.format(older), rec.manifest
        return None

    def _keep_error(self, what: str, error: BaseException) -> None:
        log.error("cairn: %s failed: %r", what, error)
        with self._errors_lock:
            self._errors.append((what, error))

    def _apply_retention(self) -> None:
        """Commit thread: delete the committed steps the keep policy does not keep, then drop
        the items the per-item policies do not keep."""
        apply_retention(
            self._catalog, self._keep, self._keep_items, self._delete_now, self._drop_item_now
        )

    def _delete_now(self, step: int) -> None:
        """Delete a committed step. With several processes on a storage that shares deletion
        out, only retire it here: every process deletes its share of the files once it heard
        (`_tell_changes`)."""
        name, reclaim = self._names.format(step), None
        shared = self._procs.count > 1 and self._storage.shares_deletion
        manifest = self._catalog.manifests([step]).get(step)
        try:
            if shared:
                self._storage.retire_step(name)
            else:
                reclaim = self._storage.delete_step(name)
        except BaseException:
            with contextlib.suppress(Exception):
                if self._storage.read_step(self._names, step) is None:  # gone all the same
                    self._catalog.remove(step)
            raise
        if shared:
            self._retired[step] = manifest
        self._catalog.remove(step)
        self._reclaim(reclaim)

    def _drop_item_now(self, step: int, item: str) -> None:
        manifest = self._manifest(step).with_dropped(item)
        reclaim = self._storage.drop_item(self._names.format(step), manifest, item)
        self._catalog.update(step, manifest=manifest)
        self._reclaim(reclaim)

    def _reclaim(self, work: Callable[[], None] | None) -> None:
        """Free a deleted step's space off the commit path (the reclaim thread)."""
        if work is not None and self._reclaimer is not None:
            self._reclaimer.submit(work)

    def _together(self, what: str, fn: Callable[[], None]) -> Callable[[], None]:
        """`fn` (which changes the directory only on the primary), then, with several processes,
        the primary's broadcast of the steps that changed, which the others read again, and a
        barrier so the primary's next change cannot race with that reading. Call on the caller
        thread."""
        procs = self._procs
        if procs.count == 1:
            return fn
        key = self._collective(what)

        def run() -> None:
            try:
                fn()
            finally:
                if procs.primary:
                    self._tell_changes(f"{key}/changed")
                    procs.forget(key)
                else:
                    self._apply_changes(procs.broadcast(f"{key}/changed", None, self._timeout))
                    procs.barrier(f"{key}/changed/read", self._timeout)

        return run

    def _tell_changes(self, key: str, prefix: str = "") -> None:
        """Primary, after a change: broadcast the steps that changed since the last time
        (committed, deleted, items dropped, metrics merged) under `key`, after `prefix`; delete
        its share of the steps it retired; wait at ``<key>/read`` until every process has read
        the changes and deleted its share (so the next change cannot race with that reading);
        then remove what is left of those steps."""
        changed, gone = self._catalog.changes()
        self._procs.broadcast(
            key, prefix + json.dumps({"changed": changed, "gone": gone}), self._timeout
        )
        retired, self._retired = self._retired, {}
        self._delete_shares(retired)
        self._procs.barrier(f"{key}/read", self._timeout)
        for step in retired:
            try:
                self._storage.finish_deletion(self._names.format(step))
            except Exception as e:  # a retired step is no step; the next start removes it
                log.warning("cairn: could not finish deleting step %d: %r", step, e)

    def _delete_shares(self, manifests: Mapping[int, Manifest | None]) -> None:
        """This process's share of the files of retired steps: every `count`-th of the sorted
        paths, from its `index`, so that each process sends about as many DELETEs as it wrote
        files. A failure leaves files for the primary's `finish_deletion`."""
        procs = self._procs
        for step, manifest in manifests.items():
            if manifest is None:
                continue
            paths = sorted(
                f"{item}/{f.path}"
                for item, entry in manifest.items.items()
                if not entry.dropped
                for f in entry.files
            )
            try:
                self._storage.remove_files(
                    self._names.format(step), paths[procs.index :: procs.count]
                )
            except Exception as e:
                log.warning("cairn: could not delete this process's share of step %d: %r", step, e)

    def _apply_changes(self, text: str) -> None:
        """Another process: forget the steps the primary deleted (and delete this process's
        share of their files) and read again the ones it changed (a manifest and a metrics
        read each), instead of listing the directory."""
        changes = json.loads(text)
        if self._storage.shares_deletion:
            self._delete_shares(self._catalog.manifests(changes["gone"]))
        records = self._read_steps(changes["changed"])
        for step in changes["gone"] + changes["changed"]:
            if step in records:
                self._catalog.committed(step, records[step])
            else:
                self._catalog.remove(step)

    def _on_commit_thread(self, fn: Callable[[], T]) -> T:
        """Run `fn` after every pending commit, on the commit thread when there is one."""
        if self._closed:
            raise RuntimeError(f"this manager of {self._where} is closed")
        if self._executor is None:
            return fn()
        return self._executor.submit(fn).result()

    def is_saving_in_progress(self) -> bool:
        """Whether a save is still being written or committed (Orbax's name)."""
        return self._catalog.any_in_flight()

    # ------------------------------------------------------------------ waiting and errors

    def wait_until_finished(self) -> None:
        """Block until pending commits and the retention after them are done, and the staging
        memory the next save copies into is ready; raise their error."""
        self._drain()
        self._staging.wait()
        self.check_for_errors()

    def check_for_errors(self) -> None:
        """Raise CommitError (once) if a background commit or retention failed since the last call."""
        with self._errors_lock:
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
            self._staging.close()
            for pool in (self._executor, self._reclaimer):
                if pool is not None:
                    pool.shutdown(wait=True)
            if self._remote is not None:
                self._remote.close()
            if self._writer:
                self._storage.release()
            self._storage.close()
            _forget_writer(self._key, self)

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
        return self._catalog.steps()

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
                raise StepNotFoundError(f"no step in {self._where} has metric {metric!r}")
            return self._restore_step(best, wanted)
        if step is not None:
            step = as_step(step)
            if step not in self.all_steps():
                raise StepNotFoundError(self._missing(step))
            return self._restore_step(step, wanted)
        candidates = self.all_steps()[::-1]
        if not candidates:
            raise StepNotFoundError(f"no committed step in {self._where}")
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
            raise StepNotFoundError(f"every step of {self._where} was deleted while being read")
        raise CorruptCheckpointError(
            f"every step in {self._where} is damaged ({candidates}); the newest: {newest_error}"
        ) from newest_error

    def _restore_step(self, step: int, wanted: dict[str, Any] | None) -> dict[str, Any]:
        t0 = time.monotonic()
        restored = self._read_items(step, wanted)
        seconds = time.monotonic() - t0
        self._catalog.restored(step, seconds)
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
            stored = self._stored(step, name, manifest)
            stored.check_files()  # a missing or truncated file fails before any parsing
            try:
                with writing_as(self._me.index, self._me.count):  # per-process data: this one's
                    restored[name] = handler.restore(stored, target)
            except FileNotFoundError as e:  # a file vanished after check_files
                raise CorruptCheckpointError(
                    f"step {step}, item {name!r}: {e.filename or e} is missing"
                ) from None
        return restored

    def _stored(self, step: int, name: str, manifest: Manifest) -> StoredItem:
        """Item `name` of a step, as its handler reads it: its files, from the storage."""
        files = {f.path: f for f in manifest.items[name].files}
        source = self._storage.source(self._names.format(step), name)
        return StoredItem(source, files, step, name)

    def _reread_manifest(self, step: int, used: Manifest, items: Iterable[str]) -> bool:
        """Read a step's manifest from disk again after reading `items` with `used`: True if
        one of them changed meanwhile (the writer's per-item retention dropped it), the step's
        record then holding the new manifest; StepNotFoundError if the step was deleted."""
        fresh = self._read_again(step)
        if fresh is None:
            raise StepNotFoundError(f"step {step} was deleted from {self._where} while being read")
        if fresh.manifest is not None and all(
            fresh.manifest.items.get(n) == used.items.get(n) for n in items
        ):
            return False
        # Its late metrics stay: they are another file.
        self._catalog.update(step, manifest=fresh.manifest, error=fresh.error)
        return True

    def _read_again(self, step: int) -> StepRecord | None:
        """A step's record read from the storage now; None (and forgotten) if it is gone."""
        listed = self._storage.read_step(self._names, step)
        if listed is None:
            self._catalog.remove(step)
            return None
        return read_record(listed)

    def _record(self, step: int) -> tuple[StepRecord, Manifest]:
        """The step's record and manifest, read once; raises the step's own error if unreadable."""
        rec = self._catalog.get(step)
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
        with self._errors_lock:
            failed = any(what == f"the commit of step {step}" for what, _ in self._errors)
        note = "; its background commit failed (see check_for_errors())" if failed else ""
        return f"step {step} is not committed in {self._where} (committed: {shown}){note}"

    def _wait_if_inflight(self, step: int) -> None:
        if self._catalog.in_flight(step):
            self._drain()

    def _drain(self) -> None:
        """Wait until the commit thread is idle; its errors stay for the next save/wait/close."""
        if self._executor is not None and not self._closed:
            self._executor.submit(lambda: None).result()  # FIFO: every earlier job has finished

    def verify(
        self,
        step: Any,
        *,
        progress: Callable[[int], None] | None = None,
        checked: dict[tuple[int, ...], str] | None = None,
    ) -> list[str]:
        """Read every file of a committed step and check it; returns the problems found (none:
        the step is intact). Each names the file: missing, truncated, failing its checksum, a
        link, or an unreadable manifest or ``metrics.json``. `progress(n)` is called with the
        bytes of each file checked. Files that a writer's retention dropped while they were
        being checked are no problem: the step is checked again under its new manifest.

        `checked`: a dict to pass to several calls (``cairn verify`` does, for all the steps of
        a directory) so that a file that steps share (an incremental save's hard link) is read
        once (`StoredItem.check_file`)."""
        step = as_step(step)
        self._wait_if_inflight(step)
        for _ in range(_REREADS):
            if self._catalog.get(step) is None:
                raise StepNotFoundError(self._missing(step))
            rec = self._read_again(step)  # as it is now, metrics.json included
            if rec is None:
                raise StepNotFoundError(f"step {step} was deleted from {self._where}")
            self._catalog.update(step, manifest=rec.manifest, error=rec.error)
            if rec.manifest is None:
                return [str(rec.error)]
            manifest = rec.manifest
            live = [n for n, e in manifest.items.items() if not e.dropped]
            problems = []
            for name in live:
                stored = self._stored(step, name, manifest)
                try:  # a packed item: each pack's chunks are checked on the same read
                    chunks = chunks_by_pack(stored)
                except CorruptCheckpointError as e:
                    problems.append(str(e))  # an index whose own file is damaged: said once
                    chunks = {}
                known = len(problems)
                for record in manifest.items[name].files:
                    try:
                        problems += stored.check_file(
                            record.path, checked, chunks.get(record.path, ())
                        )
                    except CorruptCheckpointError as e:
                        if str(e) not in problems:
                            problems.append(str(e))
                    except OSError as e:
                        problems.append(f"{stored.describe_file(record.path)} cannot be read: {e}")
                    if progress is not None:
                        progress(record.size)
                if len(problems) == known:  # the files hold: what a restore checks before reading
                    problems += self._check_item(name, manifest.items[name].handler, stored)
            if rec.metrics_error is not None:
                problems.append(f"step {step}: {rec.metrics_error}")
            if not (self._reread_manifest(step, manifest, live) and problems):
                return problems
        raise CorruptCheckpointError(
            f"step {step} in {self._where} changed {_REREADS} times while being verified"
        )

    def _check_item(self, name: str, handler_id: str, stored: StoredItem) -> list[str]:
        """The item's handler's ``check`` (what a restore refuses before it reads), as problems;
        none where the handler has no ``check`` or this cairn does not know it."""
        try:
            handler = self._handlers.get(name) or handler_by_id(handler_id)
        except UnsupportedFormatError:
            return []
        try:
            check_item(handler, stored)
        except CorruptCheckpointError as e:
            return [str(e)]
        return []

    def describe(self, step: Any) -> dict[str, dict[str, Any]]:
        """What each item of a committed step holds, from its handler's ``describe``: for array
        trees every leaf with its key path, shape and dtype, and the bytes. Dropped items are
        reported as such."""
        step = as_step(step)
        self._wait_if_inflight(step)
        manifest = self._manifest(step)
        out: dict[str, dict[str, Any]] = {}
        for name, entry in manifest.items.items():
            if entry.dropped:
                out[name] = {"kind": "dropped", "handler": entry.handler}
                continue
            handler = self._handlers.get(name) or handler_by_id(entry.handler)
            stored = self._stored(step, name, manifest)
            out[name] = {"handler": entry.handler, **handler.describe(stored)}
        return out

    def info(self, step: Any) -> StepInfo:
        """The manifest of a committed step: items, metrics, user metadata, times, telemetry."""
        step = as_step(step)
        self._wait_if_inflight(step)
        _, manifest = self._record(step)
        metrics = self._catalog.metrics(step)
        telemetry = {**manifest.telemetry, **self._catalog.telemetry(step)}
        return StepInfo(
            step=step,
            path=self._storage.location(self._names.format(step)),
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
            best=manifest.best,
        )

    # ------------------------------------------------------------------ metrics

    def metadata(self, step: Any = None) -> dict[str, Any]:
        """The directory's metadata (None: given once as ``metadata=``; the first writable
        manager that gave one saved it, later ones keep it), or a step's ``metadata=``."""
        if step is not None:
            return dict(self.info(step).metadata)
        where = f"{self._where}/{ROOT_METADATA}"
        data = self._storage.read_root_file(ROOT_METADATA)
        if data is None:
            return dict(self._given_metadata or {})
        found = parse_json(data, where)
        try:
            if not isinstance(found, dict) or set(found) != {"custom_metadata"}:
                raise TypeError('not {"custom_metadata": {...}}')
            return check_metadata(found["custom_metadata"])
        except (TypeError, RecursionError) as e:
            raise CorruptCheckpointError(f"{where}: {e}") from None

    def _save_root_metadata(self, given: dict[str, Any]) -> None:
        """Write the directory's metadata unless it has some (then keep it, as Orbax does)."""
        body = json.dumps({"custom_metadata": given}, allow_nan=False, sort_keys=True).encode()
        if self._storage.create_root_file(ROOT_METADATA, body):
            return
        try:
            kept = self.metadata() == given
        except CorruptCheckpointError as e:  # a damaged file does not stop the run; metadata() says
            log.warning("cairn: %s; metadata= given now is not saved", e)
            return
        if not kept:
            log.warning(
                "cairn: %s already has metadata (%s); metadata= given now is not saved",
                self._where,
                ROOT_METADATA,
            )

    def metrics(self, step: Any) -> dict[str, float]:
        """The metrics of a step: those given to save, updated by record_metrics (later wins)."""
        step = as_step(step)
        self._wait_if_inflight(step)
        self._record(step)
        return self._catalog.metrics(step)

    def record_metrics(self, step: Any, metrics: Mapping[str, Any]) -> None:
        """Merge late metrics (say, from an evaluation) into a committed step's ``metrics.json``.

        Waits for a commit of `step` still in flight; StepNotFoundError for an unknown step.
        Retention runs again afterwards, so KeepBest sees the new values.
        """
        self._check_writable("record_metrics")
        step = as_step(step)
        new = check_metrics(metrics)
        self._check_not_foreign(step)

        def update() -> None:
            rec = self._catalog.get(step)
            if rec is None:
                raise StepNotFoundError(self._missing(step))
            if rec.manifest is None:
                self._manifest(step)  # raises the step's own error
            merged = {**rec.late_metrics, **new}
            if self._procs.primary:
                body = dump_checked({"metrics": merged})
                self._storage.write_metrics(self._names.format(step), body)
            self._catalog.update(step, late_metrics=merged)
            if self._procs.primary:
                self._apply_retention()

        self._on_commit_thread(self._together("record_metrics", update))

    def best_step(self) -> int | None:
        """The intact step with the best value of the `best=` metric (or the KeepBest one)."""
        metric, mode = self._best_rule()
        scored = self._catalog.scored(metric)
        if not scored:
            return None
        sign = 1.0 if mode == "min" else -1.0
        return min(scored, key=lambda sv: (sign * sv[1], -sv[0]))[0]

    def _known_best(self) -> tuple[str, str] | None:
        """The best-step rule, if the manager has one: `best=`, or its one KeepBest."""
        if self._best is not None:
            return self._best
        bests = find_keep_best(self._keep)
        return (bests[0].metric, bests[0].mode) if len(bests) == 1 else None

    def _best_rule(self) -> tuple[str, str]:
        rule = self._known_best()
        if rule is not None:
            return rule
        raise ValueError(
            "best_step() needs best=(metric, mode) or exactly one KeepBest in keep=; "
            f"keep={self._keep!r}"
        )

    # ------------------------------------------------------------------ changing the directory

    def delete(self, step: Any) -> None:
        """Delete a committed step (after pending commits): rename to trash, then remove."""
        self._check_writable("delete")
        step = as_step(step)

        self._check_not_foreign(step)

        def remove() -> None:
            if self._catalog.get(step) is None:
                raise StepNotFoundError(self._missing(step))
            if self._procs.primary:
                self._delete_now(step)

        self._on_commit_thread(self._together("delete", remove))

    def reload(self) -> None:
        """Read the directory again (after pending commits), e.g. to see another writer's steps."""
        self._catalog.replace(self._on_commit_thread(self._scan))

    @staticmethod
    def _refuse(refusal: str | None) -> None:
        if refusal is not None:
            raise ValueError(refusal)

    def _other_naming(self) -> str | None:
        """Why the directory is refused, if it holds steps (cairn's, or orbax-checkpoint's)
        under a naming other than ours and none under ours: a trainer would otherwise start
        from scratch beside them. Looked for before anything is written (on object stores, by
        the primary after its listing found no step: the lease it took is released)."""
        found = self._storage.other_naming(self._names)
        if found is None:
            return None
        other, who = found
        option = f"step_prefix={other.prefix!r}" + (
            f", step_digits={other.digits}" if other.digits is not None else ""
        )
        ours = f"step_prefix={self._names.prefix!r}" + (
            f", step_digits={self._names.digits}" if self._names.digits is not None else ""
        )
        then = (
            "read them in place (read-only) and save new steps beside them"
            if who == "orbax-checkpoint"
            else "read them and save the next ones under the same names"
        )
        return (
            f"{self._where} holds steps written by {who} named like {other.format(0)!r}, and "
            f"none named as {ours} expects ({self._names.format(0)!r}); open it with "
            f"CheckpointManager(..., {option}) to {then}"
        )

    def _hand_over(self) -> None:
        """A newer writable manager of this process opens the directory: finish what is
        pending, let go of the directory and stay open for reading. An error of a pending
        commit is logged and stays kept for this manager's next call."""
        with self._handing:
            if self._closed or self._superseded:
                return
            self._superseded = (
                f"a newer writable CheckpointManager of {self._where} in this process took "
                "over; this one is read-only now. Save through the new one (or close it and "
                "open a new manager)"
            )
        try:
            self._drain()
        finally:
            for pool in (self._executor, self._reclaimer):
                if pool is not None:
                    pool.shutdown(wait=True)
            self._executor = self._reclaimer = None
            if self._remote is not None:
                self._remote.close()
                self._remote = None
            if self._preemption is not None:
                self._preemption.close()
                self._preemption = None
            if self._writer:
                self._storage.release()
                self._writer = False
            self._read_only = True
        with self._errors_lock:
            pending = [f"{what}: {type(e).__name__}: {e}" for what, e in self._errors]
        log.warning(
            "cairn: a newer writable CheckpointManager of %s in this process took over; the "
            "older one finished its pending commits and is read-only now%s",
            self._where,
            f" (they failed: {pending})" if pending else "",
        )

    def _check_writable(self, what: str) -> None:
        if self._superseded is not None:
            raise SupersededError(f"{what}: {self._superseded}")
        if self._read_only:
            raise ReadOnlyError(
                f"{what}: this manager of {self._where} was opened with read_only=True"
            )
        if self._closed:
            raise RuntimeError(f"{what}: this manager of {self._where} is closed")

    def _check_not_foreign(self, step: int) -> None:
        if self._catalog.is_foreign(step):
            raise ReadOnlyError(
                f"step {step} was written by orbax-checkpoint; cairn does not change it"
            )

    def _scan(self) -> dict[int, StepRecord]:
        """Every committed step, with its manifest or the reason it cannot be read."""
        return {listed.step: read_record(listed) for listed in self._storage.scan(self._names)}

    def _adopt_if_committed(self, step: int) -> None:
        """After a failed commit, list the step if it is committed anyway (the commit point
        passed, a later sync failed), so all_steps() stays true."""
        try:
            listed = self._storage.read_step(self._names, step)
            if listed is not None:
                self._catalog.committed(step, read_record(listed))
        except Exception as e:  # never hide the commit's own error behind this one
            log.error("cairn: could not read back step %d after its failed commit: %r", step, e)


@contextlib.contextmanager
def _naming_item(name: str) -> Iterator[None]:
    """Prefix a TypeError/ValueError raised for one item with the item's name."""
    try:
        yield
    except (TypeError, ValueError) as e:
        if type(e) in (TypeError, ValueError, MismatchError):
            raise type(e)(f"item {name!r}: {e}") from e
        raise


# Writable managers opened per directory in this process (collective keys).
_OPENED: dict[str, int] = {}

# The writable manager open on each directory in this process: a new one takes over from it.
_WRITERS: dict[str, weakref.ref[CheckpointManager]] = {}
_WRITERS_LOCK = threading.Lock()


def _take_over(key: str, manager: CheckpointManager) -> None:
    """Register `manager` as the directory's writer; the one registered before hands over."""
    with _WRITERS_LOCK:
        ref = _WRITERS.get(key)
        _WRITERS[key] = weakref.ref(manager)
    previous = ref() if ref is not None else None
    if previous is not None and previous is not manager:
        previous._hand_over()


def settle_writer(key: str) -> None:
    """Read your own writes: when this process has a writable manager open on the directory
    `key` (a storage's ``identity``), wait until the saves it accepted are committed (or have
    failed: their errors stay that manager's), so that a reader opened now sees them. Bounded
    by that manager's ``barrier_timeout``, and logged; a reader on the writer's own commit
    thread does not wait. Other processes' writers are not waited for."""
    with _WRITERS_LOCK:
        ref = _WRITERS.get(key)
    writer = ref() if ref is not None else None
    if writer is None or writer._executor is None or writer._closed:
        return
    if threading.current_thread().name.startswith("cairn-commit"):
        return
    if not writer._catalog.any_in_flight():
        return
    log.info("cairn: waiting for the saves this process's writer accepted in %s", writer._where)
    try:
        writer._executor.submit(lambda: None).result(timeout=writer._timeout)
    except concurrent.futures.TimeoutError:
        log.warning(
            "cairn: the saves this process's writer accepted in %s are still being committed "
            "after %g s (barrier_timeout); reading without them",
            writer._where,
            writer._timeout,
        )
    except RuntimeError:  # the writer closed meanwhile: its saves are done
        pass


def _forget_writer(key: str, manager: CheckpointManager) -> None:
    with _WRITERS_LOCK:
        ref = _WRITERS.get(key)
        if ref is not None and ref() in (manager, None):
            del _WRITERS[key]


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


def _pack_retention(keep: KeepPolicy, keep_items: Mapping[str, KeepPolicy]) -> bytes | None:
    """The policies a writer process applies if the trainer dies; None if they cannot be
    pickled (then the next writable manager applies them)."""
    try:
        return pickle.dumps((keep, dict(keep_items)))
    except Exception as e:
        log.info("cairn: the keep policies cannot be sent to the writer process: %r", e)
        return None


def _start_writer(spec: Mapping[str, Any], pass_fds: list[int]) -> WriterProcess:
    try:
        return WriterProcess(spec, pass_fds)
    except OSError as e:
        raise WriterProcessError(
            f"could not start a writer process ({type(e).__name__}: {e}); nothing was saved. "
            "Use writer='thread' where processes cannot be started"
        ) from e


def _settle(job: _commit.SaveJob, entered: float, *, handed: bool = False) -> None:
    """Caller thread, in save(): until no snapshot reads the caller's objects any more (the
    train state's staging copies run on while the save is handed over), then the time save()
    blocked goes to the job, whose commit waits for it (`SaveJob.settled`). A failed copy
    raises here before the hand-off; after it (`handed`), it is the commit's error, reported
    as any other (the commit's write waits for the same copies and fails)."""
    try:
        for _, snapshot in job.snapshots.values():
            try:
                settle_snapshot(snapshot)
            except Exception:
                if not handed:
                    raise
    finally:
        job.blocked_s = time.monotonic() - entered
        if job.settled is not None:
            job.settled.set()


def _release(snapshots: Mapping[str, tuple[Handler, Any]]) -> None:
    """Give the snapshots' staging memory back to the pool (a writer process is done with it,
    or the save never reached one)."""
    for _, snapshot in snapshots.values():
        release_snapshot(snapshot)


def _uses_time(policy: Any) -> bool:
    """Whether a save policy looks at the clock (so processes could disagree)."""
    if isinstance(policy, AnyOf):
        return any(_uses_time(p) for p in policy.policies)
    return not isinstance(policy, (EveryNSteps, AtSteps))
