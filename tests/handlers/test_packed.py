"""The packed layout of a train state (``TrainStateHandler(layout="packed")``): chunks in a few
pack files, found through per-process index files, each chunk checked by its own content hash."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import threading
import uuid
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.treeutil import assert_tree_equal
from test_train_state import VIEWS

from cairn.handlers import TrainStateHandler, TrainStateRestore
from cairn.handlers import _packs as packs_impl
from cairn.handlers._files import LocalDestination
from cairn.handlers._packs import PACK_BYTES, group, group_staged
from cairn.handlers._staging import PAGE, StagingPool, staging_for
from cairn.handlers._train_state.staging import _stage_layout
from cairn.handlers._train_state.threads import _Tickets
from cairn.handlers.errors import CorruptCheckpointError
from cairn.manager import CheckpointManager
from cairn.manager._format import dump_checked


def packed(**options: Any) -> dict[str, TrainStateHandler]:
    return {"state": TrainStateHandler(layout="packed", **options)}


def sample(step: int = 1) -> dict[str, Any]:
    return {
        "params": {
            "w": jnp.arange(1 << 16, dtype=jnp.float32).reshape(256, 256) * step,
            "b": jnp.full(7, step, jnp.bfloat16),
            "i4": np.arange(12, dtype=np.int8).astype(ml_dtypes.int4),
        },
        "opt": (np.float32(step), jnp.zeros((0, 3)), np.ones((3, 5), np.complex64)),
        "step": step,
        "flag": np.bool_(True),
    }


def host(tree: Any) -> Any:
    return jax.tree.map(np.asarray, tree)


def manifest(root: Path, step: int) -> dict[str, Any]:
    return json.loads((root / f"checkpoint_{step}" / "_CHECKPOINT.json").read_bytes())


def item_files(root: Path, step: int) -> list[str]:
    base = root / f"checkpoint_{step}" / "state"
    return sorted(str(p.relative_to(base)) for p in base.rglob("*") if not p.is_dir())


@pytest.mark.parametrize("zero_copy", [False, True])
def test_round_trip_views_and_staged(tmp_path: Path, zero_copy: bool) -> None:
    """Step 1 is written from views (the pool warms), step 2 from the staging pool, or both
    from views with zero_copy=True; every dtype comes back equal, in a few files. (On a GPU the
    jax leaves' host copies are written as they are, the NumPy leaves from the pool: a pack
    each.)"""
    packs = 1 if VIEWS or zero_copy else 2
    with CheckpointManager(tmp_path, handlers=packed(chunk_bytes=8192), zero_copy=zero_copy) as m:
        for step in (1, 2):
            m.save(step, {"state": sample(step)})
            m.wait_until_finished()
        for step in (1, 2):
            assert_tree_equal(host(m.restore(step)["state"]), host(sample(step)))
            assert m.verify(step) == []
            files = item_files(tmp_path, step)
            assert not any(f.startswith("arrays/") for f in files)
            assert files[-2:] == ["packs/index.0.json", "tree.json"] and len(files) == 2 + packs
            entry = manifest(tmp_path, step)["items"]["state"]
            assert (entry["handler"], entry["version"]) == ("cairn.train_state", 2)


def test_a_zarr_step_and_a_packed_step_side_by_side(tmp_path: Path) -> None:
    """Either handler reads both layouts; the zarr layout is still written as version 1."""
    zarr = {"state": TrainStateHandler(layout="zarr")}
    with CheckpointManager(tmp_path, handlers=zarr) as m:
        m.save(1, {"state": sample(1)})
    with CheckpointManager(tmp_path, handlers=packed()) as m:
        m.save(2, {"state": sample(2)})
        m.wait_until_finished()
        assert_tree_equal(host(m.restore(1)["state"]), host(sample(1)))
    with CheckpointManager(tmp_path, handlers=zarr) as m:
        assert_tree_equal(host(m.restore(2)["state"]), host(sample(2)))
    assert TrainStateHandler().layout == "packed"  # the default
    assert manifest(tmp_path, 1)["items"]["state"]["version"] == 1
    assert manifest(tmp_path, 2)["items"]["state"]["version"] == 2


def test_chunks_go_into_packs_of_at_most_pack_bytes() -> None:
    assert group([("a", 10), ("b", 10), ("c", PACK_BYTES), ("d", 1)]) == [["a", "b"], ["c"], ["d"]]
    assert group([("a", PACK_BYTES - 4096), ("b", 4096), ("c", 1)]) == [["a", "b"], ["c"]]
    assert group([]) == []


def test_a_large_state_is_a_few_large_files(tmp_path: Path) -> None:
    state = {f"w{i}": np.full((1 << 18) + i, i, np.float32) for i in range(200)}  # 200 MiB
    with CheckpointManager(tmp_path, handlers=packed()) as m:
        m.save(1, {"state": state})
        m.save(2, {"state": state})  # staged: packs are spans of the pool, O_DIRECT
        m.wait_until_finished()
        for step in (1, 2):
            files = item_files(tmp_path, step)
            packs = [f for f in files if not f.endswith(".json")]
            assert 4 <= len(packs) <= 5, files  # 200 MiB in packs of at most 64 MiB
            assert all(
                os.path.getsize(tmp_path / f"checkpoint_{step}/state" / p) <= PACK_BYTES
                for p in packs
            )
        got = m.restore(2)["state"]
        for i in (0, 77, 199):
            np.testing.assert_array_equal(got[f"w{i}"], state[f"w{i}"])


def test_small_chunks_are_packed_tight(tmp_path: Path) -> None:
    """Staged chunks follow each other from 64-byte boundaries: 3,000 leaves of 64 bytes take
    about their bytes on disk, not a 4 KiB page each (12 MB)."""
    state = {f"b{i}": np.full(16, i, np.float32) for i in range(3000)}
    state["w"] = np.arange(1 << 18, dtype=np.float32)  # 1 MiB
    data = sum(a.nbytes for a in state.values())
    with CheckpointManager(tmp_path, handlers=packed()) as m:
        m.save(1, {"state": state})
        m.save(2, {"state": state})  # staged in the pool
        m.wait_until_finished()
        base = tmp_path / "checkpoint_2" / "state"
        packs = [p for p in item_files(tmp_path, 2) if not p.endswith(".json")]
        on_disk = sum(os.path.getsize(base / p) for p in packs)
        assert data <= on_disk < data + 64 * len(state), (data, on_disk)
        got = m.restore(2)["state"]
        assert m.verify(2) == []
    for key in ("b0", "b1234", "b2999", "w"):
        np.testing.assert_array_equal(got[key], state[key])


def test_staged_packs_start_on_pages_and_hold_at_most_pack_bytes() -> None:
    """Where staging puts chunks (tight, 64-byte aligned) and how the write groups them agree:
    every pack of the slab starts on a page, so it goes to the disk with O_DIRECT."""
    rng = np.random.default_rng(5)
    sizes = [int(n) for n in rng.integers(1, 3 << 20, 120)] + [PACK_BYTES + 3, 7, 70 << 20, 5]
    state = {f"x{i:03d}": np.zeros(n, np.uint8) for i, n in enumerate(sizes)}
    snap = TrainStateHandler(chunk_bytes=PACK_BYTES * 2).snapshot(state)
    placed, total = _stage_layout(snap._leaves, packed=True)
    chunks = [(f"{leaf.index}/{key}", at, n) for leaf, key, _, at, n in placed]
    assert all(at % 64 == 0 for _, at, _ in chunks)
    assert total == chunks[-1][1] + chunks[-1][2]
    slack = sum(b[1] - (a[1] + a[2]) for a, b in itertools.pairwise(chunks))
    packs = group_staged(chunks, PACK_BYTES)
    assert len(packs) > 1 and [c for p in packs for c in p] == chunks
    assert slack < 64 * len(chunks) + PAGE * len(packs)
    for pack in packs:
        first, last = pack[0], pack[-1]
        assert first[1] % PAGE == 0, first
        assert last[1] + last[2] - first[1] <= PACK_BYTES or len(pack) == 1


def test_a_staged_pack_reads_the_slab_and_never_writes_it() -> None:
    """One snapshot feeds the writers of both tiers at once, and their chunks differ: a local
    tier's part holds a replicated leaf that another process writes to the persistent tier. A
    pack that leaves out a chunk lying between two of its own spans its bytes as the slab holds
    them, and changes no byte of the slab (it once zeroed them under the other writer: a
    process's local part of a step both tiers saved held zeros, or failed its hash)."""
    slab = np.arange(1, 513, dtype=np.uint16).astype(np.uint8)  # no zero byte to hide in
    chunks = [("a", 0, 40), ("b", 64, 36), ("c", 128, 200)]
    before = slab.copy()
    some = packs_impl.staged_pack(slab, [chunks[0], chunks[2]])
    every = packs_impl.staged_pack(slab, chunks)
    assert np.array_equal(slab, before)
    assert some.chunks == [("a", 0, 40), ("c", 128, 200)] and every.chunks == chunks
    for pack in (some, every):
        assert b"".join(bytes(p) for p in pack.pieces) == before[:328].tobytes()


def test_staging_zeroes_the_bytes_between_chunks_that_an_earlier_save_left(
    tmp_path: Path,
) -> None:
    """The slab a save stages into holds what the last save left; the bytes between two chunks
    (alignment) are zeroed as the chunks are copied in, so a pack's bytes are the state's alone
    (the same state gives the same pack), whatever the slab held."""
    state = {f"x{i}": np.full(10 + i, i + 1, np.uint8) for i in range(6)}  # 10-15 bytes each
    handler = TrainStateHandler(layout="packed")
    pool = StagingPool()

    def staged(where: str) -> tuple[np.ndarray, bytes]:
        with staging_for(pool, "state"):
            snap = handler.snapshot(state)
        assert snap._lease is not None
        slab = snap._lease.slab.array
        written = snap.write(tmp_path / where)
        (pack,) = [r.path for r in written if r.path.startswith("packs/0.")]
        return slab, (tmp_path / where / pack).read_bytes()

    slab, first = staged("first")
    assert first.count(0) >= 5 * (64 - 15)  # the alignment between the six chunks
    slab[:] = 0xAB  # an earlier save's bytes
    again, second = staged("second")
    assert again is slab and second == first


def damage(root: Path, step: int, vpath: str) -> str:
    """Flip a byte of one chunk inside its pack; the pack's name."""
    base = root / f"checkpoint_{step}" / "state"
    pack, offset, nbytes, _ = json.loads((base / "packs/index.0.json").read_bytes())["chunks"][
        vpath
    ]
    with open(base / pack, "r+b") as f:
        f.seek(offset + nbytes // 2)
        byte = f.read(1)
        f.seek(offset + nbytes // 2)
        f.write(bytes([byte[0] ^ 0x10]))
    return pack


def test_a_damaged_chunk_is_named_and_the_others_still_restore(tmp_path: Path) -> None:
    """Each chunk is checked by its own hash: a partial restore that does not read the damaged
    chunk succeeds, one that does fails naming the chunk and its pack, and verify names the pack."""
    with CheckpointManager(tmp_path, handlers=packed(chunk_bytes=8192)) as m:
        m.save(1, {"state": sample(1)})
        m.wait_until_finished()
        tree = json.loads((tmp_path / "checkpoint_1/state/tree.json").read_bytes())
        w = tree["c"][0]["c"][tree["c"][0]["k"].index("w")]["f"]
        pack = damage(tmp_path, 1, f"{w}/3.0")
        opts = TrainStateRestore(where=lambda path: path[-1] != "w")
        got = m.restore(1, {"state": opts})["state"]
        np.testing.assert_array_equal(got["opt"][2], sample(1)["opt"][2])
        with pytest.raises(CorruptCheckpointError, match=rf"{pack}, chunk {w}/3\.0 .*content hash"):
            m.restore(1)
        problems = m.verify(1)
        assert len(problems) == 1 and pack in str(problems[0])


def edit_index(root: Path, step: int, edit: Any) -> None:
    """Rewrite process 0's index and give it a matching manifest record (what a crafter can)."""
    base = root / f"checkpoint_{step}"
    path = base / "state/packs/index.0.json"
    index = json.loads(path.read_bytes())
    edit(index["chunks"])
    data = json.dumps(index).encode()
    path.write_bytes(data)
    body = json.loads((base / "_CHECKPOINT.json").read_bytes())
    del body["crc32c"]
    for record in body["items"]["state"]["files"]:
        if record["path"] == "packs/index.0.json":
            record.update(size=len(data), xxh3_128=xxhash.xxh3_128_hexdigest(data))
    (base / "_CHECKPOINT.json").write_bytes(dump_checked(body))


def _first(chunks: dict[str, Any]) -> list[Any]:
    return chunks[max(chunks, key=lambda k: chunks[k][2])]  # the largest chunk


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: _first(c).__setitem__(1, 1 << 40), "outside"),
        (lambda c: _first(c).__setitem__(1, -1), "not a byte count"),
        (lambda c: _first(c).__setitem__(2, True), "not a byte count"),
        (lambda c: _first(c).__setitem__(2, 3), "indexed with 3 bytes"),
        (lambda c: _first(c).__setitem__(0, "../../../outside"), "is not a pack"),
        (lambda c: _first(c).__setitem__(0, "tree.json"), "is not a pack"),
        (lambda c: _first(c).__setitem__(0, "packs/index.0.json"), "is not a pack"),
        (lambda c: _first(c).__setitem__(0, "packs/nope"), "not in the manifest"),
        (lambda c: _first(c).__setitem__(3, "0" * 31), "hex digest"),
        (lambda c: _first(c).__setitem__(3, "0" * 32), "content hash differs"),
        (lambda c: _first(c).pop(), r"not \[pack"),
        (lambda c: c.pop(max(c, key=lambda k: c[k][2])), "not indexed"),
        (lambda c: c.clear(), "chunks, the index lists 0"),
    ],
)
def test_a_crafted_index_is_refused_and_nothing_changes(
    tmp_path: Path, edit: Any, message: str
) -> None:
    with CheckpointManager(tmp_path, handlers=packed()) as m:
        m.save(1, {"state": sample(1)})
    edit_index(tmp_path, 1, edit)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with (
        CheckpointManager(tmp_path, handlers=packed()) as m,
        pytest.raises(CorruptCheckpointError, match=message),
    ):
        m.restore(1)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_a_second_index_that_lists_a_chunk_again_is_refused(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, handlers=packed()) as m:
        m.save(1, {"state": sample(1)})
    base = tmp_path / "checkpoint_1"
    data = (base / "state/packs/index.0.json").read_bytes()
    (base / "state/packs/index.1.json").write_bytes(data)
    body = json.loads((base / "_CHECKPOINT.json").read_bytes())
    del body["crc32c"]
    files = body["items"]["state"]["files"]
    files.append(
        {
            **next(f for f in files if f["path"] == "packs/index.0.json"),
            "path": "packs/index.1.json",
        }
    )
    (base / "_CHECKPOINT.json").write_bytes(dump_checked(body))
    with (
        CheckpointManager(tmp_path, handlers=packed()) as m,
        pytest.raises(CorruptCheckpointError, match="listed twice"),
    ):
        m.restore(1)


