"""Orbax's ``CheckpointManager`` on cairn (public as ``cairn.manager.orbax``): `args` translates
Orbax's argument objects into cairn items and restore targets, `policies` holds Orbax's save and
keep decisions, `manager` is the drop-in class. Imported only when the class is first used, so
that ``import cairn.manager`` never loads orbax-checkpoint."""
