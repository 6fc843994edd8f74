"""One of N processes of a jax.distributed run on 127.0.0.1, for the multi-process tests.

    python mh_worker.py SCENARIO PROCESS_ID NUM_PROCESSES PORT DIR

Prints ``ok <scenario> <process id>`` at the end, or the error it expected.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
import urllib.parse
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import jax


def main() -> None:
    scenario, pid, count, port, directory = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
        sys.argv[5],
    )
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=count,
        process_id=pid,
        initialization_timeout=60,
    )
    from cairn.manager import BarrierTimeoutError
    from cairn.manager._core.multihost import Processes

    procs = Processes.detect()
    assert (procs.index, procs.count) == (pid, count), procs
    if scenario == "meet":
        procs.barrier("cairn-test/start", 60)
        value = procs.broadcast("cairn-test/run-id", "abc123" if procs.primary else None, 60)
        assert value == "abc123", value
        procs.barrier("cairn-test/end", 60)
    elif scenario == "peer-dies":
        procs.barrier("cairn-test/start", 60)
        if pid == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.monotonic()
        try:
            procs.barrier("cairn-test/after-death", 3)
        except BarrierTimeoutError as e:
            print(f"timeout after {time.monotonic() - t0:.1f} s: {e}", flush=True)
        else:
            raise AssertionError("the barrier passed with a dead peer")
    elif scenario in ("save", "kill", "resume", "clock", "writer-kill"):
        run_manager(scenario, procs, directory)
    elif scenario == "iterators":
        per_process_iterators(procs, directory)
    elif scenario == "incremental":
        incremental(procs, directory)
    elif scenario == "packed":
        packed(procs, directory)
    elif scenario == "preempt":
        preempt(procs, directory)
    elif scenario == "writer-dies":
        writer_dies(procs, directory)
    elif scenario == "count":
        count_requests(procs, directory)
    elif scenario == "orbax":
        orbax_surface(procs, directory)
    elif scenario == "local":
        local_tier(procs, directory)
    print(f"ok {scenario} {pid}", flush=True)
    if scenario in ("peer-dies", "kill", "writer-dies"):
        os._exit(0)  # skip jax.distributed's shutdown barrier, which would wait for a dead peer
    jax.distributed.shutdown()  # both alive: leave together, so neither sees the other vanish


def per_process_iterators(procs: Any, directory: str) -> None:
    """Each process reads its own shard: each saves and restores its own iterator position."""
    import numpy as np

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from support.iterutil import Shuffled, advanced, take

    from cairn.manager import CheckpointManager, KeepLatest

    def position(step: int) -> int:
        return 3 + 10 * procs.index + step

    with CheckpointManager(
        directory, keep_items={"data": KeepLatest(1)}, barrier_timeout=30
    ) as mgr:
        for step in (1, 2):
            it = advanced(Shuffled(seed=procs.index), position(step))
            mgr.save(step, {"data": it, "w": np.arange(3) * step})
        mgr.wait_until_finished()
        got = mgr.restore(2, {"data": Shuffled(seed=procs.index)})["data"]
        assert take(got) == take(advanced(Shuffled(seed=procs.index), position(2)))
        assert mgr.info(1).items["data"].dropped and not mgr.info(2).items["data"].dropped
        assert list(mgr.restore(1)) == ["w"]
        print("files", sorted(mgr.info(2).items["data"].files), flush=True)


def incremental(procs: Any, directory: str) -> None:
    """Three incremental saves of a state whose sharded array never changes: each process links
    its own shards of it to the step before, and every step restores on both."""
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from cairn.manager import CheckpointManager, KeepLatest

    mesh = Mesh(np.array(jax.devices()).reshape(procs.count, 2), ("data", "model"))
    sharding = NamedSharding(mesh, P("data", "model"))
    full = np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)  # shards of 1 MiB: copied
    frozen = jax.make_array_from_callback(full.shape, sharding, lambda idx: full[idx])
    target = {"frozen": jax.ShapeDtypeStruct(full.shape, np.float32, sharding=sharding)}
    from cairn.handlers import TrainStateHandler

    zarr = {"state": TrainStateHandler(layout="zarr")}  # files per shard (tests of packs: packed)
    with CheckpointManager(directory, keep=KeepLatest(2), incremental=True, handlers=zarr) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"state": {"frozen": frozen, "step": step}})
            mgr.wait_until_finished()
        written = [mgr.info(s).telemetry["bytes_written"] for s in (2, 3)]
        total = mgr.info(3).telemetry["bytes"]
        print(f"steps {mgr.all_steps()} written {written} of {total}", flush=True)
        for step in (2, 3):
            got = mgr.restore(step, {"state": {**target, "step": 0}})["state"]
            assert got["step"] == step
            for shard in got["frozen"].addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index])
            assert mgr.verify(step) == []


def packed(procs: Any, directory: str) -> None:
    """The packed layout with two processes: each writes its own shards into its own packs and
    index; host data once (the primary); three incremental saves of a frozen sharded array and
    a changing one; every step restores into the sharding it was saved with and into another."""
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from cairn.handlers import TrainStateHandler
    from cairn.manager import CheckpointManager, KeepLatest

    mesh = Mesh(np.array(jax.devices()).reshape(procs.count, 2), ("data", "model"))
    saved, other = NamedSharding(mesh, P("data", "model")), NamedSharding(mesh, P("model"))
    full = np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)
    frozen = jax.make_array_from_callback(full.shape, saved, lambda idx: full[idx])

    def changing(step: int) -> Any:
        return jax.make_array_from_callback((64, 8), saved, lambda idx: (full[:64, :8] * step)[idx])

    handlers = {"state": TrainStateHandler(layout="packed")}
    with CheckpointManager(
        directory, keep=KeepLatest(2), incremental=True, handlers=handlers
    ) as mgr:
        for step in (1, 2, 3):
            state = {"frozen": frozen, "changing": changing(step), "host": np.arange(5) * step}
            mgr.save(step, {"state": state})
            mgr.wait_until_finished()
        written = [mgr.info(s).telemetry["bytes_written"] for s in (2, 3)]
        print(f"steps {mgr.all_steps()} written {written} of {mgr.info(3).telemetry['bytes']}")
        print("files", json.dumps(sorted(mgr.info(3).items["state"].files)), flush=True)
        for step in (2, 3):
            for sharding in (saved, other):
                target = {
                    "frozen": jax.ShapeDtypeStruct(full.shape, np.float32, sharding=sharding),
                    "changing": jax.ShapeDtypeStruct((64, 8), np.float32, sharding=sharding),
                    "host": np.zeros(5, np.int64),
                }
                got = mgr.restore(step, {"state": target})["state"]
                for shard in got["frozen"].addressable_shards:
                    np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index])
                for shard in got["changing"].addressable_shards:
                    want = (full[:64, :8] * step)[shard.index]
                    np.testing.assert_array_equal(np.asarray(shard.data), want)
                np.testing.assert_array_equal(got["host"], np.arange(5) * step)
            assert mgr.verify(step) == []


def orbax_surface(procs: Any, directory: str) -> None:
    """Orbax's API (cairn.manager.orbax) with two processes, as MaxText calls it: a sharded
    state, a JSON item and each process's grain iterator; max_to_keep; a restart restores the
    latest step into the state's sharding and moves each iterator to its own position."""
    import grain.python as gp
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from cairn.manager.orbax import CheckpointManager

    mesh = Mesh(np.array(jax.devices()).reshape(procs.count, 2), ("data", "model"))
    sharding = NamedSharding(mesh, P("data", "model"))
    full = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)

    def state(step: int) -> Any:
        return {"w": jax.make_array_from_callback(full.shape, sharding, lambda i: full[i] * step)}

    def iterator() -> Any:
        return iter(gp.MapDataset.range(100)[procs.index :: procs.count].to_iter_dataset())

    options = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=1)
    names = ("state", "config", "iter")
    data = iterator()
    with CheckpointManager(directory, options=options, item_names=names) as mngr:
        for step in range(4):
            next(data)
            saved = mngr.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state(step)),
                    config=ocp.args.JsonSave({"step": step}),
                    iter=gp.PyGrainCheckpointSave(data),
                ),
                metrics={"loss": 1.0 / (step + 1)},
            )
            assert saved, step
        mngr.wait_until_finished()
        print(f"steps {mngr.all_steps()}", flush=True)
    expected_next = next(data)
    abstract = {"w": jax.ShapeDtypeStruct(full.shape, np.float32, sharding=sharding)}
    with CheckpointManager(directory, options=options, item_names=names) as mngr:
        assert mngr.all_steps() == [2, 3], mngr.all_steps()
        fresh = iterator()
        got = mngr.restore(
            None,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract),
                config=ocp.args.JsonRestore(),
                iter=gp.PyGrainCheckpointRestore(fresh),
            ),
        )
        assert got.config == {"step": 3} and got.iter is fresh
        assert got.state["w"].sharding == sharding
        for shard in got.state["w"].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index] * 3)
        assert next(fresh) == expected_next, "the iterator did not resume where it was saved"
        assert mngr.metrics(3) == {"loss": 0.25}


