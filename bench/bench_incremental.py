"""Incremental saves: what a save costs when little, nothing or everything changed.

On the T5X-like state of bench_train_state (172 jax CPU arrays: params, Adam's mu and nu), three
cases, each a run of saves of a state that changes between saves:

* **lora**: about 2% of the parameters change between saves, and their mu and nu too (whole
  leaves, the smallest first, until 2% of the params' bytes), as when fine-tuning adapters with
  the backbone frozen;
* **frozen**: nothing changes;
* **all**: every leaf changes (pretraining).

Systems: cairn writing everything (``incremental=False``), cairn ``incremental=True``, and Orbax
(which rewrites everything). With ``--store s3`` the two cairn systems save to a bucket of a
moto S3 server process on 127.0.0.1 started here (incremental saves copy unchanged objects on the
server), Orbax is left out, and restores read from the bucket (nothing to warm). Each save is timed from ``save()`` to committed, the retired step's
removal excluded; bytes written are the manifest's ``bytes_written`` for cairn and the step's
size on disk for Orbax. Per round each system saves once per case, systems rotated; ratios
against cairn writing everything in the same round. Then the restore of an incremental step
against that of a full one (files in the page cache), paired by round.

    python bench/bench_incremental.py [--size 1G] [--rounds 5] [--store s3] [--quick] [--markdown]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _common  # noqa: F401  (sets the jax environment first)
import bench_train_state as bts
import numpy as np
from _common import REPO, RESULTS, SCRATCH, machine_facts, now, parse_size, spread

CASES = ("lora", "frozen", "all")
X, D = "\u00d7", "\u2013"  # for the tables
SYSTEMS = (
    "cairn",
    "cairn-incremental",
    "orbax",
    "cairn-packed",
    "cairn-packed-incremental",
    "cairn-zarr",
    "cairn-zarr-incremental",
)
DEFAULT_SYSTEMS = "cairn,cairn-incremental,orbax"


class Cairn(bts.CairnRunner):
    def __init__(self, directory: Path | str, abstract: Any, *, name: str) -> None:
        from cairn.handlers import TrainStateHandler
        from cairn.manager import CheckpointManager, KeepLatest

        self.name = name
        self.abstract = abstract
        layout = next((x for x in ("packed", "zarr") if x in name), None)
        handlers = {"state": TrainStateHandler(layout=layout)} if layout else None
        self.mgr = CheckpointManager(
            directory,
            keep=KeepLatest(1),
            incremental=name.endswith("incremental"),
            handlers=handlers,
        )
        self.remote = isinstance(directory, str)

    def wait_reclaimed(self, timeout: float = 120.0) -> None:
        if not self.remote:  # a bucket's deletion is done when the commit thread is
            super().wait_reclaimed(timeout)

    def written(self, step: int) -> float:
        tm = self.mgr.info(step).telemetry
        return float(tm.get("bytes_written", tm["bytes"]))


class Orbax(bts.OrbaxRunner):
    def __init__(self, directory: Path, abstract: Any) -> None:
        super().__init__(directory, abstract)
        self.root = directory

    def written(self, step: int) -> float:
        return float(
            sum(p.stat().st_size for p in (self.root / str(step)).rglob("*") if p.is_file())
        )


def warm(directory: Path) -> None:
    """Every file under `directory` read once: into the page cache."""
    for path in Path(directory).rglob("*"):
        if path.is_file() and not path.is_symlink():
            with open(path, "rb") as f:
                while f.read(8 << 20):
                    pass


def changing_paths(state: Any, share: float) -> list[tuple[str, ...]]:
    """Key paths under params (smallest leaves first) whose bytes reach `share` of the params'."""
    params = sorted(
        ((k, v.nbytes) for k, v in _leaves(state["params"])), key=lambda kv: (kv[1], kv[0])
    )
    total = sum(n for _, n in params)
    out, acc = [], 0
    for key, n in params:
        if acc >= share * total:
            break
        out.append(key)
        acc += n
    return out


