"""The first save of a manager against the hundredth: what each costs the training loop.

For each size (256M and 1G by default; a process per size) on the T5X-like train state of
bench_train_state.py (172 jax CPU arrays), trained by the memory-bound ``elementwise`` step of
bench_overhead.py (it reads and writes every leaf once and donates the state, as T5X's does),
per repetition, in rotated order:

* ``cairn first``: a new ``CheckpointManager`` (a restarted job that restores nothing, or a
  job's first save): its first save;
* ``cairn after restore``: a new manager on a directory holding one step, which restores it
  (into ``ShapeDtypeStruct`` targets; the restored tree is dropped, the trainer's state is the
  same size), trains for the baseline, then saves: a preempted job's first save after resuming;
* ``cairn steady``: one long-lived manager that has saved twice before (the staging pool warm);
* ``orbax first``: a new orbax-checkpoint ``CheckpointManager`` (async), its first save;
* ``plain-writer``: no checkpointer, the state's bytes (from a pre-faulted buffer) written with
  ``O_DIRECT`` by 4 threads at nice 19 and fsynced (bench_overhead.PlainWriter): the floor for
  what any commit that writes beside training costs the steps;
* the machine's limits for the same bytes, once per repetition: one buffered write + fsync of
  every leaf into one file, and one ``O_DIRECT`` write + fsync (bench_overhead.limits).

Each save runs in bench_overhead's window: a baseline of ``--baseline-s`` seconds of steps, then
``save()`` and steps until the first step that ends after the commit (and the retired step's
removal). Recorded: ``save()`` blocked; the first step's extra time; the training time lost
(window minus steps x the baseline's time per step); save start to committed, under training;
whether JAX donated. Ratios are paired within a repetition: lost ÷ ``orbax first``'s lost, and
the buffered write+fsync time ÷ the commit time (a throughput ratio).

    .venv/bin/python bench/bench_first_save.py              # 256M and 1G, 5 reps, ~6 min here
    .venv/bin/python bench/bench_first_save.py --quick      # smoke run: 16M, 2 reps
    .venv/bin/python bench/bench_first_save.py --markdown   # the JSON as Markdown tables
    .venv/bin/python bench/bench_first_save.py --plot       # redraw docs/benchmarks_first_save.png
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import bench_overhead as bo
import bench_train_state as bts
import numpy as np
from _common import (
    REPO,
    RESULTS,
    SCRATCH,
    MiB,
    machine_facts,
    now,
    quiet_logs,
    run_in_child,
    spread,
)

X, D = "\u00d7", "\u2013"
PNG = REPO / "docs" / "benchmarks_first_save.png"
ROWS = ("cairn first", "cairn after restore", "cairn steady", "orbax first", bo.FLOOR_WRITER)
# (row, what, goal of lost ÷ orbax first, goal of write+fsync ÷ commit)
TARGETS = (
    ("cairn first", "first save of a new manager", 1.0, 0.9),
    ("cairn after restore", "first save after restore()", 0.3, None),
    ("cairn steady", "steady state", 0.25, None),
)
NO_BASE = {"step_s": 0.0, "gap_s": 0.0, "cpu_per_step": 0.0, "faults_per_step": 0.0}


def run_size(label: str, reps: int, baseline_s: float, log: Any) -> dict[str, Any]:
    import jax

    quiet_logs()
    import orbax.checkpoint  # noqa: F401  (import time kept out of the windows)

    import cairn.manager  # noqa: F401

    tree = bts.build_state(label)
    leaves = jax.tree.leaves(tree)
    info = bts.describe_state(label, leaves)
    n_leaves = info["leaves"]
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
    )
    scratch = SCRATCH / f"first-save-{label}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    views = [np.asarray(x) for x in leaves]
    del leaves
    state = [tree]
    del tree
    trainer = bo.trainer_for("elementwise", label, state, 32)
    for _ in range(3):
        trainer.step()
    steady = bo.make_runner("cairn", scratch / "steady", abstract)
    for step in range(2):  # the pool warm, and a step to restore from
        bo.save_window(trainer, steady, step, NO_BASE, n_leaves)
    for name in ("cairn", "orbax"):  # first uses in this process: imports, compiles, threads
        runner = bo.make_runner(name, scratch / f"warm-{name}", abstract)
        bo.save_window(trainer, runner, 0, NO_BASE, n_leaves)
        runner.close()
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in ROWS}
    limits: list[dict[str, float]] = []
    step = 10
    for rep in range(reps):
        bts.clean_memory()
        # the limits hold the state's views: dropped before the windows (donation)
        limits.append(bo.limits(views, scratch / "plain.bin"))
        (scratch / "plain.bin").unlink(missing_ok=True)
        k = rep % len(ROWS)
        for name in ROWS[k:] + ROWS[:k]:
            bts.clean_memory()
            where = scratch / f"{name.replace(' ', '-')}-{rep}"
            if name == "cairn steady":
                runner = steady
            elif name == bo.FLOOR_WRITER:
                runner = bo.PlainWriter(where, info["bytes"])
            elif name == "cairn after restore":
                shutil.copytree(scratch / "steady", where, ignore=shutil.ignore_patterns(".*"))
                runner = bo.make_runner("cairn", where, abstract)
                restored = runner.restore(runner.mgr.latest_step())
                del restored
            else:
                runner = bo.make_runner(name.split()[0], where, abstract)
            base = bo.baseline(trainer, baseline_s)
            window = bo.save_window(trainer, runner, step, base, n_leaves)
            window["baseline_step_s"] = base["step_s"]
            rows[name].append(window)
            step += 1
            if runner is not steady:
                runner.close()
                shutil.rmtree(where, ignore_errors=True)
        log(f"[{label}] rep {rep + 1}/{reps}")
    steady.close()
    del views
    shutil.rmtree(scratch, ignore_errors=True)
    paired: dict[str, dict[str, Any]] = {}
    for name in ROWS:
        lost = [
            w["lost_s"] / o["lost_s"] for w, o in zip(rows[name], rows["orbax first"], strict=True)
        ]
        disk = [
            lim["write_fsync"] / w["commit_s"] for w, lim in zip(rows[name], limits, strict=True)
        ]
        paired[name] = {
            "lost_vs_orbax_first": spread(lost, 4),
            "write_fsync_vs_commit": spread(disk, 4),
        }
    return {
        "tree": info,
        "rows": {
            name: {key: spread([w[key] for w in ws], 6) for key in ws[0]}
            for name, ws in rows.items()
        },
        "limits": {key: spread([lim[key] for lim in limits], 6) for key in limits[0]},
        "paired": paired,
    }


# ----------------------------------------------------------------------------- output


def cell(s: dict[str, Any], scale: float = 1e3, digits: int = 0) -> str:
    return (
        f"{s['median'] * scale:.{digits}f} ({s['min'] * scale:.{digits}f}{D}"
        f"{s['max'] * scale:.{digits}f})"
    )


def markdown(result: dict[str, Any]) -> str:
    lines = []
    for label, entry in result["sizes"].items():
        rows, paired = entry["rows"], entry["paired"]
        wf = entry["limits"]["write_fsync"]
        lines += [
            f"**{label}** ({entry['tree']['bytes'] / MiB:.0f} MiB, {entry['tree']['leaves']} "
            f"leaves; buffered write+fsync of the same bytes {cell(wf)} ms), median (min{D}max) "
            f"of {rows['cairn first']['lost_s']['n']} windows:",
            "",
            "| | save() blocked (ms) | first step after: extra (ms) | training time lost (ms) "
            "| lost ÷ Orbax's first | committed after (ms) | write+fsync ÷ commit |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for name in ROWS:
            r, p = rows[name], paired[name]
            lines.append(
                f"| {name} | {cell(r['blocked_s'])} | {cell(r['first_step_extra_s'])} | "
                f"{cell(r['lost_s'])} | {cell(p['lost_vs_orbax_first'], 1, 2)}{X} | "
                f"{cell(r['commit_s'])} | {cell(p['write_fsync_vs_commit'], 1, 2)}{X} |"
            )
        lines += ["", "| target | measured | met |", "|---|---|---|"]
        for name, what, lost_goal, disk_goal in TARGETS:
            r = paired[name]["lost_vs_orbax_first"]["median"]
            lines.append(
                f"| {what}: training time lost ÷ Orbax's first save, ≤ {lost_goal} | "
                f"{r:.2f}{X} | {'yes' if r <= lost_goal else '**no**'} |"
            )
            if disk_goal is not None:
                d = paired[name]["write_fsync_vs_commit"]["median"]
                lines.append(
                    f"| {what}: commit ÷ buffered write+fsync (throughput), ≥ {disk_goal} | "
                    f"{d:.2f}{X} | {'yes' if d >= disk_goal else '**no**'} |"
                )
        lines.append("")
    return "\n".join(lines)


def plot(result: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(result["sizes"])
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 3.8), squeeze=False)
    for ax, label in zip(axes[0], sizes, strict=True):
        rows = result["sizes"][label]["rows"]
        med = [rows[n]["lost_s"]["median"] for n in ROWS]
        lo = [m - rows[n]["lost_s"]["min"] for m, n in zip(med, ROWS, strict=True)]
        hi = [rows[n]["lost_s"]["max"] - m for m, n in zip(med, ROWS, strict=True)]
        colors = ["#4c72b0", "#55a868", "#8172b2", "#c44e52", "#999999"]
        ax.bar(range(len(ROWS)), med, yerr=[lo, hi], color=colors, capsize=4)
        ax.set_xticks(range(len(ROWS)), [n.replace(" ", "\n", 1) for n in ROWS], fontsize=8)
        ax.set_ylabel("training time lost per save (s)")
        ax.set_title(f"{label}: median, min{D}max bars")
    fig.suptitle(
        f"First save against steady state, elementwise step ({result['date_utc']} UTC, "
        f"{result['git']})",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=110)


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="256M,1G")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--baseline-s", type=float, default=1.5)
    parser.add_argument("--label", default="", help="names the result: first_save-LABEL.json")
    parser.add_argument("--quick", action="store_true", help="smoke run: 16M, 2 reps")
    parser.add_argument("--markdown", action="store_true", help="print the JSON as Markdown")
    parser.add_argument("--plot", action="store_true", help=f"redraw {PNG.name}")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    name = (
        "first_save" + (f"-{args.label}" if args.label else "") + ("-quick" if args.quick else "")
    )
    json_path = args.json or RESULTS / f"{name}.json"
    if args.markdown or args.plot:
        result = json.loads(json_path.read_text())
        if args.plot:
            plot(result, PNG)
            print(f"wrote {PNG}")
        else:
            print(markdown(result))
        return 0
    if args.quick:
        args.sizes, args.reps, args.baseline_s = "16M", 2, 0.5
    t0 = now()

    def log(msg: str) -> None:
        print(f"{now() - t0:7.1f}s  {msg}", file=sys.stderr, flush=True)

    if args.worker:
        entry = run_size(args.worker, args.reps, args.baseline_s, log)
        json_path.write_text(json.dumps(entry) + "\n")
        return 0
    result: dict[str, Any] = {
        "benchmark": "bench/bench_first_save.py",
        "git": subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "config": {"reps": args.reps, "baseline_s": args.baseline_s},
        "machine": machine_facts(),
        "sizes": {},
    }
    for label in [s.strip().upper() for s in args.sizes.split(",") if s.strip()]:
        options = {"reps": args.reps, "baseline_s": args.baseline_s}
        part = RESULTS / f".first_save-{label}.partial.json"
        result["sizes"][label] = run_in_child(__file__, label, options, part)
        log(f"[{label}] done")
    result["wall_s"] = round(now() - t0, 1)
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))
    log(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
