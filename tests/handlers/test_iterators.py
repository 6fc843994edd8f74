"""Dataset iterator handlers: tf.data, grain, get_state()/set_state() objects.

Each passes the handler contract (tests/contracts/test_handlers.py) with a live iterator (restored
into a fresh one, compared on the elements that follow); here are the per-handler cases, on the
same subjects (`StatefulIterator`, ... from the contract).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from contracts.test_handlers import GrainDatasetIterator, StatefulIterator, TfDataIterator
from support.handlers import stored, write_item
from support.iterutil import Shuffled, TorchStyle, advanced, take
from support.treeutil import assert_tree_equal

from cairn.handlers import (
    Handler,
    TfDataIteratorHandler,
)
from cairn.handlers.errors import CorruptCheckpointError, MismatchError
from cairn.manager import CheckpointManager


class TestStatefulIteratorHandler(StatefulIterator):
    def test_state_comes_back_with_its_types(self, handler: Handler, tmp_path: Path) -> None:
        """Tuples, bytes, int keys, NumPy arrays and scalars, NaN: back as they were."""
        obj = advanced(Shuffled(), 60)  # past one epoch: a new permutation and RNG state
        records = write_item(handler, obj, tmp_path / "item")
        state = handler.restore(stored(tmp_path / "item", records))
        want = obj.get_state()
        assert state["epoch"] == (1, "train") and state["seen"][3] == b"\x00\xff"
        assert np.isnan(state["seen"]["nan"]) and type(state["pos"]) is np.int64
        del state["seen"]["nan"], want["seen"]["nan"]
        assert_tree_equal(state, want)

    def test_state_dict_objects(self, handler: Handler, tmp_path: Path) -> None:
        obj = advanced(TorchStyle(), 13)
        records = write_item(handler, obj, tmp_path / "item")
        got = handler.restore(stored(tmp_path / "item", records), TorchStyle())
        assert take(got) == take(advanced(TorchStyle(), 13))
        with pytest.raises(MismatchError, match=r"state_dict\(\).*no load_state_dict"):
            handler.restore(stored(tmp_path / "item", records), object())

    def test_bad_state_is_refused_in_save(self, tmp_path: Path) -> None:
        class Bad(Shuffled):
            def get_state(self) -> dict[str, Any]:
                return {"fn": {"inner": print}}

        with CheckpointManager(tmp_path / "ck") as mgr:
            with pytest.raises(TypeError, match=r"item 'data'.*\['fn'\]\['inner'\].*function"):
                mgr.save(1, {"data": Bad()})
            assert mgr.all_steps() == []
        assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [".cairn.lock"]


class TestGrainDatasetIterator(GrainDatasetIterator):
    def test_state_is_orbax_json(self, handler: Handler, tmp_path: Path) -> None:
        """The file is the JSON of get_state(), as Orbax's grain handler writes it."""
        import json

        records = write_item(handler, self.sample(), tmp_path / "item")
        assert [r.path for r in records] == ["process_0-of-1.json"]
        assert json.loads((tmp_path / "item" / records[0].path).read_bytes()) == (
            self.sample().get_state()
        )


class TestTfDataIteratorHandler(TfDataIterator):
    def test_external_state_is_refused_in_save(self, tmp_path: Path) -> None:
        """A tf.py_function in the pipeline: a clear error inside save(), no step on disk."""
        ds = tf.data.Dataset.range(10).map(lambda x: tf.py_function(lambda y: y + 1, [x], tf.int64))
        it = iter(ds)
        next(it)
        with CheckpointManager(tmp_path / "ck") as mgr:
            with pytest.raises(ValueError, match=r"item 'data'.*state outside tf\.data.*stateful"):
                mgr.save(1, {"data": it})
            assert mgr.all_steps() == []
        assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [".cairn.lock"]
        records = write_item(TfDataIteratorHandler(external_state="ignore"), it, tmp_path / "i")
        assert records  # saved without the py_function's state, as asked

    def test_other_pipeline_is_a_mismatch(self, handler: Handler, tmp_path: Path) -> None:
        records = write_item(handler, self.sample(), tmp_path / "item")
        other = iter(tf.data.Dataset.range(5).map(lambda x: x * 2))
        with pytest.raises(MismatchError, match=r"step 7, item .item.*not over the pipeline"):
            handler.restore(stored(tmp_path / "item", records), other)
        with pytest.raises(MismatchError, match=r"target must be iter\(\)"):
            handler.restore(stored(tmp_path / "item", records), [1, 2])

    def test_damaged_header_is_corrupt(self, handler: Handler, tmp_path: Path) -> None:
        """A file whose checksum matches but whose layout is wrong (a hand-edited manifest)."""
        from cairn.handlers import write_file

        (tmp_path / "item").mkdir()
        record = write_file(tmp_path / "item", "process_0-of-1.tfdata", b"not a state")
        with pytest.raises(CorruptCheckpointError, match=r"not a cairn tf\.data state"):
            handler.restore(stored(tmp_path / "item", [record]), self.fresh())

    def test_pipeline_the_probe_cannot_rebuild(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A tf.py_function cannot run in the probe process: a warning, and the restore goes on."""
        ds = tf.data.Dataset.range(10).map(lambda x: tf.py_function(lambda y: y + 1, [x], tf.int64))
        handler = TfDataIteratorHandler(external_state="ignore")
        records = write_item(handler, advanced(iter(ds), 3), tmp_path / "item")
        with caplog.at_level("WARNING", logger="cairn"):
            got = handler.restore(stored(tmp_path / "item", records), iter(ds))
        assert "probe process did not start" in caplog.text and "step 7, item 'item'" in caplog.text
        assert int(next(got)) == 4

    def test_bad_options(self) -> None:
        with pytest.raises(ValueError, match="external_state must be"):
            TfDataIteratorHandler(external_state="maybe")
        with pytest.raises(TypeError, match="probe must be a bool"):
            TfDataIteratorHandler(probe="yes")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="probe_timeout must be a number"):
            TfDataIteratorHandler(probe_timeout="60")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="probe_timeout must be positive and finite, got 0"):
            TfDataIteratorHandler(probe_timeout=0)
        with pytest.raises(TypeError, match=r"saves iter\(tf\.data\.Dataset\)"):
            TfDataIteratorHandler().snapshot([1, 2, 3])


@pytest.mark.slow
def test_tf_state_over_two_gib(tmp_path: Path) -> None:
    """A shuffle buffer holding 2.1 GiB: one serialized proto would exceed protobuf's limit."""
    ds = (
        tf.data.Dataset.range(10**6)
        .map(lambda i: tf.random.stateless_uniform([256 * 1024], seed=tf.stack([i, 1])))
        .shuffle(2100, seed=1)
    )
    it = iter(ds)
    next(it)
    with CheckpointManager(tmp_path / "ck") as mgr:
        mgr.save(1, {"data": it})
        expect = next(it).numpy()
        mgr.wait_until_finished()
        assert mgr.info(1).bytes > 2**31
        fresh = iter(ds)
        mgr.restore(1, {"data": fresh})
    assert np.array_equal(next(fresh).numpy(), expect)


def test_grain_multiprocess_prefetch(tmp_path: Path) -> None:
    """mp_prefetch with 2 worker processes: the per-worker positions are saved and restored."""
    import subprocess
    import sys

    worker = Path(__file__).parents[1] / "grain_mp_worker.py"
    out = subprocess.run(
        [sys.executable, str(worker), str(tmp_path / "ck")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "equal True cairn.grain_iterator" in out.stdout