def _leaves(tree: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    if isinstance(tree, dict):
        return [kv for k, v in tree.items() for kv in _leaves(v, (*path, k))]
    return [(path, tree)]


def _get(tree: Any, path: tuple[str, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def _set(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    if len(path) == 1:
        return {**tree, path[0]: value}
    return {**tree, path[0]: _set(tree[path[0]], path[1:], value)}


def advance(state: Any, case: str, lora: list[tuple[str, ...]], k: int) -> Any:
    """The state of the next save in `case` (k counts saves, so every change is new)."""
    import jax

    if case == "frozen":
        return state
    if case == "all":
        return jax.block_until_ready(jax.tree.map(lambda x: x + np.asarray(1, x.dtype), state))
    for part in (("params",), ("opt_state", "mu"), ("opt_state", "nu")):
        for path in lora:
            full = (*part, *path)
            state = _set(state, full, _get(state, full) + np.float32(1e-3 * k))
    return jax.block_until_ready(state)


@contextlib.contextmanager
def s3_bucket() -> Iterator[str]:
    """A bucket of a moto S3 server process on 127.0.0.1 (bench_objectstore's), for the
    duration, with the environment pointing cairn at it; its URL."""
    import bench_objectstore as bo  # its moto server, and tests/support/s3util's credentials

    SCRATCH.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=SCRATCH) as workdir:
        server, endpoint = bo.start_moto(Path(workdir))
        try:
            os.environ.update(bo.s3util.CREDENTIALS, AWS_ENDPOINT_URL=endpoint)
            yield f"s3://{bo.make_bucket('s3', endpoint)}"
        finally:
            bo.stop(server)


def run(
    label: str, rounds: int, log: Any, bucket: str | None = None, systems: Any = None
) -> dict[str, Any]:
    import jax

    state = bts.build_state(label)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    lora = changing_paths(state, 0.02)
    lora_bytes = 3 * sum(_get(state["params"], p).nbytes for p in lora)
    log(f"[{label}] {nbytes >> 20} MiB; lora case changes {len(lora)} params leaves (x3)")
    scratch = SCRATCH / "incremental"
    shutil.rmtree(scratch, ignore_errors=True)
    systems = list(systems or DEFAULT_SYSTEMS.split(","))
    if bucket is not None:
        systems = [s for s in systems if s != "orbax"]

    def place(name: str) -> Path | str:
        return scratch / name if bucket is None else f"{bucket}/{name}"

    runners: dict[str, Any] = {
        name: Orbax(scratch / name, abstract)
        if name == "orbax"
        else Cairn(place(name), abstract, name=name)
        for name in systems
    }
    samples: dict[str, list[float]] = {}

    def note(key: str, value: float) -> None:
        samples.setdefault(key, []).append(value)

    step = 0
    for rnd in range(rounds + 1):  # round 0 warms up (the staging pool, jit, the page cache)
        for case in CASES:
            state = advance(state, case, lora, step)
            order = systems[rnd % len(systems) :] + systems[: rnd % len(systems)]
            for name in order:
                runner = runners[name]
                bts.clean_memory()
                t0 = now()
                runner.save(step, state)
                runner.wait()
                elapsed = now() - t0
                runner.wait_reclaimed()
                if rnd:
                    note(f"{case}.{name}.commit_s", elapsed)
                    note(f"{case}.{name}.written", runner.written(step))
            step += 1
        if rnd:  # restore the lora step just saved: incremental against full
            pair = [n for n in systems if n.startswith("cairn")]
            for name in pair if rnd % 2 else pair[::-1]:  # the order alternates
                runner = runners[name]
                if bucket is None:
                    warm(runner.mgr.directory)
                bts.clean_memory()
                t0 = now()
                jax.block_until_ready(runner.restore(step - 1))
                note(f"restore.{name}", now() - t0)
        log(f"[{label}] round {rnd}/{rounds}")
    for runner in runners.values():
        runner.close()
    shutil.rmtree(scratch, ignore_errors=True)

    def ratio(num: str, den: str) -> dict[str, Any]:
        return spread([a / b for a, b in zip(samples[num], samples[den], strict=True)], 4)

    paired: dict[str, Any] = {}
    for case in CASES:
        for name in systems[1:]:
            paired[f"{case}.{name}.commit_vs_full"] = ratio(
                f"{case}.{name}.commit_s", f"{case}.cairn.commit_s"
            )
            paired[f"{case}.{name}.written_vs_full"] = ratio(
                f"{case}.{name}.written", f"{case}.cairn.written"
            )
        if {"cairn-packed", "cairn-packed-incremental"} <= set(systems):
            paired[f"{case}.cairn-packed-incremental.commit_vs_packed"] = ratio(
                f"{case}.cairn-packed-incremental.commit_s", f"{case}.cairn-packed.commit_s"
            )
    for name in ("cairn-incremental", "cairn-packed", "cairn-packed-incremental"):
        if name in systems:
            paired[f"restore.{name}_vs_full_throughput"] = ratio("restore.cairn", f"restore.{name}")
    if "cairn-incremental" in systems:  # the name the targets and older results use
        paired["restore.incremental_vs_full_throughput"] = paired[
            "restore.cairn-incremental_vs_full_throughput"
        ]
    return {
        "store": "local disk" if bucket is None else "S3 (moto on 127.0.0.1)",
        "systems": list(systems),
        "bytes": nbytes,
        "lora_leaves": len(lora),
        "lora_bytes": lora_bytes,
        "samples": {k: spread(v, 6) for k, v in samples.items()},
        "paired": paired,
    }


TARGETS = [
    ("lora.cairn-incremental.commit_vs_full", "lora: commit time ÷ a full save's", 0.1, True),
    ("lora.cairn-incremental.written_vs_full", "lora: bytes written ÷ a full save's", 0.05, True),
    ("frozen.cairn-incremental.commit_vs_full", "nothing changes: commit ÷ full", 0.05, True),
    ("all.cairn-incremental.commit_vs_full", "everything changes: commit ÷ full", 1.05, True),
    ("restore.incremental_vs_full_throughput", "restore throughput ÷ a full step's", 0.95, False),
]


def markdown(result: dict[str, Any]) -> str:
    e = result["entry"]
    lines = [
        f"**{result['size']}**, {e.get('store', 'local disk')} ({e['bytes'] >> 20} MiB; the lora case changes "
        f"{e['lora_leaves']} params leaves and their mu and nu, {e['lora_bytes'] / e['bytes']:.1%} "
        f"of the state), median (min{D}max):",
        "",
        "| case | system | save → committed (ms) | written (MiB) | commit ÷ cairn full | written ÷ full |",
        "|---|---|---:|---:|---:|---:|",
    ]
    s, p = e["samples"], e["paired"]
    for case in CASES:
        for name in e.get("systems", SYSTEMS):
            c, w = s[f"{case}.{name}.commit_s"], s[f"{case}.{name}.written"]
            rc = p.get(f"{case}.{name}.commit_vs_full")
            rw = p.get(f"{case}.{name}.written_vs_full")
            lines.append(
                f"| {case} | {name} | {c['median'] * 1e3:.0f} ({c['min'] * 1e3:.0f}{D}"
                f"{c['max'] * 1e3:.0f}) | {w['median'] / 2**20:.1f} | "
                + (f"{rc['median']:.3f}{X} ({rc['min']:.3f}{D}{rc['max']:.3f})" if rc else "1")
                + " | "
                + (f"{rw['median']:.3f}{X}" if rw else "1")
                + " |"
            )
    restores = [n for n in e.get("systems", SYSTEMS) if f"restore.{n}" in s]
    lines += [
        "",
        "Restore of the newest lora step: "
        + ", ".join(f"{n} {s[f'restore.{n}']['median'] * 1e3:.0f} ms" for n in restores)
        + ".",
        "",
        "| target | system | goal | measured | met |",
        "|---|---|---|---|---|",
    ]
    for system in ("cairn-incremental", "cairn-packed-incremental"):
        for key, what, goal, le in TARGETS:
            key = key.replace("cairn-incremental", system)
            if key == "restore.incremental_vs_full_throughput":
                key = f"restore.{system}_vs_full_throughput"
            m = p.get(key)
            if m is None:
                continue
            met = m["median"] <= goal if le else m["median"] >= goal
            lines.append(
                f"| {what} | {system} | {'≤' if le else '≥'} {goal} | {m['median']:.3f}{X} "
                f"({m['min']:.3f}{D}{m['max']:.3f}) | {'yes' if met else '**no**'} |"
            )
    for case in CASES:
        m = p.get(f"{case}.cairn-packed-incremental.commit_vs_packed")
        if m is not None:
            lines.append(
                f"| {case}: commit ÷ a full packed save's | cairn-packed-incremental | | "
                f"{m['median']:.3f}{X} ({m['min']:.3f}{D}{m['max']:.3f}) | |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1G")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--store", choices=("disk", "s3"), default="disk")
    parser.add_argument("--quick", action="store_true", help="smoke run: 16M, 2 rounds")
    parser.add_argument(
        "--systems",
        default=DEFAULT_SYSTEMS,
        help=f"comma-separated, of {', '.join(SYSTEMS)}; the first is cairn (default "
        f"{DEFAULT_SYSTEMS})",
    )
    parser.add_argument("--label", default="", help="names the result file: incremental-LABEL")
    parser.add_argument("--markdown", action="store_true", help="print the JSON as Markdown")
    args = parser.parse_args(argv)
    path = RESULTS / (
        ("incremental-quick" if args.quick else "incremental")
        + (f"-{args.label}" if args.label else "")
        + ("-s3" if args.store == "s3" else "")
        + ".json"
    )
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if systems[:1] != ["cairn"] or set(systems) - set(SYSTEMS):
        parser.error(f"--systems: cairn first, then any of {list(SYSTEMS)}")
    if args.markdown:
        print(markdown(json.loads(path.read_text())))
        return 0
    if args.quick:
        args.size, args.rounds = "16M", 2
    parse_size(args.size)
    t0 = now()

    def log(msg: str) -> None:
        print(f"{now() - t0:7.1f}s  {msg}", file=sys.stderr, flush=True)

    if args.store == "s3":
        with s3_bucket() as bucket:
            entry = run(args.size, args.rounds, log, bucket, systems)
    else:
        entry = run(args.size, args.rounds, log, systems=systems)
    result = {
        "benchmark": "bench/bench_incremental.py",
        "git": subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "size": args.size,
        "rounds": args.rounds,
        "machine": machine_facts(),
        "entry": entry,
        "wall_s": round(now() - t0, 1),
    }
    path.write_text(json.dumps(result) + "\n")
    print(markdown(result))
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    os.chdir(REPO)
    sys.exit(main())
