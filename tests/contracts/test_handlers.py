"""The handler contract (fsspec-style abstract suite), run for every handler that writes: JSON,
NumPy trees, train states (zarr and packed), in-memory, torch state dicts, SpeechBrain's
recoverables, and the dataset iterators (get_state()/set_state() objects, grain, tf.data, and
T5X's DatasetCheckpointHandler). The read-only Orbax handlers (OrbaxPyTreeHandler,
OrbaxJsonHandler, OrbaxDatasetHandler) write nothing and record no file hashes, so this contract
does not apply; tests/test_orbax_interop.py and tests/test_untrusted_foreign.py read Orbax's own
steps with them.

A handler whose restore does not give back the saved object (an iterator restores into a target,
SpeechBrain's handler returns the path its load hooks read) says so through the hooks `target`,
`restored`, `assert_restored`, `registered_type`, `item` and `restores_to_a_path`; no case is
skipped.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from conftest import Gate
from support.handlers import stored, write_item
from support.iterutil import Shuffled, advanced, take
from support.treeutil import assert_tree_equal

from cairn.handlers import (
    GrainIteratorHandler,
    Handler,
    InMemoryHandler,
    JsonHandler,
    NumpyTreeHandler,
    SpeechBrainHandler,
    SpeechBrainRecoverable,
    StatefulIteratorHandler,
    TfDataIteratorHandler,
    TfDataIteratorState,
    TorchStateHandler,
    TrainStateHandler,
    handler_for,
    writing_as,
)
from cairn.handlers._files import content_hash
from cairn.handlers._iterators import decode_state
from cairn.handlers.errors import CorruptCheckpointError, MismatchError
from cairn.manager import CheckpointManager


class HandlerContract:
    """Subclasses provide `handler`, `sample()` and `mutate(obj)` (changes obj in place)."""

    @pytest.fixture
    def handler(self) -> Handler:
        raise NotImplementedError

    def sample(self) -> Any:
        raise NotImplementedError

    def mutate(self, obj: Any) -> None:
        raise NotImplementedError

    def target(self) -> Any:
        """What restore gets as its target (None: restore as saved)."""
        return None

    def restored(self, got: Any) -> Any:
        """What restore returned, made comparable while the checkpoint is still open (a handler
        that returns a path reads the file here)."""
        return got

    def assert_restored(self, got: Any, expected: Any) -> None:
        """`got` (restored, through `restored`) equals `expected` (a fresh `sample()`)."""
        assert_tree_equal(got, expected)

    def registered_type(self, handler: Handler) -> type:
        """The handler the registry picks for a sample (a subclass registers as its base)."""
        return type(handler)

    #: the item's name in the cases through a manager (`stored` names it "item")
    item: str = "x"

    #: whether restore needs the item's files in a local directory (a handler that returns a
    #: path): then the object-store case lets it download them into a temporary directory
    restores_to_a_path: bool = False

    def test_round_trip_without_target(self, handler: Handler, tmp_path: Path) -> None:
        """What restore returns equals what was saved, types included."""
        obj = self.sample()
        records = write_item(handler, obj, tmp_path / "item")
        assert_tree_equal(handler.restore(stored(tmp_path / "item", records)), obj)

    def test_snapshot_is_a_copy(self, handler: Handler, tmp_path: Path) -> None:
        """Changes to the object after snapshot() never reach the checkpoint."""
        obj = self.sample()
        snap = handler.snapshot(obj)
        self.mutate(obj)
        (tmp_path / "item").mkdir()
        records = list(snap.write(tmp_path / "item"))
        got = self.restored(handler.restore(stored(tmp_path / "item", records), self.target()))
        self.assert_restored(got, self.sample())

    def test_records_describe_the_files(self, handler: Handler, tmp_path: Path) -> None:
        """Each record names a distinct relative file with its true size and content hash."""
        records = write_item(handler, self.sample(), tmp_path / "item")
        assert records and len({r.path for r in records}) == len(records)
        for r in records:
            data = (tmp_path / "item" / r.path).read_bytes()
            assert not r.path.startswith("/") and ".." not in r.path.split("/")
            assert (r.size, r.xxh3_128) == (len(data), content_hash(data))

    def test_describe_is_json(self, handler: Handler, tmp_path: Path) -> None:
        """describe() returns something JSON-serialisable."""
        records = write_item(handler, self.sample(), tmp_path / "item")
        json.dumps(handler.describe(stored(tmp_path / "item", records)))

    @pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
    def test_damage_is_detected(self, handler: Handler, tmp_path: Path, damage: str) -> None:
        """A flipped byte, truncation or deletion of any file raises CorruptCheckpointError naming it."""
        item = tmp_path / "item"
        records = write_item(handler, self.sample(), item)
        for r in records:
            shutil.rmtree(tmp_path / "copy", ignore_errors=True)
            shutil.copytree(item, tmp_path / "copy")
            target = tmp_path / "copy" / r.path
            data = bytearray(target.read_bytes())
            if damage == "flip":
                data[len(data) // 2] ^= 0x40
                target.write_bytes(bytes(data))
            elif damage == "truncate":
                target.write_bytes(bytes(data[: len(data) // 2]))
            else:
                target.unlink()
            with pytest.raises(
                CorruptCheckpointError, match=r"step 7.*" + r.path.replace(".", r"\.")
            ):
                handler.restore(stored(tmp_path / "copy", records), self.target())

    def test_moved_directory_restores(self, handler: Handler, tmp_path: Path) -> None:
        """Paths are relative: a moved item directory restores."""
        obj = self.sample()
        records = write_item(handler, obj, tmp_path / "a" / "item")
        shutil.move(tmp_path / "a", tmp_path / "b")
        got = self.restored(
            handler.restore(stored(tmp_path / "b" / "item", records), self.target())
        )
        self.assert_restored(got, self.sample())

    def test_through_the_manager(self, handler: Handler, tmp_path: Path, gate: Gate) -> None:
        """Saved async by a CheckpointManager (mutated while the write is held), then restored."""
        obj = self.sample()
        handlers = {"gate": InMemoryHandler(on_write=gate), self.item: handler}
        with CheckpointManager(tmp_path / "ck", handlers=handlers) as mgr:
            assert mgr.save(
                3, {"gate": 0, self.item: obj}
            )  # items are written in order: gate first
            assert gate.entered.wait(30)
            self.mutate(obj)
            gate.release.set()
            mgr.wait_until_finished()
            got = self.restored(mgr.restore(3, {self.item: self.target()})[self.item])
        self.assert_restored(got, self.sample())

    def test_through_an_object_store(
        self, handler: Handler, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Written through the destination of an object store (TensorStore's in-memory kvstore)
        and read back through its source, with no local directory to fall back on: the
        temporary directory is a file, so anything staged locally would fail."""
        if not self.restores_to_a_path:
            blocker = tmp_path / "no-tmp"
            blocker.write_bytes(b"")
            monkeypatch.setattr(tempfile, "tempdir", str(blocker))
        obj = self.sample()
        url = f"memory://conformance-{uuid.uuid4().hex}"
        with CheckpointManager(url, handlers={self.item: handler}) as mgr:
            assert mgr.save(3, {self.item: obj})
            mgr.wait_until_finished()
            self.mutate(obj)
            got = self.restored(mgr.restore(3, {self.item: self.target()})[self.item])
            assert mgr.verify(3) == []
        self.assert_restored(got, self.sample())


