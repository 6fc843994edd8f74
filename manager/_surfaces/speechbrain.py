"""SpeechBrain's recoverables API on top of CheckpointManager (public as cairn.manager.speechbrain).

Names, signatures and documented behaviour follow ``speechbrain.utils.checkpoints``; the
differences (atomic, verified and optionally asynchronous saves; meta parsed as data; no mutable
defaults; checkpoints ordered by a sequence number) are in docs/migrating-from-speechbrain.md.

A checkpoint is a cairn step ``CKPT_<sequence>/`` whose manifest holds the meta; each recoverable
is an item directory holding ``<name>.ckpt`` (written by its save hook, or by cairn's own torch /
state / pytree savers), so `Checkpoint.paramfiles` point at files that ``torch.load`` and the
hooks read as in SpeechBrain. Checkpoints written by SpeechBrain itself (``CKPT+*/CKPT.yaml``) are
listed, loaded and deleted too, their meta read as YAML data only. Such a directory is untrusted
input: no link in it is followed, its meta must be a small plain YAML mapping with a "unixtime"
and an "end-of-epoch", and its paramfiles must be regular files inside it; a directory that is not
is skipped with a warning, and the other checkpoints stay reachable.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import json
import logging
import math
import os
import pathlib
import re
import shutil
import stat
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from cairn.handlers import SpeechBrainHandler, SpeechBrainRecoverable
from cairn.handlers.errors import (
    CorruptCheckpointError,
    MissingDependencyError,
    StepNotFoundError,
    UnsupportedFormatError,
)
from cairn.handlers.io import decode_state, encode_state, has_state_methods, open_regular, optional
from cairn.manager._core.manager import CheckpointManager
from cairn.manager._format import item_name_problem, trash_name

log = logging.getLogger("cairn")

CKPT_PREFIX = "CKPT"
METAFNAME = f"{CKPT_PREFIX}.yaml"  # the meta file of SpeechBrain's own checkpoints (read only)
PARAMFILE_EXT = SpeechBrainHandler.paramfile_ext  # ".ckpt"
_META_ITEM = "CKPT.meta"  # holds the meta of a checkpoint without recoverables
_STEP_DIR = re.compile(rf"{CKPT_PREFIX}_([0-9]+)")

Checkpoint = collections.namedtuple("Checkpoint", ["path", "meta", "paramfiles"])
Checkpoint.__doc__ = """One saved checkpoint: `path` (pathlib.Path of its directory), `meta` (a dict;
"unixtime" and "end-of-epoch" always, plus what was given to save) and `paramfiles` (recoverable
name -> pathlib.Path of its saved file). Hashed by path, so checkpoints make sets."""
Checkpoint.__hash__ = lambda self: hash(self[0])  # type: ignore[method-assign]


def ckpt_recency(ckpt: Checkpoint) -> tuple[int, float]:
    """Recency as an importance key: the save sequence number, then the save time.

    cairn numbers its checkpoints in save order, so two saves within one clock tick, or a clock
    that stepped back, still sort right. SpeechBrain's own checkpoints (no number) sort before
    cairn's, by their "unixtime".
    """
    match = _STEP_DIR.fullmatch(pathlib.Path(ckpt.path).name)
    return (int(match.group(1)) if match else -1, float(ckpt.meta["unixtime"]))


# ---------------------------------------------------------------------------- hooks


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


# ---------------------------------------------------------------------------- the Checkpointer


class Checkpointer:
    """SpeechBrain's Checkpointer: saves named recoverables together and recovers them.

    Every save is one cairn step: written completely, then committed atomically (a crash leaves
    the previous checkpoints and no partial one), with checksums verified on load. With
    ``async_save=True`` the files are written and committed in the background: save_checkpoint
    returns after the objects' state is captured (torch state_dicts are copied to the CPU; custom
    hooks still run at once), and listing, loading and deleting wait for pending saves.

    Recoverables are saved, in order of preference, by a custom save hook, a default hook for
    their class (DEFAULT_SAVE_HOOKS, @register_checkpoint_hooks; torch modules, optimizers,
    schedulers and grad scalers by default), ``get_state()``/``set_state()`` or
    ``state_dict()``/``load_state_dict()`` (kept as JSON with arrays and bytes), or, for dicts,
    lists and NumPy arrays of a JAX/NumPy pytree, cairn's train-state handler (restored in place).
    Recoverable names become item names: letters, digits, ``_``, ``-`` and ``.``.
    """

    def __init__(
        self,
        checkpoints_dir: str | os.PathLike[str],
        recoverables: Mapping[str, Any] | None = None,
        custom_load_hooks: Mapping[str, Callable[..., Any]] | None = None,
        custom_save_hooks: Mapping[str, Callable[..., Any]] | None = None,
        allow_partial_load: bool = False,
        *,
        async_save: bool = False,
    ) -> None:
        if not isinstance(allow_partial_load, bool):
            raise TypeError(f"allow_partial_load must be a bool, got {allow_partial_load!r}")
        self.checkpoints_dir = pathlib.Path(checkpoints_dir)
        self.recoverables: dict[str, Any] = {}
        self.optional_recoverables: dict[str, bool] = {}
        self.custom_load_hooks: dict[str, Callable[..., Any]] = {}
        self.custom_save_hooks: dict[str, Callable[..., Any]] = {}
        for hooks, into in (
            (custom_load_hooks, self.custom_load_hooks),
            (custom_save_hooks, self.custom_save_hooks),
        ):
            if hooks is not None:
                into.update(_check_hooks(hooks))
        if recoverables is not None:
            self.add_recoverables(recoverables)
        self.allow_partial_load = allow_partial_load
        # torch.distributed (DDP): the main process writes; the others read the same directory.
        self._rank, self._world = _torch_distributed()
        if self._rank == 0:
            self._manager = CheckpointManager(
                self.checkpoints_dir, step_prefix=CKPT_PREFIX, async_save=async_save
            )
        self._synchronise()
        if self._rank != 0:
            self._manager = CheckpointManager(
                self.checkpoints_dir, step_prefix=CKPT_PREFIX, read_only=True
            )
        if self._world > 1:  # the main process saves only once every reader has listed the steps
            optional("torch.distributed", feature="a Checkpointer under DDP").barrier()
        latest = self._manager.latest_step()
        self._next = 0 if latest is None else latest + 1  # checkpoints are numbered in order

    @property
    def manager(self) -> CheckpointManager:
        """The CheckpointManager underneath."""
        return self._manager

    def _synchronise(self) -> None:
        """With torch.distributed: a barrier (after the main process changed the directory),
        after which the other processes read it again."""
        if self._world == 1:
            return
        if self._rank == 0:
            self._manager.wait_until_finished()
        optional("torch.distributed", feature="a Checkpointer under DDP").barrier()
        if self._rank != 0 and hasattr(self, "_manager"):
            self._manager.reload()

    def add_recoverable(
        self,
        name: str,
        obj: Any,
        custom_load_hook: Callable[..., Any] | None = None,
        custom_save_hook: Callable[..., Any] | None = None,
        optional_load: bool = False,
    ) -> None:
        """Register `obj` under `name`, with optional hooks; `optional_load`: a checkpoint that
        lacks it still loads (with a warning)."""
        if not isinstance(name, str):
            raise TypeError(
                f"recoverable names must be str, got {type(name).__qualname__} ({name!r})"
            )
        problem = item_name_problem(name)
        if problem:
            raise ValueError(
                f"recoverable {name!r}: its name becomes the name of its directory in the "
                f"checkpoint, so it follows cairn's rule for item names ({problem})"
            )
        if name == _META_ITEM:
            raise ValueError(f"{_META_ITEM!r} is reserved")
        self.recoverables[name] = obj
        self.optional_recoverables[name] = bool(optional_load)
        if custom_load_hook is not None:
            self.custom_load_hooks[name] = _check_hooks({name: custom_load_hook})[name]
        if custom_save_hook is not None:
            self.custom_save_hooks[name] = _check_hooks({name: custom_save_hook})[name]

    def add_recoverables(self, recoverables: Mapping[str, Any]) -> None:
        """Register several recoverables from a mapping of name to object."""
        if not isinstance(recoverables, Mapping):
            raise AttributeError(
                f"Checkpointer needs a mapping (e.g. dict), got {recoverables!r} instead."
            )
        for name, obj in recoverables.items():
            self.add_recoverable(name, obj)

    # ------------------------------------------------------------------ saving

    def _plan(self, name: str, obj: Any) -> Any:
        """What the manager saves for one recoverable (a SpeechBrainRecoverable, or the pytree)."""
        hook = self.custom_save_hooks.get(name) or _find_hook(obj, "save")
        # A hook writes into its own directory beside the steps, named as trash so that a crash
        # leaves nothing the next start does not remove; the commit moves the file into the step.
        staging = self.checkpoints_dir / trash_name(f"staging-{name}")
        if hook is torch_save:
            return SpeechBrainRecoverable(name, obj, "torch", None, staging)
        if hook is not None:
            return SpeechBrainRecoverable(name, obj, "hook", hook, staging)
        if has_state_methods(obj):
            return SpeechBrainRecoverable(name, obj, "state", None, staging)
        if _is_pytree(obj):
            return obj
        raise RuntimeError(
            f"Don't know how to save {type(obj)}. Register default hook or add custom hook for "
            "this object."
        )

    def save_checkpoint(
        self,
        meta: Mapping[str, Any] | None = None,
        end_of_epoch: bool = True,
        name: str | None = None,
        verbosity: int = logging.INFO,
    ) -> Checkpoint | None:
        """Save every recoverable as one checkpoint; returns its Checkpoint(path, meta, paramfiles).

        With torch.distributed, the main process saves (its hooks run there only) and the others
        wait for the commit and return None, as SpeechBrain's non-main processes do.

        `meta` (JSON data; NumPy/torch scalars are converted) is stored with "unixtime" and
        "end-of-epoch"; its numbers are also the step's metrics. `name` is kept in the meta as
        "name" (the directory is ``CKPT_<sequence>``).
        """
        if self._rank != 0:
            self._synchronise()
            return None
        stored: dict[str, Any] = {"unixtime": time.time(), "end-of-epoch": bool(end_of_epoch)}
        stored.update(_check_meta(meta))
        if name is not None:
            if not isinstance(name, str) or not name:
                raise ValueError(f"name must be a non-empty str, got {name!r}")
            stored["name"] = name
        full_meta = _decode_meta(stored)  # what list_checkpoints will give for it
        step = self._next
        items: dict[str, Any] = {}
        try:
            for rec_name, obj in self.recoverables.items():
                items[rec_name] = self._plan(rec_name, obj)
            if not items:
                items[_META_ITEM] = {"meta": json.dumps(stored)}
            # A NaN or infinite loss stays in the meta (a diverging run saves), not the metrics.
            metrics = {
                k: number
                for k, v in full_meta.items()
                if k not in ("unixtime", "end-of-epoch")
                and not isinstance(v, bool)
                and (number := _number(v)) is not None
                and math.isfinite(number)
            }
            self._manager.save(step, items, metrics=metrics, metadata={"meta": stored}, force=True)
        except BaseException:
            for item in items.values():
                if isinstance(item, SpeechBrainRecoverable) and item.kind == "hook":
                    shutil.rmtree(item.staging, ignore_errors=True)
            raise
        finally:
            self._synchronise()  # the other processes go on, whether the save worked or not
        self._next = step + 1
        path = self.checkpoints_dir / f"{CKPT_PREFIX}_{step}"
        kind = "end-of-epoch" if end_of_epoch else "intra-epoch"
        log.log(verbosity, "cairn.speechbrain: saved an %s checkpoint in %s", kind, path)
        files = {n: isinstance(v, SpeechBrainRecoverable) for n, v in items.items()}
        return Checkpoint(path, full_meta, self._paramfiles(path, files))

    @staticmethod
    def _paramfiles(path: pathlib.Path, files: Mapping[str, bool]) -> dict[str, pathlib.Path]:
        """Recoverable name -> its ``<name>.ckpt`` (`files[name]`) or its item directory (a
        pytree item), for the recoverables of the checkpoint at `path`."""
        return {
            n: path / n / f"{n}{PARAMFILE_EXT}" if is_file else path / n
            for n, is_file in files.items()
            if n != _META_ITEM
        }

    def save_and_keep_only(
        self,
        meta: Mapping[str, Any] | None = None,
        end_of_epoch: bool = True,
        name: str | None = None,
        num_to_keep: int = 1,
        keep_recent: bool = True,
        importance_keys: Sequence[Callable[[Checkpoint], Any]] | None = None,
        max_keys: Sequence[str] | None = None,
        min_keys: Sequence[str] | None = None,
        ckpt_predicate: Callable[[Checkpoint], bool] | None = None,
        verbosity: int = logging.INFO,
    ) -> None:
        """save_checkpoint, then delete_checkpoints: keep `num_to_keep` per importance order
        (the most recent ones too when `keep_recent`)."""
        self.save_checkpoint(meta=meta, end_of_epoch=end_of_epoch, name=name, verbosity=verbosity)
        keys = list(importance_keys or [])
        if keep_recent:
            keys.append(ckpt_recency)
        self.delete_checkpoints(
            num_to_keep=num_to_keep,
            max_keys=max_keys,
            min_keys=min_keys,
            importance_keys=keys,
            ckpt_predicate=ckpt_predicate,
            verbosity=verbosity,
        )

    # ------------------------------------------------------------------ finding

    def list_checkpoints(self) -> list[Checkpoint]:
        """Every checkpoint in the directory (pending saves first): cairn's and SpeechBrain's."""
        self._manager.wait_until_finished()
        found = []
        for step in self._manager.all_steps():
            path = self.checkpoints_dir / f"{CKPT_PREFIX}_{step}"
            try:
                info = self._manager.info(step)
                meta = _checked_meta(_decode_meta(info.metadata.get("meta")))
            except StepNotFoundError:
                continue  # deleted meanwhile
            except UnsupportedFormatError as e:
                log.warning("cairn.speechbrain: skipping checkpoint %s: %s", path, e)
                continue
            except (ValueError, KeyError, TypeError, RecursionError, OverflowError) as e:
                # CorruptCheckpointError, or a meta that _decode_meta cannot read
                log.warning("cairn.speechbrain: skipping a damaged checkpoint %s: %s", path, e)
                continue
            files = {
                n: i.handler == SpeechBrainHandler.id
                for n, i in info.items.items()
                if not i.dropped
            }
            found.append(Checkpoint(path, meta, self._paramfiles(path, files)))
        return found + _speechbrain_checkpoints(self.checkpoints_dir)

    def find_checkpoints(
        self,
        importance_key: Callable[[Checkpoint], Any] | None = None,
        max_key: str | None = None,
        min_key: str | None = None,
        ckpt_predicate: Callable[[Checkpoint], bool] | None = None,
        max_num_checkpoints: int | None = None,
    ) -> list[Checkpoint]:
        """Checkpoints ranked by importance, most important first (default: most recent first).

        At most one of `importance_key` (higher is better), `max_key` or `min_key` (a meta key;
        only checkpoints that have it count); `ckpt_predicate` filters first.
        """
        if sum(k is not None for k in (importance_key, max_key, min_key)) > 1:
            raise ValueError("Must specify only one of 'importance_key', 'max_key', and 'min_key'.")
        predicate = ckpt_predicate
        key: Callable[[Checkpoint], Any] = importance_key or ckpt_recency
        if max_key is not None or min_key is not None:
            meta_key = max_key if max_key is not None else min_key
            sign = 1.0 if max_key is not None else -1.0

            def key(ckpt: Checkpoint) -> Any:
                number = _number(ckpt.meta[meta_key])
                assert number is not None  # the predicate keeps only checkpoints with a number
                return sign * number

            def predicate(ckpt: Checkpoint, user: Any = ckpt_predicate) -> bool:
                has = _number(ckpt.meta.get(meta_key)) is not None
                return has and (user is None or bool(user(ckpt)))

        ckpts = [c for c in self.list_checkpoints() if predicate is None or predicate(c)]
        ckpts.sort(key=ckpt_recency, reverse=True)  # equal importance: the newer first
        ranked = sorted(ckpts, key=key, reverse=True)
        return ranked if max_num_checkpoints is None else ranked[:max_num_checkpoints]

    def find_checkpoint(
        self,
        importance_key: Callable[[Checkpoint], Any] | None = None,
        max_key: str | None = None,
        min_key: str | None = None,
        ckpt_predicate: Callable[[Checkpoint], bool] | None = None,
    ) -> Checkpoint | None:
        """The most important checkpoint (see find_checkpoints), or None."""
        found = self.find_checkpoints(importance_key, max_key, min_key, ckpt_predicate, 1)
        return found[0] if found else None

    # ------------------------------------------------------------------ loading

    def recover_if_possible(
        self,
        importance_key: Callable[[Checkpoint], Any] | None = None,
        max_key: str | None = None,
        min_key: str | None = None,
        ckpt_predicate: Callable[[Checkpoint], bool] | None = None,
    ) -> Checkpoint | None:
        """Load the most important checkpoint if there is one; returns it (or None)."""
        chosen = self.find_checkpoint(importance_key, max_key, min_key, ckpt_predicate)
        if chosen is None:
            log.info("cairn.speechbrain: would load a checkpoint here, but none found yet")
        else:
            self.load_checkpoint(chosen)
        return chosen

    def load_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Load every recoverable from `checkpoint`, through its load hook.

        A recoverable without a file there raises RuntimeError, unless `allow_partial_load` or
        its `optional_load` (then a warning). cairn checkpoints are verified against their
        checksums before any hook reads them (CorruptCheckpointError names the file).
        """
        log.info("cairn.speechbrain: loading a checkpoint from %s", checkpoint.path)
        end_of_epoch = checkpoint.meta["end-of-epoch"]
        step = self._step_of(checkpoint)
        for name, obj in self.recoverables.items():
            path = checkpoint.paramfiles.get(name)
            if path is None:
                if self.allow_partial_load:
                    continue
                message = (
                    f"Loading checkpoint from {checkpoint.path}, but missing a load path for {name}"
                )
                if "dataloader" in name or self.optional_recoverables.get(name):
                    warnings.warn(f"{message}. Skipping it.", UserWarning, stacklevel=2)
                    continue
                raise RuntimeError(message)
            if step is not None and pathlib.Path(path) == pathlib.Path(checkpoint.path) / name:
                # a pytree item (a hook's file is <name>/<name>.ckpt, even when a directory)
                restored = self._manager.restore(step, {name: None})[name]
                _assign(obj, restored, name)
                continue
            if step is not None:
                self._manager.restore(step, {name: None})  # verifies the files
            else:
                _check_paramfile(checkpoint, path)
            hook = self.custom_load_hooks.get(name) or _find_hook(obj, "load")
            if hook is None and has_state_methods(obj):
                hook = _state_load
            if hook is None:
                raise RuntimeError(
                    f"Don't know how to load {type(obj)}. Register default hook or add custom "
                    "hook for this object."
                )
            hook(obj, path, end_of_epoch)

    def _step_of(self, checkpoint: Checkpoint) -> int | None:
        path = pathlib.Path(checkpoint.path)
        match = _STEP_DIR.fullmatch(path.name)
        return int(match.group(1)) if match and path.parent == self.checkpoints_dir else None

    # ------------------------------------------------------------------ deleting

    def delete_checkpoints(
        self,
        *,
        num_to_keep: int = 1,
        min_keys: Sequence[str] | None = None,
        max_keys: Sequence[str] | None = None,
        importance_keys: Sequence[Callable[[Checkpoint], Any]] | None = None,
        ckpt_predicate: Callable[[Checkpoint], bool] | None = None,
        verbosity: int = logging.INFO,
    ) -> None:
        """Delete all but the `num_to_keep` most important checkpoints of each importance order.

        Orders: each of `min_keys`, `max_keys` (meta keys) and `importance_keys` (default: the
        most recent). Only checkpoints that pass `ckpt_predicate` (and have the key) may be
        deleted. A deletion is atomic: the directory is renamed away first.
        """
        if isinstance(num_to_keep, bool) or not isinstance(num_to_keep, int) or num_to_keep < 0:
            raise ValueError("Number of checkpoints to keep must be positive.")
        if self._rank != 0:  # the main process deletes; the others read the result
            self._synchronise()
            return
        orders: list[dict[str, Any]] = [{"min_key": k} for k in min_keys or []]
        orders += [{"max_key": k} for k in max_keys or []]
        orders += [
            {"importance_key": k}
            for k in (importance_keys if importance_keys is not None else [ckpt_recency])
        ]
        candidates: set[Checkpoint] = set()
        protected: set[Checkpoint] = set()
        for order in orders:
            ranked = self.find_checkpoints(ckpt_predicate=ckpt_predicate, **order)
            candidates.update(ranked)
            protected.update(ranked[:num_to_keep])
        try:
            for ckpt in sorted(candidates - protected, key=ckpt_recency):
                self._delete(ckpt)
                log.log(verbosity, "cairn.speechbrain: deleted checkpoint %s", ckpt.path)
        finally:
            self._synchronise()

    def _delete(self, checkpoint: Checkpoint) -> None:
        step = self._step_of(checkpoint)
        if step is not None:
            self._manager.delete(step)
            return
        path = pathlib.Path(checkpoint.path)
        if path.parent != self.checkpoints_dir or not _is_speechbrain_dir(path):
            raise RuntimeError("Checkpoint does not appear valid for deletion.")
        trash = path.parent / trash_name(path.name)
        os.rename(path, trash)  # gone at once for every reader; then freed
        shutil.rmtree(trash)

    def close(self) -> None:
        """Finish pending saves and release the directory."""
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _torch_distributed() -> tuple[int, int]:
    """(rank, world size) of an initialised torch.distributed group, else (0, 1)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.distributed.is_available():
        return 0, 1
    if not torch.distributed.is_initialized():
        return 0, 1
    return int(torch.distributed.get_rank()), int(torch.distributed.get_world_size())


def _check_hooks(hooks: Mapping[str, Any]) -> dict[str, Callable[..., Any]]:
    if not isinstance(hooks, Mapping):
        raise TypeError(f"hooks must be a mapping of recoverable name to function, got {hooks!r}")
    for name, hook in hooks.items():
        if not callable(hook):
            raise TypeError(f"the hook for {name!r} is not callable: {hook!r}")
    return dict(hooks)


def _check_meta(meta: Any) -> dict[str, Any]:
    """Meta as stored in the manifest (`_encode_meta` of each value); TypeError naming the key
    for a value that cannot be stored, ValueError for the keys the checkpointer sets."""
    if meta is None:
        return {}
    if not isinstance(meta, Mapping) or not all(isinstance(k, str) for k in meta):
        raise TypeError(f"meta must be a mapping with str keys, got {meta!r:.200}")
    out = {}
    for key, value in meta.items():
        if key in ("unixtime", "end-of-epoch"):
            raise ValueError(f"meta key {key!r} is set by the checkpointer")
        out[key] = _encode_meta(value, f"[{key!r}]")
    return out


_TAG = "__cairn__"  # as in encode_state: a key no meta mapping may use


def _encode_meta(value: Any, where: str) -> Any:
    """A meta value as JSON data that `_decode_meta` turns back into it: what JSON holds, NaN and
    the infinities, tuples, bytes, NumPy arrays, torch tensors (0-d ones and NumPy scalars as
    Python numbers) and paths (``pathlib.Path``); TypeError naming `where` for anything else."""
    if isinstance(value, pathlib.PurePath):
        return {_TAG: "path", "value": str(value)}
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if value.ndim == 0:
            return _encode_meta(value.item(), where)
        try:
            array = value.detach().to("cpu").numpy()
        except (TypeError, RuntimeError) as e:
            raise TypeError(f"meta{where}: a {value.dtype} tensor cannot be stored: {e}") from None
        return {_TAG: "tensor", "array": encode_state(array)}
    if isinstance(value, np.generic) or (isinstance(value, np.ndarray) and value.ndim == 0):
        value = value.item()
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"meta{where}: mapping keys must be str")
        if _TAG in value:
            raise TypeError(f"meta{where}: the key {_TAG!r} is reserved")
        return {k: _encode_meta(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, list):
        return [_encode_meta(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {
            _TAG: "tuple",
            "items": [_encode_meta(v, f"{where}[{i}]") for i, v in enumerate(value)],
        }
    try:
        return encode_state(value, where)
    except TypeError:
        raise TypeError(
            f"meta{where} is a {type(value).__qualname__}; meta values must be JSON data, NaN or "
            "infinite floats, tuples, bytes, NumPy arrays, torch tensors or pathlib paths"
        ) from None


def _decode_meta(value: Any) -> Any:
    """The meta value `_encode_meta` stored as `value`. Input it did not write raises ValueError,
    KeyError, TypeError or RecursionError (the caller reports the checkpoint as damaged)."""
    if isinstance(value, list):
        return [_decode_meta(v) for v in value]
    if not isinstance(value, dict):
        return value
    tag = value.get(_TAG)
    if tag is None:
        return {k: _decode_meta(v) for k, v in value.items()}
    if tag == "path":
        if not isinstance(value["value"], str):
            raise TypeError("a path in the meta is not a str")
        return pathlib.Path(value["value"])
    if tag == "tuple":
        if not isinstance(value["items"], list):
            raise TypeError("a tuple in the meta is not a list")
        return tuple(_decode_meta(v) for v in value["items"])
    if tag == "tensor":
        array = decode_state(value["array"])
        if not isinstance(array, np.ndarray):
            raise TypeError("a tensor in the meta is not an array")
        try:
            torch = optional("torch", feature="a torch tensor in a checkpoint's meta")
        except MissingDependencyError:
            return array  # saved where torch was; read here as the NumPy array it holds
        return torch.from_numpy(array)
    return decode_state(value)


_META_LIMIT = 256 << 10  # bytes of a SpeechBrain CKPT.yaml (a few lines in practice)
_META_DEPTH = 32  # nesting of its collections


def _number(value: Any) -> float | None:
    """A meta value as a number for ranking: a real number that is not NaN (bools count, as in
    SpeechBrain); None for anything else, an int too large for a float included."""
    if not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return None if math.isnan(number) else number


def _checked_meta(meta: Any) -> dict[str, Any]:
    """A checkpoint's meta as this API hands it out: a mapping with str keys, a finite number
    "unixtime" and a bool "end-of-epoch" (every checkpointer writes both); CorruptCheckpointError
    otherwise."""
    if not isinstance(meta, dict) or not all(isinstance(k, str) for k in meta):
        raise CorruptCheckpointError(
            f"its meta is a {type(meta).__qualname__}, not a mapping with str keys"
        )
    unixtime = meta.get("unixtime")
    number = None if isinstance(unixtime, bool) else _number(unixtime)
    if number is None or not math.isfinite(number):
        raise CorruptCheckpointError(f"its meta's unixtime {unixtime!r:.40} is not a time")
    if not isinstance(meta.get("end-of-epoch"), bool):
        raise CorruptCheckpointError(
            f"its meta's end-of-epoch {meta.get('end-of-epoch')!r:.40} is not a bool"
        )
    return dict(meta)


def _parse_meta(data: bytes) -> Any:
    """A CKPT.yaml as data: plain YAML (safe tags only) without aliases and nested at most
    `_META_DEPTH` deep, checked on the event stream before anything is built (an alias bomb or a
    deep document never reaches the constructor); CorruptCheckpointError otherwise."""
    try:
        import yaml
    except ImportError as e:  # PyYAML comes with speechbrain, whose checkpoints these are
        raise MissingDependencyError(
            "reading checkpoints SpeechBrain wrote (CKPT.yaml) needs PyYAML, which is not "
            "installed in this Python; install it with: pip install 'cairn-ckpt[speechbrain]'"
        ) from e

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        text = data.decode("utf-8")
        depth = 0
        for event in yaml.parse(text, Loader=loader):
            if isinstance(event, yaml.AliasEvent):
                raise CorruptCheckpointError("its meta uses a YAML alias")
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > _META_DEPTH:
                    raise CorruptCheckpointError(f"its meta nests deeper than {_META_DEPTH}")
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
        return yaml.load(text, Loader=loader)  # a safe loader: data only
    except CorruptCheckpointError:
        raise
    except Exception as e:  # the file's bytes are all this parses
        # Besides YAMLError, UTF-8 and int() errors, PyYAML's safe constructors raise whatever
        # a tagged value that does not fit its tag makes their code hit: KeyError for
        # `!!bool maybe`, AttributeError for `!!timestamp x`, IndexError for `!!int _`.
        raise CorruptCheckpointError(
            f"its meta does not parse: {type(e).__name__}: {e!s:.300}"
        ) from None


def _speechbrain_checkpoint(path: pathlib.Path) -> Checkpoint | None:
    """The checkpoint SpeechBrain wrote in `path`, or None if `path` is no such directory (no
    CKPT.yaml); CorruptCheckpointError if it is one that cannot be read safely: a link, a meta
    that is not a regular file or not plain data, a paramfile that is not a regular file."""
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        raise CorruptCheckpointError("it is a symbolic link; cairn does not follow links")
    if not stat.S_ISDIR(mode):
        return None
    try:
        with os.fdopen(open_regular(path / METAFNAME), "rb") as f:
            data = f.read(_META_LIMIT + 1)
    except FileNotFoundError:
        return None
    except OSError as e:  # ELOOP: a link
        raise CorruptCheckpointError(f"its {METAFNAME} cannot be read: {e}") from None
    if len(data) > _META_LIMIT:
        raise CorruptCheckpointError(f"its {METAFNAME} is larger than {_META_LIMIT} bytes")
    meta = _checked_meta(_parse_meta(data))
    paramfiles = {}
    with os.scandir(path) as entries:
        for entry in entries:
            stem = entry.name.removesuffix(PARAMFILE_EXT)
            if stem in ("", entry.name):
                continue
            if not entry.is_file(follow_symlinks=False):
                raise CorruptCheckpointError(f"its paramfile {entry.name!r} is not a regular file")
            paramfiles[stem] = pathlib.Path(entry.path)
    return Checkpoint(path, meta, paramfiles)


def _is_speechbrain_dir(path: pathlib.Path) -> bool:
    try:
        is_checkpoint = _speechbrain_checkpoint(path) is not None
    except (OSError, CorruptCheckpointError):
        return False
    return path.name.startswith(f"{CKPT_PREFIX}+") and is_checkpoint


def _speechbrain_checkpoints(root: pathlib.Path) -> list[Checkpoint]:
    """Checkpoints written by SpeechBrain itself (``CKPT+*/CKPT.yaml``); one that cannot be read
    safely is skipped with a warning."""
    try:
        with os.scandir(root) as entries:
            names = sorted(e.name for e in entries if e.name.startswith(f"{CKPT_PREFIX}+"))
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        try:
            checkpoint = _speechbrain_checkpoint(root / name)
        except FileNotFoundError:
            continue  # deleted meanwhile
        except (OSError, CorruptCheckpointError) as e:
            log.warning("cairn.speechbrain: skipping %s: %s", root / name, e)
            continue
        if checkpoint is not None:
            found.append(checkpoint)
    return found


def _check_paramfile(checkpoint: Checkpoint, path: Any) -> None:
    """Before a load hook reads a paramfile of a checkpoint cairn did not write: it must be a
    regular file (not a link) directly inside the checkpoint's directory, itself not a link."""
    directory, path = pathlib.Path(checkpoint.path), pathlib.Path(path)
    try:
        ok = (
            path.parent == directory
            and stat.S_ISDIR(os.lstat(directory).st_mode)
            and stat.S_ISREG(os.lstat(path).st_mode)
        )
    except OSError:
        ok = False
    if not ok:
        raise CorruptCheckpointError(
            f"checkpoint {directory}: paramfile {path} is not a regular file inside it; cairn "
            "hands a load hook only files of the checkpoint's own directory"
        )


