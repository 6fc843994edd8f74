"""Multi-host saves on object stores: requests per process, aggregate throughput, commit latency.

    .venv/bin/python bench/bench_multihost.py            # the full run (about 3 minutes here)
    .venv/bin/python bench/bench_multihost.py --quick    # a smoke run: 64 MiB, 2 rounds (*.tmp)
    .venv/bin/python bench/bench_multihost.py --stores s3 --rounds 7 --size 512MiB
    .venv/bin/python bench/plot_multihost.py             # redraw the plot from the JSON

The script starts moto's S3 server and fake-gcs-server on 127.0.0.1 (`start_moto`, `start_gcs`
of bench_objectstore.py: objects in memory, on the same cores as everything else), makes a
bucket per measurement, and launches N real `jax.distributed` processes on 127.0.0.1, as
tests/multihost/launcher.py does (XLA_FLAGS=--xla_force_host_platform_device_count=2: two CPU
devices per process; `jax.distributed.initialize(coordinator_address="127.0.0.1:<port>",
num_processes=N, process_id=i)`), with the store's environment (AWS_ENDPOINT_URL and the test
credentials of tests/support/s3util.py; TENSORSTORE_GCS_HTTP_URL and GOOGLE_AUTH_TOKEN_FOR_TESTING of
tests/support/gcsutil.py). Three measurements:

1. **Requests per process per save, N = 1, 2, 4** (S3 and GCS): the test worker
   ``tests/multihost/mh_worker.py count`` (each process sends its requests through its own
   counting proxy, tests/support/countproxy.py; 5 saves of 3 small arrays over an (N, 2) mesh with
   ``KeepLatest(2)``; per save the requests by kind and the files that process wrote). Tabulated
   per N and role for save 1 (no retention) and save 3 (retention deletes step 1): files
   written, requests, and "fixed" = requests - own files, by kind; on a retention save also
   net of the deletes of the old step's files (one DELETE per file of that step, whoever wrote
   it), which is what must not grow with N.
2. **Aggregate save throughput, N = 2** (goal on S3: >= 0.8x plain objects; GCS reported): a
   state of `--size` bytes as float32 jax.Arrays of 4096 x 1024 (16 MiB each) over a (2, 2)
   mesh, PartitionSpec("data", "model"), made with ``jax.make_array_from_callback``; each round
   a cairn save and a plain-objects PUT of the same objects, the order alternating
   (bench/mh_bench_worker.py has the details). Aggregate time = max(t1) - min(t0) over the
   processes, from barrier to barrier; the ratio per round is plain time / cairn time.
3. **Commit latency, N = 2** (goal: <= 2 barrier rounds + one manifest write), in the cairn
   rounds of (2): from the end of the last PUT of any process (`Destination.write_file`
   returned) to the end of the primary's `_KvPrepared.commit`; in the same run a barrier round
   (median of `--samples` `Processes.barrier` calls, all processes, as the primary sees them)
   and a manifest-sized conditional write (median of `--samples` ``ObjectStore.write(key, data,
   if_generation=<current>)``), and the commit's phases from the primary's events.

Results: bench/results/multihost.json (the workers' raw times and events, the request reports,
and the summaries); plot: docs/benchmarks_multihost.png (bench/plot_multihost.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

# _common sets the environment first (CPU only, quiet); import it before cairn.
from _common import (
    REPO,
    RESULTS,
    GiB,
    MiB,
    load_average,
    machine_facts,
    now,
    parse_size,
    spread,
)
from bench_objectstore import cairn_source, make_bucket, start_gcs, start_moto, stop

sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "multihost"))
import launcher  # tests/multihost/: N jax.distributed processes of mh_worker.py
from support import (
    gcsutil,  # tests/: the fake-gcs-server token
    s3util,  # tests/: credentials, free ports
)

HERE = Path(__file__).resolve().parent
WORKER = HERE / "mh_bench_worker.py"
DEFAULT_JSON = RESULTS / "multihost.json"
QUICK_JSON = RESULTS / "multihost-quick.json.tmp"  # --quick: ignored by git (*.tmp)
STORES = ("s3", "gs")
LABEL = {"s3": "S3 (moto)", "gs": "GCS (fake-gcs-server)"}
LEAF_SHAPE = (4096, 1024)  # float32: 16 MiB a leaf
SAVES = {1: "save 1 (no retention)", 3: "save 3 (retention deletes step 1)"}
GOALS = {
    "s3_throughput": ("S3: aggregate save throughput, cairn ÷ plain objects (median)", ">=", 0.8),
    "s3_latency": ("S3: last upload -> commit, ÷ (2 barrier rounds + 1 manifest write)", "<=", 1.0),
    "gs_latency": (
        "GCS: last upload -> commit, ÷ (2 barrier rounds + 1 manifest write)",
        "<=",
        1.0,
    ),
}


def median(values: list[float]) -> float:
    return float(statistics.median(values))


# ----------------------------------------------------------------------------- 1. requests


def store_env(store: str, endpoint: str) -> dict[str, str]:
    if store == "s3":
        return {**s3util.CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}
    return {"TENSORSTORE_GCS_HTTP_URL": endpoint, "GOOGLE_AUTH_TOKEN_FOR_TESTING": gcsutil.TOKEN}


def run_counts(store: str, endpoint: str, count: int) -> list[dict[str, Any]]:
    """tests/multihost/mh_worker.py count on `count` processes; each process's report."""
    directory = f"{store}://{make_bucket(store, endpoint)}/run"
    env = store_env(store, endpoint)
    results = launcher.launch("count", directory, count=count, timeout=600, env=env)
    reports = []
    for i, r in enumerate(results):
        if r.returncode != 0:
            raise RuntimeError(f"{store} N={count} process {i} failed:\n{r.stderr[-3000:]}")
        line = next(x for x in r.stdout.splitlines() if x.startswith("requests "))
        reports.append(json.loads(line.split(" ", 1)[1]))
    return reports


