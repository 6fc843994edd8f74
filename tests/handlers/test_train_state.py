"""TrainStateHandler: donation safety, shardings, T5X's restore options, pytree node types."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
from conftest import Gate
from support.handlers import stored, write_item

from cairn.handlers import InMemoryHandler, LazyArray, TrainStateHandler, TrainStateRestore
from cairn.handlers.errors import CorruptCheckpointError, MismatchError
from cairn.manager import CheckpointManager, CommitError

# What a snapshot of a jax array is depends on where the array lives, and these tests assert
# whichever holds, so that they run unchanged on a GPU (bench/gpu_run.sh). On the CPU backend,
# without the staging pool, the snapshot keeps zero-copy views of the buffers, so JAX declines to
# donate them while the save is in flight. On an accelerator, save() copies every shard to the
# host (into pinned memory on GPU) before it returns: the snapshot never views the state, and
# the next step donates as usual.
PLATFORM = jax.devices()[0].platform
VIEWS = PLATFORM == "cpu"


def jax_state(seed: int = 0) -> dict[str, Any]:
    k = jax.random.PRNGKey(seed)
    return {
        "params": {"dense": {"kernel": jax.random.normal(k, (64, 32)), "bias": jnp.zeros(32)}},
        "opt_state": {"mu": {"dense": {"kernel": jnp.ones((64, 32)), "bias": jnp.ones(32)}}},
        "step": jnp.array(7, jnp.int32),
    }


def host_copy(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: np.array(x, copy=True), tree)


def assert_close_trees(got: Any, want: Any) -> None:
    got_leaves, got_def = jax.tree_util.tree_flatten(got)
    want_leaves, want_def = jax.tree_util.tree_flatten(want)
    assert got_def == want_def, (got_def, want_def)
    for g, w in zip(got_leaves, want_leaves, strict=True):
        assert np.asarray(g).dtype == np.asarray(w).dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_donating_the_state_right_after_the_first_save_keeps_the_checkpoint_exact(
    tmp_path: Path, gate: Gate
) -> None:
    """The first save of a manager copies the state (into a slab mapped then, on the CPU; to
    the host on an accelerator): the next jitted step donates it while the write is held, and
    restore gives the old values."""
    state = jax_state()
    before = host_copy(state)
    train_step = jax.jit(lambda s: jax.tree_util.tree_map(lambda x: x * 3 + 1, s), donate_argnums=0)
    handlers = {"gate": InMemoryHandler(on_write=gate)}
    with CheckpointManager(tmp_path, handlers=handlers) as mgr:
        mgr.save(1, {"gate": 0, "state": state})  # the gate item is written first
        assert gate.entered.wait(30)
        new_state = train_step(state)
        assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(state)), (
            "JAX declined to donate: something views the state's buffers"
        )
        gate.release.set()
        mgr.wait_until_finished()
        restored = mgr.restore(1, {"state": None})["state"]
        assert_close_trees(restored, before)
        # Once committed, the snapshot lets go: the next donation really donates.
        newer = train_step(new_state)
        assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(new_state))
        del newer


def test_with_the_pool_the_next_step_donates_while_the_save_is_in_flight(
    tmp_path: Path, gate: Gate
) -> None:
    """From the second save on, save() copies the state into the manager's staging pool: the
    donating step right after it really donates (no second copy of the state), and the
    checkpoint still holds the values at save time."""
    train_step = jax.jit(lambda s: jax.tree_util.tree_map(lambda x: x * 3 + 1, s), donate_argnums=0)
    handlers = {"gate": InMemoryHandler(on_write=gate)}
    with CheckpointManager(tmp_path, handlers=handlers) as mgr:
        mgr.save(0, {"state": jax_state(1)})  # maps the pool's slab
        mgr.wait_until_finished()
        state = jax_state()
        before = host_copy(state)
        mgr.save(1, {"gate": 0, "state": state})
        assert gate.entered.wait(30)  # the commit is held: the save is in flight
        new_state = train_step(state)
        assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(state)), (
            "JAX declined to donate: something still views the state's buffers"
        )
        gate.release.set()
        mgr.wait_until_finished()
        assert_close_trees(mgr.restore(1, {"state": None})["state"], before)
        del new_state


def test_a_committed_save_keeps_nothing_of_the_state_alive_without_a_gc_pass(
    tmp_path: Path,
) -> None:
    """With the collector off, a save that viewed the state (``zero_copy=True``) lets go of it
    when it commits: no reference cycle keeps those views (one did: the snapshot's per-leaf
    closure called itself), so the donating step after the commit donates."""
    import gc

    train_step = jax.jit(lambda s: jax.tree_util.tree_map(lambda x: x * 2, s), donate_argnums=0)
    gc.collect()
    gc.disable()
    try:
        with CheckpointManager(tmp_path, zero_copy=True) as mgr:
            state = jax_state()
            key = jax.random.key(0)  # a typed PRNG key: the path that recursed
            mgr.save(0, {"state": {"params": state, "key": key}})  # views
            mgr.wait_until_finished()
            new_state = train_step(state)
            assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(state)), (
                "JAX declined to donate: something from a committed save still views the state"
            )
            del new_state
    finally:
        gc.enable()


def test_zero_copy_keeps_views_and_jax_declines_the_donation(tmp_path: Path, gate: Gate) -> None:
    """zero_copy=True: no staging memory, and the buffers stay the checkpoint's until it commits."""
    train_step = jax.jit(lambda s: jax.tree_util.tree_map(lambda x: x + 1, s), donate_argnums=0)
    handlers = {"gate": InMemoryHandler(on_write=gate)}
    with CheckpointManager(tmp_path, handlers=handlers, zero_copy=True) as mgr:
        for step in range(2):
            state = jax_state(step)
            before = host_copy(state)
            mgr.save(step, {"gate": 0, "state": state})
            assert gate.entered.wait(30)
            gate.entered.clear()
            new_state = train_step(state)
            donated = [x.is_deleted() for x in jax.tree_util.tree_leaves(state)]
            assert donated == [not VIEWS] * len(donated)  # views on CPU; else host copies
            gate.release.set()
            mgr.wait_until_finished()
            gate.release.clear()
            assert_close_trees(mgr.restore(step, {"state": None})["state"], before)
            del new_state
        assert mgr._staging.held_bytes() == 0


