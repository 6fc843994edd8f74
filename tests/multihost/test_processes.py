"""Barriers and broadcasts between 2 real jax.distributed processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path

import pytest
from conftest import Place
from launcher import launch

from cairn.manager import CheckpointManager
from cairn.manager._core.multihost import Processes
from cairn.manager._format import MANIFEST
from cairn.manager._storage.objectstore import ObjectStore, StorageOptions


def test_single_process_needs_no_coordination() -> None:
    """Without jax.distributed there is one process; barriers pass and broadcasts echo."""
    procs = Processes.detect()
    assert (procs.index, procs.count, procs.primary) == (0, 1, True)
    procs.barrier("x", 1)
    assert procs.broadcast("y", "v", 1) == "v"


def test_two_processes_meet_and_share_a_value(tmp_path: Path) -> None:
    """Both processes pass two barriers; the primary's value reaches the other."""
    results = launch("meet", tmp_path)
    for i, r in enumerate(results):
        assert r.returncode == 0, r.stderr[-2000:]
        assert f"ok meet {i}" in r.stdout


def test_a_dead_peer_gives_barrier_timeout_not_a_hang(tmp_path: Path) -> None:
    """Process 1 is SIGKILLed; process 0 raises BarrierTimeoutError within the 3 s timeout."""
    survivor, victim = launch("peer-dies", tmp_path)
    assert victim.returncode == -signal.SIGKILL
    assert survivor.returncode == 0, survivor.stderr[-2000:]
    line = next(line for line in survivor.stdout.splitlines() if line.startswith("timeout after"))
    waited = float(line.split()[2])
    assert 2.5 <= waited <= 15, line
    assert "barrier 'cairn-test/after-death' within 3 s" in line


def test_two_processes_save_retain_and_restore_into_other_shardings(place: Place) -> None:
    """Shards from each process, host data once; retention; 7 restore shardings; delete right
    after a save; a second manager on the same directory in the same processes, taking over
    while a save of the first is pending; no key left behind
    in the coordination service."""
    save_scenario(place, 2, timeout=180)


def save_scenario(place: Place, count: int, timeout: float) -> None:
    """The save scenario (`mh_worker.run_manager`) on `count` processes, and what it leaves."""
    results = launch("save", place.directory, count=count, timeout=timeout)
    for i, r in enumerate(results):
        assert r.returncode == 0, r.stderr[-3000:]
        assert "steps [1, 2]" in r.stdout and f"ok save {i}" in r.stdout
        assert "coordination keys []" in r.stdout or i != 0, r.stdout
    keys = place.listing()
    assert_packs_of_each_process(keys, "checkpoint_6", count)
    # delete(1), delete(2) right after save(5), save(6) pending as a second manager took over
    # and saved 7; nothing else
    assert place.steps() == ["checkpoint_5", "checkpoint_6", "checkpoint_7"], keys
    assert not [k for k in keys if "process-" in k and "state" not in k], keys


def test_incremental_saves_link_each_process_shards(place: Place) -> None:
    """Two processes save a frozen sharded array three times with incremental=True on a shared
    directory: every process links (on a bucket: copies on the server) its own shard files from
    the step before, and each step restores and verifies on both. On disk, the chunk files of
    steps 2 and 3 are the inodes step 1 wrote."""
    results = launch("incremental", place.directory)
    for i, r in enumerate(results):
        assert r.returncode == 0, r.stderr[-3000:]
        assert "steps [2, 3]" in r.stdout and f"ok incremental {i}" in r.stdout
    manifest = ObjectStore if "://" in place.directory else None
    for step in (2, 3):
        if manifest is not None:
            data = manifest(place.directory, StorageOptions()).read(f"checkpoint_{step}/{MANIFEST}")
        else:
            data = (Path(place.directory) / f"checkpoint_{step}" / MANIFEST).read_bytes()
        files = json.loads(data or b"{}")["items"]["state"]["files"]
        shared = sorted(f["path"] for f in files if f.get("reused"))
        small = [] if manifest is not None else ["zarr.json"]  # a bucket copies 1 MiB and up
        assert shared == [f"arrays/0/{n}" for n in ("0.0", "0.1", "1.0", "1.1", *small)]
    if manifest is not None:
        return
    tmp_path = Path(place.directory)
    chunks = sorted((tmp_path / "checkpoint_3" / "state" / "arrays" / "0").iterdir())
    assert [p.name for p in chunks] == ["0.0", "0.1", "1.0", "1.1", "zarr.json"]
    for chunk in chunks:  # both processes' shards: shared by steps 2 and 3 (1 is deleted)
        assert chunk.stat().st_nlink == 2, chunk
        assert (
            chunk.stat().st_ino
            == (tmp_path / "checkpoint_2" / chunk.relative_to(tmp_path / "checkpoint_3"))
            .stat()
            .st_ino
        )


