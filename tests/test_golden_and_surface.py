"""The on-disk format never drifts silently, the public surface is pinned, imports stay light."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from golden.make_golden import golden_state
from support.treeutil import assert_tree_equal

import cairn.handlers
import cairn.manager
from cairn.manager import CheckpointManager

GOLDEN = Path(__file__).parent / "golden"


@pytest.mark.parametrize("name", ["v1", "v1_train_state"])
def test_golden_v1_checkpoint_restores(tmp_path: Path, name: str) -> None:
    """Checked-in format-1 checkpoints (NumPy and train-state items) list, restore, report metrics."""
    root = tmp_path / "golden"
    shutil.copytree(GOLDEN / name, root)
    with CheckpointManager(root, read_only=True) as mgr:
        assert mgr.all_steps() == [10, 20]
        got = mgr.restore()
        assert_tree_equal(got["state"], golden_state())
        assert got["config"] == {"lr": 0.1}
        assert mgr.metrics(20) == {"loss": 0.05, "eval_loss": 0.25}
        assert mgr.info(10).metadata == {"git": "golden"}


@pytest.mark.parametrize("module", [cairn.manager, cairn.handlers])
def test_all_lists_exactly_the_public_names(module: object) -> None:
    """__all__ equals the public names the package exposes (httpx style)."""
    public = sorted(n for n in vars(module) if not n.startswith("_"))
    assert sorted(module.__all__) == public  # type: ignore[attr-defined]


def test_import_is_light() -> None:
    """import cairn.manager pulls in neither tensorflow nor jax nor orbax."""
    code = "import sys, cairn.manager, cairn.handlers; print(sorted(m for m in ('tensorflow', 'jax', 'orbax', 'torch', 'grain') if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


def test_errors_are_one_tree() -> None:
    """cairn.manager re-exports the very classes of cairn.handlers.errors, with their builtins."""
    from cairn.handlers import errors

    for name in errors.__all__:
        assert getattr(cairn.manager, name) is getattr(errors, name)
    assert issubclass(errors.StepNotFoundError, LookupError)
    assert issubclass(errors.StepAlreadyExistsError, FileExistsError)
    assert issubclass(errors.CorruptCheckpointError, ValueError)
    assert issubclass(errors.ReadOnlyError, PermissionError)
    assert issubclass(errors.CommitError, RuntimeError)
    assert issubclass(errors.BarrierTimeoutError, TimeoutError)
