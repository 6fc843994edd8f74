"""A manager's local tier: each process saves its own part of a step (every distinct shard it
holds, the shared files, its iterator positions) into a directory only it sees, often, and the
persistent directory gets a step now and then. `restore()` takes, in one decision all processes
share, the newest step every process can get its part of, from its local tier or the persistent
one (docs/multitier.md).

The local directory of a process is an ordinary single-process cairn directory (its own lock,
commit thread, retention): `cairn list` and `cairn verify` read it as any other. Each of its
steps records its part (`PART`, in the step's metadata): which process of how many saved it,
the save it came from (one id on every process), and whether the same save went to the
persistent tier too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from cairn.handlers.errors import CorruptCheckpointError, StepNotFoundError
from cairn.handlers.io import share_snapshot
from cairn.manager._core import commit as _commit
from cairn.manager._core.coordination import Coordinator
from cairn.manager._core.multihost import alone
from cairn.manager._core.policies import (
    KeepLatest,
    KeepPolicy,
    LastSave,
    SaveContext,
    SavePolicy,
    checked_should_save,
    find_on_preemption,
    policy_kind,
    uses_time,
)
from cairn.manager._format import PART
from cairn.manager._storage.base import check_directory

__all__ = ["LocalTier"]

log = logging.getLogger("cairn")

_PLACEHOLDER = "{process}"
_KEEP_TWO = KeepLatest(2)


@dataclasses.dataclass(frozen=True)
class LocalTier:
    """Where and when each process saves its own part of a step, besides the persistent
    directory (``CheckpointManager(..., local=LocalTier(...))``).

    `directory`: a directory only this process sees (a local disk, a RAM disk), or any cairn
    directory URL; ``{process}`` in it is replaced by the process index (several processes on
    one host, or a test). `save`: the local tier's save policy (no `OnPreemption`: that save
    belongs to the persistent tier, which survives the host). `keep`: its retention, applied to
    each process's parts (the newest step is always kept). `replicas`: how many other processes
    also hold each process's part; 0 for now (a lost local directory is served by the
    persistent tier). `storage_options`: as the manager's, for the local directory."""

    directory: str | os.PathLike[str]
    _: dataclasses.KW_ONLY
    save: SavePolicy
    keep: KeepPolicy = _KEEP_TWO
    replicas: int = 0
    storage_options: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.directory, (str, os.PathLike)):
            raise TypeError(f"LocalTier directory must be a path or URL, got {self.directory!r}")
        check_directory(self.directory_of(0))
        if policy_kind(self.save) != "save":
            raise TypeError(
                f"LocalTier save= must be a save policy (EveryNSteps, ...), got {self.save!r}"
            )
        if find_on_preemption(self.save):
            raise ValueError(
                "LocalTier save= cannot hold OnPreemption: a preempted host may not come back "
                "with its local disk; put OnPreemption in the manager's save= (the persistent tier)"
            )
        if policy_kind(self.keep) != "keep":
            raise TypeError(
                f"LocalTier keep= must be a keep policy (KeepLatest, ...), got {self.keep!r}"
            )
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int):
            raise TypeError(f"LocalTier replicas= must be an int >= 0, got {self.replicas!r}")
        if self.replicas != 0:
            raise ValueError(
                f"LocalTier replicas={self.replicas}: peer replicas are not there yet; with "
                "replicas=0 a process whose local directory is lost gets its part from the "
                "persistent tier"
            )
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise TypeError(
                f"LocalTier storage_options= must be a mapping, got {self.storage_options!r}"
            )

    def directory_of(self, process: int) -> str:
        """The local directory of process `process` (``{process}`` replaced)."""
        return os.fspath(self.directory).replace(_PLACEHOLDER, str(process))