def test_incremental_saves_link_whole_packs(tmp_path: Path) -> None:
    """An unchanged jax array's chunks stay in the previous step's pack, which the new step
    links; a pack still used for less than half its bytes is not linked: its unchanged chunks
    are written again, so no step keeps a pack mostly for what no step uses."""
    frozen = jnp.arange(1 << 20, dtype=jnp.float32)  # 4 MiB
    with CheckpointManager(tmp_path, incremental=True, handlers=packed()) as m:
        for step in (1, 2, 3):
            m.save(step, {"state": {"frozen": frozen, "lora": jnp.full(1000, float(step))}})
            m.wait_until_finished()
        base = m.info(1).items["state"].files[0]
        for step in (2, 3):
            files = m.info(step).items["state"].files
            assert base in files and len(files) == 4  # step 1's pack, its own, index, tree
            assert (
                os.lstat(tmp_path / f"checkpoint_{step}/state/{base}").st_ino
                == os.lstat(tmp_path / f"checkpoint_1/state/{base}").st_ino
            )
            tm = m.info(step).telemetry
            assert tm["bytes_written"] < 0.002 * tm["bytes"]
        # Now the big leaf changes and the small one stays: step 1's pack is no longer used.
        small = jnp.full(1000, 3.0)
        m.save(4, {"state": {"frozen": frozen + 1, "lora": small}})
        m.save(5, {"state": {"frozen": frozen + 2, "lora": small}})
        m.wait_until_finished()
        assert base not in m.info(5).items["state"].files
        for step in (1, 2, 3, 4, 5):
            got = host(m.restore(step)["state"])
            assert m.verify(step) == []
            assert got["lora"][0] == min(step, 3)
        m.delete(1)
        assert_tree_equal(
            host(m.restore(3)["state"]), host({"frozen": frozen, "lora": jnp.full(1000, 3.0)})
        )