def test_the_pool_is_freed_at_close_and_follows_the_state_size(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        big = {"w": np.ones((1024, 1024), np.float32)}
        for step in range(3):
            mgr.save(step, {"state": big})
            mgr.wait_until_finished()
        assert 4 << 20 <= mgr._staging.held_bytes() <= 8 << 20
        small = {"w": np.ones((64, 1024), np.float32)}
        for step in range(3, 6):
            mgr.save(step, {"state": small})
            mgr.wait_until_finished()
        assert mgr._staging.held_bytes() <= 4 << 20  # the 4 MiB slab went with the big state
        np.testing.assert_array_equal(mgr.restore(5)["state"]["w"], small["w"])
    assert mgr._staging.held_bytes() == 0


def test_deleting_a_staged_source_after_save_is_harmless(tmp_path: Path) -> None:
    """With the pool, save() has copied the arrays: deleting them at once changes nothing."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"state": jax_state()})
        mgr.wait_until_finished()
        victim = jax_state(1)
        expected = host_copy(victim)
        mgr.save(2, {"state": victim})
        for leaf in jax.tree_util.tree_leaves(victim):
            leaf.delete()
        mgr.wait_until_finished()
        assert_close_trees(mgr.restore(2, {"state": None})["state"], expected)


def test_deleting_a_source_array_mid_write_fails_the_commit(tmp_path: Path, gate: Gate) -> None:
    """Views (zero_copy=True, or the first save): if a source array is deleted while its write
    is in flight, the step is not committed. (On an accelerator the snapshot is a host copy:
    the deletion does not touch it, and the step commits with the values at save.)"""
    handlers = {"gate": InMemoryHandler(on_write=gate)}
    with CheckpointManager(tmp_path, handlers=handlers, zero_copy=True) as mgr:
        mgr.save(1, {"state": jax_state()})
        mgr.wait_until_finished()
        victim = jax_state(1)
        before = host_copy(victim)
        mgr.save(2, {"gate": 0, "state": victim})
        assert gate.entered.wait(30)
        victim["params"]["dense"]["kernel"].delete()
        gate.release.set()
        if not VIEWS:
            mgr.wait_until_finished()
            assert_close_trees(mgr.restore(2, {"state": None})["state"], before)
            return
        with pytest.raises(
            CommitError, match=r"\['params'\]\['dense'\]\['kernel'\] was deleted or donated"
        ):
            mgr.wait_until_finished()
        assert mgr.all_steps() == [1]


@dataclasses.dataclass
class TrainState:
    step: Any
    params: Any
    opt_state: Any


jax.tree_util.register_dataclass(
    TrainState, data_fields=["step", "params", "opt_state"], meta_fields=[]
)
Moments = collections.namedtuple("Moments", ["mu", "nu"])


def test_registered_dataclasses_and_namedtuples(tmp_path: Path) -> None:
    """Custom pytree nodes restore as their own types with a target, as dicts without one."""
    obj = TrainState(jnp.array(3), {"w": jnp.ones((2, 2))}, Moments(jnp.zeros(2), jnp.ones(2)))
    handler = TrainStateHandler()
    records = write_item(handler, obj, tmp_path / "item")
    item = stored(tmp_path / "item", records)
    target = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), obj)
    got = handler.restore(item, target)
    assert isinstance(got, TrainState) and isinstance(got.opt_state, Moments)
    assert isinstance(got.params["w"], jax.Array)
    assert_close_trees(got, obj)
    plain = handler.restore(item)
    assert set(plain) == {"step", "params", "opt_state"} and set(plain["opt_state"]) == {"mu", "nu"}
    # A dict target reads such nodes by field name (the Orbax surface builds such targets).
    as_dicts = handler.restore(item, jax.tree_util.tree_map(lambda _: None, plain))
    assert set(as_dicts["opt_state"]) == {"mu", "nu"}
    assert_close_trees(as_dicts["opt_state"]["nu"], obj.opt_state.nu)
    with pytest.raises(MismatchError, match=r"only in the checkpoint: \['nu'\]"):
        handler.restore(item, {**plain, "opt_state": {"mu": None}})


def test_save_dtype_restore_dtype_and_the_cast_predicates(tmp_path: Path) -> None:
    """save_dtype casts only the params on disk; a f32 target undoes it; restore_dtype casts on read."""
    state = {
        "params": {"w": np.linspace(0, 1, 12, dtype=np.float32)},
        "opt": {"m": np.ones(3, np.float32)},
    }
    handler = TrainStateHandler(
        save_dtype=ml_dtypes.bfloat16, save_dtype_where=lambda p: p[0] == "params"
    )
    records = write_item(handler, state, tmp_path / "item")
    item = stored(tmp_path / "item", records)
    described = {leaf["path"]: leaf["dtype"] for leaf in handler.describe(item)["leaves"]}
    assert described == {"['params']['w']": "bfloat16", "['opt']['m']": "<f4"}
    as_saved = handler.restore(item)
    assert as_saved["params"]["w"].dtype == ml_dtypes.bfloat16
    back = handler.restore(
        item, {"params": {"w": np.zeros(12, np.float32)}, "opt": {"m": np.zeros(3, np.float32)}}
    )
    assert back["params"]["w"].dtype == np.float32
    np.testing.assert_allclose(back["params"]["w"], state["params"]["w"], atol=1e-2)
    cast = handler.restore(
        item, TrainStateRestore(restore_dtype=np.float16, cast=lambda p: p[0] == "opt")
    )
    assert cast["opt"]["m"].dtype == np.float16 and cast["params"]["w"].dtype == ml_dtypes.bfloat16


def test_partial_restore_by_subtree_and_by_predicate(tmp_path: Path) -> None:
    """subtree= returns only that subtree; where= reads only matching leaves."""
    state = host_copy(jax_state())
    handler = TrainStateHandler()
    item = stored(tmp_path / "item", write_item(handler, state, tmp_path / "item"))
    params = handler.restore(item, TrainStateRestore(subtree=("params",)))
    assert_close_trees(params, state["params"])
    only_kernel = handler.restore(item, TrainStateRestore(where=lambda p: p[-1] == "kernel"))
    assert only_kernel["params"]["dense"]["bias"] is None
    np.testing.assert_array_equal(
        only_kernel["params"]["dense"]["kernel"], state["params"]["dense"]["kernel"]
    )
    with pytest.raises(MismatchError, match=r"subtree \['nope'\]"):
        handler.restore(item, TrainStateRestore(subtree=("nope",)))


def test_transforms_then_fallback_then_target(tmp_path: Path) -> None:
    """T5X order: transforms on the restored state, then missing keys from fallback_state."""
    saved = {"params": {"old_name": np.arange(4.0)}}
    handler = TrainStateHandler()
    item = stored(tmp_path / "item", write_item(handler, saved, tmp_path / "item"))

    def rename(state: Any, target: Any) -> Any:
        return {"params": {"new_name": state["params"]["old_name"]}}

    target = {"params": {"new_name": np.zeros(4), "added": np.zeros(2)}}
    fallback = {"params": {"added": np.full(2, 9.0)}}
    got = handler.restore(
        item, TrainStateRestore(target, transforms=[rename], fallback_state=fallback)
    )
    np.testing.assert_array_equal(got["params"]["new_name"], np.arange(4.0))
    np.testing.assert_array_equal(got["params"]["added"], np.full(2, 9.0))
    with pytest.raises(MismatchError, match=r"only in the target: \['added'\]"):
        handler.restore(item, TrainStateRestore(target, transforms=[rename]))


def test_lazy_restore_reads_on_first_use(tmp_path: Path) -> None:
    """lazy=True gives LazyArray leaves with shape and dtype; get() reads the data."""
    state = {"w": np.arange(6.0).reshape(2, 3)}
    handler = TrainStateHandler()
    item = stored(tmp_path / "item", write_item(handler, state, tmp_path / "item"))
    got = handler.restore(item, TrainStateRestore(lazy=True))
    leaf = got["w"]
    assert isinstance(leaf, LazyArray) and leaf.shape == (2, 3) and leaf.dtype == np.float64
    np.testing.assert_array_equal(leaf.get(), state["w"])
    np.testing.assert_array_equal(np.asarray(leaf), state["w"])


def test_mismatch_names_the_key_path_and_both_sides(tmp_path: Path) -> None:
    """Shape and dtype disagreements with the target name the leaf and both values."""
    handler = TrainStateHandler()
    item = stored(
        tmp_path / "item",
        write_item(handler, {"w": np.ones((2, 3), np.float32)}, tmp_path / "item"),
    )
    with pytest.raises(
        MismatchError, match=r"\['w'\]: shape \(2, 3\) in the checkpoint, \(3, 2\) in the target"
    ):
        handler.restore(item, {"w": jax.ShapeDtypeStruct((3, 2), np.float32)})
    with pytest.raises(
        MismatchError, match=r"\['w'\]: dtype float32 in the checkpoint, int32 in the target"
    ):
        handler.restore(item, {"w": jax.ShapeDtypeStruct((2, 3), np.int32)})


def test_layout_is_plain_zarr3_in_chunks(tmp_path: Path) -> None:
    """Each array is a zarr v3 array that TensorStore opens by itself; chunks respect chunk_bytes."""
    big = np.random.default_rng(0).standard_normal((1000, 64)).astype(np.float32)  # 256000 bytes
    handler = TrainStateHandler(chunk_bytes=64 * 1024, layout="zarr")
    write_item(handler, {"big": big, "s": np.float32(2)}, tmp_path / "item")
    meta = json.loads((tmp_path / "item" / "arrays" / "0" / "zarr.json").read_text())
    assert meta["codecs"][-1] == {"name": "crc32c"}
    rows = meta["chunk_grid"]["configuration"]["chunk_shape"][0]
    assert rows * 64 * 4 <= 64 * 1024 and 1000 % rows == 0
    store = ts.open(
        {
            "driver": "zarr3",
            "kvstore": {"driver": "file", "path": str(tmp_path / "item" / "arrays" / "0")},
        }
    ).result()
    np.testing.assert_array_equal(store.read().result(), big)
    chunks = [p for p in (tmp_path / "item" / "arrays" / "0").iterdir() if p.name != "zarr.json"]
    assert len(chunks) == 1000 // rows


SHARDED = r"""
import os, sys, numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from cairn.manager import CheckpointManager
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
full = np.arange(64 * 48, dtype=np.float32).reshape(64, 48)
x = jax.device_put(full, NamedSharding(mesh, P("data", "model")))
rep = jax.device_put(np.ones(8, np.float32), NamedSharding(mesh, P()))
with CheckpointManager(sys.argv[1]) as mgr:
    mgr.save(1, {"state": {"x": x, "rep": rep}})
    mgr.wait_until_finished()
    for spec in (P("data", "model"), P("model", None), P(None, "data"), P()):
        sharding = NamedSharding(mesh, spec)
        target = {"x": jax.ShapeDtypeStruct(full.shape, np.float32, sharding=sharding), "rep": jax.ShapeDtypeStruct((8,), np.float32, sharding=NamedSharding(mesh, P()))}
        got = mgr.restore(1, {"state": target})["state"]
        assert got["x"].sharding == sharding, (got["x"].sharding, sharding)
        for shard in got["x"].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index])
        np.testing.assert_array_equal(np.asarray(got["rep"]), np.ones(8))
