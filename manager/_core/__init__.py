"""The core floor: CheckpointManager, its policies, the commit sequence, the commit thread and
the writer process, multi-process coordination. It uses the storage floor and never imports
the surfaces."""
