"""One of N processes of a jax.distributed run on 127.0.0.1, for the multi-process tests.

    python mh_worker.py SCENARIO PROCESS_ID NUM_PROCESSES PORT DIR

Prints ``ok <scenario> <process id>`` at the end, or the error it expected.
"""

from __future__ import annotations

import os
import signal
import sys
import time
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
    from cairn.manager._multihost import Processes

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
    elif scenario in ("save", "kill-0", "kill-1", "resume", "clock"):
        run_manager(scenario, procs, directory)
    elif scenario == "iterators":
        per_process_iterators(procs, directory)
    elif scenario == "preempt":
        preempt(procs, directory)
    print(f"ok {scenario} {pid}", flush=True)
    if scenario == "peer-dies" or scenario.startswith("kill"):
        os._exit(0)  # skip jax.distributed's shutdown barrier, which would wait for a dead peer
    jax.distributed.shutdown()  # both alive: leave together, so neither sees the other vanish


def per_process_iterators(procs: Any, directory: str) -> None:
    """Each process reads its own shard: each saves and restores its own iterator position."""
    import numpy as np

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from iterutil import Shuffled, advanced, take

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
    print("files", sorted(os.listdir(os.path.join(directory, "checkpoint_2", "data"))), flush=True)


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


def run_manager(scenario: str, procs: Any, directory: str) -> None:
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from cairn.handlers import JsonHandler, TrainStateHandler
    from cairn.manager import CheckpointManager, CommitError, EveryNSeconds, KeepLatest

    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    full = np.arange(64 * 48, dtype=np.float32).reshape(64, 48)

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

    class Dying(TrainStateHandler):
        """Kills this process in the middle of its write phase (victim only)."""

        def snapshot(self, obj: Any) -> Any:
            inner = super().snapshot(obj)
            victim = int(scenario[-1]) if scenario.startswith("kill") else -1

            class Snap:
                def write(self, directory: Any) -> Any:
                    records = inner.write(directory)
                    if procs.index == victim and obj["step"] == 3:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return records

            return Snap()

    handlers = {"config": JsonHandler(), "state": Dying()}
    if scenario == "clock":
        real = time.time
        skew = 1000.0 if procs.index == 1 else 0.0
        time.time = lambda: real() + skew  # type: ignore[assignment]
        with CheckpointManager(directory, save=EveryNSeconds(500)) as mgr:
            decisions = [mgr.should_save(step) for step in range(3)]
            print("decisions", decisions, flush=True)
        return
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
        if scenario.startswith("kill"):
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
        other_mesh = Mesh(np.array(jax.devices()).reshape(4, 1), ("a", "b"))  # another mesh shape
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
    with CheckpointManager(
        directory, handlers=handlers, barrier_timeout=5
    ) as again:  # a second one
        again.save(6, {"state": state(6), "config": {"lr": 0.1}})
        again.wait_until_finished()
        assert again.all_steps() == [5, 6], again.all_steps()


if __name__ == "__main__":
    main()
