"""The staging pool, O_DIRECT chunk writes, the write budget and the writer threads' priority."""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import Gate
from support.mounts import mounted
from support.pages import evict, resident_pages

from cairn.handlers import LocalDestination, TrainStateHandler
from cairn.handlers._files import DIRECT_MIN, disk, io_priority
from cairn.handlers._files.disk import _NO_DIRECT_DEVICES
from cairn.handlers._staging import PAGE, StagingPool, staging_for
from cairn.handlers.io import (
    BACKGROUND_NICE,
    WriteBudget,
    aligned_empty,
    lower_thread_priority,
    read_direct,
    resident,
    round_up,
)

MiB = 1 << 20


def aligned(nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    region = mmap.mmap(-1, -(-nbytes // PAGE) * PAGE)
    array = np.frombuffer(region, np.uint8)[:nbytes]
    array[:] = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    return region, array


# ----------------------------------------------------------------------------- the pool


def test_the_first_lease_maps_a_slab_and_the_same_slab_comes_back() -> None:
    pool = StagingPool()
    lease = pool.lease("state", 5 * MiB)  # mapped now: the copy into it faults it in
    assert lease is not None
    slab = lease.slab
    assert slab.nbytes >= 5 * MiB and slab.array.ctypes.data % PAGE == 0
    assert pool.held_bytes() == slab.nbytes
    second = pool.lease("state", 5 * MiB)  # in use: a second one (two saves in flight)
    assert second is not None and second.slab is not slab
    assert pool.held_bytes() == 2 * slab.nbytes
    lease.release()
    lease.release()  # idempotent
    again = pool.lease("state", 5 * MiB)
    assert again is not None and again.slab is slab
    assert pool.held_bytes() == 2 * slab.nbytes
    pool.close()
    again.release()
    second.release()
    assert pool.held_bytes() == 0
    assert pool.lease("state", 5 * MiB) is None  # closed


def test_a_dropped_lease_goes_back_to_the_pool() -> None:
    pool = StagingPool()
    lease = pool.lease("x", MiB)
    assert lease is not None
    slab = lease.slab
    del lease  # a snapshot dropped before its write phase ran (its save failed)
    back = pool.lease("x", MiB)
    assert back is not None and back.slab is slab


def test_the_pool_shrinks_with_the_state_and_keeps_items_apart() -> None:
    pool = StagingPool()
    for key, size in (("big", 40 * MiB), ("small", MiB)):
        pool.lease(key, size).release()  # type: ignore[union-attr]
    held = pool.held_bytes()
    assert 41 * MiB <= held <= 41 * MiB + 8 * MiB
    lease = pool.lease("big", 10 * MiB)  # far smaller: the 40 MiB slab is freed
    assert lease is not None and lease.slab.nbytes < 20 * MiB
    assert pool.held_bytes() <= 10 * MiB + MiB + 8 * MiB


def test_max_bytes_keeps_views_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    pool = StagingPool(max_bytes=4 * MiB)
    pool.lease("a", 3 * MiB).release()  # type: ignore[union-attr]
    b = pool.lease("b", 3 * MiB)  # 3 + 3 > 4: a's spare slab is freed to make room
    assert b is not None and pool.held_bytes() <= 4 * MiB
    with caplog.at_level(logging.WARNING, logger="cairn"):
        assert pool.lease("c", 8 * MiB) is None  # beyond the bound: views
        assert pool.lease("c", 8 * MiB) is None
    assert caplog.text.count("max_staging_bytes=4194304") == 1
    assert StagingPool(zero_copy=True).lease("a", MiB) is None


def test_slabs_being_prepared_count_against_max_bytes() -> None:
    """Two items of 6 MiB under a bound of 8: the second keeps views at every save, and is
    never prepared."""
    pool = StagingPool(max_bytes=8 * MiB)
    pool.prepare("p", 6 * MiB)  # faulted in from now on, and counted
    assert pool.held_bytes() == 6 * MiB
    assert pool.lease("q", 6 * MiB) is None  # 6 + 6 > 8: views (p being faulted in, or ready)
    pool.prepare("q", 6 * MiB)  # no room: nothing
    pool.wait()
    assert pool.lease("q", 6 * MiB) is None  # p's prepared slab is ready: still not q's
    assert pool.held_bytes() == 6 * MiB
    for _ in range(3):
        lease = pool.lease("p", 6 * MiB)
        assert lease is not None
        assert pool.lease("q", 6 * MiB) is None
        assert pool.held_bytes() == 6 * MiB
        lease.release()


def test_a_lease_takes_the_slab_being_prepared() -> None:
    """A save right after prepare() (a restore) waits for the slab being faulted in, or takes
    it if it is ready: one slab either way, never a second one mapped beside it."""
    for _ in range(20):
        pool = StagingPool()
        pool.prepare("s", 4 * MiB)
        lease = pool.lease("s", 4 * MiB)
        assert lease is not None
        assert pool.held_bytes() == lease.slab.nbytes == 4 * MiB
        pool.prepare("s", 4 * MiB)  # lent, none free: a second one for the next save
        pool.wait()
        assert pool.held_bytes() == 8 * MiB
        lease.release()
        pool.prepare("s", 4 * MiB)  # a fitting one is free: nothing more
        pool.prepare("s", 0)
        pool.wait()
        assert pool.held_bytes() == 8 * MiB
        pool.close()
        pool.prepare("s", MiB)  # closed: nothing
        assert pool.held_bytes() == 0
    views = StagingPool(zero_copy=True)
    views.prepare("s", MiB)
    assert views.held_bytes() == 0


def test_a_save_frees_what_was_prepared_for_items_it_does_not_have() -> None:
    pool = StagingPool()
    pool.prepare("state", 2 * MiB)
    pool.prepare("restored_only", 3 * MiB)
    lease = pool.lease("state", 2 * MiB)  # the save of "state" takes its prepared slab
    assert lease is not None
    pool.drop_unused(["state"])  # waits for the other's fault-in, then frees it
    assert pool.held_bytes() == 2 * MiB
    lease.release()
    pool.drop_unused([])  # "state" was leased since: its slab is the pool's now, kept
    assert pool.held_bytes() == 2 * MiB


def test_a_slab_of_the_old_size_given_back_after_the_state_changed_is_freed() -> None:
    """With max_pending=2 a save of the old size can still be in flight when the state shrinks;
    its slab, given back later, must not stay in the pool beside the new one."""
    pool = StagingPool()
    in_flight = pool.lease("s", 8 * MiB)
    assert in_flight is not None
    small = pool.lease("s", MiB)  # the state shrank: a small slab
    assert small is not None and small.slab.nbytes < 8 * MiB
    small.release()
    in_flight.release()  # the old save ends: its 8 MiB come back
    lease = pool.lease("s", MiB)
    assert lease is not None and lease.slab is small.slab
    assert pool.held_bytes() == lease.slab.nbytes  # the 8 MiB slab is gone


def test_max_staging_bytes_bounds_a_manager_with_two_items(tmp_path: Path) -> None:
    import jax.numpy as jnp

    from cairn.manager import CheckpointManager

    with CheckpointManager(tmp_path / "run", max_staging_bytes=8 * MiB) as mgr:
        for step in range(4):
            items = {
                name: {"a": jnp.full(6 * MiB // 4, step + k, jnp.float32)}
                for k, name in enumerate("pq")
            }
            mgr.save(step, items)
            mgr.wait_until_finished()
            mgr._staging.wait()
            assert mgr._staging.held_bytes() <= 8 * MiB
            back = mgr.restore(step, {"p": None, "q": None})
            for k, name in enumerate("pq"):
                np.testing.assert_array_equal(back[name]["a"], np.full(6 * MiB // 4, step + k))


# ----------------------------------------------------------------------------- O_DIRECT


def test_aligned_chunks_go_to_disk_past_the_page_cache(tmp_path: Path) -> None:
    """A page-aligned buffer of a megabyte or more is written with O_DIRECT up to its last
    whole page: the file's pages are not in the page cache afterwards, except the tail's."""
    region, data = aligned(3 * MiB + 100)
    tail = b"tail"
    dest = LocalDestination(tmp_path / "item")
    record = dest.write_file("direct", [memoryview(data), tail])  # type: ignore[arg-type]
    path = tmp_path / "item" / "direct"
    assert path.read_bytes() == data.tobytes() + tail
    assert record.size == data.nbytes + 4
    # Reading it back brought it into the cache: write another and look before reading.
    dest.write_file("direct2", [memoryview(data), tail])  # type: ignore[arg-type]
    assert resident_pages(tmp_path / "item" / "direct2") <= 2  # the tail's page(s)
    dest.write_file("buffered", bytes(data))  # not aligned (a bytes object): page cache
    assert resident_pages(tmp_path / "item" / "buffered") >= (3 * MiB) // PAGE
    small_region, small = aligned(DIRECT_MIN // 2)
    dest.write_file("small", memoryview(small))  # type: ignore[arg-type]
    assert resident_pages(tmp_path / "item" / "small") == DIRECT_MIN // 2 // PAGE
    del data, small
    region.close()
    small_region.close()


@pytest.fixture
def ramfs(tmp_path: Path) -> Iterator[Path]:
    """A ramfs mount: a real filesystem that refuses O_DIRECT (EINVAL), as some network and
    in-memory filesystems do. The tests run as root here, as CI does."""
    with mounted("ramfs", tmp_path / "ramfs") as where:
        yield where


def test_a_filesystem_that_refuses_o_direct_gets_every_byte_buffered(ramfs: Path) -> None:
    region, data = aligned(2 * MiB + 8)
    dest = LocalDestination(ramfs / "item")
    dest.write_file("chunk", [memoryview(data), b"tail"])  # type: ignore[arg-type]
    assert (ramfs / "item" / "chunk").read_bytes() == data.tobytes() + b"tail"
    assert os.stat(ramfs).st_dev in _NO_DIRECT_DEVICES  # asked once, remembered
    dest.write_file("again", memoryview(data))  # type: ignore[arg-type]
    assert (ramfs / "item" / "again").read_bytes() == data.tobytes()
    del data
    region.close()


def test_a_manager_on_that_filesystem_saves_and_restores(ramfs: Path) -> None:
    from cairn.manager import CheckpointManager

    state = {"w": np.arange(3 * MiB // 4, dtype=np.float32).reshape(-1, 1024)}
    with CheckpointManager(ramfs / "run") as mgr:
        for step in range(3):  # the first keeps views, the others copy into the pool
            mgr.save(step, {"state": {"w": state["w"] + step}})
            mgr.wait_until_finished()
        np.testing.assert_array_equal(mgr.restore(2)["state"]["w"], state["w"] + 2)
        assert mgr.verify(2) == []


def test_a_file_is_read_past_the_page_cache(tmp_path: Path) -> None:
    """read_direct: a file written with O_DIRECT is read with O_DIRECT (its pages stay out of the
    page cache), whole blocks into a buffer of whole pages, the bytes past its end dropped; a
    buffer too short or off a page, or a file shorter than asked, is refused."""
    region, data = aligned(3 * MiB + 100)
    LocalDestination(tmp_path).write_file("f", memoryview(data))  # type: ignore[arg-type]
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        into = aligned_empty((round_up(data.nbytes),), np.dtype(np.uint8))
        got = read_direct(fd, data.nbytes, into)
        assert got.nbytes == data.nbytes and bytes(got) == data.tobytes()
        assert resident_pages(tmp_path / "f") <= 1  # the tail, written through the page cache
        assert bytes(read_direct(fd, 5, into)) == data.tobytes()[:5]  # a file's start
        with pytest.raises(ValueError, match="for a read of"):
            read_direct(fd, data.nbytes, into[: data.nbytes])  # not whole pages
        with pytest.raises(ValueError, match="for a read of"):
            read_direct(fd, 100, into[1 : 1 + PAGE])  # off a page
        with pytest.raises(EOFError, match=f"ended at byte {data.nbytes} of {data.nbytes + 1}"):
            read_direct(fd, data.nbytes + 1, aligned_empty((4 * MiB,), np.dtype(np.uint8)))
        assert not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT  # the descriptor as it was
    finally:
        os.close(fd)
    del data
    region.close()


def test_a_file_on_a_filesystem_without_o_direct_is_read_through_the_page_cache(
    ramfs: Path,
) -> None:
    data = os.urandom(2 * MiB + 7)
    (ramfs / "f").write_bytes(data)
    fd = os.open(ramfs / "f", os.O_RDONLY)
    try:
        into = aligned_empty((round_up(len(data)),), np.dtype(np.uint8))
        assert bytes(read_direct(fd, len(data), into)) == data
    finally:
        os.close(fd)


def test_resident_tells_a_file_in_memory_from_one_on_the_disk(tmp_path: Path, ramfs: Path) -> None:
    """A file just written through the page cache is in memory, one written with O_DIRECT is
    not, nor is one whose pages were dropped; a RAM disk's file always is; a file shorter than
    asked is not, and nothing at all is."""
    region, data = aligned(3 * MiB)
    LocalDestination(tmp_path).write_file("direct", memoryview(data))  # type: ignore[arg-type]
    (tmp_path / "cached").write_bytes(data.tobytes())
    (ramfs / "ram").write_bytes(data.tobytes())
    fds = {
        name: os.open(where / name, os.O_RDONLY)
        for where, name in ((tmp_path, "direct"), (tmp_path, "cached"), (ramfs, "ram"))
    }
    try:
        assert not resident(fds["direct"], data.nbytes)
        assert resident(fds["cached"], data.nbytes)
        assert not resident(fds["cached"], data.nbytes + 1)  # past its end
        assert resident(fds["cached"], 0)
        evict(tmp_path / "cached")
        assert not resident(fds["cached"], data.nbytes)
        evict(ramfs / "ram")
        assert resident(fds["ram"], data.nbytes)  # it has nowhere else to be
        assert not resident(fds["ram"], data.nbytes + 1)
    finally:
        for fd in fds.values():
            os.close(fd)
    # a RAM disk is told by its filesystem's type, with no page counted; a disk is not
    assert disk._IN_MEMORY_DEVICES[os.stat(ramfs).st_dev] is True
    assert disk._IN_MEMORY_DEVICES[os.stat(tmp_path).st_dev] is False
    tmpfs = tmp_path / "tmpfs"
    tmpfs.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "none", str(tmpfs)], check=True)
    try:
        (tmpfs / "ram").write_bytes(data.tobytes())
        fd = os.open(tmpfs / "ram", os.O_RDONLY)
        try:
            assert resident(fd, data.nbytes)
            assert disk._IN_MEMORY_DEVICES[os.stat(tmpfs).st_dev] is True
        finally:
            os.close(fd)
    finally:
        subprocess.run(["umount", str(tmpfs)], check=True)
    del data
    region.close()


# ----------------------------------------------------------------------------- write budget


def test_the_write_budget_paces_the_commit(tmp_path: Path) -> None:
    """8 files of 1 MiB at 16 MiB/s cannot finish before 7/16 s (the first goes at once)."""
    budget = WriteBudget(16 * MiB)
    dest = LocalDestination(tmp_path)
    dest.budget = budget
    data = os.urandom(MiB)
    t0 = time.monotonic()
    threads = [threading.Thread(target=dest.write_file, args=(f"f{i}", data)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - t0 >= 7 / 16
    assert all((tmp_path / f"f{i}").read_bytes() == data for i in range(8))


@pytest.mark.parametrize(
    "bad", [0, -1, 0.5, 1e-300, 10**400, float("inf"), float("nan"), "1e6", True, np.True_, None]
)
def test_the_write_budget_must_be_a_rate_of_at_least_a_byte_a_second(bad: object) -> None:
    # 1e-300 used to pass, and every commit then failed in time.sleep (OverflowError)
    with pytest.raises(ValueError, match="max_write_bytes_per_s must be a number of bytes per"):
        WriteBudget(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("rate", [1, 1e6, np.float32(1e6), np.int64(10**6), np.float64(2.5)])
def test_the_write_budget_takes_numpy_numbers(rate: object) -> None:
    assert WriteBudget(rate).bytes_per_s == float(rate)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- priorities


def test_background_threads_run_at_low_cpu_and_io_priority_under_their_name() -> None:
    seen: dict[str, object] = {}

    def body() -> None:
        lower_thread_priority()
        tid = threading.get_native_id()
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, tid)
        seen["io"] = io_priority(tid)
        seen["comm"] = Path(f"/proc/self/task/{tid}/comm").read_text().strip()

    t = threading.Thread(target=body, name="cairn-write_3")
    t.start()
    t.join()
    assert seen["nice"] == max(BACKGROUND_NICE, os.getpriority(os.PRIO_PROCESS, 0))
    assert seen["io"] == (2, 7)  # best effort, the lowest level
    assert seen["comm"] == "cairn-write_3"


# ----------------------------------------------------------------------------- the handler


def test_a_failed_write_phase_gives_its_slab_back(tmp_path: Path) -> None:
    """The write phase raises (the disk refused a file): the lease goes back all the same."""

    class Refusing(LocalDestination):
        def _put(self, relpath: str, pieces: list[memoryview]) -> None:
            if relpath.startswith("packs/0."):  # the pack (the packed layout, the default)
                raise OSError(28, "No space left on device")
            super()._put(relpath, pieces)

    pool = StagingPool()
    state = {"w": np.ones((256, 1024), np.float32)}
    handler = TrainStateHandler()
    with staging_for(pool, "state"):
        snap = handler.snapshot(state)
    assert snap._lease is not None
    slab, size = snap._lease.slab, pool.held_bytes()
    with pytest.raises(OSError, match="No space left"):
        snap.write(Refusing(tmp_path / "item"))
    again = pool.lease("state", size)
    assert again is not None and again.slab is slab


@pytest.mark.parametrize("copy_piece", [None, 4096])
def test_staged_and_unstaged_snapshots_write_the_same_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, copy_piece: int | None
) -> None:
    """Edge chunks padded, a save_dtype cast, big-endian input, scalars, empty and bool leaves:
    the staged copy writes byte for byte what the unstaged path writes (the zarr layout; for the
    packed one, tests/handlers/test_tree_properties.py compares chunks). With 4 KiB copy
    pieces, the copies run on the pool while the write waits for each chunk's."""
    import ml_dtypes

    from cairn.handlers._train_state import staging

    if copy_piece is not None:
        monkeypatch.setattr(staging, "_COPY_PIECE", copy_piece)

    rng = np.random.default_rng(3)
    state = {
        "prime": rng.standard_normal((1009, 33)).astype(np.float32),  # 1009 rows: padded edge
        "big_endian": np.arange(50, dtype=">i4"),
        "scalar": np.float64(2.5),
        "empty": np.zeros((0, 7), np.float32),
        "flags": rng.integers(0, 2, 300).astype(bool),
        "half": rng.standard_normal(77).astype(ml_dtypes.bfloat16),
    }
    handler = TrainStateHandler(chunk_bytes=16 * 1024, save_dtype=np.float16, layout="zarr")
    plain = handler.snapshot(state).write(tmp_path / "plain")
    pool = StagingPool()
    with staging_for(pool, "s"):
        snap = handler.snapshot(state)
    assert snap._lease is not None  # staged
    assert (snap._copying is not None) == (copy_piece is not None)
    staged = snap.write(tmp_path / "staged")
    assert sorted(r.path for r in plain) == sorted(r.path for r in staged)
    assert {r.path: r.xxh3_128 for r in plain} == {r.path: r.xxh3_128 for r in staged}
    for r in plain:
        assert (tmp_path / "plain" / r.path).read_bytes() == (
            tmp_path / "staged" / r.path
        ).read_bytes()


# ----------------------------------------------------------------------------- through the manager


@pytest.mark.parametrize("where", ["disk", "memory"])
def test_max_write_bytes_per_s_paces_a_managers_commit(tmp_path: Path, where: str) -> None:
    """The option reaches every destination, a local directory and an object store's prefix:
    a commit cannot end before its bytes, less the first file, have had their time."""
    from cairn.manager import CheckpointManager

    directory = tmp_path / "run" if where == "disk" else f"memory://pace-{os.getpid()}"
    rate = 8 * MiB
    state = {f"w{i}": np.full((256, 1024), i, np.float32) for i in range(4)}  # 4 files of 1 MiB
    with CheckpointManager(directory, max_write_bytes_per_s=rate) as mgr:
        t0 = time.monotonic()
        mgr.save(1, {"state": state})
        mgr.wait_until_finished()
        elapsed = time.monotonic() - t0
        written = mgr.info(1).bytes
        np.testing.assert_array_equal(mgr.restore(1)["state"]["w3"], state["w3"])
    assert written > 4 * MiB
    assert elapsed >= (written - MiB - 4096) / rate


def test_max_staging_bytes_keeps_views_past_the_bound(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, gate: Gate
) -> None:
    """A state larger than max_staging_bytes is never copied: with the commit held, the donation
    after save() is declined (views), a warning names the option once, and each step is right."""
    import jax
    import jax.numpy as jnp
    from test_train_state import VIEWS

    from cairn.handlers import InMemoryHandler
    from cairn.manager import CheckpointManager

    step_fn = jax.jit(lambda s: jax.tree_util.tree_map(lambda x: x + 1, s), donate_argnums=0)
    handlers = {"gate": InMemoryHandler(on_write=gate)}
    with (
        caplog.at_level(logging.WARNING, logger="cairn"),
        CheckpointManager(tmp_path / "run", handlers=handlers, max_staging_bytes=64 * 1024) as mgr,
    ):
        for step in range(3):
            state = {"w": jnp.full((256, 1024), float(step))}  # 1 MiB, over the bound
            mgr.save(step, {"gate": 0, "state": state})
            assert gate.entered.wait(30)  # the commit is held: the save is in flight
            gate.entered.clear()
            new = step_fn(state)
            # views: JAX declined the donation (on an accelerator: host copies, no pool at all)
            assert state["w"].is_deleted() is not VIEWS
            gate.release.set()
            mgr.wait_until_finished()
            gate.release.clear()
            restored = mgr.restore(step, {"state": None})["state"]["w"]
            np.testing.assert_array_equal(restored, np.full((256, 1024), step))
            del new
        assert mgr._staging.held_bytes() == 0
    assert caplog.text.count("max_staging_bytes=65536") == int(VIEWS)


# ------------------------------------------------ the commit writes while save() is still copying


@pytest.fixture
def small_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Staging copies of 64 KiB pieces, on the copy pool (as a state of gigabytes is), and packs
    of 1 MiB, so that a state of a few MiB has several packs and many copies."""
    from cairn.handlers._train_state import staging

    monkeypatch.setattr(staging, "_COPY_PIECE", 64 * 1024)
    monkeypatch.setattr(staging, "PACK_BYTES", MiB)
    monkeypatch.setattr(LocalDestination, "pack_bytes", MiB)


def _leaves(n: int, value: float) -> dict[str, np.ndarray]:
    return {f"w{i}": np.full((128, 1024), value + i, np.float32) for i in range(n)}  # 512 KiB


@pytest.mark.usefixtures("small_copies")
def test_the_commit_writes_the_first_pack_while_save_still_copies_the_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last staging copy is held until the commit thread has written a pack: save() hands
    the commit over before its copies end, returns only once they have, and the step is whole."""
    from cairn.handlers._train_state import staging, write
    from cairn.manager import CheckpointManager

    first_pack = threading.Event()
    overlapped: list[bool] = []
    write_pack, copy = write.write_pack, staging._Copying._copy

    def writing(*args: object, **kwargs: object) -> object:
        out = write_pack(*args, **kwargs)  # type: ignore[arg-type]
        first_pack.set()
        return out

    def copying(self: staging._Copying, n: int, dst: np.ndarray, src: np.ndarray) -> None:
        if n == len(self._ends) - 1:  # the last copy: into the last pack
            overlapped.append(first_pack.wait(10))
        copy(self, n, dst, src)

    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, {"state": _leaves(4, 0.0)})  # the first save warms the pool
        mgr.wait_until_finished()
        mgr._staging.wait()
        monkeypatch.setattr(write, "write_pack", writing)
        monkeypatch.setattr(staging._Copying, "_copy", copying)
        state = _leaves(4, 10.0)
        mgr.save(2, {"state": state})
        assert overlapped == [True]  # save() waited for the held copy, the pack went out first
        for leaf in state.values():
            leaf[:] = -1  # the caller's arrays are its own again
        mgr.wait_until_finished()
        restored = mgr.restore(2)["state"]
    for i in range(4):
        np.testing.assert_array_equal(restored[f"w{i}"], np.full((128, 1024), 10.0 + i))


@pytest.mark.usefixtures("small_copies")
@pytest.mark.parametrize("async_save", [True, False])
def test_a_failed_staging_copy_fails_that_save_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    """A copy into staging memory that raises: the step is not committed (an async save reports
    it as its commit's error, a sync save raises it), the slab goes back, the next save works."""
    from cairn.handlers._train_state import staging
    from cairn.manager import CheckpointManager, CommitError

    copy = staging._Copying._copy

    class Unreadable:
        def __array__(self, *args: object, **kwargs: object) -> np.ndarray:
            raise OSError(5, "Input/output error")

    def failing(self: staging._Copying, n: int, dst: np.ndarray, src: np.ndarray) -> None:
        copy(self, n, dst, Unreadable() if n == 3 else src)  # type: ignore[arg-type]

    with CheckpointManager(tmp_path / "run", async_save=async_save) as mgr:
        mgr.save(1, {"state": _leaves(4, 0.0)})
        mgr.wait_until_finished()
        mgr._staging.wait()
        monkeypatch.setattr(staging._Copying, "_copy", failing)
        if async_save:
            assert mgr.save(2, {"state": _leaves(4, 1.0)})
            with pytest.raises(CommitError, match="staging memory") as caught:
                mgr.wait_until_finished()
        else:
            with pytest.raises(RuntimeError, match="staging memory") as caught:
                mgr.save(2, {"state": _leaves(4, 1.0)})
        assert "Input/output error" in repr(caught.value.__cause__ or caught.value)
        assert mgr.all_steps() == [1]
        assert mgr._staging._in_use == 0  # the failed save's slab is back in the pool
        monkeypatch.undo()
        monkeypatch.setattr(staging, "_COPY_PIECE", 64 * 1024)
        mgr.save(3, {"state": _leaves(4, 3.0)})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 3]
        np.testing.assert_array_equal(mgr.restore(3)["state"]["w3"], np.full((128, 1024), 6.0))
    left = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert left == [".cairn.lock", "checkpoint_1", "checkpoint_3"]  # no temporary directory


@pytest.mark.usefixtures("small_copies")
def test_release_gives_the_slab_back_only_after_the_copies_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A snapshot released while its copies run (a commit that failed before writing) keeps the
    slab from its pool until the last copy is done: another save must not stage into it."""
    from cairn.handlers._train_state import staging

    held = threading.Event()
    copy, wait = staging._Copying._copy, staging._Copying.wait

    def copying(self: staging._Copying, n: int, dst: np.ndarray, src: np.ndarray) -> None:
        if n == len(self._ends) - 1:
            held.wait(30)
        copy(self, n, dst, src)

    def waiting(self: staging._Copying, *args: object, **kwargs: object) -> None:
        held.set()  # release() waits now: let the last copy go
        wait(self, *args, **kwargs)  # type: ignore[arg-type]

    pool = StagingPool()
    handler = TrainStateHandler()
    with staging_for(pool, "state"):  # NumPy leaves: staged at once, into a new slab
        first = handler.snapshot(_leaves(4, 0.0))
    first.release()
    copies_left: list[int] = []
    give_back = pool._give_back
    monkeypatch.setattr(
        pool, "_give_back", lambda *a: (copies_left.append(snap._copying._left), give_back(*a))
    )
    monkeypatch.setattr(staging._Copying, "_copy", copying)
    monkeypatch.setattr(staging._Copying, "wait", waiting)
    with staging_for(pool, "state"):
        snap = handler.snapshot(_leaves(4, 1.0))
    assert snap._copying is not None and snap._lease is not None
    snap.release()
    assert copies_left == [0]


@pytest.mark.usefixtures("small_copies")
@pytest.mark.parametrize("options", ["packed", "zarr", "incremental", "max_pending=2"])
def test_arrays_changed_after_save_returns_are_not_in_the_step(
    tmp_path: Path, options: str
) -> None:
    """NumPy leaves changed in place, and jax leaves donated, right after each save() returns,
    while the commit may still be writing: every step restores what was given at its save."""
    import jax
    import jax.numpy as jnp

    from cairn.manager import CheckpointManager, KeepLatest

    kwargs: dict[str, object] = {
        "packed": {},
        "zarr": {"handlers": {"state": TrainStateHandler(layout="zarr")}},
        "incremental": {"incremental": True},
        "max_pending=2": {"max_pending": 2},
    }[options]
    rng = np.random.default_rng(7)
    shapes = [(int(rng.integers(1, 300)), int(rng.integers(1, 2000))) for _ in range(6)]
    host = {f"n{i}": rng.standard_normal(s).astype(np.float32) for i, s in enumerate(shapes)}
    device = {
        f"j{i}": jnp.asarray(rng.standard_normal(s), jnp.float32) for i, s in enumerate(shapes)
    }
    step_fn = jax.jit(lambda s: jax.tree.map(lambda x: x * 1.5 + 1, s), donate_argnums=0)
    expected = {}
    with CheckpointManager(tmp_path / "run", keep=KeepLatest(10), **kwargs) as mgr:  # type: ignore[arg-type]
        for step in range(6):
            if not (options == "incremental" and step % 3 == 2):  # else: the same jax arrays
                device = step_fn(device)
            expected[step] = {k: np.array(v) for k, v in {**host, **device}.items()}
            mgr.save(step, {"state": {**host, **device}})
            for leaf in host.values():
                leaf += 1.0
            if step == 0:  # the first save of a state warms the pool: the others stage
                mgr.wait_until_finished()
                mgr._staging.wait()
        mgr.wait_until_finished()
        assert mgr.all_steps() == list(range(6))
        for step, want in expected.items():
            got = mgr.restore(step)["state"]
            for key, value in want.items():
                np.testing.assert_array_equal(np.asarray(got[key]), value, err_msg=f"{step} {key}")


# ----------------------------------------------------------------------- the pool after restore()


def test_restore_prepares_the_pool_for_the_first_save(tmp_path: Path) -> None:
    """A restarted job: restore() faults in the staging memory of the restored state in the
    background (as `staging_bytes` lays it out), and the first save copies into that slab, so
    no second one is mapped; a state of another size then frees it. A reader, and a manager
    with zero_copy=True, prepare nothing."""
    import jax
    import jax.numpy as jnp

    from cairn.manager import CheckpointManager

    state = {"w": jnp.ones((512, 1024)), "b": np.arange(10.0), "k": jax.random.key(1)}
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(0, {"state": state, "meta": {"epoch": 1}})
    expected = TrainStateHandler().staging_bytes(state)
    assert expected > 2 * MiB
    for options in ({"read_only": True}, {"zero_copy": True}):
        with CheckpointManager(tmp_path / "run", **options) as other:  # type: ignore[arg-type]
            other.restore(0)
            other.wait_until_finished()
            assert other._staging.held_bytes() == 0
    with CheckpointManager(tmp_path / "run") as mgr:
        restored = mgr.restore(0)["state"]
        mgr.wait_until_finished()  # waits for the fault-in too
        held = mgr._staging.held_bytes()
        assert held == -(-expected // PAGE) * PAGE
        step = jax.jit(lambda s: {**s, "w": s["w"] + 1}, donate_argnums=0)
        mgr.save(1, {"state": restored})
        new = step(restored)
        assert restored["w"].is_deleted()  # copied into the prepared slab: donated
        mgr.wait_until_finished()
        assert mgr._staging.held_bytes() == held  # that slab, not a second one
        mgr.save(2, {"state": {"w": new["w"][:64]}})  # another size: the slab goes
        mgr.wait_until_finished()
        assert mgr._staging.held_bytes() < held
    with CheckpointManager(tmp_path / "run") as mgr:  # saves another item than it restored
        restored = mgr.restore(0, {"state": None, "meta": None})
        mgr.wait_until_finished()
        assert mgr._staging.held_bytes() == held
        mgr.save(3, {"other": {"w": restored["state"]["w"][:64]}})
        mgr.wait_until_finished()
        assert mgr._staging.held_bytes() < held  # the memory prepared for "state" is freed


def test_a_slab_that_cannot_be_mapped_leaves_the_save_to_views(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No memory to map a slab (ENOMEM): the lease is refused with a warning, nothing held, and
    the snapshot keeps views; the save does not fail."""
    from cairn.handlers import _staging

    def no_memory(*args: object, **kwargs: object) -> None:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(_staging.Slab, "__init__", no_memory)
    pool = StagingPool()
    with caplog.at_level(logging.WARNING, logger="cairn"):
        assert pool.lease("state", MiB) is None
        with staging_for(pool, "state"):
            snap = TrainStateHandler().snapshot({"w": np.ones((256, 1024), np.float32)})
    assert snap._lease is None and pool.held_bytes() == 0
    assert "Cannot allocate memory" in caplog.text


@pytest.mark.parametrize(
    "options",
    [{}, {"layout": "zarr"}, {"save_dtype": "bfloat16"}, {"chunk_bytes": 64 * 1024}],
    ids=["packed", "zarr", "save_dtype", "small_chunks"],
)
def test_staging_bytes_is_what_a_snapshot_leases(options: dict[str, object]) -> None:
    """What a restore prepares is what the next save asks for, to the byte: padded edge chunks,
    a cast, a typed PRNG key, NumPy leaves and scalars included, nothing read."""
    import jax
    import jax.numpy as jnp

    state = {
        "w": jnp.ones((1237, 33)),  # a prime row count: padded edge chunks
        "b": jnp.arange(70_000, dtype=jnp.float32),
        "key": jax.random.key(0),
        "n": np.arange(10.0),
        "s": np.float32(2),
    }
    handler = TrainStateHandler(**options)  # type: ignore[arg-type]
    asked: list[int] = []

    class Recording(StagingPool):
        def lease(self, key: str, nbytes: int):  # type: ignore[no-untyped-def]
            asked.append(nbytes)
            return super().lease(key, nbytes)

    with staging_for(Recording(), "state"):
        handler.snapshot(state)
    assert asked == [handler.staging_bytes(state)]
