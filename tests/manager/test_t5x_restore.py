"""cairn.manager.t5x restores as T5X does (issue 20, points 1-7): dtypes from the checkpoint,
every leaf lazy, restore_dtype on integer params, T5X's shape message, attributes set after
construction, PINNED steps, and a second Checkpointer on one directory."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from cairn.manager import MismatchError, ReadOnlyError, SupersededError
from cairn.manager import t5x as checkpoints


def state_at(step: int, kernel: Any = None, count: Any = None) -> dict[str, Any]:
    """A T5X-style dict train state with a scalar optimizer count."""
    return {
        "step": jnp.array(step, jnp.int32),
        "params": {
            "kernel": jnp.full((4, 8), float(step), jnp.float32) if kernel is None else kernel,
            "bias": jnp.arange(8, dtype=jnp.float32),
        },
        "opt_state": {
            "count": np.int64(step) if count is None else count,
            "mu": {"kernel": jnp.ones((4, 8), jnp.float32)},
        },
    }


# ---------------------------------------------------------------------------- point 2: dtypes


def test_restore_dtype_none_returns_the_saved_dtype(tmp_path: Path) -> None:
    saved = state_at(3)
    with checkpoints.Checkpointer(saved, None, tmp_path) as ckpt:  # save_dtype float32
        ckpt.save(saved)
    bf16 = state_at(0, kernel=jnp.zeros((4, 8), jnp.bfloat16))
    bf16["params"]["bias"] = jnp.zeros(8, jnp.bfloat16)
    with checkpoints.Checkpointer(bf16, None, tmp_path) as ckpt:
        got = ckpt.restore()
        assert got["params"]["kernel"].dtype == jnp.float32  # as saved, not the template's
        assert isinstance(got["params"]["kernel"], jax.Array)
        np.testing.assert_array_equal(got["params"]["kernel"], np.full((4, 8), 3.0))
        ckpt.restore_dtype = jnp.bfloat16
        assert ckpt.restore()["params"]["kernel"].dtype == jnp.bfloat16
    # save_dtype=bfloat16: the checkpoint holds bfloat16, and that is what comes back
    with checkpoints.Checkpointer(saved, None, tmp_path / "b", save_dtype=jnp.bfloat16) as ckpt:
        ckpt.save(saved)
        assert ckpt.restore()["params"]["kernel"].dtype == jnp.bfloat16
    loaded = checkpoints.load_t5x_checkpoint(tmp_path / "b")
    assert loaded["target"]["kernel"].dtype == jnp.bfloat16
    assert loaded["state"]["param_states"]["mu"]["kernel"].dtype == jnp.float32


# ---------------------------------------------------------------------------- point 3: lazy


def test_lazy_parameters_make_every_leaf_a_lazy_array(tmp_path: Path) -> None:
    saved = state_at(7)
    saved["opt_state"]["scale"] = np.float32(0.5)  # a NumPy scalar leaf
    with checkpoints.Checkpointer(saved, None, tmp_path) as ckpt:
        ckpt.save(saved)
        lazy = ckpt.restore(lazy_parameters=True)
    leaves = jax.tree_util.tree_leaves(lazy)
    assert len(leaves) == 6 and all(isinstance(x, checkpoints.LazyArray) for x in leaves)
    assert lazy["step"].shape == () and lazy["step"].dtype == np.int32
    assert int(lazy["step"].get()) == 7  # T5X: state.step.get()
    got = jax.tree_util.tree_map(lambda x: x.get(), lazy)  # T5X's idiom
    np.testing.assert_array_equal(got["params"]["kernel"], np.full((4, 8), 7.0))
    assert got["opt_state"]["count"] == 7 and got["opt_state"]["scale"] == np.float32(0.5)
    kernel = lazy["params"]["kernel"]
    assert kernel.nbytes == 4 * 8 * 4 and "shape=(4, 8)" in repr(kernel)
    assert kernel.astype(np.float16).get().dtype == np.float16
    assert asyncio.run(_get_async(kernel)).shape == (4, 8)
    loaded = checkpoints.load_t5x_checkpoint(tmp_path, lazy_parameters=True)
    assert all(isinstance(x, checkpoints.LazyArray) for x in jax.tree_util.tree_leaves(loaded))
    assert int(loaded["state"]["step"].get()) == 7
    # a lazily restored state saves again (T5X: "May contain LazyArray objects")
    lazy["step"] = checkpoints.LazyArray((), np.int32, lambda: np.int32(8))
    with checkpoints.Checkpointer(saved, None, tmp_path) as ckpt:
        ckpt.save(lazy)
        assert ckpt.latest_step() == 8
        np.testing.assert_array_equal(ckpt.restore()["params"]["kernel"], np.full((4, 8), 7.0))


async def _get_async(lazy: checkpoints.LazyArray) -> np.ndarray:
    return await lazy.get_async()  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------- point 4


def test_restore_dtype_casts_params_saved_with_an_integer_save_dtype(tmp_path: Path) -> None:
    saved = state_at(1, kernel=jnp.full((4, 8), 3.0, jnp.float32))
    with checkpoints.Checkpointer(saved, None, tmp_path, save_dtype=np.int32) as ckpt:
        ckpt.save(saved)
        assert ckpt.restore()["params"]["kernel"].dtype == np.int32  # as saved
    with checkpoints.Checkpointer(saved, None, tmp_path, restore_dtype=np.float32) as ckpt:
        got = ckpt.restore()
        lazy = ckpt.restore(lazy_parameters=True)
    assert got["params"]["kernel"].dtype == np.float32
    np.testing.assert_array_equal(got["params"]["kernel"], np.full((4, 8), 3.0))
    assert got["opt_state"]["count"].dtype == np.int64  # only the params are cast
    assert lazy["params"]["kernel"].dtype == np.float32
    assert lazy["params"]["kernel"].get().dtype == np.float32
    loaded = checkpoints.load_t5x_checkpoint(tmp_path, restore_dtype=ml_dtypes.bfloat16)
    assert loaded["target"]["kernel"].dtype == ml_dtypes.bfloat16
    assert loaded["state"]["step"].dtype == np.int32


# ---------------------------------------------------------------------------- point 5


def test_non_param_dtypes_come_from_the_checkpoint(tmp_path: Path) -> None:
    saved = state_at(2, count=np.uint8(2))
    with checkpoints.Checkpointer(saved, None, tmp_path) as ckpt:
        ckpt.save(saved)
    template = state_at(0, count=jnp.array(0, jnp.int32))  # the model code changed the dtype
    with checkpoints.Checkpointer(template, None, tmp_path) as ckpt:
        got = ckpt.restore()
    assert got["opt_state"]["count"].dtype == np.uint8 and got["opt_state"]["count"] == 2


def test_shape_mismatch_uses_t5x_message(tmp_path: Path) -> None:
    saved = state_at(2, kernel=jnp.zeros((2, 16), jnp.float32))
    saved["opt_state"]["mu"]["kernel"] = jnp.zeros((2, 16), jnp.float32)
    with checkpoints.Checkpointer(saved, None, tmp_path) as ckpt:
        ckpt.save(saved)
    message = "Shape of `target/kernel` in checkpoint (2, 16) does not match expected (4, 8)."
    with checkpoints.Checkpointer(state_at(0), None, tmp_path) as ckpt:
        for lazy in (False, True):
            with pytest.raises(MismatchError) as info:
                ckpt.restore(lazy_parameters=lazy)
            assert str(info.value) == message
    assert isinstance(info.value, ValueError)  # T5X raises ValueError


# ---------------------------------------------------------------------------- point 6


def test_attributes_set_after_construction_take_effect(tmp_path: Path) -> None:
    with checkpoints.Checkpointer(state_at(0), None, tmp_path) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(state_at(step))
        ckpt.keep = 1
        assert ckpt.keep == 1
        ckpt.save(state_at(4))
        assert ckpt.all_steps() == [4]
        ckpt.keep = None
        ckpt.save(state_at(5))
        assert ckpt.all_steps() == [4, 5]
        ckpt.save_dtype = jnp.bfloat16
        ckpt.save(state_at(6))
        assert ckpt.restore(step=6)["params"]["kernel"].dtype == jnp.bfloat16
        ckpt.save_dtype = None
        ckpt.restore_dtype = np.float16
        assert ckpt.restore(step=5)["params"]["kernel"].dtype == np.float16
        for name, bad, error in (
            ("keep", -1, ValueError),
            ("keep", "3", ValueError),
            ("keep_dataset_checkpoints", 1.5, ValueError),
            ("save_dtype", "not-a-dtype", TypeError),
            ("restore_dtype", object(), TypeError),
        ):
            with pytest.raises(error, match=name):
                setattr(ckpt, name, bad)
        assert ckpt.keep is None and ckpt.save_dtype is None
        ckpt.checkpoints_dir = tmp_path / "elsewhere"  # saves go there from now on
        ckpt.save(state_at(7))
        assert ckpt.all_steps() == [7]
    assert checkpoints.all_steps(tmp_path) == [4, 5, 6]
    assert checkpoints.all_steps(tmp_path / "elsewhere") == [7]


def test_save_best_attributes_set_after_construction(tmp_path: Path) -> None:
    ckpt = checkpoints.SaveBestCheckpointer(
        state_at(0), None, tmp_path, keep=1, keep_checkpoints_without_metrics=True
    )
    with ckpt:
        for step in (1, 2, 3):
            ckpt.save(state_at(step))
        assert ckpt.all_steps() == [1, 2, 3]  # no metrics yet: all kept
        ckpt.keep_checkpoints_without_metrics = False
        ckpt.save(state_at(4))
        assert ckpt.all_steps() == [3, 4]  # latest kept, plus `keep` newest without metrics
        ckpt.force_keep_period = 5
        for step in (5, 6, 7):
            ckpt.save(state_at(step))
        assert 5 in ckpt.all_steps()
        with pytest.raises(ValueError, match="metric_mode"):
            ckpt.metric_mode = "median"
        with pytest.raises(ValueError, match="metric_name_to_monitor"):
            ckpt.metric_name_to_monitor = ""
        with pytest.raises(TypeError, match="keep_checkpoints_without_metrics"):
            ckpt.keep_checkpoints_without_metrics = 1  # type: ignore[assignment]
        assert ckpt.metric_mode == "max"


# ---------------------------------------------------------------------------- point 7: PINNED


def pin_checkpoint(ckpt_dir: str, txt: str = "1") -> None:
    """What T5X's checkpoint_utils.pin_checkpoint does: a PINNED file in the step directory."""
    with open(os.path.join(ckpt_dir, "PINNED"), "w") as f:
        f.write(txt)


