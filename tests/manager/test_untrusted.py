"""A checkpoint directory is untrusted input (issue 17, cases 1-5, 10, 11).

Each test crafts what an attacker who knows docs/format.md can write (manifests re-signed with
their crc32c recomputed, records recomputed to match) and checks that cairn neither touches
anything outside the directory nor returns wrong data: the step is damaged, the others stay
reachable, and a sentinel tree beside the root is byte-for-byte unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from cairn.handlers import JsonHandler, TrainStateHandler
from cairn.handlers.errors import CorruptCheckpointError
from cairn.manager import CheckpointManager, KeepLatest
from cairn.manager._format import dump_checked
from cairn.manager._surfaces.cli import main

# What the zarr layout writes and shares, file by file (tests/handlers/test_packed.py: packs).
pytestmark = pytest.mark.usefixtures("zarr_layout")


def digest_tree(top: Path) -> str:
    """Names, modes and contents of everything under `top` (links not followed)."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(top)):
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath, name)
            h.update(f"{path.relative_to(top)}:{path.lstat().st_mode}".encode())
            if path.is_file() and not path.is_symlink():
                h.update(path.read_bytes())
    return h.hexdigest()


@pytest.fixture
def run(tmp_path: Path) -> tuple[Path, Path]:
    """A run with steps 1 and 2 (a JSON item and a chunked train state), and a sentinel beside it."""
    root, victim = tmp_path / "run", tmp_path / "victim"
    (victim / "sub").mkdir(parents=True)
    (victim / "secret.json").write_text('{"secret": 42}')
    (victim / "sub" / "keep.txt").write_text("keep me")
    handlers = {"cfg": JsonHandler(), "state": TrainStateHandler(chunk_bytes=256, layout="zarr")}
    with CheckpointManager(root, handlers=handlers) as mgr:
        for step in (1, 2):
            state = {
                "mu": np.full((16, 8), step, np.float32),
                "w": np.arange(128.0, dtype=np.float32).reshape(16, 8) * step,
            }
            mgr.save(step, {"cfg": {"lr": 0.1 * step}, "state": state})
    return root, victim


def edit_manifest(root: Path, step: int, edit: Any) -> None:
    path = root / f"checkpoint_{step}" / "_CHECKPOINT.json"
    body = json.loads(path.read_bytes())
    del body["crc32c"]
    edit(body)
    path.write_bytes(dump_checked(body))


def rehash(root: Path, step: int, item: str, relpath: str) -> None:
    """Recompute one file's manifest record from the file as it now is (what an attacker can do)."""
    data = (root / f"checkpoint_{step}" / item / relpath).read_bytes()

    def edit(body: dict[str, Any]) -> None:
        for record in body["items"][item]["files"]:
            if record["path"] == relpath:
                record.update(size=len(data), xxh3_128=xxhash.xxh3_128_hexdigest(data))

    edit_manifest(root, step, edit)


def open_everything(root: Path) -> dict[int, str]:
    """Open writable (start-up clean-up), list, verify and restore every step; what each gave."""
    outcome = {}
    with CheckpointManager(root, keep=KeepLatest(5)) as mgr:
        for step in mgr.all_steps():
            problems = mgr.verify(step)
            try:
                mgr.restore(step)
                outcome[step] = "ok" if not problems else f"verify: {problems}"
            except CorruptCheckpointError as e:
                assert problems, f"restore found damage in step {step} that verify missed: {e}"
                outcome[step] = f"damaged: {e}"
    return outcome


@pytest.mark.parametrize("name", ["../../victim", "..", ".", "../victim", "a/b", ".hidden", ""])
def test_a_dropped_item_name_from_disk_never_deletes_outside(
    run: tuple[Path, Path], name: str
) -> None:
    """Case 1: an item marked dropped under a crafted name makes the step damaged; the start-up
    clean-up of a writable manager removes nothing."""
    root, victim = run
    before = digest_tree(victim), digest_tree(root)
    edit_manifest(
        root,
        2,
        lambda b: b["items"].update(
            {name: {"handler": "cairn.json", "version": 1, "dropped": True, "files": []}}
        ),
    )
    outcome = open_everything(root)
    assert outcome[1] == "ok"
    assert outcome[2].startswith("damaged") and "bad item name" in outcome[2]
    assert digest_tree(victim) == before[0]
    assert (root / "checkpoint_2" / "state" / "tree.json").is_file()  # the step itself is whole


