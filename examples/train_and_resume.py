"""A T5X-like trainer that is killed, preempted and resumed, and ends where an uninterrupted run ends.

    python examples/train_and_resume.py [--dir DIR] [--steps N] [--every K]
                                        [--pipeline tfdata|grain] [--seed S]

The trainer: an MLP classifier in JAX with optax's Adam, fed by a tf.data pipeline (map, shuffle,
batch, prefetch; or a grain pipeline with `--pipeline grain`), train state = step + params +
optimizer state, losses written to TensorBoard. It saves the train state and the dataset iterator
every K steps in the background with an eval loss as metric, keeps the 2 newest and the 2 best
steps (the dataset position only in the 2 newest), restores on start, and saves and exits
cleanly when it receives SIGTERM.

The driver runs the trainer as a child process: once uninterrupted (the reference), then from
scratch again, killed with SIGKILL at a random step, resumed and sent SIGTERM at a later random
step, and resumed to the end. It prints each step's loss next to the reference's (they must be
equal bit for bit: the resumed runs see the same batches in the same order), the blocked and
commit milliseconds of each save, and the kept steps with their metrics. It exits non-zero if
anything differs.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import zlib
from pathlib import Path
from typing import Any

import numpy as np

# TensorFlow's C++ log (a CPU build that looks for CUDA prints "failed call to cuInit" and the
# instructions it was not built with, at every start of the trainer): not the demo's business.
# The trainer children inherit it; set the variable to see TensorFlow's messages again.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

D_IN, HIDDEN, CLASSES, BATCH, EXAMPLES = 128, 512, 16, 64, 20_000


def teacher() -> np.ndarray:
    """The labelling rule of the synthetic task: label = argmax(x @ W)."""
    return np.random.default_rng(1234).standard_normal((D_IN, CLASSES)).astype(np.float32)


def tf_pipeline(seed: int) -> Any:
    """The T5X way: a tf.data pipeline; its iterator's position (shuffle buffer included) is saved."""
    import tensorflow as tf

    w = tf.constant(teacher())

    def example(i: Any) -> dict[str, Any]:
        x = tf.random.stateless_normal([D_IN], seed=tf.stack([i, tf.constant(seed, tf.int64)]))
        return {
            "x": x,
            "y": tf.argmax(tf.linalg.matvec(w, x, transpose_a=True), output_type=tf.int32),
        }

    ds = tf.data.Dataset.range(EXAMPLES).repeat().map(example, num_parallel_calls=2)
    ds = ds.shuffle(1024, seed=seed).batch(BATCH, drop_remainder=True).prefetch(2)
    return ds


def grain_pipeline(seed: int) -> Any:
    """The same task through grain: a shuffled, repeated MapDataset, read with 2 threads."""
    import grain

    w = teacher()

    def example(i: int) -> dict[str, Any]:
        x = np.random.default_rng([seed, i]).standard_normal(D_IN, dtype=np.float32)
        return {"x": x, "y": np.int32(np.argmax(x @ w))}

    ds = grain.MapDataset.range(EXAMPLES).shuffle(seed=seed).repeat(None).map(example)
    read = grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)
    return ds.to_iter_dataset(read).batch(BATCH, drop_remainder=True)


# ---------------------------------------------------------------------------- the trainer


