"""NumpyTreeHandler specifics: restore into targets, mismatches named by key path, refusals."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from support.handlers import stored, write_item
from support.treeutil import assert_tree_equal

from cairn.handlers import NumpyTreeHandler, handler_for, register
from cairn.handlers.errors import MismatchError

Pair = collections.namedtuple("Pair", ["first", "second"])


def save_restore(tmp_path: Path, obj: Any, target: Any) -> Any:
    handler = NumpyTreeHandler()
    records = write_item(handler, obj, tmp_path / "item")
    return handler.restore(stored(tmp_path / "item", records), target)


def test_target_of_shape_dtype_structs(tmp_path: Path) -> None:
    """jax.ShapeDtypeStruct targets give arrays; namedtuples in the target come back as namedtuples."""
    obj = {"w": np.ones((2, 3), np.float32), "p": (np.zeros(2), 3)}
    target = {"w": jax.ShapeDtypeStruct((2, 3), np.float32), "p": Pair(np.empty(2), 0)}
    got = save_restore(tmp_path, obj, target)
    assert isinstance(got["p"], Pair)
    assert_tree_equal(got["w"], obj["w"])
    assert_tree_equal(got["p"].first, obj["p"][0])
    assert got["p"].second == 3


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (
            {"w": np.ones((3, 2), np.float32), "b": [1, 2]},
            r"\['w'\]: shape \(2, 3\) in the checkpoint, \(3, 2\)",
        ),
        (
            {"w": np.ones((2, 3), np.float64), "b": [1, 2]},
            r"\['w'\]: dtype float32 in the checkpoint, float64",
        ),
        (
            {"w": np.ones((2, 3), np.float32)},
            r"<root>: keys differ.*only in the checkpoint: \['b'\]",
        ),
        (
            {"w": np.ones((2, 3), np.float32), "b": [1]},
            r"\['b'\]: the target has 1 entries, the checkpoint 2",
        ),
        ({"w": {"x": 1}, "b": [1, 2]}, r"\['w'\]: the target is a dict, the checkpoint a array"),
        ({"w": np.ones((2, 3), np.float32), "b": np.ones(2)}, r"\['b'\]: the target is a leaf"),
        (
            {"w": np.ones((2, 3), np.float32), "b": [np.ones(1), 2]},
            r"\['b'\]\[0\]: the target is an array",
        ),
    ],
)
def test_mismatch_names_the_key_path(tmp_path: Path, target: Any, message: str) -> None:
    """Every disagreement between target and checkpoint raises MismatchError naming the key path."""
    obj = {"w": np.zeros((2, 3), np.float32), "b": [1, 2]}
    with pytest.raises(MismatchError, match=message):
        save_restore(tmp_path, obj, target)


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ({"a": {1: np.ones(1)}}, r"dict key 1 at \['a'\] is a int"),
        ({"a": [np.array([object()])]}, r"array at \['a'\]\[0\] has dtype object"),
        ({"a": {"b": {1, 2}}}, r"leaf at \['a'\]\['b'\] is a set"),
    ],
)
def test_unstorable_values_are_refused_at_snapshot(obj: Any, message: str) -> None:
    """What the handler cannot store raises TypeError naming the key path, at snapshot time."""
    with pytest.raises(TypeError, match=message):
        NumpyTreeHandler().snapshot(obj)


def test_jax_arrays_are_stored_as_numpy(tmp_path: Path) -> None:
    """An array-like leaf (jax.Array) is copied at snapshot and comes back as np.ndarray."""
    got = save_restore(tmp_path, {"x": jax.numpy.arange(4.0)}, None)
    assert_tree_equal(got["x"], np.arange(4.0, dtype=np.float32))


def test_registry_picks_by_mro_and_refuses_conflicts() -> None:
    """Subclasses of dict get the tree handler; re-registering a taken type needs replace=True."""

    class MyDict(dict):  # type: ignore[type-arg]
        pass

    assert handler_for(MyDict()).id == "cairn.train_state"
    assert handler_for(collections.OrderedDict()).id == "cairn.train_state"
    with pytest.raises(TypeError, match="no handler is registered for object"):
        handler_for(object())

    class Other(NumpyTreeHandler):
        id = "test.other"

    with pytest.raises(ValueError, match=r"type dict already has handler .cairn\.train_state."):
        register(Other(), dict)
    with pytest.raises(TypeError, match="no `snapshot` method"):
        register(type("H", (), {"id": "x", "version": 1})())  # type: ignore[arg-type]
