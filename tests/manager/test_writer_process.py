"""writer="process": a save survives its trainer; a writer that dies or fails is reported and
replaced; nothing partial is left, and no shared memory outlives the processes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import writer_trainer
from support.logwait import logged
from support.writer_items import Killer, Raiser

from cairn.handlers import InMemoryHandler
from cairn.manager import CheckpointManager, KeepLatest
from cairn.manager._format import StepNames
from cairn.manager._storage.objectstore import KvStorage, StorageOptions
from cairn.manager.errors import (
    BarrierTimeoutError,
    CommitError,
    DirectoryLockedError,
    WriterProcessError,
    WriterTimeoutError,
)

TESTS = Path(__file__).resolve().parent.parent
TRAINER = TESTS / "writer_trainer.py"


def wait_exit(pid: int, timeout: float = 120.0) -> None:
    """Until process `pid` (not our child) has exited; fails after `timeout`."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
        assert ready, f"process {pid} still runs after {timeout} s"
    finally:
        os.close(fd)


def cairn_memfds() -> set[int]:
    """The inodes of cairn's staging memfds this process has open."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:cairn-stage"):
                found.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
        except OSError:
            continue
    return found


def assert_restores(directory: Path | str, seed: int, steps: list[int], *, writable: bool) -> None:
    with CheckpointManager(directory, read_only=not writable) as mgr:
        assert mgr.all_steps() == steps
        for step in mgr.all_steps():
            got = mgr.restore(step)
            want = writer_trainer.state(seed, step)
            for key in ("w", "emb", "b"):
                np.testing.assert_array_equal(got["state"]["params"][key], want["params"][key])
            assert got["state"]["step"] == step
            assert got["meta"] == {"step": step}
            assert mgr.verify(step) == []


def run_trainer(directory: Path | str, *args: str, logs: Path | None = None) -> dict[str, str]:
    """Run writer_trainer.py until it has killed itself; the lines it printed, by first word.
    Its output goes to files (`logs`, beside a local directory by default): a pipe would stay
    open as long as its writer process runs."""
    base = logs or Path(directory)
    out, err = base.with_suffix(".out"), base.with_suffix(".err")
    with open(out, "w") as stdout, open(err, "w") as stderr:
        code = subprocess.Popen(
            [sys.executable, str(TRAINER), str(directory), *args],
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,  # a process group of its own (--interrupt signals it)
        ).wait(timeout=300)
    assert code == -9, err.read_text()[-3000:]
    return dict(line.split(" ", 1) for line in out.read_text().splitlines() if " " in line)


class Waits(logging.Handler):
    """Counts the new trainer's waits for an old writer (the warning cairn logs)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += "is finishing its commits; waiting for it" in record.getMessage()


def trainer_trial(
    directory: Path | str,
    seed: int,
    steps: int,
    *,
    reopen_at_once: bool,
    waits: Waits,
    logs: Path | None = None,
) -> None:
    """A trainer saves `steps` steps and SIGKILLs itself right after the last save() returns:
    every step handed over commits, and restores equal to what was saved."""
    lines = run_trainer(directory, str(seed), str(steps), logs=logs)
    writer = int(lines["WRITER"])
    listed = lines.get("LISTED", "").split()
    # The kill landed while the last step was still the writer's alone.
    assert f"checkpoint_{steps}" not in listed, listed
    if reopen_at_once:  # a restarted trainer: it waits for the old writer, then goes on
        logging.getLogger("cairn").addHandler(waits)
        try:
            assert_restores(directory, seed, kept(steps), writable=True)
        finally:
            logging.getLogger("cairn").removeHandler(waits)
        wait_exit(writer, timeout=1)  # it had exited by the time the lock was free
    else:
        wait_exit(writer)
        assert_nothing_half_written(directory)
        assert_restores(directory, seed, kept(steps), writable=False)


def kept(steps: int) -> list[int]:
    """What KeepLatest(3) keeps of steps 1..`steps`: the trainer applies it after each answer
    it lived to get, the orphaned writer after its last commit."""
    return list(range(max(1, steps - 2), steps + 1))


