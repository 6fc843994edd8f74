"""The commit thread of a manager: saves handed over by `save()` are written, committed and
followed by retention there, in order, with the errors kept for the caller."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import pickle
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from cairn.handlers import Handler
from cairn.handlers.errors import BarrierTimeoutError, CommitError, WriterProcessError
from cairn.handlers.io import lower_thread_priority, release_snapshot, settle_snapshot
from cairn.manager._core import commit as _commit
from cairn.manager._core.catalog import Catalog, StepRecord
from cairn.manager._core.coordination import Coordinator
from cairn.manager._core.multihost import Processes
from cairn.manager._core.options import Options
from cairn.manager._core.policies import KeepPolicy
from cairn.manager._core.reading import Reader
from cairn.manager._core.retention import Retention
from cairn.manager._core.telemetry import Telemetry
from cairn.manager._core.writer import WriterProcess
from cairn.manager._format import Manifest, StepNames
from cairn.manager._storage.base import Storage

log = logging.getLogger("cairn")
T = TypeVar("T")


class Errors:
    """The errors of a manager's background work, kept until the caller is told (once).
    Threads: kept on the commit thread, read and raised on the caller's; one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._errors: list[tuple[str, BaseException]] = []

    def keep(self, what: str, error: BaseException) -> None:
        log.error("cairn: %s failed: %r", what, error)
        with self._lock:
            self._errors.append((what, error))

    def failed(self, step: int) -> bool:
        """Whether the commit of `step` failed, its error not yet raised."""
        with self._lock:
            return any(what == f"the commit of step {step}" for what, _ in self._errors)

    def pending(self) -> list[str]:
        with self._lock:
            return [f"{what}: {type(e).__name__}: {e}" for what, e in self._errors]

    def raise_kept(self) -> None:
        """Raise CommitError (once) if background work failed since the last call."""
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


class Reclaimer:
    """Deleted steps leave the listing on the commit thread; freeing their space is slow on
    some filesystems (seconds per GiB with online discard), so it happens on a thread of its
    own ("cairn-reclaim", at a lower priority), off that path. None for a read-only manager."""

    def __init__(self, enabled: bool) -> None:
        self.pool = (
            concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="cairn-reclaim", initializer=lower_thread_priority
            )
            if enabled
            else None
        )

    def __call__(self, work: Callable[[], None]) -> None:
        if self.pool is not None:
            self.pool.submit(work)


