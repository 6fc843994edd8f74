"""A local tier beside the persistent directory, one process (the multi-process cases are in
tests/multihost): which tier saves which step, one snapshot feeding both, the restore decision
(newest intact step of either tier), damage and loss of the local directory, retention, and
what each public entry refuses."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.iterutil import Shuffled, advanced, take

from cairn.manager import (
    CheckpointManager,
    CorruptCheckpointError,
    EveryNSeconds,
    EveryNSteps,
    KeepLatest,
    LocalTier,
    OnPreemption,
    StepNotFoundError,
)
from cairn.manager._format import PART


def state(step: int) -> dict[str, Any]:
    return {
        "w": jnp.arange(64.0, dtype=jnp.float32).reshape(8, 8) * step,
        "b": np.arange(5, dtype=np.int64) * step,
        "step": step,
    }


def items(step: int) -> dict[str, Any]:
    return {"state": state(step), "data": advanced(Shuffled(seed=3), step)}


def check(restored: dict[str, Any], step: int) -> None:
    got = restored["state"]
    np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(state(step)["w"]))
    np.testing.assert_array_equal(got["b"], state(step)["b"])
    assert got["step"] == step
    assert take(restored["data"]) == take(advanced(Shuffled(seed=3), step))


def manager(root: Path, **kwargs: Any) -> CheckpointManager:
    local = kwargs.pop("local", None) or LocalTier(
        root / "local-{process}", save=EveryNSteps(3), keep=KeepLatest(2)
    )
    return CheckpointManager(
        root / "persistent", save=EveryNSteps(10), keep=KeepLatest(2), local=local, **kwargs
    )


def run(mgr: CheckpointManager, steps: range) -> None:
    for step in steps:
        if mgr.should_save(step):
            assert mgr.save(step, items(step))
    mgr.wait_until_finished()


def restore(mgr: CheckpointManager, step: int | None = None, **kwargs: Any) -> dict[str, Any]:
    return mgr.restore(step, {"state": None, "data": Shuffled(seed=3)}, **kwargs)


def local_step(root: Path, step: int) -> Path:
    return root / "local-0" / "process_0" / f"checkpoint_{step}"


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_each_tier_saves_its_steps_and_restore_takes_the_newest(
    tmp_path: Path, async_save: bool
) -> None:
    """Persistent every 10, local every 3 (keep 2 each): step 30 goes to both from one
    snapshot; all_steps tells the tiers apart; a new manager restores the newest step (local),
    bit-exact with the iterator's position."""
    with manager(tmp_path, async_save=async_save) as mgr:
        run(mgr, range(1, 32))
        assert mgr.all_steps("persistent") == [20, 30]
        assert mgr.all_steps("local") == [27, 30]
        assert mgr.all_steps() == [20, 27, 30] and mgr.latest_step() == 30
    part = json.loads((local_step(tmp_path, 30) / "_CHECKPOINT.json").read_text())
    assert part["metadata"][PART] == {
        "process": 0,
        "processes": 1,
        "save": part["metadata"][PART]["save"],
        "persistent": True,
    }
    with manager(tmp_path, async_save=async_save) as mgr:
        assert mgr.latest_step() == 30
        assert not mgr.should_save(30) and not mgr.should_save(29)
        assert mgr.should_save(33) and not mgr.should_save(34)
        check(restore(mgr), 30)
        check(restore(mgr, 27), 27)  # a step only the local tier holds
        check(restore(mgr, 20), 20)  # and one only the persistent tier holds
        with pytest.raises(StepNotFoundError, match="step 21"):
            restore(mgr, 21)


def test_a_lost_local_directory_falls_back_to_the_persistent_tier(tmp_path: Path) -> None:
    """A replaced host: its local directory is empty, the newest persistent step comes back."""
    with manager(tmp_path) as mgr:
        run(mgr, range(1, 26))
        assert mgr.all_steps() == [10, 20, 21, 24]
    shutil.rmtree(tmp_path / "local-0")  # a replaced host
    with manager(tmp_path) as mgr:
        assert mgr.all_steps() == [10, 20] and mgr.latest_step() == 20
        check(restore(mgr), 20)
        assert mgr.should_save(21)  # the local tier starts again after the step restored
        run(mgr, range(21, 25))
        assert mgr.all_steps("local") == [21, 24]


