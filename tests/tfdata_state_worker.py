"""Restores damaged and crafted tf.data iterator states through TfDataIteratorHandler, in one process.

    python tfdata_state_worker.py CASE [CASE ...]

A CASE is a name from `CASES` or ``random:<seed>:<count>`` (that many byte mutations). Before each
state the worker prints ``{"start": name}``, after it ``{"case": name, "outcome": ..., "message":
...}`` with outcome the error's type name, ``ok``, or ``raw:<type>`` for an exception that is not
cairn's; so when TensorFlow kills the process, the last start names the state that did it.

Every state is restored as a real restore does, from a file whose manifest record matches it (the
attacker recomputed it), into a fresh iterator of the pipeline that saved it.
"""

from __future__ import annotations

import json
import random
import struct
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

MAGIC = b"CAIRN-TFDATA-1\n"
PROBE_TIMEOUT = 15  # seconds: the hangs below take this long each


def pipeline() -> Any:
    """A shuffle and a batch; without autotuning, whose injected prefetch would make the saved
    bytes depend on timing (the cases below are byte positions in them)."""
    import tensorflow as tf

    options = tf.data.Options()
    options.autotune.enabled = False
    options.experimental_optimization.inject_prefetch = False
    return tf.data.Dataset.range(100).shuffle(10, seed=0).batch(2).with_options(options)


def saved_state() -> bytes:
    """The file cairn writes for the pipeline after two batches."""
    from cairn.handlers import TfDataIteratorHandler

    iterator = iter(pipeline())
    next(iterator), next(iterator)
    directory = Path(tempfile.mkdtemp())
    (record,) = TfDataIteratorHandler().snapshot(iterator).write(directory)
    return (directory / record.path).read_bytes()


# ---------------------------------------------------------------------------- the file's layout


def split(data: bytes) -> list[bytes]:
    (count,) = struct.unpack_from("<Q", data, len(MAGIC))
    lengths = struct.unpack_from(f"<{count}Q", data, len(MAGIC) + 8)
    offset, pieces = len(MAGIC) + 8 + 8 * count, []
    for length in lengths:
        pieces.append(data[offset : offset + length])
        offset += length
    return pieces


def join(pieces: list[bytes], lengths: list[int] | None = None) -> bytes:
    lengths = [len(p) for p in pieces] if lengths is None else lengths
    head = MAGIC + struct.pack(f"<Q{len(lengths)}Q", len(lengths), *lengths)
    return head + b"".join(pieces)


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def iterator_state(piece: bytes) -> Any:
    """The VariantTensorDataProto of one piece (TensorFlow's own encoding of one iterator)."""
    from tensorflow.core.framework import tensor_pb2

    content = tensor_pb2.TensorProto.FromString(piece).tensor_content
    start = next(i for i, b in enumerate(content) if b < 0x80) + 1
    return tensor_pb2.VariantTensorDataProto.FromString(content[start:])


def piece_of(state: Any) -> bytes:
    from tensorflow.core.framework import tensor_pb2, types_pb2

    body = state.SerializeToString()
    tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_VARIANT, tensor_content=varint(len(body)))
    tensor.tensor_content += body
    tensor.tensor_shape.SetInParent()
    return tensor.SerializeToString()


def compressed(state: Any) -> Any:
    """The CompressedElement holding the iterator's values (dtype, shape, sizes, snappy data)."""
    from tensorflow.core.framework import dataset_pb2

    return dataset_pb2.CompressedElement.FromString(state.tensors[0].variant_val[0].metadata)


def edit_piece(data: bytes, name: str, edit: Callable[[Any], None]) -> bytes:
    """`data` with `edit` applied to the iterator state of the piece named `name`."""
    pieces = split(data)
    for i, piece in enumerate(pieces):
        state = iterator_state(piece)
        if state.metadata.split(b"@@")[0].decode() == name:
            edit(state)
            pieces[i] = piece_of(state)
            return join(pieces)
    raise KeyError(name)


def edit_compressed(data: bytes, name: str, edit: Callable[[Any], None]) -> bytes:
    def apply(state: Any) -> None:
        element = compressed(state)
        edit(element)
        state.tensors[0].variant_val[0].metadata = element.SerializeToString()

    return edit_piece(data, name, apply)


