"""Shared fixtures."""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

from cairn.handlers import InMemoryHandler

# real S3 (moto) and GCS (fake-gcs-server) servers
pytest_plugins = ["support.s3util", "support.gcsutil"]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[Any]) -> None:
    """Before Hypothesis reads ``__file__`` of every module in sys.modules (its plugin does at
    collection): SpeechBrain leaves lazy modules there that import on any attribute access, and
    warn (deprecated redirects) or fail (integrations whose library is not installed: k2, spacy,
    flair). Resolve each once, quietly; drop those that cannot import from sys.modules."""
    del items
    for name, module in list(sys.modules.items()):
        if type(module).__name__ not in ("LazyModule", "DeprecatedModuleRedirect"):
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                getattr(module, "__file__", None)
            except ImportError:
                del sys.modules[name]


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


@pytest.fixture
def zarr_layout() -> Iterator[None]:
    """Pytrees saved in the zarr layout by default (``register`` with ``replace=True``, as a
    user who wants TensorStore-readable leaves for a whole run does); the packed default after.
    For tests of what the zarr layout writes: one directory and file per leaf and chunk."""
    import numpy as np

    from cairn.handlers import TrainStateHandler, register, registered_types

    types = (dict, list, tuple, int, float, complex, np.ndarray, np.generic)
    default = registered_types()[dict]
    register(TrainStateHandler(layout="zarr"), *types, replace=True)
    try:
        yield
    finally:
        register(default, *types, replace=True)
