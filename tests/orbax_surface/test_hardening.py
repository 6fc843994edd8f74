"""What an adversarial review of the Orbax surface found, each kept as a test: damaged steps,
diverged metrics, a run whose metrics change meaning, crafted records, calls that must not
change the manager's state. Shared tests run on Orbax too; the others say what Orbax does."""

from __future__ import annotations

import glob
import logging
import math
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from orbax_surface.surface_util import jax_state, opts, save_all
from support.treeutil import dir_state

from cairn.handlers.errors import CorruptCheckpointError
from cairn.manager import CheckpointManager as CairnManager

Composite, StandardSave, StandardRestore = (
    ocp.args.Composite,
    ocp.args.StandardSave,
    ocp.args.StandardRestore,
)


@pytest.fixture
def dropin() -> type[Any]:
    from cairn.manager.orbax import CheckpointManager

    return CheckpointManager


def state_args(scale: float) -> Any:
    return Composite(state=StandardSave(jax_state(scale)))


def abstract() -> Any:
    return Composite(state=StandardRestore(jax.eval_shape(lambda: jax_state(0.0))))


# ---------------------------------------------------------------------- shared with Orbax


def test_restore_args_of_another_structure_than_the_item_is_a_value_error(
    impl: Any, root: Path
) -> None:
    """A misspelled key or a prefix tree in restore_args would drop the sharding asked for."""
    tree = {"a": {"x": np.arange(4.0)}, "b": np.ones(2)}
    with impl(root) as manager:
        manager.save(0, args=ocp.args.PyTreeSave(tree))
        manager.wait_until_finished()
        item = jax.tree_util.tree_map(lambda _: object(), tree)
        for restore_args in (
            {"a": {"X": ocp.RestoreArgs()}, "b": ocp.RestoreArgs()},  # misspelled
            {"a": ocp.RestoreArgs(), "b": ocp.RestoreArgs()},  # a prefix of the item
        ):
            with pytest.raises(ValueError):
                manager.restore(0, args=ocp.args.PyTreeRestore(item, restore_args=restore_args))


def test_a_python_scalar_in_the_target_comes_back_as_one(impl: Any, root: Path) -> None:
    with impl(root) as manager:
        manager.save(0, args=StandardSave({"n": 7, "w": np.arange(3.0)}))
        manager.wait_until_finished()
        got = manager.restore(0, args=StandardRestore({"n": 0, "w": np.zeros(3)}))
    assert got["n"] == 7 and type(got["n"]) is int
    assert isinstance(got["w"], np.ndarray)


def test_partial_restore_takes_restore_args_of_the_whole_tree(impl: Any, root: Path) -> None:
    """restore_args may cover more than the item asks for (the full tree): only the item's
    leaves come back."""
    tree = {"a": np.arange(3.0), "b": np.ones(2), "c": {"d": np.zeros(1), "e": np.ones(1)}}
    with impl(root) as manager:
        manager.save(0, args=ocp.args.PyTreeSave(tree))
        manager.wait_until_finished()
        restore_args = jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(), tree)
        item = {"a": object(), "c": {"d": object()}}
        got = manager.restore(
            0,
            args=ocp.args.PyTreeRestore(item, restore_args=restore_args, partial_restore=True),
        )
    assert set(got) == {"a", "c"} and set(got["c"]) == {"d"}
    np.testing.assert_array_equal(got["a"], tree["a"])


def test_a_default_items_metadata_is_there_once_a_new_manager_restored_it(
    impl: Any, root: Path
) -> None:
    with impl(root) as manager:
        manager.save(0, args=StandardSave({"w": np.arange(3.0)}))
    with impl(root) as fresh:
        assert fresh.metadata(0).item_metadata is None  # Orbax: no handler for it yet
        fresh.restore(0)
        assert fresh.metadata(0).item_metadata is not None


# ---------------------------------------------------------------------- cairn only


