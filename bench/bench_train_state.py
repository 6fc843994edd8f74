"""Train-state benchmark: cairn (TrainStateHandler) against Orbax on a T5X-like jax state.

For each size, in a process of its own, on a T5X-like train state of 172 jax CPU arrays
(decoder-only T5 1.1: embedding, 6 layers of attention and gated-MLP kernels and layer norms,
untied logits; params + Adam mu + nu in float32; an int32 step):

* machine limits for the same bytes: memcpy into a pre-faulted buffer, a copy into fresh arrays,
  one buffered write + fsync of every leaf into one file, reading that file back (page cache warm);
* cairn (``CheckpointManager(dir, keep=KeepLatest(1))``, items ``{"state": tree}``, async) and
  orbax-checkpoint (``ocp.CheckpointManager``, async, ``Composite(state=StandardSave(tree))``,
  ``max_to_keep=1``), each: time ``save()`` blocks the caller; save start to committed
  (``wait_until_finished``; for cairn also until its reclaim thread has removed the retired step,
  which Orbax does before ``wait_until_finished`` returns); process CPU time of the save; restore
  to ``ShapeDtypeStruct`` targets (with shardings) until ``block_until_ready``; the peak RSS
  beyond the live state while saving and while restoring (beyond the restored state itself),
  sampled every 10 ms from /proc/self/statm, after ``gc.collect()`` and glibc's
  ``malloc_trim(0)`` between phases;
* interference: a jitted stand-in train step (loss and grads of a short causal decoder pass
  through the params, Adam update of params, mu and nu; the state donated, as T5X does) runs back
  to back. A baseline window with no save, then a window from a ``save()`` of the current state
  until the first step that ends after the save has committed and freed the old step. Lost time
  = window - steps in it x the baseline's median step time. Each step records whether JAX
  donated its inputs (``is_deleted()``); a probe without any save holds NumPy views of the state
  for one step, which isolates the cost of the donation JAX declines while a save views the
  buffers.

Rounds: one untimed warm-up (which also checks each restored tree equals the saved one), then
``--repeats`` rounds of [limits, cairn, orbax], order rotated each round; target ratios are paired
per round (same-run ratios). Results: bench/results/train_state.json, rich tables with the issue's
targets, and docs/benchmarks_train_state.png. docs/benchmarks.md explains the numbers.

    .venv/bin/python bench/bench_train_state.py                  # 256M and 1G, ~5 min here
    .venv/bin/python bench/bench_train_state.py --quick          # smoke run: 16M, ~25 s
    .venv/bin/python bench/bench_train_state.py --with-4g        # adds 4G (~10 GiB more RSS)
    .venv/bin/python bench/bench_train_state.py --plot           # redraw the PNG from the JSON
    .venv/bin/python bench/bench_train_state.py --markdown       # the JSON as Markdown tables
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

# _common sets the environment jax/orbax read at import (CPU only, quiet): import it before them.
from _common import (
    REPO,
    RESULTS,
    SCRATCH,
    GiB,
    Limits,
    MiB,
    RssSampler,
    check_equal,
    fmt_range,
    fmt_s,
    load_average,
    machine_facts,
    malloc_trim,
    now,
    quiet_logs,
    run_in_child,
    scratch_filesystem,
    spread,
    summarize,
)

TIMES, EN_DASH = "\u00d7", "\u2013"  # for the Markdown tables
DEFAULT_JSON = RESULTS / "train_state.json"
QUICK_JSON = RESULTS / "train_state_quick.json"
DEFAULT_PNG = REPO / "docs" / "benchmarks_train_state.png"

# T5X-like shapes, as in shared/research/perf-baseline.md: (d_model, d_ff, vocab), 6 layers.
CONFIGS = {
    "16M": (128, 352, 768),  # smoke runs only
    "256M": (256, 704, 34176),
    "1G": (768, 2048, 30592),
    "4G": (1536, 4096, 61184),
}
N_LAYERS = 6
SYSTEMS = ("cairn", "orbax")

LABELS = {
    "limit.memcpy": "memcpy into a pre-faulted buffer (np.copyto)",
    "limit.fresh_copy": "copy into fresh arrays (np.array(x, copy=True))",
    "limit.write_fsync": "plain write + fsync, one file",
    "limit.read": "plain read back, one file (page cache warm)",
    "cairn.blocked": "cairn: save() blocks caller",
    "cairn.committed": "cairn: save start -> committed",
    "cairn.tm_write": "  of which: chunk files written (telemetry write_s)",
    "cairn.tm_sync": "  of which: tree.json, manifest, syncfs, rename",
    "cairn.tm_after": "  of which: retention (previous step renamed to trash) + hand-off",
    "cairn.freed": "cairn: save start -> previous step's files removed (reclaim thread)",
    "cairn.restore": "cairn: restore to ShapeDtypeStruct targets",
    "cairn.cpu_save": "cairn: CPU time of the save (process user+sys, start -> freed)",
    "cairn.cpu_save_sys": "  of which: system (kernel) time",
    "cairn.cpu_restore": "cairn: CPU time of the restore (process user+sys)",
    "orbax.blocked": "orbax: save() blocks caller",
    "orbax.committed": "orbax: save start -> committed",
    "orbax.restore": "orbax: restore to ShapeDtypeStruct targets",
    "orbax.cpu_save": "orbax: CPU time of the save (process user+sys, start -> committed)",
    "orbax.cpu_save_sys": "  of which: system (kernel) time",
    "orbax.cpu_restore": "orbax: CPU time of the restore (process user+sys)",
}
TELEMETRY = ("cairn.tm_write", "cairn.tm_sync", "cairn.tm_after")
NO_THROUGHPUT = (
    *TELEMETRY,
    "cairn.cpu_save",
    "cairn.cpu_save_sys",
    "cairn.cpu_restore",
    "orbax.cpu_save",
    "orbax.cpu_save_sys",
    "orbax.cpu_restore",
)
MEMORY = {
    "mem_save": "peak RSS beyond the live state, save start -> committed (cairn: -> freed)",
    "mem_after_save": "RSS kept after the commit (before malloc_trim)",
    "mem_restore": "peak RSS beyond the live state and the restored state, during restore",
}

# The targets. (key, what, comparison, target); ratios are per round, paired.
TARGETS = [
    ("commit_vs_orbax", "commit throughput, cairn ÷ Orbax", ">=", 3.0),
    ("commit_vs_write", "commit throughput, cairn ÷ plain write+fsync", ">=", 0.6),
    ("restore_vs_orbax", "restore throughput, cairn ÷ Orbax", ">=", 3.0),
    ("blocked_vs_orbax", "save() blocked time, cairn ÷ Orbax", "report", None),
    ("mem_save", "memory beyond the live state during save, x state", "<=", 0.25),
    ("mem_restore", "memory beyond the live state during restore, x state", "<=", 0.25),
    ("lost_vs_orbax", "training time lost per background save, cairn ÷ Orbax", "<=", 0.25),
]


# ----------------------------------------------------------------------------- the state


def param_shapes(d: int, ff: int, vocab: int) -> dict[str, Any]:
    """T5X decoder-only (T5 1.1) parameter shapes: 57 leaves."""
    layers: dict[str, Any] = {}
    for i in range(N_LAYERS):
        layers[f"layers_{i}"] = {
            "pre_self_attention_layer_norm": {"scale": (d,)},
            "self_attention": {n: {"kernel": (d, d)} for n in ("query", "key", "value", "out")},
            "pre_mlp_layer_norm": {"scale": (d,)},
            "mlp": {
                "wi_0": {"kernel": (d, ff)},
                "wi_1": {"kernel": (d, ff)},
                "wo": {"kernel": (ff, d)},
            },
        }
    return {
        "token_embedder": {"embedding": (vocab, d)},
        "decoder": {
            **layers,
            "decoder_norm": {"scale": (d,)},
            "logits_dense": {"kernel": (d, vocab)},
        },
    }


def build_state(label: str, seed: int = 42) -> Any:
    """{'step', 'params', 'opt_state': {'mu', 'nu'}} as jax CPU arrays, random normal, scaled.

    Each leaf is made in NumPy and copied by ``jax.device_put`` at once, so building never holds
    more than one leaf twice. params ~ 0.02 N(0,1), mu ~ 1e-3 N(0,1), nu ~ 1e-6 |N(0,1)|: about as
    incompressible as real weights.
    """
    import jax

    d, ff, vocab = CONFIGS[label]
    rng = np.random.default_rng(seed)

    def tree(shapes: Any, kind: str) -> Any:
        if isinstance(shapes, dict):
            return {k: tree(v, kind) for k, v in shapes.items()}
        a = rng.standard_normal(shapes, dtype=np.float32)
        if kind == "nu":
            np.abs(a, out=a)
        a *= {"params": 0.02, "mu": 1e-3, "nu": 1e-6}[kind]
        return jax.device_put(a)

    shapes = param_shapes(d, ff, vocab)
    state = {
        "step": jax.device_put(np.int32(0)),
        "params": tree(shapes, "params"),
        "opt_state": {"mu": tree(shapes, "mu"), "nu": tree(shapes, "nu")},
    }
    return jax.block_until_ready(state)


def describe_state(label: str, leaves: list[Any]) -> dict[str, Any]:
    d, ff, vocab = CONFIGS[label]
    largest = max(leaves, key=lambda a: a.nbytes)
    return {
        "bytes": int(sum(a.nbytes for a in leaves)),
        "leaves": len(leaves),
        "d_model": d,
        "d_ff": ff,
        "vocab": vocab,
        "layers": N_LAYERS,
        "largest_leaf_shape": list(largest.shape),
        "dtype": "float32 (+ int32 step)",
    }


def make_train_step(label: str) -> Callable[[Any, Any], Any]:
    """A jitted T5X-like step: loss and grads of a small causal decoder pass, then Adam.

    The state is donated (``donate_argnums=0``), as T5X's train step does: normally XLA writes
    the new params, mu and nu into the old buffers and deletes the old arrays.
    """
    import jax
    import jax.numpy as jnp

    d = CONFIGS[label][0]

    def rms(x: Any, scale: Any) -> Any:
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale

    def loss_fn(params: Any, seq: Any) -> Any:
        dec = params["decoder"]
        x = params["token_embedder"]["embedding"][seq[:-1]]
        t = x.shape[0]
        mask = jnp.tril(jnp.ones((t, t), dtype=bool))
        for i in range(N_LAYERS):
            layer = dec[f"layers_{i}"]
            att = layer["self_attention"]
            h = rms(x, layer["pre_self_attention_layer_norm"]["scale"])
            q, k, v = (h @ att[n]["kernel"] for n in ("query", "key", "value"))
            scores = jnp.where(mask, q @ k.T / np.sqrt(d), -1e9)
            x = x + (jax.nn.softmax(scores) @ v) @ att["out"]["kernel"]
            h = rms(x, layer["pre_mlp_layer_norm"]["scale"])
            mlp = layer["mlp"]
            gate = jax.nn.gelu(h @ mlp["wi_0"]["kernel"]) * (h @ mlp["wi_1"]["kernel"])
            x = x + gate @ mlp["wo"]["kernel"]
        logits = rms(x, dec["decoder_norm"]["scale"]) @ dec["logits_dense"]["kernel"]
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, seq[1:, None], axis=-1))

    def step(state: Any, seq: Any) -> Any:
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], seq)
        b1, b2, lr, eps = 0.9, 0.999, 1e-4, 1e-8
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state["opt_state"]["mu"], grads)
        nu = jax.tree.map(lambda n, g: b2 * n + (1 - b2) * g * g, state["opt_state"]["nu"], grads)
        params = jax.tree.map(
            lambda p, m, n: p - lr * m / (jnp.sqrt(n) + eps), state["params"], mu, nu
        )
        new = {"step": state["step"] + 1, "params": params, "opt_state": {"mu": mu, "nu": nu}}
        return new, loss

    return jax.jit(step, donate_argnums=0)


# ----------------------------------------------------------------------------- the two systems


class CairnRunner:
    name = "cairn"

    def __init__(self, directory: Path, abstract: Any) -> None:
        from cairn.manager import CheckpointManager, KeepLatest

        self.abstract = abstract
        self.mgr = CheckpointManager(directory, keep=KeepLatest(1))

    def save(self, step: int, tree: Any) -> None:
        self.mgr.save(step, {"state": tree}, force=True)

    def wait(self) -> None:
        self.mgr.wait_until_finished()

    def restore(self, step: int) -> Any:
        return self.mgr.restore(step, {"state": self.abstract})["state"]

    def wait_reclaimed(self, timeout: float = 120.0) -> None:
        """Until the reclaim thread has removed the retired step (no ``.trash-*`` left)."""
        deadline = now() + timeout
        while any(e.name.startswith(".trash") for e in os.scandir(self.mgr.directory)):
            if now() > deadline:
                raise TimeoutError(f"{self.mgr.directory}: trash still there after {timeout} s")
            time.sleep(0.002)

    def telemetry(self, step: int) -> dict[str, float]:
        tm = self.mgr.info(step).telemetry
        return {"tm_write": float(tm["write_s"]), "tm_commit": float(tm["commit_s"])}

    def close(self) -> None:
        self.mgr.close()


class OrbaxRunner:
    """Orbax's calls (StandardSave in a Composite, max_to_keep=1, async), on orbax-checkpoint's
    CheckpointManager or, with ``swap=True``, on cairn.manager.orbax's (the one-line swap)."""

    name = "orbax"

    def __init__(self, directory: Path, abstract: Any, *, swap: bool = False) -> None:
        import orbax.checkpoint as ocp

        self.ocp = ocp
        self.abstract = abstract
        self.swap = swap
        options = ocp.CheckpointManagerOptions(max_to_keep=1, enable_async_checkpointing=True)
        if swap:
            from cairn.manager.orbax import CheckpointManager

            self.name = "cairn-orbax"
            self.mgr = CheckpointManager(directory, options=options)
        else:
            self.mgr = ocp.CheckpointManager(directory, options=options)

    def save(self, step: int, tree: Any) -> None:
        args = self.ocp.args
        self.mgr.save(step, args=args.Composite(state=args.StandardSave(tree)))

    def wait(self) -> None:
        self.mgr.wait_until_finished()

    def restore(self, step: int) -> Any:
        args = self.ocp.args
        restored = self.mgr.restore(
            step, args=args.Composite(state=args.StandardRestore(self.abstract))
        )
        return restored["state"]

    def wait_reclaimed(self) -> None:
        """Orbax deletes the old step before wait_until_finished returns; cairn's reclaim
        thread frees a retired step's space after it."""
        if self.swap:
            CairnRunner.wait_reclaimed(self)  # type: ignore[arg-type]

    def telemetry(self, step: int) -> dict[str, float]:
        return {}

    def close(self) -> None:
        self.mgr.close()


