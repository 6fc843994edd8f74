"""Sending each local part to its holders in the background, and receiving the parts this
process holds of others', over `multiprocessing.connection`: the standard library's framed
connections, each authenticated by a key its listener drew (HMAC challenge), no wire format of
ours. Not JAX's collectives: they must be called on the training loop's thread, in its order
(two threads issuing them pair them up differently on two processes and deadlock,
docs/design/multitier-research.md section 4), so a transfer through them stops training.

One exchange per part and holder: the sender sends a header (JSON: owner, step, whether it
serves a restore, and the size of each piece of the part, `replicas.pack_part`: none when the
owner has no part of that step to send), then the pieces' bytes as they are (a file whose pages
are all in memory, on a RAM disk or in the page cache, by ``sendfile``; any other read from the
disk with ``O_DIRECT`` first; received into one buffer, each piece on a page, and written to
the holder's disk with ``O_DIRECT``). Both buffers are reused from one save to the next
(`_Buffers`): memory a process touches for the first time costs the kernel a fault per page,
and that was most of the transfer's CPU here. Only the header is one of
`Connection`'s messages: its receive copies every message three times over (1.2 s for 512 MiB
here, against 0.25 s into a buffer of the right size). The holder commits the part (`deliver`:
every file checked against the owner's manifest) and answers ``ok`` or what failed. A part is
held once its holder answered ``ok``. A restore's part goes back to its owner the same way,
each piece hashed as its bytes arrive (`_Hashes`), and waits in memory until the owner's
restore takes it (`fetched`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge
from typing import Any

import numpy as np
import xxhash

from cairn.handlers.io import (
    aligned_empty,
    lower_thread_priority,
    read_direct,
    resident,
    round_up,
)

log = logging.getLogger("cairn")

Address = tuple[str, int]
# A header is a JSON object, a size per piece: anything longer is refused unread.
_HEADER_BYTES = 1 << 20
_PIECES = 100_000  # the most pieces one header may announce


@dataclasses.dataclass(frozen=True)
class FilePiece:
    """A piece of a part read from an open file: `size` bytes of `fd` from its start. Sent with
    ``sendfile`` where every page of it is in memory (`resident`: a RAM disk's file, or one in
    the page cache), else read with ``O_DIRECT`` where the filesystem allows it (a file written
    with ``O_DIRECT`` is not in the page cache, and reading it through there cost 1.3 s of
    kernel CPU per 512 MiB here, the page cache's pages made and dropped). The sender closes
    `fd` once the part is sent (or not)."""

    fd: int
    size: int


Piece = bytes | memoryview | FilePiece


class Received(list[memoryview]):
    """A part sent back for a restore, as it came: its pieces, and `digests`, each piece's
    XXH3-128 (hex), hashed as its bytes arrived (`_Hashes`)."""

    def __init__(self, pieces: Sequence[memoryview] = (), digests: Sequence[str] = ()) -> None:
        super().__init__(pieces)
        self.digests = list(digests)


class Post:
    """This process's side of moving parts: a listener thread that accepts connections, each
    handled on a thread of its own that receives a part of a process this one holds for and
    commits it (`deliver`, one commit at a time), or this process's own part sent back for a
    restore (kept until `fetched` takes it); and two sender threads, one for the replicas of
    saves (at background priority, as the receiving threads of replicas), one for a restore's
    parts sent back (at normal priority, as their receiving threads: every process waits in the
    restore), one save or one restore's parts in flight at a time. Every read and write on a
    connection is bounded by `timeout` (a stopped peer, or a stray connection, holds no thread
    for ever).

    Concurrency: `send`, `send_back`, `wait_sent`, `wait_received`, `fetched` and `close` run
    on the caller thread. `send` first waits until the send before it was answered, so at most
    one part is in flight, and a save returns only once the part before it is held. `deliver`
    runs on a receiving thread and touches only the managers of other processes' parts, which
    the caller thread only waits on (drain) or reads after `wait_sent` and a meeting of every
    process. The memory parts move through is kept for the next (at most `spare` buffers,
    `_Buffers`, thread-safe; a buffer taken is used by one thread until given back)."""

    def __init__(self, timeout: float, me: int, *, spare: int = 2) -> None:
        self._timeout, self._me = timeout, me
        self._deliver: Callable[[int, int, list[memoryview]], None] | None = None  # by `open`
        self._opened = threading.Event()
        self.key = os.urandom(32)
        self._listener = Listener((reachable_host(), 0))  # authenticated per connection
        self._delivering = threading.Lock()
        self.address: Address = self._listener.address
        self._peers: dict[int, tuple[Address, bytes]] = {}
        self._received: dict[int, int] = {}  # owner -> the newest step it sent (or had none of)
        self._back: dict[int, Received] = {}  # step -> this process's part, sent back
        self._changed = threading.Condition()
        self._buffers = _Buffers(spare)
        self._closing = False
        self._sender = ThreadPoolExecutor(
            1, thread_name_prefix="cairn-local-send", initializer=lower_thread_priority
        )
        # no training step runs beside a restore, and a niced thread lost the cores to this
        # process's own reads there
        self._sender_back = ThreadPoolExecutor(1, thread_name_prefix="cairn-local-send-back")
        self._sending: Future[None] | None = None  # a save's part
        self._sending_back: Future[None] | None = None  # a restore's parts
        self._thread = threading.Thread(target=self._serve, name="cairn-local-post", daemon=True)
        self._thread.start()

    def meet(self, peers: dict[int, tuple[Address, bytes]]) -> None:
        """Every other process's listener address and key (gathered at open)."""
        self._peers = dict(peers)

    def open(self, deliver: Callable[[int, int, list[memoryview]], None]) -> None:
        """Hand the parts received to `deliver` (one that came in before waited for this, at
        most `timeout`): the listener listens as soon as the Post exists, for its address is
        published before the local tier it delivers to has opened its managers."""
        self._deliver = deliver
        self._opened.set()

    # ------------------------------------------------------------------ sending

    def send(
        self,
        owner: int,
        step: int,
        holders: Sequence[int],
        payload: Callable[[], list[Piece]],
        *,
        wait: bool,
    ) -> None:
        """Send `owner`'s part of `step` (`payload()`, built on the sender thread) to each of
        `holders`, after the send before it was answered; `wait`: until this one is, too."""
        self.wait_sent()
        self._sending = self._sender.submit(self._send, owner, step, list(holders), payload, False)
        if wait:
            self.wait_sent()

    def send_back(self, step: int, parts: Sequence[tuple[int, Callable[[], list[Piece]]]]) -> None:
        """For a restore: send each (owner, payload()) to its owner, one after the other on the
        sender thread (`wait_sent` waits for them)."""
        self.wait_sent()

        def each() -> None:
            for owner, payload in parts:
                self._send(owner, step, [owner], payload, True)

        self._sending_back = self._sender_back.submit(each)

    def wait_sent(self, *, back: bool = True) -> None:
        """Until the holders answered for the part in flight (or failed: logged); `back`: and
        the owners for the parts sent back."""
        if self._sending is not None:
            self._sending.result()
            self._sending = None
        if back and self._sending_back is not None:
            self._sending_back.result()
            self._sending_back = None

    def busy(self) -> bool:
        """A save's part is in flight (parts sent back are a restore's, not a save's)."""
        return self._sending is not None and not self._sending.done()

    def _send(
        self,
        owner: int,
        step: int,
        holders: list[int],
        payload: Callable[[], list[Piece]],
        back: bool,
    ) -> None:
        """On the sender thread: every failure is logged (that replica is missing), none raised."""
        opened: list[Piece] = []  # the part as `payload` gave it: its files are closed here
        pieces: list[Piece] = []  # as it is sent
        buffer = None
        try:
            opened = payload()
            buffer, pieces = self._read_files(opened)
        except Exception as e:  # its holders hear that there is none, and stop waiting for it
            log.error("cairn: step %d: process %d's part cannot be sent: %r", step, owner, e)
        try:
            sizes = [_size(p) for p in pieces]
            header = {"owner": owner, "step": step, "back": back, "sizes": sizes}
            for holder in holders:
                try:
                    address, key = self._peers[holder]
                    with connect(address, key, self._timeout) as conn:
                        conn.send_bytes(json.dumps(header).encode())
                        _write_pieces(conn, pieces)
                        if not conn.poll(self._timeout):
                            raise TimeoutError(f"no answer within {self._timeout:g} s")
                        answer = conn.recv_bytes(_HEADER_BYTES).decode(errors="replace")
                    if answer != "ok":
                        raise RuntimeError(answer)
                except Exception as e:  # this replica is missing; the part has its other sources
                    log.error(
                        "cairn: step %d: process %d did not take process %d's part: %r",
                        step,
                        holder,
                        owner,
                        e,
                    )
        finally:
            _close_files(opened)
            if buffer is not None:
                self._buffers.give(buffer)

    def _read_files(self, pieces: list[Piece]) -> tuple[np.ndarray | None, list[Piece]]:
        """The pieces, each file not all in memory (`resident`) read into one reused buffer:
        the buffer (None if none: once the part is sent, `_Buffers.give` it back) and the
        pieces, those files' in memory, the others as they were (to be sent with ``sendfile``;
        the caller closes every file's descriptor)."""
        files = [p for p in pieces if isinstance(p, FilePiece) and not resident(p.fd, p.size)]
        if not files:
            return None, pieces
        at, total = _layout([f.size for f in files])
        buffer = self._buffers.take(total)
        try:
            into = {f.fd: buffer[a : a + round_up(f.size)] for a, f in zip(at, files, strict=True)}
            read = [
                read_direct(p.fd, p.size, into[p.fd])
                if isinstance(p, FilePiece) and p.fd in into
                else p
                for p in pieces
            ]
        except BaseException:
            self._buffers.give(buffer)
            raise
        return buffer, read

    # ------------------------------------------------------------------ receiving

    def _serve(self) -> None:
        """Accept connections (no handshake here: a stray one that says nothing must not hold
        the others up), each handled on a thread of its own."""
        while True:
            try:
                conn = self._listener.accept()
            except OSError as e:
                if self._closing:
                    return
                log.warning("cairn: the local tier's listener: %r", e)
                continue
            if self._closing:
                conn.close()
                return
            threading.Thread(
                target=self._handle, args=(conn,), name="cairn-local-receive", daemon=True
            ).start()

    def _handle(self, conn: Connection) -> None:
        with conn:
            try:
                _bound(conn, self._timeout)
                deliver_challenge(conn, self.key)
                answer_challenge(conn, self.key)
            except Exception as e:  # without the key, or silent
                log.warning("cairn: the local tier refused a connection: %r", e)
                return
            self._take(conn)

    def _take(self, conn: Connection) -> None:
        owner = step = None  # known once the header is read: then the part is resolved
        back = False
        try:
            if not conn.poll(self._timeout):
                raise TimeoutError(f"no header within {self._timeout:g} s")
            header = _header(conn.recv_bytes(_HEADER_BYTES))
            owner, step, back = header["owner"], header["step"], header["back"]
            if not back:  # a replica: the training step goes first (a restore's part: its own)
                lower_thread_priority()
            if back and owner != self._me:
                raise ValueError(f"a part of process {owner} sent back to process {self._me}")
            take = _fresh if back else self._buffers.take  # a part sent back: its restore's
            memory, pieces = _buffer_for(header["sizes"], take)
            if back:  # hashed as it arrives: the restore waiting for it need not hash it all
                hashes = _Hashes(pieces)
                try:
                    _read_pieces(conn, pieces, hashes.came)
                finally:
                    hashes.stop()
                with self._changed:
                    self._back[step] = Received(pieces, hashes.digests(self._timeout))
                    self._changed.notify_all()
            else:
                try:
                    _read_pieces(conn, pieces)
                    if pieces:
                        self._hand_over(owner, step, pieces)
                finally:  # committed, refused or cut off: its memory serves the next part
                    self._buffers.give(memory)
            answer = "ok"
        except Exception as e:
            answer = f"{type(e).__name__}: {e}"
            log.error("cairn: a part sent by process %s was not taken: %s", owner, answer)
        if owner is not None and step is not None:  # before the answer: once the sender has
            with self._changed:  # it, nothing here may change (it may `forget_back` next)
                if not back:
                    self._received[owner] = max(step, self._received.get(owner, step))
                elif owner == self._me:  # one that broke on the way: its restore stops waiting
                    self._back.setdefault(step, Received())
                self._changed.notify_all()
        try:
            conn.send_bytes(answer.encode()[:_HEADER_BYTES])
        except OSError as e:
            log.warning("cairn: could not answer process %s: %r", owner, e)

    def _hand_over(self, owner: int, step: int, pieces: list[memoryview]) -> None:
        """`deliver` a part received (once the local tier opened)."""
        if not self._opened.is_set():
            log.info("cairn: a part of process %d came before the local tier opened", owner)
        if not self._opened.wait(self._timeout):
            raise RuntimeError("this process's local tier did not open")
        assert self._deliver is not None
        with self._delivering:  # one commit at a time
            self._deliver(owner, step, pieces)

    def wait_received(self, owners: Sequence[int], step: int) -> list[int]:
        """Until each of `owners` sent its part of `step` (or a newer one, or said it had none),
        at most `timeout`; the owners that did not."""

        def missing() -> list[int]:
            return [q for q in owners if self._received.get(q, -1) < step]

        with self._changed:
            self._changed.wait_for(lambda: not missing(), self._timeout)
            return missing()

    def fetched(self, step: int) -> Received | None:
        """This process's part of `step` sent back for a restore, taken (at most `timeout`;
        empty where its holder had none to send); None if it did not come."""
        with self._changed:
            self._changed.wait_for(lambda: step in self._back, self._timeout)
            return self._back.pop(step, None)

    def forget_back(self) -> None:
        """Drop the parts sent back that no restore took (one that came after its owner
        stopped waiting): once every process met after its sends were answered, none is in
        flight."""
        with self._changed:
            self._back.clear()

    def close(self) -> None:
        """Stop sending (after the part in flight) and listening."""
        try:
            self.wait_sent()
        finally:
            self._sender.shutdown()
            self._sender_back.shutdown()
            self._closing = True
            with contextlib.suppress(OSError):  # wakes the listener thread out of accept()
                socket.create_connection(self.address, timeout=self._timeout).close()
            self._thread.join(self._timeout)
            self._listener.close()
            self.forget_back()
            self._buffers.clear()


def _header(data: bytes) -> dict[str, Any]:
    """A part's header, checked: owner and step ints, back a bool, sizes a list of ints >= 0."""
    header = json.loads(data)
    if not (
        isinstance(header, dict)
        and all(_is_int(header.get(k)) for k in ("owner", "step"))
        and isinstance(header.get("back"), bool)
        and isinstance(header.get("sizes"), list)
        and len(header["sizes"]) <= _PIECES
        and all(_is_int(n) and n >= 0 for n in header["sizes"])
    ):
        raise ValueError(f"header {header!r:.200}")
    return header


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _write_pieces(conn: Connection, pieces: Sequence[Piece]) -> None:
    """The pieces' bytes, as they are, after the header (a file's by ``sendfile``)."""
    fd = conn.fileno()
    for piece in pieces:
        if isinstance(piece, FilePiece):
            at = 0
            while at < piece.size:
                n = os.sendfile(fd, piece.fd, at, piece.size - at)
                if n == 0:
                    raise EOFError(f"a file of the part ended at byte {at} of {piece.size}")
                at += n
            continue
        view = memoryview(piece).cast("B")
        while view.nbytes:
            view = view[os.write(fd, view) :]


def _size(piece: Piece) -> int:
    return piece.size if isinstance(piece, FilePiece) else memoryview(piece).nbytes


def _close_files(pieces: Sequence[Piece]) -> None:
    for piece in pieces:
        if isinstance(piece, FilePiece):
            os.close(piece.fd)


def _buffer_for(
    sizes: Sequence[int], take: Callable[[int], np.ndarray]
) -> tuple[np.ndarray, list[memoryview]]:
    """Room for pieces of `sizes` bytes in one buffer (`take`), each on a page of its own, so
    that a holder's commit writes them to its disk with ``O_DIRECT``, with no copy through the
    page cache: the buffer, and the pieces (views of it)."""
    at, total = _layout(sizes)
    buffer = take(total)
    return buffer, [buffer[a : a + n].data for a, n in zip(at, sizes, strict=True)]


def _read_pieces(
    conn: Connection, pieces: Sequence[memoryview], came: Callable[[int], None] | None = None
) -> None:
    """Fill `pieces` in order from `conn` (after the header); `came(n)` after each read, `n`
    the bytes in so far (the pieces laid end to end)."""
    fd, views = conn.fileno(), [p for p in pieces if p.nbytes]
    total = got = sum(p.nbytes for p in views)
    while views:
        n = os.readv(fd, views[:1024])
        if n == 0:
            raise EOFError(f"the connection closed within a part of {total} bytes")
        got -= n
        if came is not None:
            came(total - got)
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


class _Hashes:
    """The XXH3-128 of each piece of a part, hashed on a thread of its own as the piece's bytes
    arrive (`came`, from the receiving thread; python-xxhash lets go of the GIL), a block at
    least `_HASH_STEP` long at a time: once the last byte is in, only the last block is left
    to hash. A restore's owner then checks each file of the part against its record at once,
    rather than hashing 512 MiB after the transfer (0.08 s here, beside the holder's reads)."""

    def __init__(self, pieces: Sequence[memoryview]) -> None:
        self._sums = [xxhash.xxh3_128() for _ in pieces]
        self._pieces = [(s, p) for s, p in zip(self._sums, pieces, strict=True) if p.nbytes]
        self._total = sum(p.nbytes for _, p in self._pieces)
        self._came, self._stopped = 0, False
        self._changed = threading.Condition()
        self._done = threading.Event()
        self._error: BaseException | None = None
        threading.Thread(target=self._run, name="cairn-local-hash", daemon=True).start()

    def came(self, n: int) -> None:
        if n - self._came >= _HASH_STEP or n == self._total:
            with self._changed:
                self._came = n
                self._changed.notify()

    def stop(self) -> None:
        """No more bytes will come (all came, or the part broke off)."""
        with self._changed:
            self._stopped = True
            self._changed.notify()

    def digests(self, timeout: float) -> list[str]:
        """Each piece's hex digest, once all its bytes came and were hashed."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"a part's hashes took over {timeout:g} s")
        if self._error is not None:
            raise self._error
        return [s.hexdigest() for s in self._sums]

    def _run(self) -> None:
        done, piece, start = 0, 0, 0  # bytes hashed; the piece they end in, and its start
        try:
            while done < self._total:
                with self._changed:
                    self._changed.wait_for(functools.partial(self._more, done))
                    came = self._came
                if came == done:
                    raise EOFError(f"a part broke off after {done} of {self._total} bytes")
                while done < came:
                    digest, view = self._pieces[piece]
                    end = min(came, start + view.nbytes)
                    digest.update(view[done - start : end - start])
                    done = end
                    if done == start + view.nbytes:
                        piece, start = piece + 1, done
        except BaseException as e:  # the part is refused (or never completes) anyway
            self._error = e
        finally:
            self._done.set()

    def _more(self, done: int) -> bool:
        return self._came > done or self._stopped


_HASH_STEP = 8 << 20


def _layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Where pieces of `sizes` go in one buffer, each starting on a page, and its size."""
    at, total = [], 0
    for n in sizes:
        at.append(total)
        total += round_up(n)
    return at, total


def _fresh(nbytes: int) -> np.ndarray:
    return aligned_empty((nbytes,), np.dtype(np.uint8))


class _Buffers:
    """Page-aligned memory for the parts this process sends and receives, reused from one save
    to the next: memory touched for the first time costs the kernel a fault per page, and that
    cost 2.5 s of CPU for the 1 GiB two processes received in one save here, against 0.8 s for
    the rest of the transfer (socket, and ``O_DIRECT`` write) into memory touched before. A
    buffer is a little larger than asked (a part grows by a few bytes from one save to the next;
    pages never touched cost nothing). At most `spare` buffers are kept between uses, the
    largest. Thread-safe."""

    def __init__(self, spare: int) -> None:
        self._spare = spare
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            fits = [b for b in self._free if b.nbytes >= nbytes]
            if fits:
                best = min(fits, key=lambda b: b.nbytes)
                self._free.remove(best)
                return best
        return _fresh(round_up(nbytes + nbytes // 16, 1 << 20))

    def give(self, buffer: np.ndarray) -> None:
        with self._lock:
            self._free.append(buffer)
            self._free.sort(key=lambda b: b.nbytes)
            del self._free[: -self._spare]

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


def connect(address: Address, key: bytes, timeout: float) -> Connection:
    """A connection to a listener of `Post`, both sides authenticated with `key` (as
    `multiprocessing.connection.Client` does), every read and write bounded by `timeout`."""
    sock = socket.create_connection(address, timeout=timeout)
    sock.setblocking(True)  # Connection reads the descriptor: the kernel's timeouts bound it
    conn = Connection(sock.detach())
    try:
        _bound(conn, timeout)
        answer_challenge(conn, key)
        deliver_challenge(conn, key)
    except BaseException:
        conn.close()
        raise
    return conn


def _bound(conn: Connection, timeout: float) -> None:
    """Every read and write of `conn` fails after `timeout` seconds without progress (the
    socket's own timeouts, SO_RCVTIMEO and SO_SNDTIMEO): a peer that stops, or a stray
    connection that says nothing, cannot hold a thread for ever."""
    whole = max(timeout, 0.001)
    value = struct.pack("ll", int(whole), int((whole % 1) * 1_000_000))
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:  # the same socket, another fd
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


def reachable_host() -> str:
    """The address other processes reach this one at: the one it reaches JAX's coordination
    service from (a UDP socket's route to it; nothing is sent), else its host name's."""
    from jax._src import distributed

    address = distributed.global_state.coordinator_address or "127.0.0.1:0"
    host, _, port = address.rpartition(":")
    try:
        where = socket.getaddrinfo(
            host.strip("[]"), int(port or 0), socket.AF_INET, socket.SOCK_DGRAM
        )[0][4]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(where)
            return str(probe.getsockname()[0])
    except (OSError, ValueError):
        return socket.gethostbyname(socket.gethostname())
