"""cairn.manager.t5x: T5X's checkpoints API, behaviour by behaviour (../shared/seeds/t5x_checkpoints_api.txt)."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from support.iterutil import Shuffled, advanced, take
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from cairn.handlers import TfDataIteratorHandler
from cairn.manager import ItemNotFoundError, StepAlreadyExistsError
from cairn.manager import t5x as checkpoints


def make_state(step: int, scale: float = 1.0) -> dict[str, Any]:
    """A dict train state: step, params (float32 jax arrays) and optimizer state."""
    return {
        "step": jnp.array(step, jnp.int32),
        "params": {
            "dense": {"kernel": jnp.full((4, 3), scale, jnp.float32), "bias": jnp.zeros(3)},
        },
        "opt_state": {"mu": {"dense": {"kernel": jnp.full((4, 3), -scale), "bias": jnp.ones(3)}}},
    }


def assert_state_equal(got: Any, want: Any) -> None:
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, want
    )
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)


# ---------------------------------------------------------------------------- module functions


def test_get_checkpoint_dir_and_back(tmp_path: Path) -> None:
    assert checkpoints.get_checkpoint_dir("/m", 5) == "/m/checkpoint_5"
    assert (
        checkpoints.get_checkpoint_dir("/m", 5, step_format_fixed_length=4) == "/m/checkpoint_0005"
    )
    assert checkpoints.get_step_from_checkpoint_dir("/m/checkpoint_0005/") == ("/m", 5)
    assert checkpoints.get_step_from_checkpoint_dir("/m/checkpoint_12") == ("/m", 12)
    for bad in ("/m/checkpoint_5.tmp-17", "/m/my_checkpoint_5", "/m/step_5", "/m/checkpoint_"):
        with pytest.raises(ValueError, match="improperly formatted checkpoint directory"):
            checkpoints.get_step_from_checkpoint_dir(bad)
    with pytest.raises(ValueError, match="step_format_fixed_length"):
        checkpoints.get_checkpoint_dir("/m", 5, step_format_fixed_length=0)
    with pytest.raises(ValueError, match="step must be >= 0"):
        checkpoints.get_checkpoint_dir("/m", -1)


def test_listing_counts_committed_steps_only(tmp_path: Path) -> None:
    assert checkpoints.all_steps(tmp_path / "missing") == []
    assert checkpoints.latest_step(tmp_path / "missing") is None
    with checkpoints.Checkpointer(make_state(0), None, tmp_path) as ckpt:
        for step in (0, 10, 20):
            ckpt.save(make_state(step))
    (tmp_path / "checkpoint_30.tmp-0123").mkdir()  # a crashed save elsewhere
    (tmp_path / "checkpoint_40").mkdir()  # no manifest: never committed
    assert checkpoints.all_steps(tmp_path) == [0, 10, 20]
    assert checkpoints.latest_step(tmp_path) == 20
    assert checkpoints.all_dataset_checkpoint_steps(tmp_path) == []  # no iterator was given


def test_find_checkpoint(tmp_path: Path) -> None:
    with checkpoints.Checkpointer(make_state(0), None, tmp_path) as ckpt:
        ckpt.save(make_state(0))
        ckpt.save(make_state(7))
    manifest = str(tmp_path / "checkpoint_7" / "_CHECKPOINT.json")
    assert checkpoints.find_checkpoint(tmp_path) == manifest  # a model dir: the latest
    assert checkpoints.find_checkpoint(tmp_path, step=0).endswith("checkpoint_0/_CHECKPOINT.json")
    assert checkpoints.find_checkpoint(tmp_path / "checkpoint_7") == manifest
    assert checkpoints.find_checkpoint(manifest) == manifest
    for bad, step in ((tmp_path, 3), (tmp_path / "nothing", None), (tmp_path / "empty", None)):
        (tmp_path / "empty").mkdir(exist_ok=True)
        with pytest.raises(ValueError, match="Path is not a valid checkpoint"):
            checkpoints.find_checkpoint(bad, step)


# ---------------------------------------------------------------------------- Checkpointer


def test_save_and_restore_a_dict_train_state(tmp_path: Path) -> None:
    """The step comes from the state; restore returns the same kind of state; step 0 counts."""
    with checkpoints.Checkpointer(make_state(0), None, tmp_path) as ckpt:
        assert ckpt.latest_step() is None
        with pytest.raises(ValueError, match="No checkpoints found in"):
            ckpt.restore()
        ckpt.save(make_state(0, 0.5))
        assert ckpt.all_steps() == [0]  # saves are asynchronous; listing waits for them
        ckpt.save(make_state(3, 2.0))
        got = ckpt.restore()  # waits for the pending save, restores the latest
        assert_state_equal(got, make_state(3, 2.0))
        assert list(got) == ["step", "params", "opt_state"]
        assert_state_equal(ckpt.restore(step=0), make_state(0, 0.5))
        assert ckpt.latest_step() == 3


def test_restore_errors_are_the_documented_value_errors(tmp_path: Path) -> None:
    with checkpoints.Checkpointer(make_state(0), None, tmp_path) as ckpt:
        ckpt.save(make_state(1))
        with pytest.raises(ValueError, match="At most one of `step` or `path`"):
            ckpt.restore(step=1, path=tmp_path / "checkpoint_1")
        with pytest.raises(ValueError, match="Checkpoint for step 2 does not exist"):
            ckpt.restore(step=2)
        with pytest.raises(ValueError, match="Path is not a valid checkpoint"):
            ckpt.restore(path=tmp_path / "checkpoint_9")


def test_saving_an_existing_step_is_skipped_and_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """T5X's loop saves the step it restored again: the Checkpointer skips it (returns False)."""
    with checkpoints.Checkpointer(make_state(0), None, tmp_path) as ckpt:
        assert ckpt.save(make_state(4, 1.0))
        with caplog.at_level(logging.INFO, logger="cairn"):
            assert ckpt.save(make_state(4, 9.0)) is False  # in flight or committed: skipped
        assert "skipping the save" in caplog.text
        assert_state_equal(ckpt.restore(), make_state(4, 1.0))


