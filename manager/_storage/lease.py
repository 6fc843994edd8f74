"""The lease of an object-store directory: its one writer, without a lock. A lease object
beside the steps names its owner and when it expires; every change to it is a conditional write,
so two writers cannot both hold it."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Mapping
from typing import Any

from cairn.handlers.errors import (
    DirectoryLockedError,
)
from cairn.manager._format import (
    LOCK,
    unix_time,
)
from cairn.manager._storage.kvstore import ObjectStore
from cairn.manager._storage.orphans import WRITER_WAIT_S, pid_alive, runs_writer, wait_for_orphan

log = logging.getLogger("cairn")

LEASE = LOCK
LEASE_SECONDS = 3600.0  # read when a lease is taken (the tests shorten it)
_LEASE_BYTES = 4096  # the most a lease object may hold (cairn's are under 200 bytes)
_CLOCK_SLACK_S = 60.0  # clocks of two hosts may differ this much before a message says so


@dataclasses.dataclass(frozen=True)
class _Held:
    """What a lease object says: until when, whose (``host:pid:id``), and the pid of that
    trainer's writer process (``writer="process"``), which commits under the same lease.

    A lease that is not one cairn writes is *damaged* (`damaged` says why): not JSON of at most
    `_LEASE_BYTES`, an `expires` that is not a number of seconds from 1970 to 9999 (NaN,
    Infinity, 1e300, a bool, a string), an `owner` that is not a short printable string, a
    `writer` that is not a pid. No live cairn writer leaves such an object, so it counts as
    expired (a writer takes it over, with a warning)."""

    expires: float
    owner: str
    writer: int | None = None
    damaged: str | None = None

    @classmethod
    def parse(cls, data: bytes) -> _Held:
        def damaged(why: str) -> _Held:
            return cls(0.0, "unknown", damaged=why)

        if len(data) > _LEASE_BYTES:
            return damaged(f"it holds {len(data)} bytes")
        try:
            held = json.loads(data)
        except (ValueError, RecursionError) as e:  # not JSON, nested too deep, too many digits
            return damaged(f"it does not parse ({type(e).__name__})")
        if not isinstance(held, dict):
            return damaged("it is not a JSON object")
        owner, writer = held.get("owner"), held.get("writer")
        try:
            expires = unix_time(held.get("expires"), "expires")
        except (TypeError, ValueError) as e:
            return damaged(str(e))
        if not (isinstance(owner, str) and 0 < len(owner) <= 255 and owner.isprintable()):
            return damaged("its owner is not a printable name of at most 255 characters")
        if writer is not None and not (type(writer) is int and 0 < writer < 1 << 31):
            return damaged("its writer is not a pid")
        return cls(expires, owner, writer)

    def _trainer_here(self) -> int | None:
        """The owner's pid, if it ran on this host."""
        host, _, rest = self.owner.partition(":")
        pid = rest.partition(":")[0]
        here = host == socket.gethostname() and pid.isascii() and pid.isdigit()
        return int(pid) if here else None

    def orphaned_writer(self) -> tuple[int, int] | None:
        """(trainer, writer) when the owner ran here with a writer process, and has ended."""
        trainer = self._trainer_here()
        if trainer is None or self.writer is None or pid_alive(trainer) is not False:
            return None
        return trainer, self.writer

    def gone(self) -> bool:
        """Whether the owner ran on this host and no longer runs, nor its writer (a crash)."""
        trainer = self._trainer_here()
        return (
            trainer is not None
            and pid_alive(trainer) is False
            and (
                self.writer is None
                or pid_alive(self.writer) is False
                or not runs_writer(self.writer)  # a pid reused, or any pid a crafted lease names
            )
        )