def test_a_pack_mostly_unused_is_not_linked(tmp_path: Path) -> None:
    big = jnp.zeros(1 << 20, jnp.float32)  # 4 MiB, changes every save
    frozen = jnp.arange(1000, dtype=jnp.float32)  # 4 KB, never changes
    with CheckpointManager(tmp_path, incremental=True, handlers=packed()) as m:
        for step in (1, 2):
            m.save(step, {"state": {"big": big + step, "frozen": frozen}})
            m.wait_until_finished()
        one, two = (set(m.info(s).items["state"].files) for s in (1, 2))
        assert not (one & two) - {"packs/index.0.json", "tree.json"}  # nothing linked
        np.testing.assert_array_equal(
            np.asarray(m.restore(2)["state"]["frozen"]), np.asarray(frozen)
        )


def test_a_damaged_pack_of_the_previous_step_is_not_linked(tmp_path: Path) -> None:
    frozen = jnp.arange(1 << 18, dtype=jnp.float32)
    with CheckpointManager(tmp_path, incremental=True, handlers=packed()) as m:
        m.save(1, {"state": {"frozen": frozen}})
        m.wait_until_finished()
    damage(tmp_path, 1, "arrays/0/0")
    with CheckpointManager(tmp_path, incremental=True, handlers=packed()) as m:  # hashes first
        m.save(2, {"state": {"frozen": frozen}})
        m.wait_until_finished()
        assert not set(m.info(1).items["state"].files) & set(m.info(2).items["state"].files) - {
            "packs/index.0.json",
            "tree.json",
        }
        np.testing.assert_array_equal(
            np.asarray(m.restore(2)["state"]["frozen"]), np.asarray(frozen)
        )
        assert m.verify(2) == [] and m.verify(1) != []


