"""The error tree of cairn (defined in cairn.handlers.errors, the lower layer; see its docstring)."""

from cairn.handlers.errors import (
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
    "BarrierTimeoutError",
    "CairnError",
    "CommitError",
    "CorruptCheckpointError",
    "DirectoryLockedError",
    "ItemNotFoundError",
    "MismatchError",
    "MissingDependencyError",
    "PartMismatchError",
    "ReadOnlyError",
    "StepAlreadyExistsError",
    "StepNotFoundError",
    "SupersededError",
    "UnsupportedFormatError",
    "WriterProcessError",
    "WriterTimeoutError",
]
