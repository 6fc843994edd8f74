"""Save/restore benchmark: cairn against Orbax and against this machine's limits.

One run measures, for a pytree of float32 NumPy arrays of each requested size (a transformer-like
mix of a few big matrices and many small vectors, as params + Adam mu + nu):

* machine limits for the same bytes: memcpy into a preallocated (pre-faulted) buffer, a copy into
  fresh arrays, one buffered write + fsync of all leaves to a single file, and reading that file
  back (the page cache is warm: nothing is dropped);
* cairn (``CheckpointManager``, default NumPy handler): time ``save()`` holds the caller (async),
  save start to committed (``save`` + ``wait_until_finished``), synchronous save
  (``async_save=False``), and ``restore(step)`` without a target;
* Orbax (``ocp.CheckpointManager``, async, ``StandardSave``/``StandardRestore``) on the same NumPy
  tree, and on the tree converted to ``jax.Array`` leaves (what a JAX trainer hands Orbax).

Every method runs once untimed (warm-up), then ``--repeats`` times, interleaved (one of each per
round, the order rotated every round) so the machine's noise hits every method alike. Each save
goes to a fresh step; managers keep only the latest step so disk use stays bounded. Results:
medians, min-max, ratios, a rich table on stdout, JSON in bench/results/latest.json and the plot
docs/benchmarks.png (``--plot`` redraws it from the JSON without measuring).

    .venv/bin/python bench/bench_save_restore.py                 # what `make bench` runs
    .venv/bin/python bench/bench_save_restore.py --quick         # smoke run, seconds
    .venv/bin/python bench/bench_save_restore.py --sizes 1G --repeats 3
    .venv/bin/python bench/bench_save_restore.py --plot          # redraw the PNG from the JSON
    .venv/bin/python bench/bench_save_restore.py --markdown      # the JSON as Markdown tables
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import shutil
import sys
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
    Limits,
    MiB,
    Timings,
    check_equal,
    fmt_range,
    fmt_s,
    machine_facts,
    now,
    parse_size,
    quiet_logs,
    scratch_filesystem,
    size_label,
    summarize,
)

DEFAULT_JSON = RESULTS / "latest.json"
QUICK_JSON = RESULTS / "quick.json"
DEFAULT_PNG = REPO / "docs" / "benchmarks.png"

# Method keys in the JSON: "<system>.<measure>". The plot and the docs rely on these names.
LABELS = {
    "limit.memcpy": "memcpy into preallocated buffer (np.copyto)",
    "limit.fresh_copy": "copy into fresh arrays (np.array(x, copy=True))",
    "limit.write_fsync": "write + fsync, one file",
    "limit.read": "read back, one file (page cache warm)",
    "cairn.blocked": "cairn async: save() blocks caller",
    "cairn.committed": "cairn async: save start -> committed",
    "cairn.restore": "cairn: restore(step), no target",
    "cairn_sync.committed": "cairn sync (async_save=False): save()",
    "orbax_np.blocked": "orbax (NumPy leaves): save() blocks caller",
    "orbax_np.committed": "orbax (NumPy leaves): save start -> committed",
    "orbax_np.restore": "orbax (NumPy leaves): restore",
    "orbax_jax.blocked": "orbax (jax.Array leaves): save() blocks caller",
    "orbax_jax.committed": "orbax (jax.Array leaves): save start -> committed",
    "orbax_jax.restore": "orbax (jax.Array leaves): restore",
}
# cairn's own telemetry (info(step).telemetry), to show where the commit time goes.
# tm_sync = tm_commit - tm_write (manifest, fsync or syncfs, rename);
# tm_after = committed - blocked - tm_commit (retention and the thread hand-off).
TELEMETRY = {
    "cairn.tm_write": "  of which: write phase, files + crc32c (telemetry write_s)",
    "cairn.tm_sync": "  of which: manifest, fsync/syncfs, rename",
    "cairn.tm_after": "  of which: retention + hand-off",
    "cairn.tm_commit": "cairn telemetry: commit thread, start -> renamed",
}

# (label, numerator, denominator): ratios of medians reported per size.
RATIOS = [
    ("cairn / orbax_np: blocked", "cairn.blocked", "orbax_np.blocked"),
    ("cairn / orbax_np: committed", "cairn.committed", "orbax_np.committed"),
    ("cairn / orbax_np: restore", "cairn.restore", "orbax_np.restore"),
    ("cairn / orbax_jax: blocked", "cairn.blocked", "orbax_jax.blocked"),
    ("cairn / orbax_jax: committed", "cairn.committed", "orbax_jax.committed"),
    ("cairn / orbax_jax: restore", "cairn.restore", "orbax_jax.restore"),
    ("cairn committed / write+fsync", "cairn.committed", "limit.write_fsync"),
    ("cairn sync / write+fsync", "cairn_sync.committed", "limit.write_fsync"),
    ("orbax_np committed / write+fsync", "orbax_np.committed", "limit.write_fsync"),
    ("cairn restore / read back", "cairn.restore", "limit.read"),
    ("orbax_np restore / read back", "orbax_np.restore", "limit.read"),
    ("cairn blocked / memcpy", "cairn.blocked", "limit.memcpy"),
    ("cairn blocked / fresh copy", "cairn.blocked", "limit.fresh_copy"),
    ("orbax_np blocked / memcpy", "orbax_np.blocked", "limit.memcpy"),
]


# ----------------------------------------------------------------------------- the pytree


def build_tree(nbytes: int, seed: int = 0) -> dict[str, Any]:
    """A transformer-like train state of about `nbytes` float32 bytes: params, Adam mu and nu.

    Each of the three parameter sets has 8 layers of attention q/k/v/o (d x d) and an MLP
    (d x 4d, 4d x d), layer-norm scales and biases (vectors of d or 4d), a final norm, and an
    embedding (vocab x d) sized so the total comes out at `nbytes` (to within a few KiB).
    Values are random normal, scaled, so they are about as incompressible as real weights.
    """
    n_layers = 8
    floats_per_set = nbytes / 4 / 3
    # per set: n_layers * 12 d^2 (matrices) + vocab * d with vocab ~ 8 d  ->  ~104 d^2
    d = max(8, int((floats_per_set / (n_layers * 12 + 8)) ** 0.5) // 8 * 8)
    ff = 4 * d
    vectors = n_layers * (4 * d + ff) + d
    matrices = n_layers * 12 * d * d
    vocab = max(1, round((floats_per_set - vectors - matrices) / d))
    rng = np.random.default_rng(seed)

    def arr(shape: tuple[int, ...], scale: float) -> np.ndarray:
        a = rng.standard_normal(shape, dtype=np.float32)
        a *= scale
        return a

    def param_set(scale: float) -> dict[str, Any]:
        layers = {}
        for i in range(n_layers):
            layers[f"layer_{i:02d}"] = {
                "attention": {
                    "query": arr((d, d), scale),
                    "key": arr((d, d), scale),
                    "value": arr((d, d), scale),
                    "out": arr((d, d), scale),
                    "out_bias": arr((d,), scale),
                },
                "mlp": {
                    "wi": arr((d, ff), scale),
                    "wi_bias": arr((ff,), scale),
                    "wo": arr((ff, d), scale),
                    "wo_bias": arr((d,), scale),
                },
                "pre_attention_norm": {"scale": arr((d,), scale)},
                "pre_mlp_norm": {"scale": arr((d,), scale)},
            }
        return {
            "token_embedder": {"embedding": arr((vocab, d), scale)},
            "decoder": {**layers, "final_norm": {"scale": arr((d,), scale)}},
        }

    return {
        "params": param_set(0.02),
        "opt_state": {"mu": param_set(1e-3), "nu": param_set(1e-6)},
    }


def leaves_of(tree: Any) -> list[np.ndarray]:
    if isinstance(tree, dict):
        return [leaf for k in tree for leaf in leaves_of(tree[k])]
    return [tree]


def describe_tree(leaves: list[np.ndarray]) -> dict[str, Any]:
    sizes = sorted((a.nbytes for a in leaves), reverse=True)
    big = [s for s in sizes if s >= MiB]
    largest = max(leaves, key=lambda a: a.nbytes)
    return {
        "bytes": sum(sizes),
        "leaves": len(leaves),
        "leaves_ge_1MiB": len(big),
        "bytes_in_leaves_ge_1MiB": sum(big),
        "largest_leaf_shape": list(largest.shape),
        "smallest_leaf_bytes": sizes[-1],
        "dtype": "float32",
    }


# ----------------------------------------------------------------------------- measurements


class Cairn:
    """cairn's CheckpointManager, async (blocked, committed, restore) or sync (committed)."""

    def __init__(self, directory: Path, tree: Any, *, async_save: bool) -> None:
        from cairn.manager import CheckpointManager, KeepLatest

        self.name = "cairn" if async_save else "cairn_sync"
        self.tree = tree
        self.async_save = async_save
        self.mgr = CheckpointManager(directory, keep=KeepLatest(1), async_save=async_save)

    def run(self, step: int) -> Timings:
        t: Timings = {}
        t0 = now()
        self.mgr.save(step, {"state": self.tree}, force=True)
        t1 = now()
        self.mgr.wait_until_finished()
        t2 = now()
        if not self.async_save:
            return {"committed": t1 - t0}
        t["blocked"], t["committed"] = t1 - t0, t2 - t0
        telemetry = self.mgr.info(step).telemetry
        t["tm_write"] = float(telemetry["write_s"])
        t["tm_commit"] = float(telemetry["commit_s"])
        t["tm_sync"] = t["tm_commit"] - t["tm_write"]
        t["tm_after"] = t["committed"] - t["blocked"] - t["tm_commit"]
        t0 = now()
        restored = self.mgr.restore(step)
        t["restore"] = now() - t0
        if step == 0:  # warm-up round: check the round trip once, untimed
            check_equal(self.tree, restored["state"], "cairn")
        return t

    def close(self) -> None:
        self.mgr.close()


