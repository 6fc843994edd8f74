"""Steps a T5X job wrote (its legacy layout, or its Orbax layout), restored through a manager;
`cairn.manager._layouts.t5x` reads the files."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cairn.handlers.errors import MismatchError
from cairn.manager._core.manager import CheckpointManager
from cairn.manager._layouts.t5x import (
    legacy_steps,
    load_legacy,
    read_legacy,
    restore_dataset,
    restore_into,
)


def restore_foreign(
    manager: Any,
    step: int,
    template: Any,
    *,
    state_item: str,
    dataset_item: str,
    dataset_iterator: Any = None,
    **options: Any,
) -> dict[str, Any] | None:
    """Restore `step` of `manager`'s directory if a T5X job wrote it (its legacy layout, or its
    Orbax layout, which the manager lists as a read-only Orbax step); None for a cairn step.

    `options` go to `restore_into` (restore_dtype, cast, transforms, fallback_state, lazy).
    The dataset iterator, if given, is restored in place."""
    directory = manager.directory
    if isinstance(directory, Path):
        step_dir = legacy_steps(directory).get(step)
        if step_dir is not None:
            where = f"T5X step {step} at {step_dir}"
            saved = read_legacy(step_dir)
            state = restore_into(saved, template, where=where, **options)
            if dataset_iterator is not None:
                restore_dataset(step_dir, dataset_iterator, step)
            return state
    info = manager.info(step)
    if info.metadata.get("format") != "orbax":
        return None
    if state_item not in info.items:
        raise MismatchError(
            f"Orbax step {step} at {info.path} has no item {state_item!r} (items: "
            f"{sorted(info.items)}); T5X's Orbax layout saves the train state as {state_item!r}"
        )
    items: dict[str, Any] = {state_item: None}
    if dataset_iterator is not None:
        items[dataset_item] = dataset_iterator
    raw = _unwrap(_read_orbax(manager, step, items)[state_item])
    where = f"Orbax step {step} at {info.path}, item {state_item!r}"
    out: dict[str, Any] = restore_into(raw, template, where=where, **options)
    return out


def load_foreign(
    manager: Any,
    step: int,
    *,
    state_item: str,
    fns: Sequence[Callable[..., Any]],
    **options: Any,
) -> dict[str, Any] | None:
    """load_t5x_checkpoint of a step a T5X job wrote (either layout), without a template; None
    for a cairn step. `fns` run as ``fn(state_dict, {})`` (T5X's remap); `options` go to
    `load_legacy` (restore_dtype, cast, lazy)."""
    directory = manager.directory
    step_dir = legacy_steps(directory).get(step) if isinstance(directory, Path) else None
    if step_dir is not None:
        saved = read_legacy(step_dir)
    else:
        info = manager.info(step)
        if info.metadata.get("format") != "orbax":
            return None
        if state_item not in info.items:
            raise MismatchError(f"Orbax step {step} at {info.path} has no item {state_item!r}")
        saved = _unwrap(_read_orbax(manager, step, {state_item: None})[state_item])
    transforms = [lambda state, _, fn=fn: fn(state, {}) for fn in fns]
    return load_legacy(saved, transforms=transforms, **options)


def _read_orbax(manager: Any, step: int, items: dict[str, Any]) -> dict[str, Any]:
    """Items of an Orbax step through a read-only manager of the same directory with no
    handlers configured (the trainer's manager names cairn's own handler for its items)."""
    with CheckpointManager(manager.directory, read_only=True, step_prefix="checkpoint") as reader:
        out: dict[str, Any] = reader.restore(step, items)
    return out


def _unwrap(tree: Any) -> Any:
    """T5X's Orbax saves have held ``{"version": 3, "optimizer": state dict}`` (as its msgpack
    file) in some versions and the state dict itself in others: the state dict either way."""
    if isinstance(tree, Mapping) and set(tree) == {"version", "optimizer"}:
        return tree["optimizer"]
    return tree