def with_value(data: bytes, name: str, key: str, value: int) -> bytes:
    """`data` with the int64 `key` of iterator `name` set to `value`: a valid layout (TensorFlow
    compresses the values again), only the value is the attacker's."""
    import tensorflow as tf
    from tensorflow.core.framework import tensor_pb2

    def apply(state: Any) -> None:
        keys = state.metadata.decode().split("@@")[1:]
        element = compressed(state)
        types = [tf.dtypes.as_dtype(m.dtype) for m in element.component_metadata]
        shapes = [[d.size for d in m.tensor_shape.dim] for m in element.component_metadata]
        variant = tf.io.parse_tensor(state.tensors[0].SerializeToString(), tf.variant)
        values = list(
            tf.raw_ops.UncompressElement(
                compressed=variant, output_types=types, output_shapes=shapes
            )
        )
        values[keys.index(key)] = tf.constant(value, tf.int64)
        again = tf.io.serialize_tensor(tf.raw_ops.CompressElement(components=values))
        state.tensors[0].CopyFrom(tensor_pb2.TensorProto.FromString(again.numpy()))

    return edit_piece(data, name, apply)


def mutate(data: bytes, rng: random.Random) -> bytes:
    """A few bytes flipped, set or overwritten, mostly after the header (the reproduction's
    mutations: flips of one bit, random bytes, 0/0x7f/0x80/0xff, and 4-byte extremes)."""
    out = bytearray(data)
    kind = rng.randrange(6)
    low = len(MAGIC) + 8 + 8 * int.from_bytes(out[15:23], "little") if rng.random() < 0.9 else 0
    for _ in range(rng.choice([1, 1, 1, 2, 4, 8])):
        i = rng.randrange(low, len(out))
        if kind == 0:
            out[i] ^= 1 << rng.randrange(8)
        elif kind == 1:
            out[i] = rng.randrange(256)
        elif kind == 2:
            out[i] = rng.choice([0, 0xFF, 0x7F, 0x80, 1])
        elif kind == 3:
            out[i : i + 4] = rng.choice([b"\xff\xff\xff\x7f", b"\x00\x00\x00\x80", b"\xff" * 4])
        else:
            out[i] ^= rng.randrange(1, 256)
    return bytes(out[: len(data)])


def reproduction(seed: int, index: int) -> Callable[[bytes], bytes]:
    """Mutation `index` of the reproduction's run with `seed`."""
    return lambda data: mutate(data, random.Random(seed * 1000003 + index))


# ---------------------------------------------------------------------------- the cases

SHUFFLE = "Iterator::Root::BatchV2::Shuffle"
BUFFER = SHUFFLE + ":buffer::0"


def _wrapping_lengths(data: bytes) -> bytes:
    pieces = split(data)
    lengths = [len(p) for p in pieces]
    lengths[0] += 1 << 63
    lengths[1] += 1 << 63  # the sum wraps around 2**64 to the true total
    return join(pieces, lengths)


def _set(field: str, value: Any) -> Callable[[Any], None]:
    return lambda message: setattr(message, field, value)


def _first_component(edit: Callable[[Any], None]) -> Callable[[Any], None]:
    return lambda element: edit(element.component_metadata[0])


def _huge_shape(component: Any) -> None:
    del component.tensor_shape.dim[:], component.uncompressed_bytes[:]
    component.tensor_shape.dim.add(size=1 << 40)
    component.uncompressed_bytes.append(8 << 40)


def _negative_dim(component: Any) -> None:
    component.tensor_shape.dim.add(size=-1)


def _variant_count(component: Any) -> None:
    component.dtype = 21  # DT_VARIANT
    component.tensor_shape.dim.add(size=1 << 40)


def _outer_dtype(piece_index: int, dtype: int) -> Callable[[bytes], bytes]:
    from tensorflow.core.framework import tensor_pb2

    def build(data: bytes) -> bytes:
        pieces = split(data)
        tensor = tensor_pb2.TensorProto.FromString(pieces[piece_index])
        tensor.dtype = dtype
        pieces[piece_index] = tensor.SerializeToString()
        return join(pieces)

    return build


