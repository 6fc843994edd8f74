"""One of 2 torch.distributed (gloo) processes using cairn's SpeechBrain Checkpointer, as a DDP
recipe does: python sb_ddp_worker.py RANK PORT DIR. Prints what it saw. Its EpochCounter is
SpeechBrain's own (a save hook that register_checkpoint_hooks wrapped in main_process_only, whose
broadcast would wait for the other process if cairn did not unwrap it)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from speechbrain.utils.epoch_loop import EpochCounter

from cairn.manager.speechbrain import Checkpointer


def main() -> None:
    rank, port, directory = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = torch.nn.Linear(2, 2)
    counter = EpochCounter(100)
    checkpointer = Checkpointer(directory, {"model": model, "counter": counter})
    resumed = checkpointer.recover_if_possible()
    print("resumed", None if resumed is None else resumed.meta["epoch"], flush=True)
    print("counter", counter.current, flush=True)
    start = 0 if resumed is None else resumed.meta["epoch"] + 1
    for epoch in range(start, start + 3):
        with torch.no_grad():
            model.weight.fill_(float(epoch))
        counter.current = epoch + 1
        saved = checkpointer.save_and_keep_only(meta={"epoch": epoch}, num_to_keep=1)
        assert saved is None
        listed = [c.meta["epoch"] for c in checkpointer.list_checkpoints()]
        print("epoch", epoch, "listed", listed, flush=True)
    checkpointer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
