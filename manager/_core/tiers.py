"""A manager's local tier: each process saves its own part of a step (every distinct shard it
holds, the shared files, its iterator positions) into a directory only it sees, often, and the
persistent directory gets a step now and then. `restore()` takes, in one decision all processes
share, the newest step every process can get its part of, from its local tier or the persistent
one (docs/multitier.md).

The local directory of a process is an ordinary single-process cairn directory (its own lock,
commit thread, retention): `cairn list` and `cairn verify` read it as any other. Each of its
steps records its part (`PART`, in the step's metadata): which process of how many saved it,
the save it came from (one id on every process), whether the same save went to the persistent
tier too, and which process committed this copy (`holder`: the owner itself, or a process
holding a replica), so that `cairn ls` tells own parts from replicas.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from cairn.handlers.errors import CorruptCheckpointError, PartMismatchError, StepNotFoundError
from cairn.handlers.io import share_snapshot
from cairn.manager._core import commit as _commit
from cairn.manager._core import decide, replicas
from cairn.manager._core.coordination import Coordinator
from cairn.manager._core.multihost import alone
from cairn.manager._core.policies import (
    KeepLatest,
    KeepPolicy,
    LastSave,
    SavePolicy,
    find_on_preemption,
    policy_kind,
    policy_wants,
)
from cairn.manager._core.post import FilePiece, Piece, Post
from cairn.manager._core.replicas import Ring
from cairn.manager._format import PART, Manifest
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
    each process's parts and to the replicas it holds (the newest step is always kept).
    `replicas`: how many other processes also hold each process's part, sent to them in the
    background after each local save (`post.Post`); with 0, a process whose local directory
    is lost gets its part from the persistent tier. Holders are chosen in other failure domains than the owner where the
    processes tell any apart: `failure_domain` (this process's rack, zone, ...; give it on every
    process or on none), then the TPU slice, then the host (`replicas.Ring`).
    `storage_options`: as the manager's, for the local directory.

    Layout: process p keeps its own parts in ``<directory>/process_<p>`` and the replicas it
    holds of process q's in ``<directory>/process_<q>``, each an ordinary cairn directory."""

    directory: str | os.PathLike[str]
    _: dataclasses.KW_ONLY
    save: SavePolicy
    keep: KeepPolicy = _KEEP_TWO
    replicas: int = 0
    failure_domain: str | None = None
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
        if self.replicas < 0:
            raise ValueError(f"LocalTier replicas= must be >= 0, got {self.replicas}")
        if self.failure_domain is not None and not (
            isinstance(self.failure_domain, str) and self.failure_domain.strip()
        ):
            raise TypeError(
                "LocalTier failure_domain= must be a non-empty string (this process's rack, "
                f"zone, ...) or None, got {self.failure_domain!r}"
            )
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise TypeError(
                f"LocalTier storage_options= must be a mapping, got {self.storage_options!r}"
            )

    def directory_of(self, process: int) -> str:
        """The local directory of process `process` (``{process}`` replaced)."""
        return os.fspath(self.directory).replace(_PLACEHOLDER, str(process))

    def parts_directory(self, process: int, owner: int) -> str:
        """Where process `process` keeps the parts of process `owner` (its own, or replicas)."""
        return f"{self.directory_of(process).rstrip('/')}/process_{owner}"


