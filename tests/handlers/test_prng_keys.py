"""Typed PRNG keys (``jax.random.key``) in a train state (issue 43, point 1): saved as their key
data with the implementation's name, restored as keys of that implementation again, alone and
inside pytrees, with and without targets, sharded or not, and through the T5X surface."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cairn.handlers import TrainStateHandler
from cairn.handlers.errors import CorruptCheckpointError, MismatchError
from cairn.manager import CheckpointManager
from cairn.manager import t5x as checkpoints
from cairn.manager._format import dump_checked


def same_keys(a: Any, b: Any) -> bool:
    return a.dtype == b.dtype and bool(
        np.array_equal(np.asarray(jax.random.key_data(a)), np.asarray(jax.random.key_data(b)))
    )


def state() -> dict[str, Any]:
    key = jax.random.key(42)
    return {
        "rng": key,
        "keys": jax.random.split(key, 6).reshape(2, 3),
        "rbg": jax.random.key(7, impl="rbg"),
        "params": {"w": jnp.arange(6.0)},
    }


@pytest.mark.parametrize("layout", ["packed", "zarr"])
def test_keys_alone_and_in_a_tree_with_and_without_targets(tmp_path: Path, layout: str) -> None:
    handlers = {n: TrainStateHandler(layout=layout) for n in ("rng", "state")}
    want = state()
    with CheckpointManager(tmp_path, handlers=handlers) as mgr:
        mgr.save(1, {"rng": jax.random.key(0), "state": want})
        mgr.wait_until_finished()
        alone = mgr.restore(1)["rng"]
        assert same_keys(alone, jax.random.key(0))
        got = mgr.restore(1)["state"]  # no target: keys come back as keys
        for name in ("rng", "keys", "rbg"):
            assert same_keys(got[name], want[name]), name
        assert got["keys"].shape == (2, 3)
        targets = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), want)
        got = mgr.restore(1, {"state": targets})["state"]
        for name in ("rng", "keys", "rbg"):
            assert same_keys(got[name], want[name]), name
        got = mgr.restore(1, {"state": want})["state"]  # concrete targets
        assert same_keys(got["keys"], want["keys"])
        assert mgr.verify(1) == []
        leaves = {leaf["path"]: leaf for leaf in mgr.describe(1)["state"]["leaves"]}
        assert leaves["['rbg']"]["prng"] == "rbg" and leaves["['rbg']"]["shape"] == [4]


def test_a_target_of_other_keys_or_numbers_is_a_mismatch(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"state": state()})
        mgr.wait_until_finished()
        for wrong, message in [
            ({"rbg": jax.random.key(1)}, r"\['rbg'\]: rbg PRNG keys .* key<fry> in the target"),
            ({"rng": jnp.zeros(2, jnp.uint32)}, r"\['rng'\].* uint32 in the target"),
            ({"keys": jax.random.split(jax.random.key(0), 6)}, r"shape \(2, 3\) .* \(6,\)"),
        ]:
            with pytest.raises(MismatchError, match=message):
                mgr.restore(1, {"state": {**state(), **wrong}})


def edit_tree(root: Path, step: int, edit: Any) -> None:
    """Rewrite tree.json of item `state` and its manifest record (what an attacker can do)."""
    import xxhash

    item = root / f"checkpoint_{step}" / "state"
    tree = json.loads((item / "tree.json").read_bytes())
    edit(tree)
    data = json.dumps(tree).encode()
    (item / "tree.json").write_bytes(data)
    path = root / f"checkpoint_{step}" / "_CHECKPOINT.json"
    body = json.loads(path.read_bytes())
    del body["crc32c"]
    for record in body["items"]["state"]["files"]:
        if record["path"] == "tree.json":
            record.update(size=len(data), xxh3_128=xxhash.xxh3_128_hexdigest(data))
    path.write_bytes(dump_checked(body))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda node: node.update(prng="mersenne"), "'mersenne'"),
        (lambda node: node.update(prng=["threefry2x32"]), "PRNG keys"),
        (lambda node: node.update(prng="rbg"), "does not end in \\(4,\\)"),
        (lambda node: node.update(dtype="<f4"), "PRNG keys"),
    ],
)
def test_crafted_key_nodes_are_corrupt(tmp_path: Path, edit: Any, message: str) -> None:
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"state": {"rng": jax.random.key(0)}})
    edit_tree(tmp_path, 1, lambda tree: edit(tree["c"][0]))
    with (
        CheckpointManager(tmp_path, read_only=True) as mgr,
        pytest.raises(CorruptCheckpointError, match=message),
    ):
        mgr.restore(1, fallback=False)


def test_keys_of_an_unnamed_implementation_are_refused_on_save(tmp_path: Path) -> None:
    """A custom PRNG implementation has no name jax.random can make keys of again: refused
    with a message saying what to save instead, and nothing is written."""
    from jax.extend.random import define_prng_impl

    impl = define_prng_impl(
        key_shape=(2,),
        seed=lambda s: jnp.stack([s.astype(jnp.uint32), s.astype(jnp.uint32)]),
        split=lambda k, shape: jnp.zeros((*shape, 2), jnp.uint32),
        random_bits=lambda k, bw, shape: jnp.zeros(shape, jnp.uint32),
        fold_in=lambda k, d: k,
        name="custom_for_test",
        tag="cst",
    )
    keys = jax.random.key(0, impl=impl)
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(TypeError, match=r"\['rng'\] are of implementation '"):
            mgr.save(1, {"state": {"rng": keys}})
        assert mgr.all_steps() == []


SHARDED = r"""
import sys, numpy as np, jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from cairn.manager import CheckpointManager
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
keys = jax.random.split(jax.random.key(5), 16).reshape(4, 4)
saved = jax.device_put(keys, NamedSharding(mesh, P("data", "model")))
with CheckpointManager(sys.argv[1]) as mgr:
    mgr.save(1, {"state": {"keys": saved}})
    mgr.wait_until_finished()
    for spec in (P("data", "model"), P("model"), P(None, "data"), P()):
        sharding = NamedSharding(mesh, spec)
        target = {"keys": jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=sharding)}
        got = mgr.restore(1, {"state": target})["state"]["keys"]
        assert got.dtype == keys.dtype, got.dtype
        assert got.sharding.is_equivalent_to(sharding, got.ndim), (got.sharding, sharding)
        np.testing.assert_array_equal(jax.random.key_data(got), jax.random.key_data(keys))
print("ok")
"""


def test_sharded_keys_restore_into_other_shardings(tmp_path: Path) -> None:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    out = subprocess.run(
        [sys.executable, "-c", SHARDED, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_keys_through_the_t5x_surface(tmp_path: Path) -> None:
    train_state = {
        "step": jnp.array(3, jnp.int32),
        "params": {"w": jnp.ones(4)},
        "opt_state": {"rng": jax.random.key(11)},
    }
    with checkpoints.Checkpointer(train_state, None, tmp_path) as ckpt:
        ckpt.save(train_state)
    with checkpoints.Checkpointer(train_state, None, tmp_path) as ckpt:
        got = ckpt.restore()
    assert same_keys(got["opt_state"]["rng"], train_state["opt_state"]["rng"])
    loaded = checkpoints.load_t5x_checkpoint(tmp_path)
    assert same_keys(loaded["state"]["param_states"]["rng"], train_state["opt_state"]["rng"])
