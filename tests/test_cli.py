"""The cairn command line, run as a person runs it: a subprocess on real checkpoint directories."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from iterutil import Shuffled

from cairn.manager import CheckpointManager

CAIRN = str(Path(sys.executable).with_name("cairn"))


def cairn(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CAIRN, *args], capture_output=True, text=True, timeout=120)


def make_run(root: Path) -> None:
    with CheckpointManager(root) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, {"state": {"w": np.full((50, 50), step)}, "data": Shuffled()})


def test_verify_intact_and_damaged(tmp_path: Path) -> None:
    make_run(tmp_path)
    ok = cairn("verify", str(tmp_path))
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines() == [
        "step 10: ok",
        "step 20: ok",
        "step 30: ok",
        "3 steps checked, 0 damaged",
    ]
    chunk = tmp_path / "checkpoint_20" / "state" / "arrays" / "0" / "0.0"
    data = bytearray(chunk.read_bytes())
    data[7] ^= 1
    chunk.write_bytes(bytes(data))
    (tmp_path / "checkpoint_30" / "data" / "process_0-of-1.json").unlink()
    bad = cairn("verify", str(tmp_path))
    assert bad.returncode == 1
    lines = bad.stdout.splitlines()
    assert lines[0] == "step 10: ok"
    assert lines[1].startswith("step 20: DAMAGED: step 20, item 'state', file ")
    assert "arrays/0/0.0 fails its crc32c check" in lines[1]
    assert lines[2].startswith("step 30: DAMAGED:") and "process_0-of-1.json is missing" in lines[2]
    assert lines[-1] == "3 steps checked, 2 damaged"
    one = cairn("verify", str(tmp_path), "--step", "10", "--json")
    assert one.returncode == 0
    assert json.loads(one.stdout) == [{"step": 10, "ok": True, "problems": []}]
    listed = json.loads(cairn("verify", str(tmp_path), "--json").stdout)
    assert [(r["step"], r["ok"]) for r in listed] == [(10, True), (20, False), (30, False)]


def test_verify_reports_a_damaged_manifest(tmp_path: Path) -> None:
    make_run(tmp_path)
    (tmp_path / "checkpoint_30" / "_CHECKPOINT.json").write_text("{}")
    out = cairn("verify", str(tmp_path), "--step", "30")
    assert out.returncode == 1
    assert "step 30: DAMAGED:" in out.stdout and "_CHECKPOINT.json" in out.stdout


def test_bad_arguments_are_one_line_and_status_2(tmp_path: Path) -> None:
    make_run(tmp_path)
    (tmp_path / "file").write_text("x")
    for args, message in [
        (("verify", str(tmp_path / "nope")), "no such directory"),
        (("verify", str(tmp_path / "file")), "not a directory"),
        (("verify", str(tmp_path), "--step", "11"), "no step 11"),
    ]:
        out = cairn(*args)
        assert out.returncode == 2, out
        assert (
            out.stderr.count("\n") == 1 and message in out.stderr and "Traceback" not in out.stderr
        )
    usage = cairn("verify")
    assert usage.returncode == 2 and "Traceback" not in usage.stderr
    before = sorted(p.name for p in tmp_path.iterdir())
    assert cairn("verify", str(tmp_path)).returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # read-only: nothing changed


def test_module_entry_point(tmp_path: Path) -> None:
    make_run(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "cairn.manager", "verify", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.endswith("3 steps checked, 0 damaged\n")


def losses(root: Path) -> None:
    with CheckpointManager(root) as mgr:
        for step, loss in enumerate([1.0, 0.5, 0.1, 0.25, 0.2]):
            mgr.save(step, {"state": {"w": np.full((4, 4), step), "b": 3}}, metrics={"loss": loss})


def test_ls_json_and_kept_by(tmp_path: Path) -> None:
    losses(tmp_path)
    rows = json.loads(cairn("ls", str(tmp_path), "--json").stdout)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[2]["metrics"] == {"loss": 0.1} and rows[2]["items"] == ["state"]
    policy = ["--keep-latest", "2", "--keep-best", "1", "--metric", "loss", "--verify"]
    rows = json.loads(cairn("ls", str(tmp_path), *policy, "--json").stdout)
    assert {r["step"]: r["kept_by"] for r in rows} == {
        0: [],
        1: [],
        2: ["KeepBest"],
        3: ["KeepLatest"],
        4: ["KeepLatest", "newest"],
    }
    assert {r["status"] for r in rows} == {"ok"}
    table = cairn("ls", str(tmp_path), *policy)
    assert table.returncode == 0 and "(gc would delete)" in table.stdout


def test_show_metrics_plot_gc_rm(tmp_path: Path) -> None:
    losses(tmp_path)
    show = cairn("show", str(tmp_path), "3")
    assert show.returncode == 0
    assert "item 'state': train-state" in show.stdout and "['w']: <i8[4, 4], 128 B" in show.stdout
    shown = json.loads(cairn("show", str(tmp_path), "3", "--json").stdout)
    assert shown["items"]["state"]["handler"] == "cairn.train_state"
    plot = tmp_path / "loss.png"
    metrics = cairn("metrics", str(tmp_path), "--plot", str(plot))
    assert metrics.returncode == 0 and metrics.stdout.splitlines()[:2] == ["step loss", "0 1"]
    assert plot.stat().st_size > 5000 and plot.read_bytes()[:4] == b"\x89PNG"
    dry = cairn("gc", str(tmp_path), "--keep-latest", "2", "--dry-run")
    assert "would delete step 0" in dry.stdout and "3 steps would be deleted" in dry.stdout
    assert sorted(p.name for p in tmp_path.glob("checkpoint_*"))[:1] == ["checkpoint_0"]
    gc = cairn("gc", str(tmp_path), "--keep-latest", "2", "--keep-best", "1", "--metric", "loss")
    assert gc.returncode == 0 and "2 steps deleted, 3 kept: [2, 3, 4]" in gc.stdout
    assert cairn("rm", str(tmp_path), "3").stdout == "deleted step 3\n"
    with CheckpointManager(tmp_path, read_only=True) as mgr:
        assert mgr.all_steps() == [2, 4]
    for args, message in [
        (("rm", str(tmp_path), "7"), "no step 7"),
        (("gc", str(tmp_path)), "gc needs a keep option"),
        (("gc", str(tmp_path), "--keep-best", "1"), "--keep-best needs --metric"),
        (("gc", str(tmp_path), "--keep-latest", "0"), "n must be a positive int"),
        (("metrics", str(tmp_path), "--plot", "x.png", "--metric", "acc"), "no metric 'acc'"),
        (("show", str(tmp_path / "nope"), "1"), "no such directory"),
    ]:
        out = cairn(*args)
        assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out


def test_padded_step_names(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, step_digits=6) as mgr:
        mgr.save(7, {"state": {"w": np.ones(3)}})
    assert json.loads(cairn("ls", str(tmp_path), "--json").stdout) == []
    rows = json.loads(cairn("ls", str(tmp_path), "--step-digits", "6", "--json").stdout)
    assert [r["step"] for r in rows] == [7]
    bad = cairn("ls", str(tmp_path), "--step-digits", "0")
    assert bad.returncode == 2 and "step_digits must be" in bad.stderr
