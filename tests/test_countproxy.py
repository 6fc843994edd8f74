"""tests/support/countproxy.py in front of the real servers: TensorStore's S3 driver against moto and its
GCS driver against fake-gcs-server, through the proxy, and the request log that comes out.

The counts asserted are what TensorStore 0.1.86 sends (measured through the proxy):

S3: a plain write is one PUT; a conditional write (if_equal, "only if absent" included) is a HEAD
with If-Match/If-None-Match and then, if that passes, the PUT (a HEAD answered 412 ends it, no
PUT); a read, ranged or not, is one GET (a missing key: 404); a list is one GET ?list-type=2; a
delete is one DELETE (204, also for a missing key).
GCS: every write, conditional or not, is one media upload POST (the condition rides on it as
ifGenerationMatch, 0 for "only if absent"); a read is one GET ?alt=media (missing: 404); a list
is one GET of the bucket's objects; a delete is one DELETE (a missing key: 404).
"""

from __future__ import annotations

import http.client
import signal
import subprocess
import sys
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import tensorstore as ts
from support import countproxy
from support.countproxy import CountingProxy, Request, count_by_method, parse_log

BIG = 3 << 20  # over 1 MiB: libcurl sends the body only after `Expect: 100-continue`
SMALL = b"small value"
OTHER = b"another value"
COUNTPROXY = Path(countproxy.__file__)


