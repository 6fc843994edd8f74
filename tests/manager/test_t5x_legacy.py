"""Issue 20, point 8: existing T5X runs resume after the import swap, in both T5X layouts.

The legacy layout is written by tests/support/t5x_legacy_writer.py (following t5x/checkpoints.py), the
Orbax layout by the real orbax-checkpoint package with T5X's step names and items.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import msgpack
import numpy as np
import pytest
import tensorstore as ts
from support.t5x_legacy_writer import msgpack_bytes, write_legacy_step

from cairn.manager import CorruptCheckpointError, ItemNotFoundError, MismatchError
from cairn.manager import t5x as checkpoints


def t5x_state(step: int, scale: float = 1.0) -> dict[str, Any]:
    """A T5X state dict as a T5X job saves it (params float32 after save_dtype)."""
    return {
        "target": {
            "encoder": {
                "layers_0": {"kernel": np.full((4, 8), scale, np.float32) + np.arange(8)},
                "bias": np.arange(8, dtype=np.float32) * scale,
            }
        },
        "state": {
            "step": np.asarray(step, np.int32),
            "param_states": {
                "encoder": {
                    "layers_0": {"kernel": {"v": np.full((4, 8), -scale, np.float32)}},
                    "bias": {"v": np.ones(8, np.float32)},
                },
                "count": np.uint8(step % 200),
            },
        },
    }


def template(step: int = 0, param_dtype: Any = jnp.float32) -> dict[str, Any]:
    """The trainer's train state after the swap: a dict with step, params, opt_state."""
    return {
        "step": jnp.array(step, jnp.int32),
        "params": {
            "encoder": {
                "layers_0": {"kernel": jnp.zeros((4, 8), param_dtype)},
                "bias": jnp.zeros(8, param_dtype),
            }
        },
        "opt_state": {
            "encoder": {
                "layers_0": {"kernel": {"v": jnp.zeros((4, 8))}},
                "bias": {"v": jnp.zeros(8)},
            },
            "count": jnp.array(0, jnp.int64) if jax.config.jax_enable_x64 else jnp.array(0),
        },
    }


def as_cairn_state(sd: dict[str, Any]) -> dict[str, Any]:
    return {
        "step": jnp.asarray(sd["state"]["step"]),
        "params": jax.tree.map(jnp.asarray, sd["target"]),
        "opt_state": jax.tree.map(jnp.asarray, sd["state"]["param_states"]),
    }