class TestJsonHandler(HandlerContract):
    @pytest.fixture
    def handler(self) -> Handler:
        return JsonHandler()

    def sample(self) -> Any:
        return {
            "lr": 0.1,
            "layers": [1, 2, {"name": "dense/0", "bias": None}],
            "ok": True,
            "é": "ü",
        }

    def mutate(self, obj: Any) -> None:
        obj["layers"][2]["name"] = "changed"
        obj["lr"] = 5.0


def numpy_sample() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {
        "params": {
            "dense/kernel": rng.standard_normal((4, 3)).astype(np.float32),
            "dense.bias": np.arange(3, dtype=np.int64),
            "../escape": np.zeros((0, 2), np.float16),
            "": np.array(7, np.uint8),
        },
        "opt": [np.ones(2, np.complex64), (np.float64(2.5), np.int32(-3)), np.array([True, False])],
        "step": 12,
        "lr": 1e-3,
        "flag": False,
        "z": complex(1, -2),
        "name": "run/1",
        "none": None,
        "big": rng.standard_normal(20_000),
        "bf16": np.arange(6, dtype=ml_dtypes.bfloat16).reshape(2, 3),
        "fp8": np.ones(3, ml_dtypes.float8_e4m3fn),
    }


class TestNumpyTreeHandler(HandlerContract):
    @pytest.fixture
    def handler(self) -> Handler:
        return NumpyTreeHandler()

    def sample(self) -> Any:
        return numpy_sample()

    def mutate(self, obj: Any) -> None:
        obj["params"]["dense/kernel"] += 1.0
        obj["big"][:] = 0
        obj["opt"][0][0] = 99
        obj["step"] = 13