def count_rows(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per process and save of SAVES: files, requests, fixed (requests - own files), the
    deletes of this process's share of the retired step's files, and fixed net of those; the
    kinds, with "PUT other" net of the files."""
    rows = []
    count = len(reports)
    for report in reports:
        for k in SAVES:
            save = report["saves"][k]
            files, kinds = save["files"], dict(save["requests"])
            total = sum(kinds.values())
            # Retention at save k deletes step k - 2; each process deletes every count-th of
            # its files, from its own index (the manager's share).
            step_files = sum(r["saves"][k - 2]["files"] for r in reports) if k >= 2 else 0
            deleted = len(range(report["process"], step_files, count))
            fixed_kinds = dict(kinds)
            fixed_kinds["PUT other"] = fixed_kinds.get("PUT other", 0) - files
            if deleted:
                fixed_kinds["DELETE other"] = fixed_kinds.get("DELETE other", 0) - deleted
            rows.append(
                {
                    "process": report["process"],
                    "role": "primary" if report["process"] == 0 else f"process {report['process']}",
                    "save": k,
                    "files": files,
                    "requests": total,
                    "fixed": total - files,
                    "deleted_step_files": deleted,
                    "fixed_net": total - files - deleted,
                    "fixed_kinds": {n: v for n, v in sorted(fixed_kinds.items()) if v},
                }
            )
    return rows


# ----------------------------------------------------------------------------- 2 and 3


def run_workers(
    store: str, endpoint: str, args: argparse.Namespace, workdir: Path
) -> list[dict[str, Any]]:
    """bench/mh_bench_worker.py on `args.processes` processes; each process's result."""
    count = args.processes
    leaves = max(1, args.size // (LEAF_SHAPE[0] * LEAF_SHAPE[1] * 4))
    spec = {
        "store": store,
        "bucket": make_bucket(store, endpoint),
        "prefix": f"bench-{uuid.uuid4().hex[:8]}",
        "leaves": leaves,
        "rows": LEAF_SHAPE[0],
        "cols": LEAF_SHAPE[1],
        "rounds": args.rounds,
        "warmup": args.warmup,
        "samples": args.samples,
    }
    spec_path = workdir / f"spec-{store}.json"
    spec_path.write_text(json.dumps(spec))
    port = str(s3util.free_port())
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        **store_env(store, endpoint),
    }
    outs = [workdir / f"out-{store}-{i}.json" for i in range(count)]
    errs = [workdir / f"err-{store}-{i}.txt" for i in range(count)]
    procs = []
    for i in range(count):
        with errs[i].open("wb") as err:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(WORKER),
                        str(spec_path),
                        str(i),
                        str(count),
                        port,
                        str(outs[i]),
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=None if i == 0 else subprocess.DEVNULL,  # the primary's progress
                    stderr=err,
                    env=env,
                    cwd=REPO,
                )
            )
    failed = []
    try:
        for i, proc in enumerate(procs):
            if proc.wait(timeout=args.worker_timeout) != 0:
                failed.append(i)
    except subprocess.TimeoutExpired:
        failed = list(range(count))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if failed:
        tails = "\n".join(f"--- process {i}:\n{errs[i].read_text()[-3000:]}" for i in failed)
        raise RuntimeError(f"{store}: workers {failed} failed\n{tails}")
    return [json.loads(p.read_text()) for p in outs]


