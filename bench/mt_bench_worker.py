"""One of N processes of bench_multitier.py: a local tier beside a persistent directory on S3.

    python bench/mt_bench_worker.py SPEC PROCESS_ID NUM_PROCESSES PORT OUT

A `jax.distributed` process on 127.0.0.1 (two CPU devices each, as tests/multihost/launcher.py
runs them), against the moto server AWS_ENDPOINT_URL points at. SPEC is the driver's JSON: the
phase, the persistent URLs, the local root, the state's shape (float32 leaves of rows x cols
over an (N, 2) mesh, PartitionSpec("data", "model"): each process holds 1/N of it), replicas,
and which process's local directory to wipe first. OUT gets this process's times.

Phases:

* ``save``: a persistent-only manager (``<url>/plain``) saves step 1 (t: ``save()`` returns, then
  the commit); then a manager with ``local=LocalTier(..., replicas=R)`` (persistent
  ``<url>/tiers``, EveryNSteps(2); local EveryNSteps(1)) saves step 1 (local only) and step 2
  (both tiers, one snapshot), each followed by ``wait_until_finished()``. Each figure is this
  process's; all processes start each one after a barrier.
* ``restore``: after a barrier, t0; open the manager (``<url>/plain`` without a local tier for
  ``source=persistent``, else ``<url>/tiers`` with the local tier, the local directory of process
  ``wipe`` removed before the barrier, and every process's local files dropped from the page
  cache) and ``restore()`` into the state's sharding; t1; every value is checked against the
  saved one (not timed).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.pages import evict  # tests/support: drop a file from the page cache


def main() -> None:
    spec_path, pid, count, port, out = sys.argv[1:6]
    spec = json.loads(Path(spec_path).read_text())
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=int(count),
        process_id=int(pid),
        initialization_timeout=120,
    )
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from cairn.manager import AtSteps, CheckpointManager, KeepLatest, LocalTier
    from cairn.manager._core.multihost import Processes
    from cairn.manager._storage.posix import PosixStorage

    procs = Processes.detect()
    mesh = Mesh(np.array(jax.devices()).reshape(procs.count, 2), ("data", "model"))
    sharding = NamedSharding(mesh, P("data", "model"))
    rows, cols, leaves = spec["rows"], spec["cols"], spec["leaves"]

    def leaf(k: int, step: int) -> Any:
        return jax.make_array_from_callback(
            (rows, cols),
            sharding,
            lambda idx: np.full((rows, cols), k + 1000 * step, np.float32)[idx],
        )

    def state(step: int) -> dict[str, Any]:
        return {f"w{k}": leaf(k, step) for k in range(leaves)}

    tier = LocalTier(
        f"{spec['local']}/local-{{process}}",
        save=AtSteps([1, 3, 5, 7, 12, 22]),
        keep=KeepLatest(2),
        replicas=spec["replicas"],
    )
    times: dict[str, float] = {}

    def meet(name: str) -> None:
        procs.barrier(f"bench/{name}", 600)

    if spec["phase"] == "save":
        st1, st2 = state(1), state(2)
        for x in (*st1.values(), *st2.values()):
            x.block_until_ready()
        a = jax.device_put(np.ones((384, 384), np.float32), jax.local_devices()[0])
        step_fn = jax.jit(lambda m: (m @ m) * (1.0 / 384))

        def train(n: int) -> None:  # n steps of a stand-in training step, each waited for
            for _ in range(n):
                step_fn(a).block_until_ready()

        train(20)
        t0 = time.monotonic()
        train(50)
        steps = max(50, int(spec["train_s"] / ((time.monotonic() - t0) / 50)))
        meet("baseline")
        t0 = time.monotonic()
        train(steps)
        times["train_s"] = time.monotonic() - t0

        def base() -> float:
            """The same training steps without a save, just before the one measured: this
            machine's speed drifts by seconds between phases, less between neighbours."""
            t0 = time.monotonic()
            train(steps)
            return time.monotonic() - t0

        def measure(mgr: Any, saves: list[int], st: Any, name: str) -> None:
            """The first save (`saves[0]`): its time to committed. Those between, each
            waited for: a long run's state, where each save deletes a step (KeepLatest(2)).
            The last (its staging memory ready): the time save() blocks, and the time lost
            to training: save(), the training steps, the wait for its commit, less the same
            steps without a save, run just before."""
            force = name == "persistent"
            meet(name)
            t0 = time.monotonic()
            assert mgr.save(saves[0], {"state": st}, force=force)
            mgr.wait_until_finished()
            times[f"{name}_commit_s"] = time.monotonic() - t0
            for step in saves[1:-1]:
                assert mgr.save(step, {"state": st}, force=force)
                mgr.wait_until_finished()
            meet(f"{name}/base")
            paired = base()
            meet(f"{name}/train")
            t0 = time.monotonic()
            assert mgr.save(saves[-1], {"state": st}, force=force)
            times[f"{name}_blocked_s"] = time.monotonic() - t0
            train(steps)
            mgr.wait_until_finished()
            times[f"{name}_lost_s"] = time.monotonic() - t0 - paired

        if not spec["pool"]:  # for comparison: each deleted part freed, each new one allocated
            PosixStorage.reuse_pages = lambda self: None  # type: ignore[method-assign]
        else:
            with CheckpointManager(f"{spec['url']}/plain", barrier_timeout=600) as mgr:
                measure(mgr, [1, 11], st1, "persistent")
        with CheckpointManager(
            f"{spec['url']}/tiers", save=AtSteps([12, 22]), local=tier, barrier_timeout=600
        ) as mgr:
            measure(mgr, [1, 3, 5, 7], st1, "local")
            if spec["pool"]:
                measure(mgr, [12, 22], st2, "both")
        if spec["replicas"] and spec["pool"]:
            part = rows * cols * 4 * leaves // procs.count
            times |= transfer_limits(
                procs, part, meet, lambda: train(steps), base, Path(spec["local"])
            )
    else:
        if spec.get("wipe") == procs.index:
            shutil.rmtree(f"{spec['local']}/local-{procs.index}", ignore_errors=True)
        uncache(Path(f"{spec['local']}/local-{procs.index}"))
        target = {
            f"w{k}": jax.ShapeDtypeStruct((rows, cols), np.float32, sharding=sharding)
            for k in range(leaves)
        }
        meet("restore")
        t0 = time.monotonic()
        if spec["source"] == "persistent":
            mgr = CheckpointManager(f"{spec['url']}/plain", barrier_timeout=600)
        else:
            mgr = CheckpointManager(
                f"{spec['url']}/tiers", save=AtSteps([2, 12]), local=tier, barrier_timeout=600
            )
        got = mgr.restore(None, {"state": target})["state"]
        for x in got.values():
            x.block_until_ready()
        times["restore_s"] = time.monotonic() - t0
        step = {11: 1, 22: 2}[mgr.latest_step()]  # the values of st1, st2
        for k in range(leaves):
            for shard in got[f"w{k}"].addressable_shards:
                assert float(np.asarray(shard.data).ravel()[0]) == k + 1000 * step
        mgr.close()
    with open(out, "w") as f:
        json.dump(times, f)
    meet("end")
    jax.distributed.shutdown()


