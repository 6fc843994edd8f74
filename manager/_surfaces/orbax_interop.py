"""Moving steps between cairn and orbax-checkpoint (public as cairn.manager.orbax).

Reading Orbax steps needs nothing from here: CheckpointManager lists and restores them (see
docs/migrating-from-orbax.md). These two functions copy a step across, so that Orbax tools can
read a cairn step, and a cairn directory can hold (writable, checksummed) copies of Orbax steps.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cairn.handlers.errors import StepAlreadyExistsError
from cairn.handlers.io import optional
from cairn.manager._core.manager import CheckpointManager
from cairn.manager._core.validate import as_step

__all__ = ["export_step", "import_step"]

_PYTREES = ("cairn.train_state", "cairn.numpy_tree")


def export_step(
    directory: str | os.PathLike[str],
    step: int,
    destination: str | os.PathLike[str],
    *,
    items: Sequence[str] | None = None,
    step_prefix: str | None = None,
    source_step_prefix: str = "checkpoint",
) -> Path:
    """Write step `step` of the cairn directory `directory` as an Orbax step in `destination`.

    Pytree items (train states) become StandardSave items, JSON items JsonSave items; the step's
    metrics go along. `items` limits the items; iterator items have no Orbax counterpart here and
    are refused. The result is written by orbax-checkpoint's own CheckpointManager, so Orbax reads
    it as any of its steps; `step_prefix` is its step prefix (None: ``<step>``). Returns the
    Orbax step directory. StepAlreadyExistsError if Orbax already has that step there.
    """
    ocp = optional("orbax.checkpoint", feature="cairn.manager.orbax (Orbax interop)")

    step = as_step(step)
    with CheckpointManager(directory, read_only=True, step_prefix=source_step_prefix) as source:
        info = source.info(step)
        names = (
            list(items)
            if items is not None
            else [n for n, i in info.items.items() if not i.dropped]
        )
        args: dict[str, Any] = {}
        for name in names:
            if name not in info.items:
                raise ValueError(f"step {step} has no item {name!r}; it has {sorted(info.items)}")
            handler = info.items[name].handler
            if handler in _PYTREES:
                args[name] = ocp.args.StandardSave(source.restore(step, {name: None})[name])
            elif handler == "cairn.json":
                args[name] = ocp.args.JsonSave(source.restore(step, {name: None})[name])
            else:
                raise ValueError(
                    f"item {name!r} of step {step} ({handler}) has no Orbax counterpart; pass "
                    "items= to export the others"
                )
        metrics = dict(info.metrics)
    # Orbax stores a step's metrics only when it has a best_fn; with max_to_keep unset it deletes
    # nothing by it.
    options = ocp.CheckpointManagerOptions(
        step_prefix=step_prefix,
        enable_async_checkpointing=False,
        best_fn=(lambda m: 0.0) if metrics else None,
    )
    target = ocp.CheckpointManager(Path(destination).absolute(), options=options)
    try:
        if step in target.all_steps():
            raise StepAlreadyExistsError(f"{destination} already has Orbax step {step}")
        target.save(step, args=ocp.args.Composite(**args), metrics=metrics or None)
        target.wait_until_finished()
    finally:
        target.close()
    name = f"{step_prefix}_{step}" if step_prefix else str(step)
    return Path(destination).absolute() / name


def import_step(
    source: str | os.PathLike[str],
    step: int,
    directory: str | os.PathLike[str],
    *,
    source_step_prefix: str = "",
    targets: dict[str, Any] | None = None,
) -> None:
    """Copy Orbax step `step` of `source` into the cairn directory `directory` as a cairn step
    (written, checksummed and committed as any save), with its metrics. `targets` optionally
    gives restore targets per item (e.g. shardings); by default arrays come back as NumPy."""
    step = as_step(step)
    with CheckpointManager(source, read_only=True, step_prefix=source_step_prefix) as orbax:
        info = orbax.info(step)
        wanted = {n: (targets or {}).get(n) for n, i in info.items.items() if not i.dropped}
        restored = orbax.restore(step, wanted)
        metrics = dict(info.metrics)
    with CheckpointManager(directory) as cairn:
        cairn.save(step, restored, metrics=metrics, force=True)
