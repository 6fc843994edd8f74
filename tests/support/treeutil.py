"""Strict equality for the nested values the tests save: same types, shapes, dtypes and values."""

from __future__ import annotations

from typing import Any

import numpy as np


def assert_tree_equal(got: Any, want: Any, path: str = "") -> None:
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray), f"{path}: {type(got)} is not an ndarray"
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{path}: shape {got.shape} != {want.shape}"
        np.testing.assert_array_equal(got, want, err_msg=path)
        return
    assert type(got) is type(want), f"{path}: {type(got)} is not {type(want)}"
    if isinstance(want, dict):
        assert list(got) == list(want), f"{path}: keys {list(got)} != {list(want)}"
        for k in want:
            assert_tree_equal(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_tree_equal(g, w, f"{path}[{i}]")
    elif isinstance(want, float) and want != want:
        assert got != got, f"{path}: {got} is not NaN"
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def dir_state(root: Any) -> dict[str, bytes]:
    """Every file under root (relative path -> bytes), to show that nothing changed on disk."""
    from pathlib import Path

    root = Path(root)
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"<dir>")
        for p in sorted(root.rglob("*"))
    }