def test_save_dtype_in_packs(tmp_path: Path) -> None:
    tree = {"w": np.linspace(0, 1, 1 << 18, dtype=np.float32), "n": np.arange(5)}
    handlers = packed(save_dtype=jnp.bfloat16, max_inflight_bytes=1 << 20, threads=3)
    with CheckpointManager(tmp_path, handlers=handlers) as m:
        m.save(1, {"state": tree})
        m.wait_until_finished()
        got = m.restore(1, {"state": TrainStateRestore(tree)})["state"]
        np.testing.assert_array_equal(got["w"], tree["w"].astype(jnp.bfloat16).astype(np.float32))
        np.testing.assert_array_equal(got["n"], tree["n"])


def test_tickets_are_taken_all_at_once() -> None:
    """Casts in flight take their megabytes at once: a writer that needs all of them waits until
    the other gives its share back, and never holds part while it waits (the old semaphore loop
    could leave two writers each holding half, waiting for each other)."""
    tickets = _Tickets(2)
    entered = threading.Event()

    def take_two() -> None:
        with tickets.taking(2):
            entered.set()

    with tickets.taking(1):
        thread = threading.Thread(target=take_two)
        thread.start()
        assert not entered.wait(0.2)  # waits for the held ticket
        with tickets.taking(1):  # the other ticket is still free: the waiter holds none
            pass
    thread.join(10)
    assert entered.is_set()


