"""One of N processes of a jax.distributed run on 127.0.0.1, for the multi-process tests.

    python mh_worker.py SCENARIO PROCESS_ID NUM_PROCESSES PORT DIR

Prints ``ok <scenario> <process id>`` at the end, or the error it expected.
"""

from __future__ import annotations

import os
import signal
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import jax


def main() -> None:
    scenario, pid, count, port, _directory = (
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
    print(f"ok {scenario} {pid}", flush=True)
    os._exit(0)  # skip jax.distributed's shutdown barrier, which would wait for a dead peer


if __name__ == "__main__":
    main()