def tree_digest(root: Path) -> dict[str, str]:
    """Every file in the step directories under `root` with the hash of its bytes."""
    out = {}
    for dirpath, _, files in os.walk(root):
        parts = Path(dirpath).relative_to(root).parts
        if not parts or not parts[0].startswith("checkpoint_"):
            continue
        for name in files:
            path = Path(dirpath) / name
            out[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@pytest.fixture
def legacy_run(tmp_path: Path) -> Path:
    """A T5X run that saved steps 100 and 200 in its legacy layout (kernels in TensorStore)."""
    for step in (100, 200):
        write_legacy_step(tmp_path, t5x_state(step, scale=step / 100))
    return tmp_path


# ---------------------------------------------------------------------------- the legacy layout


def test_fixture_writer_follows_t5x(legacy_run: Path) -> None:
    """The fixture is T5X's layout: msgpack {'version': 3, 'optimizer': ...}, relative zarr specs."""
    step_dir = legacy_run / "checkpoint_200"
    names = sorted(p.name for p in step_dir.iterdir())
    assert names == [
        "checkpoint",
        "state.param_states.encoder.layers_0.kernel.v",
        "target.encoder.layers_0.kernel",
    ]
    raw = msgpack.unpackb((step_dir / "checkpoint").read_bytes(), raw=False)
    assert raw["version"] == 3
    spec = raw["optimizer"]["target"]["encoder"]["layers_0"]["kernel"]
    assert spec["driver"] == "zarr" and spec["kvstore"] == {
        "driver": "file",
        "path": "target.encoder.layers_0.kernel/",  # ts.Spec.to_json() ends it with a slash
    }
    assert spec["metadata"]["compressor"]["id"] == "gzip"
    assert isinstance(raw["optimizer"]["target"]["encoder"]["bias"], msgpack.ExtType)
    assert raw["optimizer"]["target"]["encoder"]["bias"].code == 1  # flax's ndarray ext type
    assert raw["optimizer"]["state"]["param_states"]["count"].code == 3  # a NumPy scalar


def test_module_functions_list_legacy_steps(legacy_run: Path) -> None:
    (legacy_run / "checkpoint_300.tmp-1700000000").mkdir()  # T5X's save in progress
    (legacy_run / "checkpoint_300.tmp-1700000000" / "checkpoint").write_bytes(b"\x80")
    assert checkpoints.all_steps(legacy_run) == [100, 200]
    assert checkpoints.latest_step(legacy_run) == 200
    assert checkpoints.find_checkpoint(legacy_run) == str(legacy_run / "checkpoint_200/checkpoint")
    assert checkpoints.find_checkpoint(legacy_run, 100) == str(
        legacy_run / "checkpoint_100/checkpoint"
    )
    assert checkpoints.find_checkpoint(legacy_run / "checkpoint_100") == str(
        legacy_run / "checkpoint_100/checkpoint"
    )


def test_load_t5x_checkpoint_reads_legacy(legacy_run: Path) -> None:
    loaded = checkpoints.load_t5x_checkpoint(str(legacy_run))
    want = t5x_state(200, scale=2.0)
    jax.tree.map(np.testing.assert_array_equal, loaded, want)
    assert loaded["state"]["param_states"]["count"].dtype == np.uint8
    cast = checkpoints.load_t5x_checkpoint(legacy_run, step=100, restore_dtype=jnp.bfloat16)
    assert cast["target"]["encoder"]["bias"].dtype == ml_dtypes.bfloat16
    assert cast["state"]["param_states"]["encoder"]["bias"]["v"].dtype == np.float32
    lazy = checkpoints.load_t5x_checkpoint(legacy_run, lazy_parameters=True)
    kernel = lazy["target"]["encoder"]["layers_0"]["kernel"]
    assert kernel.shape == (4, 8)
    np.testing.assert_array_equal(kernel.get(), want["target"]["encoder"]["layers_0"]["kernel"])
    renamed = checkpoints.load_t5x_checkpoint(
        legacy_run, state_transformation_fns=[lambda s, t: {"renamed": s["target"]}]
    )
    assert list(renamed) == ["renamed"]


def test_checkpointer_restores_latest_legacy_step(legacy_run: Path) -> None:
    before = tree_digest(legacy_run)
    ckpt = checkpoints.Checkpointer(template(), None, legacy_run)
    assert ckpt.latest_step() == 200
    assert ckpt.all_steps() == [100, 200]
    state = ckpt.restore()
    want = as_cairn_state(t5x_state(200, scale=2.0))
    jax.tree.map(np.testing.assert_array_equal, state, want)
    assert int(state["step"]) == 200
    assert isinstance(state["params"]["encoder"]["bias"], jax.Array)
    older = ckpt.restore(step=100)
    assert int(older["step"]) == 100
    by_path = ckpt.restore(path=str(legacy_run / "checkpoint_100" / "checkpoint"))
    assert int(by_path["step"]) == 100
    ckpt.close()
    assert tree_digest(legacy_run) == before  # read in place, nothing written into the steps


def test_legacy_dtypes_follow_t5x(legacy_run: Path) -> None:
    """restore_dtype=None: params in the checkpoint's dtype (float32 against a bfloat16
    template); restore_dtype casts the params only; other leaves keep the checkpoint's dtype."""
    with checkpoints.Checkpointer(template(param_dtype=jnp.bfloat16), None, legacy_run) as ckpt:
        state = ckpt.restore()
    assert state["params"]["encoder"]["layers_0"]["kernel"].dtype == jnp.float32
    assert state["opt_state"]["count"].dtype == jnp.uint8  # the checkpoint's, not the template's
    with checkpoints.Checkpointer(template(), None, legacy_run, restore_dtype=jnp.bfloat16) as ckpt:
        state = ckpt.restore()
    assert state["params"]["encoder"]["layers_0"]["kernel"].dtype == jnp.bfloat16
    assert state["params"]["encoder"]["bias"].dtype == jnp.bfloat16
    assert state["opt_state"]["encoder"]["bias"]["v"].dtype == jnp.float32


def test_legacy_lazy_parameters_and_shape_mismatch(legacy_run: Path) -> None:
    with checkpoints.Checkpointer(template(), None, legacy_run) as ckpt:
        lazy = ckpt.restore(lazy_parameters=True)
        got = jax.tree.map(
            lambda x: x.get(), lazy, is_leaf=lambda x: not isinstance(x, dict) and hasattr(x, "get")
        )
        assert int(lazy["step"].get()) == 200
        jax.tree.map(np.testing.assert_array_equal, got, as_cairn_state(t5x_state(200, 2.0)))
    wrong = template()
    wrong["params"]["encoder"]["layers_0"]["kernel"] = jnp.zeros((2, 16))
    with (
        checkpoints.Checkpointer(wrong, None, legacy_run) as ckpt,
        pytest.raises(
            ValueError,
            match=r"Shape of `target/encoder/layers_0/kernel` in checkpoint \(4, 8\) does not "
            r"match expected \(2, 16\)\.",
        ),
    ):
        ckpt.restore()


def test_resume_and_keep_training_beside_legacy_steps(legacy_run: Path) -> None:
    """Restore the newest T5X step, keep training, save cairn steps beside; retention (keep=1)
    never deletes or changes a T5X step; latest_step sees both kinds."""
    before = tree_digest(legacy_run)
    resumed = template()
    resumed["opt_state"]["count"] = jnp.array(0, jnp.uint8)  # what T5X saved (see point 5)
    ckpt = checkpoints.Checkpointer(resumed, None, legacy_run, keep=1)
    state = ckpt.restore()
    assert ckpt.save(state) is False  # step 200 exists (T5X's loop saves the restored step again)
    for step in (300, 400):
        state = {
            **state,
            "step": jnp.array(step, jnp.int32),
            "params": jax.tree.map(lambda x: x + 1, state["params"]),
        }
        assert ckpt.save(state)
    ckpt.wait_until_finished()
    assert ckpt.all_steps() == [100, 200, 400]  # 300 went to retention, T5X's steps stayed
    assert checkpoints.all_steps(legacy_run) == [100, 200, 400]
    assert checkpoints.latest_step(legacy_run) == 400
    restored = ckpt.restore()
    assert int(restored["step"]) == 400
    np.testing.assert_array_equal(
        restored["params"]["encoder"]["bias"], np.arange(8, dtype=np.float32) * 2 + 2
    )
    assert int(ckpt.restore(step=200)["step"]) == 200  # the old step still restores
    ckpt.close()
    after = tree_digest(legacy_run)
    assert {
        k: v for k, v in after.items() if k.startswith(("checkpoint_100/", "checkpoint_200/"))
    } == before


def test_legacy_chunked_and_complex_msgpack_leaves(tmp_path: Path) -> None:
    sd = t5x_state(5)
    sd["state"]["extra"] = {"big": np.arange(1000, dtype=np.int64), "z": 1 + 2j}
    write_legacy_step(tmp_path, sd, chunk_bytes=1024)  # flax's chunked arrays
    loaded = checkpoints.load_t5x_checkpoint(tmp_path)
    np.testing.assert_array_equal(loaded["state"]["extra"]["big"], np.arange(1000))
    assert loaded["state"]["extra"]["z"] == 1 + 2j


def test_all_dataset_checkpoint_steps_counts_steps_t5x_wrote(tmp_path: Path) -> None:
    """Issue 43: real T5X returns the steps whose train_ds-* files are there; cairn returned []
    for steps T5X wrote (it read manifests only). Beside them, a cairn step with a dataset."""
    import tensorflow as tf

    it = iter(tf.data.Dataset.range(100))
    write_legacy_step(tmp_path, t5x_state(10), dataset_iterator=it)
    write_legacy_step(tmp_path, t5x_state(20))  # without a dataset checkpoint
    assert checkpoints.all_dataset_checkpoint_steps(tmp_path) == [10]
    (tmp_path / "checkpoint_20" / "train_ds-000-of-001.index").mkdir()  # not a file: no
    assert checkpoints.all_dataset_checkpoint_steps(tmp_path) == [10]


def test_legacy_dataset_iterator_resumes(tmp_path: Path) -> None:
    import tensorflow as tf

    it = iter(tf.data.Dataset.range(100))
    for _ in range(7):
        next(it)
    write_legacy_step(tmp_path, t5x_state(10), dataset_iterator=it)
    fresh = iter(tf.data.Dataset.range(100))
    with checkpoints.Checkpointer(template(), None, tmp_path, dataset_iterator=fresh) as ckpt:
        assert int(ckpt.restore()["step"]) == 10
    assert int(next(fresh)) == 7
    write_legacy_step(tmp_path, t5x_state(20))  # saved without an iterator
    with (
        checkpoints.Checkpointer(template(), None, tmp_path, dataset_iterator=fresh) as ckpt,
        pytest.raises(ItemNotFoundError, match="no dataset checkpoint train_ds-000-of-001"),
    ):
        ckpt.restore()
    assert int(next(fresh)) == 8  # untouched by the refused restore


# ---------------------------------------------------------------------------- hostile legacy steps


def _write_raw(root: Path, step: int, optimizer: Any, version: int = 3) -> Path:
    step_dir = root / f"checkpoint_{step}"
    step_dir.mkdir(parents=True)
    (step_dir / "checkpoint").write_bytes(
        msgpack_bytes({"version": version, "optimizer": optimizer})
    )
    return step_dir


def _zarr(path: Path, arr: np.ndarray) -> None:
    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(path)}}
    ts.open(spec, create=True, dtype=arr.dtype.name, shape=arr.shape).result().write(arr).result()


