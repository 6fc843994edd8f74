"""Shared fixtures."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from cairn.handlers import InMemoryHandler

pytest_plugins = ["s3util", "gcsutil"]  # real S3 (moto) and GCS (fake-gcs-server) servers


class Gate:
    """Holds commit-thread writes until the test releases them (no sleeps as synchronisation)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self) -> None:
        self.entered.set()
        if not self.release.wait(timeout=60):
            raise TimeoutError("test gate was never released")


@pytest.fixture
def gate() -> Iterator[Gate]:
    g = Gate()
    yield g
    g.release.set()


@pytest.fixture
def gated_handler(gate: Gate) -> InMemoryHandler:
    return InMemoryHandler(on_write=gate)
