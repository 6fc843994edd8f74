"""A directory of Orbax steps under another naming than the manager's is refused, not ignored.

Opened with cairn's defaults, a directory Orbax wrote with its default names (``0``, ``1``, ...)
used to list nothing: a trainer restarted from scratch beside the old steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import pytest
from support.treeutil import dir_state

from cairn.manager import CheckpointManager


def write_orbax(directory: Path, steps: list[int], **options: Any) -> None:
    opts = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, **options)
    with ocp.CheckpointManager(directory, options=opts) as mgr:
        for step in steps:
            state = {"w": np.arange(4.0) * step}
            mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))


@pytest.mark.parametrize(
    ("options", "fix", "example"),
    [
        ({}, "step_prefix=''", "'0'"),
        ({"step_prefix": "step"}, "step_prefix='step'", "'step_0'"),
        (
            {"step_prefix": "ckpt", "step_format_fixed_length": 6},
            "step_prefix='ckpt', step_digits=6",
            "'ckpt_000000'",
        ),
    ],
)
@pytest.mark.parametrize("read_only", [False, True])
def test_the_error_gives_the_option_and_nothing_is_written(
    tmp_path: Path, options: dict[str, Any], fix: str, example: str, read_only: bool
) -> None:
    write_orbax(tmp_path, [1, 2], **options)
    before = dir_state(tmp_path)
    with pytest.raises(ValueError, match="written by orbax-checkpoint") as raised:
        CheckpointManager(tmp_path, read_only=read_only)
    message = str(raised.value)
    assert f"CheckpointManager(..., {fix})" in message and example in message, message
    assert "step_prefix='checkpoint' expects" in message
    assert dir_state(tmp_path) == before  # no .cairn.lock, nothing else
    prefix, _, digits = fix.partition(", step_digits=")
    kwargs: dict[str, Any] = {"step_prefix": prefix.split("=")[1].strip("'")}
    if digits:
        kwargs["step_digits"] = int(digits)
    with CheckpointManager(tmp_path, read_only=read_only, **kwargs) as mgr:  # the fix works
        assert mgr.all_steps() == [1, 2]
        np.testing.assert_array_equal(mgr.restore()["state"]["w"], np.arange(4.0) * 2)


def test_new_steps_beside_them_and_another_prefix(tmp_path: Path) -> None:
    write_orbax(tmp_path, [1])
    with CheckpointManager(tmp_path, step_prefix="") as mgr:
        mgr.save(2, {"s": [2]})
    with CheckpointManager(tmp_path, step_prefix="", read_only=True) as reader:
        assert reader.all_steps() == [1, 2]
    with pytest.raises(ValueError, match=r"step_prefix='mine' expects \('mine_0'\)"):
        CheckpointManager(tmp_path, step_prefix="mine")


def test_directories_that_only_look_like_steps_are_not_refused(tmp_path: Path) -> None:
    for name in ("0", "1", "run_3", "2024"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "notes.txt").write_text("not a checkpoint")
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.all_steps() == []
        mgr.save(1, {"s": [1]})
    with CheckpointManager(tmp_path, read_only=True) as reader:
        assert reader.all_steps() == [1]