def local_tier(procs: Any, directory: str) -> None:
    """A local tier (each process's own directory, CAIRN_TEST_LOCAL/local-{process}) beside the
    persistent directory: a sharded array, a replicated one, host data and each process's
    iterator. CAIRN_TEST_PHASE=save saves steps 1..CAIRN_TEST_STEPS (persistent every 5, local
    every 2, keep 2 in each), SIGKILLing process CAIRN_TEST_VICTIM right after save() of step
    CAIRN_TEST_KILL_AT returned, if set; =resume first wipes the local directory of process
    CAIRN_TEST_WIPE, if set, then restores and checks every value, and saves one more step.
    CAIRN_TEST_REPLICAS: the local tier's replicas= (0 by default); CAIRN_TEST_CORRUPT_REPLICA:
    the other processes flip a byte in their newest replica of the wiped process's part;
    CAIRN_TEST_RESHARD: restore "w" into another sharding than it was saved with;
    CAIRN_TEST_DOMAINS: each process's failure_domain=, comma-separated, empty for None (CAIRN_TEST_WIPE may
    name several processes, comma-separated, too);
    CAIRN_TEST_LOSE_REPLICAS: the processes not wiped delete the replicas they hold once the
    parts they sent back as the manager opened were answered, before restore();
    CAIRN_TEST_SKIP_RESTORE: save the step after the newest without restoring;
    CAIRN_TEST_ASYNC=0: async_save=False; CAIRN_TEST_MUTE_HOLDERS: the processes not wiped send
    back no replica in a restore (as a holder that cannot reach its owner);
    CAIRN_TEST_STOP_HOLDERS: the same processes stop themselves (SIGSTOP) where they would send
    back (a holder that hangs as the manager opens, where it sends back a part at once); CAIRN_TEST_BARRIER: barrier_timeout= (30 by
    default); CAIRN_TEST_WRITER: writer= ("thread" by default); CAIRN_TEST_INCREMENTAL=1:
    incremental=True, and a constant array of 4 MiB ("frozen") in the state; CAIRN_TEST_BIG=1:
    that array alone (parts of 2 MiB, which a RAM disk's PagePool takes)."""
    import shutil
    from pathlib import Path

    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from support.iterutil import Shuffled, advanced, take

    from cairn.manager import CheckpointManager, EveryNSteps, KeepLatest, LocalTier

    env = os.environ
    local_root = env["CAIRN_TEST_LOCAL"]
    mesh = Mesh(np.array(jax.devices()).reshape(procs.count, 2), ("data", "model"))
    sharded, replicated = NamedSharding(mesh, P("data", "model")), NamedSharding(mesh, P())
    full = np.arange(256 * 16, dtype=np.float32).reshape(256, 16)

    incremental = env.get("CAIRN_TEST_INCREMENTAL") == "1"
    big = incremental or env.get("CAIRN_TEST_BIG") == "1"  # parts over PagePool's 1 MiB
    frozen = np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)  # 2 MiB a process
    unchanged = jax.make_array_from_callback(frozen.shape, sharded, lambda i: frozen[i])

    def state(step: int) -> Any:
        changing = {
            "w": jax.make_array_from_callback(full.shape, sharded, lambda i: full[i] * step),
            "r": jax.make_array_from_callback((4, 4), replicated, lambda i: np.eye(4)[i] * step),
            "host": np.arange(3) * step,
            "step": step,
        }
        return {**changing, "frozen": unchanged} if big else changing

    def position(step: int) -> int:
        return 7 * procs.index + step

    domains = env.get("CAIRN_TEST_DOMAINS", "").split(",") if env.get("CAIRN_TEST_DOMAINS") else []

    def manager() -> Any:
        tier = LocalTier(
            f"{local_root}/local-{{process}}",
            save=EveryNSteps(2),
            keep=KeepLatest(2),
            replicas=int(env.get("CAIRN_TEST_REPLICAS", "0")),
            failure_domain=(domains[procs.index] or None) if domains else None,
        )
        return CheckpointManager(
            directory,
            save=EveryNSteps(5),
            keep=KeepLatest(2),
            local=tier,
            barrier_timeout=float(env.get("CAIRN_TEST_BARRIER", "30")),
            async_save=env.get("CAIRN_TEST_ASYNC", "1") == "1",
            writer=env.get("CAIRN_TEST_WRITER", "thread"),
            incremental=env.get("CAIRN_TEST_INCREMENTAL") == "1",
        )

    if env["CAIRN_TEST_PHASE"] == "save":
        kill_at = int(env.get("CAIRN_TEST_KILL_AT", "-1"))
        victim = int(env.get("CAIRN_TEST_VICTIM", "-1"))
        with manager() as mgr:
            for step in range(1, int(env["CAIRN_TEST_STEPS"]) + 1):
                if mgr.should_save(step):
                    it = advanced(Shuffled(seed=procs.index), position(step))
                    mgr.save(step, {"state": state(step), "data": it})
                if step == kill_at and victim in (procs.index, procs.count):
                    if victim == procs.count:  # every save() of the others returned too: JAX
                        procs.barrier(f"cairn-test/kill-{step}", 120)  # ends them with the first
                    print(f"killing myself after step {step}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
            mgr.wait_until_finished()
            print(f"steps {mgr.all_steps('persistent')} {mgr.all_steps('local')}", flush=True)
            if incremental and kill_at < 0:  # the packs of "frozen" linked, not written
                telemetry = mgr.info(mgr.all_steps("persistent")[-1]).telemetry
                print(f"written {telemetry['bytes_written']} of {telemetry['bytes']}", flush=True)
            if big:  # on a RAM disk: the files of deleted parts, kept to be written over
                for part in mgr._local.managers.values():
                    part._commits._reclaimer.pool.submit(lambda: None).result()
                pooled = list(Path(local_root, f"local-{procs.index}").glob("*/.trash-pages/*"))
                print(f"pooled {len(pooled)}", flush=True)
        return
    wipe = env.get("CAIRN_TEST_WIPE")
    wiped = [int(w) for w in wipe.split(",")] if wipe is not None else []
    if procs.index in wiped:
        shutil.rmtree(f"{local_root}/local-{procs.index}", ignore_errors=True)
    if wipe is not None and env.get("CAIRN_TEST_CORRUPT_REPLICA") and procs.index not in wiped:
        held = sorted(Path(f"{local_root}/local-{procs.index}/process_{wipe}").glob("check*"))
        if held:  # a flipped byte in a pack of the newest replica of the wiped process's part
            pack = next((held[-1] / "state" / "packs").glob("0.*"))
            data = bytearray(pack.read_bytes())
            data[10] ^= 0xFF
            pack.write_bytes(bytes(data))
            print(f"corrupted {held[-1].name}", flush=True)
    if env.get("CAIRN_TEST_MUTE_HOLDERS") and procs.index not in wiped:
        from cairn.manager._core.post import Post

        Post.send_back = lambda self, step, parts: print(f"not sending back {step}", flush=True)  # type: ignore[method-assign]
    if env.get("CAIRN_TEST_STOP_HOLDERS") and procs.index not in wiped:
        from cairn.manager._core.post import Post

        def stop(self: Any, step: int, parts: Any) -> None:
            print(f"stopping where it would send back {step}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)

        Post.send_back = stop  # type: ignore[method-assign]
    if env.get("CAIRN_TEST_RESHARD"):  # other shardings than saved: parts cannot serve them
        sharded = NamedSharding(mesh, P(None, ("data", "model")))
    target = {
        "w": jax.ShapeDtypeStruct(full.shape, np.float32, sharding=sharded),
        "r": jax.ShapeDtypeStruct((4, 4), np.float32, sharding=replicated),
        "host": np.zeros(3, np.int64),
        "step": 0,
    }
    if big:
        target["frozen"] = jax.ShapeDtypeStruct(frozen.shape, np.float32, sharding=sharded)
    with manager() as mgr:
        if env.get("CAIRN_TEST_LOSE_REPLICAS") and procs.index not in wiped:
            mgr._local._post.wait_sent()  # the parts it sent back as the manager opened
            for held in Path(f"{local_root}/local-{procs.index}").glob("process_*"):
                if held.name != f"process_{procs.index}":
                    shutil.rmtree(held)
                    print(f"lost {held.name} after the open", flush=True)
        latest = mgr.latest_step()
        if latest is None:  # nothing every process can get: a fresh start
            print("latest None restored 0", flush=True)
            return
        if env.get("CAIRN_TEST_SKIP_RESTORE"):  # a job that starts over: it only saves
            mgr.save(latest + 1, {"state": state(latest + 1)}, force=True)
            mgr.wait_until_finished()
            back = len(mgr._local._post._back)
            print(f"saved {latest + 1} without a restore: {back} part(s) kept", flush=True)
            return
        got = mgr.restore(items={"state": target, "data": Shuffled(seed=procs.index)})
        step = got["state"]["step"]
        for shard in got["state"]["w"].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index] * step)
        for shard in got["state"]["r"].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), np.eye(4) * step)
        np.testing.assert_array_equal(got["state"]["host"], np.arange(3) * step)
        if big:
            for shard in got["state"]["frozen"].addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), frozen[shard.index])
        want = take(advanced(Shuffled(seed=procs.index), position(step)))
        assert take(got["data"]) == want, "the iterator did not come back"
        print(f"latest {latest} restored {step}", flush=True)
        it = advanced(Shuffled(seed=procs.index), position(step + 1))
        mgr.save(step + 1, {"state": state(step + 1), "data": it}, force=True)
        mgr.wait_until_finished()
        print(f"after {mgr.all_steps('persistent')} {mgr.all_steps('local')}", flush=True)