class TestTrainStateHandler(HandlerContract):
    @pytest.fixture
    def handler(self) -> Handler:
        return TrainStateHandler(chunk_bytes=4096)  # several chunks per large leaf

    def sample(self) -> Any:
        return numpy_sample()

    def mutate(self, obj: Any) -> None:
        TestNumpyTreeHandler.mutate(self, obj)  # type: ignore[arg-type]


class TestPackedTrainStateHandler(TestTrainStateHandler):
    @pytest.fixture
    def handler(self) -> Handler:
        return TrainStateHandler(chunk_bytes=4096, layout="packed")


class TestInMemoryHandler(HandlerContract):
    @pytest.fixture
    def handler(self) -> Handler:
        return InMemoryHandler()

    def sample(self) -> Any:
        return {"a": [1, 2, 3], "b": {"c": "d"}}

    def mutate(self, obj: Any) -> None:
        obj["a"].append(4)


class TestTorchStateHandler(HandlerContract):
    @pytest.fixture
    def handler(self) -> Handler:
        return TorchStateHandler()

    def sample(self) -> Any:
        import torch

        return {
            "w": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),  # non-contiguous
            "half": torch.ones(3, dtype=torch.float16),
            "i": torch.arange(5, dtype=torch.int64),
        }

    def mutate(self, obj: Any) -> None:
        obj["w"].add_(1.0)
        obj["i"].zero_()

    def assert_restored(self, got: Any, expected: Any) -> None:
        assert_tree_equal(
            {k: v.numpy() for k, v in got.items()}, {k: v.numpy() for k, v in expected.items()}
        )

    def test_round_trip_without_target(self, handler: Handler, tmp_path: Path) -> None:
        """What restore returns equals what was saved (tensors compared as arrays)."""
        obj = self.sample()
        records = write_item(handler, obj, tmp_path / "item")
        self.assert_restored(handler.restore(stored(tmp_path / "item", records)), obj)


class SpeechBrainTorch:
    """A SpeechBrain recoverable saved through its ``state_dict()`` (kind "torch")."""

    @pytest.fixture
    def handler(self) -> Handler:
        return SpeechBrainHandler()

    def module(self) -> Any:
        import torch

        linear = torch.nn.Linear(4, 3)
        with torch.no_grad():
            linear.weight.copy_(torch.arange(12, dtype=torch.float32).reshape(3, 4))
            linear.bias.copy_(torch.tensor([0.5, -1.0, 2.0]))
        return linear

    def sample(self) -> Any:
        return SpeechBrainRecoverable("item", self.module(), "torch", None, Path("/unused"))

    def mutate(self, obj: Any) -> None:
        import torch

        with torch.no_grad():
            obj.obj.weight.add_(1.0)
            obj.obj.bias.zero_()

    def restored(self, got: Any) -> Any:
        """The handler returns the path of ``item.ckpt``, which SpeechBrain's hooks load."""
        import torch

        assert isinstance(got, Path) and got.name == "item.ckpt", got
        return {k: v.numpy() for k, v in torch.load(got, weights_only=True).items()}

    def assert_restored(self, got: Any, expected: Any) -> None:
        assert_tree_equal(
            got, {k: v.detach().numpy() for k, v in expected.obj.state_dict().items()}
        )