@pytest.mark.parametrize("place", ["posix", "s3"], indirect=True)
def test_packed_layout_with_two_processes(place: Place) -> None:
    """Each process writes its shards into packs and an index of its own; the primary writes
    the host data; incremental saves link (copy, on a bucket) each process's unchanged pack;
    every step restores into two shardings on both processes and verifies."""
    results = launch("packed", place.directory)
    for i, r in enumerate(results):
        assert r.returncode == 0, r.stderr[-3000:]
        assert "steps [2, 3]" in r.stdout and f"ok packed {i}" in r.stdout
    files = json.loads(
        next(x for x in results[0].stdout.splitlines() if x.startswith("files "))[6:]
    )
    assert {f.split(".")[0] for f in files if f.startswith("packs/") and "index" not in f} == {
        "packs/0",
        "packs/1",
    }, files
    assert "packs/index.0.json" in files and "packs/index.1.json" in files
    written, total = results[0].stdout.split("written ")[1].split(" of ")
    assert all(w < 0.05 * float(total.split()[0]) for w in json.loads(written)), written


def test_clocks_that_disagree_still_agree_on_saving(tmp_path: Path) -> None:
    """A time-based policy: the primary decides and broadcasts, whatever the other's clock says."""
    results = launch("clock", tmp_path)
    lines = []
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        lines.append(next(line for line in r.stdout.splitlines() if line.startswith("decisions")))
    assert lines[0] == lines[1] == "decisions [True, True, True]"


@pytest.mark.parametrize("victim", [0, 1])
def test_sigkill_of_either_process_mid_save_commits_nothing(place: Place, victim: int) -> None:
    kill_one_and_resume(place, victim, "upload")


# On moto every conditional write is a HEAD, then the PUT (two on manifests: claim, commit).
HEADS: dict[str, dict[str, int]] = {"s3": {"HEAD manifest": 2, "HEAD other": 1}, "gcs": {}}

KILL_POINTS = ("upload", "written", "reported", "manifest", "committed")


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(12))
def test_sigkill_at_random_points_of_a_save(place: Place, trial: int) -> None:
    """make soak: 12 kills per backend (36 in all), each of a process and a point of the save
    drawn at random (seeded by the trial), each in a fresh directory."""
    rng = random.Random(trial)
    kill_one_and_resume(place, rng.choice([0, 1]), rng.choice(KILL_POINTS))


def kill_one_and_resume(place: Place, victim: int, point: str) -> None:
    """No hang and no partial step; a fresh pair resumes from the last committed step (step 3
    only if the victim died after the commit point).

    Another process dying: the primary raises BarrierTimeoutError within the 5 s timeout.
    The primary (process 0) dying takes JAX's coordination service with it: the other either
    raises BarrierTimeoutError at once (its next call fails) or is ended by JAX itself, which
    cannot go on without the coordinator. Either way it ends promptly, never hangs.
    """
    results = launch(
        "kill", place.directory, timeout=120, env={"CAIRN_TEST_KILL": f"{victim}:{point}"}
    )
    survivor = results[1 - victim]
    assert results[victim].returncode == -signal.SIGKILL, results[victim].stderr[-3000:]
    assert f"killing myself at {point}" in results[victim].stdout
    # The primary has every report once the other process passed the barrier: it commits.
    committed = point == "committed" or (victim == 1 and point == "manifest")
    if victim == 1 or survivor.returncode == 0:  # it noticed and raised
        assert survivor.returncode == 0, survivor.stderr[-3000:]
        line = next(
            line for line in survivor.stdout.splitlines() if line.startswith("commit failed")
        )
        assert float(line.split()[3]) <= 12 and "BarrierTimeoutError" in line, line
        assert "steps [1, 2]" in survivor.stdout
    else:  # JAX ended it first, having lost its coordinator
        assert "JAX distributed service detected fatal errors" in survivor.stderr
    with CheckpointManager(place.directory, read_only=True) as reader:
        assert reader.latest_step() == (3 if committed else 2), reader.all_steps()
    again = launch("resume", place.directory)
    latest = 3 if committed else 2
    for r in again:
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"resumed {latest} " in r.stdout, r.stdout
        assert f"steps after [{latest}, {latest + 1}]" in r.stdout, r.stdout
    # whatever the dead save left is gone: two whole steps and the lock (or lease)
    assert place.steps() == [f"checkpoint_{latest}", f"checkpoint_{latest + 1}"], place.listing()