class Committer:
    """Runs every change to the directory of one manager, in submission order.

    Concurrency: one commit thread ("cairn-commit", none with ``async_save=False``: then
    saves commit on the caller thread) runs the write phase of saves, the commit, retention,
    `record_metrics`, `delete` and `reload`, so they never interleave. At most `max_pending`
    saves are in flight (`slots`): a save takes a slot before its snapshot and the commit
    thread gives it back. An error on the commit thread is kept (`keep_error`, under a lock)
    and raised once, as CommitError with the original chained, by `check_for_errors`. A
    deleted step's space is freed on a second thread ("cairn-reclaim"). Both threads run at a
    lower CPU and I/O priority. With a writer process (``writer="process"``, `remote`) the
    write and commit of each save run there: the caller thread sends the save
    (`hand_to_writer`), the commit thread waits for the answer, then applies retention."""

    def __init__(
        self,
        *,
        storage: Storage,
        names: StepNames,
        catalog: Catalog,
        reader: Reader,
        retention: Retention,
        coordinator: Coordinator,
        telemetry: Telemetry,
        errors: Errors,
        reclaimer: Reclaimer,
        timeout: float,
        max_pending: int,
        threads: bool,
        writer_spec: Mapping[str, Any] | None,
    ) -> None:
        self._storage, self._names, self._catalog = storage, names, catalog
        self._reader, self._retention, self._together = reader, retention, coordinator
        self._telemetry, self._timeout = telemetry, timeout
        self._where = storage.url
        self.slots = threading.BoundedSemaphore(max_pending)
        self.errors, self._reclaimer = errors, reclaimer
        self._writer_spec = writer_spec  # writer="process": what a writer process is given
        self.remote: WriterProcess | None = None  # writer="process": the current one
        self.closed = False
        self.executor = (
            concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="cairn-commit", initializer=lower_thread_priority
            )
            if threads
            else None
        )

    # ------------------------------------------------------------------ saves

    def take_slot(self, step: int) -> None:
        """Caller thread: wait until fewer than `max_pending` saves are in flight."""
        waited = time.monotonic()
        self.slots.acquire()
        waited = time.monotonic() - waited
        if waited > 0.001:
            log.info(
                "cairn: save of step %d waited %.1f ms for a pending commit", step, waited * 1e3
            )

    def abandon(self, snapshots: Mapping[str, tuple[Handler, Any]], *, slot: bool = True) -> None:
        """A save that stops before its hand-off: its staging memory and its slot (if it took
        one) go back."""
        release(snapshots)
        if slot:
            self.slots.release()

    def hand_over(
        self, job: _commit.SaveJob, packed: tuple[bytes, list[int]] | None, owner: object
    ) -> None:
        """Caller thread: the job goes to the commit thread (and, packed, to the writer
        process). On failure the step is no longer in flight and the snapshots are released.
        The commit thread holds `owner` (the manager) until the job is done: a manager dropped
        with a save in flight stays the directory's writer in this process until the save
        lands, so a new manager takes over from it (`takeover`) instead of finding it locked."""
        assert self.executor is not None
        try:
            remote = self._hand_to_writer(*packed) if packed is not None else None
            self.executor.submit(_run_for, owner, self, job, remote)
        except BaseException:  # e.g. from an atexit hook after interpreter shutdown began
            self._catalog.committed(job.step, None)
            self.abandon(job.snapshots)
            raise

    def _hand_to_writer(self, payload: bytes, fds: list[int]) -> WriterProcess:
        """Caller thread (``writer="process"``): send a packed save job to the writer process,
        starting one if there is none or the last one died; the process it went to."""
        for attempt in (1, 2):
            if self.remote is None or self.remote.dead is not None:
                if self.remote is not None:
                    self.remote.close()
                spec = self._storage.for_writer_process()
                assert spec is not None and self._writer_spec is not None  # checked at opening
                self.remote = _start_writer({**spec[0], **self._writer_spec}, spec[1])
                self._storage.writer_started(self.remote.pid)
            try:
                self.remote.send(payload, fds)
            except WriterProcessError:
                if attempt == 2:
                    raise
                continue  # it died since its last answer: a new one takes this save
            return self.remote
        raise AssertionError("unreachable")

    def run_save(
        self, job: _commit.SaveJob, *, reraise: bool, remote: WriterProcess | None = None
    ) -> None:
        """Commit thread: commit one step, then apply retention. Errors are kept for the caller.

        With several processes the primary commits and applies retention, then tells the others
        the outcome; they read the directory again. With a writer process (`remote`) the commit
        is that process's: this thread waits for its answer, then applies retention.
        """
        t0 = time.monotonic()
        procs, outcome_key = self._together.procs, f"cairn/{job.tmp_name}/outcome"
        if job.incremental:
            job.previous = self._newest_intact_before(job.step)
        try:
            try:
                manifest: Manifest | None
                if remote is not None:
                    try:
                        manifest = remote.result(job.step)
                    finally:
                        release(job.snapshots)
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
                    self._together.apply_changes(outcome[3:])
                    procs.barrier(f"{outcome_key}/read", self._timeout)  # see tell_changes
                    return
            except BaseException as e:
                if procs.count > 1 and procs.primary:
                    with contextlib.suppress(Exception):
                        procs.broadcast(outcome_key, f"{type(e).__name__}: {e}", self._timeout)
                self._catalog.committed(job.step, None)
                if not reraise:
                    self.errors.keep(f"the commit of step {job.step}", e)
                self._reader.adopt_if_committed(job.step)  # e.g. the rename passed, fsync failed
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
                self._retention.apply()
            except Exception as e:
                if reraise:
                    raise
                self.errors.keep(f"retention after step {job.step}", e)
            finally:
                if procs.count > 1:  # committed; retention done or failed on its own
                    try:
                        self._together.tell_changes(outcome_key, "ok ")
                        procs.forget(f"cairn/{job.tmp_name}")
                    except BarrierTimeoutError as e:  # the step stays committed
                        if reraise:
                            raise
                        self.errors.keep(f"telling the others that step {job.step} committed", e)
        finally:
            self.slots.release()

    def _newest_intact_before(self, step: int) -> tuple[str, Manifest] | None:
        """Commit thread: the newest committed step before `step` whose manifest was read (an
        incremental save links the files it shares with it); retention runs on this thread too,
        so it stays until the save that links to it has committed."""
        for older in reversed(self._catalog.steps()):
            rec = self._catalog.get(older)
            if older < step and rec is not None and rec.manifest is not None:
                return self._names.format(older), rec.manifest
        return None

    # ------------------------------------------------------------------ waiting and errors

    def drain(self) -> None:
        """Wait until the commit thread is idle; its errors stay for the next save/wait/close."""
        if self.executor is not None and not self.closed:
            self.executor.submit(lambda: None).result()  # FIFO: every earlier job has finished

    def wait_if_inflight(self, step: int) -> None:
        if self._catalog.in_flight(step):
            self.drain()

    def on_commit_thread(self, fn: Callable[[], T]) -> T:
        """Run `fn` after every pending commit, on the commit thread when there is one."""
        if self.closed:
            raise RuntimeError(f"this manager of {self._where} is closed")
        if self.executor is None:
            return fn()
        return self.executor.submit(fn).result()

    def settle_for_reader(self) -> None:
        """Another reader in this process opens the directory: wait, bounded and logged, until
        the saves accepted so far are committed (or failed). See `takeover.settle_writer`."""
        if self.executor is None or self.closed:
            return
        if threading.current_thread().name.startswith("cairn-commit"):
            return
        if not self._catalog.any_in_flight():
            return
        log.info("cairn: waiting for the saves this process's writer accepted in %s", self._where)
        try:
            self.executor.submit(lambda: None).result(timeout=self._timeout)
        except concurrent.futures.TimeoutError:
            log.warning(
                "cairn: the saves this process's writer accepted in %s are still being "
                "committed after %g s (barrier_timeout); reading without them",
                self._where,
                self._timeout,
            )
        except RuntimeError:  # the writer closed meanwhile: its saves are done
            pass

    def stop(self) -> None:
        """Let the threads finish (after pending work) and end the writer process."""
        for pool in (self.executor, self._reclaimer.pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self.executor = self._reclaimer.pool = None
        if self.remote is not None:
            self.remote.close()
            self.remote = None


def _run_for(
    owner: object, commits: Committer, job: _commit.SaveJob, remote: WriterProcess | None
) -> None:
    commits.run_save(job, reraise=False, remote=remote)  # `owner` is held until this returns


def release(snapshots: Mapping[str, tuple[Handler, Any]]) -> None:
    """Give the snapshots' staging memory back to the pool (a writer process is done with it,
    or the save never reached one)."""
    for _, snapshot in snapshots.values():
        release_snapshot(snapshot)


def settle(job: _commit.SaveJob, entered: float, *, handed: bool = False) -> None:
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


def _start_writer(spec: Mapping[str, Any], pass_fds: list[int]) -> WriterProcess:
    try:
        return WriterProcess(spec, pass_fds)
    except OSError as e:
        raise WriterProcessError(
            f"could not start a writer process ({type(e).__name__}: {e}); nothing was saved. "
            "Use writer='thread' where processes cannot be started"
        ) from e


def writer_spec(options: Options, procs: Processes) -> dict[str, Any]:
    """What a writer process is given besides the storage's own spec."""
    return {
        "step_prefix": options.names.prefix,
        "step_digits": options.names.digits,
        "max_pending": options.max_pending,
        "max_write_bytes_per_s": options.budget.bytes_per_s if options.budget else None,
        "process_index": procs.index,
        "process_count": procs.count,
        "primary_index": procs.primary_index,
        "barrier_timeout": options.barrier_timeout,
        "retention": _pack_retention(options.keep, options.keep_items),
    }


def _pack_retention(keep: KeepPolicy, keep_items: Mapping[str, KeepPolicy]) -> bytes | None:
    """The policies a writer process applies if the trainer dies; None if they cannot be
    pickled (then the next writable manager applies them)."""
    try:
        return pickle.dumps((keep, dict(keep_items)))
    except Exception as e:
        log.info("cairn: the keep policies cannot be sent to the writer process: %r", e)
        return None