def test_keep_deletes_the_oldest(tmp_path: Path) -> None:
    with checkpoints.Checkpointer(make_state(0), None, tmp_path, keep=2) as ckpt:
        for step in range(5):
            ckpt.save(make_state(step))
        assert ckpt.all_steps() == [3, 4]
    with checkpoints.Checkpointer(make_state(0), None, tmp_path / "all", keep=0) as ckpt:
        for step in range(3):
            ckpt.save(make_state(step))
        assert ckpt.all_steps() == [0, 1, 2]  # keep=0 keeps all, as T5X


def test_dataset_iterator_saved_restored_and_pruned(tmp_path: Path) -> None:
    data = Shuffled()
    with checkpoints.Checkpointer(
        make_state(0), None, tmp_path, data, keep=3, keep_dataset_checkpoints=1
    ) as ckpt:
        for step in range(1, 5):
            advanced(data, 5)
            ckpt.save(make_state(step))
        assert ckpt.all_steps() == [2, 3, 4]
        assert ckpt.all_dataset_checkpoint_steps() == [4]
        assert checkpoints.all_dataset_checkpoint_steps(tmp_path) == [4]
        expect = take(data)
        fresh = Shuffled()
        restorer = checkpoints.Checkpointer(make_state(0), None, tmp_path / "other", fresh)
        with restorer:
            restored = restorer.restore(path=tmp_path / "checkpoint_4")  # another run's directory
            assert_state_equal(restored, make_state(4))
            assert take(fresh) == expect  # moved in place to where step 4 was saved
            with pytest.raises(ItemNotFoundError, match="step 3 has no dataset iterator"):
                restorer.restore(path=tmp_path / "checkpoint_3")