def assert_nothing_half_written(directory: Path | str) -> None:
    """After an orphaned writer exited: no step half-written, and the directory is free."""
    if isinstance(directory, Path):
        # (A .trash-* entry may be left: retention runs in the trainer, and the kill can land
        # while it frees a retired step; the next start removes it.)
        assert [n for n in os.listdir(directory) if ".tmp-" in n] == []
        return
    storage = KvStorage(directory, StorageOptions())
    try:  # a prefix cairn claimed and never committed (a retired step's may be left, as above)
        found = storage._scan(StepNames())
        assert [n for listed, n, deleting in found if listed is None and not deleting] == []
        # The orphaned writer let the lease go: a trainer on another host need not wait an hour.
        assert storage.store.read(".cairn.lock") is None
    finally:
        storage.close()


def trials(
    place: Callable[[int], Path | str], count: int, first_seed: int, most_steps: int, logs: Path
) -> None:
    waits = Waits()
    for trial in range(count):
        trainer_trial(
            place(trial),
            seed=first_seed + trial,
            steps=2 + trial % (most_steps - 1),
            reopen_at_once=trial % 2 == 0,
            waits=waits,
            logs=logs / str(trial),
        )
    print(f"{count} trainers killed; {waits.count} of {count // 2 + count % 2} restarts waited")


@pytest.mark.parametrize("count", [4, pytest.param(10, marks=pytest.mark.slow)])
def test_handed_over_steps_commit_after_the_trainer_is_killed(tmp_path: Path, count: int) -> None:
    """4 trainers killed microseconds after save() returns, after 2, 3, 4 and 2 saves, every
    other one restarted at once (10 and, below, 100 in `make soak`)."""
    trials(lambda trial: tmp_path / str(trial), count, 0, 4, tmp_path)


@pytest.mark.slow
def test_handed_over_steps_commit_after_the_trainer_is_killed_soak(tmp_path: Path) -> None:
    trials(lambda trial: tmp_path / str(trial), 100, 1000, 5, tmp_path)


@pytest.mark.parametrize(
    ("store", "count"), [("s3", 2), ("gcs", 2), pytest.param("s3", 4, marks=pytest.mark.slow)]
)
def test_handed_over_steps_commit_to_an_object_store_after_the_trainer_is_killed(
    tmp_path: Path, request: pytest.FixtureRequest, store: str, count: int
) -> None:
    """The same on S3 (moto) and GCS (fake-gcs-server): the writer shares the trainer's lease,
    a restarted trainer waits for it, and an orphaned writer deletes the lease once done."""
    bucket = request.getfixturevalue(f"{store}_bucket")
    trials(lambda trial: f"{bucket}/run{trial}", count, 100, 4, tmp_path)


@pytest.mark.slow
def test_handed_over_steps_commit_to_s3_after_the_trainer_is_killed_soak(
    tmp_path: Path, s3_bucket: str
) -> None:
    trials(lambda trial: f"{s3_bucket}/run{trial}", 30, 2000, 5, tmp_path)


@pytest.fixture
def importable_items(monkeypatch: pytest.MonkeyPatch) -> None:
    """Writer processes started by this test can import writer_items (the misbehaving items)."""
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    )


def small_state(step: int) -> dict[str, Any]:
    return {"w": np.full((256, 256), step, np.float32), "b": np.arange(step + 1)}


def test_a_writer_killed_mid_commit_leaves_nothing_and_the_next_save_starts_another(
    tmp_path: Path, importable_items: None
) -> None:
    before = cairn_memfds()
    mgr = CheckpointManager(tmp_path, writer="process", handlers={"boom": Killer()})
    mgr.save(1, {"state": small_state(1)})
    mgr.wait_until_finished()
    first = mgr._commits.remote
    assert first is not None
    mgr.save(2, {"state": small_state(2), "boom": None})
    with pytest.raises(CommitError, match="commit of step 2") as info:
        mgr.wait_until_finished()
    cause = info.value.__cause__
    assert isinstance(cause, WriterProcessError)
    assert f"pid {first.pid}) was killed by SIGKILL" in str(cause)
    assert "step 2 was not committed" in str(cause)
    assert mgr.all_steps() == [1]
    # The step it was writing is no step, and the next start removes what it left.
    assert [n for n in os.listdir(tmp_path) if n.startswith("checkpoint_2")] != []
    mgr.save(3, {"state": small_state(3)})
    mgr.wait_until_finished()
    assert mgr._commits.remote is not first and mgr._commits.remote is not None
    np.testing.assert_array_equal(mgr.restore(3)["state"]["w"], small_state(3)["w"])
    mgr.close()
    # The kept error's traceback reaches step 2's snapshot: it holds no shared memory.
    assert info.value is not None and cairn_memfds() - before == set()
    with CheckpointManager(tmp_path) as again:
        assert again.all_steps() == [1, 3]
    assert sorted(os.listdir(tmp_path)) == [".cairn.lock", "checkpoint_1", "checkpoint_3"]


