"""The one protocol of foreign layouts: a read-only view of one step directory (`StepView`), which
every storage provides (a local directory here, an object store's keys in `_storage.objectstore`),
and a `Layout` that reads a step through it into a read-only manifest, or says it is not one.

A foreign step is a stranger's data: a view follows no link, reads only small files (at most
`MAX_READ` bytes, or the `limit` asked) and never a FIFO; a layout checks every name it turns
into an item and ignores bad metadata field by field, with a warning.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Protocol

from cairn.handlers.errors import CorruptCheckpointError
from cairn.handlers.io import open_regular
from cairn.manager._format import Manifest

MAX_READ = 16 << 20  # a foreign step's metadata file: Orbax's are a few KiB


class StepView(Protocol):
    """A read-only view of one step directory, whatever stores it. Relative paths are
    ``/``-separated, ``""`` the step directory itself."""

    #: where the step is (a path or a URL), for messages
    where: str
    #: whether the step's writer made it visible in one rename (a filesystem), so that a
    #: directory under a step's name is whole; on an object store, where a writer writes
    #: under the final name, only the writer's commit mark says a step is done
    renames: bool

    def entries(self, relpath: str = "") -> dict[str, bool]:
        """The entries of directory `relpath`: name -> whether it is a real directory (a link
        is not). OSError if it cannot be listed (FileNotFoundError: it is not there)."""
        ...

    def is_file(self, relpath: str) -> bool:
        """Whether `relpath` is a regular file (not a link to one)."""
        ...

    def read(self, relpath: str, limit: int = MAX_READ) -> bytes:
        """The bytes of the small file `relpath`, no link followed on the way or at the end:
        FileNotFoundError if absent, OSError or CorruptCheckpointError if it is a link, not a
        regular file, or longer than `limit` bytes."""
        ...

    def mtime(self) -> float | None:
        """When the step directory last changed (seconds since the epoch), None if the store
        does not say (object stores: their listings carry no times)."""
        ...


class Layout(Protocol):
    """A foreign checkpointer's step layout, read in place and never changed."""

    name: str  # who wrote such steps, as `StepStore.other_naming` says it

    def read(self, step: int, view: StepView) -> Manifest | None:
        """A read-only manifest for the step `view` shows, or None if it is not in this layout.
        FileNotFoundError only if the step directory itself is gone (deleted while listed)."""
        ...


def too_long(where: str, limit: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where} is longer than {limit} bytes; cairn does not read it")


def plain_parts(relpath: str) -> list[str] | None:
    """The names of a relative path, or None unless each is a plain name (not empty, ``.``,
    ``..``, and without NUL). Names are otherwise not judged here: a layout checks the names it
    turns into items."""
    parts = relpath.split("/")
    if any(p in ("", ".", "..") or "\0" in p for p in parts):
        return None
    return parts


class LocalStepView:
    """A step directory on a local filesystem."""

    renames = True

    def __init__(self, path: Path) -> None:
        self.path = path
        self.where = str(path)

    def __repr__(self) -> str:
        return f"LocalStepView({self.where!r})"

    def _path(self, relpath: str) -> Path:
        """`relpath` under the step directory, no link on the way; NotADirectoryError if it is
        not a relative path of plain names or a directory on its way is not a real one."""
        if not relpath:
            return self.path
        parts = plain_parts(relpath)
        if parts is None:
            raise NotADirectoryError(f"{self.where}: {relpath!r:.200} is not a relative path")
        path = self.path
        for part in parts[:-1]:
            path = path / part
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                raise NotADirectoryError(f"{path} is a symbolic link or not a directory")
        return path / parts[-1]

    def entries(self, relpath: str = "") -> dict[str, bool]:
        path = self._path(relpath)
        if relpath and not stat.S_ISDIR(os.lstat(path).st_mode):
            raise NotADirectoryError(f"{path} is a symbolic link or not a directory")
        with os.scandir(path) as found:
            return {e.name: e.is_dir(follow_symlinks=False) for e in found}

    def is_file(self, relpath: str) -> bool:
        try:
            return stat.S_ISREG(os.lstat(self._path(relpath)).st_mode)
        except OSError:
            return False

    def read(self, relpath: str, limit: int = MAX_READ) -> bytes:
        path = self._path(relpath)
        with os.fdopen(open_regular(path), "rb") as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise too_long(str(path), limit)
        return data

    def mtime(self) -> float | None:
        return os.lstat(self.path).st_mtime
