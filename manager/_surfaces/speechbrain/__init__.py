"""SpeechBrain's recoverables API on top of CheckpointManager (public as cairn.manager.speechbrain).

Names, signatures and documented behaviour follow ``speechbrain.utils.checkpoints``; the
differences (atomic, verified and optionally asynchronous saves; meta parsed as data; no mutable
defaults; checkpoints ordered by a sequence number) are in docs/migrating-from-speechbrain.md.

A checkpoint is a cairn step ``CKPT_<sequence>/`` whose manifest holds the meta; each recoverable
is an item directory holding ``<name>.ckpt`` (written by its save hook, or by cairn's own torch /
state / pytree savers), so `Checkpoint.paramfiles` point at files that ``torch.load`` and the
hooks read as in SpeechBrain. Checkpoints written by SpeechBrain itself (``CKPT+*/CKPT.yaml``) are
listed, loaded and deleted too, their meta read as YAML data only. Such a directory is untrusted
input: no link in it is followed, its meta must be a small plain YAML mapping with a "unixtime"
and an "end-of-epoch", and its paramfiles must be regular files inside it; a directory that is not
is skipped with a warning, and the other checkpoints stay reachable.

The modules, each using only those before it: `meta` (the names, `Checkpoint`, `ckpt_recency`,
the meta as stored in the manifest), `native` (SpeechBrain's own ``CKPT+*`` directories), `hooks`
(the default and registered hooks, cairn's savers), `checkpointer` (`Checkpointer`) and
`averaging` (`average_checkpoints`, `average_state_dicts`).
"""