import json
index = json.load(open(os.path.join(sys.argv[1], "checkpoint_1", "state", "packs", "index.0.json")))
print("chunks", sorted(k.split("/")[-1] for k in index["chunks"] if k.startswith("arrays/0/")))
print("ok")
"""


def test_sharded_arrays_save_per_shard_and_restore_into_other_shardings(tmp_path: Path) -> None:
    """4 CPU devices: shards are written once each and read back into four different shardings."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    out = subprocess.run(
        [sys.executable, "-c", SHARDED, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "chunks ['0.0', '0.1', '1.0', '1.1']" in out.stdout  # each shard once, in packs
    assert out.stdout.strip().endswith("ok")


def test_copied_shards_need_no_donation_check(tmp_path: Path, gate: Gate) -> None:
    """int4 arrays reach the host as copies (as every array does on GPU): donating them is fine."""
    x = jnp.arange(8, dtype=jnp.int4)
    before = np.array(x)
    handlers = {"gate": InMemoryHandler(on_write=gate)}
    step = jax.jit(lambda a: a + 1, donate_argnums=0)
    with CheckpointManager(tmp_path, handlers=handlers) as mgr:
        mgr.save(1, {"gate": 0, "state": {"x": x}})
        assert gate.entered.wait(30)
        step(x)
        gate.release.set()
        mgr.wait_until_finished()
        got = mgr.restore(1, {"state": None})["state"]["x"]
    np.testing.assert_array_equal(np.asarray(got), before)


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned_host", "copy_to_host_async"])
@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero_copy", "pool"])
def test_accelerator_arrays_reach_the_host_as_copies_started_together(
    tmp_path: Path, gate: Gate, monkeypatch: pytest.MonkeyPatch, pinned: bool, zero_copy: bool
) -> None:
    """The GPU/TPU path, on the CPU backend made to pass for an accelerator (on a GPU, the real
    one): every shard's
    device-to-host copy starts (into pinned host memory, or by copy_to_host_async) before the
    first is waited for; the snapshot holds those copies, never the state's buffers, so the
    next step donates even with zero_copy=True, and the checkpoint holds the values at save."""
    import cairn.handlers._train_state.handler as impl

    monkeypatch.setattr(impl, "_HOST_PLATFORMS", ())
    monkeypatch.setattr(impl, "_PINNED_PLATFORMS", (PLATFORM,) if pinned else ())
    events: list[str] = []
    start = impl._start_transfer

    class Coming:  # what np.asarray waits for, logged
        def __init__(self, real: Any) -> None:
            self.real = real

        def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
            events.append("wait")
            return np.asarray(self.real)

    def logged(data: Any) -> Any:
        coming = start(data)
        events.append("start")
        if pinned:
            assert coming.sharding.memory_kind == "pinned_host"
            return Coming(coming)
        return coming  # the state's own array: the snapshot must copy its view

    monkeypatch.setattr(impl, "_start_transfer", logged)
    train_step = jax.jit(lambda s: jax.tree_util.tree_map(lambda x: x * 3 + 1, s), donate_argnums=0)
    handlers = {"gate": InMemoryHandler(on_write=gate)}
    with CheckpointManager(tmp_path, handlers=handlers, zero_copy=zero_copy) as mgr:
        for step in (1, 2):  # the second save has the pool (unless zero_copy)
            state = jax_state(step)
            before = host_copy(state)
            events.clear()
            mgr.save(step, {"gate": 0, "state": state})
            n = len(jax.tree_util.tree_leaves(state))
            assert events[:n] == ["start"] * n
            if pinned:
                assert events[n:] == ["wait"] * n
            assert gate.entered.wait(30)  # the commit is held: the save is in flight
            gate.entered.clear()
            new_state = train_step(state)
            assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(state)), (
                "JAX declined to donate: the snapshot views the state's buffers"
            )
            gate.release.set()
            mgr.wait_until_finished()
            gate.release.clear()
            assert_close_trees(mgr.restore(step, {"state": None})["state"], before)
            del new_state


