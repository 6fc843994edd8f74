"""The demo runs end to end for both input pipelines: killed with SIGKILL, preempted with SIGTERM,
resumed each time, every loss equal to an uninterrupted run's bit for bit."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parents[1] / "examples" / "train_and_resume.py"


@pytest.mark.parametrize(("pipeline", "seed"), [("tfdata", 1), ("grain", 2)])
def test_train_and_resume_example(tmp_path: Path, pipeline: str, seed: int) -> None:
    """The example's own checks pass (it exits non-zero otherwise) and its tables say so."""
    cmd = [sys.executable, str(EXAMPLE), "--dir", str(tmp_path / "run"), "--steps", "60"]
    cmd += ["--every", "10", "--pipeline", pipeline, "--seed", str(seed)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=400, check=True).stdout
    assert re.search(r"SIGKILL at step \d+, SIGTERM at step \d+", out)
    assert "OK: every loss after each resume equals the uninterrupted run's" in out
    rows = re.findall(r"│ (run \d) │ +(\w+) │ +(\d+)-(\d+) │", out)
    assert [r[0] for r in rows] == ["run 1", "run 2", "run 3"], out
    assert rows[0][1] == "scratch" and rows[2][3] == "60"
    assert rows[2][1] == rows[1][3]  # run 3 resumed exactly at the step run 2 saved on SIGTERM
    kept = re.findall(r"│ +(\d+) │ +[\d.]+ │ +(kept|dropped) │", out)
    assert kept[-1][0] == "60"
    assert [k[1] for k in kept] == ["dropped"] * (len(kept) - 2) + ["kept", "kept"]
    assert (tmp_path / "run" / "interrupted" / "tensorboard" / "train").is_dir()
