"""T5X's module functions on checkpoint directories: step directory names, the steps committed
(cairn's, and those a T5X job wrote), finding a checkpoint, and load_t5x_checkpoint."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cairn.handlers.errors import CairnError
from cairn.manager._core.manager import CheckpointManager
from cairn.manager._core.reading import StepInfo
from cairn.manager._core.validate import as_step
from cairn.manager._format import StepNames, namings
from cairn.manager._layouts import t5x as legacy  # existing T5X runs: T5X's own layouts
from cairn.manager._surfaces.t5x.foreign import load_foreign
from cairn.manager._surfaces.t5x.state import (
    DATASET,
    STATE,
    PathLike,
    _check_fns,
    _is_target,
    _read_state,
)

log = logging.getLogger("cairn")

PREFIX = "checkpoint"
NAMES = StepNames(PREFIX)  # checkpoint_<step>, as every manager here names T5X's steps
PINNED = "PINNED"  # T5X's checkpoint_utils.pin_checkpoint: a step holding this file is kept


def get_checkpoint_dir(
    checkpoints_dir: PathLike, step: int, step_format_fixed_length: int | None = None
) -> str:
    """``<checkpoints_dir>/checkpoint_<step>``, the step zero-padded to a fixed length if given."""
    step = as_step(step)
    if step_format_fixed_length is None:
        name = f"{PREFIX}_{step}"
    else:
        if (
            isinstance(step_format_fixed_length, bool)
            or not isinstance(step_format_fixed_length, int)
            or step_format_fixed_length < 1
        ):
            raise ValueError(
                "step_format_fixed_length must be None or a positive int, got "
                f"{step_format_fixed_length!r}"
            )
        name = f"{PREFIX}_{step:0{step_format_fixed_length}d}"
    return os.path.join(os.fspath(checkpoints_dir), name)


def get_step_from_checkpoint_dir(checkpoints_dir: PathLike) -> tuple[str, int]:
    """``(parent directory, step)`` of a path ``.../checkpoint_<step>`` (T5X's order)."""
    text = os.fspath(checkpoints_dir).rstrip("/")
    parent, name = os.path.split(text)
    for naming, [(step, _)] in namings([name]):  # zero-padded too, as get_checkpoint_dir writes
        if naming.prefix == PREFIX:
            return parent, step
    raise ValueError(
        f"Found improperly formatted checkpoint directory: {checkpoints_dir!s} "
        "(expected a name checkpoint_<step>)"
    )


def _cairn_steps(root: Path) -> dict[int, StepInfo]:
    """The steps a read-only manager lists and can describe, by step (a damaged step is left
    out with a warning, as T5X leaves out a directory without its ``checkpoint`` file; a step
    T5X wrote has no manifest either). The manager waits for the saves a writer of this process
    accepted (read your writes: T5X's save is synchronous)."""
    if not root.is_dir():
        return {}
    try:
        mgr = CheckpointManager(root, read_only=True, step_prefix=PREFIX)
    except ValueError as e:  # steps under another naming only: none of T5X's names
        if isinstance(e, CairnError):  # damage, not a naming: the caller must hear of it
            raise
        return {}
    found = {}
    with mgr:
        for step in mgr.all_steps():
            try:
                found[step] = mgr.info(step)
            except CairnError as e:
                if not legacy.is_legacy_step(root / NAMES.format(step)):
                    log.warning("cairn.t5x: step %d in %s is left out: %s", step, root, e)
    return found


def _committed(checkpoints_dir: PathLike) -> dict[int, Path]:
    """Committed step directories by step: cairn's (`_cairn_steps`), then those a T5X job
    wrote (`cairn.manager._layouts.t5x`)."""
    root = Path(os.fspath(checkpoints_dir))
    found = {step: root / NAMES.format(step) for step in _cairn_steps(root)}
    for step, step_dir in legacy.t5x_steps(root).items():
        found.setdefault(step, step_dir)
    return dict(sorted(found.items()))


def all_steps(checkpoints_dir: PathLike) -> list[int]:
    """Committed steps in `checkpoints_dir`, ascending (temporary directories never count)."""
    return sorted(_committed(checkpoints_dir))


def latest_step(checkpoints_dir: PathLike) -> int | None:
    """The newest committed step, or None (step 0 is a step)."""
    steps = all_steps(checkpoints_dir)
    return steps[-1] if steps else None


def all_dataset_checkpoint_steps(checkpoints_dir: PathLike) -> list[int]:
    """Committed steps that still hold the dataset iterator (not dropped by retention)."""
    root = Path(os.fspath(checkpoints_dir))
    steps = [
        step
        for step, info in _cairn_steps(root).items()
        if (entry := info.items.get(DATASET)) is not None and not entry.dropped
    ]
    for step, path in legacy.t5x_steps(root).items():  # a step T5X wrote: its train_ds-* files
        if step not in steps and legacy.has_dataset(path):
            steps.append(step)
    return sorted(steps)


def find_checkpoint(path: PathLike, step: int | None = None) -> str:
    """The manifest file of a checkpoint (cairn's counterpart of T5X's ``checkpoint`` file).

    `path` may be a model directory (then the checkpoint of `step`, or the latest one), a
    checkpoint directory ``checkpoint_<step>``, or its manifest file. ValueError if none is there.
    """
    text = os.fspath(path)
    candidate = Path(text)
    if candidate.is_dir():
        root = candidate
        if step is None and NAMES.parse(candidate.name) is not None:  # a checkpoint directory
            root, step = candidate.parent, NAMES.parse(candidate.name)
        elif step is None and any(n.prefix == PREFIX for n, _ in namings([candidate.name])):
            padded = get_step_from_checkpoint_dir(candidate)[1]  # checkpoint_007
            raise ValueError(
                f"Path is not a valid checkpoint: {text} (zero-padded step names are not read; "
                f"rename it {NAMES.format(padded)} or open a CheckpointManager with step_digits)"
            )
        committed = _committed(root)
        if step is None:
            if not committed:
                raise ValueError(f"Path is not a valid checkpoint: {text} (no checkpoints)")
            step = max(committed)
        found = committed.get(as_step(step))
        candidate = found if found is not None else Path(get_checkpoint_dir(root, step))
        candidate = candidate / legacy.checkpoint_file(candidate)  # T5X's: its `checkpoint`
    if not candidate.is_file() or candidate.name != legacy.checkpoint_file(candidate.parent):
        raise ValueError(f"Path is not a valid checkpoint: {candidate}")
    return str(candidate)


def _open_step(path: PathLike, step: int | None = None) -> tuple[CheckpointManager, int]:
    """A read-only manager on the directory holding the checkpoint, and its step."""
    manifest = Path(find_checkpoint(path, step))
    parent, found = get_step_from_checkpoint_dir(manifest.parent)
    return CheckpointManager(parent, read_only=True), found


def load_t5x_checkpoint(
    path: PathLike,
    step: int | None = None,
    state_transformation_fns: Sequence[Callable[..., Any]] = (),
    remap: bool = True,
    restore_dtype: Any = None,
    lazy_parameters: bool = False,
) -> dict[str, Any]:
    """Load a checkpoint's train state as a nested dict, without an optimizer or a template.

    Leaves come back as they were saved: NumPy arrays, or ``jax.Array`` on the default device for
    leaves saved from ``jax.Array``.

    The dict has T5X's layout (``{"target": ..., "state": {"step", "param_states"}}``).
    `state_transformation_fns` run in order as ``fn(state_dict, {})`` when `remap` is True (as
    T5X; `remap=False` skips them). Leaves keep the dtype saved in the checkpoint;
    `restore_dtype` casts every array of ``target`` (integer ones too, as T5X).
    `lazy_parameters` returns every leaf as a LazyArray that reads on ``.get()``.
    """
    fns = _check_fns(state_transformation_fns, "state_transformation_fns")
    if not isinstance(remap, bool) or not isinstance(lazy_parameters, bool):
        raise TypeError("remap and lazy_parameters must be bools")
    mgr, found = _open_step(path, step)
    with mgr:
        # existing T5X runs (manager/_layouts/t5x.py): a step in T5X's legacy or Orbax layout
        foreign = load_foreign(
            mgr,
            found,
            state_item=STATE,
            fns=fns if remap else (),
            restore_dtype=restore_dtype,
            cast=_is_target,
            lazy=lazy_parameters,
        )
        if foreign is not None:
            return foreign
        transforms = [lambda state, target, fn=fn: fn(state, {}) for fn in fns] if remap else []
        restored = _read_state(
            mgr,
            found,
            template=None,
            transforms=transforms,
            fallback_state=None,
            lazy=lazy_parameters,
            restore_dtype=None if restore_dtype is None else np.dtype(restore_dtype),
        )
    if restore_dtype is not None and "target" not in restored:
        raise ValueError(
            f"restore_dtype={restore_dtype} was specified, but no `target` parameters were loaded."
        )
    return restored
