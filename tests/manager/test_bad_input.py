"""Every public entry refuses bad input with a clear error, and nothing on disk changes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.treeutil import dir_state

from cairn.handlers import JsonHandler
from cairn.manager import (
    CheckpointManager,
    EveryNSteps,
    ItemNotFoundError,
    KeepLatest,
    MismatchError,
    ReadOnlyError,
    StepNotFoundError,
)

Call = Callable[[CheckpointManager], Any]

BAD_CALLS: list[tuple[str, Call, type[Exception], str]] = [
    ("negative step", lambda m: m.save(-1, {"s": [1]}), ValueError, "step must be >= 0, got -1"),
    (
        "bool step",
        lambda m: m.save(True, {"s": [1]}),
        TypeError,
        "step must be an integer, got a bool",
    ),
    (
        "float step",
        lambda m: m.save(2.0, {"s": [1]}),
        TypeError,
        "step must be an integer, got float",
    ),
    ("str step", lambda m: m.save("3", {"s": [1]}), TypeError, "step must be an integer, got str"),
    ("array step", lambda m: m.save(np.array([1, 2]), {"s": [1]}), TypeError, r"shape \(2,\)"),
    ("float array step", lambda m: m.save(np.array(2.0), {"s": [1]}), TypeError, "dtype float64"),
    ("numpy bool step", lambda m: m.save(np.bool_(True), {"s": [1]}), TypeError, "got a bool"),
    (
        "items not a mapping",
        lambda m: m.save(2, [np.ones(2)]),
        TypeError,
        "items must be a mapping",
    ),
    ("no items", lambda m: m.save(2, {}), ValueError, "items is empty"),
    ("parent item", lambda m: m.save(2, {"../x": [1]}), ValueError, r"bad item name '\.\./x'"),
    ("nested item", lambda m: m.save(2, {"a/b": [1]}), ValueError, r"bad item name 'a/b'"),
    ("hidden item", lambda m: m.save(2, {".x": [1]}), ValueError, r"bad item name '\.x'"),
    ("empty item", lambda m: m.save(2, {"": [1]}), ValueError, "bad item name ''"),
    ("manifest item", lambda m: m.save(2, {"_CHECKPOINT.json": [1]}), ValueError, "bad item name"),
    ("int item", lambda m: m.save(2, {1: [1]}), TypeError, "item names must be str"),
    (
        "no handler",
        lambda m: m.save(2, {"x": object()}),
        TypeError,
        "no handler is registered for object",
    ),
    ("bad leaf", lambda m: m.save(2, {"x": {"a": {1, 2}}}), TypeError, r"leaf at \['a'\] is a set"),
    (
        "metadata",
        lambda m: m.save(2, {"s": [1]}, metadata={"a": object()}),
        TypeError,
        "not JSON-serialisable",
    ),
    (
        "metadata nan",
        lambda m: m.save(2, {"s": [1]}, metadata={"a": float("nan")}),
        TypeError,
        "not JSON",
    ),
    (
        "metadata list",
        lambda m: m.save(2, {"s": [1]}, metadata=[1]),
        TypeError,
        "metadata must be a mapping",
    ),
    (
        "metric str",
        lambda m: m.save(2, {"s": [1]}, metrics={"a": "x"}),
        TypeError,
        r"metrics\['a'\] must be a real number",
    ),
    ("metric bool", lambda m: m.save(2, {"s": [1]}, metrics={"a": True}), TypeError, "got a bool"),
    (
        "metric key",
        lambda m: m.save(2, {"s": [1]}, metrics={1: 1.0}),
        TypeError,
        "keys must be non-empty str",
    ),
    ("force", lambda m: m.save(2, {"s": [1]}, force="yes"), TypeError, "force must be a bool"),
    (
        "json item",
        lambda m: m.save(2, {"cfg": {"a": object()}}),
        TypeError,
        "JsonHandler cannot store",
    ),
    (
        "restore step str",
        lambda m: m.restore("latest"),
        ValueError,
        "step must be None, 'best' or an integer",
    ),
    ("restore negative", lambda m: m.restore(-1), ValueError, "step must be >= 0"),
    ("restore float", lambda m: m.restore(1.5), TypeError, "got float"),
    ("restore items list", lambda m: m.restore(1, ["s"]), TypeError, "items must be a mapping"),
    ("restore bad name", lambda m: m.restore(1, {"../s": None}), ValueError, "bad item name"),
    ("restore fallback", lambda m: m.restore(fallback=1), TypeError, "fallback must be a bool"),
    ("delete negative", lambda m: m.delete(-3), ValueError, "step must be >= 0"),
    ("delete unknown", lambda m: m.delete(5), LookupError, "step 5 is not committed"),
    ("record bad metric", lambda m: m.record_metrics(1, {"a": [1]}), TypeError, r"metrics\['a'\]"),
    (
        "record not mapping",
        lambda m: m.record_metrics(1, 0.5),
        TypeError,
        "metrics must be a mapping",
    ),
    ("info str", lambda m: m.info("1"), TypeError, "step must be an integer"),
    ("metrics bool", lambda m: m.metrics(False), TypeError, "got a bool"),
    ("should_save float", lambda m: m.should_save(1.0), TypeError, "got float"),
    ("huge step", lambda m: m.save(2**63, {"s": [1]}), ValueError, r"step must be < 2\*\*63"),
    (
        "mismatched target",
        lambda m: m.restore(1, {"s": [np.zeros(4)]}),
        MismatchError,
        r"\[0\].*shape",
    ),
    ("unknown item", lambda m: m.restore(1, {"t": None}), ItemNotFoundError, "has no item 't'"),
    ("record unknown step", lambda m: m.record_metrics(7, {"a": 1.0}), StepNotFoundError, "step 7"),
    ("verify unknown step", lambda m: m.verify(7), StepNotFoundError, "step 7 is not committed"),
]


@pytest.mark.parametrize(
    ("case", "call", "error", "message"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS]
)
def test_bad_call_is_refused_and_changes_nothing(
    tmp_path: Path, case: str, call: Call, error: type[Exception], message: str
) -> None:
    """The error type and message name the problem; the directory is byte-for-byte unchanged."""
    with CheckpointManager(tmp_path, handlers={"cfg": JsonHandler()}) as mgr:
        mgr.save(1, {"s": [np.arange(3)]}, metrics={"loss": 1.0})
        mgr.wait_until_finished()
        before = dir_state(tmp_path)
        with pytest.raises(error, match=message):
            call(mgr)
        mgr.wait_until_finished()
        assert dir_state(tmp_path) == before
        assert mgr.all_steps() == [1]


BAD_OPTIONS: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("save not a policy", {"save": "every 10"}, TypeError, "save= must be a save policy"),
    ("keep is a save policy", {"keep": EveryNSteps(2)}, TypeError, "keep= must be a keep policy"),
    ("save is a keep policy", {"save": KeepLatest(2)}, TypeError, "save= must be a save policy"),
    ("handler name", {"handlers": {"../x": JsonHandler()}}, ValueError, "bad item name"),
    (
        "handler object",
        {"handlers": {"x": object()}},
        TypeError,
        r"handlers\['x'\].*no snapshot\(\) method",
    ),
    ("handlers list", {"handlers": [JsonHandler()]}, TypeError, "handlers must be a mapping"),
    (
        "best mode",
        {"best": ("loss", "avg")},
        ValueError,
        r"best must be \(metric, 'min' \| 'max'\)",
    ),
    ("prefix", {"step_prefix": "a/b"}, ValueError, "step_prefix must be"),
    ("digits", {"step_digits": 0}, ValueError, "step_digits must be None or an int in 1..20"),
    ("async flag", {"async_save": "yes"}, TypeError, "async_save must be a bool"),
    ("max_pending", {"max_pending": 0}, ValueError, "max_pending must be a positive int, got 0"),
    ("read_only flag", {"read_only": 1}, TypeError, "read_only must be a bool"),
    ("zero_copy flag", {"zero_copy": "yes"}, TypeError, "zero_copy must be a bool, got 'yes'"),
    *(
        (f"max_staging_bytes={v!r}", {"max_staging_bytes": v}, ValueError, "max_staging_bytes must")
        for v in (0, -1, 1.5, True, np.int64(0), "1G")
    ),
    *(
        (
            f"max_write_bytes_per_s={v!r}",
            {"max_write_bytes_per_s": v},
            ValueError,
            "max_write_bytes_per_s must be a number of bytes per second",
        )
        for v in (0, -5, 1e-300, float("nan"), float("inf"), "100M", True)
    ),
    ("barrier_timeout", {"barrier_timeout": 0}, ValueError, "barrier_timeout must be a positive"),
    ("primary type", {"primary_process": "0"}, ValueError, "primary_process must be a process"),
    ("primary flag", {"primary_process": True}, ValueError, "primary_process must be a process"),
    ("primary < 0", {"primary_process": -1}, ValueError, "primary_process must be a process"),
    (
        "primary not a process",
        {"primary_process": 1},
        ValueError,
        r"primary_process=1: this run has processes 0\.\.0",
    ),
    (
        "primary, reading",
        {"primary_process": 2, "read_only": True},
        ValueError,
        r"primary_process=2: this run has processes 0\.\.0",
    ),
]


@pytest.mark.parametrize(
    ("case", "options", "error", "message"), BAD_OPTIONS, ids=[c[0] for c in BAD_OPTIONS]
)
def test_bad_option_is_refused_before_touching_disk(
    tmp_path: Path, case: str, options: dict[str, Any], error: type[Exception], message: str
) -> None:
    """A bad constructor option raises before the directory is created or locked."""
    with pytest.raises(error, match=message):
        CheckpointManager(tmp_path / "run", **options)
    assert not (tmp_path / "run").exists()


def test_numpy_numbers_are_taken_for_counts_sizes_and_rates(tmp_path: Path) -> None:
    """Options computed with NumPy (np.int64, np.float32) are numbers like any other."""
    with CheckpointManager(
        tmp_path / "run",
        max_pending=np.int64(2),
        max_staging_bytes=np.int64(1 << 30),
        max_write_bytes_per_s=np.float32(1e9),
    ) as mgr:
        assert type(mgr._options.max_pending) is int and mgr._staging.max_bytes == 1 << 30
        mgr.save(0, {"x": np.arange(8)})
        mgr.wait_until_finished()
        np.testing.assert_array_equal(mgr.restore(0)["x"], np.arange(8))


@pytest.mark.parametrize(
    ("directory", "error", "message"),
    [
        (123, TypeError, "directory must be a str or path, got int"),
        ("", ValueError, "directory must be a non-empty path"),
        ("ftp://host/run", ValueError, "object stores are s3://bucket/prefix or gs://"),
        ("s3://", ValueError, "object stores are s3://bucket/prefix"),
    ],
)
def test_bad_directory(directory: Any, error: type[Exception], message: str) -> None:
    """A directory that is not a path is refused with the reason."""
    with pytest.raises(error, match=message):
        CheckpointManager(directory)


def test_directory_that_is_a_file(tmp_path: Path) -> None:
    """A path to a regular file is refused and the file is untouched."""
    (tmp_path / "f").write_text("data")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        CheckpointManager(tmp_path / "f")
    assert (tmp_path / "f").read_text() == "data"


def test_a_directory_that_cannot_be_written(tmp_path: Path) -> None:
    """A checkpoint directory on a read-only mount (a read-only bind mount; as a user without
    mount rights, a directory without write permission): a writable manager is refused, naming
    the directory and what to do, and changes nothing; a read-only manager reads it."""
    import os
    import subprocess

    root, view = tmp_path / "run", tmp_path / "view"
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"s": [np.arange(3)]})
    (root / ".cairn.lock").unlink()  # as a copy would be: no lock file yet
    view.mkdir()
    mounted = subprocess.run(["mount", "--bind", "-r", str(root), str(view)], capture_output=True)
    if mounted.returncode != 0:
        assert os.geteuid() != 0, mounted.stderr  # root can mount here, so it must have worked
        view.rmdir()
        view = root
        os.chmod(root, 0o555)
    try:
        before = dir_state(view)
        with pytest.raises(ReadOnlyError, match=rf"{view} cannot be written .*read_only=True"):
            CheckpointManager(view)
        assert dir_state(view) == before
        with CheckpointManager(view, read_only=True) as reader:
            assert reader.all_steps() == [1]
            np.testing.assert_array_equal(reader.restore()["s"][0], np.arange(3))
    finally:
        if view != root:
            subprocess.run(["umount", "-l", str(view)], check=True)
        os.chmod(root, 0o755)