def count_requests(procs: Any, directory: str) -> None:
    """Every HTTP request this process makes to the object store, through its own counting
    proxy: at the open, and in each of 5 saves (KeepLatest(2): retention deletes a step from
    the third on), from a barrier before `save` to one after the commit. Prints one line,
    ``requests <json>``, with per save the requests by kind and the files this process wrote."""
    import json

    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from support.countproxy import CountingProxy

    from cairn.handlers import Destination
    from cairn.manager import CheckpointManager, KeepLatest

    primary = int(os.environ.get("CAIRN_TEST_PRIMARY", "0"))
    if procs.count > 1:
        with contextlib.suppress(ValueError):  # another process cannot see this one's memory
            CheckpointManager("memory://count")
            raise AssertionError("a multi-process manager opened a memory:// directory")
    variable = "AWS_ENDPOINT_URL" if directory.startswith("s3://") else "TENSORSTORE_GCS_HTTP_URL"
    proxy = CountingProxy(os.environ[variable]).start()
    os.environ[variable] = proxy.url
    files = {"n": 0}
    lock = threading.Lock()
    write_file = Destination.write_file

    def counted(self: Any, relpath: str, data: Any, **kwargs: Any) -> Any:
        with lock:
            files["n"] += 1
        return write_file(self, relpath, data, **kwargs)

    Destination.write_file = counted  # type: ignore[method-assign]
    mesh = Mesh(np.array(jax.devices()).reshape(procs.count, 2), ("data", "model"))
    sharding = NamedSharding(mesh, P("data", "model"))
    full = np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)  # shards of 1 MiB: copied
    state = {
        name: jax.make_array_from_callback(full.shape, sharding, lambda idx: full[idx])
        for name in ("a", "b", "c")
    }

    def kinds(requests: list[Any]) -> dict[str, int]:
        """Requests by kind: GET, PUT (a GCS upload is a POST), HEAD, DELETE, and LIST of the
        whole directory ("LIST dir") or of one step's prefix ("LIST step"); each also counted
        as "<kind> manifest" when it is about a step's manifest key."""
        out: dict[str, int] = {}
        for r in requests:
            query = urllib.parse.parse_qs(r.query)
            listing = query.get("prefix", query.get("startOffset", [None]))[0]
            if r.method == "GET" and listing is not None:
                key = f"LIST {'step' if 'checkpoint_' in listing else 'dir'}"
            else:
                method = "PUT" if r.method == "POST" and "/upload/" in r.path else r.method
                name = query.get("name", [r.path])[0]  # a GCS upload names its object
                about = "manifest" if name.endswith("_CHECKPOINT.json") else "other"
                key = f"{method} {about}"
            out[key] = out.get(key, 0) + 1
        return out

    report: dict[str, Any] = {"process": procs.index, "count": procs.count, "saves": []}
    options = {"keep": KeepLatest(2), "barrier_timeout": 60, "primary_process": primary}
    procs.barrier("cairn-test/count/start", 60)
    with CheckpointManager(directory, **options) as mgr:
        report["open"] = kinds(proxy.requests())
        for step in range(5):
            procs.barrier(f"cairn-test/count/before/{step}", 60)
            proxy.clear()
            files["n"] = 0
            mgr.save(step, {"state": state})
            mgr.wait_until_finished()
            procs.barrier(f"cairn-test/count/after/{step}", 60)
            done = kinds(proxy.requests())
            report["saves"].append({"files": files["n"], "requests": done})
        assert mgr.all_steps() == [3, 4], mgr.all_steps()
    procs.barrier("cairn-test/count/closed", 60)
    proxy.clear()
    with CheckpointManager(directory, **options) as mgr:
        report["reopen"] = kinds(proxy.requests())
        assert mgr.all_steps() == [3, 4], mgr.all_steps()
    proxy.stop()
    print("requests", json.dumps(report), flush=True)


