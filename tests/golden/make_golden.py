"""Writes tests/golden/v1, the checkpoint that pins format version 1. Run only for a new version.

python tests/golden/make_golden.py tests/golden/vN
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from cairn.handlers import JsonHandler, NumpyTreeHandler, TrainStateHandler
from cairn.manager import CheckpointManager


def golden_state() -> dict[str, object]:
    return {
        "params": {
            "dense/kernel": np.arange(12, dtype=np.float32).reshape(3, 4),
            "bias": np.ones(4, np.float16),
        },
        "opt": [np.int64(3), (1.5, None, "adam")],
        "step": 20,
    }


if __name__ == "__main__":
    root = Path(sys.argv[1])
    state_handler = {"numpy_tree": NumpyTreeHandler, "train_state": TrainStateHandler}[
        sys.argv[2]
    ]()
    handlers = {"config": JsonHandler(), "state": state_handler}
    with CheckpointManager(root, async_save=False, handlers=handlers) as mgr:
        for step in (10, 20):
            mgr.save(
                step,
                {"state": golden_state(), "config": {"lr": 0.1}},
                metrics={"loss": 1.0 / step},
                metadata={"git": "golden"},
            )
        mgr.record_metrics(20, {"eval_loss": 0.25})
    (root / ".cairn.lock").unlink()
