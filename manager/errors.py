"""The error tree of cairn (defined in cairn.handlers.errors, the lower layer; see its docstring)."""

from cairn.handlers.errors import (
    BarrierTimeoutError,
    CairnError,
    CommitError,
    CorruptCheckpointError,
    DirectoryLockedError,
    ItemNotFoundError,
    MismatchError,
    ReadOnlyError,
    StepAlreadyExistsError,
    StepNotFoundError,
    UnsupportedFormatError,
)

__all__ = [
    "BarrierTimeoutError",
    "CairnError",
    "CommitError",
    "CorruptCheckpointError",
    "DirectoryLockedError",
    "ItemNotFoundError",
    "MismatchError",
    "ReadOnlyError",
    "StepAlreadyExistsError",
    "StepNotFoundError",
    "UnsupportedFormatError",
]