class Local:
    """A manager's local tier at run time: this process's local manager (single-process, on
    `alone` terms), the steps every process agreed it holds, and the shared decisions.

    Concurrency: called on the outer manager's caller thread, in the same order on every
    process (`wants`, `save`, `restore` make collective calls through the outer `Coordinator`);
    the local manager's commit thread writes and commits each part, then applies its
    retention, as any manager's does."""

    def __init__(self, tier: LocalTier, inner: Any, together: Coordinator) -> None:
        self.tier, self.inner, self._together = tier, inner, together
        self.procs = together.procs
        self._timeout = inner._options.barrier_timeout
        #: steps whose part every process held at the last agreement (open, restore)
        self.agreed: set[int] = set()
        self.handed: set[int] = set()  # steps save() gave the local tier since then
        self._last_save = LastSave()
        self._agree()

    @classmethod
    def open(
        cls,
        tier: LocalTier,
        together: Coordinator,
        make: Callable[..., Any],
        options: Any,
    ) -> Local:
        """Open this process's local directory with `make` (the manager class) and agree."""
        with alone():
            inner = make(
                tier.directory_of(together.procs.index),
                save=tier.save,
                keep=tier.keep,
                handlers=options.handlers,
                step_prefix=options.names.prefix,
                step_digits=options.names.digits,
                async_save=options.async_save,
                max_pending=options.max_pending,
                barrier_timeout=options.barrier_timeout,
                storage_options=tier.storage_options,
                zero_copy=True,  # it stages nothing: the persistent manager's snapshot feeds it
            )
        try:
            return cls(tier, inner, together)
        except BaseException:
            inner.close()
            raise

    # ------------------------------------------------------------------ what this process holds

    def parts(self) -> dict[int, dict[str, Any]]:
        """This process's intact-looking parts by step: those its manifest says this process
        of this many processes saved."""
        me, count = self.procs.index, self.procs.count
        found = {}
        for step, manifest in self.inner._catalog.manifests().items():
            part = manifest.metadata.get(PART)
            if (
                isinstance(part, dict)
                and part.get("process") == me
                and part.get("processes") == count
                and isinstance(part.get("save"), str)
            ):
                found[step] = part
        return found

    def _gather(self, what: str, mine: str) -> list[str]:
        """Every process's `mine`, in process order, on the primary ([] elsewhere)."""
        procs = self.procs
        if procs.count == 1:
            return [mine]
        key = self._together.collective(what)
        procs.report(key, mine)
        procs.barrier(key, self._timeout)
        got = procs.reports(key) if procs.primary else []
        procs.barrier(f"{key}/read", self._timeout)
        if procs.primary:
            procs.forget(key)
        return got

    def _share(self, what: str, value: Callable[[], Any]) -> Any:
        """The primary's `value()` (JSON) on every process."""
        procs = self.procs
        text = json.dumps(value()) if procs.primary else None
        if procs.count == 1:
            assert text is not None
            return json.loads(text)
        key = self._together.collective(what)
        return json.loads(procs.broadcast(key, text, self._timeout))

    def _agree(self) -> None:
        """The steps whose part every process holds, from the same save (a collective)."""
        mine = json.dumps({str(s): p["save"] for s, p in self.parts().items()})
        reports = [json.loads(r) for r in self._gather("local/parts", mine)]
        self.agreed = set(self._share("local/agreed", lambda: sorted(_complete(reports))))
        self.handed = set()
        newest = max(self.agreed, default=None)
        started = self.inner._catalog.get(newest) if newest is not None else None
        if started is not None and started.manifest is not None:
            self._last_save.read(started.manifest.step, started.manifest.started_at, warn=False)

    def steps(self) -> list[int]:
        """The local steps: agreed on, and those this process committed since, less what its
        retention deleted (the same on every process). A part found at the open that is not
        complete on every process is not one: every process must answer alike."""
        return sorted(set(self.parts()) & (self.agreed | self.handed))

    # ------------------------------------------------------------------ saving

    def wants(self, step: int, *, force: bool) -> bool:
        """Whether the local tier's policy wants `step` (`force`: yes), False at or below its
        newest step; the same answer on every process (a time policy: the primary's)."""
        known = self.agreed | self.handed
        if step in known or (known and step <= max(known)):
            return False
        if force:
            return True
        now = time.time()
        context = SaveContext(
            latest_step=max(known) if known else None,
            last_save_time=self._last_save.time(now),
            now=now,
        )
        policy = self.tier.save
        if not uses_time(policy):
            return checked_should_save(policy, step, context)
        return self._together.decide(
            "local/should_save", lambda: checked_should_save(policy, step, context)
        )

    def save(
        self,
        job: _commit.SaveJob,
        entered: float,
        *,
        persistent: bool,
    ) -> _commit.SaveJob:
        """Hand this process's part of `job`'s step to the local manager (its commit thread,
        or committed here when synchronous); the job it commits. With `persistent`, the same
        snapshots go to the persistent tier too, so each is written twice."""
        inner = self.inner
        if job.step in inner.all_steps():  # a part of a timeline the run left
            inner.delete(job.step)
        if persistent:
            for _, snapshot in job.snapshots.values():
                share_snapshot(snapshot, 2)
        part = {
            "process": self.procs.index,
            "processes": self.procs.count,
            "save": job.tmp_name or self._save_id(),
            "persistent": persistent,
        }
        local = dataclasses.replace(
            job,
            tmp_name=None,
            metadata={**job.metadata, PART: part},
            incremental=False,
            budget=None,
            settled=(settled := threading.Event()),
        )
        if job.settled is None or job.settled.is_set():  # committed here: settled already
            settled.set()
        self.handed.add(job.step)
        self._last_save.started(entered)
        inner._commits.take_slot(job.step)
        inner._catalog.start(job.step)
        if inner._commits.executor is None:
            inner._commits.run_save(local, reraise=True)
        else:
            inner._commits.hand_over(local, None, owner=inner)
        return local

    @staticmethod
    def settled(local: _commit.SaveJob, job: _commit.SaveJob) -> None:
        """save() is returning: the part's commit may record the time it blocked and go on."""
        local.blocked_s = job.blocked_s
        assert local.settled is not None
        local.settled.set()

    def _save_id(self) -> str:
        """An id for one save, the same on every process (a collective call's name)."""
        return hashlib.md5(self._together.collective("local/save").encode()).hexdigest()

    # ------------------------------------------------------------------ restoring

    def restore(
        self,
        reader: Any,
        persistent: Iterable[int],
        step: int | None,
        wanted: dict[str, Any] | None,
        fallback: bool,
    ) -> tuple[int, dict[str, Any]]:
        """Restore the newest step (or `step`) every process can get its part of: the plan is
        the primary's, from every process's parts and the persistent steps; each process
        reads its source; all vote, and a source that failed is struck out and the decision
        taken again. Local parts above the step restored are then deleted (they belong to a
        timeline the run left). Returns (step, items)."""
        self.inner.wait_until_finished()
        persistent = sorted(persistent)
        bad: set[tuple[int, int, str]] = set()  # (process, step, tier) that failed to read
        me = self.procs.index
        while True:
            mine = {str(s): p for s, p in self.parts().items() if (me, s, "local") not in bad}
            reports = [json.loads(r) for r in self._gather("local/restore", json.dumps(mine))]
            plan = self._share(
                "local/plan",
                lambda got=reports: _plan(got, persistent, step, bad, self.procs.count),  # type: ignore[misc]
            )
            if plan["step"] is None:
                raise StepNotFoundError(
                    f"step {step} is in neither tier for every process"
                    if step is not None
                    else "no step is held by every process in the local tier or persistently"
                )
            at, source = int(plan["step"]), plan["sources"][me]
            error: BaseException | None = None
            restored: dict[str, Any] = {}
            try:
                if source == "local":
                    restored = self.inner._reader.restore(at, wanted)
                else:
                    restored = reader.restore(at, wanted)
            except Exception as e:
                error = e
            outcome = "ok" if error is None else _outcome(error)
            votes = self._share_all("local/vote", outcome)
            if all(v == "ok" for v in votes):
                self._after_restore(at)
                return at, restored
            for p, vote in enumerate(votes):
                if vote == "corrupt":
                    bad.add((p, at, plan["sources"][p]))
                    log.warning(
                        "cairn: process %d could not read its part of step %d from the %s tier; "
                        "deciding again without it",
                        p,
                        at,
                        plan["sources"][p],
                    )
            if any(v not in ("ok", "corrupt") for v in votes) or not fallback or step is not None:
                if error is not None:
                    raise error
                failed = [p for p, v in enumerate(votes) if v != "ok"]
                raise CorruptCheckpointError(
                    f"the restore of step {at} failed on process(es) {failed}: {votes}"
                )

    def _share_all(self, what: str, mine: str) -> list[str]:
        """Every process's `mine`, on every process."""
        gathered = self._gather(what, mine)
        return list(self._share(f"{what}/all", lambda: gathered))

    def _after_restore(self, step: int) -> None:
        """Parts above the restored step go (another timeline), and the tiers agree again."""
        for newer in [s for s in self.inner.all_steps() if s > step]:
            try:
                self.inner.delete(newer)
            except Exception as e:  # a part that stays is outvoted by its save id later
                log.warning("cairn: could not delete local step %d: %r", newer, e)
        self._agree()

    def close(self) -> None:
        self.inner.close()


