"""Property tests: any nested value the array handlers accept comes back exactly."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from support.handlers import stored, write_item
from support.treeutil import assert_tree_equal

from cairn.handlers import Handler, NumpyTreeHandler, TrainStateHandler
from cairn.handlers._tree import check_dtype_name
from cairn.handlers.io import StagingPool, dtype_from_name, dtype_name, staging_for

keys = st.text(min_size=0, max_size=8)  # any string: '/', '.', '..', unicode, empty
dtypes = st.sampled_from(
    [np.float32, np.float64, np.int8, np.int64, np.uint16, np.bool_, np.complex64]
)
arrays = dtypes.flatmap(
    lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5))
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**62), 2**62),
    st.floats(allow_nan=False),
    st.text(max_size=5),
    st.builds(np.float32, st.floats(width=32, allow_nan=False)),
    st.builds(np.int16, st.integers(-(2**15), 2**15 - 1)),
)
trees = st.recursive(
    st.one_of(scalars, arrays),
    lambda children: st.one_of(
        st.dictionaries(keys, children, max_size=4),
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
    ),
    max_leaves=12,
)


def round_trip(handler: Handler, obj: Any) -> Any:
    root = Path(tempfile.mkdtemp())
    try:
        records = write_item(handler, obj, root / "item")
        return handler.restore(stored(root / "item", records))
    finally:
        shutil.rmtree(root)


@settings(max_examples=60, deadline=None)
@given(trees)
def test_train_state_handler_round_trips_any_tree(obj: Any) -> None:
    """TrainStateHandler restores any generated tree exactly (small chunks to split arrays)."""
    assert_tree_equal(round_trip(TrainStateHandler(chunk_bytes=16), obj), obj)


@settings(max_examples=60, deadline=None)
@given(trees)
def test_numpy_tree_handler_round_trips_any_tree(obj: Any) -> None:
    """NumpyTreeHandler restores any generated tree exactly."""
    assert_tree_equal(round_trip(NumpyTreeHandler(), obj), obj)


_POOL = StagingPool()


@settings(max_examples=60, deadline=None)
@given(trees)
def test_staged_train_state_writes_what_the_unstaged_one_writes(obj: Any) -> None:
    """Copied through a staging pool (as a manager's save() does from its second save on), any
    tree writes the same files, byte for byte (zarr layout), or the same chunks (packed layout,
    whose staged packs keep each chunk on a page boundary), and restores exactly."""
    for layout in ("zarr", "packed"):
        handler = TrainStateHandler(chunk_bytes=16, layout=layout)
        root = Path(tempfile.mkdtemp())
        try:
            plain = written(write_item(handler, obj, root / "plain"), root / "plain")
            with staging_for(_POOL, "item"):
                snap = handler.snapshot(obj)
            if snap._lease is None:  # type: ignore[attr-defined]  # a new size: warmed, then staged
                _POOL.wait()
                with staging_for(_POOL, "item"):
                    snap = handler.snapshot(obj)
            staged = snap.write(root / "staged")
            assert written(staged, root / "staged") == plain
            assert_tree_equal(handler.restore(stored(root / "staged", staged)), obj)
        finally:
            shutil.rmtree(root)


def written(records: Any, root: Path) -> dict[str, Any]:
    """What a write phase stored: each file's hash, or (packed) each chunk's size and hash."""
    files = {r.path: r.xxh3_128 for r in records}
    if "packs/index.0.json" not in files:
        return files
    index = json.loads((root / "packs/index.0.json").read_bytes())["chunks"]
    return {"tree.json": files["tree.json"], **{k: (v[2], v[3]) for k, v in index.items()}}


#: Strings of what NumPy's dtype parser reads (it may take them, or raise TypeError, ValueError
#: or SyntaxError: it reads "(2,3)f4" as a subarray, with ast.literal_eval), and any text.
dtype_names = st.one_of(
    st.text(alphabet="()[],<>|=0123456789.efdbiuUSVOMmcsa_ ", max_size=12),
    st.text(max_size=12),
)


@settings(max_examples=300, deadline=None)
@given(dtype_names)
@example("(1,2")  # SyntaxError (issue 42)
@example("(9e9,)f")  # SyntaxError
@example("(2147483648,)f8")  # ValueError
@example("((1,)f4")
@example("")  # np.dtype("") is float64
@example("bfloat16")
@example("<M8[s]")
def test_any_dtype_name_from_disk_is_a_dtype_or_value_error(name: str) -> None:
    """A dtype name read from a file is one a save writes (numbers and booleans, for
    `check_dtype_name`), or ValueError; never another exception out of NumPy's parser."""
    try:
        dtype = check_dtype_name(name, "dtype")
    except ValueError:
        pass
    else:
        assert dtype_name(dtype) == name
        assert dtype.kind in "biufc" or dtype_name(dtype) != dtype.str  # ml_dtypes: kind V
    with contextlib.suppress(ValueError):
        dtype_from_name(name)