def test_save_dtype_and_restore_dtype_touch_params_only(tmp_path: Path) -> None:
    state = {
        "step": np.int64(1),
        "params": {"w": np.linspace(0, 1, 6, dtype=np.float64)},
        "opt_state": {"m": np.linspace(0, 1, 6, dtype=np.float64)},
    }
    with checkpoints.Checkpointer(state, None, tmp_path) as ckpt:  # save_dtype=float32 (T5X)
        ckpt.save(state)
    loaded = checkpoints.load_t5x_checkpoint(tmp_path)
    assert loaded["target"]["w"].dtype == np.float32
    assert loaded["state"]["param_states"]["m"].dtype == np.float64
    cast = checkpoints.load_t5x_checkpoint(tmp_path, restore_dtype=ml_dtypes.bfloat16)
    assert cast["target"]["w"].dtype == ml_dtypes.bfloat16
    assert cast["state"]["param_states"]["m"].dtype == np.float64
    bf16_target = {**state, "params": {"w": np.zeros(6, ml_dtypes.bfloat16)}}
    with checkpoints.Checkpointer(
        bf16_target, None, tmp_path, restore_dtype=ml_dtypes.bfloat16
    ) as ckpt:
        got = ckpt.restore()
    assert got["params"]["w"].dtype == ml_dtypes.bfloat16
    assert got["opt_state"]["m"].dtype == np.float64


def test_transformations_fallback_and_lazy(tmp_path: Path) -> None:
    """Restore fns run in order as fn(state_dict, target_state_dict); fallback_state fills what the
    checkpoint lacks; lazy_parameters gives LazyArrays."""
    old = {"step": np.int32(2), "params": {"old_name": np.ones(3)}, "opt_state": {}}
    with checkpoints.Checkpointer(old, None, tmp_path, save_dtype=None) as ckpt:
        ckpt.save(old)
    new = {
        "step": np.int32(0),
        "params": {"new_name": np.zeros(3), "head": np.zeros(2)},
        "opt_state": {},
    }
    calls = []

    def rename(state: dict[str, Any], target: dict[str, Any]) -> dict[str, Any]:
        calls.append(sorted(target["target"]))
        state["target"] = {"new_name": state["target"].pop("old_name")}
        return state

    fallback = {**new, "params": {"new_name": np.zeros(3), "head": np.full(2, 7.0)}}
    with checkpoints.Checkpointer(new, None, tmp_path) as ckpt:
        got = ckpt.restore(state_transformation_fns=[rename], fallback_state=fallback)
        lazy = ckpt.restore(
            state_transformation_fns=[rename], fallback_state=fallback, lazy_parameters=True
        )
    assert calls == [["head", "new_name"], ["head", "new_name"]]
    np.testing.assert_array_equal(got["params"]["new_name"], np.ones(3))
    np.testing.assert_array_equal(got["params"]["head"], np.full(2, 7.0))
    assert int(got["step"]) == 2
    assert isinstance(lazy["params"]["new_name"], checkpoints.LazyArray)
    np.testing.assert_array_equal(lazy["params"]["new_name"].get(), np.ones(3))


@dataclasses.dataclass
class FlaxLikeState:
    """A flax.training.TrainState look-alike: a pytree with step, params, opt_state, replace()."""

    step: Any
    params: Any
    opt_state: Any

    def replace(self, **changes: Any) -> FlaxLikeState:
        return dataclasses.replace(self, **changes)


jax.tree_util.register_dataclass(
    FlaxLikeState, data_fields=["step", "params", "opt_state"], meta_fields=[]
)


class T5XLikeState:
    """A t5x.train_state.TrainState look-alike: state_dict() and restore_state()."""

    def __init__(self, sd: dict[str, Any]) -> None:
        self.sd = sd

    @property
    def step(self) -> Any:
        return self.sd["state"]["step"]

    def state_dict(self) -> dict[str, Any]:
        return self.sd

    def restore_state(self, sd: dict[str, Any]) -> T5XLikeState:
        return T5XLikeState(sd)


