"""A trainer-like process for the crash tests: saves deterministic states in a loop until killed.

    python crash_writer.py ROOT [--sync] [--keep-latest N] [--keep-best N] [--late-metrics]

Each step's content is a pure function of the step (`expected_state`), so a checker can verify any
step that survives. After each save() returns it prints ``saved <step>`` (flushed). With
--late-metrics it then records ``eval`` for that step (record_metrics waits for the commit).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

from cairn.manager import AnyOf, CheckpointManager, KeepAll, KeepBest, KeepLatest, KeepPolicy


def expected_state(step: int) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    return {
        "layers": [rng.standard_normal((128, 128)).astype(np.float32) for _ in range(6)],
        "bias": np.full(7, step, np.int64),
        "step": step,
    }


def eval_metric(step: int) -> float:
    return float((step * 7919) % 13)


def keep_policy(keep_latest: int, keep_best: int) -> KeepPolicy:
    parts: list[KeepPolicy] = []
    if keep_latest:
        parts.append(KeepLatest(keep_latest))
    if keep_best:
        parts.append(KeepBest(keep_best, "eval", mode="min"))
    if not parts:
        return KeepAll()
    return parts[0] if len(parts) == 1 else AnyOf(*parts)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--sync", action="store_true")
    parser.add_argument("--keep-latest", type=int, default=0)
    parser.add_argument("--keep-best", type=int, default=0)
    parser.add_argument("--late-metrics", action="store_true")
    args = parser.parse_args()
    keep = keep_policy(args.keep_latest, args.keep_best)
    mgr = CheckpointManager(args.root, keep=keep, async_save=not args.sync)
    latest = mgr.latest_step()
    step = 0 if latest is None else latest + 1
    while True:
        mgr.save(step, {"state": expected_state(step)})
        print(f"saved {step}", flush=True)
        if args.late_metrics:
            mgr.record_metrics(step, {"eval": eval_metric(step)})
        step += 1


if __name__ == "__main__":
    sys.exit(main())
