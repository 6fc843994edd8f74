"""SpeechBrainHandler: one recoverable of a SpeechBrain-style Checkpointer as ``<name>.ckpt``.

cairn.manager.speechbrain's Checkpointer hands each recoverable that is not a pytree to the
manager as a `SpeechBrainRecoverable`; this handler writes it as the single file SpeechBrain's
hooks and ``torch.load`` read: a torch ``state_dict`` (copied to the CPU in the snapshot and
serialised on the commit thread), a ``get_state()``/``state_dict()`` state as JSON
(`encode_state`), or the file a custom save hook wrote. Restore verifies the files and returns
the path of ``<name>.ckpt``; the Checkpointer's load hooks read it. Registered with the other
built-in handlers (by its type and by its id, ``cairn.speechbrain``), so any reader, one that
never built a Checkpointer included, restores and verifies such steps. torch is imported only
when a torch object is saved.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import os
import pathlib
from collections.abc import Callable, Sequence
from typing import Any, Literal

from cairn.handlers._files import Destination, FileRecord, StoredItem, as_destination
from cairn.handlers._iterators import encode_state
from cairn.handlers._optional import optional

__all__ = ["SpeechBrainHandler", "SpeechBrainRecoverable"]


@dataclasses.dataclass(frozen=True)
class SpeechBrainRecoverable:
    """One recoverable as the SpeechBrain Checkpointer hands it to the manager.

    `kind` says how it is saved: ``"torch"`` (its ``state_dict()`` through ``torch.save``),
    ``"state"`` (``get_state()``, else ``state_dict()``, as JSON) or ``"hook"`` (`hook(obj,
    path)` writes the file itself, on the caller's thread, into `staging`, a directory of its
    own that the write phase moves the file out of).
    """

    name: str
    obj: Any
    kind: Literal["torch", "state", "hook"]
    hook: Callable[..., Any] | None
    staging: pathlib.Path


def _state_dict_on_cpu(obj: Any) -> Any:
    """A copy of ``obj.state_dict()`` whose tensors are detached CPU copies (a snapshot)."""
    torch = optional("torch", feature="saving a torch recoverable")

    def copy_value(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.detach().to("cpu", copy=True)
        if isinstance(value, dict):
            return type(value)((k, copy_value(v)) for k, v in value.items())
        if isinstance(value, list):
            return [copy_value(v) for v in value]
        if isinstance(value, tuple):
            return tuple(copy_value(v) for v in value)
        return copy.deepcopy(value)

    return copy_value(obj.state_dict())


class _Written:
    """The snapshot of a recoverable: bytes to write as ``<name>.ckpt``, or a file a hook wrote."""

    def __init__(self, name: str, data: Any = None, staged: pathlib.Path | None = None) -> None:
        self._name, self._data, self._staged = name, data, staged

    def write(self, dest: Destination | pathlib.Path) -> Sequence[FileRecord]:
        dest = as_destination(dest)
        target = f"{self._name}{SpeechBrainHandler.paramfile_ext}"
        if self._staged is None:
            data = self._data
            if not isinstance(data, bytes):  # a state_dict: serialised here, off the caller
                torch = optional("torch", feature="saving a torch recoverable")
                buffer = io.BytesIO()
                torch.save(data, buffer)
                data = buffer.getvalue()
            return [dest.write_file(target, data)]
        # A hook's own file (or directory): moved into the item's local directory, hashed and
        # (for an object store) uploaded by the destination.
        directory = dest.local_directory()
        os.replace(self._staged, directory / target)
        with contextlib.suppress(OSError):
            self._staged.parent.rmdir()  # the hook's own staging directory, now empty
        path = directory / target
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        return [FileRecord(p.relative_to(directory).as_posix(), p.stat().st_size) for p in files]


class SpeechBrainHandler:
    """Writes one `SpeechBrainRecoverable` as ``<name>.ckpt``; restore verifies the item's files
    and returns the path of ``<name>.ckpt`` (a target is ignored: the load hooks read the file).
    """

    id = "cairn.speechbrain"
    version = 1
    paramfile_ext = ".ckpt"
    """The suffix of a recoverable's file, as in SpeechBrain."""

    def snapshot(self, rec: SpeechBrainRecoverable) -> _Written:
        if rec.kind == "torch":
            return _Written(rec.name, _state_dict_on_cpu(rec.obj))
        if rec.kind == "state":
            getter = "get_state" if callable(getattr(rec.obj, "get_state", None)) else "state_dict"
            state = encode_state(getattr(rec.obj, getter)())
            return _Written(rec.name, json.dumps({"state": state}, allow_nan=False).encode())
        assert rec.hook is not None
        rec.staging.mkdir(parents=True)
        path = rec.staging / f"{rec.name}{self.paramfile_ext}"
        rec.hook(rec.obj, path)  # the hook writes the object's file now, on the caller thread
        others = sorted(p.name for p in rec.staging.iterdir() if p != path)
        if not path.exists() or others:
            raise RuntimeError(
                f"the save hook of {rec.name!r} ({rec.hook!r}) must write exactly the path it is "
                f"given ({path.name}); it wrote {others or 'nothing'}"
            )
        return _Written(rec.name, staged=path)

    def restore(self, stored: StoredItem, target: Any = None) -> Any:
        del target
        for relpath in stored.files:
            stored.read_bytes(relpath)  # verified
        return stored.directory / f"{stored.name}{self.paramfile_ext}"

    def describe(self, stored: StoredItem) -> dict[str, Any]:
        return {"kind": "speechbrain", "bytes": sum(r.size for r in stored.files.values())}

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