def _spec(path: str, driver: str = "file", **extra: Any) -> dict[str, Any]:
    return {
        "driver": "zarr",
        "dtype": "float32",
        "kvstore": {"driver": driver, "path": path, **extra},
        "metadata": {"shape": [2], "chunks": [2], "compressor": {"id": "gzip"}},
    }


def _hostile_state(kernel: Any) -> dict[str, Any]:
    return {
        "target": {"kernel": kernel},
        "state": {"step": np.asarray(1, np.int32), "param_states": {}},
    }


@pytest.mark.parametrize(
    ("spec", "refusal"),
    [
        (_spec("../outside"), "leaves the step directory"),
        (_spec("sub/../../outside"), "leaves the step directory"),
        (_spec("OUTSIDE_ABS"), "absolute array path"),
        (_spec("outside", driver="memory"), "kvstore driver 'memory' refused"),
        (_spec("outside", driver="http", base_url="http://127.0.0.1:1/"), "'http' refused"),
        ({**_spec("x"), "driver": "n5"}, "driver 'n5'"),
        ({**_spec("x"), "kvstore": "file:///etc"}, "kvstore is not an object"),
        # issue 42: NumPy's parser raised SyntaxError and ValueError for these
        ({**_spec("target.kernel"), "dtype": "(1,2"}, r"dtype '\(1,2' is not understood"),
        ({**_spec("target.kernel"), "dtype": "(2147483648,)f8"}, "is not understood"),
        ({**_spec("target.kernel"), "dtype": 7}, "is not a dtype's name"),
    ],
)
def test_hostile_specs_are_refused_and_nothing_outside_is_read(
    tmp_path: Path, spec: dict[str, Any], refusal: str
) -> None:
    run = tmp_path / "run"
    outside = tmp_path / "outside"
    _zarr(outside, np.array([13.0, 13.0], np.float32))  # a real array a crafted spec points at
    run.mkdir()
    if spec["kvstore"] != "file:///etc" and spec["kvstore"].get("path") == "OUTSIDE_ABS":
        spec["kvstore"]["path"] = str(outside)
    _write_raw(run, 1, _hostile_state(spec))
    file = str(run / "checkpoint_1" / "checkpoint")
    with pytest.raises(CorruptCheckpointError, match=refusal) as info:
        checkpoints.load_t5x_checkpoint(run)
    assert file in str(info.value) and "target/kernel" in str(info.value)
    with (
        checkpoints.Checkpointer(
            {"step": jnp.array(0), "params": {"kernel": jnp.zeros(2)}, "opt_state": {}}, None, run
        ) as ckpt,
        pytest.raises(CorruptCheckpointError, match=refusal),
    ):
        ckpt.restore()


