"""T5X's checkpoint API on top of CheckpointManager (public as cairn.manager.t5x).

Names, signatures and documented behaviour follow ``t5x.checkpoints``; the differences (saves are
asynchronous, atomic and verified; step 0 is a step; an existing step is reported, not silently
skipped on some hosts; `keep_dataset_checkpoints` and `save_dtype` work in the Orbax-style
wrapper) are listed in docs/migrating-from-t5x.md. The on-disk format is cairn's: a step is
``checkpoint_<step>/`` with the train state as item ``state`` (T5X's state-dict layout:
``{"target": params, "state": {"step", "param_states"}, ...}``) and the dataset iterator as item
``dataset`` (one file per process).
"""
