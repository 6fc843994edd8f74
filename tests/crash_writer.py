"""A trainer-like process for the crash tests: saves deterministic states in a loop until killed.

    python crash_writer.py ROOT [--sync] [--keep-latest N] [--keep-best N] [--late-metrics]
                                [--dataset] [--incremental] [--kill-in PHASE --kill-at N]

Each step's content is a pure function of the step (`expected_state`, and with --dataset an
iterator advanced `step` elements, kept by keep_items={"data": KeepLatest(1)}), so a checker can
verify any step that survives. Its ``frozen`` leaf never changes, so with --incremental every
step but the first links the pack that holds it (in the packed layout, the default; the file of
its chunk and its zarr.json in the zarr layout) to the step before, which retention then
deletes. After each save() returns it prints ``saved <step>`` (flushed).
With --late-metrics it then records ``eval`` for that step (record_metrics waits for the commit).

--kill-in PHASE makes the process SIGKILL itself at the N-th time it reaches PHASE (counted from
the end of its first committed save, so every trial commits something): a deterministic point
in the commit protocol, where the plain harness kills at random moments.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
from support.iterutil import Shuffled, advanced

from cairn.manager import AnyOf, CheckpointManager, KeepAll, KeepBest, KeepLatest, KeepPolicy


def expected_state(step: int) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    return {
        "layers": [rng.standard_normal((128, 128)).astype(np.float32) for _ in range(6)],
        "bias": np.full(7, step, np.int64),
        # 1 MiB in one chunk: staged, then written with O_DIRECT (a chunk of 1 MiB or more)
        "embedding": np.arange(256 * 1024, dtype=np.float32).reshape(256, 1024) + step,
        # 2 MiB, the same every step: more than half the pack it shares with the other leaves
        # (the packed layout links a previous pack only then)
        "frozen": np.linspace(-1, 1, 512 * 1024, dtype=np.float32),
        "step": step,
    }


def expected_data(step: int) -> Shuffled:
    return advanced(Shuffled(), step)


def _phases() -> dict[str, tuple[Any, str, str, Callable[..., bool]]]:
    """PHASE -> (owner, attribute, "before"|"after", which calls count)."""
    from cairn.handlers import _files
    from cairn.manager._storage import posix as _posix

    def every(*args: Any) -> bool:
        return True

    storage = _posix.PosixStorage
    return {
        "file-written": (_files.LocalDestination, "_put", "after", every),
        "file-linked": (_files.LocalDestination, "_link", "after", every),
        "manifest-written": (_posix, "fsync_tree", "before", every),
        "durable-not-renamed": (_posix, "fsync_tree", "after", every),
        "after-a-rename": (_posix, "fsync_dir", "before", every),
        "metrics-before": (storage, "write_metrics", "before", every),
        "metrics-after": (storage, "write_metrics", "after", every),
        "drop-item-before": (storage, "drop_item", "before", every),
        "drop-item-between": (_posix, "trash_name", "before", lambda n: n.endswith("-data")),
        "drop-item-after": (storage, "drop_item", "after", every),
        "delete-before": (storage, "delete_step", "before", every),
        "delete-after": (storage, "delete_step", "after", every),
        "reclaim": (_posix, "_remove_trash", "before", every),
    }


PHASES = sorted(
    [
        "file-written",
        "file-linked",
        "manifest-written",
        "durable-not-renamed",
        "after-a-rename",
        "metrics-before",
        "metrics-after",
        "drop-item-before",
        "drop-item-between",
        "drop-item-after",
        "delete-before",
        "delete-after",
        "reclaim",
    ]
)


def arm_kill(phase: str, nth: int) -> Callable[[], None]:
    """Wrap the function of `phase` to SIGKILL this process at its `nth` call after arming;
    returns the function that arms it."""
    owner, attr, when, counts = _phases()[phase]
    real = getattr(owner, attr)
    state = {"armed": False, "calls": 0}

    def hit(args: tuple[Any, ...]) -> None:
        if state["armed"] and counts(*args[:1]):
            state["calls"] += 1
            if state["calls"] == nth:
                os.kill(os.getpid(), signal.SIGKILL)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if when == "before":
            hit(args[1:] if isinstance(owner, type) else args)  # a method: skip self
        out = real(*args, **kwargs)
        if when == "after":
            hit(args[1:] if isinstance(owner, type) else args)
        return out

    setattr(owner, attr, wrapper)
    return lambda: state.update(armed=True)


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
    parser.add_argument("--dataset", action="store_true")
    parser.add_argument("--incremental", action="store_true")
    parser.add_argument("--kill-in", choices=PHASES, default=None)
    parser.add_argument("--kill-at", type=int, default=1)
    args = parser.parse_args()
    arm = arm_kill(args.kill_in, args.kill_at) if args.kill_in else None
    keep = keep_policy(args.keep_latest, args.keep_best)
    keep_items = {"data": KeepLatest(1)} if args.dataset else None
    mgr = CheckpointManager(
        args.root,
        keep=keep,
        keep_items=keep_items,
        async_save=not args.sync,
        incremental=args.incremental,
    )
    latest = mgr.latest_step()
    step = 0 if latest is None else latest + 1
    while True:
        items: dict[str, Any] = {"state": expected_state(step)}
        if args.dataset:
            items["data"] = expected_data(step)
        mgr.save(step, items)
        print(f"saved {step}", flush=True)
        if args.late_metrics:
            mgr.record_metrics(step, {"eval": eval_metric(step)})
        if arm is not None:
            mgr.wait_until_finished()  # one step is committed: from here on, the kill may come
            arm()
            arm = None
        step += 1


if __name__ == "__main__":
    sys.exit(main())
