"""Checkpoints written by the real orbax-checkpoint package, read by CheckpointManager."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorflow as tf
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cairn.manager import CheckpointManager, KeepLatest, ReadOnlyError


def tree(step: int) -> dict[str, Any]:
    return {
        "params": {"w": jnp.arange(12.0).reshape(3, 4) * step, "b": np.full(3, step, np.float32)},
        "step": step,
    }


def write_orbax(directory: Path, steps: list[int], **options: Any) -> None:
    """An Orbax CheckpointManager run: item "state" (StandardSave unless pytree_save), metrics."""
    pytree_save = options.pop("pytree_save", False)
    handlers = {}
    if options.pop("no_ocdbt", False):
        handlers["item_handlers"] = {"state": ocp.PyTreeCheckpointHandler(use_ocdbt=False)}
        pytree_save = True
    opts = ocp.CheckpointManagerOptions(
        best_fn=lambda m: m["loss"], best_mode="min", enable_async_checkpointing=False, **options
    )
    mgr = ocp.CheckpointManager(directory, options=opts, **handlers)
    for step in steps:
        item = ocp.args.PyTreeSave(tree(step)) if pytree_save else ocp.args.StandardSave(tree(step))
        mgr.save(step, args=ocp.args.Composite(state=item), metrics={"loss": 1.0 / (step + 1)})
    mgr.wait_until_finished()
    mgr.close()


def assert_tree(got: Any, step: int) -> None:
    want = tree(step)
    np.testing.assert_array_equal(np.asarray(got["params"]["w"]), np.asarray(want["params"]["w"]))
    np.testing.assert_array_equal(np.asarray(got["params"]["b"]), want["params"]["b"])
    assert int(got["step"]) == step


@pytest.mark.parametrize(
    ("layout", "options", "prefix"),
    [
        ("standard, OCDBT, no prefix", {}, ""),
        ("pytree, OCDBT, prefix", {"step_prefix": "checkpoint", "pytree_save": True}, "checkpoint"),
        ("pytree, no OCDBT", {"no_ocdbt": True}, ""),
    ],
)
def test_orbax_steps_list_and_restore(
    tmp_path: Path, layout: str, options: dict[str, Any], prefix: str
) -> None:
    write_orbax(tmp_path, [1, 2, 3], **options)
    with CheckpointManager(
        tmp_path, read_only=True, step_prefix=prefix, best=("loss", "min")
    ) as mgr:
        assert mgr.all_steps() == [1, 2, 3], layout
        assert mgr.best_step() == 3  # from Orbax's metrics
        assert mgr.metrics(2) == {"loss": 1.0 / 3}
        assert mgr.info(3).metadata["format"] == "orbax"
        assert mgr.info(3).items["state"].handler == "orbax.pytree"
        assert_tree(mgr.restore()["state"], 3)
        mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
        sharding = NamedSharding(mesh, P("d", None))
        target = {
            "params": {
                "w": jax.ShapeDtypeStruct((3, 4), jnp.float32, sharding=sharding),
                "b": jax.ShapeDtypeStruct((3,), jnp.float32, sharding=NamedSharding(mesh, P())),
            },
            "step": 0,
        }
        got = mgr.restore(2, {"state": target})["state"]
        assert got["params"]["w"].sharding == sharding
        assert_tree(got, 2)


def test_a_writer_never_changes_orbax_steps(tmp_path: Path) -> None:
    write_orbax(tmp_path, [1, 2], step_prefix="checkpoint")
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    with CheckpointManager(tmp_path, keep=KeepLatest(1), best=("loss", "min")) as mgr:
        assert mgr.best_step() == 2
        mgr.save(3, {"state": {"w": np.ones(2)}})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 2, 3]  # retention leaves Orbax steps alone
        with pytest.raises(ReadOnlyError, match="written by orbax-checkpoint"):
            mgr.delete(1)
        with pytest.raises(ReadOnlyError, match="written by orbax-checkpoint"):
            mgr.record_metrics(2, {"eval": 1.0})
    after = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")}
    assert set(before) <= after


def test_t5x_orbax_layout_with_its_dataset_item(tmp_path: Path) -> None:
    """T5X's OrbaxCheckpointManagerInterface writes checkpoint_<step>/state/ (PyTreeSave) and
    checkpoint_<step>/dataset/train_ds-000-of-001.* (a tf.train.Checkpoint of the iterator)."""
    write_orbax(tmp_path, [4], step_prefix="checkpoint", pytree_save=True)
    ds = tf.data.Dataset.range(100).shuffle(10, seed=1).batch(3)
    it = iter(ds)
    for _ in range(5):
        next(it)
    tf.train.Checkpoint(ds=it).write(
        str(tmp_path / "checkpoint_4" / "dataset" / "train_ds-000-of-001")
    )
    expect = next(it).numpy()
    with CheckpointManager(tmp_path, read_only=True) as mgr:
        assert mgr.info(4).items["dataset"].handler == "orbax.tf_dataset"
        fresh = iter(ds)
        got = mgr.restore(4, {"state": None, "dataset": fresh})
        assert_tree(got["state"], 4)
        assert got["dataset"] is fresh
        np.testing.assert_array_equal(next(fresh).numpy(), expect)


def test_orbax_temporary_directories_are_not_steps(tmp_path: Path) -> None:
    write_orbax(tmp_path, [1])
    (tmp_path / "2.orbax-checkpoint-tmp-1234").mkdir()
    with CheckpointManager(tmp_path, step_prefix="") as mgr:
        assert mgr.all_steps() == [1]
    assert (tmp_path / "2.orbax-checkpoint-tmp-1234").exists()  # not ours to remove
    assert os.listdir(tmp_path / "1")


def test_export_to_orbax_and_import_back(tmp_path: Path) -> None:
    """A cairn step exported is restored by orbax-checkpoint itself; imported back it is a
    checksummed cairn step equal to the original."""
    from cairn.handlers import JsonHandler
    from cairn.manager import orbax as interop

    state = {"params": {"w": np.arange(6.0, dtype=np.float32).reshape(2, 3)}, "step": np.int64(9)}
    with CheckpointManager(tmp_path / "cairn", handlers={"config": JsonHandler()}) as mgr:
        mgr.save(9, {"state": state, "config": {"lr": 0.1}}, metrics={"loss": 0.5})
    out = interop.export_step(tmp_path / "cairn", 9, tmp_path / "orbax", step_prefix="checkpoint")
    assert out == tmp_path / "orbax" / "checkpoint_9"
    orbax_mgr = ocp.CheckpointManager(
        tmp_path / "orbax", options=ocp.CheckpointManagerOptions(step_prefix="checkpoint")
    )
    got = orbax_mgr.restore(
        9, args=ocp.args.Composite(state=ocp.args.StandardRestore(), config=ocp.args.JsonRestore())
    )
    np.testing.assert_array_equal(np.asarray(got["state"]["params"]["w"]), state["params"]["w"])
    assert got["config"] == {"lr": 0.1}
    orbax_mgr.close()
    interop.import_step(tmp_path / "orbax", 9, tmp_path / "back", source_step_prefix="checkpoint")
    with CheckpointManager(tmp_path / "back", read_only=True) as back:
        assert back.verify(9) == [] and back.metrics(9) == {"loss": 0.5}
        restored = back.restore(9)
        np.testing.assert_array_equal(restored["state"]["params"]["w"], state["params"]["w"])
        assert restored["config"] == {"lr": 0.1}
    with pytest.raises(ValueError, match="no item 'nope'"):
        interop.export_step(tmp_path / "cairn", 9, tmp_path / "o2", items=["nope"])


def test_the_command_line_on_an_orbax_directory(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    write_orbax(tmp_path, [1, 2], step_prefix="checkpoint")
    cairn = str(Path(sys.executable).with_name("cairn"))
    rows = json.loads(
        subprocess.run(
            [cairn, "ls", str(tmp_path), "--json"], capture_output=True, text=True
        ).stdout
    )
    assert [(r["step"], r["format"], r["metrics"]) for r in rows] == [
        (1, "orbax", {"loss": 0.5}),
        (2, "orbax", {"loss": 1 / 3}),
    ]
    out = subprocess.run([cairn, "verify", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0
    assert out.stdout.splitlines()[0] == "step 1: orbax step, no checksums to verify"


def test_gc_leaves_orbax_steps_alone(tmp_path: Path) -> None:
    import subprocess
    import sys

    write_orbax(tmp_path, [1, 5], step_prefix="checkpoint")
    with CheckpointManager(tmp_path) as mgr:
        for step in (6, 7, 8):
            assert mgr.save(step, {"s": {"w": np.ones(2)}})
    cairn = str(Path(sys.executable).with_name("cairn"))
    ls = subprocess.run(
        [cairn, "ls", str(tmp_path), "--keep-latest", "1"], capture_output=True, text=True
    )
    assert ls.stdout.count("(Orbax: never deleted)") == 2
    gc = subprocess.run(
        [cairn, "gc", str(tmp_path), "--keep-latest", "1"], capture_output=True, text=True
    )
    assert gc.returncode == 0, gc.stderr
    assert "2 steps deleted, 3 kept: [1, 5, 8]" in gc.stdout


def test_cairn_export_command(tmp_path: Path) -> None:
    import subprocess
    import sys

    with CheckpointManager(tmp_path / "cairn") as mgr:
        mgr.save(3, {"state": {"w": np.arange(4.0)}})
    cairn = str(Path(sys.executable).with_name("cairn"))
    out = subprocess.run(
        [cairn, "export", str(tmp_path / "cairn"), "3", str(tmp_path / "orbax")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"exported step 3 to {tmp_path / 'orbax' / '3'}\n"
    with CheckpointManager(tmp_path / "orbax", read_only=True, step_prefix="") as orbax:
        np.testing.assert_array_equal(orbax.restore(3)["state"]["w"], np.arange(4.0))
    again = subprocess.run(
        [cairn, "export", str(tmp_path / "cairn"), "3", str(tmp_path / "orbax")],
        capture_output=True,
        text=True,
    )
    assert again.returncode == 2 and "already has Orbax step 3" in again.stderr


@pytest.mark.parametrize("target", [False, True], ids=["numpy", "target"])
def test_a_damaged_orbax_step_fails_without_reads_left_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: bool
) -> None:
    """orbax-checkpoint closes its event loop on the first failed read while its other reads
    still run; each then completes into the closed loop ("Exception ignored: Event loop is
    closed", about 15 per restore of this step before the fix). cairn has orbax wait for them."""
    from orbax.checkpoint._src import asyncio_utils

    leaves = {f"p{i:02d}": np.arange(1000.0) + i for i in range(20)}
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    handlers = {"state": ocp.PyTreeCheckpointHandler(use_ocdbt=False)}
    with ocp.CheckpointManager(tmp_path, options=options, item_handlers=handlers) as mgr:
        mgr.save(1, args=ocp.args.Composite(state=ocp.args.PyTreeSave(leaves)))
    (tmp_path / "1" / "state" / "p00" / ".zarray").write_text("")
    unraisable: list[str] = []
    monkeypatch.setattr("sys.unraisablehook", lambda u: unraisable.append(str(u.exc_value)))
    orbax_own = asyncio_utils._run_sync_via_new_loop
    want = leaves if target else None
    message = "orbax could not" if target else "orbax could not read its metadata"
    with CheckpointManager(tmp_path, step_prefix="") as mgr:
        for _ in range(5):
            with pytest.raises(ValueError, match=message) as caught:
                mgr.restore(1, {"state": want})
            assert "'state'" in str(caught.value)
    assert unraisable == []
    assert asyncio_utils._run_sync_via_new_loop is orbax_own  # put back after each restore


def test_orbax_waits_for_its_reads_only_while_cairn_calls_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The swap of orbax's run-sync function nests (the outermost exit puts orbax's back), the
    wait for leftover tasks is bounded, and an orbax without that function is left alone."""
    import asyncio
    import importlib

    from orbax.checkpoint._src import asyncio_utils

    impl = importlib.import_module("cairn.handlers._orbax")

    own = asyncio_utils._run_sync_via_new_loop
    with impl.orbax_reads_finish():
        assert asyncio_utils._run_sync_via_new_loop is impl._run_sync_finishing
        with impl.orbax_reads_finish():
            pass
        assert asyncio_utils._run_sync_via_new_loop is impl._run_sync_finishing
    assert asyncio_utils._run_sync_via_new_loop is own

    async def read(finish: bool) -> None:  # a read still in flight when the coroutine fails
        if not finish:
            await asyncio.get_running_loop().create_future()  # never done

    left: list[asyncio.Task[None]] = []

    async def fails_leaving(finish: bool) -> None:
        left.append(asyncio.ensure_future(read(finish)))
        raise ValueError("the first read failed")

    monkeypatch.setattr(impl, "_FINISH_S", 0.05)  # a task that never ends: not waited for ever
    with pytest.raises(ValueError, match="first read failed"):
        impl._run_sync_finishing(fails_leaving(finish=False))
    with pytest.raises(ValueError, match="first read failed"):
        impl._run_sync_finishing(fails_leaving(finish=True))

    monkeypatch.delattr(asyncio_utils, "_run_sync_via_new_loop")
    with impl.orbax_reads_finish():
        assert not hasattr(asyncio_utils, "_run_sync_via_new_loop")
