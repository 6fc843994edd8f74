"""Save, load and transfer hooks: the torch defaults, the registries (`DEFAULT_SAVE_HOOKS` ...,
filled with torch's classes only once the program imported torch), the method markers and
`register_checkpoint_hooks`, the lookup through cairn's registry and SpeechBrain's, and cairn's
own savers for recoverables without a hook (state methods, pytrees restored in place).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import pathlib
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from cairn.handlers.errors import CorruptCheckpointError
from cairn.handlers.io import decode_state, optional

log = logging.getLogger("cairn")


def torch_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """Default save hook of torch modules, optimizers, schedulers, grad scalers: the state_dict.

    Inside a cairn Checkpointer this hook is not called as such: the state_dict is copied to the
    CPU inside save_checkpoint and written with ``torch.save`` on the commit thread.
    """
    torch = optional("torch", feature="torch_save")
    state_dict = obj.state_dict()
    if not state_dict:
        log.warning("cairn.speechbrain: saving an empty state_dict for %r in %s", obj, path)
    torch.save(state_dict, path)


def _load_state_dict(path: str | os.PathLike[str]) -> Any:
    return _torch_load(path, "cpu")


def _torch_load(path: str | os.PathLike[str], map_location: Any) -> Any:
    """``torch.load`` of a paramfile, data only (no pickled code); a file torch cannot read is
    CorruptCheckpointError naming it, whatever torch raises for it.

    torch's readers raise what a damaged file makes their code hit (IndexError, struct.error,
    AssertionError, KeyError, TypeError ... for a truncated or edited legacy file), so every
    Exception but OSError (the file cannot be opened or read: not its content) counts.
    MemoryError too: torch may try to allocate a size the file claims before finding that the
    file does not hold it; a genuine file too large for this machine's memory is reported the
    same way, and the message names the error."""
    torch = optional("torch", feature="loading a torch paramfile")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except OSError:
        raise
    except Exception as e:  # the file's content: map_location is always "cpu" here
        raise CorruptCheckpointError(
            f"{path}: torch cannot load it: {type(e).__name__}: {e}"
        ) from None


def torch_recovery(obj: Any, path: str | os.PathLike[str], end_of_epoch: bool) -> None:
    """Default load hook of torch objects: ``load_state_dict`` of the file (strict when it can)."""
    del end_of_epoch
    state_dict = _load_state_dict(path)
    try:
        obj.load_state_dict(state_dict, strict=True)
    except TypeError:  # optimizers and schedulers take no `strict`
        obj.load_state_dict(state_dict)


def torch_parameter_transfer(obj: Any, path: str | os.PathLike[str]) -> None:
    """Non-strict load of a module's parameters; missing and unexpected keys are logged."""
    incompatible = obj.load_state_dict(_load_state_dict(path), strict=False)
    for key in incompatible.missing_keys:
        log.warning("parameter transfer to %r from %s: no parameters for %r", obj, path, key)
    for key in incompatible.unexpected_keys:
        log.warning("parameter transfer to %r from %s: %r is not used", obj, path, key)


_TORCH_DEFAULTS: dict[
    str, dict[str, Callable[..., Any]]
] = {  # class names, so that torch is imported only by programs that use it
    "save": {
        "torch.nn.Module": torch_save,
        "torch.optim.Optimizer": torch_save,
        "torch.optim.lr_scheduler.LRScheduler": torch_save,
        "torch.optim.lr_scheduler.ReduceLROnPlateau": torch_save,
        "torch.amp.grad_scaler.GradScaler": torch_save,
    },
    "load": {
        "torch.nn.Module": torch_recovery,
        "torch.optim.Optimizer": torch_recovery,
        "torch.optim.lr_scheduler.LRScheduler": torch_recovery,
        "torch.optim.lr_scheduler.ReduceLROnPlateau": torch_recovery,
        "torch.amp.grad_scaler.GradScaler": torch_recovery,
    },
    "transfer": {"torch.nn.Module": torch_parameter_transfer},
}


