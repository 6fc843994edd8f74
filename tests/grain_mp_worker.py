"""A grain pipeline with multiprocess prefetch (2 worker processes), saved and restored by cairn.

    python grain_mp_worker.py DIR

Grain's workers read absl flags: outside absl.app.run the program marks them parsed first.
Prints ``equal True`` when the restored iterator continues with the elements that followed the save.
"""

from __future__ import annotations

import sys

import grain
from absl import flags

from cairn.manager import CheckpointManager


def double(x: int) -> int:
    return x * 2


def pipeline() -> grain.IterDataset:
    ds = grain.MapDataset.range(1000).shuffle(seed=1).map(double).to_iter_dataset()
    return ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2)).batch(4)


if __name__ == "__main__":
    flags.FLAGS.mark_as_parsed()
    with CheckpointManager(sys.argv[1]) as mgr:
        it = iter(pipeline())
        for _ in range(6):
            next(it)
        mgr.save(1, {"data": it})  # the registry picks GrainIteratorHandler
        expect = [next(it).tolist() for _ in range(3)]
        fresh = iter(pipeline())
        mgr.restore(1, {"data": fresh})
        got = [next(fresh).tolist() for _ in range(3)]
        print("equal", got == expect, mgr.info(1).items["data"].handler, flush=True)
