"""A trainer that saves with ``writer="process"`` for tests/manager/test_writer_process.py.

``python writer_trainer.py DIR SEED STEPS`` (DIR a path or an s3:// or gs:// URL) saves steps 1..STEPS (the state of each drawn from
SEED and the step), up to two in flight, prints ``WRITER <pid>`` once its writer process runs,
and SIGKILLs itself right after the last ``save()`` returns: what it handed over must commit.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from cairn.manager import CheckpointManager, KeepLatest

SIDE = 1024  # a 4 MiB jax leaf and an 8 MiB NumPy leaf: a commit takes tens of ms


def state(seed: int, step: int) -> dict[str, Any]:
    """What step `step` of run `seed` saves (the test draws it again to compare)."""
    rng = np.random.default_rng([seed, step])
    return {
        "params": {
            "w": rng.standard_normal((SIDE, SIDE), dtype=np.float32),
            "emb": rng.integers(0, 2**31, (SIDE, SIDE), dtype=np.int64),
            "b": rng.standard_normal(7).astype(np.float32),
        },
        "step": np.int64(step),
    }


def as_jax(tree: dict[str, Any]) -> dict[str, Any]:
    params = dict(tree["params"], w=jnp.asarray(tree["params"]["w"]))
    return {**tree, "params": params}


def listed(mgr: CheckpointManager, directory: str, step: int) -> list[str]:
    """The directory's entries; in an object store, the last step's name if it is committed
    (one GET, where a listing of the bucket would take longer than the commit)."""
    if "://" not in directory:
        return sorted(os.listdir(directory))
    name = mgr._names.format(step)
    return [name] if mgr._storage.read_step(mgr._names, step) is not None else []


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("seed", type=int)
    parser.add_argument("steps", type=int)
    parser.add_argument("--keep", type=int, default=3)
    parser.add_argument("--gate", help="a FIFO the last step's write waits on (writer_items)")
    parser.add_argument(
        "--interrupt", action="store_true", help="SIGINT to the process group before the kill"
    )
    args = parser.parse_args(argv)
    handlers = {}
    if args.gate:
        from support.writer_items import Gated

        handlers["gate"] = Gated()
    mgr = CheckpointManager(
        args.directory,
        writer="process",
        max_pending=2,
        keep=KeepLatest(args.keep),
        handlers=handlers,
    )
    for step in range(1, args.steps + 1):
        items = {"state": as_jax(state(args.seed, step)), "meta": {"step": step}}
        if args.gate and step == args.steps:
            items["gate"] = args.gate
        mgr.save(step, items)
        if step == args.steps:  # what is committed now, then the kill, microseconds later
            print(f"LISTED {' '.join(listed(mgr, args.directory, step))}", flush=True)
            if args.interrupt:  # a Ctrl-C at the terminal reaches the trainer's process group
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                os.killpg(os.getpgrp(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGKILL)
        if step == 1:
            assert mgr._commits.remote is not None
            print(f"WRITER {mgr._commits.remote.pid}", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