@pytest.mark.parametrize(
    "arr",
    [
        np.array([[2**53 + 1, 3]], np.int64),
        np.array([[1 + 2j, 3 - 4j]], np.complex64),
        np.array([[True, False]]),
    ],
    ids=["int64", "complex64", "bool"],
)
def test_a_spec_without_a_dtype_is_corrupt(tmp_path: Path, arr: np.ndarray) -> None:
    """Issue 42: T5X always writes the dtype into a spec; one without it came back as float64
    (np.dtype(None)): 2**53 + 1 rounded, complex numbers without their imaginary part."""
    step_dir = write_legacy_step(
        tmp_path, {"target": {"w": arr}, "state": {"step": np.int32(1)}}, step=1, save_dtype=None
    )
    raw = msgpack.unpackb((step_dir / "checkpoint").read_bytes(), raw=False)
    assert raw["optimizer"]["target"]["w"]["dtype"] == arr.dtype.name  # what T5X writes
    del raw["optimizer"]["target"]["w"]["dtype"]
    (step_dir / "checkpoint").write_bytes(msgpack.packb(raw))
    with pytest.raises(CorruptCheckpointError, match="the spec has no dtype") as info:
        checkpoints.load_t5x_checkpoint(tmp_path, 1)
    assert str(step_dir / "checkpoint") in str(info.value) and "target/w" in str(info.value)


