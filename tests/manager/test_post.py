"""The local tier's transport for replicas (`post.Post`), two of them in one process over real
sockets on 127.0.0.1: a part goes to its holder and is answered, a file straight from the disk;
a part sent back for a restore waits for its owner to take it; what a holder receives goes to
its disk past the page cache; what a holder refuses (a
delivery that raises, a crafted header, a part shorter than its header says, a connection
without the key, a peer that says nothing) is answered or dropped, logged, and never stops the
listener; `wait_received`, `fetched` and `close` are bounded."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections.abc import Iterator
from multiprocessing.connection import Client, Connection
from pathlib import Path

import numpy as np
import pytest
import xxhash
from support.logwait import logged
from support.pages import PAGE, evict, resident_pages

from cairn.handlers import LocalDestination
from cairn.handlers.io import BACKGROUND_NICE, resident
from cairn.manager._core import post
from cairn.manager._core.post import FilePiece, Post, _Buffers


def joined(pieces: list[memoryview]) -> bytes:
    return b"|".join(bytes(p) for p in pieces)


class Holder:
    """A Post (of process `me`) whose deliveries are recorded, each part's pieces joined by
    ``|`` (or refused, when `refuse` is set)."""

    def __init__(self, me: int = 1, timeout: float = 5.0) -> None:
        self.got: list[tuple[int, int, bytes]] = []
        self.refuse: str | None = None
        self.post = Post(timeout, me)
        self.post.open(self.deliver)

    def deliver(self, owner: int, step: int, pieces: list[memoryview]) -> None:
        if self.refuse:
            raise ValueError(self.refuse)
        self.got.append((owner, step, joined(pieces)))


@pytest.fixture
def pair() -> Iterator[tuple[Holder, Holder]]:
    a, b = Holder(0), Holder(1)
    peers = {0: (a.post.address, a.post.key), 1: (b.post.address, b.post.key)}
    a.post.meet(peers)
    b.post.meet(peers)
    yield a, b
    a.post.close()
    b.post.close()


def test_a_part_reaches_its_holder_before_the_next_send(pair: tuple[Holder, Holder]) -> None:
    a, b = pair
    a.post.send(0, 10, [1], lambda: [b"part", b"of 10"], wait=False)
    a.post.send(0, 12, [1], lambda: [b"part of 12" * 1000], wait=True)  # waits for 10's answer
    assert b.got == [(0, 10, b"part|of 10"), (0, 12, b"part of 12" * 1000)]
    assert b.post.wait_received([0], 12) == []
    assert not a.post.busy()


def test_a_part_that_cannot_be_built_is_announced_as_none(
    pair: tuple[Holder, Holder], caplog: pytest.LogCaptureFixture
) -> None:
    """The owner's part did not commit: the holder hears of step 14 without a part, so it
    does not wait for it."""
    a, b = pair

    def broken() -> list[bytes]:
        raise OSError("disk gone")

    a.post.send(0, 14, [1], broken, wait=True)
    assert b.got == [] and b.post.wait_received([0], 14) == []
    assert "process 0's part cannot be sent: OSError('disk gone')" in caplog.text


def test_a_refused_delivery_is_answered_and_logged(
    pair: tuple[Holder, Holder], caplog: pytest.LogCaptureFixture
) -> None:
    a, b = pair
    b.refuse = "hashes differ"
    a.post.send(0, 16, [1], lambda: [b"bad"], wait=True)
    assert "did not take process 0's part: RuntimeError('ValueError: hashes differ')" in caplog.text
    b.refuse = None
    a.post.send(0, 18, [1], lambda: [b"good"], wait=True)  # the listener goes on
    assert b.got == [(0, 18, b"good")]


@pytest.mark.parametrize(
    "header",
    [
        b"not json",
        b'{"owner": "0", "step": 1, "back": false, "sizes": [7]}',
        b'{"owner": true, "step": 1, "back": false, "sizes": [7]}',
        b'{"owner": 0, "step": 1, "back": 0, "sizes": [7]}',
        b'{"owner": 0, "step": 1, "back": false, "sizes": [-7]}',
        b'{"owner": 0, "step": 1, "back": false, "sizes": [true]}',
        b'{"owner": 0, "step": 1, "back": false, "sizes": 7}',
        json.dumps({"owner": 0, "step": 1, "back": False, "sizes": [0] * 100_001}).encode(),
        b'{"owner": 0, "step": 1, "back": true, "sizes": [7]}',  # back, to another process
        b"[1, 2]",
        b" " * (2 << 20),
    ],
    ids=lambda h: h[:40].decode(),
)
def test_a_crafted_header_is_refused(
    pair: tuple[Holder, Holder], header: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    _, b = pair
    with Client(b.post.address, authkey=b.post.key) as conn:
        try:
            conn.send_bytes(header)
            os.write(conn.fileno(), b"payload")
            answer = conn.recv_bytes().decode()
        except OSError:  # refused unread (too long): the holder hung up
            answer = ""
    assert answer != "ok" and b.got == [] and not b.post._back
    assert "was not taken" in caplog.text


def test_a_part_shorter_than_its_header_says_is_refused(
    pair: tuple[Holder, Holder], caplog: pytest.LogCaptureFixture
) -> None:
    a, b = pair
    with logged("EOFError: the connection closed within a part of 103 bytes") as refused:
        with Client(b.post.address, authkey=b.post.key) as conn:
            conn.send_bytes(b'{"owner": 0, "step": 1, "back": false, "sizes": [3, 100]}')
            os.write(conn.fileno(), b"abc" + b"d" * 10)
        assert refused.wait(30)
    a.post.send(0, 2, [1], lambda: [b"next"], wait=True)  # the listener goes on
    assert b.got == [(0, 2, b"next")]


def test_a_part_sent_back_that_breaks_on_the_way_ends_the_wait_for_it(
    pair: tuple[Holder, Holder],
) -> None:
    """A restore's part whose connection closes within it (its holder died, a file of it was
    cut short while sent): its owner hears at once that none came, not after the timeout."""
    _, b = pair
    b.post._timeout = 60.0
    with Client(b.post.address, authkey=b.post.key) as conn:
        conn.send_bytes(b'{"owner": 1, "step": 7, "back": true, "sizes": [3, 100]}')
        os.write(conn.fileno(), b"abc")
    assert b.post.fetched(7) == []


def test_a_part_sent_back_is_hashed_as_it_arrives(pair: tuple[Holder, Holder]) -> None:
    """Each piece of a restore's part comes with its XXH3-128, hashed on a thread of its own
    while its bytes came in: a piece of several hashing blocks, an empty one, small ones."""
    a, b = pair
    pieces = [b"head", b"", os.urandom(3 * post._HASH_STEP + 5), b"tail"]
    a.post.send_back(41, [(1, lambda: list(pieces))])
    a.post.wait_sent()
    got = b.post.fetched(41)
    assert got is not None and [bytes(p) for p in got] == pieces
    assert got.digests == [xxhash.xxh3_128_hexdigest(p) for p in pieces]


def test_the_hashes_of_a_part_that_broke_off_are_refused() -> None:
    memory = memoryview(bytearray(2 * post._HASH_STEP))
    hashes = post._Hashes([memory[: post._HASH_STEP], memory[post._HASH_STEP :]])
    hashes.came(post._HASH_STEP + 1)
    hashes.stop()
    with pytest.raises(EOFError, match=f"broke off after {post._HASH_STEP + 1} of"):
        hashes.digests(60)


def test_a_restores_parts_move_at_normal_priority_a_saves_in_the_background(
    pair: tuple[Holder, Holder],
) -> None:
    """A save's replica is built, sent and received by threads at background priority (the
    training step goes first); a restore's part, which every process waits for, by threads at
    the caller's priority."""
    a, b = pair
    here = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: dict[str, int] = {}

    def payload(what: str) -> list[bytes]:
        seen[what] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        return [what.encode()]

    def deliver(owner: int, step: int, pieces: list[memoryview]) -> None:
        seen["received"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    b.post.open(deliver)
    a.post.send(0, 40, [1], lambda: payload("replica"), wait=True)
    a.post.send_back(40, [(1, lambda: payload("back"))])
    a.post.wait_sent()
    assert [bytes(p) for p in b.post.fetched(40) or []] == [b"back"]
    background = max(here, BACKGROUND_NICE)
    assert seen == {"replica": background, "received": background, "back": here}


def test_a_connection_without_the_key_is_refused(
    pair: tuple[Holder, Holder], caplog: pytest.LogCaptureFixture
) -> None:
    a, b = pair
    with pytest.raises(Exception, match="digest"):
        Client(b.post.address, authkey=b"guessed")
    a.post.send(0, 20, [1], lambda: [b"after"], wait=True)  # the listener goes on
    assert b.got == [(0, 20, b"after")]
    assert "refused a connection" in caplog.text


def test_a_stray_connection_holds_nothing_up(pair: tuple[Holder, Holder]) -> None:
    """A connection that never answers the challenge (a port scanner, a health check) does
    not hold up the parts that come after it."""
    a, b = pair
    with socket.create_connection(b.post.address):
        a.post.send(0, 22, [1], lambda: [b"through"], wait=True)
        assert b.got == [(0, 22, b"through")]


def test_a_silent_peer_and_a_missing_part_are_bounded() -> None:
    """A peer that connects and says nothing is dropped after the timeout; waiting for a part
    that never comes ends after the timeout too, naming the owner."""
    b = Holder(timeout=0.5)
    try:
        # a peer that says nothing until dropped
        with (
            logged("no header within 0.5 s") as dropped,
            Client(b.post.address, authkey=b.post.key),
        ):
            assert b.post.wait_received([3], 7) == [3]
            assert dropped.wait(30)
        b.post.meet({1: (b.post.address, b.post.key)})
        b.post.send(1, 8, [1], lambda: [b"x"], wait=True)  # the listener took the next one
        assert b.got == [(1, 8, b"x")]
    finally:
        b.post.close()


def test_a_holder_that_does_not_answer_is_given_up(pair: tuple[Holder, Holder]) -> None:
    """A holder stuck in its commit: the sender waits `timeout` for the answer, logs that the
    replica is missing, and the next save's send goes on."""
    a, b = pair
    a.post._timeout = 0.5  # the sender's patience (the holder's own timeout stays 5 s)
    stuck, release = threading.Event(), threading.Event()

    def slow(owner: int, step: int, pieces: list[memoryview]) -> None:
        stuck.set()
        assert release.wait(30)

    b.post.open(slow)
    try:
        with logged("process 1 did not take process 0's part: TimeoutError") as gave_up:
            a.post.send(0, 24, [1], lambda: [b"late"], wait=True)
            assert stuck.is_set() and gave_up.is_set()
    finally:
        release.set()


def test_a_part_that_comes_before_the_tier_opened_waits_for_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The listener listens as soon as its address is published, before the local tier it
    delivers to is open: a part that comes in meanwhile is delivered once it is."""
    caplog.set_level(logging.INFO, logger="cairn")
    early = Post(5.0, 1)
    sender = Holder()
    try:
        sender.post.meet({1: (early.address, early.key)})
        with logged("came before the local tier opened") as waiting:
            sender.post.send(0, 26, [1], lambda: [b"early"], wait=False)
            assert waiting.wait(30)
        got: list[tuple[int, int, bytes]] = []
        early.open(lambda owner, step, pieces: got.append((owner, step, joined(pieces))))
        sender.post.wait_sent()
        assert got == [(0, 26, b"early")]
    finally:
        sender.post.close()
        early.close()


def test_close_stops_the_listener(caplog: pytest.LogCaptureFixture) -> None:
    b = Holder()
    b.post.close()
    assert not b.post._thread.is_alive()
    with pytest.raises(OSError):
        Client(b.post.address, authkey=b.post.key)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_file_goes_from_the_disk_as_it_is_and_is_closed(
    pair: tuple[Holder, Holder], tmp_path: Path
) -> None:
    a, b = pair
    path = tmp_path / "pack"
    path.write_bytes(os.urandom(3 << 20))
    fd = os.open(path, os.O_RDONLY)
    a.post.send(0, 28, [1], lambda: [b"header", FilePiece(fd, 3 << 20)], wait=True)
    assert b.got == [(0, 28, b"header|" + path.read_bytes())]
    with pytest.raises(OSError):
        os.fstat(fd)  # the sender closed it


def test_what_a_holder_receives_goes_to_its_disk_past_the_page_cache(
    pair: tuple[Holder, Holder], tmp_path: Path
) -> None:
    """Each piece is received into page-aligned memory of its own, so a holder's commit writes
    it with O_DIRECT (a buffer from np.empty starts 16 bytes into a page and went through the
    page cache, at 0.9 s of kernel CPU per 512 MiB here): after the write, none of the file's
    whole pages are in the page cache."""
    a, b = pair
    data = os.urandom((3 << 20) + 100)
    dest = LocalDestination(tmp_path / "held")

    def deliver(owner: int, step: int, pieces: list[memoryview]) -> None:
        for k, piece in enumerate(pieces):
            dest.write_file(str(k), piece)

    b.post.open(deliver)
    a.post.send(0, 29, [1], lambda: [b"header", data], wait=True)
    assert b.post.wait_received([0], 29) == []
    assert resident_pages(tmp_path / "held" / "1") <= 1  # the tail's page
    assert (tmp_path / "held" / "1").read_bytes() == data


def test_the_memory_of_a_part_serves_the_next(pair: tuple[Holder, Holder], tmp_path: Path) -> None:
    """A part's pieces are received into one buffer, each on a page, and once it is committed
    that buffer receives the next part (memory touched before costs no page faults); the
    sender reads a part's files into a buffer it reuses too."""
    a, b = pair
    where: list[list[int]] = []
    b.post.open(lambda owner, step, pieces: where.append([address(p) for p in pieces]))
    path = tmp_path / "pack"
    path.write_bytes(os.urandom(3 << 20))
    evict(path)  # not in memory: read into a buffer with O_DIRECT, not sent with sendfile
    for step in (30, 32):
        fd = os.open(path, os.O_RDONLY)
        a.post.send(0, step, [1], lambda fd=fd: [b"header", FilePiece(fd, 3 << 20)], wait=True)
    assert where[0] == where[1] and where[0][0] % PAGE == 0
    assert where[0][1] - where[0][0] == PAGE  # the header's piece, then the file's on a page
    assert len(a.post._buffers._free) == 1 and len(b.post._buffers._free) == 1
    a.post.close()
    assert a.post._buffers._free == []  # freed at close


def test_a_file_in_memory_is_sent_with_sendfile_through_no_buffer(
    pair: tuple[Holder, Holder], tmp_path: Path
) -> None:
    """A file whose pages are all in memory (the page cache here; a RAM disk's always are)
    goes with sendfile, read into no buffer of the sender's; one that is not, with O_DIRECT
    through one; both arrive as they are, and every descriptor is closed."""
    a, b = pair
    hot, cold = tmp_path / "hot", tmp_path / "cold"
    hot.write_bytes(os.urandom(3 << 20))
    cold.write_bytes(os.urandom((1 << 20) + 5))
    evict(cold)
    fds = [os.open(hot, os.O_RDONLY), os.open(cold, os.O_RDONLY)]
    assert resident(fds[0], 3 << 20) and not resident(fds[1], (1 << 20) + 5)
    a.post.send(0, 36, [1], lambda: [FilePiece(fds[0], 3 << 20)], wait=True)
    assert a.post._buffers._free == []  # none taken
    a.post.send(0, 38, [1], lambda: [FilePiece(fds[1], (1 << 20) + 5)], wait=True)
    assert len(a.post._buffers._free) == 1
    assert b.got == [(0, 36, hot.read_bytes()), (0, 38, cold.read_bytes())]
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)  # the sender closed it


