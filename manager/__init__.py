"""cairn.manager: when and whether to save, the crash-safe commit, retention, metrics, restore.

from cairn.manager import CheckpointManager, EveryNSteps, KeepLatest
"""

from cairn.manager import errors, orbax, speechbrain, t5x
from cairn.manager._core.manager import CheckpointManager, ItemInfo, StepInfo
from cairn.manager._core.policies import (
    AnyOf,
    AtSteps,
    EveryNSeconds,
    EveryNSteps,
    KeepAll,
    KeepBest,
    KeepEvery,
    KeepLatest,
    KeepPolicy,
    OnPreemption,
    SaveContext,
    SavePolicy,
    StepView,
)
from cairn.manager._core.tiers import LocalTier
from cairn.manager._format import FORMAT_VERSION
from cairn.manager.errors import (
    BarrierTimeoutError,
    CairnError,
    CommitError,
    CorruptCheckpointError,
    DirectoryLockedError,
    ItemNotFoundError,
    MismatchError,
    MissingDependencyError,
    PartMismatchError,
    ReadOnlyError,
    StepAlreadyExistsError,
    StepNotFoundError,
    SupersededError,
    UnsupportedFormatError,
    WriterProcessError,
    WriterTimeoutError,
)

__all__ = [
    "FORMAT_VERSION",
    "AnyOf",
    "AtSteps",
    "BarrierTimeoutError",
    "CairnError",
    "CheckpointManager",
    "CommitError",
    "CorruptCheckpointError",
    "DirectoryLockedError",
    "EveryNSeconds",
    "EveryNSteps",
    "ItemInfo",
    "ItemNotFoundError",
    "KeepAll",
    "KeepBest",
    "KeepEvery",
    "KeepLatest",
    "KeepPolicy",
    "LocalTier",
    "MismatchError",
    "MissingDependencyError",
    "OnPreemption",
    "PartMismatchError",
    "ReadOnlyError",
    "SaveContext",
    "SavePolicy",
    "StepAlreadyExistsError",
    "StepInfo",
    "StepNotFoundError",
    "StepView",
    "SupersededError",
    "UnsupportedFormatError",
    "WriterProcessError",
    "WriterTimeoutError",
    "errors",
    "orbax",
    "speechbrain",
    "t5x",
]