def worker(directory: Path, steps: int, every: int, pipeline: str, seed: int) -> None:
    import jax
    import jax.numpy as jnp
    import optax
    import tensorflow as tf

    from cairn.manager import (
        AnyOf,
        CheckpointManager,
        EveryNSteps,
        KeepBest,
        KeepLatest,
        OnPreemption,
    )

    lock = threading.Lock()

    def emit(*fields: Any) -> None:  # one machine-readable line per event, for the driver
        with lock:
            sys.stdout.write(" ".join(str(f) for f in fields) + "\n")
            sys.stdout.flush()

    class CommitTelemetry(logging.Handler):
        """cairn logs each commit (on its commit thread) with blocked and commit milliseconds."""

        def emit(self, record: logging.LogRecord) -> None:
            if record.msg.startswith("cairn: committed step"):
                step, blocked_ms, commit_ms, nbytes = record.args  # type: ignore[misc]
                emit("commit", step, f"{blocked_ms:.1f}", f"{commit_ms:.1f}", int(nbytes))

    log = logging.getLogger("cairn")
    log.setLevel(logging.INFO)
    log.addHandler(CommitTelemetry())

    tx = optax.adam(1e-3)

    def init_state() -> dict[str, Any]:
        keys = jax.random.split(jax.random.key(seed), 3)
        dims = [(D_IN, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, CLASSES)]
        params = {
            f"dense_{i}": {
                "kernel": jax.random.normal(k, shape, jnp.float32) / np.sqrt(shape[0]),
                "bias": jnp.zeros(shape[1], jnp.float32),
            }
            for i, (k, shape) in enumerate(zip(keys, dims, strict=True))
        }
        return {"step": jnp.array(0, jnp.int32), "params": params, "opt_state": tx.init(params)}

    def loss_fn(params: Any, x: Any, y: Any) -> Any:
        h = x
        for i in range(2):
            h = jax.nn.relu(h @ params[f"dense_{i}"]["kernel"] + params[f"dense_{i}"]["bias"])
        logits = h @ params["dense_2"]["kernel"] + params["dense_2"]["bias"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def train_step(state: Any, x: Any, y: Any) -> tuple[Any, Any]:
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, y)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, loss

    rng = np.random.default_rng(99)
    eval_x = rng.standard_normal((512, D_IN), dtype=np.float32)
    eval_y = np.argmax(eval_x @ teacher(), axis=1).astype(np.int32)
    eval_loss = jax.jit(loss_fn)

    dataset = tf_pipeline(seed) if pipeline == "tfdata" else grain_pipeline(seed)
    data = iter(dataset)
    state = init_state()
    tb = tf.summary.create_file_writer(str(directory / "tensorboard" / "train"))
    with CheckpointManager(
        directory / "checkpoints",
        save=AnyOf(EveryNSteps(every), OnPreemption()),
        keep=AnyOf(KeepLatest(2), KeepBest(2, "eval_loss", mode="min")),
        keep_items={"dataset": KeepLatest(2)},  # T5X's keep_dataset_checkpoints
    ) as mgr:
        if mgr.latest_step() is not None:
            restored = mgr.restore(items={"state": state, "dataset": data})
            state = restored["state"]  # `data` was moved to the saved position in place
            emit("resumed", int(state["step"]))
        while int(state["step"]) < steps:
            batch = next(data)
            state, loss = train_step(state, jnp.asarray(batch["x"]), jnp.asarray(batch["y"]))
            step = int(state["step"])
            emit("step", step, float(loss).hex())
            with tb.as_default(step=step):
                tf.summary.scalar("loss", float(loss))
            if mgr.should_save(step):
                metrics = {"eval_loss": float(eval_loss(state["params"], eval_x, eval_y))}
                mgr.save(step, {"state": state, "dataset": data}, metrics=metrics)
                with tb.as_default(step=step):
                    tf.summary.scalar("eval_loss", metrics["eval_loss"])
            if mgr.reached_preemption(step):  # SIGTERM: that save has committed; leave
                emit("preempted", step)
                break
        tb.flush()
    leaves = jax.tree_util.tree_leaves(state["params"])
    emit("params", zlib.crc32(b"".join(np.asarray(x).tobytes() for x in leaves)))


# ---------------------------------------------------------------------------- the driver


