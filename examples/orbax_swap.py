"""An Orbax trainer that swaps to cairn by changing one import, mid-run, and ends where an
uninterrupted run ends.

    python examples/orbax_swap.py [--dir DIR] [--steps N] [--every K] [--seed S]

The trainer is written against orbax-checkpoint's API only, as MaxText's checkpointing is: a
``CheckpointManager`` with ``item_names=("items", "iter")``, the train state saved with
``ocp.args.StandardSave`` and restored with ``StandardRestore`` of its abstract state, the grain
iterator's position with ``PyGrainCheckpointSave/Restore``, ``save_interval_steps`` and
``max_to_keep``, asynchronous saves. ``--manager`` picks the class: ``ocp.CheckpointManager`` or
``cairn.manager.orbax.CheckpointManager``; nothing else differs.

The driver runs the trainer as a child process: once with Orbax, uninterrupted (the reference);
then in a fresh directory with Orbax up to a step, with cairn from Orbax's last step (the swap)
until a SIGKILL at a random step, and with cairn again to the end. Each step's loss must equal the
reference's bit for bit (the resumed runs see the same batches in the same order); it prints them,
the steps on disk and which checkpointer wrote each, and exits non-zero if anything differs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

MANAGERS = ("orbax", "cairn")


def trainer(directory: str, manager: str, steps: int, every: int, kill_at: int | None) -> None:
    """Train to `steps`, resuming from the latest step; SIGKILL itself after saving `kill_at`."""
    import grain.python as grain
    import jax
    import jax.numpy as jnp
    import optax
    import orbax.checkpoint as ocp

    if manager == "cairn":
        from cairn.manager.orbax import CheckpointManager  # the one line that changes
    else:
        CheckpointManager = ocp.CheckpointManager  # as MaxText binds it

    def batch(index: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(index)
        x = rng.normal(size=(32, 8)).astype(np.float32)
        return {"x": x, "y": x @ np.arange(8, dtype=np.float32) + 0.1 * rng.normal(size=32)}

    data = iter(grain.MapDataset.range(1_000_000).map(batch).to_iter_dataset())
    optimizer = optax.adam(0.05)
    params = {"w": jnp.zeros(8), "b": jnp.zeros(())}
    state = {"params": params, "opt_state": optimizer.init(params), "step": jnp.asarray(0)}

    @jax.jit
    def train_step(state: Any, batch: Any) -> tuple[Any, Any]:
        def loss_fn(p: Any) -> Any:
            return jnp.mean((batch["x"] @ p["w"] + p["b"] - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, loss

    options = ocp.CheckpointManagerOptions(
        save_interval_steps=every, max_to_keep=3, enable_async_checkpointing=True
    )
    with CheckpointManager(directory, item_names=("items", "iter"), options=options) as mngr:
        latest = mngr.latest_step()
        if latest is not None:
            abstract = jax.tree_util.tree_map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state
            )
            restored = mngr.restore(
                latest,
                args=ocp.args.Composite(
                    items=ocp.args.StandardRestore(abstract),
                    iter=grain.PyGrainCheckpointRestore(data),
                ),
            )
            state = restored["items"]  # "items" is also a method of Composite
            print(f"resumed {manager} from step {latest}", flush=True)
        for step in range(int(state["step"]), steps):
            state, loss = train_step(state, next(data))
            print(f"loss {step} {float(loss).hex()}", flush=True)
            mngr.save(
                step + 1,
                args=ocp.args.Composite(
                    items=ocp.args.StandardSave(state), iter=grain.PyGrainCheckpointSave(data)
                ),
            )
            if step + 1 == kill_at:  # a save of this step is in flight: killed mid-commit
                os.kill(os.getpid(), signal.SIGKILL)
        mngr.wait_until_finished()


def run(
    directory: Path, manager: str, steps: int, every: int, kill_at: int | None = None
) -> dict[int, str]:
    cmd = [sys.executable, __file__, "--trainer", str(directory), "--manager", manager]
    cmd += ["--steps", str(steps), "--every", str(every)]
    if kill_at is not None:
        cmd += ["--kill-at", str(kill_at)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    killed = done.returncode == -signal.SIGKILL
    if done.returncode != 0 and not (killed and kill_at is not None):
        sys.exit(f"the {manager} trainer failed ({done.returncode}):\n{done.stderr[-3000:]}")
    for line in done.stdout.splitlines():
        if line.startswith("resumed"):
            print(f"  {line}")
    if kill_at is not None:
        print(f"  the {manager} trainer was {'killed with SIGKILL' if killed else 'not killed'}")
    return {
        int(s): v
        for _, s, v in (ln.split() for ln in done.stdout.splitlines() if ln.startswith("loss"))
    }


def written_by(directory: Path) -> dict[int, str]:
    """Each step directory on disk and the checkpointer that wrote it (its marker files)."""
    steps = sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())
    return {
        s: "cairn" if (directory / str(s) / "_CHECKPOINT.json").exists() else "orbax" for s in steps
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="orbax_swap_run")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trainer", help=argparse.SUPPRESS)
    parser.add_argument("--manager", choices=MANAGERS, help=argparse.SUPPRESS)
    parser.add_argument("--kill-at", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trainer:
        trainer(args.trainer, args.manager, args.steps, args.every, args.kill_at)
        return
    root = Path(args.dir).absolute()
    if root.exists():
        sys.exit(f"{root} exists: give a new --dir")
    steps, every = args.steps, args.every
    rng = random.Random(args.seed)
    swap_at = every * rng.randint(1, steps // every // 3)
    kill_at = every * rng.randint(swap_at // every + 1, steps // every - 1)
    print(f"reference: orbax, {steps} steps uninterrupted")
    reference = run(root / "reference", "orbax", steps, every)
    print(f"swapped: orbax to step {swap_at}, then cairn (SIGKILL at step {kill_at}), then cairn")
    swapped: dict[int, str] = {}
    for manager, upto, kill in (
        ("orbax", swap_at, None),
        ("cairn", steps, kill_at),
        ("cairn", steps, None),
    ):
        swapped.update(run(root / "swapped", manager, upto, every, kill))
    differ = [s for s in range(steps) if swapped.get(s) != reference.get(s)]
    on_disk = written_by(root / "swapped")
    print(json.dumps({"steps on disk": on_disk}))
    if differ:
        sys.exit(f"FAILED: losses differ from the uninterrupted run's at steps {differ}")
    # max_to_keep=3: the 3 newest are cairn's; the Orbax steps before the swap stay (cairn never
    # deletes another checkpointer's steps).
    newest = [steps - every * i for i in (2, 1, 0)]
    cairn_steps = [s for s, by in on_disk.items() if by == "cairn"]
    if cairn_steps != newest or any(s > swap_at for s, by in on_disk.items() if by == "orbax"):
        sys.exit(f"FAILED: expected cairn's steps {newest} and Orbax's before {swap_at}: {on_disk}")
    print(
        f"OK: every loss of the swapped, killed and resumed run equals the reference's ({steps} steps)"
    )


if __name__ == "__main__":
    main()
