"""Averaging one recoverable's parameters over checkpoints (`average_checkpoints`,
`average_state_dicts`), loading one checkpoint at a time.
"""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from cairn.manager._core.manager import CheckpointManager
from cairn.manager._layouts.speechbrain import CKPT_PREFIX, Checkpoint
from cairn.manager._surfaces.speechbrain.hooks import _torch_load
from cairn.manager._surfaces.speechbrain.meta import STEP_NAMES


def average_state_dicts(state_dicts: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The average of state dicts (mappings of arrays or tensors), reading one at a time: at
    most the running sum and one more are in memory."""
    iterator = iter(state_dicts)
    try:
        first = next(iterator)
    except StopIteration:
        raise ValueError("No state dicts to average.") from None
    total = {k: _as_float(v, copy=True) for k, v in first.items()}
    count = 1
    for state in iterator:
        if set(state) != set(total):
            raise ValueError(
                f"state dict {count} has keys {sorted(state)}, the first has {sorted(total)}"
            )
        for key, value in state.items():
            total[key] += _as_float(value, copy=False)
        count += 1
    return {k: v / count for k, v in total.items()}


def _as_float(value: Any, *, copy: bool) -> Any:
    torch = sys.modules.get("torch")  # a tensor here means the program imported torch
    if torch is not None and isinstance(value, torch.Tensor):
        value = value.detach()
        value = value if value.is_floating_point() else value.double()
        return value.clone() if copy else value
    array = np.asarray(value)
    if array.dtype.kind not in "fc":
        array = array.astype(np.float64)
    return array.copy() if copy else array


def _default_loader(path: Any, map_location: str = "cpu") -> Any:
    path = pathlib.Path(path)
    if path.is_dir():  # a pytree recoverable of a cairn checkpoint
        root, step_dir = path.parent.parent, path.parent
        step = STEP_NAMES.parse(step_dir.name)
        if step is None:
            raise ValueError(f"{path} is not a recoverable of a cairn checkpoint")
        with CheckpointManager(root, read_only=True, step_prefix=CKPT_PREFIX) as mgr:
            return mgr.restore(step, {path.name: None})[path.name]
    return _torch_load(path, map_location)


def average_checkpoints(
    checkpoint_list: Sequence[Checkpoint],
    recoverable_name: str,
    parameter_loader: Callable[..., Any] | None = None,
    averager: Callable[[Iterator[Any]], Any] | None = None,
) -> Any:
    """Average one recoverable's parameters over checkpoints, loading them one at a time.

    `parameter_loader(path, map_location="cpu")` loads one paramfile (default: ``torch.load``
    with ``weights_only=True``, or cairn's pytree reader); `averager` gets an iterator over the
    loaded values (default: `average_state_dicts`).
    """
    loader = parameter_loader or _default_loader
    average = averager or average_state_dicts
    missing = [c.path for c in checkpoint_list if recoverable_name not in c.paramfiles]
    if missing:
        raise KeyError(f"{recoverable_name!r} is not saved in checkpoints {missing}")
    loaded = (loader(c.paramfiles[recoverable_name], map_location="cpu") for c in checkpoint_list)
    return average(loaded)