def test_a_link_out_of_the_step_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    _zarr(outside, np.array([13.0, 13.0], np.float32))
    run = tmp_path / "run"
    step_dir = _write_raw(run, 1, _hostile_state(_spec("target.kernel")))
    os.symlink(outside, step_dir / "target.kernel")  # the array's directory is a link
    with pytest.raises(CorruptCheckpointError, match="link"):
        checkpoints.load_t5x_checkpoint(run)
    os.unlink(step_dir / "target.kernel")
    (step_dir / "target.kernel").mkdir()
    os.symlink(outside / ".zarray", step_dir / "target.kernel" / ".zarray")  # a file in it
    with pytest.raises(CorruptCheckpointError, match="link or not a regular file"):
        checkpoints.load_t5x_checkpoint(run)


def test_truncated_and_malformed_msgpack(tmp_path: Path) -> None:
    step_dir = write_legacy_step(tmp_path, t5x_state(3))
    file = step_dir / "checkpoint"
    whole = file.read_bytes()
    file.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(CorruptCheckpointError, match="is not a T5X checkpoint file") as info:
        checkpoints.load_t5x_checkpoint(tmp_path)
    assert str(file) in str(info.value)
    cases = {
        b"": "not a T5X checkpoint file",
        msgpack.packb([1, 2]): "not a msgpack map",
        msgpack.packb({"version": 1, "optimizer": {}}): "version 1",
        msgpack.packb({"version": 3, "optimizer": {"x": msgpack.ExtType(9, b"")}}): "ext type 9",
        msgpack.packb(
            {"version": 3, "optimizer": {"x": msgpack.ExtType(1, msgpack.packb(([2], "O", b"")))}}
        ): "numbers only",
        msgpack.packb(
            {
                "version": 3,
                "optimizer": {
                    "x": msgpack.ExtType(1, msgpack.packb(([1000000], "float32", b"1234")))
                },
            }
        ): "holds 4 bytes",
        b"model_checkpoint_path: x": "TensorFlow checkpoint",
    }
    for body, message in cases.items():
        file.write_bytes(body)
        with pytest.raises(CorruptCheckpointError, match=message):
            checkpoints.load_t5x_checkpoint(tmp_path)


@pytest.mark.parametrize("key", ["\u00b2", "9" * 5000, "-1", "2", " 1", ""])
def test_a_chunked_array_with_odd_chunk_keys_is_corrupt(tmp_path: Path, key: str) -> None:
    """Issue 42: flax names a chunked array's chunks "0".."n-1"; a chunk key "²" (a digit to
    `str.isdigit`, not to `int`) or of 5,000 digits raised a raw ValueError, and keys that skip
    or repeat a number were sorted as if they did not."""
    chunks = {"0": np.zeros(2, np.float32), key: np.ones(2, np.float32)}
    chunked = {"__msgpack_chunked_array__": True, "shape": [4], "chunks": chunks}
    _write_raw(tmp_path, 1, {"target": {"kernel": chunked}, "state": {"step": 1}})
    with pytest.raises(CorruptCheckpointError, match=r"chunks named other than 0\.\.1") as info:
        checkpoints.load_t5x_checkpoint(tmp_path)
    assert str(tmp_path / "checkpoint_1" / "checkpoint") in str(info.value)


def test_missing_array_names_the_step(tmp_path: Path) -> None:
    import shutil

    step_dir = write_legacy_step(tmp_path, t5x_state(3))
    shutil.rmtree(step_dir / "target.encoder.layers_0.kernel")
    ckpt = checkpoints.Checkpointer(template(), None, tmp_path)
    with pytest.raises(CorruptCheckpointError, match=r"target\.encoder\.layers_0\.kernel") as info:
        ckpt.restore()
    ckpt.close()
    assert "missing" in str(info.value) and str(step_dir) in str(info.value)
    (step_dir / "target.encoder.layers_0.kernel").mkdir()  # a directory without .zarray
    with pytest.raises(CorruptCheckpointError, match="TensorStore cannot open"):
        checkpoints.load_t5x_checkpoint(tmp_path)