def uncache(where: Path) -> None:
    """Drop this process's local files from the page cache (written back first), so that every
    restart reads them from where they are, not from what an earlier phase left in memory (a
    RAM disk's files have nowhere else to be, and stay)."""
    for path in where.rglob("*"):
        if path.is_file() and not path.is_symlink():
            evict(path)


def transfer_limits(
    procs: Any, nbytes: int, meet: Any, train: Any, base: Any, where: Path
) -> dict[str, float]:
    """The machine's limits for moving one process's part to another: `permute_s`, a plain
    jitted ppermute of `nbytes` already on the device (JAX's collectives, no host copy, no
    file), each process sending to the next; `socket_s`, the same bytes from memory to the next
    process over a plain socket (``sendall``, ``recv_into`` a buffer), and receiving the
    previous one's; `socket_lost_s`, the training time lost while background threads do that
    (at background priority, as cairn's threads run); `socket_write_lost_s`, the same when the
    receiver then writes what it received to a file in `where` and fsyncs it, as a holder
    commits a replica."""
    import socket
    import threading

    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from cairn.handlers.io import lower_thread_priority

    count, me = procs.count, procs.index
    first = [
        min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
        for p in range(count)
    ]
    mesh = Mesh(np.array(first), ("p",))
    piece = 64 << 20
    ring = [(p, (p + 1) % count) for p in range(count)]
    send = jax.jit(
        jax.shard_map(
            lambda x: jax.lax.ppermute(x, "p", ring), mesh=mesh, in_specs=P("p"), out_specs=P("p")
        )
    )
    sharding = NamedSharding(mesh, P("p"))
    pieces = [
        jax.make_array_from_single_device_arrays(
            (count * piece,),
            sharding,
            [jax.device_put(np.full(piece, k % 251, np.uint8), first[me])],
        )
        for k in range(-(-nbytes // piece))
    ]
    send(pieces[0]).block_until_ready()  # compiled
    meet("limit/permute")
    t0 = time.monotonic()
    for x in pieces:
        send(x).block_until_ready()
    times = {"limit_permute_s": time.monotonic() - t0}
    del pieces

    data, got = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    listener = socket.create_server(("127.0.0.1", 0))
    procs.report("bench/limit/port", str(listener.getsockname()[1]))
    meet("limit/ports")
    ports = [int(p) for p in procs.reports("bench/limit/port")]

    def receive(write: bool = False) -> None:
        lower_thread_priority()
        conn, _ = listener.accept()
        with conn:
            view = memoryview(got)
            while view.nbytes:
                view = view[conn.recv_into(view) :]
        if write:
            path = where / f"limit-{me}-{time.monotonic_ns()}"
            with open(path, "wb") as f:
                f.write(memoryview(got))
                f.flush()
                os.fsync(f.fileno())
            path.unlink()

    def transmit() -> None:
        lower_thread_priority()
        with socket.create_connection(("127.0.0.1", ports[(me + 1) % count])) as conn:
            conn.sendall(memoryview(data))

    def both(write: bool = False) -> list[threading.Thread]:
        threads = [
            threading.Thread(target=receive, args=(write,)),
            threading.Thread(target=transmit),
        ]
        for t in threads:
            t.start()
        return threads

    meet("limit/socket-alone")
    t0 = time.monotonic()
    for t in both():
        t.join()
    times["limit_socket_s"] = time.monotonic() - t0
    meet("limit/base")
    baseline = base()
    meet("limit/socket")
    t0 = time.monotonic()
    threads = both()
    train()
    for t in threads:
        t.join()
    times["limit_socket_lost_s"] = time.monotonic() - t0 - baseline
    meet("limit/base-write")
    baseline = base()
    meet("limit/socket-write")
    t0 = time.monotonic()
    threads = both(write=True)
    train()
    for t in threads:
        t.join()
    times["limit_socket_write_lost_s"] = time.monotonic() - t0 - baseline
    listener.close()
    return times


if __name__ == "__main__":
    main()