class Run:
    """One child process of the trainer and what it reported."""

    def __init__(self, name: str, args: argparse.Namespace, directory: Path) -> None:
        self.name, self.directory = name, directory
        self.cmd = [
            sys.executable,
            __file__,
            "--worker",
            "--dir",
            str(directory),
            "--steps",
            str(args.steps),
            "--every",
            str(args.every),
            "--pipeline",
            args.pipeline,
            "--seed",
            str(args.seed),
        ]
        self.losses: dict[int, str] = {}
        self.commits: list[tuple[int, float, float, int]] = []
        self.resumed: int | None = None
        self.preempted: int | None = None
        self.params: str | None = None
        self.returncode: int | None = None

    def go(self, stop: tuple[signal.Signals, int] | None = None) -> Run:
        """Run to the end, or send `stop[0]` once the trainer reports step `stop[1]`."""
        with subprocess.Popen(self.cmd, stdout=subprocess.PIPE, text=True) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                kind, *fields = line.split()
                if kind == "step":
                    self.losses[int(fields[0])] = fields[1]
                    if stop is not None and int(fields[0]) == stop[1]:
                        proc.send_signal(stop[0])
                        stop = None
                elif kind == "commit":
                    self.commits.append(
                        (int(fields[0]), float(fields[1]), float(fields[2]), int(fields[3]))
                    )
                elif kind == "resumed":
                    self.resumed = int(fields[0])
                elif kind == "preempted":
                    self.preempted = int(fields[0])
                elif kind == "params":
                    self.params = fields[0]
            self.returncode = proc.wait()
        return self

    @property
    def steps(self) -> list[int]:
        return sorted(self.losses)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--dir", type=Path, default=Path("demo_run"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--pipeline", choices=["tfdata", "grain"], default="tfdata")
    parser.add_argument("--seed", type=int, default=None, help="chooses the kill steps")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.dir, args.steps, args.every, args.pipeline, args.seed)
        return
    if args.steps < 3 * args.every:
        parser.error("--steps must be at least 3 * --every (room for a kill and a preemption)")
    args.seed = random.randrange(1000) if args.seed is None else args.seed
    pick = random.Random(args.seed)
    kill_at = pick.randint(args.every + 1, args.steps // 2)
    term_at = pick.randint(kill_at + 1, args.steps - 2)

    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, width=max(Console().width, 100))
    shutil.rmtree(args.dir, ignore_errors=True)
    console.print(
        f"[bold]{args.pipeline} pipeline, {args.steps} steps, save every {args.every}, seed "
        f"{args.seed}: SIGKILL at step {kill_at}, SIGTERM at step {term_at}[/bold]"
    )
    console.print("reference: an uninterrupted run ...")
    ref = Run("reference", args, args.dir / "reference").go()
    if ref.returncode != 0 or ref.steps != list(range(1, args.steps + 1)):
        raise SystemExit(f"the reference run failed (exit status {ref.returncode})")
    interrupted = args.dir / "interrupted"
    console.print(f"run 1: from scratch, SIGKILL at step {kill_at} ...")
    one = Run("run 1", args, interrupted).go((signal.SIGKILL, kill_at))
    console.print(f"run 2: resume, SIGTERM at step {term_at} ...")
    two = Run("run 2", args, interrupted).go((signal.SIGTERM, term_at))
    console.print("run 3: resume, train to the end ...")
    three = Run("run 3", args, interrupted).go()

    problems = []
    if one.returncode != -signal.SIGKILL:
        problems.append(f"run 1 should have been killed by SIGKILL, exit status {one.returncode}")
    if two.returncode != 0 or two.preempted is None:
        problems.append(f"run 2 should have saved and exited on SIGTERM ({two.returncode})")
    if three.resumed != two.preempted:
        problems.append(f"run 3 resumed at {three.resumed}, not at run 2's save {two.preempted}")
    if three.returncode != 0 or three.params != ref.params:
        problems.append("run 3's final parameters differ from the reference's")

    table = Table(title="runs (a resumed run re-trains the steps after its checkpoint)")
    for col in ("run", "resumed at", "steps trained", "ended by", "losses = reference"):
        table.add_column(col, justify="right")
    for run, ended in ((one, "SIGKILL"), (two, "SIGTERM: saved, exit 0"), (three, "the end")):
        same = sum(run.losses[s] == ref.losses.get(s) for s in run.steps)
        if same != len(run.steps):
            problems.append(f"{run.name}: {len(run.steps) - same} losses differ from the reference")
        table.add_row(
            run.name,
            "scratch" if run.resumed is None else str(run.resumed),
            f"{run.steps[0]}-{run.steps[-1]}" if run.steps else "-",
            ended,
            f"{same}/{len(run.steps)} bit for bit",
        )
    console.print(table)

    curve = Table(title="loss curve: the resumed runs against the uninterrupted one")
    for col in ("step", "reference loss", "run", "its loss", "equal"):
        curve.add_column(col, justify="right")
    runs = (one, two, three)
    shown = sorted(
        {s for s in ref.steps if s % args.every == 0 or s == args.steps}
        | {r.steps[0] for r in runs if r.steps}
        | {r.steps[-1] for r in runs if r.steps}
    )
    for step in shown:
        for run in runs:
            if step in run.losses:
                a, b = float.fromhex(ref.losses[step]), float.fromhex(run.losses[step])
                curve.add_row(str(step), f"{a:.9f}", run.name, f"{b:.9f}", str(a == b).lower())
    console.print(curve)

    saves = Table(title="saves: training blocked vs background commit (ms)")
    for col in ("run", "saves", "blocked med", "blocked max", "commit med", "MB/step"):
        saves.add_column(col, justify="right")
    for run in (ref, *runs):
        if run.commits:
            blocked = [c[1] for c in run.commits]
            commit = [c[2] for c in run.commits]
            saves.add_row(
                run.name,
                str(len(run.commits)),
                f"{statistics.median(blocked):.1f}",
                f"{max(blocked):.1f}",
                f"{statistics.median(commit):.1f}",
                f"{run.commits[-1][3] / 1e6:.2f}",
            )
    console.print(saves)

    from cairn.manager import CheckpointManager

    kept = Table(
        title="kept steps: keep=AnyOf(KeepLatest(2), KeepBest(2, 'eval_loss')), "
        "keep_items={'dataset': KeepLatest(2)}"
    )
    for col in ("step", "eval_loss", "dataset position", "MB"):
        kept.add_column(col, justify="right")
    with CheckpointManager(
        interrupted / "checkpoints", read_only=True, best=("eval_loss", "min")
    ) as mgr:
        for step in mgr.all_steps():
            info = mgr.info(step)
            has = "kept" if not info.items["dataset"].dropped else "dropped"
            kept.add_row(
                str(step), f"{info.metrics['eval_loss']:.6f}", has, f"{info.bytes / 1e6:.2f}"
            )
        best = mgr.best_step()
    console.print(kept)
    console.print(f"best step by eval_loss: {best}")
    console.print(f"TensorBoard logs: {interrupted / 'tensorboard'}")
    if problems:
        for p in problems:
            console.print(f"[red]FAILED: {p}[/red]")
        raise SystemExit(1)
    console.print(
        "[green]OK: every loss after each resume equals the uninterrupted run's, bit for bit, "
        "and so do the final parameters[/green]"
    )


if __name__ == "__main__":
    main()
