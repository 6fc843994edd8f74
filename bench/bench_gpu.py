"""What a save costs a trainer whose state is on a GPU: cairn against Orbax, beside the device's
own floors, in one run.

Run it where JAX sees a CUDA GPU (``JAX_PLATFORMS=cuda``); elsewhere it runs on the CPU as a
smoke test, and its figures mean nothing. For each size (256M and 1G by default), on the T5X-like
state of bench_train_state.py (172 leaves) put on the GPU:

* a probe: whether ``np.asarray`` of a ``pinned_host`` array views its memory or copies it, and
  what each step of cairn's device-to-host path costs for one 64 MiB leaf;
* floors, each round: every leaf copied to ``pinned_host`` memory by ``jax.device_put`` (all
  started, then waited for: what any JAX-level snapshot costs at least), the same plus
  ``np.asarray`` of each (cairn's snapshot, without cairn), ``jax.device_get`` (pageable host
  memory), and, where torch has CUDA, a copy into pinned buffers allocated beforehand (the bus's
  own floor); plus ``limits`` of bench_overhead.py (memcpy, one ``O_DIRECT`` file);
* rounds, rotated: each system saves (``save()`` blocked; committed) and restores onto the GPU
  with the saved shardings (the page cache warm); the first round checks the values and that the
  restored arrays are on the GPU;
* training under a save, as bench_overhead.py measures it, on the decoder step (``--tokens``
  tokens a step) and the elementwise step: training time lost, ``save()`` blocked, the first
  step's extra time, whether that step donated its state.

    JAX_PLATFORMS=cuda python bench/bench_gpu.py --out gpu.json     # on the GPU machine
    .venv/bin/python bench/bench_gpu.py --quick                     # smoke run here: CPU, 16M
    .venv/bin/python bench/bench_gpu.py --markdown bench/results/gpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
import traceback
from pathlib import Path
from typing import Any

import bench_overhead as bo
import bench_train_state as bts
import numpy as np
from _common import RESULTS, SCRATCH, MiB, check_equal, machine_facts, now, quiet_logs, spread
from bench_overhead import D, X

SYSTEMS = ("cairn", "orbax", "cairn-process")  # the last on request (--systems)
STEPS = ("decoder", "elementwise")


def pinned(x: Any) -> Any:
    import jax

    return jax.sharding.SingleDeviceSharding(next(iter(x.devices())), memory_kind="pinned_host")


def has_pinned(x: Any) -> bool:
    device = next(iter(x.devices()))
    try:
        return any(m.kind == "pinned_host" for m in device.addressable_memories())
    except Exception:
        return False


def probe(log: Any) -> dict[str, Any]:
    """One 64 MiB leaf through each step of the device-to-host path, 5 times each."""
    import jax
    import jax.numpy as jnp

    y = jax.block_until_ready(jnp.arange(16 * MiB, dtype=jnp.float32))
    out: dict[str, Any] = {"platform": next(iter(y.devices())).platform, "pinned": has_pinned(y)}
    times: dict[str, list[float]] = {}
    for _ in range(6):
        x = fresh(y)  # an array keeps its host copy once made: a new one each time
        t0 = now()
        host = jax.device_get(x)
        t1 = now()
        times.setdefault("device_get", []).append(t1 - t0)
        if out["pinned"]:
            t0 = now()
            xp = jax.block_until_ready(jax.device_put(x, pinned(x)))
            t1 = now()
            a = np.asarray(xp)
            t2 = now()
            times.setdefault("device_put_pinned", []).append(t1 - t0)
            times.setdefault("asarray_of_pinned", []).append(t2 - t1)
            try:
                out["asarray_views_pinned"] = a.ctypes.data == xp.unsafe_buffer_pointer()
            except Exception as e:  # no pointer: say so
                out["asarray_views_pinned"] = f"unknown ({type(e).__name__}: {e})"
            out["asarray_writeable"] = bool(a.flags.writeable)
            assert np.array_equal(a, host)
            del xp, a
    out["times"] = {k: spread(v[1:], 6) for k, v in times.items()}
    log(f"probe: {json.dumps(out)}")
    return out


def fresh(x: Any) -> Any:
    """A new device array of the same values, with no host copy cached in it."""
    import jax
    import jax.numpy as jnp

    return jax.block_until_ready(jnp.copy(x))


def torch_pinned_floor(leaves: list[Any]) -> float | None:
    """A copy of every leaf into pinned buffers allocated beforehand (through DLPack and torch):
    the bus's floor, with no allocation in it. None where torch has no CUDA."""
    try:
        import torch
        import torch.utils.dlpack
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    src = [torch.utils.dlpack.from_dlpack(x) for x in leaves]
    dst = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in src]
    for d, s in zip(dst, src, strict=True):  # warm: the first copies set things up
        d.copy_(s, non_blocking=True)
    torch.cuda.synchronize()
    t0 = now()
    for d, s in zip(dst, src, strict=True):
        d.copy_(s, non_blocking=True)
    torch.cuda.synchronize()
    return now() - t0


