"""The directory's one writer (WriterHold: `acquire`, `release`, `check_writer`): a lock file on
POSIX, a lease object on object stores; a second writable manager in this process takes over
from the first, another process is refused. One class per backend that has the part (TestPosix,
TestMemory, TestS3 on a real moto server, TestGcs on a real fake-gcs-server).

Gathered here from tests/manager/test_takeover.py (the takeover), test_manager.py,
test_robustness.py and test_reliability.py (the lock) and test_objectstore.py (the lease).
Leases as untrusted input (damaged, from a clock far ahead, naming a live process that is no
writer) and a hard-linked lock file are the cases of issue 42 in
tests/manager/test_untrusted_round3.py.

T5X's Checkpointer has no close(), and trainers, eval tools and notebooks build another one on
the same directory; SpeechBrain recipes build a fresh Checkpointer to recover: so in one process
the newer writable manager takes over.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import Gate
from support.objectstore import hold, lease_of, put_lease
from support.treeutil import assert_tree_equal, dir_state

from cairn.handlers import InMemoryHandler
from cairn.manager import (
    CheckpointManager,
    CommitError,
    DirectoryLockedError,
    KeepLatest,
    ReadOnlyError,
    SupersededError,
)
from cairn.manager._core import takeover
from cairn.manager._format import LOCK, MANIFEST
from cairn.manager._storage import lease as _lease
from cairn.manager._storage import posix as _posix
from cairn.manager._storage.objectstore import ObjectStore, StorageOptions

HOLDS = """
import sys
from cairn.manager import CheckpointManager, DirectoryLockedError
try:
    CheckpointManager(sys.argv[1]).close()
except DirectoryLockedError as e:
    print(e)
    sys.exit(3)