def test_an_item_name_cannot_read_outside_the_step(run: tuple[Path, Path]) -> None:
    """Case 2: an item `../../victim` whose record matches a file outside: damaged, not returned."""
    root, victim = run
    data = (victim / "secret.json").read_bytes()
    edit_manifest(
        root,
        2,
        lambda b: b["items"].update(
            {"../../victim": {"handler": "cairn.json", "version": 1, "dropped": False,
                              "files": [{"path": "secret.json", "size": len(data), "xxh3_128": xxhash.xxh3_128_hexdigest(data)}]}}
        ),
    )  # fmt: skip
    with CheckpointManager(root, read_only=True) as mgr:
        assert mgr.verify(2) and "bad item name" in mgr.verify(2)[0]
        with pytest.raises(CorruptCheckpointError, match="bad item name"):
            mgr.restore(2)
        assert mgr.restore()["cfg"] == {"lr": 0.1}  # falls back to step 1, with a warning logged


@pytest.mark.parametrize(
    "path",
    # "\ud800": a lone surrogate (JSON can escape one) names no file: verify raised
    # UnicodeEncodeError from os.open (found by the fuzz soak)
    ["../../../victim/secret.json", "/etc/hostname", "a//b", "a/./b", "a\x00b", "x\nb", "a\ud800"],
)
def test_a_file_record_cannot_leave_the_item(run: tuple[Path, Path], path: str) -> None:
    root, _ = run
    edit_manifest(root, 2, lambda b: b["items"]["cfg"]["files"][0].update(path=path))
    with CheckpointManager(root, read_only=True) as mgr:
        with pytest.raises(CorruptCheckpointError, match="must be relative"):
            mgr.restore(2)
        problems = mgr.verify(2)
        assert len(problems) == 1 and "must be relative" in str(problems[0])


def test_a_symlinked_lock_file_is_never_followed(run: tuple[Path, Path]) -> None:
    """Case 3: `.cairn.lock` linked to a file elsewhere: the writable open refuses, the target is
    not truncated."""
    root, victim = run
    (root / ".cairn.lock").unlink()
    os.symlink(victim / "secret.json", root / ".cairn.lock")
    before = digest_tree(victim)
    with pytest.raises(CorruptCheckpointError, match=r"\.cairn\.lock is a symbolic link"):
        CheckpointManager(root)
    assert digest_tree(victim) == before
    with CheckpointManager(root, read_only=True) as mgr:  # readers never touch the lock
        assert mgr.all_steps() == [1, 2]


@pytest.mark.timeout(60)
def test_a_fifo_lock_file_is_refused_without_hanging(run: tuple[Path, Path]) -> None:
    root, _ = run
    (root / ".cairn.lock").unlink()
    os.mkfifo(root / ".cairn.lock")
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        CheckpointManager(root)


def chunk_files(root: Path, step: int) -> list[Path]:
    arrays = root / f"checkpoint_{step}" / "state" / "arrays"
    return sorted(p for p in arrays.rglob("*") if p.is_file() and p.name != "zarr.json")


def test_swapped_chunks_of_the_same_size_are_detected(run: tuple[Path, Path]) -> None:
    """Case 4: `mu`'s chunk and `w`'s chunk swapped (same size, each a valid chunk with its own
    crc32c tail): verify names both, restore refuses instead of returning wrong values."""
    root, _ = run
    first, second = chunk_files(root, 2)[0], chunk_files(root, 2)[-1]
    assert first.parent != second.parent and first.stat().st_size == second.stat().st_size
    a, b = first.read_bytes(), second.read_bytes()
    first.write_bytes(b)
    second.write_bytes(a)
    with CheckpointManager(root, read_only=True) as mgr:
        problems = mgr.verify(2)
        assert len(problems) == 2 and all("content hash" in p or "xxh3" in p for p in problems)
        with pytest.raises(CorruptCheckpointError, match="is not the chunk the manifest records"):
            mgr.restore(2, fallback=False)
        with pytest.raises(CorruptCheckpointError, match="is not the chunk"):
            mgr.restore(2)


def test_a_stale_chunk_from_another_step_is_detected(run: tuple[Path, Path]) -> None:
    root, _ = run
    for old, new in zip(chunk_files(root, 1), chunk_files(root, 2), strict=True):
        shutil.copyfile(old, new)  # every chunk of step 2 replaced by step 1's
    with CheckpointManager(root, read_only=True) as mgr:
        assert len(mgr.verify(2)) == len(chunk_files(root, 2))
        with pytest.raises(CorruptCheckpointError, match="is not the chunk"):
            mgr.restore(2, fallback=False)
        assert mgr.restore()["state"]["mu"][0, 0] == 1  # the intact step 1, not step 2's chunks


