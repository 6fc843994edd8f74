"""cairn.handlers: what is saved and how, one handler per kind of item.

The two-phase `Handler` protocol (snapshot on the caller's thread, write on the commit thread),
the type registry, the built-in handlers and the error tree. Never imports cairn.manager.
"""

import numpy as _np

from cairn.handlers import _iterators, errors, io
from cairn.handlers._files import (
    ChecksummedFile,
    Destination,
    FileRecord,
    LocalDestination,
    LocalSource,
    Source,
    StoredItem,
    write_file,
    writing_as,
    writing_process,
)
from cairn.handlers._iterators import (
    GrainIteratorHandler,
    StatefulIteratorHandler,
    TfDataIteratorHandler,
    TfDataIteratorState,
)
from cairn.handlers._json import JsonHandler
from cairn.handlers._memory import InMemoryHandler
from cairn.handlers._numpy_tree import NumpyTreeHandler
from cairn.handlers._orbax import OrbaxDatasetHandler, OrbaxJsonHandler, OrbaxPyTreeHandler
from cairn.handlers._protocol import Handler, Snapshot
from cairn.handlers._registry import handler_by_id, handler_for, register, registered_types
from cairn.handlers._registry import register_by_methods as _register_by_methods
from cairn.handlers._speechbrain import SpeechBrainHandler, SpeechBrainRecoverable
from cairn.handlers._torch import TORCH_TYPES as _TORCH_TYPES
from cairn.handlers._torch import TorchStateHandler
from cairn.handlers._train_state import LazyArray, TrainStateHandler, TrainStateRestore

__all__ = [
    "ChecksummedFile",
    "Destination",
    "FileRecord",
    "GrainIteratorHandler",
    "Handler",
    "InMemoryHandler",
    "JsonHandler",
    "LazyArray",
    "LocalDestination",
    "LocalSource",
    "NumpyTreeHandler",
    "OrbaxDatasetHandler",
    "OrbaxJsonHandler",
    "OrbaxPyTreeHandler",
    "Snapshot",
    "Source",
    "SpeechBrainHandler",
    "SpeechBrainRecoverable",
    "StatefulIteratorHandler",
    "StoredItem",
    "TfDataIteratorHandler",
    "TfDataIteratorState",
    "TorchStateHandler",
    "TrainStateHandler",
    "TrainStateRestore",
    "errors",
    "handler_by_id",
    "handler_for",
    "io",
    "register",
    "registered_types",
    "write_file",
    "writing_as",
    "writing_process",
]

# Built-in defaults. JsonHandler is known by id only: it is never picked from an item's type, only
# named in handlers= (or found by id when a step it wrote is restored).
# NumpyTreeHandler stays known by id, so steps it wrote restore.
register(TrainStateHandler(), dict, list, tuple, int, float, complex, _np.ndarray, _np.generic)
register(NumpyTreeHandler())
register(JsonHandler())
for _orbax in (OrbaxPyTreeHandler(), OrbaxJsonHandler(), OrbaxDatasetHandler()):
    register(_orbax)  # by id: they read the items of Orbax steps
# Iterators: by type name (TensorFlow and grain load only when one is saved), then by methods.
register(TfDataIteratorHandler(), *_iterators.TF_TYPES)
register(GrainIteratorHandler(), *_iterators.GRAIN_TYPES)
_register_by_methods(StatefulIteratorHandler(), _iterators.has_state_methods)
# The recoverables of cairn.manager.speechbrain's Checkpointer; by id, any reader restores them.
register(SpeechBrainHandler(), SpeechBrainRecoverable)
# torch modules, optimizers, schedulers and tensors, by type name (torch loads when one is saved).
register(TorchStateHandler(), *_TORCH_TYPES)
