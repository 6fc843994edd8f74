"""Foreign step layouts read in place: Orbax's steps and T5X's own (msgpack and TensorStore)
layout. Below the storage floor: they read through a `base.StepView` that every storage
provides (Orbax's, `registry.LAYOUTS`), or local paths (T5X's legacy layout), never a manager."""