def clean_memory() -> None:
    gc.collect()
    malloc_trim()


def timed_save(runner: Any, step: int, tree: Any) -> dict[str, float]:
    """One save, from its start: ``save()`` blocked; commit, until committed (the staging copy
    included); after_save, from ``save()``'s return to committed (the write phase and the
    commit alone); freed, until the retired step is gone too."""
    t0 = now()
    runner.save(step, tree)
    t1 = now()
    runner.wait()
    t2 = now()
    runner.wait_reclaimed()
    t3 = now()
    return {"blocked": t1 - t0, "commit": t2 - t0, "after_save": t2 - t1, "freed": t3 - t0}


def save_and_restore(
    runner: Any, tree: Any, step: int, sampler: RssSampler, nbytes: int, check: bool
) -> dict[str, float]:
    """One save (blocked, committed, memory) and one restore (time, memory) of `runner`."""
    import jax

    clean_memory()
    base = sampler.start_window()
    cpu0 = os.times()
    times = timed_save(runner, step, tree)
    cpu1 = os.times()
    peak = sampler.peak()
    after = sampler.rss()
    out = {
        "blocked": times["blocked"],
        "committed": times["commit"],
        "freed": times["freed"],
        "cpu_save": (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system),
        "cpu_save_sys": cpu1.system - cpu0.system,
        "mem_save": (peak - base) / nbytes,
        "mem_after_save": (after - base) / nbytes,
        **runner.telemetry(step),
    }
    if "tm_commit" in out:
        out["tm_sync"] = out["tm_commit"] - out["tm_write"]
        out["tm_after"] = out["committed"] - out["blocked"] - out["tm_commit"]
    else:
        del out["freed"]  # the same as committed
    clean_memory()
    base = sampler.start_window()
    cpu0 = os.times()
    t0 = now()
    restored = jax.block_until_ready(runner.restore(step))
    out["restore"] = now() - t0
    cpu1 = os.times()
    out["cpu_restore"] = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    out["mem_restore"] = (sampler.peak() - base - nbytes) / nbytes
    if check:
        check_equal(tree, restored, runner.name)
    del restored
    clean_memory()
    return out


