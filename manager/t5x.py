"""T5X's checkpoint API on cairn: change ``from t5x import checkpoints`` to
``from cairn.manager import t5x as checkpoints`` (docs/migrating-from-t5x.md).
"""

from cairn.manager._surfaces.t5x.checkpointers import (
    Checkpointer,
    DatasetCheckpointHandler,
    SaveBestCheckpointer,
)
from cairn.manager._surfaces.t5x.directories import (
    all_dataset_checkpoint_steps,
    all_steps,
    find_checkpoint,
    get_checkpoint_dir,
    get_step_from_checkpoint_dir,
    latest_step,
    load_t5x_checkpoint,
)
from cairn.manager._surfaces.t5x.orbax_wrapper import OrbaxCheckpointManagerInterface
from cairn.manager._surfaces.t5x.state import LazyArray
from cairn.manager._surfaces.t5x.tfevents import populate_metrics_for_steps

__all__ = [
    "Checkpointer",
    "DatasetCheckpointHandler",
    "LazyArray",
    "OrbaxCheckpointManagerInterface",
    "SaveBestCheckpointer",
    "all_dataset_checkpoint_steps",
    "all_steps",
    "find_checkpoint",
    "get_checkpoint_dir",
    "get_step_from_checkpoint_dir",
    "latest_step",
    "load_t5x_checkpoint",
    "populate_metrics_for_steps",
]