class TestSpeechBrainHandler(SpeechBrainTorch, HandlerContract):
    restores_to_a_path = True
    item = "item"  # a recoverable is saved as the item of its own name

    def test_round_trip_without_target(self, handler: Handler, tmp_path: Path) -> None:
        """Restore returns the path of the recoverable's file; it holds the saved state_dict."""
        obj = self.sample()
        records = write_item(handler, obj, tmp_path / "item")
        got = handler.restore(stored(tmp_path / "item", records))
        self.assert_restored(self.restored(got), obj)


class TestSpeechBrainHandlerState(TestSpeechBrainHandler):
    """A recoverable saved through its ``get_state()`` as JSON (kind "state")."""

    def sample(self) -> Any:
        return SpeechBrainRecoverable("item", advanced(Shuffled(), 9), "state", None, Path("/u"))

    def mutate(self, obj: Any) -> None:
        advanced(obj.obj, 5)

    def restored(self, got: Any) -> Any:
        assert isinstance(got, Path) and got.name == "item.ckpt", got
        return json.loads(got.read_bytes())["state"]

    def assert_restored(self, got: Any, expected: Any) -> None:
        fresh = Shuffled()
        fresh.set_state(decode_state(got))
        assert take(fresh) == take(expected.obj)


# ---------------------------------------------------------------------------- dataset iterators


def tf_pipeline() -> Any:
    """A T5X-like input pipeline: map, shuffle, batch, prefetch (deterministic by seed)."""
    import tensorflow as tf

    ds = tf.data.Dataset.range(400).map(
        lambda i: {"x": tf.random.stateless_uniform([8], seed=tf.stack([i, 7])), "i": i}
    )
    return ds.shuffle(64, seed=3, reshuffle_each_iteration=True).repeat().batch(4).prefetch(2)


def grain_pipeline() -> Any:
    import grain

    ds = grain.MapDataset.range(400).shuffle(seed=5).map(lambda x: x * 3).repeat(None)
    return ds.to_iter_dataset().batch(4)


class IteratorSubject:
    """Samples are live iterators advanced a few elements; equality = the same elements follow.
    A subclass gives `handler` and `fresh()`; tests/handlers/test_iterators.py reuses these for
    each handler's own cases."""

    def fresh(self) -> Any:
        raise NotImplementedError

    def sample(self) -> Any:
        return advanced(self.fresh())

    def mutate(self, obj: Any) -> None:
        advanced(obj, 11)  # iterating after save() must not change what is written

    def target(self) -> Any:
        return self.fresh()

    def elements(self, iterator: Any) -> list[Any]:
        """The next few elements, comparable with ==."""
        return take(iterator)

    def assert_restored(self, got: Any, expected: Any) -> None:
        assert self.elements(got) == self.elements(expected)

    def set_state(self, iterator: Any, state: Any) -> None:
        iterator.set_state(state)