def test_pinned_steps_survive_retention(tmp_path: Path) -> None:
    with checkpoints.Checkpointer(state_at(0), None, tmp_path, keep=2) as ckpt:
        ckpt.save(state_at(1))
        ckpt.wait_until_finished()
        pin_checkpoint(checkpoints.get_checkpoint_dir(tmp_path, 1))
        for step in (2, 3, 4, 5):
            ckpt.save(state_at(step))
        assert ckpt.all_steps() == [1, 4, 5]  # pinned, plus `keep` newest
        np.testing.assert_array_equal(ckpt.restore(step=1)["params"]["kernel"], np.ones((4, 8)))
        os.remove(os.path.join(checkpoints.get_checkpoint_dir(tmp_path, 1), "PINNED"))
        ckpt.save(state_at(6))
        assert ckpt.all_steps() == [5, 6]


def test_pinned_steps_keep_their_dataset_iterator(tmp_path: Path) -> None:
    iter_state = _Counter()
    ckpt = checkpoints.Checkpointer(
        state_at(0), None, tmp_path, iter_state, keep_dataset_checkpoints=1
    )
    with ckpt:
        ckpt.save(state_at(1))
        ckpt.wait_until_finished()
        pin_checkpoint(checkpoints.get_checkpoint_dir(tmp_path, 1))
        iter_state.n = 5
        ckpt.save(state_at(2))
        iter_state.n = 9
        ckpt.save(state_at(3))
        assert ckpt.all_dataset_checkpoint_steps() == [1, 3]