class Orbax:
    """orbax-checkpoint's CheckpointManager, async, StandardSave / StandardRestore."""

    def __init__(self, directory: Path, tree: Any, *, as_jax: bool) -> None:
        import jax
        import orbax.checkpoint as ocp

        self.ocp, self.jax = ocp, jax
        self.name = "orbax_jax" if as_jax else "orbax_np"
        self.source = tree
        # jax.device_put copies the host arrays once, here, outside any timing.
        self.tree = jax.block_until_ready(jax.tree.map(jax.numpy.asarray, tree)) if as_jax else tree
        options = ocp.CheckpointManagerOptions(max_to_keep=1, enable_async_checkpointing=True)
        self.mgr = ocp.CheckpointManager(directory, options=options)

    def run(self, step: int) -> Timings:
        ocp, jax = self.ocp, self.jax
        t0 = now()
        self.mgr.save(step, args=ocp.args.StandardSave(self.tree))
        t1 = now()
        self.mgr.wait_until_finished()
        t2 = now()
        restored = self.mgr.restore(step, args=ocp.args.StandardRestore())
        jax.block_until_ready(restored)
        t3 = now()
        if step == 0:
            check_equal(self.source, restored, self.name)
        return {"blocked": t1 - t0, "committed": t2 - t0, "restore": t3 - t2}

    def close(self) -> None:
        self.mgr.close()