def test_missing_key_in_legacy_step(legacy_run: Path) -> None:
    bigger = template()
    bigger["params"]["decoder"] = {"kernel": jnp.zeros(3)}
    with checkpoints.Checkpointer(bigger, None, legacy_run) as ckpt:
        with pytest.raises(MismatchError, match="`target/decoder/kernel` is not in the checkpoint"):
            ckpt.restore()
        filled = ckpt.restore(
            fallback_state={
                "params": {"decoder": {"kernel": np.ones(3)}},
                "step": 0,
                "opt_state": {},
            }
        )
    np.testing.assert_array_equal(filled["params"]["decoder"]["kernel"], np.ones(3))


# ---------------------------------------------------------------------------- T5X's Orbax layout


def _orbax_t5x_run(root: Path, steps: tuple[int, ...], iterator: Any) -> None:
    """What T5X's OrbaxCheckpointManagerInterface writes: orbax-checkpoint steps named
    checkpoint_<step>, item 'state' (the state dict, PyTree) and item 'dataset' (a
    tf.train.Checkpoint of the tf.data iterator, T5X's DatasetCheckpointHandler)."""
    import orbax.checkpoint as ocp
    import tensorflow as tf

    class DatasetArgs(ocp.args.CheckpointArgs):
        def __init__(self, item: Any) -> None:
            self.item = item

    class DatasetHandler(ocp.CheckpointHandler):
        def save(self, directory: Any, args: DatasetArgs) -> None:
            tf.train.Checkpoint(ds=args.item).write(str(directory / "train_ds-000-of-001"))

        def restore(self, directory: Any, args: Any = None) -> Any:
            raise NotImplementedError

        def metadata(self, directory: Any) -> None:
            return None

    ocp.args.register_with_handler(DatasetHandler, for_save=True, for_restore=True)(DatasetArgs)
    options = ocp.CheckpointManagerOptions(step_prefix="checkpoint", create=True)
    with ocp.CheckpointManager(root, options=options, item_names=("state", "dataset")) as mgr:
        for step in steps:
            for _ in range(3):
                next(iterator)
            mgr.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeSave(t5x_state(step, step / 10)),
                    dataset=DatasetArgs(iterator),
                ),
            )
        mgr.wait_until_finished()


