"""A real S3 server for the tests: `python -m moto.server` on 127.0.0.1, started and stopped here."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import urllib.request
import uuid
from collections.abc import Iterator

import pytest

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """The endpoint of a moto S3 server process, for the whole session."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    ready = threading.Event()

    def drain() -> None:  # the server logs every request: keep its pipe empty
        assert proc.stderr is not None
        for line in proc.stderr:
            if "Running on" in line:
                ready.set()

    drainer = threading.Thread(target=drain, daemon=True)
    drainer.start()
    try:
        if not ready.wait(60):
            raise RuntimeError("the moto server did not start within 60 s")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        drainer.join(timeout=30)
        assert proc.stderr is not None
        proc.stderr.close()


@pytest.fixture
def s3_bucket(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket; the environment points boto3/s3fs/TensorStore at the server.
    Returns ``s3://<bucket>``."""
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    request = urllib.request.Request(f"{s3_endpoint}/{bucket}", method="PUT")
    urllib.request.urlopen(request, timeout=10).close()
    for key, value in {**CREDENTIALS, "AWS_ENDPOINT_URL": s3_endpoint}.items():
        monkeypatch.setenv(key, value)
    return f"s3://{bucket}"


def s3_env(endpoint: str) -> dict[str, str]:
    return {**os.environ, **CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}