def _complete(reports: list[Mapping[str, Any]]) -> list[int]:
    """The steps every process reported a part of, from one save."""
    if not reports:
        return []
    steps = set(reports[0])
    for r in reports[1:]:
        steps &= set(r)
    return sorted(int(s) for s in steps if len({_save_of(r[s]) for r in reports}) == 1)


def _save_of(part: Any) -> Any:
    return part["save"] if isinstance(part, dict) else part


def _plan(
    reports: list[Mapping[str, Any]],
    persistent: list[int],
    step: int | None,
    bad: set[tuple[int, int, str]],
    count: int,
) -> dict[str, Any]:
    """The primary's decision: the newest step (or `step`) for which every process has a
    source. Its own part where every process holds one of that step from one save; otherwise,
    if the persistent tier holds the step, the persistent step, except for processes whose
    part came from the very save that wrote the persistent step."""
    held = {int(s) for r in reports for s in r}
    candidates = [step] if step is not None else sorted(held | set(persistent), reverse=True)
    for s in candidates:
        parts = [r.get(str(s)) for r in reports]
        saves = {p["save"] if p is not None else None for p in parts}
        if None not in saves and len(saves) == 1:
            return {"step": s, "sources": ["local"] * count}
        if s in persistent and not any((p, s, "persistent") in bad for p in range(count)):
            sources = [
                "local" if p is not None and p.get("persistent") else "persistent" for p in parts
            ]
            return {"step": s, "sources": sources}
    return {"step": None}


def _outcome(error: BaseException) -> str:
    """A process's vote after a failed read: its source is damaged ("corrupt"), or it failed
    otherwise (the others raise too)."""
    if isinstance(error, (CorruptCheckpointError, StepNotFoundError)):
        return "corrupt"
    return f"{type(error).__name__}: {error}"