def test_at_most_spare_buffers_are_kept_the_largest() -> None:
    buffers = _Buffers(2)
    taken = [buffers.take(n) for n in (1 << 20, 3 << 20, 2 << 20)]
    for buffer in taken:
        buffers.give(buffer)
    assert [b.nbytes for b in buffers._free] == [taken[2].nbytes, taken[1].nbytes]
    assert buffers.take(1) is taken[2]  # the smallest that fits
    assert buffers.take(4 << 20).nbytes >= 4 << 20  # none fits: a new one


def address(piece: memoryview) -> int:
    return int(np.frombuffer(piece, np.uint8).ctypes.data)


def test_a_part_sent_back_waits_for_its_owner(pair: tuple[Holder, Holder]) -> None:
    """A restore's part goes back to its owner and waits there, undelivered, until the owner
    takes it; a holder that cannot read it sends none, and the owner stops waiting at once;
    one that never comes is None after the timeout."""
    a, b = pair
    a.post.send_back(30, [(1, lambda: [b"head", b"files"])])
    a.post.wait_sent()
    assert b.got == []
    assert [bytes(p) for p in b.post.fetched(30) or []] == [b"head", b"files"]

    def unreadable() -> list[bytes]:
        raise OSError("replica gone")

    a.post.send_back(32, [(1, unreadable)])
    assert b.post.fetched(32) == []
    b.post._timeout = 0.2
    assert b.post.fetched(34) is None


def test_a_part_sent_back_that_no_restore_took_is_forgotten(
    pair: tuple[Holder, Holder], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A part that came after its owner stopped waiting is not kept for the rest of the run,
    even where the holder's receiving thread is slow to finish after its answer (held here
    until the part was forgotten: nothing it does then may bring the part back)."""
    a, b = pair
    forgotten = threading.Event()
    send_bytes = Connection.send_bytes

    def answer_then_hold(conn: Connection, data: bytes) -> None:
        send_bytes(conn, data)
        if data == b"ok" and threading.current_thread().name == "cairn-local-receive":
            forgotten.wait(5)

    monkeypatch.setattr(Connection, "send_bytes", answer_then_hold)
    a.post.send_back(40, [(1, lambda: [b"late" * 1000])])
    a.post.wait_sent()
    assert 40 in b.post._back
    b.post.forget_back()
    forgotten.set()
    b.post._timeout = 0.5
    assert b.post.fetched(40) is None