"""


def another_process_may_write(directory: Path | str) -> bool:
    """Whether a writable manager opens on `directory` in a fresh process (False: locked)."""
    done = subprocess.run(
        [sys.executable, "-c", HOLDS, str(directory)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode in (0, 3), done.stderr
    return done.returncode == 0


def state(step: int) -> dict[str, Any]:
    return {"w": np.arange(3000.0).reshape(30, 100) * step, "step": step}


class TestPosix:
    """The lock file: one writable manager per directory, readers beside it; a newer manager in
    this process takes over, a writer in another process is refused."""

    # ------------------------------------------------------------------ a takeover in this process

    def test_the_new_manager_waits_for_the_old_ones_pending_commit(
        self, tmp_path: Path, gated_handler: InMemoryHandler, gate: Gate
    ) -> None:
        old = CheckpointManager(tmp_path, handlers={"x": gated_handler}, keep=KeepLatest(5))
        old.save(1, {"x": "one"})
        assert gate.entered.wait(30)
        opened: list[CheckpointManager] = []
        thread = threading.Thread(
            target=lambda: opened.append(
                CheckpointManager(tmp_path, handlers={"x": gated_handler}, keep=KeepLatest(5))
            )
        )
        thread.start()
        thread.join(timeout=0.5)
        assert thread.is_alive(), "the new manager opened while the old one's commit was held"
        gate.release.set()
        thread.join(timeout=60)
        (new,) = opened
        assert new.all_steps() == [1]  # the old one's pending step, committed before the new scan
        assert new.restore(1)["x"] == "one"
        new.save(2, {"x": "two"})
        new.wait_until_finished()
        old.reload()
        assert old.all_steps() == [1, 2]  # the old one still reads
        new.close()
        old.close()

    def test_the_old_manager_turns_read_only(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        old = CheckpointManager(tmp_path)
        old.save(1, {"s": [1]})
        with caplog.at_level(logging.WARNING, logger="cairn"):
            new = CheckpointManager(tmp_path)
        assert "took over" in caplog.text and str(tmp_path) in caplog.text
        before = dir_state(tmp_path)
        for call in (
            lambda: old.save(2, {"s": [2]}),
            lambda: old.save(2, {"s": [2]}, force=True),
            lambda: old.delete(1),
            lambda: old.record_metrics(1, {"loss": 1.0}),
        ):
            with pytest.raises(SupersededError, match="newer writable CheckpointManager") as raised:
                call()
            assert isinstance(raised.value, ReadOnlyError)
        assert dir_state(tmp_path) == before
        assert old.read_only and not new.read_only
        assert old.restore()["s"] == [1]
        old.close()  # lets go of nothing: the lock is the new manager's
        assert not another_process_may_write(tmp_path)
        new.save(2, {"s": [2]})
        new.close()
        assert another_process_may_write(tmp_path)

    def test_a_chain_of_managers_and_other_spellings_of_the_directory(self, tmp_path: Path) -> None:
        """Three managers in turn; the directory named through a link and with ``..``."""
        run = tmp_path / "run"
        run.mkdir()
        (tmp_path / "link").symlink_to(run)
        first = CheckpointManager(run)
        first.save(1, {"s": [1]})
        second = CheckpointManager(tmp_path / "link")
        second.save(2, {"s": [2]})
        third = CheckpointManager(tmp_path / "run" / ".." / "run")
        assert third.all_steps() == [1, 2]
        for old in (first, second):
            with pytest.raises(SupersededError):
                old.save(3, {"s": [3]})
        third.save(3, {"s": [3]})
        third.wait_until_finished()
        assert not another_process_may_write(run)
        for manager in (first, second, third):
            manager.close()
        assert another_process_may_write(run)

    def test_a_failed_pending_commit_stays_with_the_old_manager(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        def fail() -> None:
            raise OSError("disk on fire")

        old = CheckpointManager(tmp_path, handlers={"x": InMemoryHandler(on_write=fail)})
        old.save(1, {"x": "one"})
        with caplog.at_level(logging.WARNING, logger="cairn"):
            new = CheckpointManager(tmp_path)
        assert "disk on fire" in caplog.text  # logged at the hand-over, not lost with the old one
        assert new.all_steps() == []
        with pytest.raises(CommitError, match="disk on fire"):
            old.check_for_errors()
        new.save(1, {"s": [1]})
        new.close()
        old.close()
        assert CheckpointManager(tmp_path, read_only=True).all_steps() == [1]

    def test_readers_do_not_take_over(self, tmp_path: Path) -> None:
        writer = CheckpointManager(tmp_path)
        with CheckpointManager(tmp_path, read_only=True) as reader:
            assert reader.all_steps() == []
        writer.save(1, {"s": [1]})  # still the writer
        writer.close()
        assert CheckpointManager(tmp_path, read_only=True).all_steps() == [1]

    def test_a_closed_or_dropped_manager_is_not_disturbed(self, tmp_path: Path) -> None:
        CheckpointManager(tmp_path).close()
        dropped = CheckpointManager(tmp_path)
        dropped.save(1, {"s": [1]})
        del dropped  # garbage: its lock goes with it
        with CheckpointManager(tmp_path) as mgr:
            assert mgr.all_steps() == [1]

    @pytest.mark.parametrize("async_save", [True, False])
    def test_a_takeover_from_another_thread_while_the_old_one_saves(
        self, tmp_path: Path, async_save: bool
    ) -> None:
        """Every save the old manager accepted is committed before the new one lists the
        directory; every later one raises SupersededError; none lands after the hand-over."""
        old = CheckpointManager(tmp_path, async_save=async_save, max_pending=2)
        accepted: list[int] = []
        refused: list[BaseException] = []
        some_saved = threading.Event()

        def train() -> None:
            for step in range(1, 10_000):
                try:
                    old.save(step, {"s": [step]})
                except SupersededError as e:
                    refused.append(e)
                    return
                accepted.append(step)
                if step == 5:
                    some_saved.set()

        trainer = threading.Thread(target=train)
        trainer.start()
        assert some_saved.wait(60)
        new = CheckpointManager(tmp_path)
        trainer.join(timeout=60)
        assert not trainer.is_alive() and refused, "the old manager kept saving"
        assert new.all_steps() == accepted  # each accepted save committed, before the new listing
        new.reload()
        assert new.all_steps() == accepted  # and nothing landed after it
        new.close()
        old.close()

    # ------------------------------------------------------------------ the lock

    def test_one_writer_per_directory(self, tmp_path: Path) -> None:
        """A second writable manager in this process takes over (the takeover cases above);
        readers open alongside; the lock goes with the writer's close()."""
        first = CheckpointManager(tmp_path)
        second = CheckpointManager(tmp_path)
        with pytest.raises(SupersededError):
            first.save(1, {"s": [1]})
        CheckpointManager(tmp_path, read_only=True).close()
        first.close()
        second.close()
        CheckpointManager(tmp_path).close()

    def test_failed_open_releases_the_lock(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """If the constructor fails after locking, the directory is not left locked."""

        def broken(*args: Any) -> None:
            raise OSError("cleanup failed")

        monkeypatch.setattr(_posix.PosixStorage, "clean_leftovers", broken)
        with pytest.raises(OSError, match="cleanup failed"):
            CheckpointManager(tmp_path)
        monkeypatch.undo()
        CheckpointManager(tmp_path).close()

    def test_forked_child_does_not_keep_the_directory_locked(self, tmp_path: Path) -> None:
        """A fork-started worker alive after close() does not block the next writer."""
        mgr = CheckpointManager(tmp_path, async_save=False)
        go_read, go_write = os.pipe()
        ready_read, ready_write = os.pipe()
        with warnings.catch_warnings():  # JAX, if another test started it, warns on any fork
            warnings.simplefilter("ignore", RuntimeWarning)
            pid = os.fork()
        if (
            pid == 0
        ):  # the child (fork hooks have run): report, wait until told, leave without cleanup
            os.write(ready_write, b"r")
            os.read(go_read, 1)
            os._exit(0)
        try:
            assert os.read(ready_read, 1) == b"r"
            mgr.close()
            CheckpointManager(tmp_path).close()
        finally:
            os.write(go_write, b"x")
            os.waitpid(pid, 0)
            for fd in (go_read, go_write, ready_read, ready_write):
                os.close(fd)

    def test_manager_dropped_without_close_releases_the_lock(self, tmp_path: Path) -> None:
        """Garbage-collecting an unclosed writer frees the directory for the next one."""
        mgr = CheckpointManager(tmp_path, async_save=False)
        mgr.save(1, {"s": [1]})
        del mgr
        gc.collect()
        with CheckpointManager(tmp_path) as again:
            assert again.all_steps() == [1]

    def test_a_second_writer_process_is_refused(self, tmp_path: Path) -> None:
        holder = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; from cairn.manager import CheckpointManager; "
                "m = CheckpointManager(sys.argv[1]); print('ready', flush=True); sys.stdin.readline()",
                str(tmp_path),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
            with pytest.raises(DirectoryLockedError, match=rf"held by .* pid {holder.pid}"):
                CheckpointManager(tmp_path)
            with CheckpointManager(tmp_path, read_only=True) as reader:  # readers are welcome
                assert reader.all_steps() == []
        finally:
            holder.communicate("\n", timeout=60)
        with CheckpointManager(tmp_path):  # released when the holder exits
            pass


class TestMemory:
    """memory:// directories hold a lease as object stores do."""

    def test_memory_directories_are_taken_over_too(self) -> None:
        url = f"memory://takeover-{os.getpid()}"
        old = CheckpointManager(url)
        old.save(1, {"s": [1]})
        with CheckpointManager(url) as new:
            assert new.all_steps() == [1]
            new.save(2, {"s": [2]})
            with pytest.raises(SupersededError):
                old.save(3, {"s": [3]})
        old.close()

    @pytest.mark.parametrize("change", ["delete", "record_metrics", "save"])
    def test_a_writer_that_lost_its_lease_changes_nothing(self, change: str) -> None:
        """Not only commits check the lease: a delete and late metrics by a writer whose lease
        another writer took over raise DirectoryLockedError and change nothing, as a save does."""
        url = f"memory://lost-{change}-{os.getpid()}-{time.monotonic_ns()}"
        with CheckpointManager(url, async_save=False) as mgr:
            mgr.save(1, {"state": {"w": np.arange(3)}, "extra": {"x": 1}}, metrics={"loss": 1.0})
            store = put_lease(url, "elsewhere:123:abcdef01", time.time() + 600)  # taken over
            before = {k: store.read(k) for k in store.list_keys() if k != LOCK}
            with pytest.raises((DirectoryLockedError, CommitError), match="lease"):
                if change == "delete":
                    mgr.delete(1)
                elif change == "record_metrics":
                    mgr.record_metrics(1, {"eval": 2.0})
                else:
                    mgr.save(2, {"state": {"w": np.arange(3)}, "extra": {"x": 2}})
            after = {k: store.read(k) for k in store.list_keys() if k != LOCK}
            assert after == before
            assert lease_of(store)["owner"] == "elsewhere:123:abcdef01"
            with contextlib.suppress(DirectoryLockedError, CommitError):
                mgr.close()


class LeaseContract:
    """The lease object of an object store: taken over in this process, refused while another
    host's is live, taken over once its writer cannot come back. A subclass gives the bucket."""

    @pytest.fixture
    def lease_bucket(self) -> str:
        raise NotImplementedError

    def test_a_second_writer_in_this_process_takes_the_lease_over(self, lease_bucket: str) -> None:
        """In one process the newer manager takes over (TestPosix's takeover cases): a lease of
        its own; the old manager's close() deletes nothing of it."""
        url = f"{lease_bucket}/lease"
        store = ObjectStore(url, StorageOptions())
        old = CheckpointManager(url)
        old.save(1, {"state": state(1)})
        first_owner = lease_of(store)["owner"]
        with CheckpointManager(url) as new:
            assert new.all_steps() == [1]  # the old one's pending save, committed first
            assert lease_of(store)["owner"] != first_owner
            with pytest.raises(SupersededError):
                old.save(2, {"state": state(2)})
            old.close()
            assert lease_of(store)["owner"] != first_owner  # still the new manager's
            new.save(2, {"state": state(2)})
            new.wait_until_finished()
            with CheckpointManager(url, read_only=True) as reader:
                assert reader.all_steps() == [1, 2]
        assert store.read(LOCK) is None  # released at close

    def test_a_live_lease_of_another_host_is_refused(self, lease_bucket: str) -> None:
        url = f"{lease_bucket}/held"
        store = put_lease(url, "elsewhere:123:abcdef01", time.time() + 600)
        with pytest.raises(
            DirectoryLockedError, match=r"held by another writable .*\(elsewhere:123:"
        ):
            CheckpointManager(url)
        assert lease_of(store)["owner"] == "elsewhere:123:abcdef01"  # left alone
        with CheckpointManager(url, read_only=True) as reader:  # readers need no lease
            assert reader.all_steps() == []

    @pytest.mark.parametrize("lease", ["expired", "of a dead process here", "unreadable"])
    def test_a_dead_writers_lease_is_taken_over(self, lease_bucket: str, lease: str) -> None:
        """A lease whose writer cannot come back: expired (another host's, not refreshed for an
        hour), or held by a process of this host that no longer runs, or not a lease at all."""
        url = f"{lease_bucket}/dead"
        if lease == "expired":
            store = put_lease(url, "elsewhere:123:abcdef01", time.time() - 1)
        elif lease == "of a dead process here":
            gone = subprocess.Popen([sys.executable, "-c", "pass"])
            gone.wait()
            store = put_lease(url, f"{socket.gethostname()}:{gone.pid}:abcdef01", time.time() + 600)
        else:
            store = ObjectStore(url, StorageOptions())
            store.write(LOCK, b"not json")
        with CheckpointManager(url) as mgr:
            held = lease_of(store)
            assert held["owner"].startswith(f"{socket.gethostname()}:{os.getpid()}:")
            mgr.save(1, {"state": state(1)})
            mgr.wait_until_finished()
            assert lease_of(store)["expires"] > held["expires"]  # refreshed by the commit
        assert store.read(LOCK) is None  # released at close


class TestS3(LeaseContract):
    """The lease on S3 (a real moto server), and a writer whose lease was taken over commits
    nothing (its manifest's write is conditional on its claim, which moto honours)."""

    @pytest.fixture
    def lease_bucket(self, s3_bucket: str) -> str:
        return s3_bucket

    @pytest.mark.parametrize("where", ["after the upload", "after the lease check"])
    def test_a_writer_whose_lease_was_taken_over_commits_nothing(
        self, s3_bucket: str, gate: Gate, monkeypatch: pytest.MonkeyPatch, where: str
    ) -> None:
        """Writer A has uploaded step 2 when its expired lease is taken over by writer B, whose start
        removes A's claimed, uncommitted step. A must not commit it (nor anything later) and must say
        why; B never lists A's step, and B's own saves work."""
        url = f"{s3_bucket}/takeover"
        store = ObjectStore(url, StorageOptions())
        monkeypatch.setattr(_lease, "LEASE_SECONDS", -1.0)  # A's lease is expired once written
        # B stands for a writer on another host: not this process's graceful takeover.
        monkeypatch.setattr(takeover, "take_over", lambda key, manager: None)
        a = CheckpointManager(url)
        try:
            a.save(1, {"state": state(1)})
            a.wait_until_finished()
            hold(where, gate, monkeypatch)
            a.save(2, {"state": state(2)})
            assert gate.entered.wait(60)  # step 2 is uploaded and claimed, not committed
            assert store.list_keys("checkpoint_2/state/")
            monkeypatch.setattr(_lease, "LEASE_SECONDS", 3600.0)
            with CheckpointManager(url) as b:  # takes A's lease over, removes A's step 2
                assert b.all_steps() == [1]
                assert store.list_keys("checkpoint_2/") == []
                gate.release.set()
                with pytest.raises(
                    CommitError, match=r"lease \.cairn\.lock was taken over by \S+:\d+:"
                ):
                    a.wait_until_finished()
                assert a.all_steps() == [1]
                assert f"checkpoint_2/{MANIFEST}" not in store.list_keys("checkpoint_2/")
                b.reload()
                assert b.all_steps() == [1]
                a.save(3, {"state": state(3)})  # a writer that lost its lease commits nothing more
                with pytest.raises(CommitError, match="commits nothing more") as lost:
                    a.wait_until_finished()
                assert isinstance(lost.value.__cause__, DirectoryLockedError)
                a.close()  # leaves B's lease alone
                for step in (2, 3, 4):
                    b.save(step, {"state": state(step)})
                b.wait_until_finished()
                assert b.all_steps() == [1, 2, 3, 4]
            with CheckpointManager(url, read_only=True) as reader:
                assert reader.all_steps() == [1, 2, 3, 4]
                for step in (1, 2, 3, 4):
                    assert_tree_equal(reader.restore(step, fallback=False)["state"], state(step))
        finally:
            gate.release.set()
            a.close()


class TestGcs(LeaseContract):
    """The lease on GCS (a real fake-gcs-server). The emulator ignores the conditions of
    TensorStore's writes (tests/manager/test_gcs_emulator.py), so a writer whose lease was taken
    over is tested on S3 only."""

    @pytest.fixture
    def lease_bucket(self, gcs_bucket: str) -> str:
        return gcs_bucket