class _DefaultHooks(dict[type, Callable[..., Any]]):
    """class -> hook. The torch classes are added the first time the dict is used after torch
    was imported (a program with torch objects has imported it), so importing cairn never
    imports torch; entries the program sets itself are never replaced."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self._kind = kind
        self._filled = False

    def _fill(self) -> None:
        if self._filled or "torch" not in sys.modules:
            return
        self._filled = True
        import importlib

        for dotted, hook in _TORCH_DEFAULTS[self._kind].items():
            module, _, name = dotted.rpartition(".")
            with contextlib.suppress(ImportError, AttributeError):
                cls = getattr(importlib.import_module(module), name)
                super().setdefault(cls, hook)

    def __getitem__(self, key: Any) -> Any:
        self._fill()
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self._fill()
        return super().__contains__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self._fill()
        return super().get(key, default)

    def __iter__(self) -> Iterator[Any]:
        self._fill()
        return super().__iter__()

    def __len__(self) -> int:
        self._fill()
        return super().__len__()

    def items(self) -> Any:
        self._fill()
        return super().items()

    def keys(self) -> Any:
        self._fill()
        return super().keys()

    def values(self) -> Any:
        self._fill()
        return super().values()


DEFAULT_SAVE_HOOKS: dict[type, Callable[..., Any]] = _DefaultHooks("save")
DEFAULT_LOAD_HOOKS: dict[type, Callable[..., Any]] = _DefaultHooks("load")
DEFAULT_TRANSFER_HOOKS: dict[type, Callable[..., Any]] = _DefaultHooks("transfer")


def _mark(method: Callable[..., Any], args: tuple[Any, ...], message: str, attr: str) -> Any:
    try:
        inspect.signature(method).bind(object(), pathlib.Path("testpath"), *args)
    except TypeError:
        raise TypeError(message) from None
    setattr(method, attr, True)
    return method


def mark_as_saver(method: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a method ``(self, path)`` as its class's save hook (with @register_checkpoint_hooks)."""
    message = "Checkpoint saver must match signature (instance, path)"
    return _mark(method, (), message, "_speechbrain_saver")


