"""Helpers for the Orbax-surface tests: states, strict comparison, what is on disk."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp


def opts(**kwargs: Any) -> ocp.CheckpointManagerOptions:
    """Orbax's own options class: the drop-in must take it unchanged."""
    return ocp.CheckpointManagerOptions(**kwargs)


def jax_state(scale: float = 1.0) -> dict[str, Any]:
    """jax.Array leaves of several dtypes and shapes."""
    return {
        "w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3) * scale,
        "b": jnp.full((3,), scale, dtype=jnp.bfloat16),
        "nested": {"count": jnp.asarray(int(scale * 10), dtype=jnp.int32)},
    }


def numpy_state(scale: float = 1.0) -> dict[str, Any]:
    """numpy leaves: they must come back as numpy, with their dtype."""
    return {
        "f64": np.linspace(0.0, scale, 5, dtype=np.float64),
        "i16": (np.arange(4, dtype=np.int16) * int(scale + 1)).astype(np.int16),
        "u8": np.arange(3, dtype=np.uint8),
        "flag": np.array([True, False]),
    }


def assert_same_tree(got: Any, want: Any) -> None:
    """Same structure; per leaf the same kind (jax.Array / numpy / Python scalar), dtype, shape and
    bit-identical values."""
    assert str(jax.tree.structure(got)) == str(jax.tree.structure(want)), (got, want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        if isinstance(w, jax.Array):
            assert isinstance(g, jax.Array), f"{type(g)} is not a jax.Array"
        elif isinstance(w, np.ndarray):
            assert isinstance(g, np.ndarray), f"{type(g)} is not a numpy array"
        else:
            assert type(g) is type(w), f"{type(g)} is not {type(w)}"
        if hasattr(w, "dtype"):
            assert g.dtype == w.dtype, f"dtype {g.dtype} != {w.dtype}"
            assert g.shape == w.shape, f"shape {g.shape} != {w.shape}"
            np.testing.assert_array_equal(
                np.asarray(g).reshape(-1).view(np.uint8), np.asarray(w).reshape(-1).view(np.uint8)
            )
        else:
            assert g == w


def steps_on_disk(root: Path, prefix: str | None = None, digits: int | None = None) -> list[int]:
    """The step directories Orbax's naming gives (`[<prefix>_]<step>`), as sorted ints."""
    number = rf"\d{{{digits},}}" if digits else r"\d+"
    pattern = re.compile(rf"{re.escape(prefix)}_({number})" if prefix else rf"({number})")
    found = []
    for path in root.iterdir():
        match = pattern.fullmatch(path.name)
        if match and path.is_dir():
            found.append(int(match.group(1)))
    return sorted(found)


def save_all(manager: Any, steps: Iterable[int], **save_kwargs: Any) -> list[bool]:
    """Save a small Composite at each step; the returned list is what each save() said."""
    return [
        manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(jax_state(step))),
            **save_kwargs,
        )
        for step in steps
    ]