def stop(pid: int) -> None:
    """SIGSTOP our child `pid`; return once it is stopped (waitid reports it, and leaves it)."""
    os.kill(pid, signal.SIGSTOP)
    os.waitid(os.P_PID, pid, os.WSTOPPED | os.WNOWAIT)


def within(seconds: float, call: Callable[[], object], stopped: int) -> BaseException | None:
    """Run `call` on a thread; what it raised. Fails the test if it is still running after
    `seconds`, once the `stopped` writer is killed so that nothing is left waiting on it."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as e:
            raised.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        with contextlib.suppress(ProcessLookupError):
            os.kill(stopped, signal.SIGKILL)
        thread.join(60)
        pytest.fail(f"still waiting for the stopped writer process after {seconds} s")
    return raised[0] if raised else None


def files_of(directory: Path) -> dict[str, tuple[int, int, str]]:
    """Every file under `directory`: its size, mtime and content hash."""
    found = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            info = path.stat()
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            found[str(path.relative_to(directory))] = (info.st_size, info.st_mtime_ns, digest)
    return found


def test_a_stopped_writer_fails_its_save_within_the_barrier_timeout(tmp_path: Path) -> None:
    """A writer stopped (SIGSTOP) with a save handed to it shows no sign of life: after
    barrier_timeout the save fails with WriterTimeoutError naming the pid, the step and the
    bound, the writer is killed, the steps committed before are untouched, and the next save
    starts a new writer. (Before, wait_until_finished waited for ever.)"""
    bound = 3.0
    mgr = CheckpointManager(tmp_path, writer="process", barrier_timeout=bound)
    mgr.save(1, {"state": small_state(1), "meta": {"step": 1}})
    mgr.wait_until_finished()
    committed = files_of(tmp_path / "checkpoint_1")
    assert mgr._commits.remote is not None
    pid = mgr._commits.remote.pid
    stop(pid)
    mgr.save(2, {"state": small_state(2)})  # handed over: it waits in the socket
    started = time.monotonic()
    error = within(bound + 30, mgr.wait_until_finished, pid)
    took = time.monotonic() - started
    assert isinstance(error, CommitError), error
    assert "the commit of step 2 failed" in str(error)
    cause = error.__cause__
    assert isinstance(cause, WriterTimeoutError)
    assert isinstance(cause, WriterProcessError) and isinstance(cause, BarrierTimeoutError)
    assert isinstance(cause, TimeoutError)
    message = str(cause)
    assert f"writer process (pid {pid}) showed no sign of life for 3 s (barrier_timeout)" in message
    assert "while step 2 was due" in message and "stopped (SIGSTOP" in message
    assert "step 2 was not committed" in message and "raise barrier_timeout" in message
    assert took < bound + 10, took
    wait_exit(pid, timeout=10)  # killed (a stopped process too)
    mgr.check_for_errors()  # raised once
    assert mgr.all_steps() == [1]
    assert files_of(tmp_path / "checkpoint_1") == committed
    got = mgr.restore(1)
    np.testing.assert_array_equal(got["state"]["w"], small_state(1)["w"])
    assert got["meta"] == {"step": 1}
    mgr.save(3, {"state": small_state(3)})  # a new writer process
    mgr.wait_until_finished()
    assert mgr._commits.remote is not None and mgr._commits.remote.pid != pid
    started = time.monotonic()
    assert within(30, mgr.close, pid) is None
    assert time.monotonic() - started < 10
    with CheckpointManager(tmp_path) as again:
        assert again.all_steps() == [1, 3]
        np.testing.assert_array_equal(again.restore(3)["state"]["w"], small_state(3)["w"])
    assert sorted(os.listdir(tmp_path)) == [".cairn.lock", "checkpoint_1", "checkpoint_3"]


@pytest.mark.parametrize("in_flight", [False, True])
def test_close_with_a_stopped_writer_returns_within_the_barrier_timeout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, in_flight: bool
) -> None:
    """close() waits for a stopped writer as long as for a barrier, then kills it and says so
    (before, 300 s whatever barrier_timeout said; with a save in flight, for ever)."""
    bound = 2.0
    mgr = CheckpointManager(tmp_path, writer="process", barrier_timeout=bound)
    mgr.save(1, {"state": small_state(1)})
    mgr.wait_until_finished()
    assert mgr._commits.remote is not None
    pid = mgr._commits.remote.pid
    stop(pid)
    if in_flight:
        mgr.save(2, {"state": small_state(2)})
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="cairn"):
        error = within(bound + 30, mgr.close, pid)
    assert time.monotonic() - started < bound + 10
    if in_flight:  # the commit's error, as close raises any
        assert isinstance(error, CommitError) and "the commit of step 2 failed" in str(error)
        assert isinstance(error.__cause__, WriterTimeoutError)
        assert f"pid {pid}) showed no sign of life for 2 s" in caplog.text
    else:
        assert error is None
        assert f"closing the writer process (pid {pid}); waiting up to 2 s" in caplog.text
        assert f"(pid {pid}) did not exit within 2 s of close" in caplog.text
        assert "stopped (SIGSTOP or a terminal stop)); killing it (SIGKILL)" in caplog.text
    wait_exit(pid, timeout=10)
    with CheckpointManager(tmp_path) as again:  # the directory was let go
        assert again.all_steps() == [1]
    assert sorted(os.listdir(tmp_path)) == [".cairn.lock", "checkpoint_1"]


def test_a_writer_waiting_at_a_meeting_tells_its_trainer_it_lives(tmp_path: Path) -> None:
    """A writer process waiting for the other processes' writers (bounded by barrier_timeout
    too) says so about once a second, so that its trainer's bound on its silence does not
    end the wait first: the wait ends with its own BarrierTimeoutError."""
    from cairn.manager._core.writer import StoredMeetings
    from cairn.manager._storage.open import open_storage

    said: list[float] = []
    storage = open_storage(tmp_path, None)
    meetings = StoredMeetings(storage, 1, 2, 0, alive=lambda: said.append(time.monotonic()))
    started = time.monotonic()
    with pytest.raises(BarrierTimeoutError, match=r"processes \[0\] did not reach"):
        meetings.barrier("cairn/checkpoint_1.tmp-ab/created", 2.5)
    assert len(said) >= 2 and said[0] - started < 0.5, [t - started for t in said]
    storage.close()


def test_an_error_in_the_writer_reaches_the_trainer_with_its_traceback(
    tmp_path: Path, importable_items: None
) -> None:
    with CheckpointManager(tmp_path, writer="process", handlers={"bad": Raiser()}) as mgr:
        mgr.save(1, {"state": small_state(1), "bad": None})
        with pytest.raises(CommitError, match="boom in pid") as info:
            mgr.wait_until_finished()
        error = info.value.__cause__
        assert isinstance(error, ValueError)
        assert f"handed over by pid {os.getpid()}" in str(error)
        assert mgr._commits.remote is not None
        assert f"boom in pid {mgr._commits.remote.pid}" in str(error)  # raised in the writer
        remote = str(error.__cause__)  # the writer's traceback, from its commit to the raise
        assert "in commit_step" in remote and "writer_items.py" in remote, remote
        assert mgr.all_steps() == []
        assert [n for n in os.listdir(tmp_path) if n.startswith("checkpoint_")] == []
        mgr.save(2, {"state": small_state(2)})  # the same writer goes on
        mgr.wait_until_finished()
        assert mgr.all_steps() == [2]


def test_close_ends_the_writer_and_frees_the_shared_memory(tmp_path: Path) -> None:
    import jax.numpy as jnp

    state = {"w": jnp.arange(1 << 20, dtype=jnp.float32), "n": np.ones((64, 64))}
    before = cairn_memfds()
    mgr = CheckpointManager(tmp_path, writer="process", keep=KeepLatest(2))
    for step in range(1, 5):
        mgr.save(step, {"state": state, "config": {"lr": 0.1, "step": step}})
    mgr.wait_until_finished()
    assert mgr.all_steps() == [3, 4]  # retention runs in the trainer, after each answer
    assert cairn_memfds() - before  # the pool keeps its slabs between saves
    writer = mgr._commits.remote
    assert writer is not None
    got = mgr.restore(4)
    np.testing.assert_array_equal(got["state"]["w"], np.arange(1 << 20, dtype=np.float32))
    assert got["config"] == {"lr": 0.1, "step": 4}
    info = mgr.info(4)
    assert info.telemetry["blocked_s"] > 0
    mgr.close()
    wait_exit(writer.pid, timeout=1)
    assert cairn_memfds() - before == set()


def test_a_save_changed_after_it_returned_commits_what_was_handed_over(tmp_path: Path) -> None:
    """The snapshot is the writer's once save() returns: the trainer's arrays may change."""
    arr = np.zeros((512, 512), np.float32)
    with CheckpointManager(tmp_path, writer="process", max_pending=2) as mgr:
        mgr.save(1, {"state": {"a": arr}})
        arr[:] = 7  # the NumPy array itself, at once
        mgr.save(2, {"state": {"a": arr}})
        arr[:] = 9
        mgr.wait_until_finished()
        assert float(mgr.restore(1)["state"]["a"].max()) == 0.0
        assert float(mgr.restore(2)["state"]["a"].min()) == 7.0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"writer": "proc"}, "writer must be 'thread' or 'process', got 'proc'"),
        ({"writer": "process", "async_save": False}, "needs async_save=True"),
        ({"writer": "process", "zero_copy": True}, "zero_copy=True"),
        ({"writer": "process", "incremental": True}, "incremental=True"),
    ],
)
def test_options_that_cannot_go_with_a_writer_process(
    tmp_path: Path, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        CheckpointManager(tmp_path, **options)
    assert os.listdir(tmp_path) == []


def test_memory_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"cannot commit into memory://wp: a writer process"):
        CheckpointManager("memory://wp", writer="process")


@pytest.fixture(params=["s3", "gcs"])
def bucket(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(f"{request.param}_bucket"))


def test_on_an_object_store_the_writer_commits_under_the_trainers_lease(bucket: str) -> None:
    """The writer refreshes the lease at each commit and the trainer's retention checks it:
    neither takes the other's write for a takeover. The lease names the writer; close
    deletes it."""
    url = f"{bucket}/run"
    mgr = CheckpointManager(url, writer="process", keep=KeepLatest(2), max_pending=2)
    lease = mgr._storage.store  # type: ignore[attr-defined]
    for step in range(1, 5):
        mgr.save(step, {"state": small_state(step), "meta": {"step": step}})
        held = json.loads(lease.read(".cairn.lock"))
        assert mgr._commits.remote is not None and held["writer"] == mgr._commits.remote.pid
    mgr.wait_until_finished()
    assert mgr.all_steps() == [3, 4]  # the trainer's retention, after the writer's commits
    for step in (3, 4):
        got = mgr.restore(step)
        np.testing.assert_array_equal(got["state"]["w"], small_state(step)["w"])
        assert got["meta"] == {"step": step}
        assert mgr.verify(step) == []
    writer = mgr._commits.remote
    mgr.close()
    assert writer is not None
    wait_exit(writer.pid, timeout=1)
    assert lease.read(".cairn.lock") is None
    with CheckpointManager(url, read_only=True) as again:
        assert again.all_steps() == [3, 4]


def test_a_lease_naming_a_live_writer_of_a_dead_trainer_is_waited_for_then_refused(
    s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crafted lease: its trainer's pid is gone, its writer's pid is a live process that
    never exits and runs cairn's writer (its command line names cairn.manager._core.writer). A new
    manager waits for that process (bounded), then refuses, naming it; once that process is
    gone too, the lease is taken over at once (not after its hour). A live process that runs
    no writer (any pid a crafted lease names) is not waited for: taken over at once."""
    from cairn.manager._storage import lease as _lease
    from cairn.manager._storage import objectstore as _objectstore

    url = f"{s3_bucket}/run"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    other = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        owner = f"{socket.gethostname()}:{gone.pid}:crafted"
        body = {"owner": owner, "expires": time.time() + 3600, "writer": other.pid}
        _objectstore.ObjectStore(url, _objectstore.StorageOptions()).write(
            ".cairn.lock", json.dumps(body).encode()
        )
        CheckpointManager(url, writer="process").close()  # taken over, not waited for
    finally:
        assert other.stdin is not None
        other.stdin.close()
        other.wait(timeout=30)
    alive = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()  # cairn.manager._core.writer"],
        stdin=subprocess.PIPE,
    )
    store = _objectstore.ObjectStore(url, _objectstore.StorageOptions())
    owner = f"{socket.gethostname()}:{gone.pid}:crafted"
    body = {"owner": owner, "expires": time.time() + 3600, "writer": alive.pid}
    store.write(".cairn.lock", json.dumps(body).encode())
    monkeypatch.setattr(_lease, "WRITER_WAIT_S", 0.5)
    try:
        with pytest.raises(
            DirectoryLockedError, match=f"{owner}, with its writer process pid {alive.pid}\\)"
        ):
            CheckpointManager(url, writer="process")
        assert json.loads(store.read(".cairn.lock") or b"{}") == body  # untouched
    finally:
        assert alive.stdin is not None
        alive.stdin.close()
        alive.wait(timeout=30)
    with CheckpointManager(url, writer="process") as mgr:  # both gone: taken over at once
        mgr.save(1, {"state": small_state(1)})
    assert CheckpointManager(url, read_only=True).all_steps() == [1]
    # pids no process can have, and a writer that is not a pid: no process, taken over at once
    for writer in (2**80, -1, "1", True, None):
        owner = f"{socket.gethostname()}:{2**80}:crafted"
        body = {"owner": owner, "expires": time.time() + 3600, "writer": writer}
        store.write(".cairn.lock", json.dumps(body).encode())
        CheckpointManager(url, writer="process").close()
    # an owner whose pid is not one (a superscript digit): not known to be gone, so held
    body = {"owner": f"{socket.gethostname()}:\u00b2:crafted", "expires": time.time() + 3600}
    store.write(".cairn.lock", json.dumps(body).encode())
    with pytest.raises(DirectoryLockedError, match="crafted"):
        CheckpointManager(url, writer="process")