@pytest.mark.parametrize("kind", ["posix", "s3"])
def test_writer_processes_commit_what_both_killed_trainers_handed_over(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """writer="process", one writer per process: both trainers SIGKILL themselves right after
    save(2) returns, taking the coordination service with them. The writers meet through the
    storage and commit step 2 with both processes' shards; no meeting file is left; a fresh
    pair resumes from step 2."""
    place = Place(str(tmp_path))
    if kind == "s3":
        place = Place(f"{request.getfixturevalue('s3_bucket')}/run")
    # launch() returns once the processes' pipes close: their writers, which inherit the
    # pipes, have exited by then too.
    results = launch("writer-kill", place.directory, timeout=180)
    for r in results:
        assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
        assert "committed-before-kill False" in r.stdout, (r.stdout, r.stderr[-3000:])
    with CheckpointManager(place.directory, read_only=True) as reader:
        assert reader.latest_step() == 2, reader.all_steps()
        assert reader.verify(2) == []
    keys = place.listing()
    assert not [k for k in keys if ".cairn-sync-" in k], keys
    assert_packs_of_each_process(keys, "checkpoint_2")
    if kind == "s3":
        assert ".cairn.lock" not in keys  # the primary's orphaned writer let the lease go
    again = launch("resume", place.directory)
    for r in again:
        assert r.returncode == 0, r.stderr[-3000:]
        assert "resumed 2 " in r.stdout and "steps after [2, 3]" in r.stdout, r.stdout


def test_a_writer_process_that_never_reports_leaves_no_step(tmp_path: Path) -> None:
    """writer="process": process 1's writer dies inside its write of step 2. The primary's
    writer waits for its report until the barrier timeout (5 s), commits nothing and removes
    the meeting files; each trainer gets its own error."""
    results = launch("writer-dies", tmp_path)
    for i, r in enumerate(results):
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"ok writer-dies {i}" in r.stdout and "steps [1]" in r.stdout, r.stdout
    assert "BarrierTimeoutError" in results[0].stdout, results[0].stdout
    assert "processes [1] did not reach" in results[0].stdout, results[0].stdout
    assert "WriterProcessError" in results[1].stdout and "SIGKILL" in results[1].stdout
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".cairn-sync-")]
    with CheckpointManager(tmp_path) as again:  # what the dead save left goes at the start
        assert again.all_steps() == [1]
    assert sorted(os.listdir(tmp_path)) == [".cairn.lock", "checkpoint_1"]


def test_each_process_saves_and_restores_its_own_iterator(place: Place) -> None:
    """One file per process in the item; each restores its own position; keep_items drops the
    item of the older step on every process's view."""
    results = launch("iterators", place.directory)
    for i, r in enumerate(results):
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"ok iterators {i}" in r.stdout
        assert "files ['process_0-of-2.json', 'process_1-of-2.json']" in r.stdout
    assert not [k for k in place.listing() if k.startswith("checkpoint_1/data/")]


@pytest.mark.parametrize("place", ["posix", "s3"], indirect=True)
def test_orbax_surface_with_two_processes(place: Place) -> None:
    """cairn.manager.orbax.CheckpointManager as MaxText uses it, on two processes: shards of a
    sharded state from each, a JSON item, each process's grain iterator, max_to_keep; a restart
    restores the state into its sharding and every iterator to its own position."""
    for i, r in enumerate(launch("orbax", place.directory)):
        assert r.returncode == 0, r.stderr[-3000:]
        assert "steps [2, 3]" in r.stdout and f"ok orbax {i}" in r.stdout, r.stdout
    assert place.steps() == ["2", "3"], place.listing()


def test_preemption_notice_to_one_process_saves_one_step_on_both(place: Place) -> None:
    """SIGTERM to process 1 only: through JAX's preemption sync point both save the same step,
    that save is committed when save() returns, and both stop there."""
    results = launch("preempt", place.directory)
    lines = []
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        lines.append(next(x for x in r.stdout.splitlines() if x.startswith("preempted at")))
    assert lines[0] == lines[1], lines
    step = int(lines[0].split()[2])
    assert step > 5 and lines[0].endswith(f"[{step}]")
    assert place.steps() == [f"checkpoint_{step}"]