def test_a_damaged_newest_step_is_passed_over_and_its_number_never_fails_a_save(
    dropin: Any, root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its manifest gone (a half-copied step): listed, as Orbax lists any step directory, so
    should_save(its number) is False and a resumed loop's save there returns False instead of
    raising; restore(None) passes over it to the step before, with a warning."""
    with dropin(root) as manager:
        save_all(manager, [0, 1, 2])
    os.remove(root / "2" / "_CHECKPOINT.json")
    with caplog.at_level(logging.WARNING, logger="cairn"), dropin(root) as manager:
        assert manager.all_steps() == [0, 1, 2]
        assert float(manager.restore(None).state["w"][0, 1]) == 1.0  # step 1's
        assert manager.save(2, args=state_args(2.0)) is False
        assert manager.save(3, args=state_args(3.0)) is True
    assert "step 2 is damaged" in caplog.text
    with dropin(root) as manager:  # a restart after it
        assert manager.all_steps() == [0, 1, 2, 3]
        assert manager.save(2, args=state_args(2.0), force=False) is False
    with dropin(root) as manager, pytest.raises(CorruptCheckpointError, match="step 2"):
        manager.restore(2)


@pytest.mark.parametrize("damage", ["truncate _METADATA", "flip its data"])
def test_a_damaged_newest_orbax_step_is_passed_over(dropin: Any, root: Path, damage: str) -> None:
    """Orbax's own manager raises orbax's error for its damaged latest step; the swap's
    restore(None) restores the step before (orbax restores it), and restore(2) names step 2."""
    options = opts(enable_async_checkpointing=False)
    with ocp.CheckpointManager(root, options=options, item_names=("state",)) as manager:
        save_all(manager, [1, 2])
    if damage == "truncate _METADATA":
        path = root / "2" / "state" / "_METADATA"
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        for name in glob.glob(str(root / "2" / "state" / "**" / "d" / "*"), recursive=True):
            data = bytearray(Path(name).read_bytes())
            data[len(data) // 2] ^= 0xFF
            Path(name).write_bytes(bytes(data))
    with dropin(root, options=options, item_names=("state",)) as manager:
        got = manager.restore(None, args=abstract())
        assert float(got.state["w"][0, 1]) == 1.0
        with pytest.raises(CorruptCheckpointError, match="step 2"):
            manager.restore(2, args=abstract())


def test_nan_and_infinite_metrics_are_saved_and_come_back(dropin: Any, root: Path) -> None:
    """A diverged loss must not fail the save. Orbax saves it too (with best_fn)."""
    options = opts(best_fn=lambda m: m["loss"], best_mode="min")
    with dropin(root, options=options) as manager:
        manager.save(0, args=state_args(0.0), metrics={"loss": 1.0})
        manager.save(
            1, args=state_args(1.0), metrics={"loss": float("nan")}, custom_metadata={"x": np.inf}
        )
        manager.save(2, args=state_args(2.0), metrics={"loss": np.float32("-inf")})
    with dropin(root, options=options) as manager:
        assert math.isnan(manager.metrics(1)["loss"]) and manager.metrics(2)["loss"] == -math.inf
        assert manager.metadata(1).custom_metadata == {"x": math.inf}
        assert manager.best_step() in (0, 2)


def test_metrics_of_a_run_without_best_fn_do_not_fail_a_run_with_one(
    dropin: Any, root: Path
) -> None:
    """Orbax stores no metrics without best_fn, so this cannot happen there; here the first
    run's metrics are kept, and best_fn cannot rank them: those steps count as without metrics."""
    with dropin(root) as manager:
        save_all(manager, [0, 1], metrics={"acc": 0.5})
    options = opts(max_to_keep=2, best_fn=lambda m: m["loss"], best_mode="min")
    with dropin(root, options=options) as manager:
        assert manager.best_step() is None
        manager.save(2, args=state_args(2.0), metrics={"loss": 0.3})
        manager.save(3, args=state_args(3.0), metrics={"loss": 0.1})
        manager.wait_until_finished()
        assert manager.best_step() == 3
        assert manager.metrics(0) == {"acc": 0.5}


def test_a_no_args_restore_of_a_cairn_step_does_not_pin_the_item_kind(
    dropin: Any, root: Path
) -> None:
    """A step cairn's own manager wrote restores without args, and StandardSave still works."""
    with CairnManager(root, step_prefix="") as manager:
        manager.save(0, {"state": jax_state(0.0)})
    with dropin(root) as manager:
        assert list(manager.restore(None).keys()) == ["state"]
        assert manager.save(1, args=state_args(1.0)) is True
        assert manager.restore(None, args=ocp.args.Composite(state=None)).state is not None


def test_a_users_metadata_cannot_make_a_cairn_step_look_like_orbaxs(
    dropin: Any, root: Path
) -> None:
    with CairnManager(root, step_prefix="") as manager:
        manager.save(0, {"state": jax_state(5.0)}, metadata={"format": "orbax"})
    with dropin(root) as manager:
        assert float(manager.restore(0).state["w"][0, 1]) == 5.0
        assert float(manager.restore(None, args=abstract()).state["w"][0, 1]) == 5.0


def test_a_crafted_record_cannot_switch_the_manager_to_default_item_mode(
    dropin: Any, root: Path
) -> None:
    record = {"default_item": True, "items": {"state": "standard"}, "time": "soon"}
    with CairnManager(root, step_prefix="") as manager:
        manager.save(0, {"state": jax_state(1.0)}, metadata={"orbax": record})
    with dropin(root) as manager:
        assert float(manager.restore(None).state["w"][0, 1]) == 1.0
        assert manager.save(1, args=state_args(2.0)) is True


def test_a_refused_save_changes_nothing_not_even_the_items_kind(dropin: Any, root: Path) -> None:
    """Orbax binds the item to StandardSave's handler before it fails on the metrics, so the
    retry with PyTreeSave is refused there."""
    with dropin(root) as manager:
        save_all(manager, [0])
    with dropin(root) as manager:  # a new manager: the item's kind is not fixed yet
        before = dir_state(root)
        loop: dict[str, Any] = {}
        loop["self"] = loop
        for metrics, custom in ((object(), None), (loop, None), (None, [1, 2]), (None, loop)):
            with pytest.raises(TypeError):
                manager.save(
                    1, args=state_args(1.0), metrics=metrics, custom_metadata=custom, force=True
                )
        assert dir_state(root) == before and manager.all_steps() == [0]
        tree = {"w": jnp.ones(3)}
        assert manager.save(1, args=Composite(state=ocp.args.PyTreeSave(tree))) is True


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("todelete_full_path", "gs://bucket/trash"),
        ("enable_per_process_directory_creation", True),
        ("async_options", ocp.options.AsyncOptions(post_finalization_callback=lambda: None)),
        ("async_options", ocp.options.AsyncOptions(barrier_sync_fn=lambda **_: None)),
        ("multiprocessing_options", ocp.options.MultiprocessingOptions(active_processes={0})),
        ("file_options", ocp.options.FileOptions(path_permission_mode=0o700)),
        ("save_interval_steps", -1),
    ],
    ids=lambda v: v if isinstance(v, str) else "x",
)
def test_options_with_no_counterpart_are_refused_before_anything_is_written(
    dropin: Any, root: Path, field: str, value: Any
) -> None:
    """Each would change what Orbax does; dropped unseen, a user would rely on it."""
    kwargs = {field: value}
    if field == "enable_per_process_directory_creation":
        kwargs["multiprocessing_options"] = ocp.options.MultiprocessingOptions(primary_host=None)
    options = opts(**kwargs)
    with pytest.raises(ValueError, match=field):
        dropin(root, options=options)
    assert not root.exists()


