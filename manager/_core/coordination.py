"""How the processes of a jax.distributed run share one directory: the primary changes it and
tells the others what changed; they read just that, and all meet before the next change."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Mapping

from cairn.manager._core.catalog import Catalog
from cairn.manager._core.multihost import Processes
from cairn.manager._core.reading import Reader
from cairn.manager._core.retention import Retention
from cairn.manager._format import Manifest, StepNames
from cairn.manager._storage.base import Storage

log = logging.getLogger("cairn")

# Writable managers opened per directory in this process (collective keys).
_OPENED: dict[str, int] = {}


class Coordinator:
    """One manager's collective calls. Every process makes the same calls in the same order
    (`collective` names them alike), each a broadcast from the primary and a barrier, bounded
    by `timeout`. With one process every call is local and immediate.

    Concurrency: `open`, `collective`, `together` and `decide` are called on the caller thread
    (in the order of the training loop, the same on every process); `tell_changes` and
    `apply_changes` on the commit thread, which runs the changes in submission order."""

    def __init__(
        self,
        procs: Processes,
        timeout: float,
        storage: Storage,
        names: StepNames,
        catalog: Catalog,
        reader: Reader,
        retention: Retention,
    ) -> None:
        self.procs, self._timeout = procs, timeout
        self._storage, self._names, self._catalog = storage, names, catalog
        self._reader, self._retention = reader, retention
        self._where = storage.url
        self._calls = 0  # collective calls so far: the same sequence on every process
        self.run = uuid.uuid4().hex
        self._opened: int | None = None  # this manager's number among those of the directory

    def _number(self) -> int:
        """This manager's number among the writable ones opened on its directory in this
        process: the same on every process (they open alike), part of its first keys."""
        if self._opened is None:
            self._opened = _OPENED[self._where] = _OPENED.get(self._where, 0) + 1
        return self._opened

    def hello(self) -> None:
        """The primary's run id on every process, before `open`: collective calls can be made
        before the primary's clean-up and scan (a local tier opens meanwhile)."""
        if self.procs.count > 1:
            key = f"cairn/hello/{self._number()}:{self._where}"
            told = self.procs.broadcast(
                key, self.run if self.procs.primary else None, self._timeout
            )
            self.run = told

    def open(self, refusal: str | None = None) -> None:
        """The run id (drawn by the primary, unless `hello` told it already) and the steps:
        with several processes the primary broadcasts the id and the steps it found after its
        clean-up and scan, and every other process reads just those steps instead of listing
        the directory; then all meet. A `refusal` of the primary's (the directory holds steps
        under another naming) is raised on every process."""
        if self.procs.count == 1:
            _refuse(refusal)
            return
        key = f"cairn/open/{self._number()}:{self._where}"  # the same on every process
        mine = json.dumps({"run": self.run, "steps": self._catalog.steps(), "refused": refusal})
        told = json.loads(
            self.procs.broadcast(key, mine if self.procs.primary else None, self._timeout)
        )
        _refuse(told.get("refused"))
        if not self.procs.primary:
            self._catalog.replace(self._reader.read_steps(told["steps"]))
        self.procs.barrier(f"cairn/{told['run']}/opened", self._timeout)
        self.run = str(told["run"])

    def collective(self, what: str) -> str:
        """A name for the next collective call, the same on every process (they call alike)."""
        self._calls += 1
        return f"cairn/{self.run}/{what}/{self._calls}"

    def decide(self, what: str, mine: Callable[[], bool]) -> bool:
        """The primary's answer, `mine()` there, for every process (a clock, a signal)."""
        if self.procs.count == 1:
            return mine()
        decided = str(mine()) if self.procs.primary else None
        return self.procs.broadcast(self.collective(what), decided, self._timeout) == "True"

    def together(self, what: str, fn: Callable[[], None]) -> Callable[[], None]:
        """`fn` (which changes the directory only on the primary), then, with several processes,
        the primary's broadcast of the steps that changed, which the others read again, and a
        barrier so the primary's next change cannot race with that reading. Call on the caller
        thread."""
        procs = self.procs
        if procs.count == 1:
            return fn
        key = self.collective(what)

        def run() -> None:
            try:
                fn()
            finally:
                if procs.primary:
                    self.tell_changes(f"{key}/changed")
                    procs.forget(key)
                else:
                    self.apply_changes(procs.broadcast(f"{key}/changed", None, self._timeout))
                    procs.barrier(f"{key}/changed/read", self._timeout)

        return run

    def tell_changes(self, key: str, prefix: str = "") -> None:
        """Primary, after a change: broadcast the steps that changed since the last time
        (committed, deleted, items dropped, metrics merged) under `key`, after `prefix`; delete
        its share of the steps it retired; wait at ``<key>/read`` until every process has read
        the changes and deleted its share (so the next change cannot race with that reading);
        then remove what is left of those steps."""
        changed, gone = self._catalog.changes()
        self.procs.broadcast(
            key, prefix + json.dumps({"changed": changed, "gone": gone}), self._timeout
        )
        retired, self._retention.retired = self._retention.retired, {}
        self._delete_shares(retired)
        self.procs.barrier(f"{key}/read", self._timeout)
        for step in retired:
            try:
                self._storage.finish_deletion(self._names.format(step))
            except Exception as e:  # a retired step is no step; the next start removes it
                log.warning("cairn: could not finish deleting step %d: %r", step, e)

    def apply_changes(self, text: str) -> None:
        """Another process: forget the steps the primary deleted (and delete this process's
        share of their files) and read again the ones it changed (a manifest and a metrics
        read each), instead of listing the directory."""
        changes = json.loads(text)
        if self._storage.shares_deletion:
            self._delete_shares(self._catalog.manifests(changes["gone"]))
        records = self._reader.read_steps(changes["changed"])
        for step in changes["gone"] + changes["changed"]:
            if step in records:
                self._catalog.committed(step, records[step])
            else:
                self._catalog.remove(step)

    def _delete_shares(self, manifests: Mapping[int, Manifest | None]) -> None:
        """This process's share of the files of retired steps: every `count`-th of the sorted
        paths, from its `index`, so that each process sends about as many DELETEs as it wrote
        files. A failure leaves files for the primary's `finish_deletion`."""
        procs = self.procs
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


def _refuse(refusal: str | None) -> None:
    if refusal is not None:
        raise ValueError(refusal)
