"""What checking every byte costs: restore throughput of this cairn against an earlier one.

Format 2 checks each chunk file against the XXH3-128 content hash in the manifest (format 1
checked only each chunk's own crc32c tail). This benchmark restores the same train state,
written by each version in its own format, with this tree's cairn and with a given earlier
checkout's, alternating the two in fresh processes round after round (same-run pairs: this
machine is shared and noisy), and reports medians, ranges and the paired ratio, beside the
machine's limit for the same bytes (reading them back from one file, page cache warm).

    .venv/bin/python bench/bench_verify_cost.py --old /tmp/old   # a dir holding cairn/{manager,handlers}
    git archive <commit> manager handlers | tar -x -C /tmp/old/cairn   # how to make one

Results: bench/results/verify_cost.json.
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
import json, os, sys, time
import numpy as np
from cairn.manager import CheckpointManager
root, nbytes, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(0)
leaves = {f"layer_{i}": rng.standard_normal(nbytes // 4 // 16, dtype=np.float32) for i in range(16)}
if not os.path.exists(root):
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"state": leaves})
    with open(os.path.join(root, "plain"), "wb") as f:  # the same bytes in one file
        for v in leaves.values():
            f.write(v.tobytes())
        f.flush(); os.fsync(f.fileno())
times, plain = [], []
with CheckpointManager(root, read_only=True) as mgr:
    for _ in range(repeats):
        t = time.perf_counter(); out = mgr.restore(1)["state"]; times.append(time.perf_counter() - t)
        t = time.perf_counter()
        with open(os.path.join(root, "plain"), "rb") as f:
            while f.read(64 << 20): pass
        plain.append(time.perf_counter() - t)
assert all(np.array_equal(out[k], leaves[k]) for k in leaves)
print(json.dumps({"restore_s": times, "plain_read_s": plain}))
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
    parser.add_argument("--repeats", type=int, default=3, help="restores per process (best kept)")
    args = parser.parse_args()
    nbytes = parse_size(args.size)
    SCRATCH.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=SCRATCH))
    rows: dict[str, list[float]] = {"new": [], "old": [], "plain": []}
    try:
        for r in range(args.rounds):
            order = [("new", None), ("old", args.old)]
            for name, src in order if r % 2 == 0 else order[::-1]:
                result = run(src, scratch / name, nbytes, args.repeats)
                rows[name].append(
                    min(result["restore_s"])
                )  # warm page cache: the best of the process
                rows["plain"].append(min(result["plain_read_s"]))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    gib = nbytes / (1 << 30)
    ratios = [n / o for n, o in zip(rows["new"], rows["old"], strict=True)]
    summary = {
        "size": args.size,
        "rounds": args.rounds,
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "restore_GiB_per_s": {
            k: {"median": gib / statistics.median(v), "min": gib / max(v), "max": gib / min(v)}
            for k, v in rows.items()
        },
        "time_ratio_new_over_old": {
            "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)
        },
        "seconds": rows,
    }  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "verify_cost.json").write_text(json.dumps(summary, indent=1))
    for k, v in summary["restore_GiB_per_s"].items():
        print(f"{k:>6}: {v['median']:.2f} GiB/s (range {v['min']:.2f}-{v['max']:.2f})")
    t = summary["time_ratio_new_over_old"]
    print(
        f"restore time, new / old: median {t['median']:.3f} (range {t['min']:.3f}-{t['max']:.3f})"
    )


if __name__ == "__main__":
    main()