def measure_size(nbytes: int, repeats: int, systems: list[str], log: Callable[[str], None]) -> Any:
    """Build the tree, run every method (warm-up + `repeats` interleaved rounds), return samples."""
    t0 = now()
    tree = build_tree(nbytes)
    leaves = leaves_of(tree)
    info = describe_tree(leaves)
    log(
        f"[{size_label(nbytes)}] tree: {info['leaves']} float32 leaves, {info['bytes'] / MiB:.1f} MiB "
        f"({info['leaves_ge_1MiB']} leaves >= 1 MiB), built in {now() - t0:.1f} s"
    )
    scratch = SCRATCH / size_label(nbytes)
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    runners: list[Any] = [Limits(leaves, scratch)]
    if "cairn" in systems:
        runners.append(Cairn(scratch / "cairn", tree, async_save=True))
        runners.append(Cairn(scratch / "cairn_sync", tree, async_save=False))
    if "orbax" in systems:
        runners.append(Orbax(scratch / "orbax_np", tree, as_jax=False))
        runners.append(Orbax(scratch / "orbax_jax", tree, as_jax=True))
    samples: dict[str, list[float]] = {}
    try:
        for rnd in range(repeats + 1):  # round 0 is the warm-up, not recorded
            order = runners[rnd % len(runners) :] + runners[: rnd % len(runners)]
            for runner in order:
                gc.collect()
                timings = runner.run(rnd)
                if rnd == 0:
                    continue
                for key, value in timings.items():
                    samples.setdefault(f"{runner.name}.{key}", []).append(value)
            where = "warm-up" if rnd == 0 else f"round {rnd}/{repeats}"
            log(f"[{size_label(nbytes)}] {where} done ({now() - t0:.0f} s)")
    finally:
        for runner in runners:
            runner.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return info, samples