def test_a_damaged_local_part_is_passed_over_and_parts_above_the_restored_step_go(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The newest local part fails its hashes: restore() says so, takes the next newest step
    (an older local part), and deletes the damaged part above it (another timeline now);
    fallback=False raises instead, naming the file."""
    with manager(tmp_path) as mgr:
        run(mgr, range(1, 26))
    pack = next((local_step(tmp_path, 24) / "state" / "packs").glob("0.*"))
    data = bytearray(pack.read_bytes())
    data[10] ^= 0xFF
    pack.write_bytes(bytes(data))
    with manager(tmp_path) as mgr:
        with pytest.raises(CorruptCheckpointError, match="packs/0"):
            restore(mgr, fallback=False)
        with caplog.at_level(logging.WARNING, logger="cairn"):
            check(restore(mgr), 21)
        assert "could not read its part of step 24 from the local tier" in caplog.text
        assert mgr.all_steps("local") == [21] and not local_step(tmp_path, 24).exists()
        assert mgr.should_save(22) is False and mgr.should_save(24)


def test_a_given_damaged_step_raises_and_nothing_is_deleted(tmp_path: Path) -> None:
    with manager(tmp_path) as mgr:
        run(mgr, range(1, 26))
    (local_step(tmp_path, 24) / "data" / "process_0-of-1.json").write_text("{}")
    with manager(tmp_path) as mgr, pytest.raises(CorruptCheckpointError, match="process_0-of-1"):
        restore(mgr, 24)
    assert local_step(tmp_path, 24).exists()


def test_a_step_both_tiers_hold_is_read_from_the_local_part(tmp_path: Path) -> None:
    """Step 30 is in both tiers: with the persistent step's files removed, it still restores
    (the local part is the source); with the local part gone, from the persistent step."""
    with manager(tmp_path) as mgr:
        run(mgr, range(28, 31))
    shutil.rmtree(tmp_path / "persistent" / "checkpoint_30" / "state")
    with manager(tmp_path) as mgr:
        check(restore(mgr), 30)


def test_save_force_goes_to_both_tiers_and_retention_is_per_tier(tmp_path: Path) -> None:
    with manager(tmp_path) as mgr:
        for step in (1, 2, 4):
            assert mgr.save(step, items(step), force=True)
        mgr.wait_until_finished()
        assert mgr.all_steps("persistent") == [2, 4] and mgr.all_steps("local") == [2, 4]
        assert not mgr.save(3, items(3))  # below the newest of both tiers
        assert [p.name for p in sorted((tmp_path / "local-0/process_0").glob("checkpoint_*"))] == [
            "checkpoint_2",
            "checkpoint_4",
        ]


def test_a_time_policy_in_the_local_tier(tmp_path: Path) -> None:
    local = LocalTier(tmp_path / "local", save=EveryNSeconds(3600), keep=KeepLatest(1))
    with manager(tmp_path, local=local) as mgr:
        assert mgr.should_save(1)  # the first save: nothing saved before
        mgr.save(1, items(1))
        assert not mgr.should_save(2)  # an hour has not passed
        assert mgr.should_save(10)  # the persistent tier's step
        mgr.wait_until_finished()
        assert mgr.all_steps("local") == [1]


def test_the_local_directory_is_an_ordinary_cairn_directory(tmp_path: Path) -> None:
    """`cairn list` and `cairn verify` read it; a read-only manager restores its part."""
    with manager(tmp_path) as mgr:
        run(mgr, range(1, 7))
    cli = [sys.executable, "-m", "cairn.manager", "verify", str(tmp_path / "local-0/process_0")]
    out = subprocess.run(cli, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    with CheckpointManager(tmp_path / "local-0/process_0", read_only=True) as reader:
        assert reader.all_steps() == [3, 6]
        check(reader.restore(6, {"state": None, "data": Shuffled(seed=3)}), 6)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"directory": 3, "save": EveryNSteps(1)}, TypeError, "directory must be a path"),
        ({"directory": "d", "save": KeepLatest(1)}, TypeError, "save= must be a save policy"),
        ({"directory": "d", "save": EveryNSteps(1), "keep": EveryNSteps(1)}, TypeError, "keep="),
        ({"directory": "d", "save": OnPreemption()}, ValueError, "cannot hold OnPreemption"),
        ({"directory": "d", "save": EveryNSteps(1), "replicas": True}, TypeError, "replicas="),
        ({"directory": "d", "save": EveryNSteps(1), "replicas": -1}, ValueError, "replicas="),
        ({"directory": "d", "save": EveryNSteps(1), "storage_options": 3}, TypeError, "mapping"),
    ],
)
def test_local_tier_refuses_bad_options(kwargs: dict[str, Any], error: type, match: str) -> None:
    directory = kwargs.pop("directory")
    with pytest.raises(error, match=match):
        LocalTier(directory, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"local": "dir"}, "must be a LocalTier"),
        ({"read_only": True}, "read_only=True manager takes none"),
        ({"writer": "process"}, "writer='process' yet"),
        ({"incremental": True}, "incremental=True yet"),
    ],
)
def test_manager_refuses_what_a_local_tier_cannot_go_with(
    tmp_path: Path, kwargs: dict[str, Any], match: str
) -> None:
    tier = LocalTier(tmp_path / "l", save=EveryNSteps(1))
    with pytest.raises((TypeError, ValueError), match=match):
        CheckpointManager(tmp_path / "p", **{"local": tier, **kwargs})
    assert not (tmp_path / "p").exists() and not (tmp_path / "l").exists()


def test_the_part_record_is_cairns_own(tmp_path: Path) -> None:
    with manager(tmp_path) as mgr, pytest.raises(ValueError, match="cairn_part"):
        mgr.save(1, items(1), metadata={PART: {}}, force=True)
    assert list((tmp_path / "local-0").glob("*/checkpoint_*")) == []


def test_a_second_manager_on_the_same_local_directory_takes_it_over(tmp_path: Path) -> None:
    """As for the persistent directory: the newer manager of this process takes the local
    directory over (the older one's pending part commits first)."""
    first = manager(tmp_path)
    first.save(3, items(3))
    with manager(tmp_path) as second:
        assert second.all_steps("local") == [3]
        check(restore(second), 3)
    first.close()


def test_sharded_state_over_devices_is_held_whole_by_one_process(tmp_path: Path) -> None:
    """One process with every device: its part is the whole array, replicated leaves once."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    x = jax.device_put(jnp.arange(16.0), sharding)
    with manager(tmp_path) as mgr:
        mgr.save(3, {"state": {"x": x}})
        mgr.wait_until_finished()
        target = {"x": jax.ShapeDtypeStruct((16,), jnp.float32, sharding=sharding)}
        got = mgr.restore(3, {"state": target})["state"]["x"]
        np.testing.assert_array_equal(np.asarray(got), np.arange(16.0))


def test_info_says_which_tier_holds_a_step(tmp_path: Path) -> None:
    with manager(tmp_path) as mgr:
        run(mgr, range(1, 11))
        assert mgr.info(9).tier == "local" and str(mgr.info(9).path).endswith("checkpoint_9")
        assert mgr.info(10).tier == "persistent"  # both tiers hold it: the persistent one
        assert mgr.info(9).metadata[PART]["process"] == 0
        with pytest.raises(StepNotFoundError):
            mgr.info(8)
        for call in (mgr.metrics, mgr.verify, mgr.describe, mgr.delete):  # persistent only
            with pytest.raises(StepNotFoundError):
                call(9)
        assert mgr.all_steps("local") == [6, 9]  # nothing deleted
        with pytest.raises(ValueError, match="tier must be"):
            mgr.all_steps("bucket")  # type: ignore[arg-type]
    with CheckpointManager(tmp_path / "persistent") as plain:
        assert plain.all_steps("local") == [] and plain.all_steps("persistent") == [10]
