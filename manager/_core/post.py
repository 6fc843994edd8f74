"""Sending each local part to its holders in the background, and receiving the parts this
process holds of others', over `multiprocessing.connection`: the standard library's framed
connections, each authenticated by a key its listener drew (HMAC challenge), no wire format of
ours. Not JAX's collectives: they must be called on the training loop's thread, in its order
(two threads issuing them pair them up differently on two processes and deadlock,
docs/design/multitier-research.md section 4), so a transfer through them stops training.

One exchange per part and holder: the sender sends a header (JSON: owner, step) and the payload
(`replicas.pack_part`; empty when the owner has no part of that step to send), the holder
commits the part (`deliver`: every file checked against the owner's manifest) and answers
``ok`` or what failed. A part is held once its holder answered ``ok``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge

log = logging.getLogger("cairn")

Address = tuple[str, int]
_HEADER_BYTES = 4096  # a header is a short JSON object: anything longer is refused unread


class Post:
    """This process's side of moving parts: a listener thread that accepts connections, each
    handled on a thread of its own that receives a part of a process this one holds for and
    commits it (`deliver`, one commit at a time); and one sender thread that sends this
    process's parts to their holders, one save at a time. Every read and write on a connection
    is bounded by `timeout` (a stopped peer, or a stray connection, holds no thread for ever).

    Concurrency: `send`, `wait_sent`, `wait_received` and `close` run on the caller thread.
    `send` first waits until the send before it was answered, so at most one part is in
    flight, and a save returns only once the part before it is held. `deliver` runs on a
    receiving thread and touches only the managers of other processes' parts, which the caller
    thread only waits on (drain) or reads after `wait_sent` and a meeting of every process."""

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self._deliver: Callable[[int, int, bytes], None] | None = None  # set by `open`
        self._opened = threading.Event()
        self.key = os.urandom(32)
        self._listener = Listener((reachable_host(), 0))  # authenticated per connection
        self._delivering = threading.Lock()
        self.address: Address = self._listener.address
        self._peers: dict[int, tuple[Address, bytes]] = {}
        self._received: dict[int, int] = {}  # owner -> the newest step it sent (or had none of)
        self._changed = threading.Condition()
        self._closing = False
        self._sender = ThreadPoolExecutor(1, thread_name_prefix="cairn-local-send")
        self._sending: Future[None] | None = None
        self._thread = threading.Thread(target=self._serve, name="cairn-local-post", daemon=True)
        self._thread.start()

    def meet(self, peers: dict[int, tuple[Address, bytes]]) -> None:
        """Every other process's listener address and key (gathered at open)."""
        self._peers = dict(peers)

    def open(self, deliver: Callable[[int, int, bytes], None]) -> None:
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
        payload: Callable[[], bytes],
        *,
        wait: bool,
    ) -> None:
        """Send `owner`'s part of `step` (`payload()`, built on the sender thread) to each of
        `holders`, after the send before it was answered; `wait`: until this one is, too."""
        self.wait_sent()
        self._sending = self._sender.submit(self._send, owner, step, list(holders), payload)
        if wait:
            self.wait_sent()

    def wait_sent(self) -> None:
        """Until the holders answered for the part in flight (or failed: logged)."""
        if self._sending is not None:
            self._sending.result()
            self._sending = None

    def busy(self) -> bool:
        return self._sending is not None and not self._sending.done()

    def _send(
        self, owner: int, step: int, holders: list[int], payload: Callable[[], bytes]
    ) -> None:
        """On the sender thread: every failure is logged (that replica is missing), none raised."""
        try:
            data = payload()
        except Exception as e:  # its holders hear that there is none, and stop waiting for it
            log.error("cairn: step %d: this process's part cannot be sent: %r", step, e)
            data = b""
        header = json.dumps({"owner": owner, "step": step}).encode()
        for holder in holders:
            try:
                address, key = self._peers[holder]
                with connect(address, key, self._timeout) as conn:
                    conn.send_bytes(header)
                    conn.send_bytes(data)
                    if not conn.poll(self._timeout):
                        raise TimeoutError(f"no answer within {self._timeout:g} s")
                    answer = conn.recv_bytes(_HEADER_BYTES).decode(errors="replace")
                if answer != "ok":
                    raise RuntimeError(answer)
            except Exception as e:  # this replica is missing; the part has its other sources
                log.error(
                    "cairn: step %d: process %d did not take this process's part: %r",
                    step,
                    holder,
                    e,
                )

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
        try:
            if not conn.poll(self._timeout):
                raise TimeoutError(f"no header within {self._timeout:g} s")
            header = json.loads(conn.recv_bytes(_HEADER_BYTES))
            if not isinstance(header, dict) or not all(
                isinstance(header.get(k), int) and not isinstance(header.get(k), bool)
                for k in ("owner", "step")
            ):
                raise ValueError(f"header {header!r}")
            owner, step = header["owner"], header["step"]
            if not conn.poll(self._timeout):
                raise TimeoutError(f"no part within {self._timeout:g} s")
            data = conn.recv_bytes()
            if data:
                if not self._opened.is_set():
                    log.info("cairn: a part of process %d came before the local tier opened", owner)
                if not self._opened.wait(self._timeout):
                    raise RuntimeError("this process's local tier did not open")
                assert self._deliver is not None
                with self._delivering:  # one commit at a time
                    self._deliver(owner, step, data)
            answer = "ok"
        except Exception as e:
            answer = f"{type(e).__name__}: {e}"
            log.error("cairn: a part sent by process %s was not taken: %s", owner, answer)
        try:
            conn.send_bytes(answer.encode()[:_HEADER_BYTES])
        except OSError as e:
            log.warning("cairn: could not answer process %s: %r", owner, e)
        if owner is not None and step is not None:
            with self._changed:
                self._received[owner] = max(step, self._received.get(owner, step))
                self._changed.notify_all()

    def wait_received(self, owners: Sequence[int], step: int) -> list[int]:
        """Until each of `owners` sent its part of `step` (or a newer one, or said it had none),
        at most `timeout`; the owners that did not."""

        def missing() -> list[int]:
            return [q for q in owners if self._received.get(q, -1) < step]

        with self._changed:
            self._changed.wait_for(lambda: not missing(), self._timeout)
            return missing()

    def close(self) -> None:
        """Stop sending (after the part in flight) and listening."""
        try:
            self.wait_sent()
        finally:
            self._sender.shutdown()
            self._closing = True
            with contextlib.suppress(OSError):  # wakes the listener thread out of accept()
                socket.create_connection(self.address, timeout=self._timeout).close()
            self._thread.join(self._timeout)
            self._listener.close()


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