def writer_dies(procs: Any, directory: str) -> None:
    """writer="process": process 1's writer is SIGKILLed inside its write of step 2, so it never
    reports; the primary's writer gives up after the barrier timeout and commits nothing."""
    import numpy as np

    from cairn.manager import CheckpointManager, CommitError

    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, tests)
    os.environ["PYTHONPATH"] = os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])
    from support.writer_items import Killer  # the writer processes import it too

    mgr = CheckpointManager(
        directory, handlers={"boom": Killer()}, barrier_timeout=5, writer="process"
    )
    for step in (1, 2):
        items: dict[str, Any] = {"w": np.full(4, step)}
        if step == 2:
            items["boom"] = "spare" if procs.index == 0 else None
        mgr.save(step, items)
        try:
            mgr.wait_until_finished()
        except CommitError as e:
            print(f"commit failed: {type(e.__cause__).__name__}: {e.__cause__}", flush=True)
    print("steps", mgr.all_steps(), flush=True)
    print(f"ok writer-dies {procs.index}", flush=True)


def preempt(procs: Any, directory: str) -> None:
    """Process 1 gets SIGTERM at step 5; JAX's preemption sync point makes both save one step."""
    import numpy as np

    from cairn.manager import AnyOf, CheckpointManager, EveryNSteps, OnPreemption

    with CheckpointManager(
        directory, save=AnyOf(EveryNSteps(10**6), OnPreemption()), barrier_timeout=30
    ) as mgr:
        for step in range(1, 100_000):
            procs.barrier(f"cairn-test/step/{step}", 30)  # stands in for a collective train step
            if procs.index == 1 and step == 5:
                os.kill(os.getpid(), signal.SIGTERM)  # JAX's handler notes it; the run goes on
            if mgr.should_save(step):
                mgr.save(step, {"w": np.full(2, step)})
            if mgr.reached_preemption(step):
                print(f"preempted at {step} {mgr.all_steps()}", flush=True)
                break


