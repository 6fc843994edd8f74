"""The foreign layouts a storage looks for in a step directory without a cairn manifest, in
order: orbax-checkpoint's (on every storage). T5X's own legacy layout is not here: the T5X
surface reads it from local directories only (`_layouts.t5x`)."""

from __future__ import annotations

from cairn.manager._format import Manifest
from cairn.manager._layouts.base import Layout, StepView
from cairn.manager._layouts.orbax import OrbaxLayout

LAYOUTS: tuple[Layout, ...] = (OrbaxLayout(),)


def read_foreign(step: int, view: StepView) -> tuple[str, Manifest] | None:
    """(who wrote it, its read-only manifest) for the first layout that reads the step `view`
    shows; None if none does. FileNotFoundError if the step directory is gone."""
    for layout in LAYOUTS:
        manifest = layout.read(step, view)
        if manifest is not None:
            return layout.name, manifest
    return None