def test_flax_and_t5x_style_train_states(tmp_path: Path) -> None:
    flax_state = FlaxLikeState(jnp.array(5), {"w": jnp.ones(3)}, {"m": jnp.zeros(3)})
    with checkpoints.Checkpointer(flax_state, None, tmp_path / "flax") as ckpt:
        ckpt.save(flax_state)
        got = ckpt.restore()
    assert isinstance(got, FlaxLikeState) and int(got.step) == 5
    np.testing.assert_array_equal(got.params["w"], np.ones(3))
    sd = {"target": {"w": np.ones(2, np.float32)}, "state": {"step": 9, "param_states": {}}}
    t5x_state = T5XLikeState(sd)
    with checkpoints.Checkpointer(t5x_state, None, tmp_path / "t5x") as ckpt:
        ckpt.save(t5x_state)
        got = ckpt.restore()
    assert isinstance(got, T5XLikeState) and got.step == 9
    loaded = checkpoints.load_t5x_checkpoint(tmp_path / "t5x")
    assert loaded["state"]["step"] == 9 and list(loaded) == ["target", "state"]


def test_partitioner_places_the_restored_arrays(tmp_path: Path) -> None:
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    state = make_state(1)
    specs = jax.tree_util.tree_map(lambda _: P(), state)
    specs["params"]["dense"]["kernel"] = P("data", None)
    with checkpoints.Checkpointer(state, (mesh, specs), tmp_path) as ckpt:
        ckpt.save(state)
        got = ckpt.restore()
    kernel = got["params"]["dense"]["kernel"]
    assert kernel.sharding == NamedSharding(mesh, P("data", None))
    shardings = jax.tree_util.tree_map(lambda _: NamedSharding(mesh, P()), state)
    with checkpoints.Checkpointer(state, shardings, tmp_path) as ckpt:
        got = ckpt.restore()
    assert got["opt_state"]["mu"]["dense"]["bias"].sharding == NamedSharding(mesh, P())


@pytest.mark.parametrize("without_metrics", [True, False])
def test_a_metric_with_no_run_is_never_found(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, without_metrics: bool
) -> None:
    """T5X's own utils_test builds a checkpointer that monitors "loss": accepted, as there, with
    a warning; no step has a value, so keep_checkpoints_without_metrics decides."""
    with caplog.at_level(logging.WARNING, logger="cairn"):
        ckpt = checkpoints.SaveBestCheckpointer(
            make_state(0),
            None,
            tmp_path,
            keep=1,
            metric_name_to_monitor="loss",
            keep_checkpoints_without_metrics=without_metrics,
        )
    assert "metric_name_to_monitor='loss' names no run" in caplog.text
    with ckpt:
        for step in (1, 2, 3):
            ckpt.save(make_state(step))
        ckpt.wait_until_finished()
        assert ckpt.all_steps() == ([1, 2, 3] if without_metrics else [2, 3])


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="train_state must be a T5X TrainState"):
        checkpoints.Checkpointer([1, 2], None, tmp_path)
    with pytest.raises(ValueError, match="needs a 'step' entry"):
        checkpoints.Checkpointer({"params": {}}, None, tmp_path)
    with pytest.raises(ValueError, match="keep must be None or a non-negative int"):
        checkpoints.Checkpointer(make_state(0), None, tmp_path, keep=-1)
    with pytest.raises(TypeError, match="no handler is registered for object"):
        checkpoints.Checkpointer(make_state(0), None, tmp_path, object())
    with pytest.raises(ValueError, match="Unsupported `metric_mode`"):
        checkpoints.SaveBestCheckpointer(make_state(0), None, tmp_path, metric_mode="best")
    with pytest.raises(ValueError, match=r"metric_name_to_monitor must be '\{run\}/\{tag\}'"):
        checkpoints.SaveBestCheckpointer(make_state(0), None, tmp_path, metric_name_to_monitor="/")
    with checkpoints.Checkpointer(make_state(0), None, tmp_path) as ckpt:
        with pytest.raises(ValueError, match="concurrent_gb must be positive"):
            ckpt.save(make_state(1), concurrent_gb=0)
        with pytest.raises(TypeError, match="state_transformation_fns must hold functions"):
            ckpt.restore(state_transformation_fns=[3])
        assert ckpt.all_steps() == []
    assert not list(tmp_path.glob("checkpoint_*"))