class _Counter:
    """A stateful iterator with get_state/set_state (cairn's iterator protocol)."""

    def __init__(self) -> None:
        self.n = 0

    def __iter__(self) -> _Counter:
        return self

    def __next__(self) -> int:
        self.n += 1
        return self.n

    def get_state(self) -> dict[str, int]:
        return {"n": self.n}

    def set_state(self, state: dict[str, int]) -> None:
        self.n = state["n"]


# ---------------------------------------------------------------------------- point 1


def test_a_save_best_checkpointer_takes_over_from_a_checkpointer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    old = checkpoints.Checkpointer(state_at(0), None, tmp_path, keep=3)
    old.save(state_at(1))
    with caplog.at_level(logging.WARNING, logger="cairn"):
        new = checkpoints.SaveBestCheckpointer(state_at(0), None, tmp_path, keep=3)
    with new:
        assert new.all_steps() == [1]  # the old one's pending save landed first
        new.save(state_at(2))
        with pytest.raises(SupersededError) as info:
            old.save(state_at(3))
        assert isinstance(info.value, ReadOnlyError)
        message = str(info.value)
        assert message.startswith("Checkpointer.save(step 3): another writable checkpointer")
        assert str(tmp_path) in message and "Save through the newest one" in message
        assert any("took over" in r.getMessage() for r in caplog.records)  # logged, as it went
        assert new.all_steps() == [1, 2]
        np.testing.assert_array_equal(old.restore(step=1)["params"]["kernel"], np.ones((4, 8)))
        again = checkpoints.Checkpointer(state_at(0), None, tmp_path)  # a notebook cell run twice
        again.save(state_at(4))
        with pytest.raises(SupersededError):
            new.save(state_at(5))
        again.close()
    old.close()
    assert checkpoints.all_steps(tmp_path) == [1, 2, 4]


def test_restore_dtype_applies_where_the_transforms_put_the_params(tmp_path: Path) -> None:
    """T5X casts ``target`` after the restore transformations, not where a leaf was saved."""
    saved = state_at(3)
    with checkpoints.Checkpointer(saved, None, tmp_path) as ckpt:
        ckpt.save(saved)

    def swap(state: dict[str, Any], target: dict[str, Any]) -> dict[str, Any]:
        params, mu = state["target"]["kernel"], state["state"]["param_states"]["mu"]["kernel"]
        state["target"]["kernel"], state["state"]["param_states"]["mu"]["kernel"] = mu, params
        return state

    with checkpoints.Checkpointer(saved, None, tmp_path, restore_dtype=np.float16) as ckpt:
        for lazy in (False, True):
            got = ckpt.restore(state_transformation_fns=[swap], lazy_parameters=lazy)
            kernel, mu = got["params"]["kernel"], got["opt_state"]["mu"]["kernel"]
            assert kernel.dtype == np.float16 and mu.dtype == np.float32
            np.testing.assert_array_equal(np.asarray(kernel), np.ones((4, 8)))  # was mu
            np.testing.assert_array_equal(np.asarray(mu), np.full((4, 8), 3.0))  # was kernel
            assert got["params"]["bias"].dtype == np.float16