class Lease:
    """One writer per object-store directory: a lease object ``.cairn.lock`` created only if
    absent (or expired), checked before and after each upload, refreshed at each commit,
    deleted at close.

    A writer that crashed leaves its lease; another writer may take it over once it expired
    (`LEASE_SECONDS` after the last refresh, one hour), or at once when the owner was a process on
    the same host that no longer runs. A writer whose lease was taken over (or deleted) has lost
    it for good: every later check raises DirectoryLockedError, so it commits nothing more.

    A lease is its owner's while the object names that owner. With ``writer="process"`` two
    processes share it (`for_writer`, `shared`): the writer process refreshes it at each of
    its commits, the trainer checks it in its retention, so each takes the other's newer
    generation for its own when the owner is unchanged. The object names the writer's pid
    (`set_writer`): a trainer started on this host after the owner ended waits for that writer
    to finish (`wait_for_orphan`) before it takes the lease over; an orphaned writer deletes the
    lease when it has committed what it was handed.
    """

    def __init__(self, store: ObjectStore) -> None:
        self._store, self._seconds = store, LEASE_SECONDS
        self._owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._writer: int | None = None
        self._lost: str | None = None
        data, self._generation = store.read_with_generation(LEASE)
        if data is not None:
            held = _Held.parse(data)
            if held.damaged is not None:
                log.warning(
                    "cairn: %s/%s is no lease cairn wrote (%s); taking it over as an expired one",
                    store.url,
                    LEASE,
                    held.damaged,
                )
            orphan = held.orphaned_writer() if held.expires > time.time() else None
            if orphan is not None and wait_for_orphan(*orphan, WRITER_WAIT_S):
                data, self._generation = store.read_with_generation(LEASE)  # it may have gone
                held = _Held.parse(data) if data is not None else _Held(0.0, "nobody")
            now = time.time()
            if held.expires > now and not held.gone():
                also = f", with its writer process pid {held.writer}" if held.writer else ""
                ahead = (
                    f" (more than the lease's {self._seconds:g} s ahead of this host's clock: the "
                    "owner's clock runs ahead of this one, or the lease was written by hand; if "
                    f"its owner is gone, delete {LEASE})"
                    if held.expires - now > self._seconds + _CLOCK_SLACK_S
                    else ""
                )
                raise DirectoryLockedError(
                    f"{store.url} is held by another writable CheckpointManager ({held.owner}"
                    f"{also}) until "
                    f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(held.expires))}{ahead}; "
                    "open it with read_only=True to read alongside"
                )
        if not self._write():
            store.check_bucket()  # a write refused: the bucket may be missing, not the race lost
            raise DirectoryLockedError(f"{store.url}: another writer took the lease first")

    @classmethod
    def shared(cls, store: ObjectStore, state: Mapping[str, Any]) -> Lease:
        """The lease a trainer holds (`for_writer`), as its writer process holds it too."""
        lease = cls.__new__(cls)
        lease._store, lease._seconds = store, float(state["seconds"])
        lease._owner, lease._writer = str(state["owner"]), os.getpid()
        lease._lost, lease._generation = None, state["generation"]
        return lease

    def for_writer(self) -> dict[str, Any]:
        """What `shared` needs (picklable)."""
        return {"owner": self._owner, "generation": self._generation, "seconds": self._seconds}

    def set_writer(self, pid: int) -> None:
        """Name writer process `pid` in the lease (before it is sent a save)."""
        self._writer = pid
        self.refresh()

    def _write(self) -> bool:
        body = {"owner": self._owner, "expires": time.time() + self._seconds}
        if self._writer is not None:
            body["writer"] = self._writer
        generation = self._store.write(
            LEASE, json.dumps(body).encode(), if_generation=self._generation
        )
        if generation is None:
            return False
        self._generation = generation
        return True

    def _still_ours(self) -> bool:
        """Whether the lease object (one read) is still this manager's: at the generation it
        last wrote, or at another that still names this owner (the other process of a shared
        lease wrote it), whose generation is ours from then on. Else the lease is lost."""
        data, generation = self._store.read_with_generation(LEASE)
        if generation == self._generation:
            return True
        if data is not None and _Held.parse(data).owner == self._owner:
            self._generation = generation
            return True
        self._lose(data)
        return False

    def check(self) -> None:
        """DirectoryLockedError if the lease is no longer this manager's (one read)."""
        if self._lost is None and self._still_ours():
            return
        raise DirectoryLockedError(self._lost)

    def refresh(self) -> None:
        """Extend the lease by `LEASE_SECONDS`; DirectoryLockedError if it was lost."""
        for _ in range(3):  # the other holder of a shared lease may write it meanwhile
            if self._lost is None and self._write():
                return
            if self._lost is not None or not self._still_ours():
                break
        raise DirectoryLockedError(
            self._lost or f"{self._store.url}: the lease {LEASE} changed at each of 3 refreshes"
        )

    def _lose(self, data: bytes | None) -> None:
        how = "deleted" if data is None else f"taken over by {_Held.parse(data).owner}"
        self._lost = (
            f"{self._store.url}: this manager's lease {LEASE} was {how} (a lease not refreshed "
            f"by a commit for {self._seconds:g} s expires and another writer may take it); it "
            "commits nothing more: close it, and open a new writable CheckpointManager once the "
            "other writer has closed"
        )

    def release(self) -> None:
        """Delete the lease, unless it is no longer this manager's."""
        if self._lost is None and self._still_ours():
            self._store.delete(LEASE, if_generation=self._generation)
