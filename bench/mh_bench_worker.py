"""One of N processes of bench_multihost.py's throughput and latency measurements.

    python bench/mh_bench_worker.py SPEC PROCESS_ID NUM_PROCESSES PORT OUT

A `jax.distributed` process on 127.0.0.1 (two CPU devices each, as tests/multihost/launcher.py
runs them), against the object store the environment points at (AWS_ENDPOINT_URL and the AWS
test credentials, or TENSORSTORE_GCS_HTTP_URL and GOOGLE_AUTH_TOKEN_FOR_TESTING). SPEC is a JSON
file written by the driver: the store and bucket, the prefix of this run, the state's shape (so
many float32 leaves of rows x cols over an (N, 2) mesh, PartitionSpec("data", "model")), the
number of rounds and of samples. OUT is where this process writes its JSON: per round its own
times (epoch seconds from `time.time()`, one clock for all processes of one machine) and the
events that the wrappers below noted, and at the end the barrier and write samples. The driver
computes every aggregate from those.

Per round, in an order that alternates (cairn first in even rounds):

* ``cairn``: a ``CheckpointManager(url, async_save=True)`` opened before timing; a barrier; t0;
  ``save(0, {"state": state})`` + ``wait_until_finished()``; t1. Then (not timed) the primary
  checks the step's manifest lists exactly the objects the plain variant PUTs, by key and size.
* ``plain``: the same objects this process's part of cairn's save wrote (its shards' chunk
  files with their crc32c tail; on the primary also each leaf's zarr.json and tree.json), their
  bytes made once before the first round, PUT with TensorStore's kvstore by a pool of as many
  threads as the TrainStateHandler's writer pool; a barrier; t0; the PUTs; t1.

Events (cairn rounds only; `Recorder`): every `Destination.write_file` (start and end of the
PUT of each file), and on the primary the phases of the commit: `_KvPrepared.commit`, the
lease's check and refresh, the manifest's conditional write, and the coordination calls
(`Processes.barrier`, `report`, `reports`, `broadcast`) of every process. Monkeypatching in this
process only, for measuring; cairn's code is unchanged.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np

TIMEOUT_S = 300.0


class Recorder:
    """Thread-safe list of (kind, name, start, end) events, noted while `on`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[tuple[str, str, float, float]] = []
        self.on = False

    def note(self, kind: str, name: str, start: float, end: float) -> None:
        if self.on:
            with self._lock:
                self._events.append((kind, name, start, end))

    def take(self) -> list[tuple[str, str, float, float]]:
        with self._lock:
            out, self._events = self._events, []
        return out


def install_wrappers(rec: Recorder) -> None:
    """Wrap the calls whose ends the latency measurement needs (see the module docstring)."""
    from cairn.handlers import Destination
    from cairn.manager._core.multihost import Processes
    from cairn.manager._format import MANIFEST
    from cairn.manager._storage.objectstore import _CLAIM_TAG, Lease, ObjectStore, _KvPrepared

    def timed(owner: Any, attr: str, kind: str, name_of: Callable[..., str | None]) -> None:
        original = getattr(owner, attr)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.time()
            try:
                return original(*args, **kwargs)
            finally:
                name = name_of(*args, **kwargs)
                if name is not None:
                    rec.note(kind, name, start, time.time())

        setattr(owner, attr, wrapper)

    timed(Destination, "write_file", "upload", lambda self, relpath, data: relpath)
    timed(_KvPrepared, "commit", "commit", lambda self, manifest: str(manifest.step))
    timed(Lease, "check", "lease_check", lambda self: "lease")
    timed(Lease, "refresh", "lease_refresh", lambda self: "lease")

    def manifest_write(self: Any, key: str, data: bytes, *, if_generation: Any = None) -> Any:
        if not key.endswith(MANIFEST) or not isinstance(data, bytes):
            return None
        return "claim" if data.startswith(_CLAIM_TAG) else "manifest"

    timed(ObjectStore, "write", "manifest_write", manifest_write)
    for method in ("barrier", "broadcast", "report"):
        timed(Processes, method, method, lambda self, name, *a, **k: name)
    timed(Processes, "reports", "reports", lambda self, name: name)


