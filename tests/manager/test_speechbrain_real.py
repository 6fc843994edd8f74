"""cairn.manager.speechbrain with SpeechBrain's own classes and values (issue 20, points 1, 9-11):
classes registered with speechbrain's register_checkpoint_hooks, the meta values SpeechBrain
accepts, its recoverable names and hooks, and a fresh Checkpointer on the same directory."""

from __future__ import annotations

import json
import logging
import math
import pathlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from speechbrain.nnet.schedulers import NewBobScheduler
from speechbrain.processing.features import InputNormalization
from speechbrain.utils.epoch_loop import EpochCounter, EpochCounterWithStopper
from speechbrain.utils.repro import SaveableGenerator

from cairn.manager import SupersededError
from cairn.manager.speechbrain import Checkpointer


def test_speechbrain_registered_classes_save_and_load(tmp_path: Path) -> None:
    """EpochCounter, EpochCounterWithStopper, SaveableGenerator, NewBobScheduler and the
    nn.Module InputNormalization (whose own hooks win over the torch default, by the MRO) go
    through the hooks speechbrain's register_checkpoint_hooks put in its registry."""
    counter, stopper = EpochCounter(10), EpochCounterWithStopper(10, 2, 0, "min")
    generator = SaveableGenerator({"a": torch.Generator().manual_seed(42)})
    scheduler = NewBobScheduler(initial_value=1.0)
    norm = InputNormalization()
    recoverables = {
        "counter": counter,
        "stopper": stopper,
        "generator": generator,
        "scheduler": scheduler,
        "norm": norm,
    }
    checkpointer = Checkpointer(tmp_path, recoverables)
    for _ in range(3):
        next(iter(counter))
    stopper.current, stopper.best_score = 4, 0.5
    scheduler(metric_value=2.0)
    scheduler(metric_value=3.0)  # worse: the value is annealed
    annealed = scheduler.hyperparam_value
    norm(torch.randn(2, 5, 3), torch.ones(2))  # accumulates statistics
    glob_mean = norm.glob_mean.clone()
    ckpt = checkpointer.save_checkpoint(meta={"loss": 1.0})
    assert ckpt is not None
    # SpeechBrain's savers wrote the files they write under SpeechBrain
    assert (ckpt.paramfiles["counter"]).read_text() == "3"
    expected_draws = torch.randint(0, 100, (4,), generator=generator.generators["a"])

    counter.current, stopper.current, stopper.best_score = 0, 0, None
    scheduler.hyperparam_value = 123.0
    norm.glob_mean.zero_()
    fresh = Checkpointer(tmp_path, recoverables)  # takes over from `checkpointer`
    assert fresh.recover_if_possible() == ckpt
    assert counter.current == 3
    assert stopper.current == 4  # its class inherits EpochCounter's hooks, as under SpeechBrain
    assert scheduler.hyperparam_value == annealed < 1.0
    assert torch.equal(norm.glob_mean, glob_mean) and glob_mean.abs().sum() > 0
    again = torch.randint(0, 100, (4,), generator=generator.generators["a"])
    assert torch.equal(again, expected_draws)
    fresh.close()


def test_intra_epoch_load_follows_speechbrain(tmp_path: Path) -> None:
    """SpeechBrain's EpochCounter loader gets end_of_epoch from the meta: an intra-epoch
    checkpoint resumes the epoch it was saved in."""
    counter = EpochCounter(5)
    with Checkpointer(tmp_path, {"counter": counter}) as checkpointer:
        for _ in range(2):
            next(iter(counter))
        checkpointer.save_checkpoint(end_of_epoch=False)
        counter.current = 0
        checkpointer.recover_if_possible()
    assert counter.current == 1  # epoch 2 is run again


_IMPORT_CHECK = """
import sys
import cairn.manager, cairn.manager.speechbrain, cairn.handlers
heavy = sorted(m for m in ("speechbrain", "torch", "yaml") if m in sys.modules)
print(heavy)
"""


