"""Moving steps between cairn and orbax-checkpoint: ``export_step`` and ``import_step``
(docs/migrating-from-orbax.md). Reading Orbax steps in place needs nothing from here."""

from cairn.manager._surfaces.orbax_interop import export_step, import_step

__all__ = ["export_step", "import_step"]