def build_state(spec: dict[str, Any], mesh: Any) -> dict[str, Any]:
    """`leaves` float32 arrays of rows x cols over the mesh; each block random, from a seed of
    its leaf and position, made on the process that holds it (no process holds the whole)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sharding = NamedSharding(mesh, P("data", "model"))
    shape = (spec["rows"], spec["cols"])

    def leaf(k: int) -> Any:
        def block(index: Any) -> np.ndarray:
            bounds = [sl.indices(n)[:2] for sl, n in zip(index, shape, strict=True)]
            rng = np.random.default_rng([k, *(lo for lo, _ in bounds)])
            return rng.standard_normal(tuple(hi - lo for lo, hi in bounds), dtype=np.float32)

        return jax.make_array_from_callback(shape, sharding, block)

    return {f"w{k:02d}": leaf(k) for k in range(spec["leaves"])}


def planned_objects(handler: Any, state: Any, primary: bool) -> list[tuple[str, bytes]]:
    """What this process's part of the TrainStateHandler's write phase PUTs, key and bytes
    (keys relative to the item's prefix): `_StateSnapshot.write`'s logic, with its private
    helpers: the primary writes each leaf's zarr.json and tree.json; every process the chunks of
    its shards with replica_id 0 (the snapshot keeps only those), raw bytes + crc32c tail."""
    import crc32c

    from cairn.handlers._train_state import layout
    from cairn.handlers._tree import TREE

    snap = handler.snapshot(state)
    objects: list[tuple[str, bytes]] = []
    for leaf in snap._leaves:
        base = f"arrays/{leaf.index}"
        if primary:
            meta = layout._zarr_metadata(leaf.shape, leaf.dtype, leaf.chunk)
            objects.append((f"{base}/zarr.json", json.dumps(meta).encode()))
        if leaf.shared and not primary:
            continue
        for region, data in leaf.pieces:
            for key, part in layout._chunks_of(region, data, leaf.chunk):
                raw = np.ascontiguousarray(part).reshape(-1).view(np.uint8).tobytes()
                objects.append((f"{base}/{key}", raw + crc32c.crc32c(raw).to_bytes(4, "little")))
    if primary:
        objects.append((TREE, json.dumps(snap._tree).encode()))
    return objects


def kv_spec(store: str, bucket: str, path: str) -> dict[str, Any]:
    """A plain TensorStore kvstore spec for `path/` in the bucket (the same endpoint cairn uses)."""
    if store == "s3":
        return {
            "driver": "s3",
            "bucket": bucket,
            "path": f"{path}/",
            "endpoint": os.environ["AWS_ENDPOINT_URL"],
            "aws_region": os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
            "aws_credentials": {"type": "environment"},
        }
    return {"driver": "gcs", "bucket": bucket, "path": f"{path}/"}


def main() -> None:
    spec_path, pid, count, port, out_path = sys.argv[1:6]
    spec = json.loads(Path(spec_path).read_text())
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=int(count),
        process_id=int(pid),
        initialization_timeout=120,
    )
    import tensorstore as ts
    from jax.sharding import Mesh

    from cairn.handlers import TrainStateHandler, handler_for
    from cairn.manager import CheckpointManager
    from cairn.manager._core.multihost import Processes
    from cairn.manager._storage.objectstore import ObjectStore, StorageOptions

    procs = Processes.detect()
    assert (procs.index, procs.count) == (int(pid), int(count)), procs
    store, bucket, prefix = spec["store"], spec["bucket"], spec["prefix"]
    scheme = "s3" if store == "s3" else "gs"

    def url(path: str) -> str:
        return f"{scheme}://{bucket}/{prefix}/{path}"

    def say(text: str) -> None:
        if procs.primary:
            print(f"[{store} N={procs.count}] {text}", flush=True)

    mesh = Mesh(np.array(jax.devices()).reshape(procs.count, 2), ("data", "model"))
    state = build_state(spec, mesh)
    handler = handler_for(state)
    if not isinstance(handler, TrainStateHandler):
        raise RuntimeError(f"the default handler of a dict of jax.Arrays is {handler!r}")
    threads = handler.threads
    objects = planned_objects(handler, state, procs.primary)
    mine = {key: len(data) for key, data in objects}
    procs.report("bench/planned", json.dumps(mine))
    procs.barrier("bench/planned", TIMEOUT_S)
    planned: dict[str, int] = {}
    if procs.primary:
        for text in procs.reports("bench/planned"):
            planned.update(json.loads(text))
    rec = Recorder()
    install_wrappers(rec)
    opts = StorageOptions()
    manifest_size = 0

    def cairn_round(tag: str) -> dict[str, Any]:
        nonlocal manifest_size
        where = url(f"{tag}/cairn")
        mgr = CheckpointManager(where, async_save=True, barrier_timeout=TIMEOUT_S)
        try:
            procs.barrier(f"bench/{tag}/cairn/go", TIMEOUT_S)
            rec.take()
            rec.on = True
            t0 = time.time()
            mgr.save(0, {"state": state})
            mgr.wait_until_finished()
            t1 = time.time()
            rec.on = False
            events = rec.take()
            if procs.primary:  # the plain variant PUTs exactly what cairn wrote
                body = ObjectStore(where, opts).read("checkpoint_0/_CHECKPOINT.json")
                assert body is not None, where
                manifest_size = len(body)
                entry = json.loads(body)["items"]["state"]
                written = {f["path"]: f["size"] for f in entry["files"]}
                if written != planned:
                    raise RuntimeError(
                        f"cairn wrote {len(written)} files, the plain variant PUTs "
                        f"{len(planned)}: {sorted(set(written) ^ set(planned))[:5]}"
                    )
                telemetry = json.loads(body).get("telemetry", {})
            else:
                telemetry = {}
        finally:
            mgr.close()
        return {"t0": t0, "t1": t1, "events": events, "telemetry": telemetry}

    def plain_round(tag: str) -> dict[str, Any]:
        kv = ts.KvStore.open(
            kv_spec(store, bucket, f"{prefix}/{tag}/plain/checkpoint_0/state")
        ).result()

        def put(job: tuple[str, bytes]) -> float:
            kv.write(job[0], job[1]).result()
            return time.time()

        procs.barrier(f"bench/{tag}/plain/go", TIMEOUT_S)
        t0 = time.time()
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            ends = list(pool.map(put, objects))
        t1 = time.time()
        return {"t0": t0, "t1": t1, "last_put_end": max(ends)}

    def wipe(tag: str) -> None:
        procs.barrier(f"bench/{tag}/wipe", TIMEOUT_S)
        if procs.primary:
            kv = ObjectStore(url(tag), opts)._kv
            kv.delete_range(ts.KvStore.KeyRange()).result()
        procs.barrier(f"bench/{tag}/wiped", TIMEOUT_S)

    rounds: list[dict[str, Any]] = []
    total = spec["warmup"] + spec["rounds"]
    for r in range(total):
        warm = r < spec["warmup"]
        tag = f"warmup{r}" if warm else f"r{r - spec['warmup']}"
        index = r - spec["warmup"]
        order = ["cairn", "plain"] if warm or index % 2 == 0 else ["plain", "cairn"]
        got: dict[str, Any] = {"order": order}
        for variant in order:
            got[variant] = cairn_round(tag) if variant == "cairn" else plain_round(tag)
        wipe(tag)
        if not warm:
            rounds.append(got)
        c, p = got["cairn"], got["plain"]
        say(
            f"{tag}: cairn {c['t1'] - c['t0']:.2f} s, plain {p['t1'] - p['t0']:.2f} s "
            f"(this process), order {'/'.join(order)}"
        )

    # A barrier round and a manifest-sized conditional write, alone.
    barrier_s = []
    for i in range(spec["samples"]):
        t = time.time()
        procs.barrier(f"bench/sample/barrier/{i}", TIMEOUT_S)
        barrier_s.append(time.time() - t)
    samples: dict[str, Any] = {"barrier_s": barrier_s}
    if procs.primary:
        probe = ObjectStore(url("probe"), opts)
        data = os.urandom(manifest_size)
        generation = probe.write("manifest.json", data)
        writes, reads = [], []
        for _ in range(spec["samples"]):
            t = time.time()
            generation = probe.write("manifest.json", data, if_generation=generation)
            writes.append(time.time() - t)
            assert generation is not None
        for _ in range(spec["samples"]):  # as the lease's check: a GET of a small object
            t = time.time()
            probe.read_with_generation("manifest.json")
            reads.append(time.time() - t)
        probe._kv.delete_range(ts.KvStore.KeyRange()).result()
        samples.update(conditional_write_s=writes, small_get_s=reads, manifest_bytes=manifest_size)
    procs.barrier("bench/samples/done", TIMEOUT_S)
    result = {
        "process": procs.index,
        "count": procs.count,
        "threads": threads,
        "devices": [str(d) for d in jax.local_devices()],
        "objects": len(objects),
        "object_bytes": sum(mine.values()),
        "state_bytes_here": int(
            sum(
                s.data.nbytes
                for a in state.values()
                for s in a.addressable_shards
                if s.replica_id == 0
            )
        ),
        "planned_total": {"objects": len(planned), "bytes": sum(planned.values())}
        if procs.primary
        else None,
        "rounds": rounds,
        "samples": samples,
    }
    Path(out_path).write_text(json.dumps(result))
    say("done")
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
