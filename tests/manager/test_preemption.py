"""OnPreemption: SIGTERM makes the next step save, the save lands before save() returns, the
trainer exits cleanly; the program's own handler is chained and comes back on close."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cairn.manager import AnyOf, CheckpointManager, EveryNSteps, OnPreemption

WORKER = Path(__file__).parent.parent / "preempt_worker.py"


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_sigterm_saves_the_next_step_and_the_trainer_exits(tmp_path: Path, writer: str) -> None:
    with subprocess.Popen(
        [sys.executable, str(WORKER), str(tmp_path), "37", writer],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        assert proc.stdout.readline() == "paused\n"
        proc.send_signal(signal.SIGTERM)  # arrives while the loop waits at step 37
        proc.stdin.write("go\n")
        proc.stdin.close()
        out = proc.stdout.read()
        assert proc.wait(timeout=120) == 0, out  # not killed by SIGTERM: a clean exit
    assert out == "saved 38 committed [38]\npreempted at 38\n"  # committed when save returned
    with CheckpointManager(tmp_path, read_only=True) as mgr:
        assert mgr.all_steps() == [38]
        np.testing.assert_array_equal(mgr.restore()["state"]["w"], np.full(4, sum(range(39))))


def test_own_handler_is_chained_and_restored(tmp_path: Path) -> None:
    calls: list[int] = []

    def own(signum: int, frame: object) -> None:
        calls.append(signum)

    previous = signal.signal(signal.SIGTERM, own)
    try:
        mgr = CheckpointManager(tmp_path, save=AnyOf(EveryNSteps(10), OnPreemption()))
        assert not mgr.should_save(3) and not mgr.reached_preemption(3)
        signal.raise_signal(signal.SIGTERM)
        assert calls == [signal.SIGTERM]
        assert mgr.should_save(3) and mgr.reached_preemption(3)
        assert mgr.save(3, {"s": [3]})
        assert mgr.all_steps() == [3]  # the preemption save waited for its commit
        mgr.close()
        assert signal.getsignal(signal.SIGTERM) is own
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_without_on_preemption_nothing_is_watched(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    with CheckpointManager(tmp_path, save=EveryNSteps(10)) as mgr:
        assert signal.getsignal(signal.SIGTERM) is before
        assert not mgr.reached_preemption(5)
    with CheckpointManager(tmp_path, save=OnPreemption(), read_only=True):
        assert signal.getsignal(signal.SIGTERM) is before  # readers never save


def test_other_signals(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, save=OnPreemption(signals=(signal.SIGUSR1,))) as mgr:
        assert signal.getsignal(signal.SIGTERM) is not signal.getsignal(signal.SIGUSR1)
        signal.raise_signal(signal.SIGUSR1)
        assert mgr.should_save(1) and mgr.reached_preemption(1)


@pytest.mark.parametrize("signals", [(), (signal.SIGKILL,), ("TERM",), [15], (True,)])
def test_bad_signals(signals: object) -> None:
    with pytest.raises(ValueError, match="OnPreemption: signals must be"):
        OnPreemption(signals=signals)  # type: ignore[arg-type]


def test_signal_after_should_save_waits_for_the_next_step(tmp_path: Path) -> None:
    """SIGTERM between should_save(7) (False) and reached_preemption(7): the loop does not stop
    at 7 unsaved; step 8 saves and then reached_preemption(8) is True."""
    with CheckpointManager(tmp_path, save=AnyOf(EveryNSteps(100), OnPreemption())) as mgr:
        assert not mgr.should_save(7)
        signal.raise_signal(signal.SIGTERM)
        assert not mgr.reached_preemption(7)
        assert mgr.should_save(8)
        mgr.save(8, {"s": [8]})
        assert mgr.reached_preemption(8) and mgr.all_steps() == [8]