# ----------------------------------------------------------------------------- summary


def ratios(stats: dict[str, Any]) -> dict[str, float]:
    out = {}
    for label, num, den in RATIOS:
        if num in stats and den in stats and stats[den]["median_s"] > 0:
            out[label] = round(stats[num]["median_s"] / stats[den]["median_s"], 3)
    return out


def print_tables(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(110, Console().width))
    for label, entry in result["sizes"].items():
        tree = entry["tree"]
        table = Table(
            title=(
                f"{label}: {tree['bytes'] / MiB:.1f} MiB in {tree['leaves']} float32 leaves, "
                f"n={result['config']['repeats']} (median, min-max)"
            ),
            title_justify="left",
        )
        table.add_column("measurement")
        table.add_column("median", justify="right")
        table.add_column("min-max", justify="right")
        table.add_column("GiB/s", justify="right")
        stats = entry["stats"]
        keys = list(LABELS)
        at = keys.index("cairn.committed") + 1
        keys[at:at] = ["cairn.tm_write", "cairn.tm_sync", "cairn.tm_after"]
        for key in keys:
            if key not in stats:
                continue
            s = stats[key]
            table.add_row(
                {**LABELS, **TELEMETRY}[key],
                fmt_s(s["median_s"]),
                f"{fmt_s(s['min_s'])} - {fmt_s(s['max_s'])}",
                f"{s['gib_per_s']:.2f}" if s["gib_per_s"] else "",
                end_section=key in ("limit.read", "cairn_sync.committed", "orbax_np.restore"),
            )
        console.print(table)
    ratio_table = Table(title="ratios of medians (< 1: the first is faster)", title_justify="left")
    ratio_table.add_column("ratio")
    labels = list(result["sizes"])
    for label in labels:
        ratio_table.add_column(label, justify="right")
    for name, _, _ in RATIOS:
        cells = [result["sizes"][lab]["ratios"].get(name) for lab in labels]
        if any(c is not None for c in cells):
            ratio_table.add_row(name, *(f"{c:.2f}x" if c is not None else "" for c in cells))
    console.print(ratio_table)