# ----------------------------------------------------------------------------- interference


class Trainer:
    """Runs the donating train step back to back; records step times and donation."""

    def __init__(self, label: str, state: list[Any], tokens: int) -> None:
        import jax
        import jax.numpy as jnp

        self.jax = jax
        vocab = CONFIGS[label][2]
        seq = np.random.default_rng(0).integers(0, vocab, tokens + 1, dtype=np.int32)
        self.seq = jnp.asarray(seq)
        self.step_fn = make_train_step(label)
        self.state = state.pop()  # the caller keeps no reference: donation can free it

    def step(self) -> tuple[float, int]:
        """One step; (seconds, how many input leaves were donated, i.e. deleted)."""
        old = self.state
        t0 = now()
        new, loss = self.step_fn(old, self.seq)
        self.jax.block_until_ready((new, loss))
        dt = now() - t0
        donated = sum(x.is_deleted() for x in self.jax.tree.leaves(old))
        self.state = new
        return dt, donated

    def run_for(self, seconds: float, min_steps: int = 3) -> tuple[list[float], list[int]]:
        times, donated = [], []
        t0 = now()
        while now() - t0 < seconds or len(times) < min_steps:
            dt, d = self.step()
            times.append(dt)
            donated.append(d)
        return times, donated


def save_window(trainer: Trainer, runner: Any, step: int) -> dict[str, Any]:
    """save() the current state; train until the first step that ends after the save has
    committed and freed the previous step."""
    done = threading.Event()
    box: dict[str, Any] = {}

    def watch() -> None:
        try:
            runner.wait()
            box["committed_at"] = now()
            runner.wait_reclaimed()  # freeing the old step is part of the save's cost
        except BaseException as e:  # reported by the caller
            box["error"] = e
        box["freed_at"] = now()
        done.set()

    t0 = now()
    runner.save(step, trainer.state)
    blocked = now() - t0
    watcher = threading.Thread(target=watch, name="bench-watch", daemon=True)
    watcher.start()
    times, donated = [], []
    while True:
        dt, d = trainer.step()
        times.append(dt)
        donated.append(d)
        if done.is_set():
            break
    end = now()
    watcher.join()
    if "error" in box:
        raise RuntimeError(f"{runner.name}: the save under training failed") from box["error"]
    return {
        "t0": t0,
        "window_s": end - t0,
        "blocked_s": blocked,
        "commit_s": box.get("committed_at", box["freed_at"]) - t0,
        "step_times": times,
        "donated": donated,
    }