def test_an_item_that_cannot_be_sent_is_refused_by_name_and_nothing_changes(
    tmp_path: Path,
) -> None:
    with CheckpointManager(tmp_path, writer="process", handlers={"fake": InMemoryHandler()}) as mgr:
        mgr.save(1, {"state": small_state(1)})
        mgr.wait_until_finished()
        with pytest.raises(TypeError, match=r"item 'fake': writer='process' .* cannot be pickled"):
            mgr.save(2, {"state": small_state(2), "fake": {"x": 1}})
        assert not mgr.is_saving_in_progress()
        mgr.save(3, {"state": small_state(3)})  # its slot and staging memory were given back
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 3]


def test_a_second_trainer_is_refused_while_the_first_and_its_writer_live(tmp_path: Path) -> None:
    """The lock names the live trainer and its writer; nobody waits for a trainer that lives."""
    with CheckpointManager(tmp_path, writer="process") as mgr:
        mgr.save(1, {"state": small_state(1)})
        mgr.wait_until_finished()
        assert mgr._commits.remote is not None
        code = (
            "import sys\n"
            "from cairn.manager import CheckpointManager\n"
            "from cairn.manager.errors import DirectoryLockedError\n"
            "try:\n"
            f"    CheckpointManager({str(tmp_path)!r})\n"
            "except DirectoryLockedError as e:\n"
            "    print(e)\n"
            "    sys.exit(3)\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert out.returncode == 3, out.stderr
        assert (
            f"pid {os.getpid()} (with its writer process, pid {mgr._commits.remote.pid}"
            in out.stdout
        )


FORKING_TRAINER = """
import os, signal, sys
import numpy as np
from cairn.manager import CheckpointManager
mgr = CheckpointManager(sys.argv[1], writer="process")
mgr.save(1, {"state": {"w": np.ones(1000)}})
mgr.wait_until_finished()
if os.fork() == 0:  # a data loader worker, say: lives on until the test closes stdin
    sys.stdin.read()
    os._exit(0)
mgr.save(2, {"state": {"w": np.zeros(1000)}})
print("WRITER", mgr._commits.remote.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_forked_child_of_the_trainer_does_not_keep_the_writer_waiting(tmp_path: Path) -> None:
    """A fork of the trainer (a data loader worker) closes its copy of the writer's socket, so
    the writer sees the trainer's death and exits while the fork lives on (without the fork
    hook the writer waits for the fork: checked by hand)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", FORKING_TRAINER, str(tmp_path / "run")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        line = proc.stdout.readline()
        assert line.startswith("WRITER "), proc.stderr.read()
        assert proc.wait(timeout=60) == -9
        wait_exit(int(line.split()[1]), timeout=60)  # while the fork waits on its stdin
    finally:
        proc.stdin.close()  # the fork ends
        proc.stdout.close()
        proc.stderr.close()
    with CheckpointManager(tmp_path / "run", read_only=True) as mgr:
        assert mgr.all_steps() == [1, 2]