def markdown_tables(result: dict[str, Any]) -> str:
    """The results as Markdown (for docs/benchmarks.md): one timing table, one ratio table."""
    labels = list(result["sizes"])
    keys = list(LABELS)
    at = keys.index("cairn.committed") + 1
    keys[at:at] = ["cairn.tm_write", "cairn.tm_sync", "cairn.tm_after"]
    names = {**LABELS, **TELEMETRY}
    lines = [
        "| measurement | " + " | ".join(f"{lab} median (min-max) | GiB/s" for lab in labels) + " |",
        "|---|" + "---:|---:|" * len(labels),
    ]
    for key in keys:
        cells = []
        for lab in labels:
            st = result["sizes"][lab]["stats"].get(key)
            if st is None:
                cells += ["", ""]
                continue
            cells.append(fmt_range(st["median_s"], st["min_s"], st["max_s"]))
            cells.append(f"{st['gib_per_s']:.2f}" if st["gib_per_s"] else "")
        if any(cells):
            lines.append(f"| {names[key].strip()} | " + " | ".join(cells) + " |")
    lines += ["", "| ratio of medians | " + " | ".join(labels) + " |"]
    lines.append("|---|" + "---:|" * len(labels))
    for name, _, _ in RATIOS:
        cells = [result["sizes"][lab]["ratios"].get(name) for lab in labels]
        if any(c is not None for c in cells):
            lines.append(
                f"| {name} | "
                + " | ".join(f"{c:.2f}x" if c is not None else "" for c in cells)
                + " |"
            )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def make_plot(json_path: Path, png_path: Path) -> None:
    import plot  # bench/plot.py, next to this script

    plot.plot(json_path, png_path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        default="64M,256M,1G",
        help="comma-separated, e.g. 64M,256M (default 64M,256M,1G)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per size (default 5)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 4M, 2 repeats")
    parser.add_argument("--no-orbax", action="store_true", help="skip Orbax (no jax import)")
    parser.add_argument("--json", type=Path, default=None, help=f"default {DEFAULT_JSON}")
    parser.add_argument("--png", type=Path, default=DEFAULT_PNG, help=f"default {DEFAULT_PNG}")
    parser.add_argument("--plot", action="store_true", help="only redraw the PNG from the JSON")
    parser.add_argument(
        "--markdown", action="store_true", help="only print the JSON's results as Markdown tables"
    )
    args = parser.parse_args(argv)

    json_path = args.json or (QUICK_JSON if args.quick else DEFAULT_JSON)
    if args.markdown:
        print(markdown_tables(json.loads(json_path.read_text())))
        return 0
    if args.plot:
        make_plot(json_path, args.png)
        print(f"wrote {args.png}")
        return 0
    sizes = [parse_size(s) for s in ("4M" if args.quick else args.sizes).split(",") if s.strip()]
    repeats = 2 if args.quick else args.repeats
    if repeats < 1 or not sizes or min(sizes) < MiB:
        parser.error("need --repeats >= 1 and sizes of at least 1M")
    systems = ["cairn"] if args.no_orbax else ["cairn", "orbax"]

    quiet_logs()
    started = time.time()
    t0 = now()

    def log(msg: str) -> None:
        print(f"{now() - t0:7.1f}s  {msg}", file=sys.stderr, flush=True)

    fs = scratch_filesystem()
    log(f"scratch directory {SCRATCH} ({fs or 'filesystem unknown'})")
    if fs and fs.split()[0] in ("tmpfs", "ramfs"):
        log("WARNING: the scratch directory is in memory, disk numbers will be meaningless")
    if "orbax" in systems:
        import orbax.checkpoint  # noqa: F401  (import time kept out of the first measurement)

        quiet_logs()

    result: dict[str, Any] = {
        "benchmark": "bench/bench_save_restore.py",
        "date_utc": datetime.datetime.fromtimestamp(started, datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M"
        ),
        "config": {"repeats": repeats, "warmup_rounds": 1, "quick": args.quick, "systems": systems},
        "machine": machine_facts(),
        "labels": {**LABELS, **TELEMETRY},
        "sizes": {},
    }
    try:
        for nbytes in sizes:
            info, samples = measure_size(nbytes, repeats, systems, log)
            stats = {k: summarize(v, info["bytes"]) for k, v in samples.items()}
            for key in TELEMETRY:  # telemetry is a part of a save, not a throughput of its own
                if key in stats:
                    stats[key]["gib_per_s"] = None
            result["sizes"][size_label(nbytes)] = {
                "tree": info,
                "stats": stats,
                "ratios": ratios(stats),
            }
    finally:
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


if __name__ == "__main__":
    sys.exit(main())
