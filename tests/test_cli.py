"""The cairn command line, run as a person runs it: a subprocess on real checkpoint directories
(and in-process, through main(), where the test needs capsys)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.iterutil import Shuffled

from cairn.handlers import JsonHandler
from cairn.manager import CheckpointManager, EveryNSteps, KeepBest, KeepLatest, LocalTier
from cairn.manager._format import PART, dump_checked, load_checked
from cairn.manager._surfaces.cli import main

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
    (chunk,) = (tmp_path / "checkpoint_20" / "state" / "packs").glob("0.*.0")
    data = bytearray(chunk.read_bytes())
    data[7] ^= 1
    chunk.write_bytes(bytes(data))
    (tmp_path / "checkpoint_30" / "data" / "process_0-of-1.json").unlink()
    bad = cairn("verify", str(tmp_path))
    assert bad.returncode == 1
    lines = bad.stdout.splitlines()
    assert lines[0] == "step 10: ok"
    assert lines[1].startswith("step 20: DAMAGED: step 20, item 'state', file ")
    # The damaged file is named (the words of the check depend on the format version).
    assert f"{chunk.name} " in lines[1]
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


def test_show_says_what_an_incremental_save_wrote(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, incremental=True) as mgr:
        for step in (1, 2):
            mgr.save(step, {"state": {"frozen": np.ones(100_000), "w": np.full(4, step)}})
    shown = json.loads(cairn("show", str(tmp_path), "2", "--json").stdout)
    assert shown["bytes"] > 800_000 and 0 < shown["bytes_written"] < 2_000
    first = json.loads(cairn("show", str(tmp_path), "1", "--json").stdout)
    assert first["bytes_written"] == first["bytes"]
    text = cairn("show", str(tmp_path), "2").stdout.splitlines()[0]
    assert text.endswith(" written, the rest shared with an earlier step)"), text
    assert "shared" not in cairn("show", str(tmp_path), "1").stdout


def test_verify_reads_a_shared_file_once(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from cairn.handlers import FileRecord

    with CheckpointManager(tmp_path, incremental=True) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"state": {"frozen": np.ones(100_000), "w": np.full(4, step)}})
    checked: list[str] = []
    real = FileRecord.check

    def counting(self: FileRecord, data: Any, where: str) -> None:
        checked.append(where)
        real(self, data, where)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(FileRecord, "check", counting)
        code, out, _ = run_cli(capsys, "verify", str(tmp_path))
    assert code == 0 and "3 steps checked, 0 damaged" in out
    packs = [w for w in checked if "/packs/0." in w]
    (shared,) = [  # step 1's pack (frozen, and w of step 1), linked by steps 2 and 3
        p.name
        for p in (tmp_path / "checkpoint_3" / "state" / "packs").glob("0.*")
        if (tmp_path / "checkpoint_1" / "state" / "packs" / p.name).exists()
    ]
    assert len([w for w in packs if w.endswith(shared)]) == 1  # read once, for step 1
    assert len(packs) == 3  # that pack, and the packs of w that steps 2 and 3 wrote
    chunk = tmp_path / "checkpoint_1" / "state" / "packs" / shared
    data = bytearray(chunk.read_bytes())
    data[-10] ^= 1  # the shared chunk: damaged in every step
    with open(chunk, "r+b") as f:
        f.write(data)
    code, out, _ = run_cli(capsys, "verify", str(tmp_path))
    assert code == 1 and "3 steps checked, 3 damaged" in out


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
    assert "item 'state': train-state" in show.stdout and "['w']: int64[4, 4], 128 B" in show.stdout
    shown = json.loads(cairn("show", str(tmp_path), "3", "--json").stdout)
    assert shown["items"]["state"]["handler"] == "cairn.train_state"
    plot = tmp_path / "loss.png"
    metrics = cairn("metrics", str(tmp_path), "--plot", str(plot), "--mode", "min")
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
        (("gc", str(tmp_path), "--keep-latest", "0"), "--keep-latest must be at least 1"),
        (("metrics", str(tmp_path), "--plot", "x.png", "--metric", "acc"), "no metric 'acc'"),
        (("show", str(tmp_path / "nope"), "1"), "no such directory"),
    ]:
        out = cairn(*args)
        assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out


def test_padded_step_names(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, step_digits=6) as mgr:
        mgr.save(7, {"state": {"w": np.ones(3)}})
    empty = cairn("ls", str(tmp_path), "--json")  # issue 43: not an empty list, exit 0
    assert (
        empty.returncode == 2
        and "run it again with --step-prefix 'checkpoint' --step-digits 6" in empty.stderr
    )
    rows = json.loads(cairn("ls", str(tmp_path), "--step-digits", "6", "--json").stdout)
    assert [r["step"] for r in rows] == [7]
    bad = cairn("ls", str(tmp_path), "--step-digits", "0")
    assert bad.returncode == 2 and "step_digits must be" in bad.stderr


def test_an_empty_listing_names_the_step_like_directories(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Directories named like steps that hold none (no manifest, no Orbax metadata) are not
    refused, but an empty listing says what they are and which flags read steps named so."""
    for name in ("checkpoint_000100", "ckpt_7", "ckpt_8", f"ckpt_9{EVIL}", "notes"):
        (tmp_path / name).mkdir()
    code, out, err = run_cli(capsys, "ls", str(tmp_path))
    assert code == 0 and out.splitlines() == ["step\tcommitted\tsize\tmetrics\titems\tstatus"]
    assert "no steps; 3 directories have step-like names but no manifest" in err
    assert "checkpoint_000100, ckpt_7, ckpt_8" in err and "notes" not in err
    assert "--step-prefix 'ckpt'" in err and "--step-prefix 'checkpoint' --step-digits 6" in err
    code, out, err = run_cli(capsys, "ls", str(tmp_path), "--step-prefix", "ckpt", "--json")
    assert code == 0 and "--step-prefix" not in err  # named as steps: listed as damaged
    assert [(r["step"], r["status"][:8]) for r in json.loads(out)] == [
        (7, "damaged:"),
        (8, "damaged:"),
    ]
    (tmp_path / "ckpt_7").rmdir()
    (tmp_path / "ckpt_8").rmdir()
    code, out, err = run_cli(capsys, "ls", str(tmp_path), "--json")
    assert "1 directory has a step-like name but no manifest: checkpoint_000100\n" in err
    for name in ("checkpoint_000100", "notes"):
        (tmp_path / name).rmdir()
    assert run_cli(capsys, "ls", str(tmp_path))[2] == ""  # nothing step-like: nothing said