def test_orbax_layout_resumes_and_new_steps_go_beside(tmp_path: Path) -> None:
    import tensorflow as tf

    _orbax_t5x_run(tmp_path, (10, 20), iter(tf.data.Dataset.range(100)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_10", "checkpoint_20"]
    before = tree_digest(tmp_path)
    assert checkpoints.latest_step(tmp_path) == 20
    assert checkpoints.all_steps(tmp_path) == [10, 20]
    loaded = checkpoints.load_t5x_checkpoint(tmp_path)
    jax.tree.map(np.testing.assert_array_equal, loaded, t5x_state(20, 2.0))

    fresh = iter(tf.data.Dataset.range(100))
    ckpt = checkpoints.Checkpointer(template(), None, tmp_path, dataset_iterator=fresh, keep=1)
    assert ckpt.latest_step() == 20
    state = ckpt.restore()
    jax.tree.map(np.testing.assert_array_equal, state, as_cairn_state(t5x_state(20, 2.0)))
    assert state["opt_state"]["count"].dtype == jnp.uint8
    assert int(next(fresh)) == 6  # the iterator position came back too
    for step in (30, 40):
        assert ckpt.save({**state, "step": jnp.array(step, jnp.int32)})
    ckpt.wait_until_finished()
    assert ckpt.all_steps() == [10, 20, 40]
    assert int(ckpt.restore()["step"]) == 40
    assert int(ckpt.restore(step=10)["step"]) == 10
    ckpt.close()
    after = tree_digest(tmp_path)
    assert {
        k: v for k, v in after.items() if k.startswith(("checkpoint_10/", "checkpoint_20/"))
    } == before


def test_logging_stays_quiet_about_legacy_steps(
    legacy_run: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        caplog.at_level(logging.WARNING, logger="cairn"),
        checkpoints.Checkpointer(template(), None, legacy_run) as ckpt,
    ):
        ckpt.restore()
    assert not [r for r in caplog.records if "checkpoint_200" in r.getMessage()]


def test_gcs_written_step_copied_to_disk_reads_from_the_step(tmp_path: Path) -> None:
    """T5X writes kvstore gcs + t5x-dummy-bucket on GCS and reads such a step from a local copy
    at the same relative path; so does cairn (never from a bucket)."""
    step_dir = _write_raw(
        tmp_path,
        1,
        _hostile_state(_spec("target.kernel", driver="gcs", bucket="t5x-dummy-bucket")),
    )
    _zarr(step_dir / "target.kernel", np.array([1.5, 2.5], np.float32))
    loaded = checkpoints.load_t5x_checkpoint(tmp_path)
    np.testing.assert_array_equal(loaded["target"]["kernel"], [1.5, 2.5])


def test_crafted_shapes_depth_keys_and_placeholders(tmp_path: Path) -> None:
    huge = {**_spec("target.kernel"), "metadata": {"shape": [2**40], "chunks": [1024]}}
    step_dir = _write_raw(tmp_path / "a", 1, _hostile_state(huge))
    spec = {
        "driver": "zarr",
        "kvstore": {"driver": "file", "path": str(step_dir / "target.kernel")},
    }
    ts.open(
        spec,
        create=True,
        dtype="float32",
        shape=[2**40],
        chunk_layout=ts.ChunkLayout(read_chunk_shape=[1024]),
    ).result()  # metadata only: every chunk is missing, so zarr would fill 4 TiB
    with pytest.raises(CorruptCheckpointError, match="more than this machine's memory"):
        checkpoints.load_t5x_checkpoint(tmp_path / "a")

    deep: dict[str, Any] = {}
    node = deep
    for _ in range(300):
        node["a"] = {}
        node = node["a"]
    _write_raw(tmp_path / "b", 1, deep)
    with pytest.raises(CorruptCheckpointError, match="nested deeper than"):
        checkpoints.load_t5x_checkpoint(tmp_path / "b")

    step_dir = _write_raw(tmp_path / "c", 1, {})
    (step_dir / "checkpoint").write_bytes(
        msgpack.packb({"version": 3, "optimizer": {b"target": {}}}, use_bin_type=True)
    )
    with pytest.raises(CorruptCheckpointError, match="not a string"):
        checkpoints.load_t5x_checkpoint(tmp_path / "c")

    _write_raw(tmp_path / "d", 1, _hostile_state("PLACEHOLDER://target.kernel"))
    with (
        checkpoints.Checkpointer(
            {"step": jnp.array(0), "params": {"kernel": jnp.zeros(2)}, "opt_state": {}},
            None,
            tmp_path / "d",
        ) as ckpt,
        pytest.raises(MismatchError, match="`target/kernel` is str 'PLACEHOLDER"),
    ):
        ckpt.restore()


def test_orbax_layout_with_version_and_optimizer_keys(tmp_path: Path) -> None:
    """Some T5X versions saved ``{"version": 3, "optimizer": state dict}`` as the Orbax item."""
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(step_prefix="checkpoint", create=True)
    with ocp.CheckpointManager(tmp_path, options=options, item_names=("state",)) as mgr:
        tree = {"version": 3, "optimizer": t5x_state(7, 0.7)}
        mgr.save(7, args=ocp.args.Composite(state=ocp.args.PyTreeSave(tree)))
        mgr.wait_until_finished()
    with checkpoints.Checkpointer(template(), None, tmp_path) as ckpt:
        state = ckpt.restore()
    jax.tree.map(np.testing.assert_array_equal, state, as_cairn_state(t5x_state(7, 0.7)))
    assert checkpoints.load_t5x_checkpoint(tmp_path)["state"]["step"] == 7


def test_legacy_restore_places_leaves_by_the_partitioner(legacy_run: Path) -> None:
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    specs = jax.tree.map(lambda _: PartitionSpec(), template())
    with checkpoints.Checkpointer(template(), (mesh, specs), legacy_run) as ckpt:
        state = ckpt.restore()
    kernel = state["params"]["encoder"]["layers_0"]["kernel"]
    assert isinstance(kernel.sharding, NamedSharding) and kernel.sharding.mesh == mesh
    np.testing.assert_array_equal(
        kernel, t5x_state(200, 2.0)["target"]["encoder"]["layers_0"]["kernel"]
    )


def test_t5x_save_in_progress_is_left_alone(legacy_run: Path) -> None:
    tmp = legacy_run / "checkpoint_300.tmp-1700000000"
    write_legacy_step(legacy_run, t5x_state(300), commit=False).rename(tmp)
    before = tree_digest(legacy_run)
    with checkpoints.Checkpointer(template(), None, legacy_run, keep=1) as ckpt:
        assert ckpt.latest_step() == 200
        ckpt.save({**ckpt.restore(), "step": jnp.array(400, jnp.int32)})
    assert tmp.is_dir() and checkpoints.all_steps(legacy_run) == [100, 200, 400]
    after = tree_digest(legacy_run)
    assert {k: v for k, v in after.items() if not k.startswith("checkpoint_400/")} == before


def test_bfloat16_save_dtype_and_restore_only_checkpointer(tmp_path: Path) -> None:
    """save_dtype=bfloat16 (TensorStore's bfloat16 and flax's 'bfloat16' ext name) comes back
    bfloat16 with restore_dtype=None; a restore-only checkpointer (checkpoints_dir="") restores a
    T5X step of another directory by path."""
    run = tmp_path / "t5x_run"
    step_dir = write_legacy_step(run, t5x_state(50), save_dtype=ml_dtypes.bfloat16)
    raw = msgpack.unpackb((step_dir / "checkpoint").read_bytes(), raw=False)
    assert raw["optimizer"]["target"]["encoder"]["layers_0"]["kernel"]["dtype"] == "bfloat16"
    reader = checkpoints.Checkpointer(template(), None, "")
    state = reader.restore(path=str(step_dir))
    assert state["params"]["encoder"]["layers_0"]["kernel"].dtype == jnp.bfloat16
    assert state["params"]["encoder"]["bias"].dtype == jnp.bfloat16
    assert state["opt_state"]["encoder"]["bias"]["v"].dtype == jnp.float32  # never cast
    np.testing.assert_array_equal(
        np.asarray(state["params"]["encoder"]["bias"], np.float32), np.arange(8, dtype=np.float32)
    )
    as_f32 = checkpoints.load_t5x_checkpoint(step_dir, restore_dtype=np.float32)
    assert as_f32["target"]["encoder"]["layers_0"]["kernel"].dtype == np.float32


def test_other_checkpointers_resume_legacy_runs(legacy_run: Path) -> None:
    """The Orbax-style wrapper and SaveBestCheckpointer restore T5X steps too, and SaveBest's
    retention never deletes them."""
    before = tree_digest(legacy_run)
    wrapper = checkpoints.OrbaxCheckpointManagerInterface(legacy_run, template(), None)
    assert wrapper.latest_step() == 200
    assert int(wrapper.restore()["step"]) == 200
    assert int(wrapper.restore(step=100)["step"]) == 100
    assert not wrapper.should_save(200)
    wrapper.close()
    resumed = template()
    resumed["opt_state"]["count"] = jnp.array(0, jnp.uint8)
    best = checkpoints.SaveBestCheckpointer(
        resumed, None, legacy_run, keep=1, keep_checkpoints_without_metrics=False
    )
    state = best.restore()
    for step in (300, 400, 500):
        assert best.save({**state, "step": jnp.array(step, jnp.int32)})
    best.close()
    assert checkpoints.all_steps(legacy_run) == [100, 200, 400, 500]  # keep=1 + the latest
    after = tree_digest(legacy_run)
    assert {
        k: v for k, v in after.items() if k.startswith(("checkpoint_100/", "checkpoint_200/"))
    } == before


def test_legacy_manifest_describes_a_t5x_step(tmp_path: Path) -> None:
    """What a storage can list for a T5X step (a foreign, read-only step), or None."""
    import tensorflow as tf

    from cairn.manager._layouts import t5x as _t5x_legacy

    plain = write_legacy_step(tmp_path / "a", t5x_state(1))
    with_ds = write_legacy_step(
        tmp_path / "b", t5x_state(2), dataset_iterator=iter(tf.data.Dataset.range(3))
    )
    manifest = _t5x_legacy.legacy_manifest(1, plain)
    assert manifest.step == 1 and list(manifest.items) == ["state"]
    assert manifest.metadata == {"format": "t5x"}
    assert list(_t5x_legacy.legacy_manifest(2, with_ds).items) == ["state", "dataset"]
    (plain / "_CHECKPOINT.json").write_text("{}")  # a cairn step is not a T5X one
    assert _t5x_legacy.legacy_manifest(1, plain) is None
    assert _t5x_legacy.legacy_manifest(3, tmp_path / "missing") is None


def test_zero_padded_t5x_names_are_not_listed_anywhere(legacy_run: Path) -> None:
    """Listings agree: the module functions and the checkpointer see the same T5X steps."""
    os.rename(legacy_run / "checkpoint_100", legacy_run / "checkpoint_0100")
    assert checkpoints.all_steps(legacy_run) == [200]
    with checkpoints.Checkpointer(template(), None, legacy_run) as ckpt:
        assert ckpt.all_steps() == [200]