def test_the_layout_option_is_checked() -> None:
    with pytest.raises(ValueError, match="layout must be 'zarr' or 'packed', got 'flat'"):
        TrainStateHandler(layout="flat")
    assert "layout='zarr'" in repr(TrainStateHandler(layout="zarr"))
    assert "layout" not in repr(TrainStateHandler())  # the default


def test_packed_on_s3(s3_bucket: str) -> None:
    """On an object store: packs are objects, a restore reads each chunk with a ranged GET, and
    an incremental save copies the unchanged pack on the server."""
    url = f"{s3_bucket}/packed"
    frozen = jnp.arange(1 << 18, dtype=jnp.float32)
    with CheckpointManager(url, incremental=True, handlers=packed(chunk_bytes=1 << 16)) as m:
        for step in (1, 2):
            m.save(step, {"state": {"frozen": frozen, "lora": jnp.full(10, float(step))}})
            m.wait_until_finished()
        assert m.info(1).items["state"].files[0] in m.info(2).items["state"].files
        tm = m.info(2).telemetry
        assert tm["bytes_written"] < 0.01 * tm["bytes"]
        for step in (1, 2):
            got = host(m.restore(step)["state"])
            np.testing.assert_array_equal(got["frozen"], np.asarray(frozen))
            assert got["lora"][0] == step
            assert m.verify(step) == []


def test_packed_with_the_writer_process(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, handlers=packed(), writer="process") as m:
        for step in (1, 2):  # 2: staged in shared memory, written by the writer process
            m.save(step, {"state": sample(step)})
            m.wait_until_finished()
        for step in (1, 2):
            assert_tree_equal(host(m.restore(step)["state"]), host(sample(step)))
            assert m.info(step).items["state"].files[-2:] == ("packs/index.0.json", "tree.json")
            assert manifest(tmp_path, step)["items"]["state"]["version"] == 2


