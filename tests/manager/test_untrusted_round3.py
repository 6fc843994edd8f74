"""Crafted directories, round three (issue 42): what an attacker who knows docs/format.md can do
against incremental saves, the lock file, the lease and time policies, with every manifest
record recomputed so that each file looks intact on its own.

Each test fails on the code before issue 42 and holds now: an index that lies is never carried
into a new step, ``verify`` names what ``restore`` would refuse, a hard-linked lock file is
refused and left as it was, a lease of impossible numbers is a damaged lease (taken over with a
warning), and a newest step from the future does not hold time-based saves off.
"""

from __future__ import annotations

import json
import logging
import os
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
import xxhash

from cairn.handlers import JsonHandler, NumpyTreeHandler, TrainStateHandler
from cairn.handlers.errors import CorruptCheckpointError
from cairn.manager import CheckpointManager, EveryNSeconds
from cairn.manager._core import manager as _manager
from cairn.manager._core import policies as _policies
from cairn.manager._format import LOCK, MANIFEST, dump_checked
from cairn.manager._storage.objectstore import ObjectStore, StorageOptions

N = 1 << 18  # floats: 1 MiB a leaf, one chunk each, both in one pack


def state() -> dict[str, Any]:
    return {"a": jnp.arange(N, dtype=jnp.float32), "b": jnp.arange(N, dtype=jnp.float32) * 2}


def packed() -> dict[str, TrainStateHandler]:
    return {"state": TrainStateHandler(layout="packed")}


class Files:
    """A step's files, read and rewritten as an attacker would, on disk or in a bucket."""

    def __init__(self, where: str | Path) -> None:
        self.where = where
        self.store = ObjectStore(where, StorageOptions()) if isinstance(where, str) else None

    def read(self, relpath: str) -> bytes:
        if self.store is None:
            return (Path(self.where) / relpath).read_bytes()
        data = self.store.read(relpath)
        assert data is not None, relpath
        return data

    def write(self, relpath: str, data: bytes) -> None:
        if self.store is None:
            path = Path(self.where) / relpath
            path.unlink()  # a new inode: the attacker does not write through the old one
            path.write_bytes(data)
        else:
            self.store.write(relpath, data)

    def edit_file(self, step: int, item: str, relpath: str, edit: Callable[[Any], None]) -> None:
        """Rewrite a JSON file of an item and its manifest record (size and XXH3-128)."""
        name = f"checkpoint_{step}/{item}/{relpath}"
        body = json.loads(self.read(name))
        edit(body)
        data = json.dumps(body).encode()
        self.write(name, data)

        def record(manifest: dict[str, Any]) -> None:
            for entry in manifest["items"][item]["files"]:
                if entry["path"] == relpath:
                    entry.update(size=len(data), xxh3_128=xxhash.xxh3_128_hexdigest(data))

        self.edit_manifest(step, record)

    def edit_manifest(self, step: int, edit: Callable[[dict[str, Any]], None]) -> None:
        """Rewrite a step's manifest, its CRC-32C made to match."""
        manifest = json.loads(self.read(f"checkpoint_{step}/{MANIFEST}"))
        del manifest["crc32c"]
        edit(manifest)
        self.write(f"checkpoint_{step}/{MANIFEST}", dump_checked(manifest))


def point_a_at_b(files: Files, step: int) -> None:
    """The lie of case 1: the index places chunk `a` at `b`'s bytes of the same intact pack,
    keeping `a`'s own content hash; the index's manifest record is recomputed."""

    def edit(index: dict[str, Any]) -> None:
        chunks = index["chunks"]
        (a,) = [k for k in chunks if k.startswith("arrays/0/")]
        (b,) = [k for k in chunks if k.startswith("arrays/1/")]
        assert chunks[a][0] == chunks[b][0]  # one pack
        chunks[a][1] = chunks[b][1]

    files.edit_file(step, "state", "packs/index.0.json", edit)


