"""SpeechBrain's `Checkpointer` on a CheckpointManager: saving named recoverables as one step,
finding, loading and deleting checkpoints (cairn's and SpeechBrain's own), torch.distributed.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pathlib
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cairn.handlers import SpeechBrainHandler, SpeechBrainRecoverable
from cairn.handlers.errors import StepNotFoundError, UnsupportedFormatError
from cairn.handlers.io import has_state_methods, optional
from cairn.manager._core.manager import CheckpointManager
from cairn.manager._format import item_name_problem, trash_name
from cairn.manager._layouts.speechbrain import (  # SpeechBrain's own directories, read in place
    CKPT_PREFIX,
    PARAMFILE_EXT,
    Checkpoint,
    _check_paramfile,
    _checked_meta,
    _is_speechbrain_dir,
    _number,
    _speechbrain_checkpoints,
)
from cairn.manager._surfaces.speechbrain.hooks import (
    _assign,
    _check_hooks,
    _find_hook,
    _is_pytree,
    _state_load,
    torch_save,
)
from cairn.manager._surfaces.speechbrain.meta import (
    _META_ITEM,
    STEP_NAMES,
    _check_meta,
    _decode_meta,
    ckpt_recency,
)

log = logging.getLogger("cairn")


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
        return STEP_NAMES.parse(path.name) if path.parent == self.checkpoints_dir else None

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
        self._manager.delete_directory(path.name)  # under the lock, after pending saves

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