def floors(state: list[Any], scratch: Path) -> dict[str, float]:
    """Each on new copies of the leaves: `jax.Array` keeps the host copy `device_get` made."""
    import jax

    out: dict[str, float] = {}
    leaves = [fresh(x) for x in state]
    if all(has_pinned(x) for x in leaves):
        t0 = now()
        copies = [jax.device_put(x, pinned(x)) for x in leaves]
        jax.block_until_ready(copies)
        out["d2h_pinned"] = now() - t0
        del copies
        t0 = now()
        copies = [jax.device_put(x, pinned(x)) for x in leaves]
        arrays = [np.asarray(c) for c in copies]
        out["d2h_pinned_asarray"] = now() - t0
        del copies, arrays
    leaves = [fresh(x) for x in state]
    t0 = now()
    host = jax.device_get(leaves)
    out["d2h_pageable"] = now() - t0
    bus = torch_pinned_floor(leaves)
    if bus is not None:
        out["d2h_preallocated"] = bus
    out.update(bo.limits([np.asarray(h) for h in host], scratch / "plain.bin"))
    return out


def run_size(label: str, args: argparse.Namespace, log: Any) -> dict[str, Any]:
    import jax

    quiet_logs()
    import orbax.checkpoint  # noqa: F401  (import time kept out of the measurements)

    import cairn.manager  # noqa: F401

    quiet_logs()
    t_start = now()
    tree = bts.build_state(label)
    leaves = jax.tree.leaves(tree)
    info = bts.describe_state(label, leaves)
    info["device"] = str(next(iter(leaves[0].devices())))
    nbytes, n_leaves = info["bytes"], info["leaves"]
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
    )
    # what a restore must give back, taken from copies: the state's arrays get no host copy
    expected = jax.tree.map(lambda x: np.asarray(fresh(x)), tree)
    scratch = SCRATCH / f"gpu-{label}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    log(f"[{label}] {n_leaves} leaves, {nbytes / MiB:.0f} MiB on {info['device']}")
    rounds: dict[str, list[float]] = {}
    systems = args.systems
    runners = {name: bo.make_runner(name, scratch / name, abstract) for name in systems}
    order = ["floors", *systems]
    checks: dict[str, Any] = {}
    for rnd in range(args.repeats + 1):  # round 0: warm-up and checks, not recorded
        k = rnd % len(order)
        for name in order[k:] + order[:k]:
            bo.clean()
            if name == "floors":
                values = floors(leaves, scratch)
            else:
                runner = runners[name]
                values = bts.timed_save(runner, 100 + rnd, tree)
                t3 = now()
                restored = jax.block_until_ready(runner.restore(100 + rnd))
                values["restore"] = now() - t3
                if rnd == 0:
                    check_equal(expected, restored, name)
                    where = {str(d) for x in jax.tree.leaves(restored) for d in x.devices()}
                    checks[name] = {"values_equal": True, "restored_on": sorted(where)}
                del restored
            if rnd:
                for key, value in values.items():
                    rounds.setdefault(f"{name}.{key}", []).append(value)
        log(f"[{label}] round {rnd}/{args.repeats} ({now() - t_start:.0f} s)")
    for runner in runners.values():
        runner.close()
    del leaves, expected
    windows: dict[str, dict[str, list[dict[str, float]]]] = {}
    state = [tree]
    del tree
    for kind in STEPS:
        trainer = bo.trainer_for(kind, label, state, args.tokens)
        for _ in range(3):
            trainer.step()
        runners = {
            name: bo.make_runner(name, scratch / f"{kind}-{name}", abstract) for name in systems
        }
        zero = {"step_s": 0, "gap_s": 0, "cpu_per_step": 0, "faults_per_step": 0}
        step = 1000
        for name in systems:  # one untimed save each: compiled, pools set up
            trainer.run_for(0.2)
            bo.save_window(trainer, runners[name], step, zero, n_leaves)
            step += 1
        windows[kind] = bo.rotated_windows(
            trainer, runners, systems, args.reps, args.baseline_s, step, n_leaves
        )
        log(f"[{label}] {kind}: {args.reps} windows each ({now() - t_start:.0f} s)")
        for runner in runners.values():
            runner.close()
        state = [trainer.state]
        del trainer
    shutil.rmtree(scratch, ignore_errors=True)
    return {
        "tree": info,
        "checks": checks,
        "rounds": {key: spread(values, 6) for key, values in rounds.items()},
        "ratios": ratios(rounds, windows),
        "windows": {
            kind: {
                name: {key: spread([w[key] for w in rows], 6) for key in rows[0]}
                for name, rows in per.items()
            }
            for kind, per in windows.items()
        },
        "wall_s": round(now() - t_start, 1),
    }