def _truncated_piece(data: bytes) -> bytes:
    pieces = split(data)
    pieces[3] = pieces[3][: len(pieces[3]) // 2]
    return join(pieces)


class Case(NamedTuple):
    build: Callable[[bytes], bytes]  # the crafted state, from the saved one
    outcome: str  # what restore raises now
    before: str  # what the restore did before these checks (TensorFlow 2.21)


CORRUPT, MISMATCH = "CorruptCheckpointError", "MismatchError"

CASES: dict[str, Case] = {
    "bad magic": Case(lambda d: b"CAIRN-TFDATA-9\n" + d[15:], CORRUPT, "CorruptCheckpointError"),
    "piece count past the file": Case(
        lambda d: d[:15] + struct.pack("<Q", 1 << 61) + d[23:], CORRUPT, "a raw ValueError"
    ),
    "piece lengths wrapping 2**64": Case(
        _wrapping_lengths, CORRUPT, "garbage pieces to TensorFlow"
    ),
    "piece cut in half": Case(_truncated_piece, CORRUPT, "MismatchError"),
    "piece of dtype string": Case(_outer_dtype(2, 7), CORRUPT, "MismatchError"),
    "iterator type renamed": Case(
        lambda d: edit_piece(d, SHUFFLE, _set("type_name", "tensorflow::Other")),
        CORRUPT,
        "MismatchError",
    ),
    "compressed element version 9": Case(
        lambda d: edit_compressed(d, SHUFFLE, _set("version", 9)), CORRUPT, "a hang"
    ),
    "component of 2**40 int64s": Case(
        lambda d: edit_compressed(d, BUFFER, _first_component(_huge_shape)), CORRUPT, "SIGSEGV"
    ),
    "component with a dimension of -1": Case(
        lambda d: edit_compressed(d, BUFFER, _first_component(_negative_dim)), CORRUPT, "SIGABRT"
    ),
    "2**40 variants in 8 bytes": Case(
        lambda d: edit_compressed(d, BUFFER, _first_component(_variant_count)), CORRUPT, "SIGSEGV"
    ),
    # A valid layout and an attacker's value: only the probe process tells these apart.
    "shuffle buffer element with -1 components": Case(
        lambda d: with_value(d, BUFFER, "num_components", -1), CORRUPT, "SIGSEGV"
    ),
    "shuffle buffer element with 2**31 components": Case(
        lambda d: with_value(d, BUFFER, "num_components", 1 << 31), CORRUPT, "SIGSEGV"
    ),
    # Byte mutations from the reproduction (seed 1: 60 of its 300 crashed or hung TensorFlow 2.21,
    # each of these also in a fresh process); 45, 121 and 251 pass the layout checks.
    **{
        f"reproduction 1/{i}": Case(reproduction(1, i), CORRUPT, "SIGSEGV")
        for i in (4, 21, 24, 28, 37, 45, 54, 121)
    },
    **{f"reproduction 1/{i}": Case(reproduction(1, i), CORRUPT, "a hang") for i in (38, 118, 251)},
}


def restore(data: bytes) -> tuple[str, str]:
    from cairn.handlers import StoredItem, TfDataIteratorHandler, write_file
    from cairn.handlers.errors import CairnError

    directory = Path(tempfile.mkdtemp())
    record = write_file(directory, "process_0-of-1.tfdata", data)
    stored = StoredItem(directory, {record.path: record}, 5, "dataset")
    handler = TfDataIteratorHandler(probe_timeout=PROBE_TIMEOUT)
    try:
        restored = handler.restore(stored, iter(pipeline()))
        for _ in range(3):
            next(restored, None)
    except CairnError as e:
        return type(e).__name__, str(e)
    except Exception as e:
        return f"raw:{type(e).__name__}", str(e)
    return "ok", ""


def main(names: list[str]) -> None:
    base = saved_state()
    runs: list[tuple[str, Callable[[bytes], bytes]]] = []
    for name in names:
        if name.startswith("random:"):
            _, seed, count = name.split(":")
            runs += [(f"{name}/{i}", reproduction(int(seed), i)) for i in range(int(count))]
        else:
            runs.append((name, CASES[name].build))
    for name, build in runs:
        data = build(base)
        print(json.dumps({"start": name}), flush=True)
        outcome, message = restore(data)
        print(json.dumps({"case": name, "outcome": outcome, "message": message}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
