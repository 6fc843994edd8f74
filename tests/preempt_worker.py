"""A training loop that saves when preempted: python preempt_worker.py DIR PAUSE_AT [WRITER].

It prints each save, pauses at step PAUSE_AT until a line arrives on stdin (the test sends SIGTERM
meanwhile), and stops at the step where the manager reports the preemption.
"""

from __future__ import annotations

import sys

import numpy as np

from cairn.manager import AnyOf, CheckpointManager, EveryNSteps, OnPreemption


def main() -> None:
    directory, pause_at = sys.argv[1], int(sys.argv[2])
    writer = sys.argv[3] if len(sys.argv) > 3 else "thread"
    state = {"w": np.zeros(4)}
    save = AnyOf(EveryNSteps(100), OnPreemption())
    with CheckpointManager(directory, save=save, writer=writer) as mgr:
        for step in range(1, 1000):
            state = {"w": state["w"] + step}
            if mgr.should_save(step):
                mgr.save(step, {"state": state})
                print(f"saved {step} committed {mgr.all_steps()}", flush=True)
            if mgr.reached_preemption(step):
                print(f"preempted at {step}", flush=True)
                return
            if step == pause_at:
                print("paused", flush=True)
                sys.stdin.readline()
    print("never preempted", flush=True)


if __name__ == "__main__":
    main()
