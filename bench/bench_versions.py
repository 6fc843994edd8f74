"""Save and restore on disk: this tree's cairn against an earlier one, in the same run.

Saves (synchronous, each into a fresh directory, durable) and restores (page cache warm) the
same train state with this tree's cairn and with a given earlier checkout's, alternating the two
in fresh processes round after round (same-run pairs: this machine is shared and noisy), and
reports medians, ranges and the paired time ratios, beside the machine's limits for the same
bytes (one file written and fsynced; the same file read back).

    mkdir -p /tmp/old/cairn && git archive <commit> manager handlers | tar -x -C /tmp/old/cairn
    .venv/bin/python bench/bench_versions.py --old /tmp/old [--size 256M] [--rounds 7]

Results: bench/results/versions.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import RESULTS, SCRATCH, parse_size

WORKER = """
import json, os, shutil, sys, time
import numpy as np
from cairn.manager import CheckpointManager
root, nbytes, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(0)
leaves = {f"layer_{i}": rng.standard_normal(nbytes // 4 // 16, dtype=np.float32) for i in range(16)}
saves, plain_write = [], []
for r in range(repeats):
    target = os.path.join(root, f"save-{r}")
    t = time.perf_counter()
    with CheckpointManager(target, async_save=False) as mgr:
        mgr.save(1, {"state": leaves})
    saves.append(time.perf_counter() - t)
    t = time.perf_counter()
    with open(os.path.join(root, f"plain-{r}"), "wb") as f:  # the same bytes in one file
        for v in leaves.values():
            f.write(v.data)
        f.flush(); os.fsync(f.fileno())
    plain_write.append(time.perf_counter() - t)
restores, plain_read = [], []
with CheckpointManager(os.path.join(root, "save-0"), read_only=True) as mgr:
    for r in range(repeats):
        t = time.perf_counter(); out = mgr.restore(1)["state"]; restores.append(time.perf_counter() - t)
        t = time.perf_counter()
        with open(os.path.join(root, "plain-0"), "rb") as f:
            while f.read(64 << 20): pass
        plain_read.append(time.perf_counter() - t)
assert all(np.array_equal(out[k], leaves[k]) for k in leaves)
shutil.rmtree(root)
print(json.dumps({"save": saves, "restore": restores, "plain_write": plain_write,
                  "plain_read": plain_read}))
"""


def run(src: Path | None, root: Path, nbytes: int, repeats: int) -> dict[str, list[float]]:
    env = dict(os.environ)
    if src is not None:  # an earlier cairn first on the path (cairn is a namespace package)
        env["PYTHONPATH"] = f"{src}{os.pathsep}{env.get('PYTHONPATH', '')}"
    out = subprocess.run(
        [sys.executable, "-c", WORKER, str(root), str(nbytes), str(repeats)],
        env=env, check=True, capture_output=True, text=True,
    )  # fmt: skip
    result: dict[str, list[float]] = json.loads(out.stdout.splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--old", type=Path, required=True, help="a dir with cairn/{manager,handlers}"
    )
    parser.add_argument("--size", default="256M")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=3, help="per process (best kept)")
    args = parser.parse_args()
    nbytes = parse_size(args.size)
    SCRATCH.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=SCRATCH))
    kinds = ("save", "restore", "plain_write", "plain_read")
    rows: dict[str, dict[str, list[float]]] = {v: {k: [] for k in kinds} for v in ("new", "old")}
    try:
        for r in range(args.rounds):
            order = [("new", None), ("old", args.old)]
            for name, src in order if r % 2 == 0 else order[::-1]:
                result = run(src, scratch / name, nbytes, args.repeats)
                for kind in kinds:  # the best of the process: the least disturbed
                    rows[name][kind].append(min(result[kind]))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    gib = nbytes / (1 << 30)

    def spread(values: list[float]) -> dict[str, float]:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    summary = {
        "size": args.size,
        "rounds": args.rounds,
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "GiB_per_s": {
            f"{v}.{k}": spread([gib / s for s in rows[v][k]]) for v in rows for k in kinds
        },
        "time_ratio_new_over_old": {
            k: spread([n / o for n, o in zip(rows["new"][k], rows["old"][k], strict=True)])
            for k in ("save", "restore")
        },
        "seconds": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "versions.json").write_text(json.dumps(summary, indent=1))
    for k, v in summary["GiB_per_s"].items():
        print(f"{k:>18}: {v['median']:.2f} GiB/s (range {v['min']:.2f}-{v['max']:.2f})")
    for k, t in summary["time_ratio_new_over_old"].items():
        print(
            f"{k} time, new / old: median {t['median']:.3f} (range {t['min']:.3f}-{t['max']:.3f})"
        )


if __name__ == "__main__":
    main()
