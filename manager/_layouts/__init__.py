"""Foreign step layouts read in place: Orbax's steps and T5X's own (msgpack and TensorStore)
layout. Below the storage floor: they read paths and bytes, never a manager."""
