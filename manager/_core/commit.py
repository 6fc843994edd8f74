"""The commit sequence, top to bottom, on any storage; and the manifest it commits.

`commit_step` runs on the commit thread (or the caller's, for synchronous saves).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from cairn.handlers import Destination, FileRecord, Handler, Snapshot, writing_as
from cairn.handlers.io import WriteBudget, snapshot_version
from cairn.manager._core.multihost import SINGLE, Meetings
from cairn.manager._format import ItemEntry, Manifest, StepNames
from cairn.manager._storage.base import Storage

log = logging.getLogger("cairn")


@dataclasses.dataclass
class SaveJob:
    """One save as the caller thread hands it to the commit thread."""

    step: int
    tmp_name: str | None  # shared by all processes of a multi-process save, else None
    snapshots: Mapping[str, tuple[Handler, Snapshot]]
    metrics: Mapping[str, float]
    metadata: Mapping[str, Any]
    started_at: float
    blocked_s: float
    budget: WriteBudget | None = None  # max_write_bytes_per_s
    incremental: bool = False  # files the previous step has are linked, not written
    #: the newest committed step (name, manifest) whose files this one may reuse (incremental)
    previous: tuple[str, Manifest] | None = None
    #: set by save() when it returns, `blocked_s` final; the commit waits for it (None: no wait)
    settled: threading.Event | None = None
    #: the manager's best-step rule (metric, mode), recorded in the manifest, if it has one
    best: tuple[str, str] | None = None


def commit_step(
    storage: Storage,
    names: StepNames,
    job: SaveJob,
    procs: Meetings = SINGLE,
    *,
    timeout_s: float = 300.0,
) -> Manifest | None:
    """Write one step and commit it; on any failure nothing new is visible and what was written
    is gone.

    The order is the whole point: items first, the manifest last, everything durable, then the
    commit point, which the storage makes atomic (one rename of the temporary directory on
    POSIX; on object stores the manifest, written last, replacing the claim taken at
    `prepare`). A reader, or a restart after SIGKILL, sees either no step or a complete one.

    With several processes (`procs`, all calling this with the same `job.tmp_name`): the primary
    prepares the step; every process writes its shards, makes them durable and reports its list
    of files, or its error, through the coordination service; a barrier; then the primary alone
    reads the reports (one request), merges the lists into the manifest and commits. Nothing
    step-level is written to the storage by any other process, and no process lists it. A
    process that never arrives makes the others raise BarrierTimeoutError and nothing is
    committed. Returns the manifest on the primary, None on the others (the manager's commit
    thread then waits for the primary's outcome broadcast).
    """
    t0 = time.monotonic()
    name = names.format(job.step)
    key = f"cairn/{job.tmp_name or name}"
    tmp_name = job.tmp_name or names.temporary(job.step)
    if procs.primary:
        storage.check_writer()
        step = storage.prepare(name, tmp_name, job.snapshots, create=True)
    procs.barrier(f"{key}/created", timeout_s)  # nobody writes before the step is claimed
    if not procs.primary:
        step = storage.prepare(name, tmp_name, job.snapshots, create=False)
    try:
        records: dict[str, tuple[FileRecord, ...]] = {}
        error = None
        try:
            with writing_as(procs.index, procs.count):
                for item, (handler, snapshot) in job.snapshots.items():
                    dest = step.destination(item)
                    dest.budget = job.budget
                    if job.incremental:
                        _reuse_previous(dest, storage, job.previous, item, handler.id)
                    records[item] = dest.finish(handler.id, tuple(snapshot.write(dest)))
            if procs.count == 1:  # a writer that lost the directory during the upload stops
                storage.check_writer()
            else:
                if procs.primary:  # the same check, while the others finish: off the path
                    checked = _in_background(storage.check_writer)
                step.sync()  # each process makes its own writes durable, on its own host
        except Exception as e:
            if procs.count == 1:
                raise
            error = e
        if procs.count > 1:
            procs.report(f"{key}/written", _report(records, error))
            procs.barrier(f"{key}/written", timeout_s)
            if error is not None:
                raise error
            if not procs.primary:
                return None
            _merge_reports(records, procs.reports(f"{key}/written"), procs.index, job.step)
            checked.result()
        if job.settled is not None:  # its blocked_s: the copies it waited for are done
            job.settled.wait()
        manifest = build_manifest(job, records, time.monotonic() - t0)
        step.commit(manifest)  # the commit point
    except BaseException:
        if procs.primary:
            step.abort()
        raise
    finally:
        if procs.primary:  # the reports, off the path to the commit
            procs.forget(f"{key}/written")
    return manifest


def _reuse_previous(
    dest: Destination,
    storage: Storage,
    previous: tuple[str, Manifest] | None,
    item: str,
    handler_id: str,
) -> None:
    """An incremental save's item: the files of the same item in `previous`, if that step has
    it, written by the same handler and not dropped, may be linked instead of written."""
    entry = previous[1].items.get(item) if previous is not None else None
    if previous is None or entry is None or entry.handler != handler_id or entry.dropped:
        dest.reuse(None)
    else:
        dest.reuse(storage.source(previous[0], item), entry.files)


def _in_background(fn: Callable[[], None]) -> concurrent.futures.Future[None]:
    """`fn` on a thread of its own; its outcome from the future's `result`."""
    future: concurrent.futures.Future[None] = concurrent.futures.Future()

    def run() -> None:
        try:
            fn()
        except BaseException as e:
            future.set_exception(e)
        else:
            future.set_result(None)

    threading.Thread(target=run, name="cairn-check", daemon=True).start()
    return future


def _report(records: Mapping[str, tuple[FileRecord, ...]], error: Exception | None) -> str:
    """What one process tells the primary after its write phase: its files, or its error."""
    if error is not None:
        return json.dumps({"error": f"{type(error).__name__}: {error}"})
    return json.dumps({"files": {n: [f.to_json() for f in r] for n, r in records.items()}})


def _merge_reports(
    records: dict[str, tuple[FileRecord, ...]], reports: list[str], me: int, step: int
) -> None:
    """The primary adds the other processes' files to its own records; RuntimeError if one of
    them failed, or if two processes wrote one file."""
    for index, text in enumerate(reports):
        report = json.loads(text)
        if "error" in report:
            raise RuntimeError(f"process {index} failed to write step {step}: {report['error']}")
        if index == me:
            continue
        for name, entries in report["files"].items():
            records[name] += tuple(FileRecord.from_json(f) for f in entries)
    for name, merged in records.items():
        paths = [f.path for f in merged]
        if len(set(paths)) != len(paths):
            twice = sorted({p for p in paths if paths.count(p) > 1})
            raise RuntimeError(f"item {name!r}: several processes wrote {twice[:5]}")


def build_manifest(
    job: SaveJob, records: Mapping[str, tuple[FileRecord, ...]], write_s: float
) -> Manifest:
    """The manifest of a written step (its commit time is now)."""
    items = {
        # A snapshot may say which of its handler's versions it wrote (the train state's layout).
        name: ItemEntry(handler.id, snapshot_version(handler, snap), records[name])
        for name, (handler, snap) in job.snapshots.items()
    }
    size = sum(entry.bytes for entry in items.values())
    written = sum(f.size for entry in items.values() for f in entry.files if not f.reused)
    return Manifest(
        step=job.step,
        items=items,
        started_at=job.started_at,
        committed_at=time.time(),
        metrics=dict(job.metrics),
        metadata=dict(job.metadata),
        telemetry={
            "blocked_s": job.blocked_s,
            "write_s": write_s,
            "bytes": float(size),
            "bytes_written": float(written),
        },
        best=job.best,
    )