@pytest.fixture(params=["disk", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> str | Path:
    if request.param == "disk":
        return tmp_path / "run"
    return f"{request.getfixturevalue('s3_bucket')}/run"


def test_an_index_that_lies_is_not_carried_into_the_next_step(
    where: str | Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Case 1: step 1's index points `a` at `b`'s bytes of its intact pack. A new manager's
    incremental save of the correct state (it has no memory of step 1) checks the chunks it
    would keep in the pack on the read that checks the pack before linking it: it warns,
    naming the pack and the chunk, and writes the chunks afresh, so step 2 restores; the next
    save trusts what this one wrote."""
    with CheckpointManager(where, handlers=packed(), incremental=True) as mgr:
        mgr.save(1, {"state": state()})
    files = Files(where)
    point_a_at_b(files, 1)
    with CheckpointManager(where, handlers=packed(), incremental=True) as mgr:
        with pytest.raises(CorruptCheckpointError, match="is not the chunk the index records"):
            mgr.restore(1, fallback=False)
        with caplog.at_level(logging.WARNING, "cairn"):
            mgr.save(2, {"state": state()})
            mgr.wait_until_finished()
        assert "chunk arrays/0/0 (bytes 1048576..2097152) is not the chunk the index" in caplog.text
        assert "checkpoint_1/state/packs/0." in caplog.text
        got = mgr.restore(2, fallback=False)["state"]
        np.testing.assert_array_equal(np.asarray(got["a"]), np.asarray(state()["a"]))
        assert mgr.verify(2) == []
        one, two = (set(mgr.info(s).items["state"].files) for s in (1, 2))
        assert not (one & two) - {"packs/index.0.json", "tree.json"}  # no pack of step 1 kept
        caplog.clear()
        with caplog.at_level(logging.WARNING, "cairn"):
            mgr.save(3, {"state": state()})  # links step 2's pack, which this process wrote
            mgr.wait_until_finished()
        assert "is not the chunk" not in caplog.text
        assert set(mgr.info(2).items["state"].files) & set(mgr.info(3).items["state"].files) - {
            "packs/index.0.json",
            "tree.json",
        }
        assert mgr.verify(3) == []


def test_an_honest_index_is_still_linked_by_a_new_process(where: str | Path) -> None:
    """The check costs a read, not the links: an index that holds is linked as before."""
    with CheckpointManager(where, handlers=packed(), incremental=True) as mgr:
        mgr.save(1, {"state": state()})
    with CheckpointManager(where, handlers=packed(), incremental=True) as mgr:
        mgr.save(2, {"state": state()})
        mgr.wait_until_finished()
        assert mgr.info(1).items["state"].files[0] in mgr.info(2).items["state"].files
        tm = mgr.info(2).telemetry
        assert tm["bytes_written"] < 0.01 * tm["bytes"]


def test_verify_checks_each_chunk_against_its_index(tmp_path: Path) -> None:
    """Case 4: `verify` (and ``cairn verify``) read each pack whole and each chunk the index
    places in it: the lie of case 1 is named, pack and chunk, where restore refuses."""
    with CheckpointManager(tmp_path, handlers=packed()) as mgr:
        mgr.save(1, {"state": state()})
    point_a_at_b(Files(tmp_path), 1)
    with CheckpointManager(tmp_path, read_only=True) as mgr:
        problems = mgr.verify(1)
        assert len(problems) == 1, problems
        assert "packs/0." in problems[0] and "chunk arrays/0/0" in problems[0]
        assert "is not the chunk the index records" in problems[0]
        with pytest.raises(CorruptCheckpointError):
            mgr.restore(1, fallback=False)


@pytest.mark.parametrize("target", ["a step's manifest", "a file outside the root"])
def test_a_hard_linked_lock_file_is_refused_and_left_whole(tmp_path: Path, target: str) -> None:
    """Case 2: `.cairn.lock` a hard link to another file (tar and rsync -H keep them): a
    writable open refuses it, naming the link count, and truncates nothing."""
    root = tmp_path / "run"
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"state": {"x": np.arange(4)}})
    victim = root / "checkpoint_1" / MANIFEST
    if target == "a file outside the root":
        victim = tmp_path / "secret.txt"
        victim.write_text("do not overwrite me")
    before = victim.read_bytes()
    (root / LOCK).unlink()
    os.link(victim, root / LOCK)
    with pytest.raises(
        CorruptCheckpointError,
        match=r"\.cairn\.lock is not a regular file of its own \(2 hard links",
    ):
        CheckpointManager(root)
    assert victim.read_bytes() == before
    with CheckpointManager(root, read_only=True) as mgr:
        assert mgr.verify(1) == []
        assert mgr.restore(1)["state"]["x"].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "body",
    [
        b'{"owner": "elsewhere:1:x", "expires": Infinity}',
        b'{"owner": "elsewhere:1:x", "expires": NaN}',
        b'{"owner": "elsewhere:1:x", "expires": 1e300}',
        b'{"owner": "elsewhere:1:x", "expires": ' + b"9" * 400 + b"}",
        b'{"owner": "elsewhere:1:x", "expires": ' + b"9" * 5000 + b"}",
        b'{"owner": "elsewhere:1:x", "expires": true}',
        b'{"owner": "elsewhere:1:x", "expires": -5}',
        b'{"owner": ["x"], "expires": 1}',
        b'{"owner": "elsewhere:99999999999999999999:x", "expires": 1, "writer": 99999999999999}',
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a":' * 900 + b"1" + b"}" * 900,
    ],
    ids=[
        "Infinity",
        "NaN",
        "1e300",
        "400 digits",
        "5000 digits",
        "bool",
        "negative",
        "owner a list",
        "huge pids",
        "100k deep",
        "900 deep",
    ],
)
def test_a_damaged_lease_is_taken_over_with_a_warning(
    s3_bucket: str, body: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """Case 5: a lease object whose numbers no clock or pid can have, or JSON nested deeper
    than Python parses: a damaged lease, taken over at once with a warning (no live cairn
    writer leaves one), never a raw OverflowError or RecursionError."""
    url = f"{s3_bucket}/damaged"
    store = ObjectStore(url, StorageOptions())
    store.write(LOCK, body)
    with caplog.at_level(logging.WARNING, "cairn"), CheckpointManager(url) as mgr:
        assert "is no lease cairn wrote" in caplog.text
        mgr.save(1, {"state": {"x": np.arange(3)}})
        mgr.wait_until_finished()
        held = json.loads(store.read(LOCK) or b"")
        assert held["owner"].split(":")[1] == str(os.getpid())
    assert store.read(LOCK) is None


def test_a_live_lease_from_a_clock_far_ahead_says_so(s3_bucket: str) -> None:
    """A lease that expires days from now by this host's clock is refused (its owner may be
    alive), with a message that says the clocks differ and how to take it over."""
    url = f"{s3_bucket}/ahead"
    store = ObjectStore(url, StorageOptions())
    store.write(
        LOCK, json.dumps({"owner": "elsewhere:1:x", "expires": time.time() + 30 * 86400}).encode()
    )
    with pytest.raises(Exception, match=r"ahead of this host's clock.*delete \.cairn\.lock"):
        CheckpointManager(url)


class FakeClock:
    """time.time and time.monotonic for the manager and its policies, moved by the test."""

    def __init__(self) -> None:
        self.wall, self.mono = time.time(), 1000.0

    def module(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(
            time=lambda: self.wall,
            monotonic=lambda: self.mono,
            strftime=time.strftime,
            localtime=time.localtime,
            perf_counter=time.perf_counter,
        )


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeClock]:
    fake = FakeClock()
    monkeypatch.setattr(_policies, "time", fake.module(), raising=False)  # (issue 42: new)
    monkeypatch.setattr(_manager, "time", fake.module())
    yield fake


def set_started_at(root: Path, step: int, started_at: float) -> None:
    path = root / f"checkpoint_{step}" / MANIFEST
    body = json.loads(path.read_bytes())
    del body["crc32c"]
    body["started_at"] = started_at
    path.write_bytes(dump_checked(body))


def test_a_newest_step_from_the_future_counts_as_now(
    tmp_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Case 3: the newest step started 30 days ahead of this clock (a host whose clock ran
    ahead wrote it, or a crafted manifest). A restarted manager counts the interval from now,
    with one warning naming the step and the skew, instead of waiting 30 days."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"state": {"x": np.arange(3)}})
    set_started_at(tmp_path, 1, clock.wall + 30 * 86400)
    with caplog.at_level(logging.WARNING, "cairn"):
        mgr = CheckpointManager(tmp_path, save=EveryNSeconds(60))
    try:
        warned = [r.getMessage() for r in caplog.records if "time-based saves" in r.getMessage()]
        assert len(warned) == 1 and "step 1 started at" in warned[0]
        assert "2592000 s after" in warned[0]
        assert not mgr.should_save(2)
        clock.wall += 61
        clock.mono += 61
        assert mgr.should_save(2)
    finally:
        mgr.close()


def test_a_clock_stepped_back_does_not_hold_saves_off(tmp_path: Path, clock: FakeClock) -> None:
    """Case 3, in one process: the wall clock steps back a day after a save (NTP, a VM
    restored); the interval is measured on the monotonic clock, so the next save comes when
    `seconds` have passed, not a day later. Stepped forward, it does not come early."""
    with CheckpointManager(tmp_path, save=EveryNSeconds(60)) as mgr:
        assert mgr.save(1, {"state": {"x": np.arange(3)}})
        clock.wall -= 86400
        clock.mono += 30
        assert not mgr.should_save(2)
        clock.mono += 31
        assert mgr.should_save(2)
        assert mgr.save(2, {"state": {"x": np.arange(3)}})
        clock.wall += 7 * 86400
        clock.mono += 1
        assert not mgr.should_save(3)


# ---------------------------------------------------------------------------- the review's finds


@pytest.mark.parametrize(
    ("lie", "message"),
    [
        (lambda e: e.__setitem__(2, 8), "is indexed with 8 bytes"),
        (lambda e: e.__setitem__(2, 0), "is indexed with 0 bytes"),
        (None, "is not indexed"),
    ],
)
def test_verify_refuses_what_restore_refuses_before_reading(
    tmp_path: Path, lie: Any, message: str
) -> None:
    """verify calls a step intact only if a restore takes it: an index entry of the wrong size
    (its hash recomputed for those bytes) or a chunk left out of the index is reported, as the
    handler's own checks before any allocation (`TrainStateHandler.check`) find it."""
    with CheckpointManager(tmp_path, handlers=packed()) as mgr:
        mgr.save(1, {"state": state()})
    item = tmp_path / "checkpoint_1" / "state"

    def edit(index: dict[str, Any]) -> None:
        (name,) = [k for k in index["chunks"] if k.startswith("arrays/0/")]
        if lie is None:
            del index["chunks"][name]
            return
        entry = index["chunks"][name]
        lie(entry)
        pack = (item / entry[0]).read_bytes()
        entry[3] = xxhash.xxh3_128_hexdigest(pack[entry[1] : entry[1] + entry[2]])

    Files(tmp_path).edit_file(1, "state", "packs/index.0.json", edit)
    with CheckpointManager(tmp_path, read_only=True) as mgr:
        problems = mgr.verify(1)
        assert len(problems) == 1 and message in problems[0], problems
        with pytest.raises(CorruptCheckpointError, match=message):
            mgr.restore(1, fallback=False)


def test_a_record_far_larger_than_its_object_allocates_nothing(tmp_path: Path) -> None:
    """In a bucket, sizes are not stat'ed: a manifest record saying a pack holds 64 GiB (the
    object holds 2 MiB, tree.json and the index agree with the lie) is found by reading the
    object's last byte before anything is allocated, so the step is damaged (a raw MemoryError
    before) and restore() falls back to the step before."""
    import uuid

    url = f"memory://round3/{uuid.uuid4().hex}"
    with CheckpointManager(url, handlers=packed()) as mgr:
        mgr.save(1, {"state": state()})
        mgr.save(2, {"state": state()})
    files = Files(url)
    nbytes = 64 << 30
    manifest = json.loads(files.read(f"checkpoint_2/{MANIFEST}"))
    del manifest["crc32c"]
    records = manifest["items"]["state"]["files"]
    pack = next(r for r in records if r["path"].startswith("packs/") and "index" not in r["path"])
    pack["size"] = nbytes
    for relpath, body in [
        ("tree.json", lambda t: t["c"][0].update(shape=[nbytes // 4], chunk=[nbytes // 4])),
        ("packs/index.0.json", lambda i: i.__setitem__(
            "chunks", {"arrays/0/0": [pack["path"], 0, nbytes, "0" * 32]})),
    ]:  # fmt: skip
        data = json.loads(files.read(f"checkpoint_2/state/{relpath}"))
        body(data)
        raw = json.dumps(data).encode()
        files.write(f"checkpoint_2/state/{relpath}", raw)
        for r in records:
            if r["path"] == relpath:
                r.update(size=len(raw), xxh3_128=xxhash.xxh3_128_hexdigest(raw))
    files.write(f"checkpoint_2/{MANIFEST}", dump_checked(manifest))
    with CheckpointManager(url, read_only=True) as mgr:
        with pytest.raises(CorruptCheckpointError, match="shorter than the manifest says"):
            mgr.restore(2, fallback=False)
        assert mgr.restore()["state"]["a"].shape == (N,)  # step 1


def test_a_pack_others_may_write_is_not_shared(tmp_path: Path) -> None:
    """A crafted step whose pack is a hard link to a file outside the root that others may
    write (mode 0666; tar and rsync -H keep hard links): an incremental save writes its chunks
    afresh rather than link that inode into every later step, so a later write to the outside
    file damages none of them."""
    root, outside = tmp_path / "run", tmp_path / "outside"
    with CheckpointManager(root, handlers=packed(), incremental=True) as mgr:
        mgr.save(1, {"state": state()})
    (pack,) = (root / "checkpoint_1" / "state" / "packs").glob("0.*")
    os.replace(pack, outside)
    os.chmod(outside, 0o666)
    os.link(outside, pack)
    with CheckpointManager(root, handlers=packed(), incremental=True) as mgr:
        mgr.save(2, {"state": state()})
        mgr.save(3, {"state": state()})
        mgr.wait_until_finished()
        assert os.stat(outside).st_nlink == 2  # not linked on
        with open(outside, "r+b") as f:
            f.write(b"\xff" * 16)
        assert mgr.verify(2) == [] and mgr.verify(3) == []
        got = mgr.restore(3, fallback=False)["state"]
        np.testing.assert_array_equal(np.asarray(got["a"]), np.asarray(state()["a"]))


def test_a_lease_naming_a_live_process_that_is_no_writer_is_taken_over(
    tmp_path: Path,
) -> None:
    """A lease of this host whose owner is gone and whose "writer" is a live process that runs
    no cairn writer (pid 1, or a pid reused since): taken over at once, not after waiting
    10 minutes for that process and then refused."""
    import socket
    import subprocess
    import uuid

    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "600"])
    try:
        url = f"memory://round3/{uuid.uuid4().hex}"
        lease = {
            "owner": f"{socket.gethostname()}:{dead.pid}:x",
            "expires": time.time() + 3000,
            "writer": live.pid,
        }
        ObjectStore(url, StorageOptions()).write(LOCK, json.dumps(lease).encode())
        started = time.monotonic()
        with CheckpointManager(url) as mgr:
            mgr.save(1, {"state": {"x": np.arange(3)}})
        assert time.monotonic() - started < 60
    finally:
        live.kill()
        live.wait()


@pytest.mark.parametrize(
    "best", [{"metric": "loss", "mode": "up"}, {"metric": "", "mode": "min"}, ["loss", "min"], 7]
)
def test_a_malformed_best_rule_makes_the_step_damaged(tmp_path: Path, best: Any) -> None:
    """The manifest's optional `best` (issue 43): anything but {metric, min|max} is malformed."""
    with CheckpointManager(tmp_path, best=("loss", "min")) as mgr:
        mgr.save(1, {"state": {"x": np.arange(3)}}, metrics={"loss": 1.0})
        mgr.save(2, {"state": {"x": np.arange(3)}}, metrics={"loss": 0.5})
    path = tmp_path / "checkpoint_2" / MANIFEST
    body = json.loads(path.read_bytes())
    assert body["best"] == {"metric": "loss", "mode": "min"}
    del body["crc32c"]
    body["best"] = best
    path.write_bytes(dump_checked(body))
    with CheckpointManager(tmp_path, read_only=True) as mgr:
        with pytest.raises(CorruptCheckpointError, match="best"):
            mgr.restore(2, fallback=False)
        assert mgr.info(1).best == ("loss", "min")


# ---------------------------------------------------------------------------- the soak's finds


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (  # test_fuzz_packed_soak, 2026-12-07: a JSON item's handler named as the NumPy tree's
            lambda m: m["items"]["config"].update(handler="cairn.numpy_tree"),
            "config/tree.json is not in the manifest",
        ),
        (  # test_fuzz_soak, 2026-12-07: an iterator item's only record removed
            lambda m: m["items"]["data"]["files"].clear(),
            "data/process_0-of-1.json is not in the manifest",
        ),
        (  # one process's file of two left out: process 1's restore refuses the step
            lambda m: m["items"]["data"]["files"][0].update(path="process_0-of-2.json"),
            "data/process_1-of-2.json is not in the manifest",
        ),
    ],
)
def test_verify_reports_a_manifest_no_restore_takes(
    tmp_path: Path, edit: Callable[[dict[str, Any]], None], message: str
) -> None:
    """The soak's fuzzers found steps verify called intact that restore refused: an item's
    handler changed in the manifest, an iterator item's process files left out. Each handler's
    ``check`` now sees what its restore would refuse."""
    from support.iterutil import Shuffled, advanced

    with CheckpointManager(tmp_path, handlers={"config": JsonHandler()}) as mgr:
        mgr.save(1, {"config": {"lr": 0.1}, "data": advanced(Shuffled(seed=1), 3)})
    if "of-2" in message:
        os.rename(
            tmp_path / "checkpoint_1" / "data" / "process_0-of-1.json",
            tmp_path / "checkpoint_1" / "data" / "process_0-of-2.json",
        )
    Files(tmp_path).edit_manifest(1, edit)
    with CheckpointManager(tmp_path, read_only=True) as mgr:
        problems = mgr.verify(1)
        assert len(problems) == 1 and message in problems[0], problems
        if "of-2" not in message:  # a restore here is process 0 of 1
            with pytest.raises(CorruptCheckpointError, match=message):
                mgr.restore(1, fallback=False)


def test_verify_reads_a_numpy_leaf_header_as_a_restore_does(tmp_path: Path) -> None:
    """A NumPy tree whose ``tree.json`` (its record rewritten) gives a leaf another shape than
    its ``.npy`` header: verify reports it, as the restore refuses it, before reading the data."""
    with CheckpointManager(tmp_path, handlers={"state": NumpyTreeHandler()}) as mgr:
        mgr.save(1, {"state": {"x": np.arange(6.0)}})
    Files(tmp_path).edit_file(1, "state", "tree.json", lambda t: t["c"][0].update(shape=[2, 3]))
    message = r"shape \(6,\) where tree.json says \[2, 3\]"
    with CheckpointManager(tmp_path, read_only=True) as mgr:
        problems = mgr.verify(1)
        assert len(problems) == 1 and "arrays/0.npy: shape (6,)" in problems[0], problems
        with pytest.raises(CorruptCheckpointError, match=message):
            mgr.restore(1, fallback=False)


def test_a_local_part_holds_its_own_process_s_iterator_file_only(tmp_path: Path) -> None:
    """A local tier's part of process 1 of 2 lists `process_1-of-2.json` alone: verify (and
    `cairn verify` on the part's directory) calls it intact; left out, it is named."""
    from support.iterutil import Shuffled, advanced

    from cairn.manager._format import PART

    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"data": advanced(Shuffled(seed=1), 3)})
    data = tmp_path / "checkpoint_1" / "data"
    os.rename(data / "process_0-of-1.json", data / "process_1-of-2.json")
    part = {"process": 1, "processes": 2, "save": "s", "persistent": False, "holder": 1}

    def as_part(m: dict[str, Any]) -> None:
        m["metadata"][PART] = part
        m["items"]["data"]["files"][0].update(path="process_1-of-2.json")

    Files(tmp_path).edit_manifest(1, as_part)
    with CheckpointManager(tmp_path, read_only=True) as mgr:
        assert mgr.verify(1) == []
    Files(tmp_path).edit_manifest(1, lambda m: m["items"]["data"]["files"].clear())
    with CheckpointManager(tmp_path, read_only=True) as mgr:
        (problem,) = mgr.verify(1)
        assert "data/process_0-of-1.json is not in the manifest" in problem, problem
