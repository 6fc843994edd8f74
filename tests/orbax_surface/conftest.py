"""The `impl` fixture: every shared-behaviour test runs against real Orbax and the cairn drop-in.

A test that fails on Orbax tests the wrong thing: the drop-in promises Orbax's behaviour.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp
import pytest


@pytest.fixture(params=["orbax", "cairn"])
def impl(request: pytest.FixtureRequest) -> type[Any]:
    """The CheckpointManager class under test (the one line a user changes)."""
    if request.param == "orbax":
        return ocp.CheckpointManager
    from cairn.manager.orbax import CheckpointManager

    return CheckpointManager


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """An absolute checkpoint root that does not exist yet (the manager creates it)."""
    return tmp_path / "ckpt"
