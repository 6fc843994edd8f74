"""orbax-checkpoint's API on cairn (docs/migrating-from-orbax.md).

``CheckpointManager``: change ``CheckpointManager = ocp.CheckpointManager`` to
``from cairn.manager.orbax import CheckpointManager``; options, ``ocp.args`` objects, return
values and errors stay Orbax's, and every step is a cairn step. It loads orbax-checkpoint when
first used, never on ``import cairn.manager``.

``export_step`` and ``import_step`` copy a step between a cairn directory and an Orbax one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cairn.manager._surfaces.orbax_interop import export_step, import_step

if TYPE_CHECKING:  # loaded on first use (`__getattr__`), with orbax-checkpoint
    from cairn.manager._surfaces.orbax.manager import CheckpointManager, StepAlreadyExistsError

__all__ = ["CheckpointManager", "StepAlreadyExistsError", "export_step", "import_step"]


def __getattr__(name: str) -> Any:
    if name in ("CheckpointManager", "StepAlreadyExistsError"):
        from cairn.manager._surfaces.orbax import manager

        return getattr(manager, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