def test_dataset_checkpoint_handler_is_the_tf_data_handler() -> None:
    handler = checkpoints.DatasetCheckpointHandler("train_ds-000-of-001")
    assert isinstance(handler, TfDataIteratorHandler) and handler.id == "cairn.tf_data_iterator"
    assert handler.checkpoint_filename == "train_ds-000-of-001"


# ---------------------------------------------------------------------------- TensorBoard metrics


def write_events(logdir: Path, tag: str, values: dict[int, float], *, tensor: bool = False) -> None:
    """Scalar summaries as TensorBoard writes them: simple_value, or a tensor (tf.summary v2)."""
    from tensorboard.util import tensor_util

    writer = EventFileWriter(str(logdir))
    for step, value in values.items():
        if tensor:
            v = summary_pb2.Summary.Value(
                tag=tag, tensor=tensor_util.make_tensor_proto(np.float32(value))
            )
        else:
            v = summary_pb2.Summary.Value(tag=tag, simple_value=value)
        writer.add_event(
            event_pb2.Event(
                step=step, wall_time=time.time(), summary=summary_pb2.Summary(value=[v])
            )
        )
    writer.close()


def test_populate_metrics_reads_every_event(tmp_path: Path) -> None:
    write_events(tmp_path / "train", "accuracy", {s: s / 1024 for s in range(0, 3000, 10)})
    write_events(
        tmp_path / "inference_eval" / "glue", "eval/accuracy", {5: 0.5, 6: 0.25}, tensor=True
    )
    got = checkpoints.populate_metrics_for_steps(tmp_path, "train/accuracy", [0, 1000, 2990, 7])
    assert got == {
        0: 0.0,
        1000: 1000 / 1024,
        2990: 2990 / 1024,
    }  # far past TensorBoard's default sampling
    nested = checkpoints.populate_metrics_for_steps(
        tmp_path, "inference_eval/glue/eval/accuracy", range(10)
    )
    assert nested == {5: 0.5, 6: 0.25}
    write_events(tmp_path / "train", "accuracy", {1000: 0.125})  # a restarted run wrote it again
    assert checkpoints.populate_metrics_for_steps(tmp_path, "train/accuracy", [1000]) == {
        1000: 0.125
    }
    assert checkpoints.populate_metrics_for_steps(tmp_path, "eval/loss", [1]) == {}
    assert checkpoints.populate_metrics_for_steps(tmp_path, "accuracy", [1]) == {}  # as T5X: no run
    with pytest.raises(ValueError, match=r"metric_name must be '\{run\}/\{tag\}'"):
        checkpoints.populate_metrics_for_steps(tmp_path, "/", [1])


def t5x_style_training(
    tmp_path: Path, ckpt: Any, accuracy: dict[int, float], *, period: int, total: int
) -> None:
    """T5X's loop: save every `period` steps and at the final step; eval writes its metric to
    TensorBoard after the save; the step's metric is seen by the next save's retention."""
    state = make_state(0)
    for step in range(1, total + 1):
        state = {**state, "step": jnp.array(step, jnp.int32)}
        if step % period == 0 or step == total:
            ckpt.save(state)
            if step in accuracy:
                write_events(tmp_path / "inference_eval", "accuracy", {step: accuracy[step]})


@pytest.mark.parametrize("without_metrics", [True, False])
def test_save_best_checkpointer_in_a_t5x_loop(tmp_path: Path, without_metrics: bool) -> None:
    accuracy = {10: 0.5, 20: 0.9, 30: 0.1, 40: 0.8, 60: 0.7, 70: 0.95, 80: math.nan}  # no 50
    with checkpoints.SaveBestCheckpointer(
        make_state(0),
        None,
        tmp_path,
        keep=2,
        metric_name_to_monitor="inference_eval/accuracy",
        metric_mode="max",
        keep_checkpoints_without_metrics=without_metrics,
        force_keep_period=30,
    ) as ckpt:
        t5x_style_training(tmp_path, ckpt, accuracy, period=10, total=85)
        steps = ckpt.all_steps()
    # the latest (85), the 2 best with metrics (70, 20), multiples of 30 (30, 60), and, when
    # kept, those without a metric (50; 80's is NaN)
    expected = {20, 30, 60, 70, 85} | ({50, 80} if without_metrics else set())
    assert set(steps) == expected