def big_value() -> bytes:
    return bytes(range(256)) * (BIG // 256)


@pytest.fixture
def proxy() -> Iterator[Callable[[str], CountingProxy]]:
    """Starts a proxy in front of the upstream given; each is stopped when the test ends."""
    started: list[CountingProxy] = []

    def make(upstream: str) -> CountingProxy:
        p = CountingProxy(upstream).start()
        started.append(p)
        return p

    yield make
    for p in started:
        p.stop()


@pytest.fixture
def expect_100(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths of the requests the proxy answered `100 Continue` to."""
    paths: list[str] = []
    original = countproxy._Handler.handle_expect_100

    def counted(self: countproxy._Handler) -> bool:
        paths.append(urllib.parse.urlsplit(self.path).path)
        return original(self)

    monkeypatch.setattr(countproxy._Handler, "handle_expect_100", counted)
    return paths


def summary(requests: list[Request]) -> list[tuple[str, str, int]]:
    """(method, the path's last segment, status) of each request."""
    return [(r.method, r.path.rsplit("/", 1)[-1], r.status) for r in requests]


def test_s3_through_the_proxy(
    s3_bucket: str, s3_endpoint: str, proxy: Callable[[str], CountingProxy], expect_100: list[str]
) -> None:
    bucket = s3_bucket.removeprefix("s3://")
    p = proxy(s3_endpoint)
    kv = ts.KvStore.open(
        {
            "driver": "s3",
            "bucket": bucket,
            "endpoint": p.url,
            "aws_region": "us-east-1",
            "aws_credentials": {"type": "environment"},  # AWS_ACCESS_KEY_ID=testing, from s3_bucket
        }
    ).result()
    assert p.requests() == []  # opening sends nothing

    absent = kv.read("no-such-key").result().stamp.generation  # GET 404
    p.clear()
    assert p.requests() == []

    kv.write("d/a", SMALL).result()  # PUT
    kv.write("d/b", OTHER, if_equal=absent).result()  # HEAD (If-None-Match: *) 404, then PUT
    kv.write("d/big", big_value()).result()  # PUT, after 100 Continue
    assert count_by_method(p.requests()) == {"HEAD": 1, "PUT": 3}
    assert [bytes(kv.read(k).result().value) for k in ("d/a", "d/b", "d/big")] == [
        SMALL,
        OTHER,
        big_value(),
    ]
    assert kv.list(ts.KvStore.KeyRange("d/", "d0")).result() == [b"d/a", b"d/b", b"d/big"]
    kv.write("d/a", None).result()  # delete
    assert kv.list().result() == [b"d/b", b"d/big"]

    log = p.requests()
    assert count_by_method(log) == {"DELETE": 1, "GET": 5, "HEAD": 1, "PUT": 3}
    assert summary(log) == [
        ("PUT", "a", 200),
        ("HEAD", "b", 404),  # the condition, checked first
        ("PUT", "b", 200),
        ("PUT", "big", 200),
        ("GET", "a", 200),
        ("GET", "b", 200),
        ("GET", "big", 200),
        ("GET", "", 200),  # the list: GET /<bucket>/?list-type=2&prefix=d%2F
        ("DELETE", "a", 204),
        ("GET", "", 200),
    ]
    assert all(r.path.startswith(f"/{bucket}/") for r in log)
    assert log[7].query == "list-type=2&prefix=d%2F"
    assert [r.sent for r in log if r.method == "PUT"] == [len(SMALL), len(OTHER), BIG]
    assert [r.received for r in log[4:7]] == [len(SMALL), len(OTHER), BIG]
    assert expect_100 == [f"/{bucket}/d/big"]  # only the big body waited for 100 Continue

    p.clear()
    assert p.requests() == []
    assert kv.write("d/b", b"lost", if_equal=absent).result().generation == b""  # exists now
    assert summary(p.requests()) == [("HEAD", "b", 412)]  # refused on the HEAD: no PUT


def test_gcs_through_the_proxy(
    gcs_bucket: str,
    gcs_endpoint: str,
    proxy: Callable[[str], CountingProxy],
    expect_100: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bucket = gcs_bucket.removeprefix("gs://")
    p = proxy(gcs_endpoint)
    # TensorStore reads TENSORSTORE_GCS_HTTP_URL when a gcs kvstore is opened (each open, not once
    # per process: measured), so this kvstore goes through the proxy and others do not
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", p.url)
    kv = ts.KvStore.open({"driver": "gcs", "bucket": bucket}).result()
    assert p.requests() == []

    absent = kv.read("no-such-key").result().stamp.generation  # GET 404
    p.clear()
    kv.write("d/a", SMALL).result()
    kv.write("d/b", OTHER, if_equal=absent).result()  # one POST, with ifGenerationMatch=0
    kv.write("d/big", big_value()).result()
    assert count_by_method(p.requests()) == {"POST": 3}
    assert [bytes(kv.read(k).result().value) for k in ("d/a", "d/b", "d/big")] == [
        SMALL,
        OTHER,
        big_value(),
    ]
    assert kv.list(ts.KvStore.KeyRange("d/", "d0")).result() == [b"d/a", b"d/b", b"d/big"]
    kv.write("d/a", None).result()

    log = p.requests()
    assert count_by_method(log) == {"DELETE": 1, "GET": 4, "POST": 3}
    uploads = [urllib.parse.parse_qs(r.query) for r in log[:3]]
    assert [u["name"] for u in uploads] == [["d/a"], ["d/b"], ["d/big"]]
    assert [u.get("ifGenerationMatch") for u in uploads] == [None, ["0"], None]
    assert all(r.path == f"/upload/storage/v1/b/{bucket}/o" for r in log[:3])
    assert [r.sent for r in log[:3]] == [len(SMALL), len(OTHER), BIG]
    assert [(r.method, r.path, r.status) for r in log[3:]] == [
        ("GET", f"/storage/v1/b/{bucket}/o/d%2Fa", 200),
        ("GET", f"/storage/v1/b/{bucket}/o/d%2Fb", 200),
        ("GET", f"/storage/v1/b/{bucket}/o/d%2Fbig", 200),
        ("GET", f"/storage/v1/b/{bucket}/o", 200),  # the list
        ("DELETE", f"/storage/v1/b/{bucket}/o/d%2Fa", 200),
    ]
    assert [r.received for r in log[3:6]] == [len(SMALL), len(OTHER), BIG]
    assert expect_100 == [f"/upload/storage/v1/b/{bucket}/o"]


def test_plain_http_through_the_proxy(
    s3_bucket: str, s3_endpoint: str, proxy: Callable[[str], CountingProxy]
) -> None:
    """What TensorStore does not send: a chunked body, HEAD, a query. Unsigned: moto lets anyone
    write, and read what was written public-read."""
    bucket = s3_bucket.removeprefix("s3://")
    p = proxy(s3_endpoint)
    port = urllib.parse.urlsplit(p.url).port
    value = b"".join(uuid.uuid4().bytes for _ in range(5000))  # 80000 bytes, in 5000 chunks
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        chunks = iter([value[i : i + 16] for i in range(0, len(value), 16)])
        connection.request(
            "PUT",
            f"/{bucket}/chunked",
            body=chunks,
            headers={"x-amz-acl": "public-read"},
            encode_chunked=True,
        )
        with connection.getresponse() as response:
            assert response.status == 200
            response.read()
        connection.request("HEAD", f"/{bucket}/chunked")  # the same connection: kept alive
        with connection.getresponse() as response:
            assert response.status == 200
            assert response.getheader("Content-Length") == str(len(value))
            assert response.read() == b""
        connection.request("GET", f"/{bucket}/chunked?x=1", headers={"Range": "bytes=16-31"})
        with connection.getresponse() as response:
            assert response.status == 206
            assert response.read() == value[16:32]
    finally:
        connection.close()
    assert p.requests() == [
        Request("PUT", f"/{bucket}/chunked", "", 200, len(value), 0),
        Request("HEAD", f"/{bucket}/chunked", "", 200, 0, 0),
        Request("GET", f"/{bucket}/chunked", "x=1", 206, 0, 16),
    ]


def test_unreachable_upstream(proxy: Callable[[str], CountingProxy]) -> None:
    with CountingProxy("http://127.0.0.1:1") as p:
        port = urllib.parse.urlsplit(p.url).port
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            connection.request("PUT", "/b/k?q", body=b"abc")
            with connection.getresponse() as response:
                assert response.status == 502
                response.read()
        finally:
            connection.close()
        assert p.requests() == [Request("PUT", "/b/k", "q", 502, 3, 0)]
    with pytest.raises(ValueError, match="http://"):
        CountingProxy("https://example.com")


@pytest.mark.parametrize("ending", ["end of stdin", "SIGTERM"])
def test_command_line(s3_bucket: str, s3_endpoint: str, ending: str) -> None:
    bucket = s3_bucket.removeprefix("s3://")
    proc = subprocess.Popen(
        [sys.executable, str(COUNTPROXY), s3_endpoint],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:")
        connection = http.client.HTTPConnection("127.0.0.1", urllib.parse.urlsplit(url).port)
        try:
            connection.request("PUT", f"/{bucket}/k", body=b"abc")
            with connection.getresponse() as response:
                assert response.status == 200
                response.read()
        finally:
            connection.close()
        if ending == "SIGTERM":
            proc.send_signal(signal.SIGTERM)  # stdin stays open
        else:
            proc.stdin.close()
        out = proc.stdout.read()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
    assert parse_log(out.splitlines()) == [Request("PUT", f"/{bucket}/k", "", 200, 3, 0)]