def events_of(rnd: dict[str, Any], kind: str, name: str | None = None) -> list[list[Any]]:
    return [e for e in rnd["events"] if e[0] == kind and (name is None or name in e[1])]


def analyse_round(per_process: list[dict[str, Any]], state_bytes: int) -> dict[str, Any]:
    """One round's aggregates from every process's times and events (epoch seconds)."""
    cairn = [p["cairn"] for p in per_process]
    plain = [p["plain"] for p in per_process]
    cairn_s = max(c["t1"] for c in cairn) - min(c["t0"] for c in cairn)
    plain_s = max(c["t1"] for c in plain) - min(c["t0"] for c in plain)
    uploads = [events_of(c, "upload") for c in cairn]
    first_upload = min(e[2] for ev in uploads for e in ev)
    last_upload = max(e[3] for ev in uploads for e in ev)
    primary = cairn[0]
    commit = events_of(primary, "commit")
    if len(commit) != 1:
        raise RuntimeError(f"expected one commit on the primary, found {commit}")
    commit_start, commit_end = commit[0][2], commit[0][3]
    written = [e for e in events_of(primary, "barrier") if e[1].endswith("/written")]
    reports = events_of(primary, "reports")
    manifest = events_of(primary, "manifest_write", "manifest")
    checks = [e for e in events_of(primary, "lease_check") if e[2] >= commit_start]
    refresh = events_of(primary, "lease_refresh")
    t0 = min(c["t0"] for c in cairn)

    def rel(t: float) -> float:  # seconds after the last upload ended
        return t - last_upload

    phases = {
        # min(t0) -> the first PUT starts: the snapshot, the hand-off to the commit thread, the
        # primary's lease check and claim, the barrier "created"
        "before_uploads_s": first_upload - t0,
        "uploads_s": last_upload - first_upload,  # first PUT start -> last PUT end, any process
        "commit_latency_s": commit_end - last_upload,
        # commit end -> the last wait_until_finished returns: the outcome broadcast, the others'
        # reading of the new step (manifest, metrics), the barrier after it
        "after_commit_s": max(c["t1"] for c in cairn) - commit_end,
    }
    breakdown = {
        "barrier_written_end": rel(written[0][3]) if written else None,
        "reports_end": rel(reports[0][3]) if reports else None,
        "lease_check_end": rel(checks[0][3]) if checks else None,
        "manifest_write_start": rel(manifest[0][2]) if manifest else None,
        "manifest_write_end": rel(manifest[0][3]) if manifest else None,
        "lease_refresh_end": rel(refresh[0][3]) if refresh else None,
        "commit_end": rel(commit_end),
        "last_upload_process": max(
            range(len(uploads)), key=lambda i: max(e[3] for e in uploads[i])
        ),
    }
    durations = {
        "manifest_write_s": manifest[0][3] - manifest[0][2] if manifest else None,
        "lease_check_s": checks[0][3] - checks[0][2] if checks else None,
        "lease_refresh_s": refresh[0][3] - refresh[0][2] if refresh else None,
    }
    return {
        "order": per_process[0]["order"],
        "cairn_s": cairn_s,
        "plain_s": plain_s,
        "ratio": plain_s / cairn_s,
        "cairn_gib_s": state_bytes / GiB / cairn_s,
        "plain_gib_s": state_bytes / GiB / plain_s,
        "phases": phases,
        "after_last_upload": breakdown,
        "durations": durations,
        "per_process": [
            {
                "cairn_s": c["t1"] - c["t0"],
                "plain_s": p["t1"] - p["t0"],
                "upload_span_s": max(e[3] for e in ev) - min(e[2] for e in ev),
                "files": len(ev),
            }
            for c, p, ev in zip(cairn, plain, uploads, strict=True)
        ],
    }