@pytest.mark.parametrize("store", ["local", "s3"])
def test_a_restarted_trainer_waits_for_the_old_writer_then_finds_its_step(
    tmp_path: Path, importable_items: None, request: pytest.FixtureRequest, store: str
) -> None:
    """The old writer is held inside its last commit (a FIFO) while the new trainer opens the
    directory: the new trainer waits (for the lock; for the lease, which names the writer),
    and does not remove the step being committed."""
    fifo = tmp_path / "gate"
    os.mkfifo(fifo)
    directory: Path | str = tmp_path / "run"
    if store == "s3":
        directory = f"{request.getfixturevalue('s3_bucket')}/run"
    logs = tmp_path / "trainer"
    writer = int(run_trainer(directory, "7", "2", "--gate", str(fifo), logs=logs)["WRITER"])
    opened: list[Any] = []
    thread = threading.Thread(target=lambda: opened.append(CheckpointManager(directory)))
    try:
        with logged("is finishing its commits; waiting for it") as waiting:
            thread.start()
            assert waiting.wait(60), "the new trainer did not wait for the old writer"
        with open(fifo, "wb") as gate:  # let the old writer finish its commit
            gate.write(b"x")
        thread.join(120)
        assert not thread.is_alive()
    finally:
        if thread.is_alive():  # failed: end the old writer so the waiting thread ends too
            with contextlib.suppress(ProcessLookupError):
                os.kill(writer, signal.SIGKILL)
            thread.join(60)
    mgr = opened[0]
    try:
        assert mgr.all_steps() == [1, 2]
        assert mgr.restore(2, {"state": None})["state"]["step"] == 2
        assert mgr.verify(2) == []
    finally:
        mgr.close()
    wait_exit(writer, timeout=1)


