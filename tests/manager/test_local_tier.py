"""A local tier beside the persistent directory, one process (the multi-process cases are in
tests/multihost): which tier saves which step, one snapshot feeding both, the restore decision
(newest intact step of either tier), damage and loss of the local directory, retention, and
what each public entry refuses."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.iterutil import Shuffled, advanced, take
from support.mounts import mounted

from cairn.manager import (
    AtSteps,
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
        "holder": 0,
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


def gated(manager: Any) -> threading.Event:
    """An event that holds `manager`'s commit thread until set: the jobs handed to it after
    this call wait for it (its commits run in submission order)."""
    gate = threading.Event()
    manager._commits.executor.submit(gate.wait)
    return gate


def test_writer_process_commits_the_persistent_steps_and_parts_commit_here(
    tmp_path: Path,
) -> None:
    """writer="process": the persistent tier's steps are committed by the writer process,
    each process's parts by its own manager; step 30 (both tiers) from one snapshot. Every step
    restores bit-exact from its tier, and from the persistent one once the local directory is
    gone."""
    with manager(tmp_path, writer="process") as mgr:
        run(mgr, range(1, 10))
        assert mgr.all_steps("local") == [6, 9] and mgr.all_steps("persistent") == []
        assert mgr._commits.remote is None  # parts alone start no writer process
        run(mgr, range(10, 32))
        assert mgr.all_steps("persistent") == [20, 30] and mgr.all_steps("local") == [27, 30]
        writer = mgr._commits.remote
        assert writer is not None and writer.pid != os.getpid() and writer.dead is None
        assert mgr.info(30).metadata == {} and mgr.info(27).metadata[PART]["persistent"] is False
    part = json.loads((local_step(tmp_path, 30) / "_CHECKPOINT.json").read_text())
    assert part["metadata"][PART]["persistent"] is True
    with manager(tmp_path, writer="process") as mgr:
        check(restore(mgr), 30)  # from the local part
        check(restore(mgr, 27), 27)  # a step only the local tier holds
        check(restore(mgr, 20), 20)  # and one only the persistent tier holds
    shutil.rmtree(tmp_path / "local-0")
    with manager(tmp_path, writer="process") as mgr:
        assert mgr.all_steps() == [20, 30]
        check(restore(mgr), 30)  # from the persistent step the writer process committed
        run(mgr, range(31, 34))
        assert mgr.all_steps("local") == [33]


def test_writer_process_a_step_of_both_tiers_keeps_its_staging_memory_for_the_part(
    tmp_path: Path,
) -> None:
    """The writer process answers for step 30 before this process writes its part: the
    snapshot's staging memory stays the part's until it is written (released after the last
    of its two writes), so the next save (33, a part only) stages elsewhere, and both parts
    hold their own step, bit-exact."""
    with manager(tmp_path, writer="process", max_pending=2) as mgr:
        gate = gated(mgr._local.inner)
        try:
            mgr.save(30, items(30))
            mgr._commits.drain()  # the writer process committed step 30, its answer is in
            assert mgr.all_steps("persistent") == [30]
            mgr.save(33, items(33))  # staged while the part of step 30 waits to be written
        finally:
            gate.set()
        mgr.wait_until_finished()
        assert mgr.all_steps("local") == [30, 33]
    with CheckpointManager(tmp_path / "local-0/process_0", read_only=True) as parts:
        for step in (30, 33):
            check(parts.restore(step, {"state": None, "data": Shuffled(seed=3)}), step)


FROZEN = jnp.arange(1 << 18, dtype=jnp.float32)  # 1 MiB, the same jax.Array in every save


def frozen_items(step: int) -> dict[str, Any]:
    return {"state": {**state(step), "frozen": FROZEN}, "data": advanced(Shuffled(seed=3), step)}


def check_frozen(restored: dict[str, Any], step: int) -> None:
    check(restored, step)
    np.testing.assert_array_equal(np.asarray(restored["state"]["frozen"]), np.asarray(FROZEN))


def test_incremental_persistent_steps_link_and_parts_are_whole(tmp_path: Path) -> None:
    """incremental=True: a persistent step links the unchanged pack of the persistent step
    before it (parts saved in between change nothing there); each part is written whole. Every
    step restores bit-exact from its tier; with the local directory wiped, from the persistent
    tier, and so does a persistent step saved after the wipe, which links its predecessor."""
    with manager(tmp_path, incremental=True) as mgr:
        for step in range(1, 32):
            if mgr.should_save(step):
                assert mgr.save(step, frozen_items(step))
        mgr.wait_until_finished()
        assert mgr.all_steps("persistent") == [20, 30] and mgr.all_steps("local") == [27, 30]
        for step in (20, 30):  # 30: both tiers, one snapshot
            telemetry = mgr.info(step).telemetry
            assert telemetry["bytes_written"] < 0.1 * telemetry["bytes"], (step, telemetry)
        for step in (27, 30):
            manifest = json.loads((local_step(tmp_path, step) / "_CHECKPOINT.json").read_text())
            files = [f for entry in manifest["items"].values() for f in entry["files"]]
            assert files and not any(f.get("reused") for f in files)
            assert manifest["telemetry"]["bytes_written"] == manifest["telemetry"]["bytes"]
    with manager(tmp_path, incremental=True) as mgr:
        check_frozen(restore(mgr), 30)  # from the local part
        check_frozen(restore(mgr, 27), 27)
        check_frozen(restore(mgr, 20), 20)
    shutil.rmtree(tmp_path / "local-0")
    with manager(tmp_path, incremental=True) as mgr:
        assert mgr.all_steps() == [20, 30]
        check_frozen(restore(mgr), 30)
        for step in range(31, 41):
            if mgr.should_save(step):
                assert mgr.save(step, frozen_items(step))
        mgr.wait_until_finished()
        assert mgr.all_steps("persistent") == [30, 40] and mgr.all_steps("local") == [36, 39]
        telemetry = mgr.info(40).telemetry
        assert telemetry["bytes_written"] < 0.1 * telemetry["bytes"]
    shutil.rmtree(tmp_path / "local-0")
    with manager(tmp_path, incremental=True) as mgr:
        assert mgr.all_steps() == [30, 40]
        check_frozen(restore(mgr), 40)
        assert mgr.verify(40) == [] and mgr.verify(30) == []


def test_incremental_never_reads_an_array_the_caller_let_go_after_save(tmp_path: Path) -> None:
    """Once save() returned, the caller may donate or delete its arrays. A part is written from
    the snapshot's own copy (nothing of a part is linked), and a persistent step after a part
    links, unread, the files of the array the persistent step before wrote (a part written in
    between is not what it links to): neither reads the deleted array."""
    frozen = jnp.arange(1 << 18, dtype=jnp.float32)

    def items_with(step: int, array: Any) -> dict[str, Any]:
        return {"state": {"frozen": array, "lora": jnp.full(1000, float(step))}}

    with manager(tmp_path, incremental=True) as mgr:
        for step in (10, 12):  # persistent, then a part
            assert mgr.save(step, items_with(step, frozen))
            mgr.wait_until_finished()
        gate = gated(mgr)
        try:
            assert mgr.save(20, items_with(20, frozen))  # persistent: links step 10's pack
            frozen.delete()
        finally:
            gate.set()
        mgr.wait_until_finished()
        telemetry = mgr.info(20).telemetry
        assert telemetry["bytes_written"] < 0.1 * telemetry["bytes"]
        again = jnp.arange(1 << 18, dtype=jnp.float32)
        assert mgr.save(30, items_with(30, again))  # both tiers; the persistent write links
        mgr.wait_until_finished()
        gate = gated(mgr._local.inner)
        try:
            assert mgr.save(33, items_with(33, again))  # a part: `again` as step 30 wrote it
            again.delete()
        finally:
            gate.set()
        mgr.wait_until_finished()
        assert mgr.all_steps("local") == [30, 33] and mgr.all_steps("persistent") == [20, 30]
        for step in (33, 30, 20):  # a restore deletes the parts above its step
            got = mgr.restore(step, {"state": None})["state"]
            np.testing.assert_array_equal(
                np.asarray(got["frozen"]), np.arange(1 << 18, dtype=np.float32)
            )
            np.testing.assert_array_equal(np.asarray(got["lora"]), np.full(1000, float(step)))


@pytest.mark.timeout(120)  # the bug this guards against hung the next persistent save
def test_a_synchronous_part_that_fails_gives_its_slot_back(tmp_path: Path) -> None:
    """async_save=False, max_pending=1: step 30's local part cannot be written (its directory
    was replaced by a file), so save() raises, and the persistent save of the same step never
    happens: its slot and its snapshot's staging memory go back. The next persistent save
    (step 40) then commits and restores, instead of waiting for the slot forever."""
    mgr = manager(tmp_path, async_save=False, max_pending=1)
    run(mgr, range(1, 30))
    parts = tmp_path / "local-0" / "process_0"
    parts.rename(tmp_path / "gone")  # (its retention may still be emptying a trash directory)
    parts.write_bytes(b"not a directory")
    with pytest.raises(Exception, match="process_0"):
        mgr.save(30, items(30))
    assert mgr.all_steps("persistent") == [10, 20]
    assert mgr.save(40, items(40))
    assert mgr.all_steps("persistent") == [20, 40]
    parts.unlink()
    mgr.close()
    with manager(tmp_path) as again:
        check(restore(again), 40)


@pytest.mark.parametrize("store", ["s3", "gcs"])
def test_a_local_tier_on_an_object_store(
    tmp_path: Path, store: str, request: pytest.FixtureRequest
) -> None:
    """Either tier may be an object store: the local tier's parts in a bucket (a real moto or
    fake-gcs-server process), the persistent directory on disk. Restore reads the newest part
    from the bucket, bit-exact; the bucket's parts lost, the persistent step serves."""
    bucket = request.getfixturevalue(f"{store}_bucket")
    local = LocalTier(f"{bucket}/local-{{process}}", save=EveryNSteps(3), keep=KeepLatest(2))
    with manager(tmp_path, local=local) as mgr:
        run(mgr, range(1, 13))
        assert mgr.all_steps("local") == [9, 12] and mgr.all_steps("persistent") == [10]
    with manager(tmp_path, local=local) as mgr:
        check(restore(mgr), 12)
        assert mgr.latest_step() == 12
    with CheckpointManager(f"{bucket}/local-0/process_0") as parts:  # an ordinary directory
        for step in parts.all_steps():
            parts.delete(step)  # the bucket's parts gone
    with manager(tmp_path, local=local) as mgr:
        check(restore(mgr), 10)


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