def test_todelete_subdir_is_accepted_with_a_warning(
    dropin: Any, root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    options = opts(max_to_keep=1, todelete_subdir="trash")
    with caplog.at_level(logging.WARNING, logger="cairn"), dropin(root, options=options) as manager:
        save_all(manager, [0, 1])
    assert "todelete_subdir='trash'" in caplog.text
    assert not (root / "trash").exists() and manager.all_steps() == [1]


def test_handlers_and_name_formats_without_a_counterpart_are_refused(
    dropin: Any, root: Path
) -> None:
    class NameFormat:  # any object with Orbax's NameFormat methods
        def build_name(self, step: int) -> str:
            return f"s{step}"

    with pytest.raises(ValueError, match="step_name_format"):
        dropin(root, options=opts(step_name_format=NameFormat()))
    with pytest.raises(ValueError, match="item 'x': handler ProtoCheckpointHandler"):
        dropin(root, item_handlers={"x": ocp.ProtoCheckpointHandler("f")})
    assert not root.exists()


def test_the_logger_gets_an_entry_per_save_and_restore(impl: Any, root: Path) -> None:
    class Logger:
        def __init__(self) -> None:
            self.entries: list[dict[str, Any]] = []

        def log_entry(self, entry: dict[str, Any]) -> None:
            self.entries.append(dict(entry))

    logger = Logger()
    with impl(root, logger=logger) as manager:
        manager.save(3, args=StandardSave({"w": np.arange(3.0)}))
        manager.wait_until_finished()
        manager.restore(3)
    events = [(e.get("event_type"), e.get("step")) for e in logger.entries]
    assert ("save", 3) in events and ("restore", 3) in events


def test_each_step_keeps_the_time_its_retention_used(
    dropin: Any, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Orbax's keep_time_interval uses the save's start time while running but the commit
    time after a restart; here the time a save's decision used is the one a restart reads."""
    import datetime

    from cairn.manager._surfaces.orbax import manager as surface

    when = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
    monkeypatch.setattr(surface, "_now", lambda: when)
    options = opts(keep_time_interval=datetime.timedelta(hours=1))
    with dropin(root, options=options) as manager:
        manager.save(0, args=state_args(0.0))
    with dropin(root, options=options) as fresh:
        assert fresh.metadata(0).init_timestamp_nsecs == int(when.timestamp() * 1e9)


def test_an_orbax_step_in_a_bucket_is_refused_not_taken_for_damage() -> None:
    """restore(None) passes over damage only; a step the swap cannot hand to orbax is an
    UnsupportedFormatError that names what reads it, not a CorruptCheckpointError."""
    from cairn.handlers.errors import UnsupportedFormatError
    from cairn.manager._surfaces.orbax import foreign

    with pytest.raises(UnsupportedFormatError, match=r"cairn\.manager\.CheckpointManager") as e:
        foreign.restore(3, "s3://bucket/run/3", {})
    assert not isinstance(e.value, CorruptCheckpointError)
