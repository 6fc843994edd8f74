"""Local disk against S3 (a moto server on 127.0.0.1), save and restore, in the same run.

    python bench/bench_s3.py [--size 64M] [--repeats 5] [--out bench/results/s3.json]

For each repeat: a synchronous save (commit included) and a restore of the same train state
(float32 leaves of ~8 MiB) to a local directory and to an s3:// directory, alternating, and a
plain upload of the same bytes with TensorStore's kvstore (the S3 "machine limit" here: what the
server accepts at best). Reports medians, ranges and the S3/local ratios. moto is a Python server
on the same 2 cores, so the absolute S3 figures say more about moto than about S3; the ratio to
the plain upload says what cairn adds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import _common  # noqa: F401  (sets the environment first)
import numpy as np
from _common import (
    RESULTS,
    MiB,
    check_equal,
    fmt_range,
    machine_facts,
    parse_size,
    spread,
    summarize,
)

from cairn.manager import CheckpointManager
from cairn.manager._objectstore import ObjectStore, StorageOptions


def make_state(nbytes: int) -> dict[str, Any]:
    leaf = 8 * MiB // 4
    n = max(1, nbytes // (leaf * 4))
    rng = np.random.default_rng(0)
    return {f"layer_{i}": rng.standard_normal(leaf, dtype=np.float32) for i in range(n)}


def start_moto() -> tuple[subprocess.Popen[str], str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    ready = threading.Event()

    def drain() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "Running on" in line:
                ready.set()

    threading.Thread(target=drain, daemon=True).start()
    if not ready.wait(60):
        raise RuntimeError("moto did not start")
    return proc, f"http://127.0.0.1:{port}"


def timed_save_restore(directory: str, state: dict[str, Any], step: int) -> tuple[float, float]:
    with CheckpointManager(directory, async_save=False) as mgr:
        t0 = time.perf_counter()
        mgr.save(step, {"state": state})
        save_s = time.perf_counter() - t0
    with CheckpointManager(directory, read_only=True) as reader:
        t0 = time.perf_counter()
        got = reader.restore(step)["state"]
        restore_s = time.perf_counter() - t0
    check_equal(state, got, directory)
    return save_s, restore_s


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="64M")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "s3.json")
    args = parser.parse_args()
    nbytes = parse_size(args.size)
    state = make_state(nbytes)
    nbytes = sum(v.nbytes for v in state.values())
    server, endpoint = start_moto()
    import os

    os.environ.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=endpoint,
    )
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{bucket}", method="PUT")).close()
    local_root = Path(tempfile.mkdtemp(prefix="cairn-bench-s3-", dir=RESULTS))
    times: dict[str, list[float]] = {
        k: [] for k in ("local_save", "local_restore", "s3_save", "s3_restore", "s3_upload")
    }
    try:
        for r in range(args.repeats):
            for kind in ("local", "s3") if r % 2 == 0 else ("s3", "local"):
                directory = str(local_root / f"r{r}") if kind == "local" else f"s3://{bucket}/r{r}"
                save_s, restore_s = timed_save_restore(directory, state, r)
                times[f"{kind}_save"].append(save_s)
                times[f"{kind}_restore"].append(restore_s)
            store = ObjectStore(f"s3://{bucket}/plain{r}", StorageOptions())
            t0 = time.perf_counter()
            futures = [store._kv.write(k, v.tobytes()) for k, v in state.items()]
            for f in futures:
                f.result()
            times["s3_upload"].append(time.perf_counter() - t0)
    finally:
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(local_root, ignore_errors=True)
    summary = {k: summarize(v, nbytes) for k, v in times.items()}
    ratios = {
        "s3_save_over_local_save": spread(
            [x / y for x, y in zip(times["s3_save"], times["local_save"], strict=True)]
        ),
        "s3_restore_over_local_restore": spread(
            [x / y for x, y in zip(times["s3_restore"], times["local_restore"], strict=True)]
        ),
        "s3_save_over_plain_upload": spread(
            [x / y for x, y in zip(times["s3_save"], times["s3_upload"], strict=True)]
        ),
    }
    result = {
        "bytes": nbytes,
        "repeats": args.repeats,
        "machine": machine_facts(),
        "timings": summary,
        "ratios": ratios,
    }
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{nbytes / MiB:.0f} MiB, {args.repeats} repeats (median, min-max)")
    for key in times:
        print(
            f"  {key:14s} {fmt_range(summary[key]['median_s'], summary[key]['min_s'], summary[key]['max_s'])}"
        )
    for key, value in ratios.items():
        print(f"  {key:32s} {value['median']:.2f} ({value['min']:.2f}-{value['max']:.2f})")


if __name__ == "__main__":
    main()
