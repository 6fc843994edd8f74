"""Reading committed steps: restore, verify, describe and the step records a manager lists,
all under the manifests a writer's per-item retention may change while they are read."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from cairn.handlers import Handler, StoredItem, handler_by_id, writing_as
from cairn.handlers.errors import (
    CorruptCheckpointError,
    ItemNotFoundError,
    MismatchError,
    ReadOnlyError,
    StepNotFoundError,
    UnsupportedFormatError,
)
from cairn.handlers.io import MemorySource, as_parts, check_item, chunks_by_pack, parse_json
from cairn.manager._core.catalog import Catalog, StepRecord, read_record
from cairn.manager._core.multihost import Processes
from cairn.manager._core.telemetry import Telemetry
from cairn.manager._format import PART, ROOT_METADATA, Manifest, StepNames, check_metadata
from cairn.manager._storage.base import Listed, Storage

log = logging.getLogger("cairn")
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
    #: the tier that holds it: "persistent", or "local" (this process's part, ``local=``)
    tier: str = "persistent"

    @property
    def bytes(self) -> int:
        return sum(i.bytes for i in self.items.values())


class Reader:
    """A manager's reads of its directory's committed steps.

    Concurrency: called from the manager's caller thread, and (`scan`, `read_steps`,
    `read_again`) from its commit thread; the `Catalog` it updates is locked. A read may race
    with a writer's retention in another process: every read is checked against the step's
    manifest read again afterwards (`reread_manifest`), and starts over if an item it read was
    dropped meanwhile. `failed(step)` says whether this process's commit of a step failed (for
    messages)."""

    def __init__(
        self,
        storage: Storage,
        names: StepNames,
        catalog: Catalog,
        handlers: Mapping[str, Handler],
        me: Processes,
        failed: Callable[[int], bool],
    ) -> None:
        self._storage, self._names, self._catalog = storage, names, catalog
        self.catalog = catalog  # the steps it reads, which it updates
        self._handlers, self._me, self._failed = handlers, me, failed
        self.telemetry: Telemetry | None = None  # restores are recorded there once it is set
        self._where = storage.url

    # ------------------------------------------------------------------ listing

    def scan(self, listed: list[Listed] | None = None) -> dict[int, StepRecord]:
        """Every committed step, with its manifest or the reason it cannot be read (from
        `listed`, the storage's listing just read, if given)."""
        if listed is None:
            listed = self._storage.scan(self._names)
        return {one.step: read_record(one) for one in listed}

    def read_steps(self, steps: Iterable[int]) -> dict[int, StepRecord]:
        """Steps another process listed, each read again (16 at a time; one may be gone)."""

        def read(step: int) -> Listed | None:
            return self._storage.read_step(self._names, step)

        steps = list(steps)
        if len(steps) < 2:
            found = [read(step) for step in steps]
        else:
            with concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="cairn-read") as pool:
                found = list(pool.map(read, steps))
        return {listed.step: read_record(listed) for listed in found if listed is not None}

    def read_again(self, step: int) -> StepRecord | None:
        """A step's record read from the storage now; None (and forgotten) if it is gone."""
        listed = self._storage.read_step(self._names, step)
        if listed is None:
            self._catalog.remove(step)
            return None
        return read_record(listed)

    def adopt_if_committed(self, step: int) -> None:
        """After a failed commit, list the step if it is committed anyway (the commit point
        passed, a later sync failed), so all_steps() stays true."""
        try:
            listed = self._storage.read_step(self._names, step)
            if listed is not None:
                self._catalog.committed(step, read_record(listed))
        except Exception as e:  # never hide the commit's own error behind this one
            log.error("cairn: could not read back step %d after its failed commit: %r", step, e)

    def record(self, step: int) -> tuple[StepRecord, Manifest]:
        """The step's record and manifest, read once; raises the step's own error if unreadable."""
        rec = self._catalog.get(step)
        if rec is None:
            raise StepNotFoundError(self.missing(step))
        if rec.manifest is None:
            assert rec.error is not None
            raise type(rec.error)(str(rec.error))
        return rec, rec.manifest

    def manifest(self, step: int) -> Manifest:
        return self.record(step)[1]

    def missing(self, step: int) -> str:
        steps = self._catalog.steps()
        shown = steps if len(steps) <= 10 else [*steps[:3], "...", *steps[-5:]]
        note = (
            "; its background commit failed (see check_for_errors())" if self._failed(step) else ""
        )
        return f"step {step} is not committed in {self._where} (committed: {shown}){note}"

    def info(self, step: int) -> StepInfo:
        _, manifest = self.record(step)
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
            metrics=self._catalog.metrics(step),
            metadata=manifest.metadata,
            telemetry={**manifest.telemetry, **self._catalog.telemetry(step)},
            best=manifest.best,
        )

    # ------------------------------------------------------------------ restoring

    def restore_newest(self, wanted: dict[str, Any] | None, fallback: bool) -> dict[str, Any]:
        """The newest intact step (older ones if `fallback`, a damaged one is skipped with a
        warning); a step deleted meanwhile is skipped too."""
        candidates = self._catalog.steps()[::-1]
        if not candidates:
            raise StepNotFoundError(f"no committed step in {self._where}")
        newest_error: CorruptCheckpointError | None = None
        for s in candidates:
            try:
                return self.restore(s, wanted)
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

    def restore(self, step: int, wanted: dict[str, Any] | None) -> dict[str, Any]:
        t0 = time.monotonic()
        restored = self._read_items(step, wanted)
        self._restored(step, time.monotonic() - t0)
        return restored

    def restore_part(
        self,
        manifest: Manifest,
        files: Mapping[str, Mapping[str, memoryview]],
        wanted: dict[str, Any] | None,
        hashed: Mapping[str, frozenset[str]] | None = None,
    ) -> dict[str, Any]:
        """The wanted items (None: all) of a step not in the directory: a local tier's part
        received from another process, `files` by item and path, read from memory (`hashed`:
        by item, the files whose whole content was checked against their records already)."""
        t0, step = time.monotonic(), manifest.step
        items = wanted if wanted is not None else {n: None for n in files}
        where = f"{self._where} (step {step}, received)"

        def stored(name: str) -> StoredItem:
            records = {f.path: f for f in manifest.items[name].files}
            source = MemorySource(files.get(name, {}), where, (hashed or {}).get(name, ()))
            return StoredItem(source, records, step, name)

        restored = self._read_once(step, manifest, items, stored)
        self._restored(step, time.monotonic() - t0)
        return restored

    def _restored(self, step: int, seconds: float) -> None:
        self._catalog.restored(step, seconds)
        log.info("cairn: restored step %d in %.1f ms", step, seconds * 1e3)
        if self.telemetry is not None:
            with contextlib.suppress(Exception):
                self.telemetry.restored(step, seconds)

    def _read_items(self, step: int, wanted: dict[str, Any] | None) -> dict[str, Any]:
        """The wanted items of a step (None: every item it has), read with the manifest this
        manager holds, which a writer's retention may have changed since: after the reads, and
        after a read that fails, the manifest is read again. A step gone is StepNotFoundError; if
        an item read was dropped meanwhile, the reads start over with the new manifest (a named
        item is then ItemNotFoundError); only damage under an unchanged manifest is damage."""
        for _ in range(_REREADS):
            manifest = self.manifest(step)
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

    def _read_once(
        self,
        step: int,
        manifest: Manifest,
        wanted: dict[str, Any],
        stored: Callable[[str], StoredItem] | None = None,
    ) -> dict[str, Any]:
        """The wanted items of `manifest`'s step, each read by its handler from `stored(name)`
        (the directory's files by default)."""
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
            item = stored(name) if stored is not None else self._stored(step, name, manifest)
            item.check_files()  # a missing or truncated file fails before any parsing
            try:
                with (
                    writing_as(self._me.index, self._me.count),  # per-process data: this one's
                    as_parts(PART in manifest.metadata),  # a local tier's part: this process's
                ):
                    restored[name] = handler.restore(item, target)
            except FileNotFoundError as e:  # a file vanished after check_files
                raise CorruptCheckpointError(
                    f"step {step}, item {name!r}: {e.filename or e} is missing"
                ) from None
            finally:
                item.source.release()  # a foreign item's download, on an object store
        return restored

    def _stored(self, step: int, name: str, manifest: Manifest) -> StoredItem:
        """Item `name` of a step, as its handler reads it: its files, from the storage."""
        files = {f.path: f for f in manifest.items[name].files}
        stepname = self._names.format(step)
        if self._catalog.is_foreign(step):  # read in place (a download on object stores)
            return StoredItem(self._storage.foreign_source(stepname, name), files, step, name)
        return StoredItem(self._storage.source(stepname, name), files, step, name)

    def _reread_manifest(self, step: int, used: Manifest, items: Iterable[str]) -> bool:
        """Read a step's manifest from disk again after reading `items` with `used`: True if
        one of them changed meanwhile (the writer's per-item retention dropped it), the step's
        record then holding the new manifest; StepNotFoundError if the step was deleted."""
        fresh = self.read_again(step)
        if fresh is None:
            raise StepNotFoundError(f"step {step} was deleted from {self._where} while being read")
        if fresh.manifest is not None and all(
            fresh.manifest.items.get(n) == used.items.get(n) for n in items
        ):
            return False
        # Its late metrics stay: they are another file.
        self._catalog.update(step, manifest=fresh.manifest, error=fresh.error)
        return True

    # ------------------------------------------------------------------ checking

    def verify(
        self,
        step: int,
        progress: Callable[[int], None] | None,
        checked: dict[tuple[int, ...], str] | None,
    ) -> list[str]:
        """`CheckpointManager.verify` of a known step."""
        for _ in range(_REREADS):
            if self._catalog.get(step) is None:
                raise StepNotFoundError(self.missing(step))
            rec = self.read_again(step)  # as it is now, metrics.json included
            if rec is None:
                raise StepNotFoundError(f"step {step} was deleted from {self._where}")
            self._catalog.update(step, manifest=rec.manifest, error=rec.error)
            if rec.manifest is None:
                return [str(rec.error)]
            manifest = rec.manifest
            live = [n for n, e in manifest.items.items() if not e.dropped]
            problems: list[str] = []
            for name in live:
                self._check_files(step, name, manifest, problems, progress, checked)
            if rec.metrics_error is not None:
                problems.append(f"step {step}: {rec.metrics_error}")
            if not (self._reread_manifest(step, manifest, live) and problems):
                return problems
        raise CorruptCheckpointError(
            f"step {step} in {self._where} changed {_REREADS} times while being verified"
        )

    def _check_files(
        self,
        step: int,
        name: str,
        manifest: Manifest,
        problems: list[str],
        progress: Callable[[int], None] | None,
        checked: dict[tuple[int, ...], str] | None,
    ) -> None:
        """An item's files read and checked, then (if they hold) its handler's ``check``; what
        is wrong is added to `problems`."""
        stored = self._stored(step, name, manifest)
        try:  # a packed item: each pack's chunks are checked on the same read
            chunks = chunks_by_pack(stored)
        except CorruptCheckpointError as e:
            problems.append(str(e))  # an index whose own file is damaged: said once
            chunks = {}
        known = len(problems)
        for record in manifest.items[name].files:
            try:
                problems += stored.check_file(record.path, checked, chunks.get(record.path, ()))
            except CorruptCheckpointError as e:
                if str(e) not in problems:
                    problems.append(str(e))
            except OSError as e:
                problems.append(f"{stored.describe_file(record.path)} cannot be read: {e}")
            if progress is not None:
                progress(record.size)
        if len(problems) == known:  # the files hold: what a restore checks before reading
            with as_parts(PART in manifest.metadata):
                problems += self._check_item(name, manifest.items[name].handler, stored)

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

    def describe(self, step: int) -> dict[str, dict[str, Any]]:
        manifest = self.manifest(step)
        out: dict[str, dict[str, Any]] = {}
        for name, entry in manifest.items.items():
            if entry.dropped:
                out[name] = {"kind": "dropped", "handler": entry.handler}
                continue
            handler = self._handlers.get(name) or handler_by_id(entry.handler)
            stored = self._stored(step, name, manifest)
            out[name] = {"handler": entry.handler, **handler.describe(stored)}
        return out

    # ------------------------------------------------------------------ the directory

    def root_metadata(self, given: dict[str, Any] | None) -> dict[str, Any]:
        """The directory's metadata file, or `given` (``metadata=``) where it has none."""
        where = f"{self._where}/{ROOT_METADATA}"
        data = self._storage.read_root_file(ROOT_METADATA)
        if data is None:
            return dict(given or {})
        found = parse_json(data, where)
        try:
            if not isinstance(found, dict) or set(found) != {"custom_metadata"}:
                raise TypeError('not {"custom_metadata": {...}}')
            return check_metadata(found["custom_metadata"])
        except (TypeError, RecursionError) as e:
            raise CorruptCheckpointError(f"{where}: {e}") from None

    def save_root_metadata(self, given: dict[str, Any]) -> None:
        """Write the directory's metadata unless it has some (then keep it, as Orbax does)."""
        body = json.dumps({"custom_metadata": given}, allow_nan=False, sort_keys=True).encode()
        if self._storage.create_root_file(ROOT_METADATA, body):
            return
        try:
            kept = self.root_metadata(given) == given
        except CorruptCheckpointError as e:  # a damaged file does not stop the run; metadata() says
            log.warning("cairn: %s; metadata= given now is not saved", e)
            return
        if not kept:
            log.warning(
                "cairn: %s already has metadata (%s); metadata= given now is not saved",
                self._where,
                ROOT_METADATA,
            )

    def refuse_foreign(self, step: int) -> None:
        """Orbax's steps are read in place, never changed."""
        if self._catalog.is_foreign(step):
            raise ReadOnlyError(
                f"step {step} was written by orbax-checkpoint; cairn does not change it"
            )


def naming_refusal(storage: Storage, names: StepNames) -> str | None:
    """Why the directory is refused, if it holds steps (cairn's, or orbax-checkpoint's)
    under a naming other than ours and none under ours: a trainer would otherwise start
    from scratch beside them. Looked for before anything is written (on object stores, by
    the primary after its listing found no step: the lease it took is released)."""
    found = storage.other_naming(names)
    if found is None:
        return None
    other, who = found
    option = f"step_prefix={other.prefix!r}" + (
        f", step_digits={other.digits}" if other.digits is not None else ""
    )
    ours = f"step_prefix={names.prefix!r}" + (
        f", step_digits={names.digits}" if names.digits is not None else ""
    )
    then = (
        "read them in place (read-only) and save new steps beside them"
        if who == "orbax-checkpoint"
        else "read them and save the next ones under the same names"
    )
    return (
        f"{storage.url} holds steps written by {who} named like {other.format(0)!r}, and "
        f"none named as {ours} expects ({names.format(0)!r}); open it with "
        f"CheckpointManager(..., {option}) to {then}"
    )