class IteratorContract(IteratorSubject, HandlerContract):
    """The contract for iterator handlers: restored into a fresh iterator (the target)."""

    def test_round_trip_without_target(self, handler: Handler, tmp_path: Path) -> None:
        """Without a target, restore returns the saved state, which a fresh iterator accepts."""
        records = write_item(handler, self.sample(), tmp_path / "item")
        state = handler.restore(stored(tmp_path / "item", records))
        iterator = self.fresh()
        if isinstance(state, TfDataIteratorState):
            state.restore_into(iterator)
        else:
            self.set_state(iterator, state)
        self.assert_restored(iterator, self.sample())

    def test_restore_is_in_place(self, handler: Handler, tmp_path: Path) -> None:
        records = write_item(handler, self.sample(), tmp_path / "item")
        target = self.fresh()
        assert handler.restore(stored(tmp_path / "item", records), target) is target

    def test_one_file_per_process(self, handler: Handler, tmp_path: Path) -> None:
        """Two processes write their own positions into one item; each restores its own."""
        item = tmp_path / "item"
        item.mkdir()
        records = []
        for index, skip in ((0, 2), (1, 9)):
            with writing_as(index, 2):
                records += handler.snapshot(advanced(self.fresh(), skip)).write(item)
        assert sorted(r.path.split(".")[0] for r in records) == [
            "process_0-of-2",
            "process_1-of-2",
        ]
        for index, skip in ((0, 2), (1, 9)):
            with writing_as(index, 2):
                got = handler.restore(stored(item, records), self.fresh())
            self.assert_restored(got, advanced(self.fresh(), skip))
        with pytest.raises(MismatchError, match=r"saved by 2 process.*this run has 1"):
            handler.restore(stored(item, records), self.fresh())

    def test_registry_picks_it(self, handler: Handler) -> None:
        assert type(handler_for(self.fresh())) is self.registered_type(handler)


class StatefulIterator(IteratorSubject):
    @pytest.fixture
    def handler(self) -> Handler:
        return StatefulIteratorHandler()

    def fresh(self) -> Any:
        return Shuffled()


class GrainDatasetIterator(IteratorSubject):
    @pytest.fixture
    def handler(self) -> Handler:
        return GrainIteratorHandler()

    def fresh(self) -> Any:
        return iter(grain_pipeline())


class _Source:
    def __len__(self) -> int:
        return 300

    def __getitem__(self, i: int) -> int:
        return i * 2

    def __repr__(self) -> str:  # grain checks the source by repr
        return "_Source(300)"


class GrainDataLoader(IteratorSubject):
    @pytest.fixture
    def handler(self) -> Handler:
        return GrainIteratorHandler()

    def fresh(self) -> Any:
        import grain

        sampler = grain.samplers.IndexSampler(
            300, shard_options=grain.sharding.NoSharding(), shuffle=True, seed=0, num_epochs=1
        )
        loader = grain.DataLoader(
            data_source=_Source(),
            sampler=sampler,
            operations=[grain.transforms.Batch(4)],
            worker_count=0,
        )
        return iter(loader)

    def set_state(self, iterator: Any, state: Any) -> None:
        iterator.set_state(json.dumps(state).encode())  # restored without a target: a dict


class TfDataIterator(IteratorSubject):
    @pytest.fixture
    def handler(self) -> Handler:
        return TfDataIteratorHandler()

    def fresh(self) -> Any:
        return iter(tf_pipeline())

    def elements(self, iterator: Any) -> list[Any]:
        return take(batch["i"] for batch in iterator)


class T5xDatasetIterator(TfDataIterator):
    """T5X's DatasetCheckpointHandler (cairn.manager.t5x): the tf.data handler under T5X's name."""

    @pytest.fixture
    def handler(self) -> Handler:
        from cairn.manager.t5x import DatasetCheckpointHandler

        return DatasetCheckpointHandler("train_ds")

    def registered_type(self, handler: Handler) -> type:
        return TfDataIteratorHandler  # the registry's handler for tf.data; T5X passes its own


class TestStatefulIteratorHandler(StatefulIterator, IteratorContract):
    pass


class TestGrainDatasetIterator(GrainDatasetIterator, IteratorContract):
    pass


class TestGrainDataLoader(GrainDataLoader, IteratorContract):
    pass


class TestTfDataIteratorHandler(TfDataIterator, IteratorContract):
    pass


class TestT5xDatasetCheckpointHandler(T5xDatasetIterator, IteratorContract):
    pass