def test_an_empty_listing_of_a_bucket_says_nothing_more(capsys: pytest.CaptureFixture[str]) -> None:
    """On an object store the step-like names are not looked for (a LIST of every object):
    the listing is empty and nothing is added, as cli.md says."""
    from cairn.manager._storage.kvstore import ObjectStore, StorageOptions

    url = f"memory://cli-empty-{id(capsys)}"
    ObjectStore(url, StorageOptions()).write("ckpt_7/notes.txt", b"not a step")
    code, out, err = run_cli(capsys, "ls", url, "--json")
    assert code == 0 and json.loads(out) == [] and err == ""


# ---------------------------------------------------------------------------- untrusted names

# What a stranger's directory may hold in a name: a window-title OSC, clear-screen, a carriage
# return and a newline (forged lines), rich markup, a bidi override, a C1 CSI and DEL.
EVIL = "\x1b]0;pwned\x07\x1b[2J\r\nstep 9: ok [bold red]x\u202e\x9b\x7f"


def assert_printable(text: str) -> None:
    """Nothing a terminal acts on: every line printable (box drawing is), only \\n between
    lines and \\t between the columns of `ls` in a pipe (a tab in a name is escaped)."""
    for line in text.split("\n"):
        assert line.replace("\t", " ").isprintable(), repr(line)
    assert not any((c < " " and c not in "\n\t") or "\x7f" <= c <= "\x9f" for c in text)


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    assert_printable(out)
    assert_printable(err)
    assert "Traceback" not in err
    return code, out, err


def strict_json(text: str) -> Any:
    def refuse(constant: str) -> Any:
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def evil_run(root: Path) -> None:
    with CheckpointManager(root, handlers={"config": JsonHandler()}) as mgr:
        for step in (1, 2):
            mgr.save(
                step,
                {"state": {EVIL: np.ones(2), "nan": float("nan")}, "config": {EVIL: EVIL}},
                metrics={EVIL: float(step), "loss": float("nan"), "step": 99.0},
                metadata={EVIL: [EVIL, {"nested": EVIL}]},
            )
        mgr.record_metrics(2, {"acc": float("inf"), "worst": float("-inf")})