def test_a_newer_manager_in_the_same_process_takes_over_from_one_with_a_writer(
    tmp_path: Path,
) -> None:
    old = CheckpointManager(tmp_path, writer="process")
    old.save(1, {"state": small_state(1)})
    writer = old._commits.remote
    assert writer is not None
    with CheckpointManager(tmp_path, writer="process") as new:  # waits for step 1, ends the writer
        assert writer._proc.returncode == 0
        assert new.all_steps() == [1]
        new.save(2, {"state": small_state(2)})
        new.wait_until_finished()
        assert new._commits.remote is not None and new._commits.remote.pid != writer.pid
    old.close()
    assert sorted(os.listdir(tmp_path)) == [".cairn.lock", "checkpoint_1", "checkpoint_2"]


def test_a_writer_that_cannot_start_fails_the_save_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with CheckpointManager(tmp_path, writer="process") as mgr:
        with monkeypatch.context() as patch:
            patch.setattr(sys, "executable", str(tmp_path / "no-python"))
            with pytest.raises(WriterProcessError, match="could not start a writer process"):
                mgr.save(1, {"state": small_state(1)})
        assert not mgr.is_saving_in_progress()
        assert mgr.all_steps() == []
        assert sorted(os.listdir(tmp_path)) == [".cairn.lock"]
        mgr.save(1, {"state": small_state(1)})  # the slot and the pool were given back
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1]