def test_a_pinned_copy_numpy_refuses_falls_back_to_the_plain_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should NumPy refuse a `pinned_host` array on some backend, the save takes the plain
    device-to-host copy instead of failing."""
    import cairn.handlers._train_state.handler as impl

    monkeypatch.setattr(impl, "_HOST_PLATFORMS", ())
    monkeypatch.setattr(impl, "_PINNED_PLATFORMS", (PLATFORM,))

    class Refused:
        def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
            raise RuntimeError("no host view of this memory kind")

    monkeypatch.setattr(impl, "_start_transfer", lambda data: Refused())
    state = jax_state()
    before = host_copy(state)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"state": state})
        for leaf in jax.tree_util.tree_leaves(state):
            leaf.delete()  # the plain copy was copied again: nothing views the state
        mgr.wait_until_finished()
        assert_close_trees(mgr.restore(1, {"state": None})["state"], before)


def test_odd_dtypes_and_shapes(tmp_path: Path) -> None:
    """Big-endian data is stored little-endian; empty arrays write no chunk; strings are refused."""
    handler = TrainStateHandler(chunk_bytes=4 * 1024, layout="zarr")
    obj = {
        "be": np.arange(5, dtype=">f4"),
        "empty": np.zeros((3, 0), np.float32),
        "prime": np.arange(1009 * 3, dtype=np.float32).reshape(1009, 3),  # 1009 rows: a prime
    }
    records = write_item(handler, obj, tmp_path / "item")
    got = handler.restore(stored(tmp_path / "item", records))
    np.testing.assert_array_equal(got["be"], np.arange(5, dtype=np.float32))
    assert got["empty"].shape == (3, 0)
    np.testing.assert_array_equal(got["prime"], obj["prime"])
    assert not [
        r for r in records if r.path.startswith("arrays/1/") and r.path != "arrays/1/zarr.json"
    ]
    prime_chunks = [
        r for r in records if r.path.startswith("arrays/2/") and not r.path.endswith(".json")
    ]
    assert 3 <= len(prime_chunks) <= 4  # ~4 KiB chunks, the last padded, not 1009 one-row files
    for bad in (np.array(["a"]), np.array([b"x"]), np.array(["2020-01-01"], dtype="datetime64[D]")):
        with pytest.raises(
            TypeError, match=r"array at \['s'\] has dtype .*\(numbers and booleans only\)"
        ):
            handler.snapshot({"s": bad})


def test_transforms_keep_the_targets_types(tmp_path: Path) -> None:
    """With transforms or fallback, namedtuple, dataclass and OrderedDict targets keep their types."""
    obj = TrainState(
        np.int32(3), collections.OrderedDict(w=np.ones(2)), Moments(np.zeros(2), np.ones(2))
    )
    handler = TrainStateHandler()
    item = stored(tmp_path / "item", write_item(handler, obj, tmp_path / "item"))
    got = handler.restore(item, TrainStateRestore(obj, transforms=[lambda state, target: state]))
    assert isinstance(got, TrainState) and isinstance(got.opt_state, Moments)
    assert isinstance(got.params, collections.OrderedDict)
    np.testing.assert_array_equal(got.opt_state.nu, np.ones(2))


def test_reads_across_chunk_boundaries_are_checked_too(tmp_path: Path) -> None:
    """A region that is not whole chunks reads each overlapping chunk whole, checked all the same."""
    data = np.arange(4096, dtype=np.float32).reshape(256, 16)
    handler = TrainStateHandler(chunk_bytes=4096, layout="zarr")  # 64-row chunks
    records = write_item(handler, {"w": data}, tmp_path / "item")
    lazy = handler.restore(stored(tmp_path / "item", records), TrainStateRestore(lazy=True))["w"]
    np.testing.assert_array_equal(
        lazy._reader.read((slice(10, 100), slice(0, 16))).result(), data[10:100]
    )
    chunk = tmp_path / "item" / "arrays" / "0" / "1.0"
    raw = bytearray(chunk.read_bytes())
    raw[100] ^= 1
    chunk.write_bytes(bytes(raw))
    with pytest.raises(
        CorruptCheckpointError, match=r"arrays/0/1.0 \(leaf \['w'\]\) is not the chunk"
    ):
        lazy._reader.read((slice(10, 100), slice(0, 16))).result()
    with pytest.raises(
        CorruptCheckpointError,
        match=r"arrays/0/1\.0 \(leaf \['w'\]\) is not the chunk the manifest records",
    ):
        lazy.get()


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (
            lambda: TrainStateHandler(chunk_bytes=0),
            ValueError,
            "chunk_bytes must be an int >= 1, got 0",
        ),
        (lambda: TrainStateHandler(threads=1.5), ValueError, "threads must be an int >= 1"),
        (
            lambda: TrainStateHandler(max_inflight_bytes=10),
            ValueError,
            "max_inflight_bytes must be an int",
        ),
        (lambda: TrainStateHandler(save_dtype="nope"), TypeError, "nope"),
        (
            lambda: TrainStateHandler(save_dtype_where=3),
            TypeError,
            "save_dtype_where must be a key-path predicate",
        ),
        (lambda: TrainStateRestore(subtree="params"), TypeError, "subtree must be a tuple of keys"),
        (lambda: TrainStateRestore(where=1), TypeError, "where must be a key-path predicate"),
        (lambda: TrainStateRestore(transforms=[1]), TypeError, "transforms must be callables"),
        (lambda: TrainStateRestore(lazy="yes"), TypeError, "lazy must be a bool"),
    ],
)
def test_bad_options_are_refused(make: Any, error: type[Exception], message: str) -> None:
    """Handler and restore options are checked at construction, naming the option."""
    with pytest.raises(error, match=message):
        make()


def test_two_saves_in_flight_each_keep_their_own_values(tmp_path: Path, gate: Gate) -> None:
    """max_pending=2: the second save finds the pool's slab lent to the first (still held by the
    gate) and keeps views while a second slab warms; later saves copy into either. Every step
    restores to what it was at its save, and the pool ends with two slabs."""
    handlers = {"gate": InMemoryHandler(on_write=gate)}
    with CheckpointManager(tmp_path, handlers=handlers, max_pending=2) as mgr:
        mgr.save(0, {"state": jax_state(0)})
        mgr.wait_until_finished()  # the pool holds one slab now
        expected = {}
        for step in (1, 2):
            state = jax_state(step)
            expected[step] = host_copy(state)
            mgr.save(step, {"gate": 0, "state": state} if step == 1 else {"state": state})
            del state
        assert gate.entered.wait(30)
        gate.release.set()
        mgr.wait_until_finished()
        for step in (3, 4):
            state = jax_state(step)
            expected[step] = host_copy(state)
            mgr.save(step, {"state": state})
        mgr.wait_until_finished()
        for step, want in expected.items():
            assert_close_trees(mgr.restore(step, {"state": None})["state"], want)
        one_state = sum(x.nbytes for x in jax.tree_util.tree_leaves(jax_state()))
        # On an accelerator the device-to-host copies are the snapshots: the pool lends nothing.
        assert (
            mgr._staging.held_bytes() >= 2 * one_state if VIEWS else not mgr._staging.held_bytes()
        )