def test_names_from_disk_are_escaped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    evil_run(tmp_path)
    # Written as its Python escapes, the markup as it is (rich renders no markup from disk).
    escaped = "\\x1b]0;pwned\\x07\\x1b[2J\\r\\nstep 9: ok [bold red]x\\u202e\\x9b\\x7f"
    for args in [
        ("ls", str(tmp_path)),
        ("ls", str(tmp_path), "--verify", "--keep-best", "1", "--metric", EVIL),
        ("show", str(tmp_path), "2"),
        ("metrics", str(tmp_path)),
    ]:
        code, out, _ = run_cli(capsys, *args)
        assert code == 0 and escaped in out, (args, out)
    _, shown, _ = run_cli(capsys, "show", str(tmp_path), "2")
    assert f"  metrics: {escaped}=2, loss=nan, step=99, acc=inf, worst=-inf\n" in shown
    assert f"    ['{escaped}']: float64[2], 16 B\n" in shown
    _, table, _ = run_cli(capsys, "metrics", str(tmp_path))
    assert table.splitlines() == [
        f"step {escaped} acc loss step worst",
        "1 1 - nan 99 -",
        "2 2 inf nan 99 -inf",
    ]
    _, kept, _ = run_cli(capsys, "ls", str(tmp_path), "--keep-best", "1", "--metric", EVIL)
    assert "KeepBest" in kept and "(gc would delete)" not in kept
    for args in [
        ("verify", str(tmp_path)),
        ("gc", str(tmp_path), "--keep-best", "1", "--metric", EVIL, "--mode", "max", "--dry-run"),
    ]:
        code, out, _ = run_cli(capsys, *args)
        assert code == 0 and out.endswith(("2 steps checked, 0 damaged\n", "1 kept: [2]\n")), out


def test_json_is_strict_and_keeps_the_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    evil_run(tmp_path)
    _, out, _ = run_cli(capsys, "ls", str(tmp_path), "--json")
    rows = strict_json(out)
    assert rows[1]["metrics"] == {
        EVIL: 2.0,
        "loss": "NaN",
        "step": 99.0,
        "acc": "Infinity",
        "worst": "-Infinity",
    }
    assert [float(v) for v in rows[1]["metrics"].values()][-2:] == [float("inf"), float("-inf")]
    _, out, _ = run_cli(capsys, "show", str(tmp_path), "2", "--json")
    shown = strict_json(out)
    assert shown["metadata"] == {EVIL: [EVIL, {"nested": EVIL}]}
    assert shown["metrics"]["loss"] == "NaN"
    leaves = {leaf["path"]: leaf for leaf in shown["items"]["state"]["leaves"]}
    assert leaves["['nan']"]["value"] == "NaN"
    _, out, _ = run_cli(capsys, "metrics", str(tmp_path), "--json")
    assert strict_json(out) == [
        {"step": 1, EVIL: 1.0, "loss": "NaN"},
        {"step": 2, EVIL: 2.0, "loss": "NaN", "acc": "Infinity", "worst": "-Infinity"},
    ]  # a metric named "step" does not stand in for the step number
    _, out, _ = run_cli(capsys, "verify", str(tmp_path), "--json")
    assert [r["ok"] for r in strict_json(out)] == [True, True]


def test_a_crafted_manifest_prints_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Item names and handler ids written by hand into a manifest whose crc32c is recomputed."""
    with CheckpointManager(tmp_path, handlers={"config": JsonHandler()}) as mgr:
        for step in (1, 2):
            mgr.save(step, {"config": {"a": 1}})
    for step, edit in [(1, "name"), (2, "handler")]:
        path = tmp_path / f"checkpoint_{step}" / "_CHECKPOINT.json"
        body = load_checked(path.read_bytes(), str(path))
        if edit == "name":
            body["items"][EVIL] = body["items"].pop("config")
        else:
            body["items"]["config"]["handler"] = EVIL
        path.write_bytes(dump_checked(body))
    for args in [
        ("ls", str(tmp_path)),
        ("ls", str(tmp_path), "--json"),
        ("verify", str(tmp_path)),
        ("verify", str(tmp_path), "--json"),
        ("show", str(tmp_path), "1"),
        ("show", str(tmp_path), "2"),
        ("show", str(tmp_path), "2", "--json"),
    ]:
        code, out, err = run_cli(capsys, *args)
        assert code in (0, 1, 2), args
        if args[-1] == "--json" and code != 2:
            strict_json(out)
        assert "\\x1b]0;pwned" in out + err, (args, out, err)


def test_warnings_and_errors_are_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A directory whose own name holds escapes: the warnings and errors that quote it."""
    root = tmp_path / "run\x1b]0;pwned\x07"
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"state": [1]}, metrics={"loss": 1.0})
        mgr.record_metrics(1, {"loss": 0.5})
    (root / "checkpoint_1" / "metrics.json").write_text("{not json")
    code, out, err = run_cli(capsys, "ls", str(root))
    assert code == 0 and "loss=1" in out
    assert "ignoring unreadable" in err and "run\\x1b]0;pwned\\x07" in err
    code, _, err = run_cli(capsys, "show", str(root), "7")
    error = err.splitlines()[-1]
    assert code == 2 and error.startswith("cairn: error: ") and "\\x1b]0;pwned" in error