def install_kill(kill: str, procs: Any) -> None:
    """CAIRN_TEST_KILL="<victim>:<point>": SIGKILL the victim at that point of the save of step 3.

    Points: "upload" (after its second file of the step), "written" (after its write phase,
    before it reports), "reported" (after it reported ok, before the barrier), "manifest" (the
    primary, once every report is in, before the commit; another process, while it waits for the
    outcome), "committed" (the primary right after the commit point, before the outcome; another
    process right after the outcome arrived).
    """
    from cairn.handlers import Destination
    from cairn.manager._core import commit as _commit
    from cairn.manager._core.multihost import Processes
    from cairn.manager._storage.objectstore import _KvPrepared
    from cairn.manager._storage.posix import _Prepared

    victim, point = kill.split(":")
    if int(victim) != procs.index:
        return
    saving = {"step": -1}
    lock = threading.Lock()

    def die() -> None:
        print(f"killing myself at {point}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def wrap(cls: Any, name: str, *, before: bool, when: Any = lambda *a, **k: True) -> None:
        original = getattr(cls, name)

        def patched(*args: Any, **kwargs: Any) -> Any:
            with lock:  # writer threads call write_file at once
                fire = saving["step"] == 3 and when(*args, **kwargs)
            if fire and before:
                die()
            out = original(*args, **kwargs)
            if fire:
                die()
            return out

        setattr(cls, name, patched)

    commit_step = _commit.commit_step

    def tracking(storage: Any, names: Any, job: Any, *args: Any, **kwargs: Any) -> Any:
        saving["step"] = job.step
        if job.step == 3 and point == "written":
            for item, (handler, snapshot) in list(job.snapshots.items()):
                job.snapshots[item] = (handler, _DieAfter(snapshot, die))  # type: ignore[index]
        return commit_step(storage, names, job, *args, **kwargs)

    _commit.commit_step = tracking
    uploads = {"n": 0}

    def second_upload(*args: Any, **kwargs: Any) -> bool:
        uploads["n"] += 1
        return uploads["n"] == 2

    if point == "upload":
        wrap(Destination, "write_file", before=False, when=second_upload)
    elif point == "reported":
        wrap(Processes, "report", before=False)
    elif point == "manifest" and procs.primary:
        wrap(_commit, "build_manifest", before=True)
    elif point == "manifest":
        wrap(Processes, "broadcast", before=True, when=lambda self, name, *a: "outcome" in name)
    elif point == "committed" and procs.primary:
        wrap(_Prepared, "commit", before=False)
        wrap(_KvPrepared, "commit", before=False)
    elif point == "committed":  # once the primary's word that it committed has arrived
        wrap(Processes, "broadcast", before=False, when=lambda self, name, *a: "outcome" in name)


class _DieAfter:
    def __init__(self, inner: Any, die: Any) -> None:
        self._inner, self._die = inner, die

    def write(self, dest: Any) -> Any:
        records = self._inner.write(dest)
        self._die()
        return records


def run_manager(scenario: str, procs: Any, directory: str) -> None:
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from cairn.handlers import JsonHandler
    from cairn.manager import (
        CheckpointManager,
        CommitError,
        EveryNSeconds,
        KeepLatest,
        SupersededError,
    )

    n = procs.count
    mesh = Mesh(np.array(jax.devices()).reshape(n, 2), ("data", "model"))
    full = np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)  # shards of 1 MiB: copied

    def state(step: int) -> Any:
        sharding = NamedSharding(mesh, P("data", "model"))
        x = jax.make_array_from_callback(full.shape, sharding, lambda idx: full[idx] * step)
        # Besides the global array: host data and a process-local array, the same everywhere.
        return {"x": x, "step": step, "host": np.arange(3) * step, "local": jax.numpy.full(2, step)}

    def target(sharding: Any) -> Any:
        x = jax.ShapeDtypeStruct(full.shape, np.float32, sharding=sharding)
        return {"x": x, "step": 0, "host": None, "local": None}

    def check(restored: Any, step: int, sharding: Any) -> None:
        x = restored["x"]
        assert x.sharding == sharding, (x.sharding, sharding)
        for shard in x.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index] * step)
        assert restored["step"] == step
        np.testing.assert_array_equal(np.asarray(restored["host"]), np.arange(3) * step)
        np.testing.assert_array_equal(np.asarray(restored["local"]), np.full(2, step))

    handlers = {"config": JsonHandler()}
    if scenario == "clock":
        real = time.time
        skew = 1000.0 if procs.index == 1 else 0.0
        time.time = lambda: real() + skew  # type: ignore[assignment]
        with CheckpointManager(directory, save=EveryNSeconds(500)) as mgr:
            decisions = [mgr.should_save(step) for step in range(3)]
            print("decisions", decisions, flush=True)
        return
    if scenario == "kill":
        install_kill(os.environ["CAIRN_TEST_KILL"], procs)
    if scenario == "writer-kill":  # each trainer dies right after it handed step 2 over
        mgr = CheckpointManager(
            directory, keep=KeepLatest(2), handlers=handlers, barrier_timeout=60, writer="process"
        )
        for step in range(3):
            mgr.save(step, {"state": state(step), "config": {"lr": 0.1}})
        assert mgr._commits.remote is not None
        committed = mgr._storage.read_step(mgr._names, 2) is not None
        print(f"writer {mgr._commits.remote.pid} committed-before-kill {committed}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    with CheckpointManager(
        directory, keep=KeepLatest(2), handlers=handlers, barrier_timeout=5
    ) as mgr:
        if scenario == "resume":
            latest = mgr.latest_step()
            print("resumed", latest, mgr.all_steps(), flush=True)
            sharding = NamedSharding(mesh, P("data", "model"))
            check(mgr.restore(items={"state": target(sharding)})["state"], latest, sharding)
            mgr.save(latest + 1, {"state": state(latest + 1), "config": {"lr": 0.1}})
            mgr.wait_until_finished()
            print("steps after", mgr.all_steps(), flush=True)
            return
        for step in range(3):
            mgr.save(
                step,
                {"state": state(step), "config": {"lr": 0.1}},
                metrics={"loss": 1.0 / (step + 1)},
            )
        mgr.wait_until_finished()
        print("steps", mgr.all_steps(), flush=True)
        if scenario == "kill":
            t0 = time.monotonic()
            mgr.save(3, {"state": state(3), "config": {"lr": 0.1}})
            try:
                mgr.wait_until_finished()
            except CommitError as e:
                print(
                    f"commit failed after {time.monotonic() - t0:.1f} s: {type(e.__cause__).__name__}",
                    flush=True,
                )
            print("steps", mgr.all_steps(), flush=True)
            print(f"ok {scenario} {procs.index}", flush=True)
            os._exit(0)
        other_mesh = Mesh(np.array(jax.devices()).reshape(2 * n, 1), ("a", "b"))  # another shape
        shardings = [
            NamedSharding(mesh, spec)
            for spec in (P("data", "model"), P("model", None), P(None, "data"), P())
        ]
        shardings += [
            NamedSharding(other_mesh, spec) for spec in (P("a", None), P(None, "a"), P("a", "b"))
        ]
        for sharding in shardings:
            check(mgr.restore(2, {"state": target(sharding)})["state"], 2, sharding)
        mgr.record_metrics(2, {"eval": 0.5})
        assert mgr.metrics(2) == {"loss": 1.0 / 3, "eval": 0.5}, mgr.metrics(2)
        mgr.delete(1)
        assert mgr.all_steps() == [2], mgr.all_steps()
        mgr.save(5, {"state": state(5), "config": {"lr": 0.1}})
        mgr.delete(2)  # right after a save: the others must have re-read the directory first
        assert mgr.all_steps() == [5], mgr.all_steps()
        print("files", sorted(mgr.info(5).items["state"].files), flush=True)
        mgr.save(6, {"state": state(6), "config": {"lr": 0.1}})  # pending when the next opens
        with CheckpointManager(
            directory, handlers=handlers, barrier_timeout=5
        ) as again:  # a second one, in the same processes: it takes over
            assert again.all_steps() == [5, 6], again.all_steps()
            try:
                mgr.save(8, {"state": state(8), "config": {"lr": 0.1}})
                raise AssertionError("the superseded manager saved")
            except SupersededError:
                pass
            again.save(7, {"state": state(7), "config": {"lr": 0.1}})
            again.wait_until_finished()
            assert again.all_steps() == [5, 6, 7], again.all_steps()
    left = procs.client.key_value_dir_get("cairn/")
    print("coordination keys", sorted(k for k, _ in left if "/open/" not in k), flush=True)


if __name__ == "__main__":
    main()
