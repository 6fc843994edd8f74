"""Orbax's CheckpointManagerTest against a drop-in class (run.py copies this as test_dropin.py).

Orbax's test file sits beside it as ``upstream_cmt.py`` (a name pytest does not collect). Its test
bodies look up the module global ``CheckpointManager`` at call time, so rebinding that global swaps
the class for every test without touching ``orbax.checkpoint.checkpoint_manager`` (the drop-in may
use the real Orbax manager inside; patching Orbax's module would make it recurse). The class is
named by ``ORBAX_SUITE_DROPIN`` as ``module:attribute``. A thin subclass counts constructions, and
tearDown fails a test in which the drop-in was never built: a swap that silently stopped working
would otherwise measure Orbax.
"""

from __future__ import annotations

import importlib
import os

import upstream_cmt as _upstream  # a module attribute: pytest does not collect through it


def _load_dropin() -> type:
    module, _, attribute = os.environ["ORBAX_SUITE_DROPIN"].partition(":")
    return getattr(importlib.import_module(module), attribute or "CheckpointManager")


DropIn = _load_dropin()
_constructed = [0]  # in the current test; tests run one at a time per process


class _Counted(DropIn):  # type: ignore[misc, valid-type]
    """The drop-in, counting its constructions."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        _constructed[0] += 1
        super().__init__(*args, **kwargs)


_Counted.__name__ = DropIn.__name__
_Counted.__qualname__ = DropIn.__qualname__
_Counted.__module__ = DropIn.__module__
_upstream.CheckpointManager = _Counted


class CheckpointManagerTest(_upstream.CheckpointManagerTest):
    """Every test of Orbax's CheckpointManagerTest, with the drop-in in place."""

    def setUp(self) -> None:
        _constructed[0] = 0
        assert _upstream.CheckpointManager is _Counted, "the test module's class was rebound"
        super().setUp()

    def tearDown(self) -> None:
        super().tearDown()
        assert _constructed[0] > 0, (
            f"harness: the drop-in {os.environ['ORBAX_SUITE_DROPIN']} was never constructed"
        )