def mark_as_loader(method: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a method ``(self, path, end_of_epoch)`` as its class's load hook."""
    message = "Checkpoint loader must have signature (self, path, end_of_epoch)"
    return _mark(method, (True,), message, "_speechbrain_loader")


def mark_as_transfer(method: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a method ``(self, path)`` as its class's parameter-transfer hook."""
    message = "Transfer hook must have signature (self, path)"
    return _mark(method, (), message, "_speechbrain_transfer")


def register_checkpoint_hooks(cls: type, save_on_main_only: bool = True) -> type:
    """Class decorator: make the methods marked with mark_as_saver/loader/transfer the class's
    default hooks (found through the MRO, so subclasses get them too).

    `save_on_main_only` is accepted for compatibility; cairn's savers run where save is called.
    """
    del save_on_main_only
    for method in cls.__dict__.values():
        if getattr(method, "_speechbrain_saver", False):
            DEFAULT_SAVE_HOOKS[cls] = method
        if getattr(method, "_speechbrain_loader", False):
            DEFAULT_LOAD_HOOKS[cls] = method
        if getattr(method, "_speechbrain_transfer", False):
            DEFAULT_TRANSFER_HOOKS[cls] = method
    return cls


def get_default_hook(obj: Any, default_hooks: Mapping[type, Callable[..., Any]]) -> Any:
    """The hook registered for `obj`'s class or the nearest base class (MRO), or None."""
    for cls in inspect.getmro(type(obj)):
        if cls in default_hooks:
            return default_hooks[cls]
    return None


_SB_CHECKPOINTS = "speechbrain.utils.checkpoints"
_OURS = {"save": DEFAULT_SAVE_HOOKS, "load": DEFAULT_LOAD_HOOKS, "transfer": DEFAULT_TRANSFER_HOOKS}


def _speechbrain_hooks(kind: str) -> Mapping[type, Callable[..., Any]]:
    """SpeechBrain's own registry of `kind` hooks (its ``DEFAULT_SAVE_HOOKS`` ...), where classes
    decorated with its ``register_checkpoint_hooks`` are; empty unless the program imported
    speechbrain's checkpoints module (a class registered there has: the decorator lives in it),
    so cairn never imports speechbrain itself."""
    module = sys.modules.get(_SB_CHECKPOINTS)
    hooks = getattr(module, f"DEFAULT_{kind.upper()}_HOOKS", None)
    return hooks if isinstance(hooks, Mapping) else {}


def _from_speechbrain(hook: Any, kind: str) -> Any:
    """A hook of SpeechBrain's registry as cairn runs it: SpeechBrain's torch hooks become
    cairn's (the state_dict copied in the snapshot, ``weights_only`` loads), and a save hook that
    ``register_checkpoint_hooks`` wrapped in ``main_process_only`` is unwrapped: cairn already runs
    save hooks on the main process only, and the wrapper's broadcast would wait for processes
    that never call it."""
    module = sys.modules.get(_SB_CHECKPOINTS)
    same = {
        "save": ("torch_save", "torch_save_once_per_node"),
        "load": ("torch_recovery",),
        "transfer": ("torch_parameter_transfer",),
    }[kind]
    if any(hook is getattr(module, name, None) for name in same):
        return {"save": torch_save, "load": torch_recovery, "transfer": torch_parameter_transfer}[
            kind
        ]
    wrapped = getattr(hook, "__wrapped__", None)
    if kind == "save" and getattr(hook, "_speechbrain_saver", False) and callable(wrapped):
        return wrapped
    return hook


def _find_hook(obj: Any, kind: str) -> Any:
    """The default `kind` hook of `obj`: of its class or the nearest base class (MRO) in cairn's
    registry or in SpeechBrain's (at each class, cairn's first), or None."""
    ours, theirs = _OURS[kind], _speechbrain_hooks(kind)
    for cls in inspect.getmro(type(obj)):
        if cls in ours:
            return ours[cls]
        if cls in theirs:
            return _from_speechbrain(theirs[cls], kind)
    return None


# ---------------------------------------------------------------------------- cairn's savers


def _is_pytree(obj: Any) -> bool:
    if isinstance(obj, (dict, list, np.ndarray)):
        return True
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(obj, jax.Array)


def _state_load(obj: Any, path: pathlib.Path, end_of_epoch: bool) -> None:
    del end_of_epoch
    try:
        state = decode_state(json.loads(pathlib.Path(path).read_bytes())["state"])
    except (ValueError, KeyError, TypeError, RecursionError, OverflowError) as e:
        raise CorruptCheckpointError(f"{path}: the saved state does not parse: {e}") from None
    setter = "set_state" if callable(getattr(obj, "set_state", None)) else "load_state_dict"
    getattr(obj, setter)(state)


def _assign(obj: Any, value: Any, where: str) -> None:
    """Put `value` into the mutable pytree `obj` in place (dicts, lists, NumPy arrays)."""
    if isinstance(obj, dict) and isinstance(value, Mapping):
        for key in list(obj):
            if key not in value:
                del obj[key]
        for key, v in value.items():
            if key in obj and isinstance(obj[key], (dict, list, np.ndarray)):
                _assign(obj[key], v, f"{where}[{key!r}]")
            else:
                obj[key] = v
    elif isinstance(obj, list) and isinstance(value, (list, tuple)):
        obj[:] = list(value)
    elif isinstance(obj, np.ndarray) and obj.shape == np.shape(value):
        obj[...] = value
    else:
        raise TypeError(
            f"{where}: a {type(obj).__qualname__} cannot be restored in place; give recoverables "
            "that are mutable containers (a dict of arrays, a list, a NumPy array)"
        )


def _check_hooks(hooks: Mapping[str, Any]) -> dict[str, Callable[..., Any]]:
    if not isinstance(hooks, Mapping):
        raise TypeError(f"hooks must be a mapping of recoverable name to function, got {hooks!r}")
    for name, hook in hooks.items():
        if not callable(hook):
            raise TypeError(f"the hook for {name!r} is not callable: {hook!r}")
    return dict(hooks)