def test_incremental_numpy_leaves_are_kept_by_their_content(tmp_path: Path) -> None:
    """NumPy leaves are copied in save(): an unchanged one is found by the hash of its bytes
    against what the previous save recorded for the chunk, and its pack is linked."""
    frozen = np.arange(1 << 20, dtype=np.float32)  # 4 MiB
    with CheckpointManager(tmp_path, incremental=True, handlers=packed()) as m:
        for step in (1, 2, 3):
            m.save(step, {"state": {"frozen": frozen.copy(), "w": np.full(4, step)}})
            m.wait_until_finished()
        for step in (2, 3):
            tm = m.info(step).telemetry
            assert tm["bytes_written"] < 0.01 * tm["bytes"], tm
        one = set(m.info(1).items["state"].files)
        shared = one & set(m.info(3).items["state"].files) - {"packs/index.0.json", "tree.json"}
        assert len(shared) == 1  # step 1's pack
        for step in (1, 2, 3):
            got = m.restore(step)["state"]
            np.testing.assert_array_equal(got["frozen"], frozen)
            assert got["w"][0] == step and m.verify(step) == []


def test_a_restarted_process_links_against_the_committed_index(tmp_path: Path) -> None:
    """A new manager (a restarted trainer) has no memory of the last save: it reads the newest
    committed step's index, hashes the chunks it recorded, and links the pack all the same."""
    frozen = np.arange(1 << 20, dtype=np.float32)
    for step in (1, 2):
        with CheckpointManager(tmp_path, incremental=True) as m:
            m.save(step, {"state": {"frozen": frozen, "w": np.full(4, step)}})
    with CheckpointManager(tmp_path) as m:
        tm = m.info(2).telemetry
        assert tm["bytes_written"] < 0.01 * tm["bytes"], tm
        np.testing.assert_array_equal(m.restore(2)["state"]["frozen"], frozen)


@pytest.mark.parametrize("zero_copy", [False, True], ids=["pool", "views"])
def test_incremental_with_save_dtype_and_keep_items(tmp_path: Path, zero_copy: bool) -> None:
    """A frozen float32 leaf saved as bfloat16 (cast into the pool, or, from views, cast a
    piece at a time to be hashed: every save on a GPU) matches the previous step's chunk by the
    hash of its cast bytes; per-item retention drops the item from the step whose pack a newer
    step links, and the newer step still restores."""
    from cairn.manager import KeepLatest

    frozen = jnp.linspace(0, 1, 1 << 21, dtype=jnp.float32)  # 8 MiB, 4 MiB as bfloat16
    handlers = packed(save_dtype=jnp.bfloat16)
    with CheckpointManager(
        tmp_path,
        incremental=True,
        handlers=handlers,
        keep_items={"state": KeepLatest(1)},
        zero_copy=zero_copy,
    ) as m:
        for step in (1, 2, 3):
            m.save(step, {"state": {"frozen": frozen * 1, "w": jnp.full(4, float(step))}})
            m.wait_until_finished()
        tm = m.info(3).telemetry
        assert tm["bytes_written"] < 0.01 * tm["bytes"], tm
        assert m.info(1).items["state"].dropped and m.info(2).items["state"].dropped
        got = m.restore(3, {"state": TrainStateRestore({"frozen": frozen, "w": frozen[:4]})})
        want = np.asarray(frozen.astype(jnp.bfloat16).astype(jnp.float32))
        np.testing.assert_array_equal(np.asarray(got["state"]["frozen"]), want)
        assert m.verify(3) == []