class Local:
    """A manager's local tier at run time: this process's managers of parts (its own, and the
    replicas it holds of others', each single-process on `alone` terms), the steps every
    process can get its part of (`agreed`), and the shared decisions.

    Concurrency: called on the outer manager's caller thread, in the same order on every
    process (`wants`, `save`, `finish`, `restore` make collective calls through the outer
    `Coordinator`); each manager's commit thread writes and commits its parts, then applies
    its retention. With replicas, `Post`'s sender thread opens this process's committed parts
    (`_own_payload`, on the commit thread right after the commit) and sends them, and the
    replicas a restore's plan reads (`_send_back`: at the open, for the plan it foresees
    (`_early`), else in the restore); its receiving threads commit the parts
    received (`deliver`) into the managers of other processes' parts, which the caller thread
    only drains until a restore has met every process after its sends were answered
    (`_settle`), and keep a part sent back until the caller thread takes it (`_fetched`)."""

    def __init__(
        self,
        tier: LocalTier,
        managers: dict[int, Any],
        together: Coordinator,
        ring: Ring,
        post: Post | None = None,
    ) -> None:
        self.tier, self._together, self.ring, self._post = tier, together, ring, post
        self._newest: int | None = None  # the newest step save() gave the local tier
        self.procs = together.procs
        self.managers = managers  # by owner: this process's own first
        self.inner = managers[self.procs.index]
        self._timeout = self.inner._options.barrier_timeout
        #: steps every process could get its part of at the last agreement (open, restore)
        self.agreed: set[int] = set()
        self.handed: set[int] = set()  # steps save() gave the local tier since then
        self._unowned: set[int] = set()  # agreed steps this process held no own part of
        self.replicas = _replicas(tier, self.procs.count)
        self._last_save = LastSave()
        #: [step, sources] of the restore the open foresaw, whose parts were sent back then
        self._early: list[Any] | None = None
        self._agree(early=post is not None)

    @classmethod
    def open(
        cls, tier: LocalTier, together: Coordinator, make: Callable[..., Any], options: Any
    ) -> Local:
        """Open this process's directories of parts with `make` (the manager class), agree."""
        me, count = together.procs.index, together.procs.count
        replicas = min(tier.replicas, count - 1)
        # buffers kept: one to send from, one for each owner's part received at once
        post = Post(options.barrier_timeout, me, spare=replicas + 1) if replicas > 0 else None
        managers: dict[int, Any] = {}
        try:
            ring = _ring(tier, together, options.barrier_timeout, post)
            # the owners whose parts this process holds: it is their k-th holder
            owners = [me] + [ring.owner(me, k) for k in range(1, replicas + 1)]
            with alone():
                for owner in owners:
                    managers[owner] = make(
                        tier.parts_directory(me, owner),
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
                    # its commits and restores under the local tier's names, not Orbax's
                    managers[owner]._telemetry.local_tier(options.tensorboard_dir, own=owner == me)
                    managers[owner]._storage.reuse_pages()  # on a RAM disk: no pages freed
            local = cls(tier, managers, together, ring, post)
            if post is not None:
                post.open(local.deliver)  # (a part that came in meanwhile waited for this)
                if local._early is not None:  # on their way while the persistent tier opens
                    local._send_back(*local._early)
            return local
        except BaseException:
            if post is not None:
                post.close()
            for manager in managers.values():
                _close_quietly(manager)
            raise

    # ------------------------------------------------------------------ what this process holds

    def parts_of(self, owner: int) -> dict[int, dict[str, Any]]:
        """The intact-looking parts of `owner` this process holds, by step: those whose record
        says `owner` of this many processes saved them."""
        found = {}
        for step, manifest in self.managers[owner]._catalog.manifests().items():
            part = manifest.metadata.get(PART)
            if (
                isinstance(part, dict)
                and part.get("process") == owner
                and part.get("processes") == self.procs.count
                and isinstance(part.get("save"), str)
            ):
                found[step] = part
        return found

    def _listing(self) -> str:
        """This process's report (`decide`): every part it holds, by owner."""
        return json.dumps(
            {str(q): {str(s): p for s, p in self.parts_of(q).items()} for q in self.managers}
        )

    def _gather(self, what: str, mine: str) -> list[str]:
        """Every process's `mine`, in process order, on the primary ([] elsewhere)."""
        return _gather(self._together, what, mine, self._timeout, everyone=False)

    def _share(self, what: str, value: Callable[[], Any]) -> Any:
        """The primary's `value()` (JSON) on every process."""
        procs = self.procs
        text = json.dumps(value()) if procs.primary else None
        if procs.count == 1:
            assert text is not None
            return json.loads(text)
        key = self._together.collective(what)
        return json.loads(procs.broadcast(key, text, self._timeout))

    def _share_all(self, what: str, mine: str) -> list[str]:
        """Every process's `mine`, on every process."""
        return _gather(self._together, what, mine, self._timeout, everyone=True)

    def _agree(self, *, early: bool = False) -> None:
        """The steps every process can get its part of from the local tier (a collective).
        `early` (at the open, with replicas): also the restore plan of the newest of them, as
        if the persistent tier held no newer step (`_early`, where some part comes from a
        peer): its holders send those parts back at once, and a restore that plans the same
        sends none again. A process whose directory was lost then has its part on the way while
        the persistent tier opens, or the job builds its model, before it calls restore()."""
        reports = [json.loads(r) for r in self._gather("local/parts", self._listing())]
        count = self.procs.count

        def decided() -> dict[str, Any]:
            plan = decide.plan(reports, [], None, set(), count) if early else {"step": None}
            return {"agreed": decide.complete(reports, count), "early": plan}

        shared = self._share("local/agreed", decided)
        self.agreed = set(shared["agreed"])
        plan = shared["early"]
        if plan["step"] is not None and any(isinstance(s, list) for s in plan["sources"]):
            self._early = [plan["step"], plan["sources"]]
        self.handed = set()
        self._unowned = self.agreed - set(self.parts_of(self.procs.index))
        newest = max(self.agreed, default=None)
        started = self.inner._catalog.get(newest) if newest is not None else None
        if started is not None and started.manifest is not None:
            self._last_save.read(started.manifest.step, started.manifest.started_at, warn=False)

    def steps(self) -> list[int]:
        """The local steps: agreed on, and those saved since, less what retention deleted.
        At the open and after a restore the same on every process (so is latest_step());
        after saves, this process's view of its own parts."""
        own = set(self.parts_of(self.procs.index))
        steps = (own | self._unowned) & (self.agreed | self.handed)
        return sorted(s for s in steps if not own or s >= min(own))  # retention ran alike

    # ------------------------------------------------------------------ saving

    def wants(self, step: int, *, force: bool) -> bool:
        """Whether the local tier's policy wants `step` (`force`: yes), False at or below its
        newest step; the same answer on every process (a time policy: the primary's)."""
        known = self.agreed | self.handed
        if force:
            return not (step in known or (known and step <= max(known)))
        decide = self._together.decide
        return policy_wants(
            self.tier.save, step, known, self._last_save, decide, "local/should_save"
        )

    def save(self, job: _commit.SaveJob, entered: float, *, persistent: bool) -> _commit.SaveJob:
        """Hand this process's part of `job`'s step to its manager (its commit thread, or
        committed here when synchronous); the job it commits. With `persistent`, the same
        snapshots go to the persistent tier too, so each is written twice (with
        writer="process", there by the writer process from its copy: the release after its
        answer counts as that write). A part is written whole, never incrementally."""
        if persistent:
            for _, snapshot in job.snapshots.values():
                share_snapshot(snapshot, 2)
        if self._early is not None:  # no restore took the parts sent back at the open
            self._early = None
            self._settle(back=True)
            assert self._post is not None
            self._post.forget_back()
        part = {
            "process": self.procs.index,
            "processes": self.procs.count,
            "save": job.tmp_name or self._save_id(),
            "persistent": persistent,
            "holder": self.procs.index,
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
        _commit_part(self.inner, local, now=False)
        return local

    def finish(self, local: _commit.SaveJob, job: _commit.SaveJob) -> None:
        """save() is returning: the part's commit may record the time save() blocked and go
        on; then, with replicas, this process's part, once committed, goes to its holders in
        the background (`Post`; with a synchronous manager, before save() returns), after the
        parts of the local step before it are held: this process's by its holders, and those
        of the processes it holds for, here."""
        local.blocked_s = job.blocked_s
        assert local.settled is not None
        local.settled.set()
        previous, self._newest = self._newest, local.step
        if self._post is not None:
            self._await_parts(previous)  # so a save returns with the step before it replicated
            me, step = self.procs.index, local.step
            holders = [self.ring.holder(me, k) for k in range(1, self.replicas + 1)]
            executor = self.inner._commits.executor
            if executor is None:  # committed already, here
                self._post.send(me, step, holders, lambda: self._own_payload(step), wait=True)
            else:  # read on the commit thread right after the part's commit, before retention
                read = executor.submit(self._own_payload, step)
                self._post.send(me, step, holders, read.result, wait=False)

    def _await_parts(self, step: int | None) -> None:
        """Until the parts of `step` this process holds for others have come in (at most
        `barrier_timeout`, then logged)."""
        assert self._post is not None
        owners = [q for q in self.managers if q != self.procs.index]
        late = self._post.wait_received(owners, step) if step is not None else []
        if late:
            log.warning("cairn: the parts of step %d of process(es) %s did not come", step, late)

    def _own_payload(self, step: int) -> list[Piece]:
        """This process's part of `step`, committed, as the pieces `Post` sends."""
        if self.inner._catalog.get(step) is None:
            raise StepNotFoundError(f"this process's part of step {step} did not commit")
        return self._payload(self.inner, step)

    def deliver(self, owner: int, step: int, pieces: list[memoryview]) -> None:
        """On a receiving thread: commit `owner`'s part of `step`, received, into this
        process's directory of its parts (every file checked against the owner's manifest)."""
        if owner == self.procs.index or owner not in self.managers:
            raise ValueError(f"this process holds no parts of process {owner}")
        manifest, files = self._received(owner, step, pieces)
        job = replicas.received_job(manifest, files, holder=self.procs.index)
        _commit_part(self.managers[owner], job, now=True)

    def _settle(self, *, back: bool = False) -> None:
        """Every process's part in flight is held (its holders answered): a meeting. `back`:
        and the parts sent back at the open were answered (a restore waits for those only
        before its vote: a holder reads its own part meanwhile)."""
        if self._post is not None:
            self._post.wait_sent(back=back)
            self._gather("local/sent", "")

    def _payload(self, manager: Any, step: int) -> list[Piece]:
        """A committed part as the pieces `Post` sends: each file of a local directory opened
        (checked to be the regular file of the recorded size) and sent from the disk as it is,
        for its receiver checks every file; a file of an object store read and checked."""
        reader = manager._reader
        manifest = reader.manifest(step)
        files: list[tuple[str, str, Piece]] = []
        try:
            for item, entry in manifest.items.items():
                if entry.dropped:
                    continue
                stored = reader._stored(step, item, manifest)
                for f in entry.files:
                    try:  # a file on disk, opened: sent as it is
                        piece: Piece = FilePiece(stored.open_file(f.path), f.size)
                    except TypeError:  # not on a local filesystem (an object store): read it
                        piece = stored.read_bytes(f.path)
                    files.append((item, f.path, piece))
        except BaseException:
            for _, _, piece in files:
                if isinstance(piece, FilePiece):
                    os.close(piece.fd)
            raise
        return replicas.pack_part(manifest, files)

    def _received(
        self, owner: int, step: int, pieces: list[memoryview]
    ) -> tuple[Manifest, replicas.Files]:
        """A part of `owner`'s `step` received from another process: its manifest (whose part
        record must say so) and files, not yet checked."""
        header, files = replicas.unpack_part(pieces)
        manifest = Manifest.from_bytes(header["manifest"].encode(), f"a part of process {owner}")
        part = manifest.metadata.get(PART)
        if not isinstance(part, dict) or (part.get("process"), part.get("processes")) != (
            owner,
            self.procs.count,
        ):
            raise CorruptCheckpointError(
                f"a part received as process {owner}'s records {part!r} (step {manifest.step})"
            )
        if manifest.step != step:
            raise CorruptCheckpointError(f"a part sent as step {step} is step {manifest.step}")
        return manifest, files

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
        the primary's (`decide.plan`), from every process's listing and the persistent steps;
        each process reads its source, a part that comes from a peer from memory as it came
        (its files checked as a directory's are, as they are read); all vote, and a source that failed is struck out and the
        decision taken again. A part that came from a peer is then committed into its owner's
        directory on its commit thread. Parts above the step restored are then deleted (a timeline
        the run left). Returns (step, items)."""
        self._settle()
        for manager in self.managers.values():
            manager.wait_until_finished()
        persistent = sorted(persistent)
        bad: decide.Bad = set()
        me, count = self.procs.index, self.procs.count
        local_ok = True  # False once a part could not serve the shardings asked for
        while True:
            listing = self._listing() if local_ok else "{}"
            reports = [json.loads(r) for r in self._gather("local/restore", listing)]
            plan = self._share(
                "local/plan",
                lambda got=reports: decide.plan(got, persistent, step, bad, count),  # type: ignore[misc]
            )
            if plan["step"] is None:
                raise StepNotFoundError(
                    f"step {step} is in neither tier for every process"
                    if step is not None
                    else "no step is held by every process in the local tier or persistently"
                )
            at, sources = int(plan["step"]), plan["sources"]
            restored: dict[str, Any] = {}
            error, received = None, None
            if [at, sources] != self._early:  # (else sent back at the open)
                self._send_back(at, sources)
            self._early = None
            try:
                if sources[me] == "persistent":
                    restored = reader.restore(at, wanted)
                elif sources[me] == "local":
                    restored = self.inner._reader.restore(at, wanted)
                else:
                    manifest, files, hashed = self._fetched(at)
                    received = manifest, files
                    restored = self.inner._reader.restore_part(manifest, files, wanted, hashed)
            except Exception as e:
                error = e
                log.warning("cairn: step %d from the %s tier: %s", at, _tier(sources[me]), e)
            if self._post is not None:
                self._post.wait_sent()  # the parts this process sent back were answered
            votes = self._share_all("local/vote", "ok" if error is None else _outcome(error))
            if self._post is not None:  # every part sent back was answered before the vote
                self._post.forget_back()
            if all(v == "ok" for v in votes):
                if received is not None:  # this process's own part again, committed meanwhile
                    job = replicas.received_job(*received, holder=me)
                    _commit_part(self.inner, job, now=False)
                self._after_restore(at)
                return at, restored
            if "mismatch" in votes:  # parts hold their process's regions as saved: not these
                local_ok = False
                log.warning(
                    "cairn: the local parts of step %d do not hold the regions this restore "
                    "reads (other shardings than saved): restoring from the persistent tier",
                    at,
                )
            for p, vote in enumerate(votes):
                if vote == "corrupt":
                    source = _tier(sources[p])
                    bad.add((p, at, source))
                    log.warning(
                        "cairn: process %d could not read its part of step %d from the %s tier; "
                        "deciding again without it",
                        p,
                        at,
                        source,
                    )
            failed = any(v not in ("ok", "corrupt", "mismatch") for v in votes)
            if failed or not fallback or (step is not None and local_ok):
                if error is not None:
                    raise error
                who = [p for p, v in enumerate(votes) if v != "ok"]
                raise CorruptCheckpointError(
                    f"the restore of step {at} failed on process(es) {who}: {votes}"
                )

    def _send_back(self, step: int, sources: list[Any]) -> None:
        """The replicas this process holds that the plan reads (``["peer", this process]``),
        sent back to their owners on the sender thread (an owner whose replica cannot be read
        hears that there is none)."""
        me = self.procs.index
        owners = [q for q, src in enumerate(sources) if isinstance(src, list) and src[1] == me]
        if owners and self._post is not None:
            self._post.send_back(
                step,
                [(q, functools.partial(self._payload, self.managers[q], step)) for q in owners],
            )

    def _fetched(self, step: int) -> tuple[Manifest, replicas.Files, dict[str, frozenset[str]]]:
        """This process's part of `step`, sent back by the process holding it (at most
        `barrier_timeout`), holding the files its manifest lists: to be read from memory. With
        the files that hashed whole as they arrived (`replicas.hashed_whole`)."""
        part = self._post.fetched(step) if self._post is not None else None
        if not part:
            raise CorruptCheckpointError(
                f"step {step}: the process holding this process's part "
                + (
                    "could not send it"
                    if part is not None
                    else f"did not send it within {self._timeout:g} s"
                )
            )
        manifest, files = self._received(self.procs.index, step, part)
        # its content is checked as it is read, as a directory's (sizes before any parsing,
        # each read's bytes against their hash, unless its file hashed whole as it arrived),
        # and the part's commit checks every file again
        replicas.check_files(files, manifest, content=False)
        return manifest, files, replicas.hashed_whole(files, manifest, part)

    def _after_restore(self, step: int) -> None:
        """Parts above the restored step go (another timeline), and the tiers agree again."""
        for manager in self.managers.values():
            for newer in [s for s in manager.all_steps() if s > step]:
                try:
                    manager.delete(newer)
                except Exception as e:  # a part that stays is outvoted by its save id later
                    log.warning("cairn: could not delete local step %d: %r", newer, e)
        self._agree()

    def info(self, step: int) -> Any:
        """A local step's `StepInfo`: this process's own part's."""
        return dataclasses.replace(self.inner.info(step), tier="local")

    def all_steps(self, persistent: list[int], tier: str | None) -> list[int]:
        """`CheckpointManager.all_steps`: the persistent steps, the local ones, or both."""
        local = self.steps() if tier in (None, "local") else []
        return sorted(set(NoLocal().all_steps(persistent, tier)) | set(local))

    # ------------------------------------------------------------------ the end

    def check_for_errors(self) -> None:
        """This process's own part commits raise (CommitError); a replica's are logged."""
        self.inner.check_for_errors()

    def drain(self) -> None:
        """This process's commits, and its part in flight held (or failed)."""
        if self._post is not None:
            self._post.wait_sent()
        for manager in self.managers.values():
            manager._commits.drain()

    def busy(self) -> bool:
        sending = self._post is not None and self._post.busy()
        return sending or any(m.is_saving_in_progress() for m in self.managers.values())

    def abandon(self) -> None:
        """Close everything, quietly: the outer manager did not open."""
        if self._post is not None:
            self._post.close()
        for manager in self.managers.values():
            _close_quietly(manager)

    def close(self) -> None:
        """Close the managers: this process's own raises a commit error; replicas' are logged.
        With replicas, first this process's part in flight goes out, and the parts of the
        newest local step it holds for others come in (at most `barrier_timeout`)."""
        try:
            if self._post is not None:
                self._post.wait_sent()
                self._await_parts(self._newest)
        finally:
            try:
                if self._post is not None:
                    self._post.close()
                self.inner.close()
            finally:
                for owner, manager in self.managers.items():
                    if owner != self.procs.index:
                        _close_quietly(manager)


class NoLocal:
    """A manager without a local tier: its side of `Local`'s calls."""

    def wants(self, step: int, *, force: bool) -> bool:
        return False

    def steps(self) -> list[int]:
        return []

    def all_steps(self, persistent: list[int], tier: str | None) -> list[int]:
        if tier not in (None, "persistent", "local"):
            raise ValueError(f"tier must be None, 'persistent' or 'local', got {tier!r}")
        return persistent if tier in (None, "persistent") else []

    def save(self, job: _commit.SaveJob, entered: float, *, persistent: bool) -> _commit.SaveJob:
        raise AssertionError("no local tier")

    def finish(self, local: _commit.SaveJob, job: _commit.SaveJob) -> None:
        raise AssertionError("no local tier")

    def info(self, step: int) -> Any:
        raise AssertionError("no local tier")

    def busy(self) -> bool:
        return False

    def abandon(self) -> None:
        pass

    def drain(self) -> None:
        pass

    def check_for_errors(self) -> None:
        pass

    def close(self) -> None:
        pass


def domains_of(tier: LocalTier) -> list[str]:
    """This process's failure domains, outermost first: `tier.failure_domain` if given, then
    its devices' slice (TPU multislice), then its host."""
    found = [tier.failure_domain] if tier.failure_domain is not None else []
    jax = sys.modules.get("jax")
    slices = {getattr(d, "slice_index", None) for d in jax.local_devices()} if jax else set()
    if slices - {None}:
        found.append(f"slice {min(s for s in slices if s is not None)}")
    return [*found, f"host {socket.gethostname()}"]


def _ring(tier: LocalTier, together: Coordinator, timeout: float, post: Post | None) -> Ring:
    """Every process's failure domains, gathered, as the ring of holders (`Ring.of`); and
    with `post`, every process's listener address and key, for it."""
    procs = together.procs
    if procs.count == 1 or post is None:
        return Ring(tuple(range(procs.count)))
    mine = {"domains": domains_of(tier), "address": list(post.address), "key": post.key.hex()}
    got = [
        json.loads(d)
        for d in _gather(together, "local/meet", json.dumps(mine), timeout, everyone=True)
    ]
    post.meet(
        {
            p: ((g["address"][0], g["address"][1]), bytes.fromhex(g["key"]))
            for p, g in enumerate(got)
        }
    )
    domains = [g["domains"] for g in got]
    if any(len(d) != len(domains[0]) for d in domains):
        raise ValueError(
            "LocalTier failure_domain= is given on some processes and not on others: "
            + ", ".join(f"process {p}: {d}" for p, d in enumerate(domains))
        )
    ring, replicas = Ring.of(domains), min(tier.replicas, procs.count - 1)
    shared = ring.sharing(domains, replicas)
    if shared:
        log.warning(
            "cairn: %d of the %d replicas of the local tier's parts share their owner's failure "
            "domain (domains by process: %s)",
            shared,
            replicas * procs.count,
            domains,
        )
    return ring


def _gather(
    together: Coordinator, what: str, mine: str, timeout: float, *, everyone: bool
) -> list[str]:
    """Every process's `mine`, in process order: on every process (`everyone`), else on the
    primary ([] elsewhere). A collective call."""
    procs = together.procs
    if procs.count == 1:
        return [mine]
    key = together.collective(what)
    procs.report(key, mine)
    procs.barrier(key, timeout)
    got = procs.reports(key) if everyone or procs.primary else []
    procs.barrier(f"{key}/read", timeout)
    if procs.primary:
        procs.forget(key)
    return got


def _replicas(tier: LocalTier, count: int) -> int:
    """The replicas each part gets: at most one per other process."""
    if tier.replicas >= count:
        log.warning(
            "cairn: LocalTier(replicas=%d) with %d process(es): each part is held by %d other(s)",
            tier.replicas,
            count,
            count - 1,
        )
    return min(tier.replicas, count - 1)


def _commit_part(manager: Any, job: _commit.SaveJob, *, now: bool) -> None:
    """Commit a part through `manager`: on its commit thread, or here (`now`, or a synchronous
    manager; errors raise then). A part of the same step already there (a timeline the run
    left) goes first."""
    if job.step in manager.all_steps():
        manager.delete(job.step)
    manager._commits.take_slot(job.step)
    manager._catalog.start(job.step)
    if now or manager._commits.executor is None:
        manager._commits.run_save(job, reraise=True)
    else:
        manager._commits.hand_over(job, None, owner=manager)


def _close_quietly(manager: Any) -> None:
    try:
        manager.close()
    except Exception as e:
        log.error("cairn: closing a local tier's replicas: %r", e)


def _tier(source: Any) -> str:
    """A plan's source as the tier it reads: "local", "persistent", or "peer" (["peer", holder])."""
    return source if isinstance(source, str) else "peer"


def _outcome(error: BaseException) -> str:
    """A process's vote after a failed read: its part does not hold the regions asked for
    ("mismatch"), its source is damaged ("corrupt"), or it failed otherwise (the others raise
    too)."""
    if isinstance(error, PartMismatchError):
        return "mismatch"
    if isinstance(error, (CorruptCheckpointError, StepNotFoundError)):
        return "corrupt"
    return f"{type(error).__name__}: {error}"
