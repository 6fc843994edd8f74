"""Crashes at every point of a change (StepStore): the process dies at the N-th change of what is
stored, for every N, while deleting a step, dropping an item or replacing late metrics; the next
writer finds whole steps and removes what the crash left. On every backend
(tests/contracts/storage.py).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from cairn.manager import CheckpointManager
from cairn.manager._format import Manifest, dump_checked
from cairn.manager._storage.base import Storage
from contracts.storage import (
    NAMES,
    GcsBackend,
    MemoryBackend,
    Place,
    PosixBackend,
    S3Backend,
    StorageContract,
    check_restored,
    step_2_whole_or_gone,
)


class CrashesContract(StorageContract):
    """A crash at any point of a deletion, an item drop or a metrics update."""

    # ------------------------------------------------------------------ crashes

    def test_a_crash_at_any_point_of_a_deletion(
        self, places: Callable[[str], Place], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Deleting step 2 (and freeing its space), dying at each point: step 2 is whole or
        gone, steps 1 and 3 are untouched."""
        found, _ = self.crash_deleting(places, monkeypatch)
        assert found[0] == "whole" and found[-1] == "gone", found
        assert len(found) >= 3, found

    def test_a_crash_at_any_point_of_a_deletion_leaves_nothing(
        self, places: Callable[[str], Place], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """... and the next writer's start removes everything the crash left."""
        found, strays = self.crash_deleting(places, monkeypatch)
        assert [(n, s) for n, s in enumerate(strays, 1) if s] == [], found

    def crash_deleting(
        self, places: Callable[[str], Place], monkeypatch: pytest.MonkeyPatch
    ) -> tuple[list[str], list[list[str]]]:
        """`crash_everywhere` around the deletion of step 2."""

        def delete(storage: Storage) -> None:
            reclaim = storage.delete_step("checkpoint_2")
            if reclaim is not None:
                reclaim()

        return self.crash_everywhere(places, monkeypatch, delete, step_2_whole_or_gone)

    def test_a_crash_at_any_point_of_an_item_drop(
        self, places: Callable[[str], Place], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Dropping item "state" of step 2 (as keep_items does), dying at each point: step 2
        has its item or has it dropped, and restores its other item either way; no files of a
        dropped item stay."""

        def drop(storage: Storage) -> None:
            listed = storage.read_step(NAMES, 2)
            assert listed is not None and listed.manifest is not None
            manifest = Manifest.from_bytes(listed.manifest, "step 2").with_dropped("state")
            reclaim = storage.drop_item("checkpoint_2", manifest, "state")
            if reclaim is not None:
                reclaim()

        def check(place: Place, mgr: CheckpointManager) -> str:
            assert mgr.all_steps() == [1, 2, 3]
            assert mgr.verify(2) == []
            dropped = mgr.info(2).items["state"].dropped
            live = ["extra"] if dropped else ["state", "extra"]
            check_restored(mgr.restore(2, fallback=False), 2, live=live)
            assert mgr.metrics(2) == {"loss": 0.5, "eval": 0.5}
            return "dropped" if dropped else "whole"

        found, strays = self.crash_everywhere(places, monkeypatch, drop, check)
        assert found[0] == "whole" and found[-1] == "dropped", found
        assert len(found) >= 3, found
        assert [(n, s) for n, s in enumerate(strays, 1) if s] == [], found

    def test_a_crash_at_any_point_of_a_metrics_update(
        self, places: Callable[[str], Place], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Replacing step 2's metrics.json, dying at each point: the old metrics or the new."""
        old, new = {"loss": 0.5, "eval": 0.5}, {"loss": 0.5, "eval": 0.25}

        def update(storage: Storage) -> None:
            storage.write_metrics("checkpoint_2", dump_checked({"metrics": {"eval": 0.25}}))

        def check(place: Place, mgr: CheckpointManager) -> str:
            assert mgr.all_steps() == [1, 2, 3]
            assert mgr.verify(2) == []
            check_restored(mgr.restore(2, fallback=False), 2, live=["state", "extra"])
            metrics = mgr.metrics(2)
            assert metrics in (old, new), metrics
            return "new" if metrics == new else "old"

        found, strays = self.crash_everywhere(places, monkeypatch, update, check)
        assert found[0] == "old" and found[-1] == "new", found
        assert [(n, s) for n, s in enumerate(strays, 1) if s] == [], found


class TestPosix(PosixBackend, CrashesContract):
    """CrashesContract on Posix."""


class TestMemory(MemoryBackend, CrashesContract):
    """CrashesContract on Memory."""


class TestS3(S3Backend, CrashesContract):
    """CrashesContract on S3."""


class TestGcs(GcsBackend, CrashesContract):
    """CrashesContract on Gcs."""
