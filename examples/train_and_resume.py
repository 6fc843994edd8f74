"""A T5X-like JAX training loop that saves asynchronously, gets SIGKILLed, restarts and resumes.

    python examples/train_and_resume.py [--dir DIR] [--steps N] [--every K] [--kill-at S]

The driver runs the trainer as a child process twice. The first child trains from scratch,
saving every K steps in the background, and kills itself with SIGKILL right after the save at
step S was handed to the commit thread (so that commit may or may not have landed). The second
child restores the latest intact step, checks it equals the state the trainer had at that step
(recomputed from scratch), trains to the end, and checks the final parameters equal those of an
uninterrupted run, bit for bit. Then the kept steps are listed with their metrics.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cairn.manager import AnyOf, CheckpointManager, EveryNSteps, KeepBest, KeepLatest

DIM_IN, DIM_OUT, BATCH, LR, MOMENTUM = 1024, 512, 256, 0.01, 0.9


def dataset(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A synthetic regression task: train and eval splits (host arrays, like a data pipeline)."""
    rng = np.random.default_rng(seed)
    w_true = rng.standard_normal((DIM_IN, DIM_OUT)).astype(np.float32) / np.sqrt(DIM_IN)
    x = rng.standard_normal((4096, DIM_IN)).astype(np.float32)
    y = x @ w_true + 0.01 * rng.standard_normal((4096, DIM_OUT)).astype(np.float32)
    return x[:3584], y[:3584], x[3584:], y[3584:]


def init_state() -> dict[str, Any]:
    """A T5X-like train state: params and optimizer state as jax.Arrays, plus host counters."""
    return {
        "params": {"w": jnp.zeros((DIM_IN, DIM_OUT), jnp.float32)},
        "opt_state": {"momentum": jnp.zeros((DIM_IN, DIM_OUT), jnp.float32)},
        "data_position": 0,  # the input pipeline's position: where the next batch starts
        "step": 0,
    }


@functools.partial(jax.jit, donate_argnums=(0, 1))  # the old buffers are reused, as in T5X
def _update(params: Any, opt: Any, xb: jax.Array, yb: jax.Array) -> tuple[Any, Any]:
    err = xb @ params["w"] - yb
    grad = xb.T @ err / BATCH
    momentum = MOMENTUM * opt["momentum"] + grad
    return {"w": params["w"] - LR * momentum}, {"momentum": momentum}


def train_step(state: dict[str, Any], x: np.ndarray, y: np.ndarray) -> dict[str, Any]:
    """One SGD-with-momentum step on the next batch; donates the previous params and moments."""
    pos = state["data_position"]
    idx = np.arange(pos, pos + BATCH) % len(x)
    params, opt = _update(state["params"], state["opt_state"], x[idx], y[idx])
    return {
        "params": params,
        "opt_state": opt,
        "data_position": int((pos + BATCH) % len(x)),
        "step": state["step"] + 1,
    }


def eval_loss(state: dict[str, Any], x: np.ndarray, y: np.ndarray) -> float:
    return float(jnp.mean((x @ state["params"]["w"] - y) ** 2))


def state_at(step: int, data: tuple[np.ndarray, ...]) -> dict[str, Any]:
    """The trainer's state after `step` steps, recomputed from scratch (training is deterministic)."""
    state = init_state()
    for _ in range(step):
        state = train_step(state, data[0], data[1])
    return state


def abstract_state() -> Any:
    """The restore target: shapes, dtypes and shardings of the arrays, no data."""
    return jax.tree_util.tree_map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            if isinstance(x, jax.Array)
            else x
        ),
        init_state(),
    )


def trees_equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(trees_equal(a[k], b[k]) for k in a)
        )
    if isinstance(a, (np.ndarray, jax.Array)):
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and np.array_equal(a, b)
    return bool(a == b)


def worker(directory: Path, steps: int, every: int, kill_at: int | None) -> None:
    logging.basicConfig(format="    %(message)s", stream=sys.stdout)
    logging.getLogger("cairn").setLevel(logging.INFO)  # cairn logs each commit
    data = dataset()
    keep = AnyOf(KeepLatest(2), KeepBest(2, "eval_loss", mode="min"))
    with CheckpointManager(directory, save=EveryNSteps(every), keep=keep) as mgr:
        if mgr.latest_step() is None:
            state = init_state()
            print("  no checkpoint: starting from scratch", flush=True)
        else:
            t0 = time.perf_counter()
            state = mgr.restore(items={"state": abstract_state()})["state"]
            took = (time.perf_counter() - t0) * 1e3
            ok = trees_equal(state, state_at(state["step"], data))
            print(
                f"  resumed from step {state['step']} in {took:.1f} ms; "
                f"restored state equals the state saved at that step: {ok}",
                flush=True,
            )
            if not ok:
                raise SystemExit("restored state differs from what was saved")
        while state["step"] <= steps:
            step = state["step"]
            if mgr.should_save(step):
                metrics = {"eval_loss": eval_loss(state, data[2], data[3])}
                t0 = time.perf_counter()
                mgr.save(step, {"state": state}, metrics=metrics)
                blocked = (time.perf_counter() - t0) * 1e3
                print(
                    f"  step {step:4d}: save returned after {blocked:6.1f} ms "
                    f"(eval_loss {metrics['eval_loss']:.4f}); training goes on",
                    flush=True,
                )
                if step == kill_at:
                    print(
                        f"  step {step:4d}: SIGKILL (the commit of step {step} is in flight)",
                        flush=True,
                    )
                    os.kill(os.getpid(), signal.SIGKILL)
            if step == steps:
                break
            state = train_step(state, data[0], data[1])
    final = state_at(steps, data)
    same = trees_equal(state, final)
    print(f"  final parameters equal an uninterrupted run of {steps} steps, bit for bit: {same}")
    if not same:
        raise SystemExit("resumed training diverged from the uninterrupted run")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--dir", type=Path, default=Path("demo_run"))
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--kill-at", type=int, default=70)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.dir, args.steps, args.every, args.kill_at)
        return

    shutil.rmtree(args.dir, ignore_errors=True)
    base = [
        sys.executable,
        __file__,
        "--dir",
        str(args.dir),
        "--steps",
        str(args.steps),
        "--every",
        str(args.every),
    ]
    print(f"run 1: train from scratch, save every {args.every} steps, die at step {args.kill_at}")
    first = subprocess.run([*base, "--kill-at", str(args.kill_at), "--worker"], check=False)
    if first.returncode != -signal.SIGKILL:
        raise SystemExit(f"run 1 should have been killed, exit status {first.returncode}")
    print("run 1 was killed with SIGKILL\n")
    print("run 2: restart, resume from the latest intact step, train to the end")
    subprocess.run([*base, "--kill-at", "-1", "--worker"], check=True)

    print("\nkept steps (AnyOf(KeepLatest(2), KeepBest(2, 'eval_loss', 'min'))):")
    with CheckpointManager(args.dir, read_only=True, best=("eval_loss", "min")) as mgr:
        for step in mgr.all_steps():
            info = mgr.info(step)
            t = info.telemetry
            print(
                f"  step {step:4d}  eval_loss {info.metrics['eval_loss']:.4f}  "
                f"{info.bytes / 1e6:5.1f} MB  blocked {t['blocked_s'] * 1e3:6.1f} ms  "
                f"write {t['write_s'] * 1e3:6.1f} ms"
            )
        print(f"  best step: {mgr.best_step()}")


if __name__ == "__main__":
    main()