LOCAL_WRITE = {
    "/cairn/local/checkpoint/write/blocking_duration_secs",
    "/cairn/local/checkpoint/write/async/total_duration_secs",
}
ORBAX_WRITE = {
    "/jax/checkpoint/write/blocking_duration_secs",
    "/jax/checkpoint/write/async/total_duration_secs",
}


WRITE_NAMES = (
    "write/blocking_duration_secs",
    "write/async/total_duration_secs",
    "write/bytes",
    "write/bytes_per_sec",
)


@pytest.fixture
def checkpoint_events() -> Any:
    """The names of the duration events JAX's monitoring listeners get of checkpoints, in order."""
    names: list[str] = []

    def listen(name: str, seconds: float, **kwargs: Any) -> None:
        if "/checkpoint/" in name:
            names.append(name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    yield names
    jax.monitoring.unregister_event_duration_listener(listen)


def test_each_tier_reports_under_its_own_names(tmp_path: Path, checkpoint_events: Any) -> None:
    """A local part's commit and restore go to JAX's monitoring listeners and to TensorBoard
    under /cairn/local/..., the persistent tier's under Orbax's names (/jax/checkpoint/...):
    dashboards built for Orbax see the persistent tier alone. One event file holds both."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    tb = tmp_path / "tb"
    with manager(tmp_path, tensorboard_dir=tb) as mgr:
        run(mgr, range(1, 7))
        assert mgr.all_steps("local") == [3, 6] and mgr.all_steps("persistent") == []
        assert set(checkpoint_events) == LOCAL_WRITE and len(checkpoint_events) == 4
        checkpoint_events.clear()
        run(mgr, range(7, 11))  # 9: local, 10: persistent
        assert sorted(checkpoint_events) == sorted(LOCAL_WRITE | ORBAX_WRITE)
        checkpoint_events.clear()
        check(restore(mgr, 10), 10)
        assert checkpoint_events == ["/jax/checkpoint/read/duration_secs"]
        check(restore(mgr, 9), 9)
        assert checkpoint_events[1:] == ["/cairn/local/checkpoint/read/duration_secs"]
        local_bytes = mgr.info(9).telemetry["bytes"]
    (events,) = tb.glob("*tfevents*")  # one writer for both tiers
    steps: dict[str, list[int]] = {}
    values: dict[tuple[str, int], float] = {}
    for event in EventFileLoader(str(events)).Load():
        for value in event.summary.value:
            steps.setdefault(value.tag, []).append(event.step)
            values[value.tag, event.step] = float(tensor_util.make_ndarray(value.tensor))
    local, orbax = "/cairn/local/checkpoint", "/jax/checkpoint"
    assert steps == {
        **{f"{local}/{name}": [3, 6, 9] for name in WRITE_NAMES},
        **{f"{orbax}/{name}": [10] for name in WRITE_NAMES},
        f"{local}/read/duration_secs": [9],
        f"{orbax}/read/duration_secs": [10],
    }
    assert values[f"{local}/write/bytes", 9] == local_bytes


def test_a_replica_held_for_another_process_is_not_reported(
    tmp_path: Path, checkpoint_events: Any
) -> None:
    """The telemetry of a manager of replicas (another process's parts) reports nothing: the
    save is its owner's, reported there; an own part's reports under the local names."""
    from cairn.manager._core.telemetry import Telemetry

    replicas, own = Telemetry(None), Telemetry(None)
    replicas.local_tier(tmp_path / "tb", own=False)
    own.local_tier(None, own=True)
    for telemetry in (replicas, own):
        telemetry.committed(4, 0.5, 1.0, 100.0)
        telemetry.restored(4, 0.25)
        telemetry.close()
    assert checkpoint_events == [
        "/cairn/local/checkpoint/write/blocking_duration_secs",
        "/cairn/local/checkpoint/write/async/total_duration_secs",
        "/cairn/local/checkpoint/read/duration_secs",
    ]
    assert not (tmp_path / "tb").exists()


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs mount of its own: a RAM disk, as /dev/shm is."""
    with mounted("tmpfs", tmp_path / "tmpfs") as where:
        yield where


def big(step: int, rows: int = 1024) -> dict[str, Any]:
    """A state whose part is one pack of 2 MiB (rows=1024), over the pool's 1 MiB."""
    return {"w": jnp.full((rows, 512), step, jnp.float32), "step": step}


def reclaimed(manager: Any) -> None:
    """Wait until the part manager's reclaim thread has done what it was given."""
    manager._commits._reclaimer.pool.submit(lambda: None).result()


def pack_of(parts: Path, step: int) -> Path:
    (pack,) = (parts / f"checkpoint_{step}" / "state" / "packs").glob("0.*")
    return pack


def test_on_a_ram_disk_a_deleted_parts_files_are_written_over_by_the_next(
    tmp_path: Path, tmpfs: Path
) -> None:
    """Local tier on tmpfs, KeepLatest(2): the pack of a deleted step is kept (no pages freed)
    and becomes the pack of a later step, written over (its inode); a smaller state cuts it
    to its own length. Files that may not be written over are freed instead: one with a second
    link (a crafted hard link to a file outside), one that others may write, and a symlink is
    never followed. Every step restores bit-exact and verifies clean; a new manager removes
    what the last one left in the pool. On the disk there is no pool."""
    tier = LocalTier(tmpfs / "local-{process}", save=EveryNSteps(1), keep=KeepLatest(2))
    parts = tmpfs / "local-0" / "process_0"
    pool = parts / ".trash-pages"
    outside = tmpfs / "outside"
    with CheckpointManager(tmp_path / "persistent", save=AtSteps([]), local=tier) as mgr:
        inner = mgr._local.inner
        assert mgr._storage._pool is None  # the persistent tier, on the disk
        for step in (1, 2, 3):
            mgr.save(step, {"state": big(step)})
        mgr.wait_until_finished()
        reclaimed(inner)
        kept = [p.stat().st_ino for p in pool.iterdir()]  # step 1's pack
        assert len(kept) == 1
        mgr.save(4, {"state": big(4)})
        mgr.wait_until_finished()
        assert pack_of(parts, 4).stat().st_ino == kept[0]  # written over, not allocated
        reclaimed(inner)
        # step 3 is deleted next: a hard link to its pack from outside, a file others may
        # write, and a symlink to the outside file, inside it
        os.link(pack_of(parts, 3), outside)
        before = outside.read_bytes()
        loose = parts / "checkpoint_3" / "state" / "loose"
        loose.write_bytes(b"x" * (2 << 20))
        loose.chmod(0o666)
        (parts / "checkpoint_3" / "state" / "link").symlink_to(outside)
        mgr.save(5, {"state": big(5, rows=600)})  # a smaller part: the pack written over is cut
        mgr.wait_until_finished()
        reclaimed(inner)
        assert sorted(pool.iterdir()) == []  # none of step 3's files may be written over
        assert not (parts / "checkpoint_3").exists()
        assert outside.read_bytes() == before  # the outside file keeps its bytes
        assert os.stat(outside).st_nlink == 1
        mgr.save(6, {"state": big(6)})
        mgr.wait_until_finished()
        assert pack_of(parts, 5).stat().st_size < pack_of(parts, 6).stat().st_size
        reclaimed(inner)
        assert len(list(pool.iterdir())) == 1  # step 4's pack
    assert not pool.exists()  # close() frees the pool
    pool.mkdir()
    with CheckpointManager(parts, read_only=True) as reader:
        for step, rows in ((5, 600), (6, 1024)):
            got = reader.restore(step, {"state": None})["state"]
            np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(big(step, rows)["w"]))
            assert reader.verify(step) == []
    (pool / "0.1").write_bytes(b"left by a writer killed")
    with CheckpointManager(tmp_path / "persistent", save=AtSteps([]), local=tier) as mgr:
        assert not pool.exists()  # removed at the open
        assert mgr._local.inner._storage._pool is not None
        assert mgr.restore(6, {"state": None})["state"]["step"] == 6
