"""Argument checks shared by the public entry points; each error names the argument and value."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from cairn.manager._format import item_name_problem


def as_step(step: Any, *, argument: str = "step") -> int:
    """An int step from an int, np.integer or 0-d integer array (T5X passes ``state.step``)."""
    if isinstance(step, (bool, np.bool_)):
        raise TypeError(f"{argument} must be an integer, got a bool ({step!r})")
    if isinstance(step, (int, np.integer)):
        value = int(step)
    elif hasattr(step, "shape") and hasattr(step, "dtype"):
        if tuple(step.shape) != () or np.dtype(step.dtype).kind not in "iu":
            raise TypeError(
                f"{argument} must be an integer or a 0-d integer array, got an array of shape "
                f"{tuple(step.shape)} and dtype {np.dtype(step.dtype)}"
            )
        value = int(np.asarray(step))
    else:
        raise TypeError(f"{argument} must be an integer, got {type(step).__qualname__} ({step!r})")
    if value < 0:
        raise ValueError(f"{argument} must be >= 0, got {value}")
    if value >= 2**63:  # an int64, as JAX and T5X steps are; also keeps step names short
        raise ValueError(f"{argument} must be < 2**63, got {value}")
    return value


def check_item_name(name: Any) -> str:
    if not isinstance(name, str):
        raise TypeError(f"item names must be str, got {type(name).__qualname__} ({name!r})")
    problem = item_name_problem(name)
    if problem:
        raise ValueError(problem)
    return name


def check_items(items: Any, *, argument: str = "items") -> dict[str, Any]:
    if not isinstance(items, Mapping):
        raise TypeError(
            f"{argument} must be a mapping of item name to object, e.g. {{'state': state}}; "
            f"got {type(items).__qualname__}"
        )
    return {check_item_name(name): obj for name, obj in items.items()}
