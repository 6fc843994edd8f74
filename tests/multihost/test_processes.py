"""Barriers and broadcasts between 2 real jax.distributed processes on 127.0.0.1."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from launcher import launch

from cairn.manager._multihost import Processes


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


def test_two_processes_save_retain_and_restore_into_other_shardings(tmp_path: Path) -> None:
    """Shards from each process, host data once; retention; 7 restore shardings; delete right
    after a save; a second manager on the same directory in the same run."""
    results = launch("save", tmp_path)
    for i, r in enumerate(results):
        assert r.returncode == 0, r.stderr[-3000:]
        assert "steps [1, 2]" in r.stdout and f"ok save {i}" in r.stdout
    step_dir = tmp_path / "checkpoint_6"
    chunks = sorted(p.name for p in (step_dir / "state" / "arrays" / "0").iterdir())
    assert chunks == ["0.0", "0.1", "1.0", "1.1", "zarr.json"]  # shards of both processes
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert not list(step_dir.rglob(".process-*"))
    # delete(1), delete(2) right after save(5), then a second manager saved 6
    assert sorted(p.name for p in tmp_path.glob("checkpoint_*")) == ["checkpoint_5", "checkpoint_6"]


def test_clocks_that_disagree_still_agree_on_saving(tmp_path: Path) -> None:
    """A time-based policy: the primary decides and broadcasts, whatever the other's clock says."""
    results = launch("clock", tmp_path)
    lines = []
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        lines.append(next(line for line in r.stdout.splitlines() if line.startswith("decisions")))
    assert lines[0] == lines[1] == "decisions [True, True, True]"


@pytest.mark.parametrize("victim", [0, 1])
def test_sigkill_of_either_process_mid_save_commits_nothing(tmp_path: Path, victim: int) -> None:
    kill_one_and_resume(tmp_path, victim)


@pytest.mark.slow
@pytest.mark.parametrize("attempt", range(5))
@pytest.mark.parametrize("victim", [0, 1])
def test_sigkill_of_either_process_repeatedly(tmp_path: Path, victim: int, attempt: int) -> None:
    """make soak: 5 more kills of each process, each in a fresh directory."""
    kill_one_and_resume(tmp_path, victim)


def kill_one_and_resume(tmp_path: Path, victim: int) -> None:
    """No hang and no partial step; a fresh pair resumes from the last committed step.

    Process 1 dying: process 0 raises BarrierTimeoutError within the 5 s timeout. Process 0
    dying takes JAX's coordination service with it: process 1 either raises BarrierTimeoutError
    at once (its next call fails) or is ended by JAX itself, which cannot go on without the
    coordinator. Either way it ends promptly, never hangs.
    """
    results = launch(f"kill-{victim}", tmp_path, timeout=120)
    survivor = results[1 - victim]
    assert results[victim].returncode == -signal.SIGKILL
    if victim == 1 or survivor.returncode == 0:  # it noticed and raised
        assert survivor.returncode == 0, survivor.stderr[-3000:]
        line = next(
            line for line in survivor.stdout.splitlines() if line.startswith("commit failed")
        )
        assert float(line.split()[3]) <= 30 and "BarrierTimeoutError" in line, line
        assert "steps [1, 2]" in survivor.stdout
    else:  # JAX ended it first, having lost its coordinator
        assert "JAX distributed service detected fatal errors" in survivor.stderr
    assert not (tmp_path / "checkpoint_3").exists()
    again = launch("resume", tmp_path)
    for r in again:
        assert r.returncode == 0, r.stderr[-3000:]
        assert "resumed 2 [1, 2]" in r.stdout and "steps after [2, 3]" in r.stdout
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_each_process_saves_and_restores_its_own_iterator(tmp_path: Path) -> None:
    """One file per process in the item; each restores its own position; keep_items drops the
    item of the older step on every process's view."""
    results = launch("iterators", tmp_path)
    for i, r in enumerate(results):
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"ok iterators {i}" in r.stdout
        assert "files ['process_0-of-2.json', 'process_1-of-2.json']" in r.stdout
    assert not (tmp_path / "checkpoint_1" / "data").exists()


def test_preemption_notice_to_one_process_saves_one_step_on_both(tmp_path: Path) -> None:
    """SIGTERM to process 1 only: through JAX's preemption sync point both save the same step,
    that save is committed when save() returns, and both stop there."""
    results = launch("preempt", tmp_path)
    lines = []
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        lines.append(next(x for x in r.stdout.splitlines() if x.startswith("preempted at")))
    assert lines[0] == lines[1], lines
    step = int(lines[0].split()[2])
    assert step > 5 and lines[0].endswith(f"[{step}]")
    assert sorted(p.name for p in tmp_path.glob("checkpoint_*")) == [f"checkpoint_{step}"]