def donation_probe(
    trainer: Trainer, sampler: RssSampler, nbytes: int, n_leaves: int
) -> dict[str, float]:
    """The donation effect without any save: hold NumPy views of the state, as a snapshot does.

    JAX then declines to donate: the step allocates fresh output buffers while the old ones stay
    alive. Measured: that step's time against the median of the steps before it, and the RSS
    it adds (peak during the step, beyond the RSS before it).
    """
    times, _ = trainer.run_for(0.0, min_steps=4)
    base = statistics.median(times[1:])
    views = [np.asarray(x) for x in trainer.jax.tree.leaves(trainer.state)]
    gc.collect()  # no malloc_trim while training: the allocator behaves as in a real loop
    before = sampler.start_window()
    dt, donated = trainer.step()
    peak = sampler.peak()
    del views
    after, _ = trainer.step()  # donates again, into the fresh buffers
    return {
        "step_ratio": dt / base,
        "extra_s": dt - base,
        "donated_leaves": donated,
        "of_leaves": n_leaves,
        "mem_extra": (peak - before) / nbytes,
        "next_step_ratio": after / base,
    }


def interference(
    trainer: Trainer,
    runners: list[Any],
    reps: int,
    baseline_s: float,
    sampler: RssSampler,
    nbytes: int,
    n_leaves: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    t0 = now()
    for _ in range(3):  # compile, then settle
        trainer.step()
    log(f"train step compiled and warm ({now() - t0:.1f} s)")
    step = 1000
    for runner in runners:  # warm-up: one untimed save under training each
        trainer.run_for(1.0)
        save_window(trainer, runner, step)
        step += 1
    samples: dict[str, list[dict[str, Any]]] = {r.name: [] for r in runners}
    probes: list[dict[str, float]] = []
    for rep in range(reps):
        probes.append(donation_probe(trainer, sampler, nbytes, n_leaves))
        order = runners[rep % len(runners) :] + runners[: rep % len(runners)]
        for runner in order:
            gc.collect()
            sampler.start_window()
            times, donated = trainer.run_for(baseline_s)
            base_peak = sampler.peak()
            base_med = statistics.median(times)
            sampler.start_window()
            win = save_window(trainer, runner, step)
            win_peak = sampler.peak()
            step += 1
            n = len(win["step_times"])
            declined = [i for i, d in enumerate(win["donated"]) if d < n_leaves]
            samples[runner.name].append(
                {
                    "baseline_step_s": base_med,
                    "baseline_steps": len(times),
                    "baseline_declined": sum(1 for d in donated if d < n_leaves),
                    "window_s": win["window_s"],
                    "window_steps": n,
                    "window_step_s": statistics.median(win["step_times"]),
                    "blocked_s": win["blocked_s"],
                    "commit_s": win["commit_s"],
                    "lost_s": win["window_s"] - n * base_med,
                    "steps_per_s_ratio": (n / win["window_s"]) * base_med,
                    "declined_steps": len(declined),
                    "declined_at": declined,
                    "first_step_ratio": win["step_times"][0] / base_med,
                    "donated_first_step": win["donated"][0],
                    "mem_extra": (win_peak - base_peak) / nbytes,
                }
            )
        log(f"interference rep {rep + 1}/{reps} done ({now() - t0:.0f} s)")
    out: dict[str, Any] = {"reps": reps, "baseline_s": baseline_s, "systems": {}}
    out["donation_probe"] = {key: spread([p[key] for p in probes]) for key in probes[0]}
    for name, rows in samples.items():
        stats = {
            key: spread([float(r[key]) for r in rows])
            for key in rows[0]
            if key not in ("declined_at",)
        }
        stats["declined_at"] = [r["declined_at"] for r in rows]
        out["systems"][name] = stats
    return out


# ----------------------------------------------------------------------------- one size


def run_size(
    label: str,
    repeats: int,
    reps: int,
    baseline_s: float,
    tokens: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    import jax

    quiet_logs()
    import orbax.checkpoint  # noqa: F401  (import time kept out of the first measurement)

    quiet_logs()
    sampler = RssSampler(0.01)
    load_before = load_average()
    t0 = now()
    tree = build_state(label)
    leaves = jax.tree.leaves(tree)
    info = describe_state(label, leaves)
    nbytes = info["bytes"]
    log(
        f"[{label}] state: {info['leaves']} leaves, {nbytes / MiB:.1f} MiB, built in "
        f"{now() - t0:.1f} s; RSS {sampler.rss() / GiB:.2f} GiB"
    )
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
    )
    scratch = SCRATCH / label
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    limits = Limits([np.asarray(x) for x in leaves], scratch)
    runners: list[Any] = [CairnRunner(scratch / "cairn", abstract)]
    runners.append(OrbaxRunner(scratch / "orbax", abstract))
    samples: dict[str, list[float]] = {}
    try:
        order_all: list[Any] = [limits, *runners]
        for rnd in range(repeats + 1):  # round 0 is the warm-up, not recorded
            k = rnd % len(order_all)
            for runner in order_all[k:] + order_all[:k]:
                clean_memory()
                if runner is limits:
                    values = limits.run(rnd)
                else:
                    values = save_and_restore(runner, tree, rnd, sampler, nbytes, check=rnd == 0)
                if rnd == 0:
                    continue
                for key, value in values.items():
                    samples.setdefault(f"{runner.name}.{key}", []).append(value)
            where = "warm-up" if rnd == 0 else f"round {rnd}/{repeats}"
            log(f"[{label}] {where} done ({now() - t0:.0f} s)")
        limits.close()
        del limits, leaves
        state = [tree]
        del tree
        clean_memory()
        trainer = Trainer(label, state, tokens)
        inter = interference(
            trainer, runners, reps, baseline_s, sampler, nbytes, info["leaves"], log
        )
        del trainer
    finally:
        for runner in runners:
            runner.close()
        shutil.rmtree(scratch, ignore_errors=True)
        sampler.close()
    stats: dict[str, Any] = {}
    for key, values in samples.items():
        if key.split(".")[1] in MEMORY:
            stats[key] = spread(values)
        else:
            stats[key] = summarize(values, None if key in NO_THROUGHPUT else nbytes)
    return {
        "tree": info,
        "stats": stats,
        "interference": inter,
        "targets": targets(samples, inter),
        "load_average": {"before": load_before, "after": load_average()},
        "wall_s": round(now() - t0, 1),
    }


def targets(samples: dict[str, list[float]], inter: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets: same-run ratios, paired by round (interference: by repetition)."""

    def paired(num: str, den: str) -> list[float]:
        return [a / b for a, b in zip(samples[num], samples[den], strict=True) if b > 0]

    lost = inter["systems"]
    values = {
        "commit_vs_orbax": paired("orbax.committed", "cairn.committed"),
        "commit_vs_write": paired("limit.write_fsync", "cairn.committed"),
        "restore_vs_orbax": paired("orbax.restore", "cairn.restore"),
        "blocked_vs_orbax": paired("cairn.blocked", "orbax.blocked"),
        "mem_save": samples["cairn.mem_save"],
        "mem_restore": samples["cairn.mem_restore"],
        "lost_vs_orbax": [
            a / b
            for a, b in zip(
                lost["cairn"]["lost_s"]["samples"], lost["orbax"]["lost_s"]["samples"], strict=True
            )
            if b > 0
        ],
    }
    out = {}
    for key, _, cmp, goal in TARGETS:
        vals = values[key]
        if not vals:
            continue
        entry: dict[str, Any] = spread(vals, 3)
        if cmp != "report":
            med, worst = entry["median"], entry["min"] if cmp == ">=" else entry["max"]
            entry["met"] = med >= goal if cmp == ">=" else med <= goal
            entry["met_by_every_round"] = worst >= goal if cmp == ">=" else worst <= goal
            # > 1: met with room to spare; < 1: the fraction of the target reached
            entry["of_target"] = round(med / goal if cmp == ">=" else goal / max(med, 1e-9), 3)
        out[key] = entry
    return out


# ----------------------------------------------------------------------------- output


def print_tables(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(120, Console().width))
    for label, entry in result["sizes"].items():
        tree = entry["tree"]
        n = result["config"]["repeats"]
        table = Table(
            title=f"{label}: {tree['bytes'] / MiB:.1f} MiB in {tree['leaves']} leaves, n={n} "
            "(median, min-max)",
            title_justify="left",
        )
        for col, just in (("measurement", "left"), ("median", "right"), ("min-max", "right")):
            table.add_column(col, justify=just)  # type: ignore[arg-type]
        table.add_column("GiB/s", justify="right")
        stats = entry["stats"]
        for key, name in LABELS.items():
            if key not in stats:
                continue
            s = stats[key]
            table.add_row(
                name,
                fmt_s(s["median_s"]),
                f"{fmt_s(s['min_s'])} - {fmt_s(s['max_s'])}",
                f"{s['gib_per_s']:.2f}" if s.get("gib_per_s") else "",
                end_section=key in ("limit.read", "cairn.cpu_restore"),
            )
        for system in SYSTEMS:
            for mkey, name in MEMORY.items():
                s = stats.get(f"{system}.{mkey}")
                if s:
                    table.add_row(
                        f"{system}: {name} (x state)",
                        f"{s['median']:.3f}",
                        f"{s['min']:.3f} - {s['max']:.3f}",
                        "",
                    )
        console.print(table)
        it = Table(title=f"{label}: training during a background save", title_justify="left")
        it.add_column("measure")
        for system in SYSTEMS:
            it.add_column(f"{system} median (min-max)", justify="right")
        inter = entry["interference"]["systems"]
        for key, name in INTERFERENCE_ROWS:
            cells = []
            for system in SYSTEMS:
                s = inter[system][key]
                cells.append(fmt_value(key, s))
            it.add_row(name, *cells)
        console.print(it)
        probe = entry["interference"]["donation_probe"]
        console.print(
            f"{label}: donation declined without a save (NumPy views held for one step): "
            + "; ".join(f"{name} {fmt_value(key, probe[key])}" for key, name in PROBE_ROWS)
        )
    console.print(targets_table_rich(result))


INTERFERENCE_ROWS = [
    ("baseline_step_s", "step time, no save"),
    ("window_step_s", "step time while the save is in flight"),
    ("steps_per_s_ratio", "steps/s during the save ÷ without"),
    ("blocked_s", "save() blocks the loop"),
    ("commit_s", "save start -> committed, under training"),
    ("window_s", "window (save start -> first step ending after commit and freeing)"),
    ("lost_s", "training time lost per save"),
    ("declined_steps", "steps whose donation JAX declined, per window"),
    ("first_step_ratio", "first step after save() ÷ baseline step"),
    ("mem_extra", "extra peak RSS in the window vs the baseline window, x state"),
]


PROBE_ROWS = [
    ("step_ratio", "step time / baseline"),
    ("extra_s", "extra seconds"),
    ("donated_leaves", "leaves donated"),
    ("mem_extra", "extra peak RSS, x state"),
    ("next_step_ratio", "next step / baseline"),
]


def fmt_value(key: str, s: dict[str, Any]) -> str:
    med, lo, hi = s["median"], s["min"], s["max"]
    if key.endswith("_s"):
        return fmt_range(med, lo, hi)
    if key in ("declined_steps", "donated_leaves"):
        return f"{med:g} ({lo:g}-{hi:g})"
    return f"{med:.2f} ({lo:.2f}-{hi:.2f})"


def target_rows(result: dict[str, Any]) -> list[list[str]]:
    rows = []
    for key, what, cmp, goal in TARGETS:
        for label, entry in result["sizes"].items():
            t = entry["targets"].get(key)
            if t is None:
                continue
            measured = f"{t['median']:.2f}{TIMES} ({t['min']:.2f}{EN_DASH}{t['max']:.2f})"
            if cmp == "report":
                rows.append([what, "(report)", label, measured, "—"])
                continue
            verdict = "met" if t["met"] else "**missed**"
            if t["met"] and not t["met_by_every_round"]:
                verdict += " (not in every round)"
            how = (
                f"{t['of_target']:.2f}{TIMES} the target"
                if cmp == ">="
                else f"{1 / t['of_target']:.2f}{TIMES} the limit"
            )
            rows.append(
                [
                    what,
                    f"{cmp.replace('>=', '≥').replace('<=', '≤')} {goal:g}",
                    label,
                    measured,
                    f"{verdict}: {how}",
                ]
            )
    return rows


def targets_table_rich(result: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(
        title="targets (same-run ratios, median and range over rounds)", title_justify="left"
    )
    for col in ("target", "goal", "size", "measured", "verdict"):
        table.add_column(col)
    for row in target_rows(result):
        table.add_row(*[c.replace("**", "") for c in row])
    return table


def markdown_tables(result: dict[str, Any]) -> str:
    lines = [
        f"| target | goal | size | measured: median (min{EN_DASH}max) | verdict |",
        "|---|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in target_rows(result)]
    labels = list(result["sizes"])
    lines += [
        "",
        "| measurement | "
        + " | ".join(f"{lab} median (min{EN_DASH}max) | GiB/s" for lab in labels)
        + " |",
    ]
    lines.append("|---|" + "---:|---:|" * len(labels))
    for key, name in LABELS.items():
        cells = []
        for lab in labels:
            st = result["sizes"][lab]["stats"].get(key)
            if st is None:
                cells += ["", ""]
                continue
            cells.append(fmt_range(st["median_s"], st["min_s"], st["max_s"]))
            cells.append(f"{st['gib_per_s']:.2f}" if st.get("gib_per_s") else "")
        lines.append(f"| {name.strip()} | " + " | ".join(cells) + " |")
    for system in SYSTEMS:
        for mkey, name in MEMORY.items():
            cells = []
            for lab in labels:
                st = result["sizes"][lab]["stats"].get(f"{system}.{mkey}")
                cells += [
                    f"{st['median']:.3f} ({st['min']:.3f}{EN_DASH}{st['max']:.3f})" if st else "",
                    "",
                ]
            if any(cells):
                lines.append(f"| {system}: {name}, {TIMES} state | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| training during a background save | "
        + " | ".join(f"{lab} {s}" for lab in labels for s in SYSTEMS)
        + " |",
    ]
    lines.append("|---|" + "---:|" * (len(labels) * len(SYSTEMS)))
    for key, name in INTERFERENCE_ROWS:
        cells = [
            fmt_value(key, result["sizes"][lab]["interference"]["systems"][s][key])
            for lab in labels
            for s in SYSTEMS
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| donation declined, no save (views held one step) | " + " | ".join(labels) + " |",
    ]
    lines.append("|---|" + "---:|" * len(labels))
    for key, name in PROBE_ROWS:
        cells = [
            fmt_value(key, result["sizes"][lab]["interference"]["donation_probe"][key])
            for lab in labels
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", default="256M,1G", help=f"of {', '.join(CONFIGS)} (default 256M,1G)"
    )
    parser.add_argument(
        "--with-4g", action="store_true", help="add the 4G state (needs ~16 GiB free)"
    )
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds per size (default 7)")
    parser.add_argument(
        "--reps", type=int, default=5, help="save windows under training per system (default 5)"
    )
    parser.add_argument(
        "--baseline-s",
        type=float,
        default=4.0,
        help="training window without a save, s (default 4)",
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=32,
        help="sequence length of the stand-in train step (default 32)",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 16M, 2 rounds, 2 windows")
    parser.add_argument("--in-process", action="store_true", help="run every size in this process")
    parser.add_argument("--json", type=Path, default=None, help=f"default {DEFAULT_JSON}")
    parser.add_argument("--png", type=Path, default=DEFAULT_PNG, help=f"default {DEFAULT_PNG}")
    parser.add_argument("--plot", action="store_true", help="only redraw the PNG from the JSON")
    parser.add_argument(
        "--markdown", action="store_true", help="only print the JSON as Markdown tables"
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    json_path = args.json or (QUICK_JSON if args.quick else DEFAULT_JSON)
    if args.markdown:
        print(markdown_tables(json.loads(json_path.read_text())))
        return 0
    if args.plot:
        make_plot(json_path, args.png)
        print(f"wrote {args.png}")
        return 0
    if args.quick:
        args.sizes, args.repeats, args.reps, args.baseline_s = "16M", 2, 2, 1.5
    sizes = [s.strip().upper() for s in args.sizes.split(",") if s.strip()]
    if args.with_4g and "4G" not in sizes:
        sizes.append("4G")
    unknown = [s for s in sizes if s not in CONFIGS]
    if unknown or not sizes or args.repeats < 1 or args.reps < 1:
        parser.error(f"sizes must be of {list(CONFIGS)} (got {unknown}); repeats, reps >= 1")

    t0 = now()

    def log(msg: str) -> None:
        print(f"{now() - t0:7.1f}s  {msg}", file=sys.stderr, flush=True)

    if args.worker:  # one size, in a child process; writes its entry to --json
        entry = run_size(args.worker, args.repeats, args.reps, args.baseline_s, args.tokens, log)
        json_path.write_text(json.dumps(entry) + "\n")
        return 0

    started = time.time()
    fs = scratch_filesystem()
    log(
        f"scratch directory {SCRATCH} ({fs or 'filesystem unknown'}); load average {load_average()}"
    )
    if fs and fs.split()[0] in ("tmpfs", "ramfs"):
        log("WARNING: the scratch directory is in memory, disk numbers will be meaningless")
    result: dict[str, Any] = {
        "benchmark": "bench/bench_train_state.py",
        "date_utc": datetime.datetime.fromtimestamp(started, datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M"
        ),
        "config": {
            "repeats": args.repeats,
            "warmup_rounds": 1,
            "interference_reps": args.reps,
            "baseline_s": args.baseline_s,
            "tokens": args.tokens,
            "quick": args.quick,
            "process_per_size": not args.in_process,
            "rss_interval_s": 0.01,
            "malloc_trim_between_phases": True,
        },
        "machine": machine_facts(),
        "labels": {**LABELS, **{f"mem.{k}": v for k, v in MEMORY.items()}},
        "sizes": {},
    }
    for label in sizes:
        if args.in_process:
            entry = run_size(label, args.repeats, args.reps, args.baseline_s, args.tokens, log)
        else:
            options = {
                "repeats": args.repeats,
                "reps": args.reps,
                "baseline_s": args.baseline_s,
                "tokens": args.tokens,
            }
            entry = run_in_child(
                __file__,
                label,
                options,
                RESULTS / f".{label}.partial.json",
            )
        result["sizes"][label] = entry
        log(f"[{label}] done in {entry['wall_s']:.0f} s")
    shutil.rmtree(SCRATCH, ignore_errors=True)
    result["wall_s"] = round(now() - t0, 1)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    print_tables(result)
    log(f"wrote {json_path}")
    if not args.quick:
        make_plot(json_path, args.png)
        log(f"wrote {args.png}")
    return 0


def make_plot(json_path: Path, png_path: Path) -> None:
    import plot  # bench/plot.py, next to this script

    plot.plot_train_state(json_path, png_path)


if __name__ == "__main__":
    sys.exit(main())