def analyse_store(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-round aggregates and the summary (medians, ranges) of one store's worker results."""
    state_bytes = sum(r["state_bytes_here"] for r in results)
    rounds = [
        analyse_round([r["rounds"][i] for r in results], state_bytes)
        for i in range(len(results[0]["rounds"]))
    ]
    primary = results[0]
    samples = primary["samples"]
    barrier = median(samples["barrier_s"])
    write = median(samples["conditional_write_s"])
    small_get = median(samples["small_get_s"])
    latency = [r["phases"]["commit_latency_s"] for r in rounds]
    point = [r["after_last_upload"]["manifest_write_end"] for r in rounds]
    budget = 2 * barrier + write
    summary = {
        "state_bytes": state_bytes,
        "objects": primary["planned_total"]["objects"],
        "object_bytes": primary["planned_total"]["bytes"],
        "objects_per_process": [r["objects"] for r in results],
        "writer_threads": primary["threads"],
        "cairn_s": spread([r["cairn_s"] for r in rounds], 4),
        "plain_s": spread([r["plain_s"] for r in rounds], 4),
        "cairn_gib_s": spread([r["cairn_gib_s"] for r in rounds], 4),
        "plain_gib_s": spread([r["plain_gib_s"] for r in rounds], 4),
        "ratio": spread([r["ratio"] for r in rounds], 3),
        "phases": {k: spread([r["phases"][k] for r in rounds], 4) for k in rounds[0]["phases"]},
        "after_last_upload": {
            k: spread([r["after_last_upload"][k] for r in rounds], 4)
            for k in rounds[0]["after_last_upload"]
            if all(r["after_last_upload"][k] is not None for r in rounds)
        },
        "durations": {
            k: spread([r["durations"][k] for r in rounds], 4)
            for k in rounds[0]["durations"]
            if all(r["durations"][k] is not None for r in rounds)
        },
        "barrier_round_s": spread(samples["barrier_s"], 5),
        "barrier_round_all_processes_median_s": [
            round(median(r["samples"]["barrier_s"]), 5) for r in results
        ],
        "conditional_write_s": spread(samples["conditional_write_s"], 5),
        "small_get_s": spread(samples["small_get_s"], 5),
        "manifest_bytes": samples["manifest_bytes"],
        "latency_s": spread(latency, 4),
        "latency_in_barrier_rounds": round(median(latency) / barrier, 2),
        "latency_in_manifest_writes": round(median(latency) / write, 2),
        "latency_in_small_gets": round(median(latency) / small_get, 2),
        "budget_s": round(budget, 5),
        "latency_vs_budget": spread([x / budget for x in latency], 3),
        # the step is visible once the manifest replaced the claim; the lease's refresh follows
        "commit_point_latency_s": spread(point, 4),
        "commit_point_vs_budget": spread([x / budget for x in point], 3),
    }
    return {"rounds": rounds, "summary": summary}


# ----------------------------------------------------------------------------- output


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 0.1 else f"{seconds * 1e3:.0f} ms"


def fmt_spread(s: dict[str, Any], unit: str = "s") -> str:
    if unit == "ms":
        return f"{fmt_ms(s['median'])} ({s['min'] * 1e3:.1f}-{s['max'] * 1e3:.1f})"
    if unit == "x":
        return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"
    return f"{s['median']:.2f} s ({s['min']:.2f}-{s['max']:.2f})"


def kinds_text(kinds: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in kinds.items())


def print_tables(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(140, Console().width))
    for store, by_n in result["counts"].items():
        table = Table(
            title=f"1. requests per process per save, {LABEL[store]} (mh_worker.py count)",
            title_justify="left",
        )
        for col in (
            "N",
            "save",
            "role",
            "files",
            "requests",
            "fixed",
            "old step's files",
            "fixed net",
            "fixed, by kind",
        ):
            table.add_column(
                col, justify="left" if col in ("save", "role", "fixed, by kind") else "right"
            )
        for n, entry in by_n.items():
            for k in SAVES:
                rows = [r for r in entry["rows"] if r["save"] == k]
                for j, row in enumerate(rows):
                    table.add_row(
                        str(n) if j == 0 else "",
                        SAVES[k] if j == 0 else "",
                        row["role"],
                        str(row["files"]),
                        str(row["requests"]),
                        str(row["fixed"]),
                        str(row["deleted_step_files"] or ""),
                        str(row["fixed_net"]),
                        kinds_text(row["fixed_kinds"]),
                        end_section=j == len(rows) - 1 and k == max(SAVES),
                    )
        console.print(table)
    for store, entry in result["throughput"].items():
        s = entry["summary"]
        table = Table(
            title=f"2. aggregate save throughput, {LABEL[store]}, N={result['processes']}: "
            f"{s['state_bytes'] / MiB:.0f} MiB, {s['objects']} objects "
            f"({'+'.join(map(str, s['objects_per_process']))} per process), "
            f"{s['writer_threads']} writer threads a process",
            title_justify="left",
        )
        table.add_column("round")
        for col in (
            "order",
            "cairn",
            "GiB/s",
            "plain objects",
            "GiB/s",
            "plain ÷ cairn",
            "before PUTs",
            "PUTs",
            "last PUT -> commit",
            "commit -> done",
        ):
            table.add_column(col, justify="right")
        for i, r in enumerate(entry["rounds"]):
            ph = r["phases"]
            table.add_row(
                str(i + 1),
                "/".join(r["order"]),
                f"{r['cairn_s']:.2f} s",
                f"{r['cairn_gib_s']:.3f}",
                f"{r['plain_s']:.2f} s",
                f"{r['plain_gib_s']:.3f}",
                f"{r['ratio']:.2f}",
                fmt_ms(ph["before_uploads_s"]),
                f"{ph['uploads_s']:.2f} s",
                fmt_ms(ph["commit_latency_s"]),
                fmt_ms(ph["after_commit_s"]),
            )
        ps = s["phases"]
        table.add_row(
            "median (min-max)",
            "",
            fmt_spread(s["cairn_s"]),
            f"{s['cairn_gib_s']['median']:.3f}",
            fmt_spread(s["plain_s"]),
            f"{s['plain_gib_s']['median']:.3f}",
            fmt_spread(s["ratio"], "x"),
            fmt_spread(ps["before_uploads_s"], "ms"),
            fmt_spread(ps["uploads_s"]),
            fmt_spread(ps["commit_latency_s"], "ms"),
            fmt_spread(ps["after_commit_s"], "ms"),
            style="bold",
        )
        console.print(table)
    table = Table(
        title=f"3. last upload (any process) -> commit, N={result['processes']} "
        "(median (min-max) over the rounds; samples: median of "
        f"{result['samples']})",
        title_justify="left",
    )
    table.add_column("")
    for store in result["throughput"]:
        table.add_column(LABEL[store], justify="right")
    stores = list(result["throughput"].values())
    sums = [e["summary"] for e in stores]
    lines: list[tuple[str, list[str]]] = [
        ("latency: last PUT end -> commit end", [fmt_spread(s["latency_s"], "ms") for s in sums]),
        (
            "a barrier round (primary's view)",
            [fmt_spread(s["barrier_round_s"], "ms") for s in sums],
        ),
        (
            "a manifest-sized conditional write",
            [
                f"{fmt_spread(s['conditional_write_s'], 'ms')}, {s['manifest_bytes']} B"
                for s in sums
            ],
        ),
        (
            "a GET of a small object (the lease check)",
            [fmt_spread(s["small_get_s"], "ms") for s in sums],
        ),
        ("budget: 2 barrier rounds + 1 manifest write", [fmt_ms(s["budget_s"]) for s in sums]),
        ("latency ÷ budget", [fmt_spread(s["latency_vs_budget"], "x") for s in sums]),
        (
            "last PUT end -> the manifest written (the commit point)",
            [fmt_spread(s["commit_point_latency_s"], "ms") for s in sums],
        ),
        (
            "  ÷ budget",
            [fmt_spread(s["commit_point_vs_budget"], "x") for s in sums],
        ),
        ("latency in barrier rounds", [f"{s['latency_in_barrier_rounds']:.1f}" for s in sums]),
        ("latency in manifest writes", [f"{s['latency_in_manifest_writes']:.1f}" for s in sums]),
    ]
    marks = [
        ("barrier_written_end", "  barrier 'written' returns on the primary"),
        ("reports_end", "  the reports read (one request to the service)"),
        ("lease_check_end", "  the lease checked (a GET)"),
        ("manifest_write_start", "  the manifest's conditional write starts"),
        ("manifest_write_end", "  ... and ends"),
        ("lease_refresh_end", "  the lease refreshed (a conditional write): commit ends"),
    ]
    lines.append(("timeline on the primary, after the last PUT:", ["" for _ in sums]))
    for key, label in marks:
        lines.append(
            (
                label,
                [
                    fmt_spread(s["after_last_upload"][key], "ms")
                    if key in s["after_last_upload"]
                    else ""
                    for s in sums
                ],
            )
        )
    for label, cells in lines:
        table.add_row(label, *cells)
    console.print(table)
    goals = Table(title="goals", title_justify="left")
    for col in ("goal", "target", "value", "met"):
        goals.add_column(col)
    for key, g in result["goals"].items():
        label, op, target = GOALS[key]
        goals.add_row(label, f"{op} {target:g}", f"{g['value']:.2f}", "yes" if g["met"] else "NO")
    console.print(goals)


def goals_of(result: dict[str, Any]) -> dict[str, Any]:
    out = {}
    tp = result["throughput"]
    values = {
        "s3_throughput": tp["s3"]["summary"]["ratio"]["median"] if "s3" in tp else None,
        "s3_latency": tp["s3"]["summary"]["latency_vs_budget"]["median"] if "s3" in tp else None,
        "gs_latency": tp["gs"]["summary"]["latency_vs_budget"]["median"] if "gs" in tp else None,
    }
    for key, (_, op, target) in GOALS.items():
        value = values[key]
        if value is not None:
            out[key] = {"value": value, "met": value >= target if op == ">=" else value <= target}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB, 2 rounds, 5 samples")
    parser.add_argument("--size", default=None, help="the state's bytes (default 256MiB)")
    parser.add_argument("--rounds", type=int, default=None, help="default 5")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--samples", type=int, default=None, help="barrier/write samples (20)")
    parser.add_argument("--processes", type=int, default=2, help="N for (2) and (3)")
    parser.add_argument("--counts", default="1,2,4", help="N for (1), comma-separated")
    parser.add_argument("--stores", default="s3,gs")
    parser.add_argument("--worker-timeout", type=float, default=900.0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    args.size = parse_size(args.size or ("64MiB" if args.quick else "256MiB"))
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.samples = args.samples or (5 if args.quick else 20)
    args.out = args.out or (QUICK_JSON if args.quick else DEFAULT_JSON)
    stores = [s for s in args.stores.split(",") if s]
    if set(stores) - set(STORES):
        raise SystemExit(f"--stores: unknown {sorted(set(stores) - set(STORES))}")
    counts = [int(n) for n in args.counts.split(",") if n]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the servers are stopped

    workdir = Path(tempfile.mkdtemp(prefix="cairn-bench-multihost-"))
    started = now()
    servers: list[subprocess.Popen[Any]] = []
    result: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "quick": args.quick,
        "processes": args.processes,
        "size_bytes": args.size,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "samples": args.samples,
        "leaf_shape": list(LEAF_SHAPE),
        "counts": {},
        "throughput": {},
        "raw": {},
    }
    try:
        endpoints: dict[str, str] = {}
        for store in stores:
            proc, endpoints[store] = start_moto(workdir) if store == "s3" else start_gcs(workdir)
            servers.append(proc)
        for store in stores:
            result["counts"][store] = {}
            for n in counts:
                t0 = now()
                reports = run_counts(store, endpoints[store], n)
                result["counts"][store][str(n)] = {"reports": reports, "rows": count_rows(reports)}
                print(
                    f"[{now() - started:6.0f} s] {store} requests, N={n} [{now() - t0:.0f} s]",
                    flush=True,
                )
        for store in stores:
            t0 = now()
            raw = run_workers(store, endpoints[store], args, workdir)
            result["raw"][store] = raw
            result["throughput"][store] = analyse_store(raw)
            s = result["throughput"][store]["summary"]
            print(
                f"[{now() - started:6.0f} s] {store} throughput and latency [{now() - t0:.0f} s]: "
                f"plain ÷ cairn {s['ratio']['median']:.2f}, latency "
                f"{s['latency_s']['median'] * 1e3:.0f} ms",
                flush=True,
            )
    finally:
        for proc in servers:
            stop(proc)
        shutil.rmtree(workdir, ignore_errors=True)
    result["goals"] = goals_of(result)
    result["cairn_source"] = cairn_source()
    result["machine"] = machine_facts()
    result["load_average_end"] = load_average()
    result["wall_s"] = round(now() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print_tables(result)
    print(f"wrote {args.out}")
    if not args.no_plot:
        import plot_multihost

        print(plot_multihost.draw(result, quick=args.quick))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
