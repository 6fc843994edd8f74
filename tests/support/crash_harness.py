"""SIGKILL a real writer process at random moments and check what it leaves behind.

Reused by later crash tests: `run_trials` starts `crash_writer.py` over and over in one directory,
waits until the writer reports saves, kills it after a random delay, then checks with a fresh
manager that (1) only intact steps are listed and each restores equal to what was saved, (2) the
writer advanced since the previous trial, (3) retention kept what it must, (4) no temporary or
trash entry survives the next start.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from crash_writer import PHASES, eval_metric, expected_data, expected_state

from cairn.manager import CheckpointManager
from support.iterutil import Shuffled, take
from support.treeutil import assert_tree_equal

WRITER = Path(__file__).parents[1] / "crash_writer.py"  # a worker script, in tests/


@dataclasses.dataclass
class TrialStats:
    trials: int = 0
    steps_committed: int = 0
    kills_with_leftovers: int = 0
    max_delay_s: float = 0.0

    def __str__(self) -> str:
        return (
            f"{self.trials} trials, {self.steps_committed} steps committed in all, "
            f"{self.kills_with_leftovers} kills left a temporary/trash entry that the next start removed"
        )


def run_trials(
    root: Path,
    trials: int,
    *,
    writer_args: tuple[str, ...] = (),
    keep_latest: int = 0,
    keep_best: int = 0,
    min_saves: int = 1,
    seed: int = 0,
) -> TrialStats:
    rng = random.Random(seed)
    stats = TrialStats()
    previous_latest = -1
    args = [*writer_args]
    if keep_latest:
        args += ["--keep-latest", str(keep_latest)]
    if keep_best:
        args += ["--keep-best", str(keep_best)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for _ in range(trials):
        proc = subprocess.Popen(
            [sys.executable, str(WRITER), str(root), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert proc.stdout is not None
        saved = []
        while len(saved) < min_saves:  # the writer really saves before we kill it
            line = proc.stdout.readline()
            if not line:
                proc.wait()
                raise AssertionError(f"writer exited early: {proc.stderr.read()}")  # type: ignore[union-attr]
            saved.append(int(line.split()[1]))
        delay = rng.uniform(0, 0.15)  # a random moment: the kill time, not a synchronisation
        stats.max_delay_s = max(stats.max_delay_s, delay)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        saved += [int(line.split()[1]) for line in proc.stdout.read().splitlines()]
        proc.stdout.close()
        proc.stderr.close()  # type: ignore[union-attr]
        assert proc.returncode == -signal.SIGKILL, proc.returncode

        if any(_is_leftover(p.name) for p in root.iterdir()):
            stats.kills_with_leftovers += 1
        latest = check_directory(
            root,
            keep_latest=keep_latest,
            keep_best=keep_best,
            dataset="--dataset" in args,
            incremental="--incremental" in args,
        )
        assert latest > previous_latest, (
            f"the writer did not advance: {latest} <= {previous_latest}"
        )
        if "--sync" in writer_args:  # a synchronous save has committed when it returns
            assert latest >= saved[-1], f"step {saved[-1]} was reported saved but is gone"
        stats.steps_committed += latest - previous_latest
        previous_latest = latest
        stats.trials += 1
    return stats


def run_phase_trials(
    root: Path, phases: list[str], per_phase: int, *, seed: int = 0
) -> dict[str, int]:
    """For each phase, `per_phase` writers (async, KeepLatest(2) | KeepBest(2), late metrics,
    an iterator item kept by keep_items, incremental saves: each step links its unchanged files
    to the step before) that SIGKILL themselves at the N-th time they reach it (N random in
    1..4); after each, the directory is checked as in `run_trials`.
    Returns the steps committed per phase."""
    rng = random.Random(seed)
    committed = {}
    for phase in phases:
        assert phase in PHASES, phase
        previous_latest = (
            check_directory(root, dataset=True, incremental=True) if _has_steps(root) else -1
        )
        total = 0
        for _ in range(per_phase):
            args = ["--late-metrics", "--dataset", "--keep-latest", "2", "--keep-best", "2"]
            args += ["--incremental", "--kill-in", phase, "--kill-at", str(rng.randint(1, 4))]
            proc = subprocess.run(
                [sys.executable, str(WRITER), str(root), *args],
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
            assert proc.returncode == -signal.SIGKILL, (phase, proc.returncode, proc.stderr[-2000:])
            latest = check_directory(
                root, keep_latest=2, keep_best=2, dataset=True, incremental=True
            )
            assert latest > previous_latest, f"{phase}: the writer did not advance"
            total += latest - previous_latest
            previous_latest = latest
        committed[phase] = total
    return committed


def _has_steps(root: Path) -> bool:
    return root.exists() and any(p.name.startswith("checkpoint_") for p in root.iterdir())


def _is_leftover(name: str) -> bool:
    return ".tmp-" in name or name.startswith(".trash-")


def check_directory(
    root: Path,
    *,
    keep_latest: int = 0,
    keep_best: int = 0,
    dataset: bool = False,
    incremental: bool = False,
) -> int:
    """Open a fresh writer on `root` and check everything; returns the newest step. With
    `incremental`, every step but step 0 must have linked files of the step before (the state's
    frozen leaf at least) and still verify on its own."""
    with CheckpointManager(root) as mgr:
        leftover = [p.name for p in root.iterdir() if _is_leftover(p.name)]
        leftover += [
            f"{p.parent.name}/{p.name}" for p in root.glob("checkpoint_*/*") if _is_leftover(p.name)
        ]
        assert leftover == [], f"left after restart: {leftover}"
        steps = mgr.all_steps()
        assert steps, "no step survived"
        for step in steps:
            items = mgr.info(step).items
            wanted = {"state": None}
            if dataset and not items["data"].dropped:
                wanted["data"] = Shuffled()
            elif dataset:
                assert not (root / f"checkpoint_{step}" / "data").exists(), "an orphan item"
            got = mgr.restore(step, wanted, fallback=False)
            assert_tree_equal(got["state"], expected_state(step))
            if incremental and step > 0:
                tm = mgr.info(step).telemetry
                assert tm["bytes_written"] < tm["bytes"], f"step {step} linked nothing"
                assert mgr.verify(step) == []
            if "data" in got:
                assert take(got["data"]) == take(expected_data(step))
        if dataset:  # the newest step always keeps its iterator position
            assert not mgr.info(steps[-1]).items["data"].dropped
        latest = steps[-1]
        must_keep = set()
        if keep_latest:
            must_keep |= set(range(max(0, latest - keep_latest + 1), latest + 1))
        if keep_best and latest > 0:
            # Every step below the newest had its eval recorded before the next save began, so the
            # best of them (ties to the newer) is among the best `keep_best` of whatever exists.
            earlier = range(latest)
            must_keep.add(min(earlier, key=lambda s: (eval_metric(s), -s)))
        missing = must_keep - set(steps)
        assert not missing, f"retention lost {sorted(missing)}; on disk: {steps}"
        if keep_latest and not keep_best:
            assert len(steps) <= keep_latest + 1, f"retention left too many steps: {steps}"
        return latest
