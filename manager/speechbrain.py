"""SpeechBrain's recoverables API on cairn: change
``from speechbrain.utils.checkpoints import ...`` to ``from cairn.manager.speechbrain import ...``
(docs/migrating-from-speechbrain.md).
"""

from cairn.manager._layouts.speechbrain import CKPT_PREFIX, METAFNAME, PARAMFILE_EXT, Checkpoint
from cairn.manager._surfaces.speechbrain.averaging import average_checkpoints, average_state_dicts
from cairn.manager._surfaces.speechbrain.checkpointer import Checkpointer
from cairn.manager._surfaces.speechbrain.hooks import (
    DEFAULT_LOAD_HOOKS,
    DEFAULT_SAVE_HOOKS,
    DEFAULT_TRANSFER_HOOKS,
    get_default_hook,
    mark_as_loader,
    mark_as_saver,
    mark_as_transfer,
    register_checkpoint_hooks,
    torch_parameter_transfer,
    torch_recovery,
    torch_save,
)
from cairn.manager._surfaces.speechbrain.meta import ckpt_recency

__all__ = [
    "CKPT_PREFIX",
    "DEFAULT_LOAD_HOOKS",
    "DEFAULT_SAVE_HOOKS",
    "DEFAULT_TRANSFER_HOOKS",
    "METAFNAME",
    "PARAMFILE_EXT",
    "Checkpoint",
    "Checkpointer",
    "average_checkpoints",
    "average_state_dicts",
    "ckpt_recency",
    "get_default_hook",
    "mark_as_loader",
    "mark_as_saver",
    "mark_as_transfer",
    "register_checkpoint_hooks",
    "torch_parameter_transfer",
    "torch_recovery",
    "torch_save",
]
