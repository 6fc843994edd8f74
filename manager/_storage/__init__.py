"""The storage floor: where steps live (a local filesystem, S3, GCS, memory) and the writer lock
or lease. `base` states the protocol, `open` picks a backend; nothing here imports the floors
above (`_core`, `_surfaces`)."""