def test_a_crafted_metric_name_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A metric name is drawn as it is: no mathtext (an unknown symbol used to crash the plot)."""
    with CheckpointManager(tmp_path) as mgr:
        for step in (1, 2):
            mgr.save(step, {"state": [step]}, metrics={"$\\foo$" + EVIL: float(step)})
    plot = tmp_path / "m.png"
    code, _, err = run_cli(capsys, "metrics", str(tmp_path), "--plot", str(plot), "--mode", "min")
    assert code == 0 and err == f"wrote {plot}\n" and plot.read_bytes()[:4] == b"\x89PNG"


def test_no_traceback_for_what_users_do(tmp_path: Path) -> None:
    """Issue 20, point 15: every error is one line and a status; an unknown option prints that
    subcommand's usage; a closed pipe ends quietly."""
    with CheckpointManager(tmp_path) as mgr:
        for step in (1, 2):
            mgr.save(step, {"s": [step]}, metrics={"accuracy": 0.5 + step / 10})
    bad_plot = cairn("metrics", str(tmp_path), "--plot", "/nonexistent/x.png", "--mode", "min")
    assert bad_plot.returncode == 2 and "Traceback" not in bad_plot.stderr
    assert bad_plot.stderr.strip().splitlines()[-1] == (
        "cairn: error: --plot /nonexistent/x.png: no such directory '/nonexistent'"
    )
    assert bad_plot.stdout == ""  # refused before the table is printed
    unknown = cairn("ls", str(tmp_path), "--bogus")
    assert unknown.returncode == 2 and "Traceback" not in unknown.stderr
    assert unknown.stderr.startswith("usage: cairn ls "), unknown.stderr
    assert "unrecognized arguments: --bogus" in unknown.stderr
    piped = subprocess.run(
        f"'{CAIRN}' metrics '{tmp_path}' | head -c 1",
        shell=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert piped.returncode == 0 and piped.stderr == "", piped.stderr


def test_metric_without_plot_selects_the_column(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"s": [1]}, metrics={"loss": 0.5, "accuracy": 0.7})
    out = cairn("metrics", str(tmp_path), "--metric", "accuracy")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["step accuracy", "1 0.7"]
    missing = cairn("metrics", str(tmp_path), "--metric", "bleu")
    assert missing.returncode == 2 and "no metric 'bleu'" in missing.stderr


