"""The commit protocol on a POSIX filesystem, and the deletion that undoes it.

Every function here is called on the commit thread (or the caller's, for synchronous saves),
except `clean_leftovers`, which the manager calls once at start-up.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from cairn.handlers import FileRecord, Handler, Snapshot, write_file
from cairn.handlers._files import check_relative, fsync_dir, hash_file, within, writing_as
from cairn.handlers.errors import StepAlreadyExistsError
from cairn.manager._format import (
    MANIFEST,
    METRICS,
    TRASH_PREFIX,
    ItemEntry,
    Manifest,
    StepNames,
    dump_checked,
    trash_name,
)
from cairn.manager._multihost import SINGLE, Processes

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


def commit_step(
    root: Path,
    names: StepNames,
    job: SaveJob,
    procs: Processes = SINGLE,
    *,
    timeout_s: float = 300.0,
) -> Manifest | None:
    """Write one step and commit it; on any failure nothing new is visible and the tmp dir is gone.

    The order is the whole point: items first, the manifest last, everything durable, then one
    rename. A reader (or a restart after SIGKILL) sees either no step or a complete one, because
    the final name appears only through the atomic rename of a directory whose contents and
    manifest are already durable. POSIX rename would replace an *empty* directory of the final
    name, so an existing one is refused first (the directory lock keeps other writers out).

    With several processes (`procs`, all calling this with the same `job.tmp_name`): the primary
    creates the directories; every process writes its shards and its list of files, makes them
    durable and reports ok or its error; a barrier; then the primary alone checks the reports,
    merges the lists into the manifest and renames. A process that never arrives makes the others
    raise BarrierTimeoutError and nothing is committed. Returns the manifest on the primary, None
    on the others (the manager's commit thread then waits for the primary's outcome broadcast).
    """
    t0 = time.monotonic()
    tmp = root / (job.tmp_name or names.temporary(job.step))
    final = root / names.format(job.step)
    key = f"cairn/{tmp.name}"
    if procs.primary:
        tmp.mkdir()
        for name in job.snapshots:
            (tmp / name).mkdir()
    procs.barrier(f"{key}/created", timeout_s)
    try:
        records: dict[str, tuple[FileRecord, ...]] = {}
        error = None
        try:
            with writing_as(procs.index, procs.count):
                for name, (handler, snapshot) in job.snapshots.items():
                    written = tuple(snapshot.write(tmp / name))
                    records[name] = _check_records(tmp / name, handler, written)
            if procs.count > 1:
                listing = {n: [f.to_json() for f in r] for n, r in records.items()}
                write_file(tmp, f".process-{procs.index}.json", json.dumps(listing).encode())
                fsync_tree(tmp)  # each process makes its own writes durable, on its own host
        except Exception as e:
            if procs.count == 1:
                raise
            error = e
        if procs.count > 1:
            outcome = "ok" if error is None else f"{type(error).__name__}: {error}"
            procs.report(f"{key}/written", outcome)
            procs.barrier(f"{key}/written", timeout_s)
            if error is not None:
                raise error
            if not procs.primary:
                return None
            for index, report in enumerate(procs.reports(f"{key}/written", timeout_s)):
                if report != "ok":
                    raise RuntimeError(f"process {index} failed to write step {job.step}: {report}")
        for index in range(1, procs.count):  # merge the other processes' lists of files
            listing_path = tmp / f".process-{index}.json"
            for name, entries in json.loads(listing_path.read_bytes()).items():
                records[name] += tuple(FileRecord.from_json(f) for f in entries)
            listing_path.unlink()
        if procs.count > 1:
            (tmp / ".process-0.json").unlink()
            for name, merged in records.items():  # two processes must never write one file
                paths = [f.path for f in merged]
                if len(set(paths)) != len(paths):
                    twice = sorted({p for p in paths if paths.count(p) > 1})
                    raise RuntimeError(f"item {name!r}: several processes wrote {twice[:5]}")
        manifest = build_manifest(job, records, time.monotonic() - t0)
        write_file(tmp, MANIFEST, manifest.to_bytes())
        fsync_tree(tmp)
        if os.path.lexists(final):
            raise StepAlreadyExistsError(f"step {job.step}: {final} appeared on disk meanwhile")
        os.rename(tmp, final)  # the commit point
    except BaseException:
        if procs.primary:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(root)  # make the new name itself durable
    return manifest


def build_manifest(
    job: SaveJob, records: Mapping[str, tuple[FileRecord, ...]], write_s: float
) -> Manifest:
    """The manifest of a written step (its commit time is now)."""
    items = {
        name: ItemEntry(handler.id, handler.version, records[name])
        for name, (handler, _) in job.snapshots.items()
    }
    size = sum(entry.bytes for entry in items.values())
    return Manifest(
        step=job.step,
        items=items,
        started_at=job.started_at,
        committed_at=time.time(),
        metrics=dict(job.metrics),
        metadata=dict(job.metadata),
        telemetry={"blocked_s": job.blocked_s, "write_s": write_s, "bytes": float(size)},
    )


def write_items(tmp: Path, job: SaveJob) -> dict[str, tuple[FileRecord, ...]]:
    """Run each item's write phase into ``tmp/<item>/`` (created here); returns the records."""
    records = {}
    for name, (handler, snapshot) in job.snapshots.items():
        (tmp / name).mkdir()
        records[name] = _check_records(tmp / name, handler, tuple(snapshot.write(tmp / name)))
    return records


