"""One contract every handler passes (fsspec-style abstract suite), run for each built-in."""

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
from support.treeutil import assert_tree_equal

from cairn.handlers import (
    FileRecord,
    Handler,
    InMemoryHandler,
    JsonHandler,
    NumpyTreeHandler,
    StoredItem,
    TorchStateHandler,
    TrainStateHandler,
)
from cairn.handlers._files import content_hash
from cairn.handlers.errors import CorruptCheckpointError
from cairn.manager import CheckpointManager


def write_item(handler: Handler, obj: Any, directory: Path) -> list[FileRecord]:
    directory.mkdir(parents=True)
    return list(handler.snapshot(obj).write(directory))


def stored(directory: Path, records: list[FileRecord], step: int | None = 7) -> StoredItem:
    return StoredItem(directory, {r.path: r for r in records}, step, "item")


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

    def assert_restored(self, got: Any, expected: Any) -> None:
        """`got` (restored) equals `expected` (a fresh `sample()`)."""
        assert_tree_equal(got, expected)

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
        got = handler.restore(stored(tmp_path / "item", records), self.target())
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
        got = handler.restore(stored(tmp_path / "b" / "item", records), self.target())
        self.assert_restored(got, self.sample())

    def test_through_the_manager(self, handler: Handler, tmp_path: Path, gate: Gate) -> None:
        """Saved async by a CheckpointManager (mutated while the write is held), then restored."""
        obj = self.sample()
        handlers = {"gate": InMemoryHandler(on_write=gate), "x": handler}
        with CheckpointManager(tmp_path / "ck", handlers=handlers) as mgr:
            assert mgr.save(3, {"gate": 0, "x": obj})  # items are written in order: gate first
            assert gate.entered.wait(30)
            self.mutate(obj)
            gate.release.set()
            mgr.wait_until_finished()
            got = mgr.restore(3, {"x": self.target()})
        self.assert_restored(got["x"], self.sample())

    def test_through_an_object_store(
        self, handler: Handler, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Written through the destination of an object store (TensorStore's in-memory kvstore)
        and read back through its source, with no local directory to fall back on: the
        temporary directory is a file, so anything staged locally would fail."""
        blocker = tmp_path / "no-tmp"
        blocker.write_bytes(b"")
        monkeypatch.setattr(tempfile, "tempdir", str(blocker))
        obj = self.sample()
        url = f"memory://conformance-{uuid.uuid4().hex}"
        with CheckpointManager(url, handlers={"x": handler}) as mgr:
            assert mgr.save(3, {"x": obj})
            mgr.wait_until_finished()
            self.mutate(obj)
            got = mgr.restore(3, {"x": self.target()})
            assert mgr.verify(3) == []
        self.assert_restored(got["x"], self.sample())


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
