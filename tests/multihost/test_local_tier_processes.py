"""A local tier with real jax.distributed processes on 127.0.0.1: each with its own local
directory beside a shared persistent directory (POSIX, or S3 on a moto server). The worker is
`mh_worker.local_tier`: persistent every 5 steps, local every 2, KeepLatest(2) in each; a
sharded array, a replicated one, host data and each process's iterator, all checked bit-exact
after every restore."""

from __future__ import annotations

import random
import re
import signal
from pathlib import Path
from typing import Any

import pytest
from conftest import Place
from launcher import launch


def run(place: Place, local: Path, phase: str, count: int = 2, **env: Any) -> list[str]:
    """Launch a phase of the local-tier scenario; the stdout of each process."""
    settings = {"CAIRN_TEST_LOCAL": str(local), "CAIRN_TEST_PHASE": phase}
    settings.update({f"CAIRN_TEST_{k.upper()}": str(v) for k, v in env.items()})
    results = launch("local", place.directory, count=count, timeout=300, env=settings)
    killed = env.get("victim")
    for i, r in enumerate(results):
        if killed is not None and killed in (i, count):
            assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
        else:
            assert r.returncode == 0, r.stderr[-3000:]
    return [r.stdout for r in results]


def restored(outs: list[str]) -> int:
    """The step every process restored (the same on all, or the test fails)."""
    steps = {int(re.search(r"restored (\d+)", out).group(1)) for out in outs}  # type: ignore[union-attr]
    assert len(steps) == 1, outs
    return steps.pop()


@pytest.mark.parametrize("place", ["posix", "s3"], indirect=True)
def test_two_processes_restore_from_local_parts_and_a_lost_one_from_the_persistent_tier(
    place: Place, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Steps 1..12: persistent [5, 10], local [10, 12] on each process. A restart restores 12
    from the local parts. Then process 1's local directory is wiped (a replaced host): the
    newest step every process can get is 13, the persistent step (process 0 reads its own part
    of it, process 1 the persistent step), the same on both, and all_steps() agrees too."""
    local = tmp_path_factory.mktemp("local")
    for out in run(place, local, "save", steps=12):
        assert "steps [5, 10] [10, 12]" in out, out
    outs = run(place, local, "resume")
    assert restored(outs) == 12
    for out in outs:
        assert "latest 12 restored 12" in out and "after [10, 13] [12, 13]" in out, out
    outs = run(place, local, "resume", wipe=1)
    assert restored(outs) == 13
    for out in outs:  # the same on every process: 13 is not a local step of process 1
        assert "after [13, 14] [14]" in out, out


def kill_and_resume(place: Place, local: Path, rng: random.Random, count: int) -> None:
    """Every process is SIGKILLed right after save() of a random step returned (that save's
    commits may still be running); a random process's local directory is wiped or not; the
    restart restores the same step everywhere, bit-exact, and no older than the rule allows:
    each tier's save before its newest one had committed (max_pending=1), so the floor is the
    newer of the two tiers' second-newest saves, or with a wiped directory the persistent
    tier's (0: nothing to restore, a fresh start)."""
    kill_at = rng.randint(3, 14)
    run(place, local, "save", count=count, steps=16, kill_at=kill_at, victim=count)
    wipe = rng.choice([None, *range(count)])
    outs = run(place, local, "resume", count=count, **({} if wipe is None else {"wipe": wipe}))
    step = restored(outs)

    def committed(every: int) -> int:
        saves = [s for s in range(1, kill_at + 1) if s % every == 0]
        return saves[-2] if len(saves) > 1 else 0

    floor = committed(5) if wipe is not None else max(committed(5), committed(2))
    assert floor <= step <= kill_at, (kill_at, wipe, step)


@pytest.mark.parametrize("trial", range(2))
def test_sigkill_of_every_process_then_resume(tmp_path: Path, trial: int) -> None:
    kill_and_resume(
        Place(str(tmp_path / "persistent")), tmp_path / "local", random.Random(trial), 2
    )


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(30))
def test_four_processes_sigkill_and_wipe_at_random(
    place: Place, tmp_path_factory: pytest.TempPathFactory, trial: int
) -> None:
    """make soak: 30 kill trials per backend with 4 processes, each drawing the step of the
    kill and the process (if any) whose local directory is lost."""
    kill_and_resume(place, tmp_path_factory.mktemp("local"), random.Random(1000 + trial), 4)