def _check_records(
    item_dir: Path, handler: Handler, records: tuple[FileRecord, ...]
) -> tuple[FileRecord, ...]:
    """A handler's records must name distinct files it really wrote, at the size it says.

    Returns them with a content hash each: a record without one (a handler that computes only a
    crc32c) gets the file's hash here, the one time cairn reads back a file it wrote.
    """
    seen = set()
    out = []
    for record in records:
        if not isinstance(record, FileRecord):
            raise TypeError(f"handler {handler.id!r} returned {record!r}, not a FileRecord")
        if record.path in seen:
            raise ValueError(f"handler {handler.id!r} returned {record.path!r} twice")
        seen.add(record.path)
        check_relative(record.path)
        path = item_dir / record.path
        if not path.is_file() or path.is_symlink():
            raise ValueError(
                f"handler {handler.id!r} returned {record.path!r}, which it did not write"
            )
        size = path.stat().st_size
        if size != record.size:
            raise ValueError(
                f"handler {handler.id!r} says {record.path!r} has {record.size} bytes, "
                f"the file has {size}"
            )
        if record.xxh3_128 is None:
            record = dataclasses.replace(record, xxh3_128=hash_file(path))
        out.append(record)
    return tuple(out)


def _load_syncfs() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None


_syncfs = _load_syncfs()


