"""Argument checks shared by the public entry points; each error names the argument and value."""

from __future__ import annotations

import numbers
import os
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

from cairn.handlers import Handler
from cairn.manager._core.policies import KeepPolicy, policy_kind
from cairn.manager._format import ROOT_METADATA, StepNames, item_name_problem


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


def check_entry_name(name: Any, names: StepNames) -> str:
    """`name` if it can name a directory of the root that is no step of this naming and none
    of cairn's own entries (`CheckpointManager.delete_directory`); TypeError/ValueError else."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__qualname__} ({name!r:.100})")
    if (
        name in ("", ROOT_METADATA)
        or name.startswith(".")
        or any(c in name for c in "/\\\0")
        or not name.isprintable()
        or len(os.fsencode(name)) > 255
    ):
        raise ValueError(
            f"name {name!r:.100} is not a directory delete_directory may delete: one entry of "
            "the root (no '/' or '\\'), not hidden and not cairn's own"
        )
    step = names.parse(name)
    if step is not None:
        raise ValueError(f"{name!r} is step {step} of this manager: delete it with delete({step})")
    if names.is_temporary(name):
        raise ValueError(f"{name!r} is a save in progress (the next writer removes it)")
    return name


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


def check_flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def _positive_int(value: Any) -> int | None:
    """`value` as an int if it is a positive integer (NumPy's too, not a bool), else None."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 1:
        return int(value)
    return None


def check_max_pending(value: Any) -> int:
    if (count := _positive_int(value)) is None:
        raise ValueError(f"max_pending must be a positive int, got {value!r}")
    return count


def check_max_staging_bytes(value: Any) -> int | None:
    if value is None:
        return None
    if (nbytes := _positive_int(value)) is None:
        raise ValueError(
            f"max_staging_bytes must be None or a positive number of bytes, got {value!r}"
        )
    return nbytes


def check_primary_process(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"primary_process must be a process index (an int >= 0), got {value!r}")
    return value


def check_barrier_timeout(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"barrier_timeout must be a positive number of seconds, got {value!r}")
    return float(value)


def check_keep_items(keep_items: Any) -> dict[str, KeepPolicy]:
    if keep_items is None:
        return {}
    if not isinstance(keep_items, Mapping):
        raise TypeError(
            f"keep_items must be a mapping of item name to keep policy, got {keep_items!r}"
        )
    for name, policy in keep_items.items():
        check_item_name(name)
        if policy_kind(policy) != "keep":
            raise TypeError(
                f"keep_items[{name!r}] must be a keep policy (KeepLatest, ...), got {policy!r}"
            )
    return dict(keep_items)


def check_handlers(handlers: Any) -> dict[str, Handler]:
    if handlers is None:
        return {}
    if not isinstance(handlers, Mapping):
        raise TypeError(f"handlers must be a mapping of item name to handler, got {handlers!r}")
    out = {}
    for name, handler in handlers.items():
        check_item_name(name)
        for attr in ("snapshot", "restore", "describe"):
            if not callable(getattr(handler, attr, None)):
                raise TypeError(f"handlers[{name!r}] = {handler!r} has no {attr}() method")
        if not isinstance(getattr(handler, "id", None), str) or not isinstance(
            getattr(handler, "version", None), int
        ):
            raise TypeError(
                f"handlers[{name!r}] = {handler!r} needs a str `id` and an int `version`"
            )
        out[name] = handler
    return out


def check_best(best: Any) -> tuple[str, Literal["min", "max"]] | None:
    if best is None:
        return None
    if (
        not isinstance(best, tuple)
        or len(best) != 2
        or not isinstance(best[0], str)
        or not best[0]
        or best[1] not in ("min", "max")
    ):
        raise ValueError(f"best must be (metric, 'min' | 'max'), got {best!r}")
    return best[0], best[1]
