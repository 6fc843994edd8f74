"""A trainer on the Orbax drop-in, for the crash test in test_cairn_only.py.

    python dropin_crash_writer.py ROOT

Saves step 0 and waits for it, then starts an async save of step 1 (large enough that its
commit takes a while), prints ``started 1`` (flushed) and waits to be killed. Each step's
content is `expected_state(step)`, so the test can check whatever step survives.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np


def expected_state(step: int) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    return {
        "big": rng.standard_normal(4 * 1024 * 1024).astype(np.float32),  # 16 MiB
        "small": np.arange(10, dtype=np.int64) + step,
    }


def main(root: str) -> None:
    import orbax.checkpoint as ocp

    from cairn.manager.orbax import CheckpointManager

    manager = CheckpointManager(root)
    manager.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave(expected_state(0))))
    manager.wait_until_finished()
    manager.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(expected_state(1))))
    print("started 1", flush=True)
    threading.Event().wait()  # until SIGKILL


if __name__ == "__main__":
    main(sys.argv[1])
