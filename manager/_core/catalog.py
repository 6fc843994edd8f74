"""The steps a manager knows: each committed step's manifest (or why it is unreadable), its late
metrics, the saves in flight, and the telemetry of what this manager committed and restored."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable, Mapping

from cairn.handlers.errors import CorruptCheckpointError, UnsupportedFormatError
from cairn.manager._core.policies import KeepPolicy, StepView, steps_to_delete
from cairn.manager._format import MANIFEST, METRICS, Manifest, check_metrics, load_checked
from cairn.manager._storage.base import Listed

log = logging.getLogger("cairn")


@dataclasses.dataclass
class StepRecord:
    """A committed step as the manager knows it: its manifest, or why it is unreadable."""

    manifest: Manifest | None
    error: Exception | None = None
    late_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    foreign: bool = False  # written by another checkpointer (orbax-checkpoint): read-only
    metrics_error: Exception | None = None  # metrics.json is there but cannot be read

    @property
    def metrics(self) -> dict[str, float]:
        base = dict(self.manifest.metrics) if self.manifest else {}
        return {**base, **self.late_metrics}


def read_record(listed: Listed) -> StepRecord:
    """Parse what a storage listed: the manifest checked field by field and against the step
    number, ``metrics.json`` checked too (an unreadable one is ignored with a warning: the
    manifest's metrics stand, and `verify` reports it)."""
    if listed.foreign is not None:
        return StepRecord(listed.foreign, foreign=True)
    if listed.manifest is None:
        error = listed.error or CorruptCheckpointError(f"step {listed.step} has no manifest")
        return StepRecord(None, error)
    where = f"manifest {listed.where}/{MANIFEST} of step {listed.step}"
    try:
        manifest = Manifest.from_bytes(listed.manifest, where)
    except (CorruptCheckpointError, UnsupportedFormatError) as e:
        return StepRecord(None, e)
    if manifest.step != listed.step:
        return StepRecord(None, CorruptCheckpointError(f"{where} says step {manifest.step}"))
    late: dict[str, float] = {}
    problem = listed.metrics_error
    if listed.metrics is not None:
        try:
            body = load_checked(listed.metrics, f"{listed.where}/{METRICS}")
            late = check_metrics(body["metrics"])
        except (CorruptCheckpointError, KeyError, TypeError) as e:
            problem = CorruptCheckpointError(f"{listed.where}/{METRICS}: {e}")
    if problem is not None:
        log.warning("cairn: ignoring unreadable metrics (the manifest's stand): %s", problem)
    return StepRecord(manifest, late_metrics=late, metrics_error=problem)


class Catalog:
    """Committed steps by number, saves in flight, and per-step telemetry of this manager.

    Threads: the caller thread reads and the commit thread changes it; every method takes the
    one lock, and records handed out are changed only under it (`update`).

    With `journal` (the primary of several processes) it also notes which steps changed, so the
    other processes can read just those again (`changes`).
    """

    def __init__(self, *, journal: bool = False) -> None:
        self._lock = threading.Lock()
        self._journal: dict[int, bool] | None = {} if journal else None  # step: still there
        self._steps: dict[int, StepRecord] = {}
        self._inflight: set[int] = set()
        self._commit_telemetry: dict[int, dict[str, float]] = {}
        self._restore_s: dict[int, float] = {}

    def replace(self, records: dict[int, StepRecord]) -> None:
        with self._lock:
            self._steps = records

    def get(self, step: int) -> StepRecord | None:
        with self._lock:
            return self._steps.get(step)

    def steps(self) -> list[int]:
        with self._lock:
            return sorted(self._steps)

    def known(self) -> set[int]:
        """Committed and in-flight steps."""
        with self._lock:
            return set(self._steps) | self._inflight

    def state(self, step: int) -> str | None:
        """ "committed", "being committed", or None."""
        with self._lock:
            if step in self._steps:
                return "committed"
            return "being committed" if step in self._inflight else None

    def is_foreign(self, step: int) -> bool:
        with self._lock:
            rec = self._steps.get(step)
            return rec is not None and rec.foreign

    def start(self, step: int) -> None:
        with self._lock:
            self._inflight.add(step)

    def any_in_flight(self) -> bool:
        with self._lock:
            return bool(self._inflight)

    def in_flight(self, step: int) -> bool:
        with self._lock:
            return step in self._inflight

    def committed(
        self, step: int, record: StepRecord | None, telemetry: dict[str, float] | None = None
    ) -> None:
        """A save of `step` finished: its record (None if it failed) replaces what was known."""
        with self._lock:
            self._inflight.discard(step)
            if record is not None:
                self._steps[step] = record
                self._note(step, True)
            if telemetry is not None:
                self._commit_telemetry[step] = telemetry

    def remove(self, step: int) -> None:
        with self._lock:
            self._steps.pop(step, None)
            self._commit_telemetry.pop(step, None)
            self._note(step, False)

    def _note(self, step: int, present: bool) -> None:
        if self._journal is not None:
            self._journal[step] = present

    def changes(self) -> tuple[list[int], list[int]]:
        """(steps changed or added, steps removed) since the last call; needs `journal`."""
        with self._lock:
            assert self._journal is not None, "this catalog keeps no journal"
            changed = sorted(s for s, present in self._journal.items() if present)
            gone = sorted(s for s, present in self._journal.items() if not present)
            self._journal.clear()
            return changed, gone

    def update(
        self,
        step: int,
        *,
        manifest: Manifest | None = None,
        error: Exception | None = None,
        late_metrics: dict[str, float] | None = None,
    ) -> None:
        """Change a known step's record (a new manifest after an item drop, late metrics)."""
        with self._lock:
            rec = self._steps.get(step)
            if rec is None:
                return
            if manifest is not None or error is not None:
                rec.manifest, rec.error = manifest, error
            if late_metrics is not None:
                rec.late_metrics = late_metrics
            self._note(step, True)

    def metrics(self, step: int) -> dict[str, float]:
        with self._lock:
            rec = self._steps.get(step)
            return rec.metrics if rec is not None else {}

    def views(self, item: str | None = None) -> list[StepView]:
        """What keep policies see: intact steps cairn wrote (with `item` live, if given)."""
        with self._lock:
            return [
                StepView(s, rec.manifest.started_at, rec.metrics)
                for s, rec in self._steps.items()
                if rec.manifest is not None
                and not rec.foreign  # other checkpointers' steps are never touched
                and (
                    item is None
                    or (item in rec.manifest.items and not rec.manifest.items[item].dropped)
                )
            ]

    def manifests(self, steps: Iterable[int] | None = None) -> dict[int, Manifest]:
        with self._lock:
            wanted = self._steps if steps is None else steps
            return {
                s: rec.manifest
                for s in wanted
                if (rec := self._steps.get(s)) is not None and rec.manifest is not None
            }

    def newest_intact(self) -> StepRecord | None:
        with self._lock:
            for step in sorted(self._steps, reverse=True):
                if self._steps[step].manifest is not None:
                    return self._steps[step]
        return None

    def scored(self, metric: str) -> list[tuple[int, float]]:
        """(step, value) of intact steps that have `metric` (not NaN)."""
        with self._lock:
            return [
                (s, rec.metrics[metric])
                for s, rec in self._steps.items()
                if rec.manifest is not None
                and metric in rec.metrics
                and rec.metrics[metric] == rec.metrics[metric]
            ]

    def restored(self, step: int, seconds: float) -> None:
        with self._lock:
            self._restore_s[step] = seconds

    def telemetry(self, step: int) -> dict[str, float]:
        """This manager's figures for `step`: commit_s and bytes_per_s, restore_s."""
        with self._lock:
            out = dict(self._commit_telemetry.get(step, {}))
            if step in self._restore_s:
                out["restore_s"] = self._restore_s[step]
            return out


def apply_retention(
    catalog: Catalog,
    keep: KeepPolicy,
    keep_items: Mapping[str, KeepPolicy],
    delete: Callable[[int], None],
    drop: Callable[[int, str], None],
) -> None:
    """Delete the committed steps `keep` does not keep, then drop the items the per-item
    policies do not keep (`delete` and `drop` change the storage and `catalog`). One step
    that cannot be changed does not stop the others; OSError naming them all at the end."""
    failures = []
    for step in steps_to_delete(catalog.views(), keep):
        log.info("cairn: retention deletes step %d", step)
        try:
            delete(step)
        except OSError as e:
            failures.append((step, e))
    for item, policy in keep_items.items():
        for step in steps_to_delete(catalog.views(item), policy):
            log.info("cairn: retention drops item %r of step %d", item, step)
            try:
                drop(step, item)
            except OSError as e:
                failures.append((step, e))
    if failures:
        step, first = failures[0]
        raise OSError(
            f"retention could not delete steps {[s for s, _ in failures]}: step {step}: {first}"
        ) from first