def ratios(
    rounds: dict[str, list[float]], windows: dict[str, dict[str, list[dict[str, float]]]]
) -> dict[str, Any]:
    """Same-round (same-window-pair) ratios: cairn over Orbax and over the floors."""

    def paired(num: str, den: str) -> dict[str, Any] | None:
        return bo.same_round_ratio(rounds, num, den)

    out: dict[str, Any] = {
        "blocked / orbax": paired("cairn.blocked", "orbax.blocked"),
        "blocked / d2h_pinned": paired("cairn.blocked", "floors.d2h_pinned"),
        "blocked / d2h_pinned_asarray": paired("cairn.blocked", "floors.d2h_pinned_asarray"),
        "blocked / d2h_preallocated": paired("cairn.blocked", "floors.d2h_preallocated"),
        "orbax blocked / d2h_pinned": paired("orbax.blocked", "floors.d2h_pinned"),
        "commit / odirect": paired("cairn.commit", "floors.odirect"),
        "orbax restore / cairn restore": paired("orbax.restore", "cairn.restore"),
    }
    for kind, per in windows.items():
        for name in per.keys() - {"orbax"}:
            lost = [
                c["lost_s"] / o["lost_s"] if o["lost_s"] > 0 else float("nan")
                for c, o in zip(per[name], per["orbax"], strict=True)
            ]
            out[f"{kind}: {name} lost / orbax"] = spread(lost, 4)
    return {k: v for k, v in out.items() if v is not None}


def ms(s: dict[str, Any]) -> str:
    return f"{s['median'] * 1e3:.1f} ms | {s['min'] * 1e3:.1f}{D}{s['max'] * 1e3:.1f}"


def markdown(result: dict[str, Any]) -> str:
    lines = [f"GPU run of {result['date_utc']} (cairn {result['git']}), {result['device']}", ""]
    for label, entry in result["sizes"].items():
        if "error" in entry:
            lines += [f"**{label}**: failed: `{entry['error'].splitlines()[-1]}`", ""]
            continue
        lines += [
            f"**{label}** ({entry['tree']['leaves']} leaves)",
            "",
            "| figure | median | range |",
        ]
        lines.append("|---|---|---|")
        for key, s in entry["rounds"].items():
            lines.append(f"| {key} | {ms(s)} |")
        for key, s in entry["ratios"].items():
            lines.append(f"| {key} | {s['median']:.2f}{X} | {s['min']:.2f}{D}{s['max']:.2f} |")
        for kind, per in entry["windows"].items():
            for name, row in per.items():
                for key in ("lost_s", "blocked_s", "first_step_extra_s"):
                    lines.append(f"| {kind}, {name}: {key} | {ms(row[key])} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="256M,1G")
    parser.add_argument("--systems", default="cairn,orbax", help=f"of {', '.join(SYSTEMS)}")
    parser.add_argument("--repeats", type=int, default=5, help="save/restore rounds")
    parser.add_argument("--reps", type=int, default=5, help="save windows per system and step")
    parser.add_argument("--baseline-s", type=float, default=0.5)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu.json")
    parser.add_argument("--quick", action="store_true", help="smoke run: 16M, 2 rounds, 2 windows")
    parser.add_argument("--markdown", type=Path, default=None, help="print a result as Markdown")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())))
        return 0
    args.systems = [s for s in args.systems.split(",") if s]
    if not set(args.systems) <= set(SYSTEMS) or not {"cairn", "orbax"} <= set(args.systems):
        parser.error(f"--systems: cairn, orbax and any of {SYSTEMS}")
    if args.quick:
        args.sizes, args.repeats, args.reps, args.baseline_s, args.tokens = "16M", 2, 2, 0.2, 32
    t0 = now()

    def log(msg: str) -> None:
        print(f"{now() - t0:7.1f}s  {msg}", file=sys.stderr, flush=True)

    import jax

    result: dict[str, Any] = {
        "benchmark": "bench/bench_gpu.py",
        "git": _git(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "device": str(jax.devices()[0]),
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "markdown")},
        "machine": machine_facts(),
        "sizes": {},
    }
    try:
        result["probe"] = probe(log)
    except Exception:
        result["probe"] = {"error": traceback.format_exc()}
        log(f"probe failed:\n{traceback.format_exc()}")
    for label in [s.strip().upper() for s in args.sizes.split(",") if s.strip()]:
        try:
            result["sizes"][label] = run_size(label, args, log)
        except Exception:  # keep what the other sizes measured
            result["sizes"][label] = {"error": traceback.format_exc()}
            log(f"[{label}] failed:\n{traceback.format_exc()}")
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))
    log(f"wrote {args.out}")
    return 0


def _git() -> str:
    import subprocess

    run = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return run.stdout.strip() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