def test_a_cairn_that_reads_only_the_zarr_layout_refuses_a_packed_item(tmp_path: Path) -> None:
    """What an older cairn (train-state version 1) does with a packed step: it refuses it by
    the version the manifest records, and still reads a zarr-layout step."""
    from cairn.manager import UnsupportedFormatError

    class Older(TrainStateHandler):
        version = 1

    with CheckpointManager(tmp_path) as m:
        m.save(1, {"state": sample(1)})
    with CheckpointManager(tmp_path, handlers={"state": TrainStateHandler(layout="zarr")}) as m:
        m.save(2, {"state": sample(2)})
    with CheckpointManager(tmp_path, handlers={"state": Older()}) as m:
        with pytest.raises(UnsupportedFormatError, match="version 2; this cairn has version 1"):
            m.restore(1)
        assert_tree_equal(host(m.restore(2)["state"]), host(sample(2)))


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    sizes=st.lists(st.tuples(st.integers(0, 300), st.integers(0, 70)), min_size=1, max_size=12),
    window=st.sampled_from([1, 7, 64, 4096]),
    gil_slice=st.sampled_from([1, 5, 64 << 10]),
    hold_up_to=st.sampled_from([0, 150, 1 << 30]),
    staged=st.booleans(),
    known=st.sets(st.integers(0, 11)),
)
def test_the_hash_pass_gives_each_chunk_and_the_pack_their_own_hashes(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    sizes: list[tuple[int, int]],
    window: int,
    gil_slice: int,
    hold_up_to: int,
    staged: bool,
    known: set[int],
) -> None:
    """Chunks of any sizes (empty ones too), with gaps between them (staged) or tight, hashed a
    window at a time (windows smaller than, equal to and larger than the chunks), small chunks
    in slices: each chunk's hash is the XXH3 of its bytes (or the one given for it), the pack's
    that of the file."""
    monkeypatch.setattr(packs_impl, "_HASH_BLOCK", window)
    monkeypatch.setattr(packs_impl, "_GIL_SLICE", gil_slice)
    monkeypatch.setattr(packs_impl, "_HOLD_GIL_UP_TO", hold_up_to)
    rng = np.random.default_rng(len(sizes) * 31 + window)
    pack = packs_impl._Pack()
    if staged:
        slab = rng.integers(0, 256, sum(n + gap for n, gap in sizes) + 1, dtype=np.uint8)
        chunks, at = [], 0
        for i, (n, gap) in enumerate(sizes):
            chunks.append((f"c/{i}", at, n))
            at += n + min(gap, 64)
        pack = packs_impl.staged_pack(slab, chunks)
    else:
        for i, (n, _) in enumerate(sizes):
            pack.add(f"c/{i}", memoryview(rng.integers(0, 256, n, dtype=np.uint8)))
    data = b"".join(bytes(p) for p in pack.pieces)
    given = {f"c/{i}": "0" * 32 for i in known if i < len(sizes)}
    dest = LocalDestination(tmp_path / f"item-{uuid.uuid4().hex}")
    record, placed = packs_impl.write_pack(dest, "packs/p", pack, given)
    assert record.xxh3_128 == xxhash.xxh3_128_hexdigest(data)
    assert (dest.directory / "packs/p").read_bytes() == data
    assert sorted(placed) == sorted(v for v, _, _ in pack.chunks)
    for vpath, at, n in pack.chunks:
        want = given.get(vpath) or xxhash.xxh3_128_hexdigest(data[at : at + n])
        assert placed[vpath].xxh3_128 == want, vpath


@pytest.mark.parametrize(
    "part",
    [
        np.float32(1.5) * np.ones(()),  # a scalar
        np.arange(3 * 5 * 7, dtype=np.float32).reshape(3, 5, 7)[:, 1:4, ::2],  # not contiguous
        np.linspace(0, 1, (packs_impl.PACK_BYTES // 4) + 17, dtype=np.float32),  # many pieces
        np.zeros((0, 4), np.float32),
    ],
    ids=["scalar", "strided", "pieces", "empty"],
)
def test_a_cast_view_is_hashed_in_pieces_as_its_stored_bytes(part: np.ndarray) -> None:
    """The hash of a view that save_dtype casts, made a piece at a time, is the hash of the whole
    chunk as written."""
    from cairn.handlers._train_state.layout import _cast_digest, _raw

    want = np.dtype(ml_dtypes.bfloat16)
    assert _cast_digest(part, want) == xxhash.xxh3_128_hexdigest(_raw(part, want))
    assert _cast_digest(part, part.dtype) == xxhash.xxh3_128_hexdigest(_raw(part, part.dtype))


# ---------------------------------------------------------------------------- reading in runs


def _chunk(pack: str, offset: int, nbytes: int) -> packs_impl.Packed:
    record = packs_impl.FileRecord(pack, 1 << 40)
    return packs_impl.Packed(record, offset, nbytes, "0" * 32)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["packs/a", "packs/b"]),
            st.integers(0, 12 << 20),
            st.sampled_from([1, 64, 4096, 300_000, 1 << 20, 5 << 20]),
        ),
        max_size=40,
    )
)
def test_runs_are_close_chunks_of_one_pack_in_order(chunks: list[tuple[str, int, int]]) -> None:
    """Every chunk is in exactly one run; a run is one pack, in order, without overlap, its gaps
    at most _RUN_GAP, its span at most _RUN_BYTES unless it is a single chunk."""
    parts = [(_chunk(*c), k) for k, c in enumerate(chunks)]
    runs = packs_impl.runs(parts)
    assert sorted(k for run in runs for _, k in run) == list(range(len(parts)))
    for run in runs:
        first, last = run[0][0], run[-1][0]
        assert {p.pack for p, _ in run} == {first.pack}
        for (a, _), (b, _) in itertools.pairwise(run):
            assert 0 <= b.offset - (a.offset + a.nbytes) <= packs_impl._RUN_GAP
        span = last.offset + last.nbytes - first.offset
        assert span <= packs_impl._RUN_BYTES or len(run) == 1


