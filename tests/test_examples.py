"""The demo example runs end to end: killed once, resumed bit-exactly, kept steps listed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).parents[1] / "examples" / "train_and_resume.py"


def test_train_and_resume_example(tmp_path: Path) -> None:
    """The example's own checks pass and it reports the kill, the resume and the kept steps."""
    out = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--dir",
            str(tmp_path / "run"),
            "--steps",
            "40",
            "--every",
            "5",
            "--kill-at",
            "25",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    assert "run 1 was killed with SIGKILL" in out
    assert "restored state equals the state saved at that step: True" in out
    assert "final parameters equal an uninterrupted run of 40 steps, bit for bit: True" in out
    kept = [line for line in out.splitlines() if line.startswith("  step") and "MB" in line]
    assert [line.split()[1] for line in kept][-2:] == ["35", "40"], out
    assert "cairn: committed step 40" in out