def test_orbax_style_wrapper_uses_every_option(tmp_path: Path) -> None:
    data = Shuffled()
    state = {**make_state(0), "params": {"w": jnp.linspace(0, 1, 4, dtype=jnp.float32)}}
    with checkpoints.OrbaxCheckpointManagerInterface(
        tmp_path,
        state,
        None,
        data,
        save_dtype=jnp.bfloat16,
        keep=2,
        period=10,
        checkpoint_steps=[15],
        keep_dataset_checkpoints=1,
        force_keep_period=20,
    ) as mgr:
        assert mgr.directory == str(tmp_path)
        saved = []
        for step in range(1, 46):
            state = {**state, "step": jnp.array(step, jnp.int32)}
            advanced(data, 1)
            if mgr.save(state, force=False):
                saved.append(step)
        assert saved == [10, 15, 20, 30, 40]
        assert mgr.should_save(50) and not mgr.should_save(45)
        assert mgr.all_steps() == [20, 30, 40]  # keep=2 newest, plus 20 (force_keep_period)
        assert mgr.all_dataset_checkpoint_steps() == [40]
        with pytest.raises(StepAlreadyExistsError):
            mgr.save({**state, "step": jnp.array(40, jnp.int32)})
    loaded = checkpoints.load_t5x_checkpoint(tmp_path, step=30)
    assert loaded["target"]["w"].dtype == ml_dtypes.bfloat16  # save_dtype applied to params


def test_metrics_written_by_tf_summary(tmp_path: Path) -> None:
    """T5X writes its metrics with tf.summary (tensor summaries in TF 2): they are read back."""
    import tensorflow as tf

    writer = tf.summary.create_file_writer(str(tmp_path / "training_eval" / "task"))
    with writer.as_default():
        for step in (100, 200):
            tf.summary.scalar("loss", step / 256, step=step)
    writer.close()
    got = checkpoints.populate_metrics_for_steps(tmp_path, "training_eval/task/loss", [100, 200])
    assert got == {100: 100 / 256, 200: 200 / 256}


def test_restore_only_checkpointer_with_an_empty_directory(tmp_path: Path) -> None:
    """T5X restores through a second Checkpointer with checkpoints_dir='': it reads by path, next
    to the writing one (no directory lock taken), and refuses to save."""
    with checkpoints.Checkpointer(make_state(0), None, tmp_path) as writer:
        writer.save(make_state(6, 3.0))
        writer.wait_until_finished()
        reader = checkpoints.Checkpointer(make_state(0), None, "")
        assert_state_equal(reader.restore(path=tmp_path / "checkpoint_6"), make_state(6, 3.0))
        assert reader.all_steps() == [] and reader.latest_step() is None
        with pytest.raises(ValueError, match="No checkpoints found in ''"):
            reader.restore()
        with pytest.raises(ValueError, match="only restores by path"):
            reader.save(make_state(7))
        reader.close()


def test_metrics_appended_to_an_event_file_are_seen(tmp_path: Path) -> None:
    """SaveBestCheckpointer reads event files incrementally: events a live writer appends to the
    same file after the first read are found by the next one."""
    from tensorboard.util import tensor_util

    writer = EventFileWriter(str(tmp_path / "eval"))

    def add(step: int, value: float) -> None:
        v = summary_pb2.Summary.Value(
            tag="acc", tensor=tensor_util.make_tensor_proto(np.float32(value))
        )
        writer.add_event(
            event_pb2.Event(
                step=step, wall_time=time.time(), summary=summary_pb2.Summary(value=[v])
            )
        )
        writer.flush()

    add(1, 0.5)
    assert checkpoints.populate_metrics_for_steps(tmp_path, "eval/acc", [1, 2]) == {1: 0.5}
    add(2, 0.75)
    add(1, 0.25)  # step 1 evaluated again later: the later value wins
    assert checkpoints.populate_metrics_for_steps(tmp_path, "eval/acc", [1, 2]) == {
        1: 0.25,
        2: 0.75,
    }
    writer.close()
