"""Every error cairn raises on purpose, in one module.

The tree (each also subclasses the builtin in brackets, so ``except LookupError`` and friends work)::

    CairnError
    ├── StepNotFoundError         [LookupError]       no such committed step
    ├── ItemNotFoundError         [LookupError]       the step has no such item (or it was dropped)
    ├── StepAlreadyExistsError    [FileExistsError]   the step is committed or being committed
    ├── CorruptCheckpointError    [ValueError]        a file is missing, truncated or fails its checksum
    ├── MismatchError             [ValueError]        target and checkpoint disagree (structure, shape, dtype)
    ├── UnsupportedFormatError    [ValueError]        e.g. a manifest written by a newer format version
    ├── ReadOnlyError             [PermissionError]   a write on a manager opened with read_only=True
    │   └── SupersededError                           a newer writable manager of this process took over
    ├── DirectoryLockedError      [RuntimeError]      another writer holds the directory
    ├── CommitError               [RuntimeError]      a background commit failed (the original is chained)
    ├── WriterProcessError        [RuntimeError]      the writer process (writer="process") died
    │   └── WriterTimeoutError                        no sign of life within barrier_timeout; killed
    │                                                 (also a BarrierTimeoutError, so a TimeoutError)
    ├── BarrierTimeoutError       [TimeoutError]      a process did not reach a barrier in time
    └── MissingDependencyError    [ImportError]       an optional library is not installed (names the extra)

Invalid arguments raise plain ``ValueError`` / ``TypeError`` naming the argument and the value.
``cairn.manager`` re-exports all of these, so both layers raise and catch the same types.
"""

from __future__ import annotations

__all__ = [
    "BarrierTimeoutError",
    "CairnError",
    "CommitError",
    "CorruptCheckpointError",
    "DirectoryLockedError",
    "ItemNotFoundError",
    "MismatchError",
    "MissingDependencyError",
    "ReadOnlyError",
    "StepAlreadyExistsError",
    "StepNotFoundError",
    "SupersededError",
    "UnsupportedFormatError",
    "WriterProcessError",
    "WriterTimeoutError",
]


class CairnError(Exception):
    """Base class of every error cairn raises on purpose."""


class StepNotFoundError(CairnError, LookupError):
    """The requested step is not committed in the directory."""


class ItemNotFoundError(CairnError, LookupError):
    """The step exists but does not hold the requested item."""


class StepAlreadyExistsError(CairnError, FileExistsError):
    """A save was asked for a step that is already committed or in flight."""


class CorruptCheckpointError(CairnError, ValueError):
    """A committed step is damaged: the message names the step and the file."""


class MismatchError(CairnError, ValueError):
    """A restore target disagrees with the checkpoint; the message names the key path."""


class PartMismatchError(MismatchError):
    """A process's part of a local step does not hold the regions a restore reads: it was
    saved with other shardings (a local tier then restores from the persistent one)."""


class UnsupportedFormatError(CairnError, ValueError):
    """The checkpoint was written in a format (or by a handler version) this cairn cannot read."""


class ReadOnlyError(CairnError, PermissionError):
    """A write was asked of a manager opened with ``read_only=True``."""


class SupersededError(ReadOnlyError):
    """A write on a manager whose directory a newer writable manager in this process took over."""


class DirectoryLockedError(CairnError, RuntimeError):
    """Another writable manager (possibly in another process) holds the directory."""


class CommitError(CairnError, RuntimeError):
    """A background commit failed; the original exception is chained as ``__cause__``."""


class WriterProcessError(CairnError, RuntimeError):
    """The writer process of ``writer="process"`` died or could not take a save; the steps it
    had not committed are not committed (the next save starts a new writer process)."""


class BarrierTimeoutError(CairnError, TimeoutError):
    """A process did not arrive at a multi-process barrier within the timeout."""


class WriterTimeoutError(WriterProcessError, BarrierTimeoutError):
    """The writer process of ``writer="process"`` showed no sign of life (no answer, no CPU
    time, no I/O) for the barrier timeout while a save was due from it: stopped (SIGSTOP, a
    debugger) or stuck on a hung filesystem. It was killed; the step it owed is not committed
    (the next save starts a new writer process). Both a WriterProcessError and a
    BarrierTimeoutError (so a ``TimeoutError``): the same bound, the same kind of error."""


class MissingDependencyError(CairnError, ImportError):
    """An optional library a feature needs is not installed; the message names the pip extra."""