def test_importing_cairn_imports_neither_speechbrain_nor_torch() -> None:
    run = subprocess.run(
        [sys.executable, "-c", _IMPORT_CHECK], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"


def test_meta_values_speechbrain_accepts_round_trip(tmp_path: Path) -> None:
    """NaN and infinite losses (a diverging run saves), 1-D tensors, NumPy arrays and scalars,
    pathlib paths, tuples and bytes come back from a fresh Checkpointer as they were given."""
    meta: dict[str, Any] = {
        "loss": float("nan"),
        "grad_norm": math.inf,
        "neg": -math.inf,
        "per_class": torch.tensor([0.5, 1.5, 2.5]),
        "ints": torch.tensor([[1, 2]], dtype=torch.int64),
        "scalar": torch.tensor(3.25),
        "np": np.arange(3, dtype=np.int16),
        "np_scalar": np.float32(0.5),
        "where": pathlib.Path("/data/run1"),
        "pair": (1, "a"),
        "raw": b"\x00\x01",
        "nested": {"x": [math.nan, {"y": pathlib.Path("rel/p")}]},
    }
    with Checkpointer(tmp_path, {"counter": EpochCounter(3)}) as checkpointer:
        saved = checkpointer.save_checkpoint(meta=meta)
        assert saved is not None
    with Checkpointer(tmp_path, {"counter": EpochCounter(3)}) as fresh:
        (listed,) = fresh.list_checkpoints()
    for got in (saved.meta, listed.meta):
        assert math.isnan(got["loss"]) and got["grad_norm"] == math.inf
        assert got["neg"] == -math.inf
        assert isinstance(got["per_class"], torch.Tensor)
        assert torch.equal(got["per_class"], meta["per_class"])
        assert got["ints"].dtype == torch.int64 and got["ints"].tolist() == [[1, 2]]
        assert got["scalar"] == 3.25 and type(got["scalar"]) is float
        assert got["np"].dtype == np.int16 and got["np"].tolist() == [0, 1, 2]
        assert got["np_scalar"] == 0.5
        assert got["where"] == pathlib.Path("/data/run1")
        assert isinstance(got["where"], pathlib.Path)
        assert got["pair"] == (1, "a") and got["raw"] == b"\x00\x01"
        assert math.isnan(got["nested"]["x"][0]) and got["nested"]["x"][1]["y"] == Path("rel/p")


def test_a_diverging_run_saves_and_ranking_skips_nan(tmp_path: Path) -> None:
    """save_and_keep_only with min_keys=["loss"] goes on when the loss turns NaN or infinite;
    the best checkpoint by loss is a finite one, and the latest is kept too."""
    counter = EpochCounter(10)
    with Checkpointer(tmp_path, {"counter": counter}) as checkpointer:
        for epoch, loss in enumerate([2.0, 1.0, math.nan, math.inf]):
            counter.current = epoch
            checkpointer.save_and_keep_only(meta={"loss": loss}, min_keys=["loss"])
        kept = checkpointer.list_checkpoints()
        best = checkpointer.find_checkpoint(min_key="loss")
    assert best is not None and best.meta["loss"] == 1.0
    assert sorted(c.meta["loss"] for c in kept if math.isfinite(c.meta["loss"])) == [1.0]
    assert any(c.meta["loss"] == math.inf for c in kept)  # the latest


def test_meta_values_nothing_can_store_are_refused(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, {"counter": EpochCounter(3)}) as checkpointer:
        with pytest.raises(TypeError, match=r"meta\['m'\]: a torch.bfloat16 tensor cannot be"):
            checkpointer.save_checkpoint(meta={"m": torch.ones(2, dtype=torch.bfloat16)})
        with pytest.raises(TypeError, match=r"meta\['d'\]: mapping keys must be str"):
            checkpointer.save_checkpoint(meta={"d": {1: 2}})
        with pytest.raises(TypeError, match=r"meta\['d'\]: the key '__cairn__' is reserved"):
            checkpointer.save_checkpoint(meta={"d": {"__cairn__": "path", "value": "/etc"}})
        with pytest.raises(TypeError, match=r"meta\['o'\]\[0\] is a object; meta values must"):
            checkpointer.save_checkpoint(meta={"o": [object()]})
        assert checkpointer.list_checkpoints() == []


def test_crafted_meta_tags_are_damage_not_objects(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A manifest meta with cairn's tags that cairn did not write (a path that is not a str, a
    tensor that is not an array) makes that checkpoint skipped with a warning, the others
    listed."""
    from cairn.manager._surfaces.speechbrain import checkpointer as impl
    from cairn.manager._surfaces.speechbrain.meta import _decode_meta

    for bad in (
        {"__cairn__": "path", "value": 1},
        {"__cairn__": "tensor", "array": "x"},
        {"__cairn__": "tensor", "array": {"__cairn__": "nope"}},
        {"__cairn__": "tuple", "items": "ab"},
    ):
        with pytest.raises((ValueError, KeyError, TypeError)):
            _decode_meta({"k": bad})
    # through the Checkpointer: the manifest's meta replaced by a crafted one
    counter = EpochCounter(3)
    with Checkpointer(tmp_path, {"counter": counter}) as checkpointer:
        checkpointer.save_checkpoint(meta={"epoch": 0})
        checkpointer.save_checkpoint(meta={"epoch": 1})
    manager_meta = {"meta": {"unixtime": 1.0, "end-of-epoch": True, "p": {"__cairn__": "path"}}}
    original = impl.CheckpointManager.info

    def crafted_info(self: Any, step: int) -> Any:
        import dataclasses

        info = original(self, step)
        return dataclasses.replace(info, metadata=manager_meta) if step == 1 else info

    impl.CheckpointManager.info = crafted_info  # type: ignore[method-assign]
    try:
        with (
            caplog.at_level(logging.WARNING, logger="cairn"),
            Checkpointer(tmp_path, {"counter": counter}) as fresh,
        ):
            listed = fresh.list_checkpoints()
    finally:
        impl.CheckpointManager.info = original  # type: ignore[method-assign]
    assert [c.meta["epoch"] for c in listed] == [0]
    assert "skipping a damaged checkpoint" in caplog.text and "CKPT_1" in caplog.text


def test_recoverable_names_and_hooks_refused_name_the_rule(tmp_path: Path) -> None:
    """Names SpeechBrain takes (any str its file system takes) that cannot be an item name are
    refused naming the rule; hooks that do not write their path are refused naming the path."""
    with pytest.raises(ValueError, match=r"recoverable 'my model': its name becomes the name"):
        Checkpointer(tmp_path / "a", {"my model": EpochCounter(1)})
    with pytest.raises(ValueError, match=r"letters, digits, '_', '-' and '.'"):
        Checkpointer(tmp_path / "a", {".hidden": EpochCounter(1)})
    with pytest.raises(TypeError, match=r"recoverable names must be str, got int"):
        Checkpointer(tmp_path / "a", {1: EpochCounter(1)})  # type: ignore[dict-item]
    for ok in ("lr_annealing", "model.v2", "CKPT-x", "a" * 128):
        Checkpointer(tmp_path / "ok", {ok: EpochCounter(1)}).close()

    def writes_nothing(obj: Any, path: Path) -> None:
        del obj, path

    def writes_beside(obj: Any, path: Path) -> None:
        path.write_text("x")
        (path.parent / "extra.txt").write_text("y")

    for hook, message in ((writes_nothing, "it wrote nothing"), (writes_beside, "extra.txt")):
        with Checkpointer(tmp_path / hook.__name__) as checkpointer:
            checkpointer.add_recoverable("thing", object(), custom_save_hook=hook)
            with pytest.raises(RuntimeError, match=rf"must write exactly the path.*{message}"):
                checkpointer.save_checkpoint()
            assert checkpointer.list_checkpoints() == []


def test_a_hook_that_writes_a_directory(tmp_path: Path) -> None:
    """A save hook may make `path` a directory (as some SpeechBrain hooks do); the load hook gets
    the same path back, with the files in it verified."""
    loaded: list[str] = []

    def save(obj: Any, path: Path) -> None:
        path.mkdir()
        (path / "part").write_text("data")

    def load(obj: Any, path: Path, end_of_epoch: bool) -> None:
        loaded.append((path / "part").read_text())

    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.add_recoverable("thing", object(), load, save)
        ckpt = checkpointer.save_checkpoint()
        assert ckpt is not None and ckpt.paramfiles["thing"].is_dir()
        checkpointer.recover_if_possible()
    assert loaded == ["data"]


def test_a_fresh_checkpointer_on_the_same_directory_takes_over(tmp_path: Path) -> None:
    """Recovering with a fresh Checkpointer on the same directory in one process, as recipes do,
    works and numbers on from the old one's checkpoints (its pending async save included); the
    old one's next save raises SupersededError and writes nothing."""
    counter = EpochCounter(10)
    old = Checkpointer(tmp_path, {"counter": counter}, async_save=True)
    counter.current = 1
    old.save_checkpoint(meta={"epoch": 1})
    counter.current = 2
    old.save_checkpoint(meta={"epoch": 2})  # may still be pending

    fresh_counter = EpochCounter(10)
    fresh = Checkpointer(tmp_path, {"counter": fresh_counter})
    resumed = fresh.recover_if_possible()
    assert resumed is not None and resumed.meta["epoch"] == 2 and fresh_counter.current == 2
    fresh_counter.current = 3
    saved = fresh.save_checkpoint(meta={"epoch": 3})
    assert saved is not None and saved.path.name == "CKPT_2"

    with pytest.raises(SupersededError):
        old.save_checkpoint(meta={"epoch": 99})
    assert [c.meta["epoch"] for c in fresh.list_checkpoints()] == [1, 2, 3]
    old.close()
    fresh.close()


def test_the_checkpoint_file_of_a_recoverable(tmp_path: Path) -> None:
    """Where a recoverable's file is (point 11, see docs/migrating-from-speechbrain.md): at
    ckpt.paramfiles[name] == ckpt.path / name / f"{name}.ckpt"; `name=` is in the meta."""
    with Checkpointer(tmp_path, {"counter": EpochCounter(3)}) as checkpointer:
        ckpt = checkpointer.save_checkpoint(name="epoch-3")
        assert ckpt is not None
        assert ckpt.paramfiles["counter"] == ckpt.path / "counter" / "counter.ckpt"
        assert ckpt.paramfiles["counter"].read_text() == "0"
        assert ckpt.meta["name"] == "epoch-3"
        (listed,) = checkpointer.list_checkpoints()
        assert listed == ckpt and listed.paramfiles == ckpt.paramfiles
    manifest = json.loads((ckpt.path / "_CHECKPOINT.json").read_text())
    assert "counter" in manifest["items"]
