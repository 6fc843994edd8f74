"""Barriers and broadcasts between 2 real jax.distributed processes on 127.0.0.1."""

from __future__ import annotations

import signal
from pathlib import Path

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
