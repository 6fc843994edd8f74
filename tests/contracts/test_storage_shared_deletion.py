"""A deletion shared out among the processes of a job (SharedDeletion: `retire_step`, each
process's `remove_files`, `finish_deletion`), in the order tests/multihost/ drives it with
several processes: the primary retires the step (from then on it is no step), every process
removes its share of the manifest's files, the primary finishes. Object stores share deletions
(memory://, S3 on a real moto server, GCS on a real fake-gcs-server); POSIX retires a step with
one rename and says so (`shares_deletion` False), so it is never asked.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from cairn.manager._format import Manifest
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
    items,
    step_2_whole_or_gone,
    step_paths,
    stored_keys,
)


def manifest_of(storage: Storage, step: int) -> Manifest:
    listed = storage.read_step(NAMES, step)
    assert listed is not None and listed.manifest is not None
    return Manifest.from_bytes(listed.manifest, f"step {step}")


class SharedDeletionContract(StorageContract):
    """What every backend says about shared deletion."""

    def test_the_storage_says_whether_it_shares_deletion(self, place: Place) -> None:
        storage = place.storage()
        try:
            assert storage.shares_deletion is self.shares_deletion
        finally:
            storage.close()


class SharesDeletionContract(SharedDeletionContract):
    """Backends whose processes share a step's deletion out."""

    @pytest.mark.parametrize("shares", ["every process's", "the primary's only"])
    def test_a_deletion_shared_by_two_processes(self, place: Place, shares: str) -> None:
        """Step 2 of three, deleted by a job of two processes: once retired it is listed by no
        one; each process removes every other file of the manifest (or only the primary does:
        the other's share failed), and finish_deletion removes what is left, the claim last.
        Steps 1 and 3 are untouched."""
        with place.writer() as mgr:
            for step in (1, 2, 3):
                mgr.save(step, items(step), metrics={"loss": 1.0 / step})
        primary, other = place.storage(), place.storage()  # `other`: a process that holds no lock
        primary.acquire()
        try:
            paths = step_paths(manifest_of(primary, 2))
            assert len(paths) >= 2, paths
            primary.retire_step("checkpoint_2")
            assert [listed.step for listed in other.scan(NAMES)] == [1, 3]
            assert other.read_step(NAMES, 2) is None
            with place.reader() as reader:
                assert reader.all_steps() == [1, 3]
            primary.remove_files("checkpoint_2", paths[0::2])
            if shares == "every process's":
                other.remove_files("checkpoint_2", paths[1::2])
            left = {k.removeprefix("checkpoint_2/") for k in place.raw.all_keys()}
            removed = paths if shares == "every process's" else paths[0::2]
            assert left.isdisjoint(removed), sorted(left & set(removed))
            primary.finish_deletion("checkpoint_2")
        finally:
            primary.release()
            primary.close()
            other.close()
        assert [k for k in place.raw.all_keys() if k.startswith("checkpoint_2/")] == []
        with place.writer() as mgr:
            assert mgr.all_steps() == [1, 3]
            assert place.raw.all_keys() == stored_keys(mgr, lock=True)
            check_restored(mgr.restore(1), 1, live=["state", "extra"])
            check_restored(mgr.restore(3), 3, live=["state", "extra"])

    def test_a_crash_at_any_point_of_a_shared_deletion(
        self, places: Callable[[str], Place], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """retire_step, remove_files and finish_deletion of step 2 on one storage, dying at each
        change: step 2 is whole or gone, steps 1 and 3 are untouched, and the next writer's
        start removes everything the crash left."""

        def delete(storage: Storage) -> None:
            paths = step_paths(manifest_of(storage, 2))
            storage.retire_step("checkpoint_2")
            storage.remove_files("checkpoint_2", paths)
            storage.finish_deletion("checkpoint_2")

        found, strays = self.crash_everywhere(places, monkeypatch, delete, step_2_whole_or_gone)
        assert found[0] == "whole" and found[-1] == "gone", found
        assert len(found) >= 3, found
        assert [(n, s) for n, s in enumerate(strays, 1) if s] == [], found


class TestPosix(PosixBackend, SharedDeletionContract):
    """POSIX does not share deletion (one rename retires a step)."""


class TestMemory(MemoryBackend, SharesDeletionContract):
    """SharesDeletionContract on Memory."""


class TestS3(S3Backend, SharesDeletionContract):
    """SharesDeletionContract on S3."""


class TestGcs(GcsBackend, SharesDeletionContract):
    """SharesDeletionContract on Gcs."""