def edit_tree(root: Path, step: int, edit: Any) -> None:
    path = root / f"checkpoint_{step}" / "state" / "tree.json"
    tree = json.loads(path.read_bytes())
    edit(tree)
    path.write_text(json.dumps(tree))
    rehash(root, step, "state", "tree.json")


def first_leaf(tree: dict[str, Any]) -> dict[str, Any]:
    leaf: dict[str, Any] = tree["c"][0]
    return leaf


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda leaf: leaf.update(shape=[-16, 8]), "shape"),
        (lambda leaf: leaf.update(shape=[2**40, 8]), "zarr.json"),
        (lambda leaf: leaf.update(shape=[2**40, 8], chunk=[2**40, 8]), "zarr.json"),
        (lambda leaf: leaf.update(shape=[16, 8, 1]), "chunk"),
        (lambda leaf: leaf.update(dtype="|O"), "not a stored dtype"),
        (lambda leaf: leaf.update(dtype="<U8"), "not a stored dtype"),
        (lambda leaf: leaf.update(dtype=["<f4"]), "not a stored dtype"),
        (lambda leaf: leaf.update(dtype="<f8"), "zarr.json"),
        (lambda leaf: leaf.update(f="../../../victim"), "must be relative"),
        (lambda leaf: leaf.update(t="bogus"), "unknown node type"),
        (lambda leaf: leaf.update(chunk=[1, 8]), "zarr.json"),
        (lambda leaf: leaf.pop("shape"), "shape"),
    ],
)
def test_array_metadata_from_disk_is_checked_before_allocating(
    run: tuple[Path, Path], edit: Any, message: str
) -> None:
    """Case 5: tree.json edits (records recomputed): CorruptCheckpointError naming the problem,
    never an empty array, a raw TypeError, or an allocation beyond the files' sizes."""
    root, _ = run
    edit_tree(root, 2, lambda tree: edit(first_leaf(tree)))
    with CheckpointManager(root, read_only=True) as mgr:
        tracemalloc.start()
        try:
            with pytest.raises(CorruptCheckpointError, match=message):
                mgr.restore(2, fallback=False)
            problems = mgr.verify(2)  # every file matches its record; the handler's check tells
            assert [p for p in problems if re.search(message, p)], problems
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
    assert peak < 16 << 20