@pytest.mark.parametrize(("backend", "chosen"), [("s3", 0), ("gcs", 0), ("s3", 1)])
def test_requests_per_process_per_save(
    request: pytest.FixtureRequest, backend: str, chosen: int
) -> None:
    """Each process's requests to the store, through its own counting proxy (docs/scaling.md):
    the other process sends one PUT per file it writes and reads the new step's manifest and
    metrics, nothing else; no process lists the directory; only the primary (process 0, or
    process 1 with primary_process=1) writes the manifest. A memory:// directory is refused."""
    bucket = request.getfixturevalue(f"{backend}_bucket")
    results = launch("count", f"{bucket}/run", env={"CAIRN_TEST_PRIMARY": str(chosen)})
    reports = []
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        line = next(x for x in r.stdout.splitlines() if x.startswith("requests "))
        reports.append(json.loads(line.split(" ", 1)[1]))
    primary, other = reports if chosen == 0 else reversed(reports)
    heads = HEADS[backend]  # see below
    step_files = primary["saves"][0]["files"] + other["saves"][0]["files"]
    for step, (mine, theirs) in enumerate(zip(primary["saves"], other["saves"], strict=True)):
        files = mine["files"]
        # The other process: its files, then the new step's manifest and metrics.json; once
        # retention deletes a step, every other one of its files (the primary deletes the rest).
        assert theirs["requests"] == other_requests(
            theirs["files"], step, step_files, 1 - chosen, 2
        ), (
            step,
            theirs,
        )
        # The primary: the lease read before the claim and before the commit, the claim and
        # the manifest, its files and the lease's refresh; on moto every conditional write is
        # a HEAD and a PUT (TensorStore sends If-Match itself only to amazonaws.com). The
        # first save reads one missing key more (what "absent" looks like, once per process).
        expected = {"GET other": 2 + (step == 0), "PUT manifest": 2, "PUT other": files + 1}
        if step >= 2:  # retention deletes the oldest step: a claim, its manifest, its files
            expected["GET other"] += 1  # the lease, once more
            expected["PUT other"] += 1  # the deletion's claim
            shares = len(range(chosen, step_files, 2))
            expected.update({"LIST step": 2, "DELETE manifest": 1, "DELETE other": shares + 1})
        assert mine["requests"] == {**expected, **heads}, (step, mine)
    # At the open only the primary lists the directory, once (its clean-up's listing is its
    # scan), and reads each step's manifest once; the other reads the manifest and
    # metrics.json of each step the primary found.
    assert primary["reopen"]["LIST dir"] == 1, primary["reopen"]
    assert primary["reopen"]["GET manifest"] == 2, primary["reopen"]
    assert other["open"] == {}, other["open"]
    assert other["reopen"] == {"GET manifest": 2, "GET other": 2}, other["reopen"]


@pytest.mark.slow
def test_four_processes_save_retain_restore_and_iterators(place: Place) -> None:
    """make soak: the save scenario on a (4, 2) mesh of 4 processes (shards of all four, 7
    restore shardings, retention, delete, a second manager), then each process's iterator."""
    save_scenario(place, 4, timeout=600)
    sub = Place(f"{place.directory}/iterators")
    results = launch("iterators", sub.directory, count=4, timeout=600)
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        assert str([f"process_{p}-of-4.json" for p in range(4)]) in r.stdout
    assert not [k for k in sub.listing() if k.startswith("checkpoint_1/data/")]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["s3", "gcs"])
def test_requests_per_save_do_not_grow_with_four_processes(
    request: pytest.FixtureRequest, backend: str
) -> None:
    """make soak: at 4 processes each other process still sends its files' PUTs and 2 GETs
    per save, and the primary the same fixed requests as at 2."""
    bucket = request.getfixturevalue(f"{backend}_bucket")
    results = launch("count", f"{bucket}/run", count=4, timeout=600)
    reports = []
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        line = next(x for x in r.stdout.splitlines() if x.startswith("requests "))
        reports.append(json.loads(line.split(" ", 1)[1]))
    primary = reports[0]
    step_files = sum(r["saves"][0]["files"] for r in reports)
    for index, other in enumerate(reports[1:], start=1):
        for step, save in enumerate(other["saves"]):
            expected = other_requests(save["files"], step, step_files, index, 4)
            assert save["requests"] == expected, save
    fixed = {k: v for k, v in primary["saves"][1]["requests"].items() if k != "PUT other"}
    assert fixed == {"GET other": 2, "PUT manifest": 2, **HEADS[backend]}, fixed
    assert primary["saves"][1]["requests"]["PUT other"] == primary["saves"][1]["files"] + 1


def assert_packs_of_each_process(keys: list[str], step: str, count: int = 2) -> None:
    """The step's train state holds each process's packs and index (the packed layout)."""
    state = [k.split("/", 2)[2] for k in keys if k.startswith(f"{step}/state/")]
    indexes = {f"packs/index.{p}.json" for p in range(count)}
    assert {*indexes, "tree.json"} <= set(state), state
    packs = {k.split(".")[0] for k in state if k.startswith("packs/") and "index" not in k}
    assert packs == {f"packs/{p}" for p in range(count)}, state


def other_requests(
    files: int, step: int, step_files: int, index: int, count: int
) -> dict[str, int]:
    """What a process other than the primary sends in the save of `step` (of the count
    scenario: KeepLatest(2), so from step 2 on each save deletes a step of `step_files` files,
    of which process `index` of `count` deletes every `count`-th, from its index)."""
    expected = {"PUT other": files, "GET manifest": 1, "GET other": 1}
    if step >= 2:
        expected["DELETE other"] = len(range(index, step_files, count))
    return expected