def test_a_broken_pipe_mid_output_is_quiet(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        for step in range(1, 400):
            mgr.save(step, {"s": [step]}, metrics={"loss": 1.0 / step})
    piped = subprocess.run(
        f"'{CAIRN}' metrics '{tmp_path}' | head -n 2",
        shell=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert piped.stdout.splitlines()[0] == "step loss" and piped.stderr == "", piped.stderr


def test_orbax_names_get_the_cli_flag(tmp_path: Path) -> None:
    import orbax.checkpoint as ocp

    opts = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    with ocp.CheckpointManager(tmp_path, options=opts) as mgr:
        mgr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": np.ones(2)})))
    out = cairn("ls", str(tmp_path))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "run it again with --step-prefix ''" in out.stderr, out.stderr
    again = cairn("ls", str(tmp_path), "--step-prefix", "")
    assert again.returncode == 0 and "1" in again.stdout, again.stderr


def test_counts_are_spelled_right(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"s": [1]})
    verify = cairn("verify", str(tmp_path))
    assert verify.stdout.splitlines()[-1] == "1 step checked, 0 damaged", verify.stdout
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(2, {"s": [2]})
    gc = cairn("gc", str(tmp_path), "--keep-latest", "1")
    assert "1 step deleted, 1 kept: [2]" in gc.stdout, gc.stdout


def on_terminal(*args: str) -> tuple[int, str, str]:
    """Run cairn with its stdout on a pseudo-terminal (as a person at a shell); returns the
    status, what the terminal showed and stderr."""
    import os
    import pty

    leader, follower = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR")}
    proc = subprocess.Popen(
        [CAIRN, *args],
        stdin=subprocess.DEVNULL,
        stdout=follower,
        stderr=subprocess.PIPE,
        env=env | {"TERM": "xterm", "COLUMNS": "150"},
    )
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, shown.decode(), err.decode()


def test_tables_on_a_terminal_plain_lines_in_a_pipe(tmp_path: Path) -> None:
    """Issue 20, point 15: show, metrics and verify print the same rich tables as ls on a
    terminal (box drawing, bold headers); piped, they print the plain lines scripts read, and
    ls tab-separated columns (issue 43)."""
    with CheckpointManager(tmp_path) as mgr:
        for step in (1, 2):
            mgr.save(
                step, {"state": {"w": np.zeros((2, 3), np.float32)}}, metrics={"acc": step / 4}
            )
    bold = "\x1b[1m"
    for args, cells in [
        (("ls", str(tmp_path)), ["│    2 │", "acc=0.5"]),
        (("show", str(tmp_path), "2"), ["│ state ", "│ ['w']    │ float32[2, 3] "]),
        (("metrics", str(tmp_path)), ["│    1 │ 0.25 │", "│    2 │  0.5 │"]),
        (("verify", str(tmp_path)), ["│    1 │ ok     │", "│    2 │ ok     │"]),
    ]:
        code, shown, err = on_terminal(*args)
        assert code == 0 and err == "", (args, err)
        assert "┏" in shown and bold in shown, (args, shown)
        for cell in cells:
            assert cell in shown, (args, cell, shown)
        piped = cairn(*args)
        assert piped.returncode == 0 and "\x1b" not in piped.stdout, args
    assert cairn("metrics", str(tmp_path)).stdout.splitlines() == ["step acc", "1 0.25", "2 0.5"]
    listed = cairn("ls", str(tmp_path)).stdout.splitlines()  # issue 43: columns, no box drawing
    assert listed[0] == "step\tcommitted\tsize\tmetrics\titems\tstatus"
    assert [line.split("\t")[0] for line in listed[1:]] == ["1", "2"]
    assert listed[2].split("\t")[3:] == ["acc=0.5", "state", "listed"]
    assert not any(c in "".join(listed) for c in "┃│┏━")
    assert cairn("verify", str(tmp_path)).stdout.splitlines() == [
        "step 1: ok",
        "step 2: ok",
        "2 steps checked, 0 damaged",
    ]
    assert "  item 'state': train-state" in cairn("show", str(tmp_path), "2").stdout
    _, shown, _ = on_terminal("verify", str(tmp_path))
    assert shown.splitlines()[-1] == "2 steps checked, 0 damaged"
    (tmp_path / "checkpoint_2" / "state" / "tree.json").write_text("{}")
    code, shown, _ = on_terminal("verify", str(tmp_path))
    assert code == 1 and "DAMAGED" in shown and "tree.json" in shown
    assert shown.splitlines()[-1] == "2 steps checked, 1 damaged"


def test_metrics_options_are_honoured_or_refused(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        for step in (1, 2):
            mgr.save(step, {"s": [step]}, metrics={"loss": 1 / step, "accuracy": step / 4})
    one = cairn("metrics", str(tmp_path), "--metric", "accuracy", "--json")
    assert one.returncode == 0, one.stderr
    assert json.loads(one.stdout) == [{"step": 1, "accuracy": 0.25}, {"step": 2, "accuracy": 0.5}]
    mode = cairn("metrics", str(tmp_path), "--mode", "max")
    assert mode.returncode == 2 and mode.stdout == ""
    assert mode.stderr.splitlines() == [
        "cairn: error: --mode says which end of the metric --plot marks as best: it needs --plot"
    ]
    for sub in ("show", "metrics", "verify", "gc", "rm", "export"):
        unknown = cairn(sub, str(tmp_path), "--frobnicate")
        assert unknown.returncode == 2 and unknown.stderr.startswith(f"usage: cairn {sub} "), sub
        assert "Traceback" not in unknown.stderr


def test_metrics_plot_options_are_honoured_or_refused(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        for step in (1, 2):
            mgr.save(step, {"s": [step]}, metrics={"loss": 1 / step, "accuracy": step / 4})
    guess = cairn(  # no mode given nor recorded: the curve, no best step marked (issue 43)
        "metrics", str(tmp_path), "--metric", "accuracy", "--plot", str(tmp_path / "a.png")
    )
    assert guess.returncode == 0 and (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"
    assert "no best step marked: give --mode min or --mode max" in guess.stderr
    odd = cairn("metrics", str(tmp_path), "--plot", str(tmp_path / "a.nope"), "--mode", "max")
    assert odd.returncode == 2 and "Traceback" not in odd.stderr
    assert odd.stderr.splitlines()[-1].startswith(f"cairn: error: --plot {tmp_path / 'a.nope'}: ")
    best = cairn(
        "metrics", str(tmp_path), "--metric", "accuracy", "--plot", str(tmp_path / "a.png"),
        "--mode", "max",
    )  # fmt: skip
    assert best.returncode == 0 and (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"


def test_a_closed_pipe_is_a_nonzero_status_and_quiet(tmp_path: Path) -> None:
    """A reader that is gone (the read end closed before cairn writes a byte, so every write
    fails, whatever the pipe buffer holds): no traceback, no "Exception ignored" at exit, 141."""
    import os

    with CheckpointManager(tmp_path) as mgr:
        for step in (1, 2):
            mgr.save(step, {"s": [step]}, metrics={"loss": 1.0 / step})
    for args in (("ls",), ("metrics",), ("verify",), ("show",), ("metrics", "--json")):
        sub, *rest = args
        extra = ["2"] if sub == "show" else []
        read, write = os.pipe()
        os.close(read)
        try:
            done = subprocess.run(
                [CAIRN, sub, str(tmp_path), *extra, *rest],
                stdout=write,
                stderr=subprocess.PIPE,
                text=True,
                timeout=120,
            )
        finally:
            os.close(write)
        assert done.returncode == 141 and done.stderr == "", (args, done.stderr)


def test_orbax_advice_is_one_line(tmp_path: Path) -> None:
    import orbax.checkpoint as ocp

    opts = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    with ocp.CheckpointManager(tmp_path, options=opts) as mgr:
        mgr.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": np.ones(2)})))
    for sub in ("ls", "verify", "metrics"):
        out = cairn(sub, str(tmp_path))
        assert out.returncode == 2 and out.stdout == ""
        (line,) = out.stderr.splitlines()
        assert "--step-prefix ''" in line and "CheckpointManager" not in line, line
        assert "step_prefix=" not in line, line


def test_a_crafted_metric_name_is_text_in_a_terminal_table(tmp_path: Path) -> None:
    """Metric names are the metrics table's column headers on a terminal: escaped, never markup."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(
            1,
            {"s": [1]},
            metrics={
                "[bold red]x": 1.0,
                "\x1b]0;pwned\x07y": 2.0,
                "step": 3.0,
                "rows": 4.0,
                "title": 5.0,
            },
        )
    code, shown, err = on_terminal("metrics", str(tmp_path))
    assert code == 0 and err == "", err
    assert "[bold red]x" in shown and "\\x1b]0;pwned\\x07y" in shown, shown
    assert "\x1b]0;" not in shown and "\x07" not in shown


def test_plot_writes_the_file_it_names(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "run") as mgr:
        for step in (1, 2):
            mgr.save(step, {"s": [step]}, metrics={"loss": 1 / step})
    run = str(tmp_path / "run")
    bare = cairn("metrics", run, "--plot", str(tmp_path / "plot"), "--mode", "min")
    assert bare.returncode == 0 and bare.stderr == f"wrote {tmp_path / 'plot'}\n", bare.stderr
    assert (tmp_path / "plot").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "plot.png").exists()
    for target, message in [
        (str(tmp_path), "is a directory"),
        ("", "--plot needs the name of the PNG file to write"),
    ]:
        out = cairn("metrics", run, "--plot", target, "--mode", "min")
        assert out.returncode == 2 and out.stdout == "" and message in out.stderr, out
    assert not Path(str(tmp_path) + ".png").exists()


# ---------------------------------------------------------------------------- issue 43, point 6


def test_plot_marks_the_best_step_by_the_mode_the_run_recorded(tmp_path: Path) -> None:
    """A manager with best= (or one KeepBest) records its rule in each manifest; --plot then
    marks the best step without --mode, and --mode still wins."""
    with CheckpointManager(tmp_path, keep=KeepBest(5, "accuracy", mode="max")) as mgr:
        for step in (1, 2):
            mgr.save(step, {"s": [step]}, metrics={"loss": 1 / step, "accuracy": step / 4})
        assert mgr.info(2).best == ("accuracy", "max")
    plot = cairn("metrics", str(tmp_path), "--plot", str(tmp_path / "a.png"))
    assert plot.returncode == 0 and "no best step marked" not in plot.stderr, plot.stderr
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"
    other = cairn("metrics", str(tmp_path), "--metric", "loss", "--plot", str(tmp_path / "b.png"))
    assert other.returncode == 0 and "no best step marked" in other.stderr  # another metric


def test_version(tmp_path: Path) -> None:
    from importlib.metadata import version

    out = cairn("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"cairn {version('cairn-ckpt')}"


def test_no_flag_is_accepted_and_ignored(tmp_path: Path) -> None:
    make_run(tmp_path)
    for args, message in [
        (("ls", "--mode", "max"), "--metric and --mode say what --keep-best keeps"),
        (("ls", "--metric", "loss"), "give --keep-best N with them"),
        (("gc", "--keep-latest", "0"), "--keep-latest must be at least 1, got 0"),
        (("gc", "--keep-every", "-3"), "--keep-every must be at least 1, got -3"),
        (("ls", "--keep-best", "0", "--metric", "loss"), "--keep-best must be at least 1"),
    ]:
        out = cairn(args[0], str(tmp_path), *args[1:])
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)
        assert "KeepLatest" not in out.stderr and "Traceback" not in out.stderr


def test_messages_speak_shell(tmp_path: Path) -> None:
    """The lock error in a command's words (not read_only=True); dtypes as NumPy names them;
    bytes_written an int in --json; export's destination explained in --help."""
    with CheckpointManager(tmp_path) as writer:
        writer.save(1, {"state": {"w": np.ones((2, 3), np.float32), "n": np.arange(4)}})
        writer.wait_until_finished()
        locked = cairn("gc", str(tmp_path), "--keep-latest", "1")
    assert locked.returncode == 2 and "read_only=True" not in locked.stderr
    assert "cairn ls, show, verify and metrics read alongside it" in locked.stderr
    shown = cairn("show", str(tmp_path), "1")
    assert shown.returncode == 0 and "float32[2, 3]" in shown.stdout and "<f4" not in shown.stdout
    assert "int64[4]" in shown.stdout
    as_json = json.loads(cairn("show", str(tmp_path), "1", "--json").stdout)
    assert type(as_json["bytes_written"]) is int
    helped = cairn("export", "--help")
    assert "DESTINATION/<step>" in " ".join(helped.stdout.split())


def test_the_plot_extra_is_named() -> None:
    from cairn.handlers._optional import EXTRAS

    assert EXTRAS["matplotlib"] == "plot"


def test_a_users_metadata_does_not_make_a_cairn_step_an_orbax_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`metadata={"format": "orbax"}` given to save is the user's: the step is still cairn's,
    verified against its checksums and considered by gc (only Orbax's own steps are exempt)."""
    with CheckpointManager(tmp_path, step_prefix="") as mgr:
        mgr.save(0, {"state": {"w": np.arange(4.0)}}, metadata={"format": "orbax"})
        mgr.save(1, {"state": {"w": np.arange(4.0)}})
    code, out, _ = run_cli(capsys, "verify", str(tmp_path), "--step-prefix", "", "--json")
    assert code == 0
    assert [r.get("format") for r in strict_json(out)] == [None, None]
    code, out, _ = run_cli(
        capsys, "gc", str(tmp_path), "--step-prefix", "", "--keep-latest", "1", "--dry-run"
    )
    assert code == 0 and "would delete step 0" in out.lower()


# ---------------------------------------------------------------------------- a local tier

LS_COLUMNS = ["committed", "size", "metrics", "items", "status"]


def local_run(root: Path) -> None:
    """A persistent step every 5, a local part every 2 (two kept): parts 8 and 10, the save of
    10 in both tiers."""
    local = LocalTier(root / "local-{process}", save=EveryNSteps(2), keep=KeepLatest(2))
    with CheckpointManager(root / "ckpts", save=EveryNSteps(5), local=local) as mgr:
        for step in range(1, 11):
            if mgr.should_save(step):
                mgr.save(step, {"state": {"w": np.arange(3) * step}}, metrics={"loss": 1 / step})


def records(directory: Path) -> dict[int, dict[str, Any]]:
    with CheckpointManager(directory, read_only=True) as mgr:
        return {step: mgr.info(step).metadata[PART] for step in mgr.all_steps()}


def test_ls_of_a_local_tier_shows_whose_part_each_step_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ls` of a local tier's directory lists the parts in its process_<p> directories (owner,
    own, the save, whether it went to the persistent tier too); of one process_<p> directory,
    the same columns but `held`; of the persistent directory, no part columns."""
    local_run(tmp_path)
    local, part = tmp_path / "local-0", tmp_path / "local-0" / "process_0"
    recorded = records(part)
    assert [(r["process"], r["persistent"], r["holder"]) for r in recorded.values()] == [
        (0, False, 0),
        (0, True, 0),
    ]
    save8, save10 = recorded[8]["save"][:8], recorded[10]["save"][:8]
    code, out, err = run_cli(capsys, "ls", str(local))
    assert code == 0 and err == ""  # no step-like hint about process_0 (it was named one)
    lines = [line.split("\t") for line in out.splitlines()]
    assert lines[0] == ["step", "process", "held", "save", "persistent", *LS_COLUMNS]
    assert [row[:5] for row in lines[1:]] == [
        ["8", "0", "own", save8, "no"],
        ["10", "0", "own", save10, "yes"],
    ]
    assert [(row[7], row[-1]) for row in lines[1:]] == [
        ("loss=0.125", "listed"),
        ("loss=0.1", "listed"),
    ]
    code, out, err = run_cli(capsys, "ls", str(part))
    lines = [line.split("\t") for line in out.splitlines()]
    assert code == 0 and lines[0] == ["step", "process", "save", "persistent", *LS_COLUMNS]
    assert [row[:4] for row in lines[1:]] == [["8", "0", save8, "no"], ["10", "0", save10, "yes"]]
    code, out, _ = run_cli(capsys, "ls", str(tmp_path / "ckpts"))
    assert code == 0 and out.splitlines()[0].split("\t") == ["step", *LS_COLUMNS]
    # --json: the keys ls always has, plus the part's record (and, of a local tier's
    # directory, its owner and whether it is the holder's own)
    plain = strict_json(run_cli(capsys, "ls", str(tmp_path / "ckpts"), "--json")[1])
    assert [set(r) for r in plain] == [
        {"step", "committed_at", "bytes", "metrics", "items", "status"}
    ] * 2
    of_part = strict_json(run_cli(capsys, "ls", str(part), "--json", "--verify")[1])
    assert [set(r) - set(plain[0]) for r in of_part] == [{"part"}] * 2
    assert [(r["step"], r["part"], r["status"]) for r in of_part] == [
        (8, recorded[8], "ok"),
        (10, recorded[10], "ok"),
    ]
    of_tier = strict_json(run_cli(capsys, "ls", str(local), "--json", "--keep-latest", "1")[1])
    assert [(r["step"], r["owner"], r["held"], r["part"], r["kept_by"]) for r in of_tier] == [
        (8, 0, "own", recorded[8], []),
        (10, 0, "own", recorded[10], ["KeepLatest", "newest"]),
    ]
    assert list(of_tier[0])[:3] == ["step", "owner", "held"]
    code, shown, _ = on_terminal("ls", str(local))
    assert code == 0 and "held" in shown and "own" in shown and save10 in shown


def as_part(source: Path, target: Path, process: int, processes: int, **record: Any) -> None:
    """`source`'s parts copied to `target`, recorded as process `process`'s of `processes`
    (and with `record`'s other keys, a key given None removed)."""
    shutil.copytree(source, target)
    for path in sorted(target.glob("checkpoint_*/_CHECKPOINT.json")):
        body = load_checked(path.read_bytes(), str(path))
        part = body["metadata"][PART]
        part.update(process=process, processes=processes, **record)
        body["metadata"][PART] = {k: v for k, v in part.items() if v is not None}
        path.write_bytes(dump_checked(body))


def test_ls_of_a_local_tier_tells_replicas_from_own_parts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Process 1's local directory in a job of 3, holding its own parts and a replica of process
    0's: each part records the process that committed it (`holder`), so `ls` tells them apart,
    a damaged part by the directory's one holder; parts that record none (saved before cairn
    recorded holders) are told apart by --process, and `ls` says so without it; a crafted
    holder is no holder; a save id from the directory is printed as text."""
    local_run(tmp_path)
    source, holder = tmp_path / "local-0" / "process_0", tmp_path / "host"
    as_part(source, holder / "process_1", 1, 3, holder=1)
    as_part(source, holder / "process_0", 0, 3, save=EVIL, holder=1)
    (holder / "process_0" / "checkpoint_8" / "_CHECKPOINT.json").write_text("{}")
    code, out, err = run_cli(capsys, "ls", str(holder))
    assert code == 0 and err == ""
    lines = [line.split("\t") for line in out.splitlines()]
    assert [row[:3] for row in lines[1:]] == [
        ["8", "0", "replica"],
        ["8", "1", "own"],
        ["10", "0", "replica"],
        ["10", "1", "own"],
    ]
    assert lines[1][3:5] == ["-", "-"] and lines[1][-1].startswith("damaged: ")
    assert lines[3][3] == "\\x1b]0;pwne"  # the crafted save id, as text
    for bad in (None, "1", True, -1):  # none recorded, or not a process index
        shutil.rmtree(holder)
        as_part(source, holder / "process_1", 1, 3, holder=bad)
        as_part(source, holder / "process_0", 0, 3, holder=bad)
        code, out, err = run_cli(capsys, "ls", str(holder))
        assert code == 0 and "give --process P" in err and len(err.splitlines()) == 1
        assert [line.split("\t")[2] for line in out.splitlines()[1:]] == ["-"] * 4
    code, out, err = run_cli(capsys, "ls", str(holder), "--process", "1", "--json")
    rows = strict_json(out)
    assert code == 0 and err == ""
    assert [(r["step"], r["owner"], r["held"]) for r in rows] == [
        (8, 0, "replica"),
        (8, 1, "own"),
        (10, 0, "replica"),
        (10, 1, "own"),
    ]
    assert rows[3]["part"]["processes"] == 3 and rows[3]["part"]["holder"] == -1
    lines = [
        line.split("\t")
        for line in run_cli(capsys, "ls", str(holder), "--process", "1")[1].splitlines()
    ]
    assert [row[2] for row in lines[1:]] == ["replica", "own", "replica", "own"]
    for args, message in [
        ((str(holder), "--process", "2"), "no process_2 in it (it holds process_0, process_1)"),
        ((str(holder), "--process", "-1"), "--process must be at least 0, got -1"),
        ((str(tmp_path / "ckpts"), "--process", "0"), "--process reads a local tier's directory"),
        ((str(source), "--process", "0"), "--process reads a local tier's directory"),
    ]:
        code, out, err = run_cli(capsys, "ls", *args)
        assert (code, out) == (2, "") and err.startswith("cairn: error: ") and message in err
        assert len(err.splitlines()) == 1
