"""Retention: deleting the steps a keep policy does not keep and dropping the items per-item
policies do not keep. One copy, used by the manager's commit thread and by a writer process
whose trainer died (`cairn.manager._core.writer`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from pathlib import Path

from cairn.manager._core.catalog import Catalog, apply_retention
from cairn.manager._core.policies import KeepPolicy
from cairn.manager._format import LOCK, MANIFEST, ROOT_METADATA, Manifest, StepNames, namings
from cairn.manager._storage.base import Storage

# What a directory that holds a checkpoint holds: cairn's manifest or root files, Orbax's marks.
_CHECKPOINT_MARKS = {MANIFEST, LOCK, ROOT_METADATA, "commit_success.txt", "_CHECKPOINT_METADATA"}


class Retention:
    """Applies `keep` and `keep_items` to a `Catalog` of committed steps through a `Storage`.

    Concurrency: call from one thread, the one that makes every change to the directory (the
    commit thread). `reclaim` frees a deleted step's space; the manager hands it to its
    reclaim thread, a writer process runs it at once. With `retire` (several processes on a
    storage that shares deletion out) a step is only retired here: its manifest waits in
    `retired` until the processes delete their shares (`Coordinator.tell_changes`)."""

    def __init__(
        self,
        storage: Storage,
        names: StepNames,
        catalog: Catalog,
        keep: KeepPolicy,
        keep_items: Mapping[str, KeepPolicy],
        *,
        reclaim: Callable[[Callable[[], None]], None],
        retire: bool = False,
    ) -> None:
        self._storage, self._names, self._catalog = storage, names, catalog
        self._keep, self._keep_items = keep, keep_items
        self._reclaim, self._retire = reclaim, retire
        self.retired: dict[int, Manifest | None] = {}  # retired, shares not yet deleted

    def apply(self) -> None:
        """Delete the committed steps the keep policy does not keep, then drop the items the
        per-item policies do not keep."""
        apply_retention(self._catalog, self._keep, self._keep_items, self.delete, self.drop)

    def delete(self, step: int) -> None:
        """Delete a committed step (or retire it, see the class docstring)."""
        name, reclaim = self._names.format(step), None
        manifest = self._catalog.manifests([step]).get(step)
        try:
            if self._retire:
                self._storage.retire_step(name)
            else:
                reclaim = self._storage.delete_step(name)
        except BaseException:
            with contextlib.suppress(Exception):
                if self._storage.read_step(self._names, step) is None:  # gone all the same
                    self._catalog.remove(step)
            raise
        if self._retire:
            self.retired[step] = manifest
        self._catalog.remove(step)
        if reclaim is not None:
            self._reclaim(reclaim)

    def delete_directory(self, name: str) -> None:
        """Delete a directory of the root that is no step of this naming (`check_entry_name`
        checked the name). ValueError, nothing changed, if it is missing or empty, not a real
        directory, a step under any naming (cairn's or orbax-checkpoint's, intact or damaged),
        or holds a checkpoint: cairn's or Orbax's marks, or step-like directories (another
        checkpoint directory nested in the root, whose writer may be at work). On an object store
        the prefix is marked first: what a crash part-way leaves, the next writer removes."""
        for naming, [(step, _)] in namings([name]):
            if self._storage.read_step(naming, step) is not None:
                raise ValueError(
                    f"{name!r} is step {step} under another naming (step_prefix="
                    f"{naming.prefix!r}): delete it with a manager of that naming"
                )
        where = self._storage.location(name)
        if isinstance(where, Path) and not os.path.lexists(where):
            raise ValueError(f"there is no directory {name!r} in {where.parent}")
        if isinstance(where, Path) and (os.path.islink(where) or not os.path.isdir(where)):
            raise ValueError(f"{where} is not a directory (a link or a file): not deleted")
        try:
            entries = self._storage.view(name).entries()
        except FileNotFoundError:
            entries = {}
        if not entries:
            raise ValueError(
                f"there is no directory {name!r} in {self._storage.url} (or it is empty)"
            )
        marks = sorted(entries.keys() & _CHECKPOINT_MARKS)
        nested = sorted(n for n, is_dir in entries.items() if is_dir and namings([n]))
        if marks or nested:
            raise ValueError(
                f"{where} holds a checkpoint ({', '.join((marks + nested)[:3])}): not deleted"
            )
        reclaim = self._storage.delete_step(name)
        if reclaim is not None:
            self._reclaim(reclaim)

    def drop(self, step: int, item: str) -> None:
        """Drop one item of an intact step: its files go, its manifest says so."""
        record = self._catalog.get(step)
        assert record is not None and record.manifest is not None  # a view of an intact step
        manifest = record.manifest.with_dropped(item)
        reclaim = self._storage.drop_item(self._names.format(step), manifest, item)
        self._catalog.update(step, manifest=manifest)
        if reclaim is not None:
            self._reclaim(reclaim)
