"""A counting HTTP reverse proxy: how many requests one process makes to an object-store server.

Each process of a multi-process job starts its own `CountingProxy` in front of the shared server
(moto's S3 server, fake-gcs-server) and points its client at `proxy.url`; the proxy forwards every
request unchanged and records it, so its log is that process's requests::

    with CountingProxy("http://127.0.0.1:5000") as proxy:
        ...  # a client that sends its requests to proxy.url
    count_by_method(proxy.requests())  # {"GET": 3, "PUT": 3}

Forwarding: HTTP/1.1 with keep-alive on both sides, one upstream connection per client connection
(http.client, reconnected when the server has closed it). The Host header goes upstream as the
client sent it (an S3 client signs the host it connects to, here the proxy's); hop-by-hop headers
(Connection, Keep-Alive, Transfer-Encoding, ...) are dropped. `Expect: 100-continue` is answered
by the proxy itself (BaseHTTPRequestHandler does so under HTTP/1.1) and not forwarded. A request
body, sent with Content-Length or chunked, is read whole before it is forwarded (at most one body
in memory per connection, which lets a request be resent on a fresh upstream connection); the
response body is streamed back in pieces, with the upstream's Content-Length, or chunked when the
upstream gave none. A request is recorded before the last byte of its response goes out, so once a
client has its response, `requests()` includes it.

`lose_answer` makes the proxy drop the upstream's answer to a chosen request and answer 503
instead, as a load balancer's timeout does after the server did the request: what a client's
retry then meets.

Command line, for a proxy in a separate process: `python tests/support/countproxy.py UPSTREAM` prints its
URL as the first line of stdout, and on SIGTERM, SIGINT or end of stdin prints its log, one JSON
object per request (`parse_log` reads it back), and exits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import signal
import socket
import sys
import threading
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType, TracebackType

__all__ = ["CountingProxy", "Request", "count_by_method", "parse_log"]

CHUNK = 1 << 20  # bytes per read and write of a response body
UPSTREAM_TIMEOUT_S = 300.0
# RFC 9110 7.6.1 hop-by-hop headers, plus the ones the proxy sets itself
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "expect",
        "content-length",
    }
)
_NO_BODY = frozenset({204, 304})
Record = Callable[[int, int], None]  # (status, response body bytes) -> None


@dataclasses.dataclass(frozen=True)
class Request:
    """One forwarded request. `status` is 502 when the upstream could not be reached."""

    method: str
    path: str  # without the query
    query: str  # without the "?"; "" when none
    status: int
    sent: int  # request body bytes
    received: int  # response body bytes


def count_by_method(requests: Iterable[Request]) -> dict[str, int]:
    """How many requests of each method, e.g. {"GET": 2, "PUT": 3}, methods sorted."""
    counts = Counter(r.method for r in requests)
    return dict(sorted(counts.items()))


def parse_log(lines: Iterable[str]) -> list[Request]:
    """The requests in a log printed by the command line (blank lines and the URL line skipped)."""
    return [Request(**json.loads(line)) for line in lines if line.lstrip().startswith("{")]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    upstream: tuple[str, int]
    proxy: CountingProxy


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, and BaseHTTPRequestHandler answers 100-continue
    server: _Server

    def setup(self) -> None:
        super().setup()
        host, port = self.server.upstream
        self._upstream = http.client.HTTPConnection(host, port, timeout=UPSTREAM_TIMEOUT_S)
        self._used = False  # whether self._upstream has carried a request
        self.server.proxy._opened(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self._upstream.close()
            self.server.proxy._closed(self.connection)

    def log_message(self, format: str, *args: object) -> None:
        pass  # quiet: the record is the log

    def _body(self) -> bytes:
        """The request body, decoded from chunks if it came chunked."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts: list[bytes] = []
            while True:
                size = int(self.rfile.readline().split(b";", 1)[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers: dropped
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()  # the CRLF after the chunk
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send_upstream(self, body: bytes) -> http.client.HTTPResponse:
        """Send the request upstream; resend once on a fresh connection when a reused one fails
        before any response (the server closed it while idle)."""
        connection_tokens = {
            t.strip().lower() for t in self.headers.get("Connection", "").split(",") if t.strip()
        }
        for attempt in (0, 1):
            reused = self._used
            try:
                self._upstream.putrequest(
                    self.command, self.path, skip_host=True, skip_accept_encoding=True
                )
                for name, value in self.headers.items():
                    lower = name.lower()
                    if lower not in _HOP_BY_HOP and lower not in connection_tokens:
                        self._upstream.putheader(name, value)
                if body or self.command in ("POST", "PUT", "PATCH"):
                    self._upstream.putheader("Content-Length", str(len(body)))
                self._upstream.endheaders(body or None)
                self._used = True
                return self._upstream.getresponse()
            except (http.client.RemoteDisconnected, ConnectionError):
                self._upstream.close()
                self._used = False
                if attempt or not reused:
                    raise
        raise AssertionError("unreachable")

    def _forward(self) -> None:
        seq = self.server.proxy._arrived()
        body = self._body()
        split = urllib.parse.urlsplit(self.path)

        def record(status: int, received: int) -> None:
            self.server.proxy._record(
                seq, Request(self.command, split.path, split.query, status, len(body), received)
            )

        try:
            response = self._send_upstream(body)
            lost = self.server.proxy._loses(self.command, split.path)
            if lost:
                response.read()  # done upstream; the client hears a 503 instead
        except (OSError, http.client.HTTPException) as error:
            record(502, 0)
            self._answer(502, f"countproxy: upstream {self.server.upstream}: {error!r}\n".encode())
            return
        if lost:
            record(503, 0)
            self._answer(503, b"countproxy: the upstream's answer was lost\n")
            return
        try:
            self._relay(response, record)
        finally:
            if response.will_close or not response.isclosed():
                self._upstream.close()  # the next request reconnects
                self._used = False

    def _answer(self, status: int, message: bytes) -> None:
        self.send_response_only(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(message)))
        self.end_headers()
        self.wfile.write(message)

    def _relay(self, response: http.client.HTTPResponse, record: Record) -> None:
        """Stream the response back; record it just before its last byte goes out."""
        self.send_response_only(response.status, response.reason)
        connection_tokens = {
            t.strip().lower() for t in (response.getheader("Connection") or "").split(",")
        }
        for name, value in response.getheaders():
            lower = name.lower()
            if lower not in _HOP_BY_HOP and lower not in connection_tokens:
                self.send_header(name, value)
        length = response.getheader("Content-Length")
        if self.command == "HEAD" or response.status in _NO_BODY or response.status < 200:
            if length is not None:  # a HEAD's length is the GET's: pass it through
                self.send_header("Content-Length", length)
            response.read()  # nothing: marks the response done
            record(response.status, 0)
            self.end_headers()
            return
        received = 0
        if response.length is not None:  # the upstream's Content-Length: stream exactly that
            self.send_header("Content-Length", str(response.length))
            if response.length == 0:
                record(response.status, 0)
            self.end_headers()
            while response.length:  # http.client counts down what is left
                data = response.read(min(CHUNK, response.length))
                if not data:
                    self.close_connection = True  # the upstream stopped short
                    record(response.status, received)
                    return
                received += len(data)
                if not response.length:
                    record(response.status, received)
                self.wfile.write(data)
            return
        # no length upstream (chunked, or until close): chunked to an HTTP/1.1 client
        chunked = self.request_version >= "HTTP/1.1"
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.close_connection = True  # the end of the body is the end of the connection
        self.end_headers()
        while data := response.read1(CHUNK):
            received += len(data)
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
        record(response.status, received)
        if chunked:
            self.wfile.write(b"0\r\n\r\n")

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = do_PATCH = do_OPTIONS = _forward


class CountingProxy:
    """A reverse proxy on 127.0.0.1 that forwards every request to `upstream` and records it."""

    def __init__(self, upstream: str) -> None:
        """`upstream`: the server's base URL, e.g. "http://127.0.0.1:5000" (plain HTTP)."""
        split = urllib.parse.urlsplit(upstream)
        if split.scheme != "http" or not split.hostname:
            raise ValueError(f"upstream must be an http:// URL, not {upstream!r}")
        self.upstream = upstream
        self._target = (split.hostname, split.port or 80)
        self.url = ""  # "http://127.0.0.1:<port>", set by start()
        self._lock = threading.Lock()
        self._next = 0  # the arrival number of the next request
        self._first = 0  # arrival numbers below this were cleared
        self._log: dict[int, Request] = {}  # arrival number -> the completed request
        self._sockets: set[socket.socket] = set()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._losing: list[Callable[[str, str], bool]] = []

    def lose_answer(self, matches: Callable[[str, str], bool]) -> None:
        """The next request for which `matches(method, path)` is true is forwarded and done
        upstream, but its client is answered 503 instead (a response lost on the way back, as a
        load balancer's timeout loses it); the client's retry then finds the request's effect.
        Once per call."""
        with self._lock:
            self._losing.append(matches)

    def _loses(self, method: str, path: str) -> bool:
        with self._lock:
            for i, matches in enumerate(self._losing):
                if matches(method, path):
                    del self._losing[i]
                    return True
            return False

    def start(self) -> CountingProxy:
        """Listen on a free port and serve in a daemon thread; returns self."""
        if self._server is not None:
            raise RuntimeError("the proxy is already started")
        server = _Server(("127.0.0.1", 0), _Handler)
        server.upstream = self._target
        server.proxy = self
        self._server = server
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.05},  # how soon stop() returns
            name=f"countproxy {self.url}",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening and close the connections clients hold open; the log stays."""
        server, thread = self._server, self._thread
        if server is None or thread is None:
            return
        server.shutdown()
        server.server_close()
        thread.join()
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:  # wakes handler threads waiting on an idle keep-alive connection
            with contextlib.suppress(OSError):  # already closed
                sock.shutdown(socket.SHUT_RDWR)
        self._server = self._thread = None

    def __enter__(self) -> CountingProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def requests(self) -> list[Request]:
        """The completed requests, a copy, in the order they arrived."""
        with self._lock:
            return [self._log[n] for n in sorted(self._log)]

    def clear(self) -> None:
        """Forget the requests so far, those still in flight included."""
        with self._lock:
            self._log.clear()
            self._first = self._next

    def _arrived(self) -> int:
        with self._lock:
            self._next += 1
            return self._next - 1

    def _record(self, number: int, request: Request) -> None:
        with self._lock:
            if number >= self._first:
                self._log[number] = request

    def _opened(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.add(sock)

    def _closed(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.discard(sock)


class _Stop(Exception):
    pass


def _stop(signum: int, frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: not again while shutting down
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise _Stop


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/support/countproxy.py UPSTREAM_URL", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    with CountingProxy(argv[0]) as proxy:
        print(proxy.url, flush=True)
        try:
            while sys.stdin.buffer.read(CHUNK):  # until end of input
                pass
        except _Stop:
            pass
    for request in proxy.requests():
        sys.stdout.write(json.dumps(dataclasses.asdict(request)) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