def many_small_leaves() -> dict[str, Any]:
    small = {f"b{i:03d}": np.full(100 + i, i, np.float32) for i in range(300)}
    return {**small, "big": jnp.arange(1 << 20, dtype=jnp.float32)}


def test_a_restore_reads_many_small_leaves_in_a_few_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """300 small leaves close together in one pack are one read (an open and a preadv), not 300;
    each is still checked by its own hash (a damaged one is named: the test above)."""
    from cairn.handlers._files import LocalSource

    reads: list[int] = []
    real = LocalSource.readinto_at

    def counted(self: LocalSource, relpath: str, size: int, offset: int, buffers: Any) -> int:
        reads.append(sum(memoryview(b).nbytes for b in buffers))
        return real(self, relpath, size, offset, buffers)

    state = many_small_leaves()
    with CheckpointManager(tmp_path, handlers=packed()) as m:
        m.save(1, {"state": state})
        m.wait_until_finished()
        monkeypatch.setattr(LocalSource, "readinto_at", counted)
        got = m.restore(1)["state"]
    assert_tree_equal(host(got), host(state))
    assert len(reads) == 2, reads  # the small leaves' run, the 4 MiB leaf
    assert sorted(reads)[-1] == 4 << 20


def test_on_s3_a_run_of_small_leaves_is_one_ranged_get(
    s3_bucket: str, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from support.countproxy import CountingProxy

    state = many_small_leaves()
    with CountingProxy(s3_endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        with CheckpointManager(f"{s3_bucket}/runs", handlers=packed()) as m:
            m.save(1, {"state": state})
            m.wait_until_finished()
            before = len(proxy.requests())
            got = m.restore(1)["state"]
            pack_gets = [
                r for r in proxy.requests()[before:] if r.method == "GET" and "/packs/" in r.path
            ]
    assert_tree_equal(host(got), host(state))
    index_gets = [r for r in pack_gets if "/packs/index." in r.path]
    assert len(pack_gets) - len(index_gets) == 2, pack_gets


def test_a_run_reads_over_the_gaps_between_its_chunks_and_checks_each(tmp_path: Path) -> None:
    """Chunks with alignment bytes between them are one read (the gaps go to scratch), each
    filled with its own bytes and checked by its own hash; a wrong one is named."""
    from cairn.handlers._files import FileRecord, StoredItem

    data = np.random.default_rng(0).integers(0, 256, 10_000, np.uint8).tobytes()
    (tmp_path / "packs").mkdir()
    (tmp_path / "packs/p").write_bytes(data)
    record = FileRecord("packs/p", len(data))
    stored = StoredItem(tmp_path, {"packs/p": record})
    spans = [(0, 100), (128, 1000), (1152, 7), (9000, 1000)]  # gaps of 28, 24 and 7841 bytes
    chunks = [
        packs_impl.Packed(record, at, n, xxhash.xxh3_128_hexdigest(data[at : at + n]))
        for at, n in spans
    ]
    runs = packs_impl.runs([(c, k) for k, c in enumerate(chunks)])
    assert [[k for _, k in run] for run in runs] == [[0, 1, 2, 3]]  # 7841 <= _RUN_GAP
    outs = [bytearray(n) for _, n in spans]
    parts = [
        (c, memoryview(o), lambda k=k: f"chunk {k}")
        for k, (c, o) in enumerate(zip(chunks, outs, strict=True))
    ]
    packs_impl.read_chunks(stored, parts)
    assert [bytes(o) for o in outs] == [data[at : at + n] for at, n in spans]
    wrong = dataclasses.replace(chunks[2], xxh3_128="0" * 32)
    parts[2] = (wrong, parts[2][1], parts[2][2])
    with pytest.raises(CorruptCheckpointError, match="chunk 2 is not the chunk the index records"):
        packs_impl.read_chunks(stored, parts)