def fsync_tree(top: Path) -> None:
    """Make every file and directory under `top` durable.

    On Linux one ``syncfs(2)`` of the filesystem holding `top` does it (it also flushes other dirty
    data there); it costs one call instead of an fsync per file, which matters for the hundreds of
    chunk files of a train state. Elsewhere: fsync every file and directory, children first.
    """
    if _syncfs is not None:
        fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
        try:
            if _syncfs(fd) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"syncfs of {top} failed: {os.strerror(err)}")
        finally:
            os.close(fd)
        return
    for dirpath, _dirnames, filenames in os.walk(top, topdown=False, onerror=_raise):
        for filename in filenames:
            fd = os.open(os.path.join(dirpath, filename), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def _raise(error: OSError) -> None:
    raise error


def write_metrics(step_dir: Path, metrics: Mapping[str, float]) -> None:
    """Replace ``metrics.json`` of a committed step atomically (tmp file, fsync, rename)."""
    tmp = step_dir / f".{METRICS}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(dump_checked({"metrics": dict(metrics)}))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, step_dir / METRICS)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(step_dir)


def drop_item(step_dir: Path, manifest: Manifest, item: str) -> tuple[Manifest, Path | None]:
    """Per-item retention: remove one item from a committed step; returns the new manifest and
    the trash path for `remove_trash`.

    The manifest that marks the item dropped replaces the old one atomically first, so from then
    on no reader looks for the item's files; only then does the item's directory leave the step
    (renamed to trash beside the steps). A crash in between leaves an orphan directory, which
    `remove_dropped` clears at the next start.
    """
    entry = manifest.items[item]
    items = {**manifest.items, item: dataclasses.replace(entry, dropped=True, files=())}
    new = dataclasses.replace(manifest, items=items)
    tmp = step_dir / f".{MANIFEST}.tmp-{uuid.uuid4().hex}"
    try:
        with open(tmp, "xb") as f:
            f.write(new.to_bytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, step_dir / MANIFEST)  # the item is dropped from here on
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(step_dir)
    trash = step_dir.parent / trash_name(f"{step_dir.name}-{item}")
    try:
        os.rename(within(step_dir, item, what=f"step {manifest.step}"), trash)
    except FileNotFoundError:  # a damaged step whose item had no directory: dropped all the same
        log.warning("cairn: item %r of %s had no directory to drop", item, step_dir)
        return new, None
    fsync_dir(step_dir)
    fsync_dir(step_dir.parent)
    return new, trash


def remove_dropped(step_dir: Path, manifest: Manifest) -> None:
    """Remove directories of items the manifest marks dropped (left by a crash in `drop_item`).

    Names come from the manifest, so they go through `within` (a manifest is untrusted): only an
    entry of the step directory itself is removed, and a link there is unlinked, never followed.
    """
    for name, entry in manifest.items.items():
        if not entry.dropped:
            continue
        path = within(step_dir, name, what=f"manifest of {step_dir}")
        if path.is_symlink():
            log.info("cairn: removing link %s left as a dropped item", path)
            path.unlink()
        elif path.is_dir():
            log.info("cairn: removing dropped item %r left in %s", name, step_dir)
            shutil.rmtree(path)


def delete_step(root: Path, name: str) -> Path | None:
    """Retire a committed step: rename it to trash (atomic: from then on it is no step) and fsync.

    Returns the trash path for `remove_trash`, or None if the step was already gone. A crash before
    the trash is removed leaves a ``.trash-*`` directory, which the next start removes.
    """
    trash = root / trash_name(name)
    try:
        os.rename(root / name, trash)  # from here on the step is gone
    except FileNotFoundError:
        log.warning("cairn: step directory %s was already gone", root / name)
        return None
    fsync_dir(root)
    return trash


def remove_trash(trash: Path) -> None:
    """Free the space of a retired step (slow on some filesystems; never on the commit path)."""
    try:
        if trash.is_symlink():  # a step that was a link: remove the link, never its target
            trash.unlink()
        else:
            shutil.rmtree(trash)
    except OSError as e:
        log.warning("cairn: could not finish removing %s (the next start will): %s", trash, e)


def clean_leftovers(root: Path, names: StepNames) -> list[str]:
    """Remove temporary and trash entries a crashed writer left behind; returns their names."""
    removed = []
    for entry in os.scandir(root):
        if entry.name.startswith(TRASH_PREFIX) or names.is_temporary(entry.name):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
            removed.append(entry.name)
    for entry in os.scandir(root):  # half-written metrics.json or manifest replacements
        if entry.is_dir(follow_symlinks=False) and names.parse(entry.name) is not None:
            for inner in os.scandir(entry.path):
                if inner.name.startswith((f".{METRICS}.tmp-", f".{MANIFEST}.tmp-")):
                    os.unlink(inner.path)
                    removed.append(f"{entry.name}/{inner.name}")
    if removed:
        fsync_dir(root)
        log.info("cairn: removed %d leftover entries in %s: %s", len(removed), root, removed)
    return removed