@pytest.mark.parametrize("dtype", ["(1,2", "(9e9,)f"])
def test_a_dtype_numpy_cannot_parse_is_damage(
    run: tuple[Path, Path], dtype: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 42: NumPy's parser raises SyntaxError for these; from tree.json that came out of
    restore and describe raw, `restore()` did not fall back past the step, and `cairn show`
    printed "error: SyntaxError". Now it is damage naming the file, as any dtype off the list."""
    root, _ = run
    edit_tree(root, 2, lambda tree: first_leaf(tree).update(dtype=dtype))
    tree_json = str(root / "checkpoint_2" / "state" / "tree.json")
    with CheckpointManager(root, read_only=True) as mgr:
        for call in (lambda: mgr.restore(2, fallback=False), lambda: mgr.describe(2)):
            with pytest.raises(CorruptCheckpointError, match="not a stored dtype") as info:
                call()
            assert tree_json in str(info.value)
        assert mgr.restore()["state"]["mu"][0, 0] == 1  # the intact step 1
        assert [p for p in mgr.verify(2) if tree_json in p and "not a stored dtype" in p]
    assert main(["show", str(root), "2"]) == 2
    assert "not a stored dtype" in capsys.readouterr().err


def edit_zarr_json(root: Path, edit: Any) -> None:
    path = root / "checkpoint_2" / "state" / "arrays" / "0" / "zarr.json"
    meta = json.loads(path.read_bytes())
    edit(meta)
    path.write_text(json.dumps(meta))
    rehash(root, 2, "state", "arrays/0/zarr.json")


def test_zarr_json_must_describe_the_leaf(run: tuple[Path, Path]) -> None:
    root, _ = run
    edit_zarr_json(root, lambda meta: meta.update(shape=[2**40, 8]))
    with (
        CheckpointManager(root, read_only=True) as mgr,
        pytest.raises(CorruptCheckpointError, match="does not describe the leaf"),
    ):
        mgr.restore(2, fallback=False)


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ([2**40, 8], "the leaf has 137438953472 chunks"),
        ([24, 8], r"arrays/0/2\.0 \(leaf \['mu'\]\) is not listed"),
    ],
)
def test_a_shape_larger_than_the_files_is_refused(
    run: tuple[Path, Path], shape: list[int], message: str
) -> None:
    """tree.json and zarr.json agree on a larger shape: the chunk grid must be in the manifest."""
    root, _ = run
    edit_zarr_json(root, lambda meta: meta.update(shape=shape))
    edit_tree(root, 2, lambda tree: first_leaf(tree).update(shape=shape))
    with CheckpointManager(root, read_only=True) as mgr:
        tracemalloc.start()
        try:
            with pytest.raises(CorruptCheckpointError, match=message):
                mgr.restore(2, fallback=False)
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
    assert peak < 16 << 20


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "relpath",
    ["_CHECKPOINT.json", "metrics.json", "cfg/data.json", "state/tree.json", "state/arrays/0/0.0"],
)
def test_a_fifo_in_place_of_a_file_never_hangs(run: tuple[Path, Path], relpath: str) -> None:
    """Case 10: a FIFO named like a file cairn reads: the step is damaged (or metrics.json is
    ignored), nothing blocks in open()."""
    root, _ = run
    path = root / "checkpoint_2" / relpath
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    with CheckpointManager(root, read_only=True) as mgr:
        assert mgr.all_steps() == [1, 2]
        if relpath == "metrics.json":
            assert mgr.restore(2)["cfg"] == {"lr": 0.2}
            return
        assert any("not a regular file" in p for p in mgr.verify(2))
        with pytest.raises(CorruptCheckpointError, match="not a regular file"):
            mgr.restore(2, fallback=False)
        assert mgr.restore()["cfg"] == {"lr": 0.1}


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "edit",
    [
        lambda b: b.update(started_at=float("inf")),
        lambda b: b.update(committed_at=float("nan")),
        lambda b: b.update(started_at=10**400),
        lambda b: b.update(step=2.0),
        lambda b: b.update(step=True),
        lambda b: b.update(metrics={"loss": 10**400}),
        lambda b: b.update(metrics=["loss"]),
        lambda b: b.update(metadata=nested(50_000)),
        lambda b: b.update(items=[]),
        lambda b: b["items"]["cfg"].update(version="1"),
        lambda b: b["items"]["cfg"].update(dropped="no"),
        lambda b: b["items"]["cfg"]["files"].append(b["items"]["cfg"]["files"][0]),
        lambda b: b["items"]["cfg"]["files"][0].update(size=-1),
        lambda b: b["items"]["cfg"]["files"][0].pop("xxh3_128"),
        lambda b: b["items"]["cfg"]["files"][0].update(xxh3_128="zz"),
    ],
)
def test_malformed_manifests_make_one_step_damaged(run: tuple[Path, Path], edit: Any) -> None:
    """Case 11: deep nesting, huge integers, non-finite values, wrong types: that step is damaged,
    never an exception out of opening the directory."""
    root, _ = run
    path = root / "checkpoint_2" / "_CHECKPOINT.json"
    body = json.loads(path.read_bytes())
    del body["crc32c"]
    edit(body)
    try:
        path.write_bytes(dump_checked(body))
    except (RecursionError, ValueError):  # json cannot write it; the raw text can still be crafted
        path.write_text("[" * 50_000 + "]" * 50_000)
    with CheckpointManager(root, read_only=True) as mgr:
        assert mgr.all_steps() == [1, 2]
        with pytest.raises(CorruptCheckpointError):
            mgr.info(2)
        assert mgr.restore()["cfg"] == {"lr": 0.1}
    assert open_everything(root)[1] == "ok"


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000 + "]" * 100_000,
        '{"metrics": {"a": 1' + "0" * 5000 + '}, "crc32c": 1}',
        '{"metrics": {"a": NaN}, "crc32c": 1}',
        "\xff\xfe garbage",
    ],
)
def test_unreadable_late_metrics_are_ignored_with_a_warning(
    run: tuple[Path, Path], text: str, caplog: pytest.LogCaptureFixture
) -> None:
    root, _ = run
    (root / "checkpoint_2" / "metrics.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    with CheckpointManager(root, read_only=True) as mgr:
        assert mgr.metrics(2) == {}
        assert mgr.restore()["cfg"] == {"lr": 0.2}
    assert "metrics.json" in caplog.text