# ---------------------------------------------------------------------------- averaging


def average_state_dicts(state_dicts: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The average of state dicts (mappings of arrays or tensors), reading one at a time: at
    most the running sum and one more are in memory."""
    iterator = iter(state_dicts)
    try:
        first = next(iterator)
    except StopIteration:
        raise ValueError("No state dicts to average.") from None
    total = {k: _as_float(v, copy=True) for k, v in first.items()}
    count = 1
    for state in iterator:
        if set(state) != set(total):
            raise ValueError(
                f"state dict {count} has keys {sorted(state)}, the first has {sorted(total)}"
            )
        for key, value in state.items():
            total[key] += _as_float(value, copy=False)
        count += 1
    return {k: v / count for k, v in total.items()}


def _as_float(value: Any, *, copy: bool) -> Any:
    torch = sys.modules.get("torch")  # a tensor here means the program imported torch
    if torch is not None and isinstance(value, torch.Tensor):
        value = value.detach()
        value = value if value.is_floating_point() else value.double()
        return value.clone() if copy else value
    array = np.asarray(value)
    if array.dtype.kind not in "fc":
        array = array.astype(np.float64)
    return array.copy() if copy else array


def _default_loader(path: Any, map_location: str = "cpu") -> Any:
    path = pathlib.Path(path)
    if path.is_dir():  # a pytree recoverable of a cairn checkpoint
        root, step_dir = path.parent.parent, path.parent
        match = _STEP_DIR.fullmatch(step_dir.name)
        if match is None:
            raise ValueError(f"{path} is not a recoverable of a cairn checkpoint")
        with CheckpointManager(root, read_only=True, step_prefix=CKPT_PREFIX) as mgr:
            return mgr.restore(int(match.group(1)), {path.name: None})[path.name]
    return _torch_load(path, map_location)


def average_checkpoints(
    checkpoint_list: Sequence[Checkpoint],
    recoverable_name: str,
    parameter_loader: Callable[..., Any] | None = None,
    averager: Callable[[Iterator[Any]], Any] | None = None,
) -> Any:
    """Average one recoverable's parameters over checkpoints, loading them one at a time.

    `parameter_loader(path, map_location="cpu")` loads one paramfile (default: ``torch.load``
    with ``weights_only=True``, or cairn's pytree reader); `averager` gets an iterator over the
    loaded values (default: `average_state_dicts`).
    """
    loader = parameter_loader or _default_loader
    average = averager or average_state_dicts
    missing = [c.path for c in checkpoint_list if recoverable_name not in c.paramfiles]
    if missing:
        raise KeyError(f"{recoverable_name!r} is not saved in checkpoints {missing}")
    loaded = (loader(c.paramfiles[recoverable_name], map_location="cpu") for c in checkpoint_list)
    return average(loaded)