def test_a_ctrl_c_to_the_trainers_process_group_does_not_stop_its_writer(tmp_path: Path) -> None:
    """SIGINT to the trainer's process group (a Ctrl-C at the terminal), then the trainer's
    SIGKILL: the writer, in a session of its own, still commits the step it was handed."""
    lines = run_trainer(tmp_path / "run", "11", "2", "--interrupt")
    assert "checkpoint_2" not in lines["LISTED"].split()
    wait_exit(int(lines["WRITER"]))
    assert_restores(tmp_path / "run", 11, [1, 2], writable=False)


def test_meeting_files_a_crash_left_are_removed_at_start_and_nothing_else(
    tmp_path: Path, s3_bucket: str
) -> None:
    """Writer processes' meeting files left by a crash go at the next writable start; a link
    among them is removed, never followed; removal refuses any other name before it removes
    anything."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".cairn-sync-checkpoint_3.tmp-ab.created.0").write_bytes(b"")
    (run / ".cairn-sync-dir").mkdir()
    (run / ".cairn-sync-link").symlink_to(outside, target_is_directory=True)
    (run / "notes.cairn-sync-x").write_text("not a meeting file")
    with CheckpointManager(run, writer="process") as mgr:
        assert sorted(os.listdir(run)) == [".cairn.lock", "notes.cairn-sync-x"]
        for bad in (
            ["../outside"],
            [".cairn-sync-a", "../x"],
            ["/etc/passwd"],
            [".cairn-sync-a/b"],
        ):
            (run / ".cairn-sync-a").write_bytes(b"")
            with pytest.raises(ValueError, match="meeting file"):
                mgr._storage.remove_sync_files(bad)  # type: ignore[attr-defined]
            assert (run / ".cairn-sync-a").exists()  # nothing removed before the refusal
    assert (outside / "keep.txt").read_text() == "mine"
    url = f"{s3_bucket}/run"
    store = KvStorage(url, StorageOptions()).store
    for key in (".cairn-sync-checkpoint_3.tmp-ab.written.1", "checkpoint_1/.cairn-sync-x", "x"):
        store.write(key, b"{}")
    with CheckpointManager(url, writer="process"):
        assert store.list_keys() == [".cairn.lock", "checkpoint_1/.cairn-sync-x", "x"]


@pytest.mark.parametrize(
    "text",
    [
        "cairn-writer",
        "\u00b2 \u00b2 cairn-writer",
        f"{2**80} {2**80} cairn-writer",
        f"{2**80} 1 cairn-writer",
    ],
)
def test_a_crafted_lock_file_gives_a_clear_refusal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    """The lock is held (by this test, on its own open file) and the file says something no
    cairn wrote: the new manager raises DirectoryLockedError, after a bounded wait at most
    (pid 1 lives: waited for, as a writer would be), never another exception."""
    import fcntl

    from cairn.manager._storage import posix as _posix

    monkeypatch.setattr(_posix, "WRITER_WAIT_S", 0.2)
    with open(tmp_path / ".cairn.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write(text)
        held.flush()
        with pytest.raises(DirectoryLockedError, match="held by another writable"):
            CheckpointManager(tmp_path, writer="process")
    assert sorted(os.listdir(tmp_path)) == [".cairn.lock"]


def test_on_an_accelerator_the_host_copies_reach_the_writer_in_shared_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On GPU/TPU the snapshot is each shard's device-to-host copy. With a writer process those
    copies are staged into the shared slab too, so the job sent over the socket is the tree and
    the slab's descriptor, not the arrays pickled (which held save() for 1.5 s per GiB on an
    H200). The CPU backend made to pass for an accelerator."""
    import jax.numpy as jnp

    import cairn.handlers._train_state.handler as impl
    from cairn.manager._core import writer as _writer

    monkeypatch.setattr(impl, "_HOST_PLATFORMS", ())
    sent: list[tuple[int, int]] = []
    real = _writer.WriterProcess.send

    def send(self: Any, payload: bytes, fds: Any) -> None:
        sent.append((len(payload), len(fds)))
        real(self, payload, fds)

    monkeypatch.setattr(_writer.WriterProcess, "send", send)
    state = {"w": jnp.arange(1 << 20, dtype=jnp.float32), "b": jnp.ones(7, jnp.bfloat16)}
    with CheckpointManager(tmp_path, writer="process") as mgr:
        for step in (1, 2):
            mgr.save(step, {"state": {k: x * step for k, x in state.items()}})
        mgr.wait_until_finished()
        for step in (1, 2):
            got = mgr.restore(step)["state"]
            np.testing.assert_array_equal(got["w"], np.arange(1 << 20, dtype=np.float32) * step)
            np.testing.assert_array_equal(got["b"], np.full(7, step, got["b"].dtype))
    assert [fds for _, fds in sent] == [1, 1]  # a slab each
    assert max(size for size, _ in sent) < 64 << 10  # the state is 4 MiB
