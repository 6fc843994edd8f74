"""Directories cairn did not write, read as untrusted input (issue 17, case 9).

Orbax steps written by the real orbax-checkpoint package, SpeechBrain ``CKPT+`` directories as
SpeechBrain writes them, and TensorBoard event files written by the real writer, each then
damaged or crafted: links to a sentinel directory beside the run, FIFOs, malformed metadata,
corrupt records. Opening, listing and restoring raise only cairn's documented errors or skip what
is bad with a warning; the other steps stay reachable; nothing outside is read or changed;
nothing hangs.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import re
import shutil
import stat
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch
from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter
from test_orbax_interop import assert_tree, write_orbax

from cairn.manager import CheckpointManager, CorruptCheckpointError
from cairn.manager import t5x as checkpoints
from cairn.manager._format import dump_checked, load_checked
from cairn.manager._surfaces.cli import main as cairn_main
from cairn.manager.speechbrain import Checkpointer


def snapshot(root: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every entry under `root` (links not followed): mode and, for files, content."""
    out: dict[str, tuple[int, bytes | None]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            mode = os.lstat(path).st_mode
            out[str(path.relative_to(root))] = (
                mode,
                path.read_bytes() if stat.S_ISREG(mode) else None,
            )
    return out


def link_out(path: Path, sentinel: Path) -> None:
    """Replace `path` (a file or directory) by a link to a copy of it in `sentinel`."""
    copy = sentinel / f"{path.parent.name}-{path.name}"
    if path.is_dir():
        shutil.copytree(path, copy)
        shutil.rmtree(path)
    else:
        shutil.copyfile(path, copy)
        path.unlink()
    path.symlink_to(copy)


def replace_by_fifo(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
    os.mkfifo(path)


# ---------------------------------------------------------------------------- Orbax steps


@pytest.fixture(scope="module")
def orbax_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("orbax") / "run"
    write_orbax(root, [1, 2])  # item "state" (StandardSave, OCDBT), metrics/metrics, no prefix
    return root


@pytest.fixture
def run(orbax_run: Path, tmp_path: Path) -> Path:
    """A fresh copy of the Orbax run, with an empty sentinel directory beside it."""
    shutil.copytree(orbax_run, tmp_path / "run", symlinks=True)
    (tmp_path / "sentinel").mkdir()
    return tmp_path / "run"


def opened(root: Path) -> CheckpointManager:
    return CheckpointManager(root, read_only=True, step_prefix="")


def first_file(directory: Path) -> Path:
    return next(p for p in sorted(directory.rglob("*")) if p.is_file())


ITEM_ENTRIES: dict[str, Callable[[Path], Path]] = {
    "_METADATA": lambda item: item / "_METADATA",
    "manifest.ocdbt": lambda item: item / "manifest.ocdbt",
    "a data file": lambda item: first_file(item / "ocdbt.process_0" / "d"),
    "a subdirectory": lambda item: item / "ocdbt.process_0",
}


@pytest.mark.parametrize("entry", sorted(ITEM_ENTRIES))
def test_a_link_inside_an_orbax_item_is_refused_before_orbax_reads(run: Path, entry: str) -> None:
    """orbax itself follows links: cairn checks the item's tree first and names what it found.
    The step is still listed, the other step restores."""
    sentinel = run.parent / "sentinel"
    path = ITEM_ENTRIES[entry](run / "2" / "state")
    link_out(path, sentinel)
    before = snapshot(sentinel)
    with opened(run) as mgr:
        assert mgr.all_steps() == [1, 2]
        with pytest.raises(CorruptCheckpointError, match=r"step 2, item 'state'.*symbolic link"):
            mgr.restore(2)
        assert_tree(mgr.restore(1)["state"], 1)
    assert snapshot(sentinel) == before


@pytest.mark.timeout(60)
@pytest.mark.parametrize("entry", sorted(ITEM_ENTRIES))
def test_a_fifo_inside_an_orbax_item_is_refused(run: Path, entry: str) -> None:
    replace_by_fifo(ITEM_ENTRIES[entry](run / "2" / "state"))
    with opened(run) as mgr:
        assert mgr.all_steps() == [1, 2]
        with pytest.raises(CorruptCheckpointError, match=r"step 2, item 'state'.*not a regular"):
            mgr.restore(2)


def test_a_linked_item_directory_is_not_an_item(run: Path) -> None:
    """The item directory itself linked out: not listed as an item, so step 2 has none left
    and is a damaged step; step 1 is the newest intact one."""
    link_out(run / "2" / "state", run.parent / "sentinel")
    with opened(run) as mgr:
        assert mgr.all_steps() == [1, 2]
        with pytest.raises(CorruptCheckpointError, match="step 2"):
            mgr.restore(2)
        assert_tree(mgr.restore()["state"], 1)  # falls back past the damaged step


@pytest.mark.parametrize("metadata", ["_CHECKPOINT_METADATA", "metrics/metrics", "metrics"])
def test_linked_step_metadata_is_ignored_with_a_warning(
    run: Path, metadata: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A metadata file (or the metrics directory) linked to a file outside that says something
    else: never read; the step keeps what its own files say."""
    sentinel = run.parent / "sentinel"
    lie = {"metrics": {"loss": -1.0}, "custom_metadata": {"from": "outside"}}
    target = sentinel / "lie"
    if metadata == "metrics":
        target.mkdir()
        (target / "metrics").write_text(json.dumps(lie["metrics"]))
        shutil.rmtree(run / "2" / "metrics")
    else:
        target.write_text(json.dumps(lie if metadata == "_CHECKPOINT_METADATA" else lie["metrics"]))
        (run / "2" / metadata).unlink()
    (run / "2" / metadata).symlink_to(target)
    before = snapshot(sentinel)
    with caplog.at_level(logging.WARNING, logger="cairn"), opened(run) as mgr:
        assert mgr.all_steps() == [1, 2]
        assert mgr.metrics(2) in ({"loss": 1.0 / 3}, {})  # its own metrics file, or none
        assert mgr.info(2).metadata["custom_metadata"] == {}
        assert_tree(mgr.restore(2)["state"], 2)
    assert "Orbax step 2" in caplog.text
    assert snapshot(sentinel) == before


@pytest.mark.timeout(60)
@pytest.mark.parametrize("metadata", ["_CHECKPOINT_METADATA", "metrics/metrics"])
def test_a_fifo_named_like_step_metadata_does_not_hang(
    run: Path, metadata: str, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    replace_by_fifo(run / "2" / metadata)
    with caplog.at_level(logging.WARNING, logger="cairn"):
        with opened(run) as mgr:
            assert mgr.all_steps() == [1, 2]
            assert_tree(mgr.restore(2)["state"], 2)
        assert cairn_main(["ls", str(run), "--step-prefix", "", "--json"]) == 0
    assert [row["step"] for row in json.loads(capsys.readouterr().out)] == [1, 2]
    assert "not a regular file" in caplog.text


DEEP = "[" * 100_000 + "]" * 100_000
HUGE_INT = "9" * 5000
# _CHECKPOINT_METADATA of step 2 -> (metrics, custom_metadata) the step has then. Orbax's own
# file has empty metrics: the step's metrics come from metrics/metrics, {"loss": 1/3}.
STEP_METADATA: dict[str, tuple[bytes, dict[str, float], Any]] = {
    "a list": (b"[1, 2]", {"loss": 1 / 3}, {}),
    "a string": (b'"yes"', {"loss": 1 / 3}, {}),
    "not UTF-8": (b"\xff\xfe{}", {"loss": 1 / 3}, {}),
    "not JSON": (b"{'a': 1", {"loss": 1 / 3}, {}),
    "deep nesting": (f'{{"custom_metadata": {DEEP}}}'.encode(), {"loss": 1 / 3}, {}),
    "a huge integer": (
        f'{{"init_timestamp_nsecs": {HUGE_INT}}}'.encode(),
        {"loss": 1 / 3},
        {},
    ),
    "odd timestamps": (
        b'{"init_timestamp_nsecs": "yesterday", "commit_timestamp_nsecs": 1e300,'
        b' "custom_metadata": {"ok": 1}}',
        {"loss": 1 / 3},
        {"ok": 1},
    ),
    "timestamps out of range": (
        b'{"init_timestamp_nsecs": -5, "commit_timestamp_nsecs": 100000000000000000000000000000}',
        {"loss": 1 / 3},
        {},
    ),
    "metrics of every type": (
        b'{"metrics": {"ok": 0.5, "word": "low", "list": [1], "flag": true, "nan": NaN,'
        b' "inf": Infinity, "big": 1e999, "huge": ' + HUGE_INT[:400].encode() + b', "": 2}}',
        {"ok": 0.5},
        {},
    ),
    "metrics not a mapping": (b'{"metrics": [0.5]}', {"loss": 1 / 3}, {}),
    "custom metadata not a mapping": (b'{"custom_metadata": [1, 2]}', {"loss": 1 / 3}, {}),
    "custom metadata with NaN": (b'{"custom_metadata": {"x": NaN}}', {"loss": 1 / 3}, {}),
}


@pytest.mark.parametrize("case", sorted(STEP_METADATA))
def test_malformed_step_metadata_is_ignored_with_a_warning(
    run: Path, case: str, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    data, metrics, custom = STEP_METADATA[case]
    (run / "2" / "_CHECKPOINT_METADATA").write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="cairn"):
        with opened(run) as mgr:
            assert mgr.all_steps() == [1, 2]
            assert mgr.metrics(2) == pytest.approx(metrics)
            info = mgr.info(2)
            assert info.metadata == {"format": "orbax", "custom_metadata": custom}
            assert math.isfinite(info.committed_at) and 0 < info.committed_at < 2**40
            assert_tree(mgr.restore(2)["state"], 2)
        assert cairn_main(["ls", str(run), "--step-prefix", "", "--json"]) == 0
    assert [row["step"] for row in json.loads(capsys.readouterr().out)] == [1, 2]
    assert "Orbax step 2" in caplog.text


@pytest.mark.parametrize(
    "data",
    [b"[0.5]", b'{"loss": "low"}', b'{"loss": Infinity}', b'{"loss": NaN}', DEEP.encode()],
)
def test_malformed_orbax_metrics_are_ignored_with_a_warning(
    run: Path, data: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    (run / "2" / "metrics" / "metrics").write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="cairn"), opened(run) as mgr:
        assert mgr.all_steps() == [1, 2]
        assert mgr.metrics(2) == {}
        assert mgr.metrics(1) == {"loss": 0.5}
    assert "Orbax step 2" in caplog.text


@pytest.mark.parametrize(
    "data", [b"[]", b"{}", b"{not json", b'{"tree_metadata": NaN}', DEEP.encode()]
)
def test_malformed_item_metadata_makes_the_restore_corrupt(run: Path, data: bytes) -> None:
    """orbax's own reading of a bad ``_METADATA`` raises AttributeError, KeyError or
    RecursionError; cairn reports it as damage of that step and item."""
    (run / "2" / "state" / "_METADATA").write_bytes(data)
    with opened(run) as mgr:
        assert mgr.all_steps() == [1, 2]
        with pytest.raises(CorruptCheckpointError, match=r"step 2, item 'state'"):
            mgr.restore(2)
        assert_tree(mgr.restore(1)["state"], 1)


def test_item_directories_with_names_a_save_refuses_are_left_out(
    run: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for name in ("bad\x1b[31mname", "with space", "x" * 200):
        (run / "2" / name).mkdir()
        (run / "2" / name / "_METADATA").write_text("{}")
    with caplog.at_level(logging.WARNING, logger="cairn"), opened(run) as mgr:
        assert set(mgr.info(2).items) == {"state"}
        assert_tree(mgr.restore(2)["state"], 2)
    assert "ignoring an item directory" in caplog.text


@pytest.fixture(scope="module")
def orbax_json_and_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An Orbax step with a JsonSave item "config" and T5X's tf.data item "dataset"."""
    import orbax.checkpoint as ocp
    import tensorflow as tf

    root = tmp_path_factory.mktemp("orbax-json") / "run"
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    with ocp.CheckpointManager(root, options=options) as mgr:
        mgr.save(1, args=ocp.args.Composite(config=ocp.args.JsonSave({"lr": 0.5})))
        mgr.wait_until_finished()
    tf.train.Checkpoint(ds=iter(tf.data.Dataset.range(10))).write(
        str(root / "1" / "dataset" / "train_ds-000-of-001")
    )
    return root


JSON_AND_DATASET: dict[str, tuple[str, Callable[[Path, Path], None]]] = {
    "JSON: a link": ("config", lambda p, s: link_out(p / "config" / "metadata", s)),
    "JSON: a FIFO": ("config", lambda p, s: replace_by_fifo(p / "config" / "metadata")),
    "JSON: deep": ("config", lambda p, s: (p / "config" / "metadata").write_text(DEEP)),
    "JSON: not UTF-8": ("config", lambda p, s: (p / "config" / "metadata").write_bytes(b"\xff")),
    "dataset: a link": ("dataset", lambda p, s: link_out(first_file(p / "dataset"), s)),
    "dataset: a FIFO": ("dataset", lambda p, s: replace_by_fifo(first_file(p / "dataset"))),
    "dataset: garbage": ("dataset", lambda p, s: first_file(p / "dataset").write_bytes(b"x" * 9)),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(JSON_AND_DATASET))
def test_orbax_json_and_dataset_items_are_checked_before_they_are_read(
    orbax_json_and_dataset: Path, tmp_path: Path, case: str
) -> None:
    import tensorflow as tf

    root, sentinel = tmp_path / "run", tmp_path / "sentinel"
    shutil.copytree(orbax_json_and_dataset, root, symlinks=True)
    sentinel.mkdir()
    with opened(root) as mgr:  # intact first
        assert mgr.restore(1, {"config": None})["config"] == {"lr": 0.5}
        mgr.restore(1, {"dataset": iter(tf.data.Dataset.range(10))})
    item, damage = JSON_AND_DATASET[case]
    damage(root / "1", sentinel)
    before = snapshot(sentinel)
    with opened(root) as mgr:
        assert mgr.all_steps() == [1]
        target = iter(tf.data.Dataset.range(10)) if item == "dataset" else None
        with pytest.raises(CorruptCheckpointError, match=rf"step 1, item '{item}'"):
            mgr.restore(1, {item: target})
    assert snapshot(sentinel) == before


# ---------------------------------------------------------------------------- SpeechBrain


def net(weight: float) -> torch.nn.Linear:
    lin = torch.nn.Linear(2, 2)
    with torch.no_grad():
        lin.weight.fill_(weight)
        lin.bias.fill_(weight)
    return lin


def speechbrain_checkpoint(root: Path, name: str, meta: str, weight: float) -> Path:
    """A checkpoint directory as SpeechBrain writes it: CKPT.yaml and <recoverable>.ckpt."""
    path = root / f"CKPT+{name}"
    path.mkdir()
    (path / "CKPT.yaml").write_text(f"# yamllint disable\n{meta}", encoding="utf-8")
    torch.save(net(weight).state_dict(), path / "net.ckpt")
    return path


GOOD_META = "end-of-epoch: true\nloss: 0.5\nunixtime: 5.0\n"
NEWER_META = "end-of-epoch: true\nloss: 0.1\nunixtime: 10.0\n"  # would be preferred if listed
LAUGHS = "a: &a ['x','x','x','x','x','x','x','x','x']\n" + "".join(
    f"{b}: &{b} [*{a},*{a},*{a},*{a},*{a},*{a},*{a},*{a},*{a}]\n"
    for a, b in zip("abcdefgh", "bcdefghi", strict=True)
)


def _meta(text: str | bytes) -> Callable[[Path, Path], None]:
    def write(path: Path, sentinel: Path) -> None:
        data = text if isinstance(text, bytes) else f"# yamllint disable\n{text}".encode()
        (path / "CKPT.yaml").write_bytes(data)

    return write


def _link_meta(path: Path, sentinel: Path) -> None:
    link_out(path / "CKPT.yaml", sentinel)


def _link_dir(path: Path, sentinel: Path) -> None:
    link_out(path, sentinel)


def _link_paramfile(path: Path, sentinel: Path) -> None:
    link_out(path / "net.ckpt", sentinel)


def _fifo(name: str) -> Callable[[Path, Path], None]:
    return lambda path, sentinel: replace_by_fifo(path / name)


def _paramfile_dir(path: Path, sentinel: Path) -> None:
    (path / "net.ckpt").unlink()
    (path / "net.ckpt").mkdir()


BAD_SPEECHBRAIN: dict[str, Callable[[Path, Path], None]] = {
    "meta a list": _meta("- 1\n- 2\n"),
    "meta keys not strings": _meta(f"1: 2\n{NEWER_META}"),
    "unixtime a string": _meta("end-of-epoch: true\nunixtime: yesterday\n"),
    "unixtime a bool": _meta("end-of-epoch: true\nunixtime: true\n"),
    "unixtime NaN": _meta("end-of-epoch: true\nunixtime: .nan\n"),
    "unixtime a huge integer": _meta(f"end-of-epoch: true\nunixtime: {HUGE_INT}\n"),
    "unixtime a hex integer too large for a float": _meta(
        f"end-of-epoch: true\nunixtime: 0x{'f' * 400}\n"
    ),
    "unixtime an impossible date": _meta("end-of-epoch: true\nunixtime: 2001-13-45\n"),
    "no unixtime": _meta("end-of-epoch: true\nloss: 0.1\n"),
    "no end-of-epoch": _meta("unixtime: 10.0\n"),
    "deep nesting": _meta(f"{NEWER_META}x: {'[' * 10_000}{']' * 10_000}\n"),
    "an alias bomb": _meta(f"{NEWER_META}{LAUGHS}"),
    "a huge document": _meta(f"{NEWER_META}pad: '{'x' * (2 << 20)}'\n"),
    "not UTF-8": _meta(b"\xff\xfeunixtime: 10.0\n"),
    "a Python object": _meta("unixtime: !!python/object/apply:os.system ['echo pwned']\n"),
    "two documents": _meta(f"{NEWER_META}---\n{NEWER_META}"),
    # a tag the value does not fit: PyYAML raised KeyError, AttributeError, IndexError (issue 42)
    "a bool tag on no bool": _meta("end-of-epoch: !!bool maybe\nunixtime: 10.0\n"),
    "a timestamp tag on no time": _meta(f"{NEWER_META}note: !!timestamp x\n"),
    "an int tag on no int": _meta(f"{NEWER_META}note: !!int _\n"),
    "meta a link": _link_meta,
    "meta a FIFO": _fifo("CKPT.yaml"),
    "the directory a link": _link_dir,
    "paramfile a link": _link_paramfile,
    "paramfile a FIFO": _fifo("net.ckpt"),
    "paramfile a directory": _paramfile_dir,
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(BAD_SPEECHBRAIN))
def test_a_bad_speechbrain_checkpoint_is_skipped_and_the_others_stay_reachable(
    tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    root, sentinel = tmp_path / "ckpts", tmp_path / "sentinel"
    root.mkdir()
    sentinel.mkdir()
    good = speechbrain_checkpoint(root, "2024-01-01+00-00-00+00", GOOD_META, 3.0)
    bad = speechbrain_checkpoint(root, "2024-01-02+00-00-00+00", NEWER_META, 7.0)
    BAD_SPEECHBRAIN[case](bad, sentinel)
    before = snapshot(sentinel)
    model = net(0.0)
    with caplog.at_level(logging.WARNING, logger="cairn"), Checkpointer(root, {"net": model}) as c:
        assert [x.path for x in c.list_checkpoints()] == [good]
        assert [x.path for x in c.find_checkpoints(min_key="loss")] == [good]
        assert c.recover_if_possible() == c.find_checkpoint() == c.list_checkpoints()[0]
        assert torch.all(model.weight == 3.0)
        new = c.save_checkpoint(meta={"loss": 0.25})
        assert c.find_checkpoint() == new
        c.delete_checkpoints(num_to_keep=1)
        assert c.list_checkpoints() == [new]
    assert not good.exists() and os.path.lexists(bad)  # only what was listed is deleted
    assert "skipping" in caplog.text and str(bad) in caplog.text
    assert snapshot(sentinel) == before


def test_a_paramfile_swapped_for_a_link_after_listing_is_refused(tmp_path: Path) -> None:
    root, sentinel = tmp_path / "ckpts", tmp_path / "sentinel"
    root.mkdir()
    sentinel.mkdir()
    speechbrain_checkpoint(root, "2024-01-01+00-00-00+00", GOOD_META, 3.0)
    model = net(0.0)
    with Checkpointer(root, {"net": model}) as c:
        (found,) = c.list_checkpoints()
        link_out(found.paramfiles["net"], sentinel)
        with pytest.raises(CorruptCheckpointError, match="is not a regular file inside it"):
            c.load_checkpoint(found)
    assert torch.all(model.weight == 0.0)


def legacy_paramfile(weight: float) -> bytes:
    """net(weight)'s state dict as torch.save writes it in its legacy (not zip) format."""
    buffer = io.BytesIO()
    torch.save(net(weight).state_dict(), buffer, _use_new_zipfile_serialization=False)
    return buffer.getvalue()


def _other_storage_key(data: bytes) -> bytes:
    match = re.search(rb"Storage\nq.X(.{4})", data, re.DOTALL)  # the weight's storage key
    assert match is not None
    size = int.from_bytes(match[1], "little")
    return data[: match.end()] + b"x" * size + data[match.end() + size :]


def _replace(old: bytes, new: bytes) -> Callable[[bytes], bytes]:
    def edit(data: bytes) -> bytes:
        assert old in data
        return data.replace(old, new, 1)

    return edit


# Truncations and byte edits of a legacy paramfile (weight [2, 2]: 4 floats), each making
# torch.load(weights_only=True) raise an error of its own, which escaped as it was (issue 42).
CRAFTED_PARAMFILES: dict[str, Callable[[bytes], bytes]] = {
    "cut after 1 byte (IndexError)": lambda data: data[:1],
    "cut after 18 bytes (struct.error)": lambda data: data[:18],
    "another storage key (AssertionError)": _other_storage_key,
    "a memo entry never stored (KeyError)": _replace(b"K\x04Nt", b"K\x04h\x63t"),
    "a PROTO opcode among a tensor's arguments (TypeError)": _replace(
        b"QK\x00K\x02K\x02\x86", b"Q\x80\x00K\x02K\x02\x86"
    ),
}


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # the PROTO opcode's
@pytest.mark.parametrize("case", sorted(CRAFTED_PARAMFILES))
def test_a_paramfile_torch_cannot_load_is_corrupt(tmp_path: Path, case: str) -> None:
    path = speechbrain_checkpoint(tmp_path, "2024-01-01+00-00-00+00", GOOD_META, 3.0)
    (path / "net.ckpt").write_bytes(CRAFTED_PARAMFILES[case](legacy_paramfile(3.0)))
    model = net(0.0)
    with (
        Checkpointer(tmp_path, {"net": model}) as c,
        pytest.raises(
            CorruptCheckpointError, match=re.escape(f"{path / 'net.ckpt'}: torch cannot load it")
        ),
    ):
        c.recover_if_possible()
    assert torch.all(model.weight == 0.0)


@pytest.mark.parametrize("meta", [[1, 2], "text", {"unixtime": "now", "end-of-epoch": True}])
def test_a_cairn_checkpoint_with_malformed_meta_is_skipped(
    tmp_path: Path, meta: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The meta of a cairn checkpoint lives in its manifest; one crafted (checksum recomputed)
    to hold something that is not a checkpoint's meta is skipped like a damaged one."""
    with Checkpointer(tmp_path, {"net": net(1.0)}) as c:
        c.save_checkpoint(meta={"loss": 1.0})
        c.save_checkpoint(meta={"loss": 2.0})
    manifest = tmp_path / "CKPT_1" / "_CHECKPOINT.json"
    body = load_checked(manifest.read_bytes(), "test")
    body["metadata"]["meta"] = meta
    manifest.write_bytes(dump_checked(body))
    with caplog.at_level(logging.WARNING, logger="cairn"), Checkpointer(tmp_path, {}) as c:
        assert [x.path.name for x in c.list_checkpoints()] == ["CKPT_0"]
        assert [x.path.name for x in c.find_checkpoints(max_key="loss")] == ["CKPT_0"]
    assert "skipping a damaged checkpoint" in caplog.text


# ---------------------------------------------------------------------------- TensorBoard


def scalar(tag: str, value: float) -> summary_pb2.Summary.Value:
    return summary_pb2.Summary.Value(tag=tag, simple_value=value)


def write_events(logdir: Path, values: list[tuple[int, summary_pb2.Summary.Value]]) -> Path:
    """An event file written by TensorBoard's writer; returns its path."""
    writer = EventFileWriter(str(logdir))
    for step, value in values:
        writer.add_event(
            event_pb2.Event(
                step=step, wall_time=time.time(), summary=summary_pb2.Summary(value=[value])
            )
        )
    writer.close()
    (path,) = logdir.glob("*tfevents*")
    return path


def records(data: bytes) -> list[tuple[int, int]]:
    """(offset, length) of each TFRecord in `data`."""
    out, offset = [], 0
    while offset < len(data):
        (length,) = struct.unpack("<Q", data[offset : offset + 8])
        out.append((offset, length))
        offset += 12 + length + 4
    return out


def masked_crc(data: bytes) -> int:
    crc = crc32c.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record_header(length: int) -> bytes:
    """A record header whose length field passes its checksum."""
    head = struct.pack("<Q", length)
    return head + struct.pack("<I", masked_crc(head))


ACCURACY = {step: step / 10 for step in range(1, 6)}


def _truncate(data: bytes) -> bytes:
    return data[:-5]


def _append_garbage(data: bytes) -> bytes:
    return data + bytes(range(7, 250, 3))


def _flip_in_record_4(data: bytes) -> bytes:
    offset, _ = records(data)[4]  # record 0 is the file-version event, 4 holds step 4
    flipped = bytearray(data)
    flipped[offset + 14] ^= 0x40
    return bytes(flipped)


def _bad_length_crc_in_record_4(data: bytes) -> bytes:
    offset, _ = records(data)[4]
    flipped = bytearray(data)
    flipped[offset + 9] ^= 0x01
    return bytes(flipped)


# corruption -> the steps still read (those before the damage)
CORRUPT_EVENTS: dict[str, tuple[Callable[[bytes], bytes], list[int]]] = {
    "truncated": (_truncate, [1, 2, 3, 4]),
    "garbage appended": (_append_garbage, [1, 2, 3, 4, 5]),
    "a data checksum fails": (_flip_in_record_4, [1, 2, 3]),
    "a length checksum fails": (_bad_length_crc_in_record_4, [1, 2, 3]),
    "a length of 2**60": (lambda d: d + record_header(2**60) + b"x" * 64, [1, 2, 3, 4, 5]),
    "a length of 2**33": (lambda d: d + record_header(2**33) + b"x" * 64, [1, 2, 3, 4, 5]),
}

_READ_IN_A_CHILD = """
import json, resource, sys
from cairn.manager import t5x
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
got = t5x.populate_metrics_for_steps(sys.argv[1], "train/acc", range(100))
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"steps": sorted(got), "grown_kib": grown}))
"""


def read_in_a_child(root: Path) -> dict[str, Any]:
    """populate_metrics_for_steps in a fresh process: a reader that crashes (TensorFlow's record
    reader dies with SIGSEGV on a huge length) fails this test instead of killing pytest."""
    out = subprocess.run(
        [sys.executable, "-c", _READ_IN_A_CHILD, str(root)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    assert "cairn: event file" in out.stderr  # the warning, logged
    return result


@pytest.mark.parametrize("case", sorted(CORRUPT_EVENTS))
def test_a_corrupt_event_file_is_read_up_to_the_damage(tmp_path: Path, case: str) -> None:
    corrupt, steps = CORRUPT_EVENTS[case]
    path = write_events(tmp_path / "train", [(s, scalar("acc", v)) for s, v in ACCURACY.items()])
    path.write_bytes(corrupt(path.read_bytes()))
    result = read_in_a_child(tmp_path)
    assert result["steps"] == steps
    assert result["grown_kib"] < 200 * 1024  # nothing like the length fields' sizes


def test_crafted_summaries_are_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    float32 = 1  # DT_FLOAT
    shape = tensor_shape_pb2.TensorShapeProto
    crafted = [
        (1, scalar("acc", 0.5)),
        (2, scalar("acc", math.nan)),
        (3, scalar("acc", math.inf)),
        # a tensor whose content does not match its dtype
        (4, summary_pb2.Summary.Value(tag="acc", tensor=tensor_pb2.TensorProto(
            dtype=float32, tensor_shape=shape(), tensor_content=b"abc"))),
        # one value repeated over 2**40 elements: never expanded
        (5, summary_pb2.Summary.Value(tag="acc", tensor=tensor_pb2.TensorProto(
            dtype=float32, tensor_shape=shape(dim=[shape.Dim(size=2**40)]), float_val=[1.0]))),
        # text is no metric
        (6, summary_pb2.Summary.Value(tag="acc", tensor=tensor_pb2.TensorProto(
            dtype=7, tensor_shape=shape(), string_val=[b"0.9"]))),
        (7, summary_pb2.Summary.Value(tag="acc", tensor=tensor_pb2.TensorProto(
            dtype=float32, tensor_shape=shape(), float_val=[0.75]))),
    ]  # fmt: skip
    write_events(tmp_path / "train", crafted)
    with caplog.at_level(logging.WARNING, logger="cairn"):
        got = checkpoints.populate_metrics_for_steps(tmp_path, "train/acc", range(10))
    assert got == {1: 0.5, 7: 0.75}
    assert "ignoring 'acc' at step 2" in caplog.text and "ignoring 'acc' at step 3" in caplog.text
    assert "malformed tensor summary" in caplog.text


def test_a_record_that_is_not_an_event_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_events(tmp_path / "train", [(1, scalar("acc", 0.5))])
    garbage = b"\xff" * 20  # a framed record (valid checksums) that does not parse
    with path.open("ab") as f:
        f.write(record_header(len(garbage)) + garbage + struct.pack("<I", masked_crc(garbage)))
    with caplog.at_level(logging.WARNING, logger="cairn"):
        assert checkpoints.populate_metrics_for_steps(tmp_path, "train/acc", [1]) == {1: 0.5}
    assert "not an event" in caplog.text


@pytest.mark.timeout(60)
def test_links_and_fifos_named_like_event_files_are_not_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_events(tmp_path / "train", [(1, scalar("acc", 0.5))])
    outside = write_events(tmp_path / "sentinel", [(2, scalar("acc", 0.9))])
    before = snapshot(tmp_path / "sentinel")
    (tmp_path / "train" / "events.out.tfevents.0.link").symlink_to(outside)
    os.mkfifo(tmp_path / "train" / "events.out.tfevents.0.fifo")
    with caplog.at_level(logging.WARNING, logger="cairn"):
        got = checkpoints.populate_metrics_for_steps(tmp_path, "train/acc", [1, 2])
    assert got == {1: 0.5}
    assert "tfevents.0.link" in caplog.text and "tfevents.0.fifo" in caplog.text
    assert snapshot(tmp_path / "sentinel") == before


def test_an_event_file_replaced_by_another_is_read_afresh(tmp_path: Path) -> None:
    path = write_events(tmp_path / "train", [(1, scalar("acc", 0.5)), (2, scalar("acc", 0.25))])
    got = checkpoints.populate_metrics_for_steps(tmp_path, "train/acc", [1, 2])
    assert got == {1: 0.5, 2: 0.25}
    other = write_events(tmp_path / "other", [(3, scalar("acc", 0.75))] * 4)
    os.replace(other, path)  # same name, another file (another inode), as long or longer
    assert checkpoints.populate_metrics_for_steps(tmp_path, "train/acc", [1, 2, 3]) == {3: 0.75}
