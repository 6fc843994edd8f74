"""Dataset iterator handlers: tf.data, grain, and anything with get_state()/set_state().

Each process of a run saves its own iterator position: the write phase stores one file per process,
``process_<i>-of-<n>.<ext>``, and restore reads the calling process's file (`writing_process()`
gives i and n). The state is captured on the caller's thread inside `save()`; iterating after
`save()` returns never changes what is written. TensorFlow and grain are imported only by the
handler that needs them.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import os
import pickle
import re
import signal
import struct
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cairn.handlers._files import (
    Destination,
    FileRecord,
    StoredItem,
    as_destination,
    in_parts,
    writing_as,
    writing_process,
)
from cairn.handlers._optional import optional
from cairn.handlers._tree import dtype_from_name, dtype_name
from cairn.handlers.errors import CorruptCheckpointError, MismatchError

__all__ = [
    "GrainIteratorHandler",
    "StatefulIteratorHandler",
    "TfDataIteratorHandler",
    "TfDataIteratorState",
    "decode_state",
    "encode_state",
    "has_state_methods",
]

_PROCESS_FILE = re.compile(r"process_([0-9]+)-of-([0-9]+)\.")


def _type_names(obj: Any) -> set[str]:
    return {f"{t.__module__}.{t.__qualname__}" for t in type(obj).__mro__}


class _BytesSnapshot:
    """Captured bytes (in pieces), written as this process's file on the commit thread."""

    def __init__(self, pieces: Sequence[bytes | memoryview], suffix: str) -> None:
        self._pieces = pieces
        self._suffix = suffix

    def write(self, dest: Destination | Path) -> Sequence[FileRecord]:
        dest = as_destination(dest)
        index, count = writing_process()
        with dest.create(f"process_{index}-of-{count}{self._suffix}") as f:
            for piece in self._pieces:
                f.write(piece)
        return [f.record]


class _PerProcessHandler:
    """Shared by the iterator handlers: one file per process, the caller's process restored.

    Subclasses give `id`, `version`, `_suffix`, `_kind` and the three conversions: `_capture`
    (caller thread, inside save: the state as bytes), `_apply` (into a target, in place) and
    `_decode` (no target).
    """

    id: str
    version: int
    _suffix: str
    _kind: str

    def _capture(self, obj: Any) -> Sequence[bytes | memoryview]:
        raise NotImplementedError

    def _apply(self, data: bytes, target: Any, stored: StoredItem) -> Any:
        raise NotImplementedError

    def _decode(self, data: bytes, stored: StoredItem) -> Any:
        raise NotImplementedError

    def snapshot(self, obj: Any) -> _BytesSnapshot:
        return _BytesSnapshot(self._capture(obj), self._suffix)

    def _file_name(self) -> str:
        """This process's file: ``process_<i>-of-<n><suffix>``."""
        index, count = writing_process()
        return f"process_{index}-of-{count}{self._suffix}"

    def restore(self, stored: StoredItem, target: Any = None) -> Any:
        name = self._file_name()
        count = writing_process()[1]
        if name not in stored.files:
            saved = sorted(
                {int(m.group(2)) for p in stored.files if (m := _PROCESS_FILE.match(p)) is not None}
            )
            if saved and count not in saved:
                raise MismatchError(
                    f"step {stored.step}, item {stored.name!r}: the {self._kind} state was saved "
                    f"by {saved[0]} process(es); this run has {count}, and an iterator position "
                    "cannot be re-split"
                )
            raise CorruptCheckpointError(f"{stored.describe_file(name)} is not in the manifest")
        data = stored.read_bytes(name)
        if target is None:
            return self._decode(data, stored)
        return self._apply(data, target, stored)

    def _load_json(self, data: bytes, stored: StoredItem) -> Any:
        """The file's JSON; CorruptCheckpointError naming the file if it is not plain JSON
        (bare NaN or Infinity, integers past Python's digit limit, nesting that overflows)."""
        try:
            return json.loads(data, parse_constant=_no_constant)
        except (ValueError, RecursionError) as e:
            raise CorruptCheckpointError(
                f"{stored.describe_file(self._file_name())}: the {self._kind} state does not "
                f"parse: {type(e).__name__}: {e}"
            ) from None

    def _set_state(self, setter: Callable[[Any], Any], state: Any, stored: StoredItem) -> None:
        """Hand `state` to the target's setter; whatever the setter raises on a state it does
        not accept (the state is read from disk) becomes MismatchError, the original chained."""
        try:
            setter(state)
        except Exception as e:
            raise MismatchError(
                f"{stored.describe_file(self._file_name())}: the target iterator does not accept "
                f"the saved state (a different pipeline?): {type(e).__name__}: {e}"
            ) from e

    def check(self, stored: StoredItem) -> None:
        """Each file decodes as a restore without target does, and none is missing (outside a
        local tier's part, every process's); CorruptCheckpointError naming the file otherwise."""
        held: set[tuple[int, int]] = set()
        for relpath in sorted(stored.files):
            match = _PROCESS_FILE.match(relpath)
            if match is None:
                continue
            index, count = int(match.group(1)), int(match.group(2))
            if relpath == f"process_{index}-of-{count}{self._suffix}" and index < count:
                held.add((index, count))
                with writing_as(index, count):  # its messages name that process's file
                    self._decode(stored.read_bytes(relpath), stored)
        wanted = set() if in_parts() else {(i, n) for _, n in held for i in range(n)}
        missing = sorted(wanted - held) if held else [writing_process()]
        if missing:
            name = "process_{}-of-{}".format(*missing[0]) + self._suffix
            raise CorruptCheckpointError(f"{stored.describe_file(name)} is not in the manifest")

    def describe(self, stored: StoredItem) -> dict[str, Any]:
        return {
            "kind": self._kind,
            "processes": {p: r.size for p, r in sorted(stored.files.items())},
            "bytes": sum(r.size for r in stored.files.values()),
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (cairn writes no NaN or infinities)")


# ---------------------------------------------------------------------------- get/set_state objects

_TAG = "__cairn__"

#: The kinds of array a state holds: booleans, integers, floats and complex numbers (ml_dtypes'
#: too, see `_holdable`), datetimes and timedeltas, bytes and str. Never object or void (a
#: structured array would come back as raw bytes, without its fields).
_STATE_KINDS = "biufcMmSU"


def _holdable(dtype: np.dtype) -> bool:
    return dtype.kind in _STATE_KINDS or dtype_name(dtype) != dtype.str  # ml_dtypes: kind "V"


def _state_dtype(name: Any) -> np.dtype:
    """The dtype of a stored array or scalar, if `name` is one `encode_state` writes (its
    `dtype_name`, of a kind a state holds); ValueError otherwise."""
    dtype = dtype_from_name(name)  # ValueError for a name that is no dtype
    if dtype_name(dtype) != name or not _holdable(dtype):
        raise ValueError(f"dtype {name!r:.40} is not one a saved state holds")
    return dtype


def encode_state(value: Any, path: str = "") -> Any:
    """A JSON value for the state of an object (``get_state()``, ``state_dict()``), which
    `decode_state` turns back into what it was.

    Dicts with str keys, lists, str, finite numbers, bool and None stay as they are; NaN and the
    infinities, tuples, bytes, NumPy arrays and scalars (of numbers, booleans, datetimes, bytes or
    str: not object or void), and dicts with other keys become objects tagged ``"__cairn__"`` (a
    key no state may use). Anything else is a TypeError naming where it is in the state (`path`
    prefixes that name). The result goes through ``json.dumps(..., allow_nan=False)``.
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)) and type(value) in (int, float):
        if isinstance(value, float) and value != value:
            return {_TAG: "float", "value": "nan"}
        if value in (float("inf"), float("-inf")):
            return {_TAG: "float", "value": str(value)}
        return value
    if isinstance(value, (np.ndarray, np.generic)):
        array = np.asarray(value)
        if not _holdable(array.dtype):
            raise TypeError(
                f"state{path}: arrays of dtype {array.dtype} cannot be stored (numbers, booleans, "
                "datetimes, bytes and str only)"
            )
        return {
            _TAG: "ndarray" if isinstance(value, np.ndarray) else "scalar",
            "dtype": dtype_name(array.dtype),
            "shape": list(array.shape),
            "data": base64.b64encode(np.ascontiguousarray(array).tobytes()).decode(),
        }
    if isinstance(value, (bytes, bytearray)):
        return {_TAG: "bytes", "data": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, tuple):
        return {
            _TAG: "tuple",
            "items": [encode_state(v, f"{path}[{i}]") for i, v in enumerate(value)],
        }
    if isinstance(value, list):
        return [encode_state(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if _TAG in value:
            raise TypeError(f"state{path}: the key {_TAG!r} is reserved")
        if all(isinstance(k, str) for k in value):
            return {k: encode_state(v, f"{path}[{k!r}]") for k, v in value.items()}
        return {
            _TAG: "dict",
            "items": [
                [encode_state(k, f"{path}(key {k!r})"), encode_state(v, f"{path}[{k!r}]")]
                for k, v in value.items()
            ],
        }
    raise TypeError(
        f"state{path} is a {type(value).__qualname__}; iterator state must be JSON data, bytes, "
        "tuples or numpy arrays"
    )


def decode_state(value: Any) -> Any:
    """The state `encode_state` gave `value` for, from its JSON (as ``json.loads`` returns it).

    Input it did not write (read from a damaged file) raises ValueError (an unknown tag, bad
    base64, a dtype it never writes, a shape that does not fit), KeyError, TypeError,
    OverflowError or RecursionError; callers reading from disk report these as
    CorruptCheckpointError.
    """
    if isinstance(value, list):
        return [decode_state(v) for v in value]
    if not isinstance(value, dict):
        return value
    tag = value.get(_TAG)
    if tag is None:
        return {k: decode_state(v) for k, v in value.items()}
    if tag == "float":
        return float(value["value"])
    if tag in ("ndarray", "scalar"):
        raw = base64.b64decode(value["data"])
        array = np.frombuffer(raw, _state_dtype(value["dtype"])).reshape(value["shape"]).copy()
        return array if tag == "ndarray" else array[()]
    if tag == "bytes":
        return base64.b64decode(value["data"])
    if tag == "tuple":
        return tuple(decode_state(v) for v in value["items"])
    if tag == "dict":
        return {decode_state(k): decode_state(v) for k, v in value["items"]}
    raise ValueError(f"unknown tag {tag!r}")


_METHOD_PAIRS = (("get_state", "set_state"), ("state_dict", "load_state_dict"))


def _state_methods(obj: Any) -> tuple[str, str] | None:
    for get, put in _METHOD_PAIRS:
        if callable(getattr(obj, get, None)) and callable(getattr(obj, put, None)):
            return get, put
    return None


def has_state_methods(obj: Any) -> bool:
    """Whether `obj` has get_state()/set_state() or state_dict()/load_state_dict()."""
    return not isinstance(obj, type) and _state_methods(obj) is not None


class StatefulIteratorHandler(_PerProcessHandler):
    """Any object with ``get_state()``/``set_state(state)`` or ``state_dict()``/``load_state_dict()``.

    The state is captured by calling the getter inside `save()`; it must be JSON data, possibly
    with bytes, tuples, numpy arrays and scalars, and dicts with non-str keys, which all come back
    as they were (``process_<i>-of-<n>.json``). Restore calls the setter on the target, in place,
    and returns the target; without a target it returns the state. The registry picks this handler
    for any object that has those methods and no handler of its own.
    """

    id = "cairn.stateful_iterator"
    version = 1
    _suffix = ".json"
    _kind = "stateful"

    def _capture(self, obj: Any) -> Sequence[bytes]:
        methods = _state_methods(obj)
        if methods is None:
            raise TypeError(
                f"StatefulIteratorHandler needs get_state()/set_state() or "
                f"state_dict()/load_state_dict(); {type(obj).__qualname__} has neither"
            )
        state = getattr(obj, methods[0])()
        body = {"methods": list(methods), "state": encode_state(state, "")}
        return [json.dumps(body, allow_nan=False).encode()]

    def _parse(self, data: bytes, stored: StoredItem) -> tuple[tuple[str, str], Any]:
        body = self._load_json(data, stored)
        try:
            methods = tuple(body["methods"])
            if methods not in _METHOD_PAIRS:
                raise ValueError(f"methods {body['methods']!r} are not one of {_METHOD_PAIRS}")
            return methods, decode_state(body["state"])
        except (ValueError, KeyError, TypeError, RecursionError, OverflowError) as e:
            raise CorruptCheckpointError(
                f"{stored.describe_file(self._file_name())}: the iterator state does not parse: "
                f"{type(e).__name__}: {e}"
            ) from None

    def _decode(self, data: bytes, stored: StoredItem) -> Any:
        return self._parse(data, stored)[1]

    def _apply(self, data: bytes, target: Any, stored: StoredItem) -> Any:
        methods, state = self._parse(data, stored)
        setter = getattr(target, methods[1], None)
        if not callable(setter):
            raise MismatchError(
                f"step {stored.step}, item {stored.name!r} was saved with {methods[0]}(); "
                f"the target {type(target).__qualname__} has no {methods[1]}()"
            )
        self._set_state(setter, state, stored)
        return target


# ---------------------------------------------------------------------------- grain

_GRAIN_LOADER = "grain._src.python.data_loader.DataLoaderIterator"
GRAIN_TYPES = ("grain._src.python.dataset.dataset.DatasetIterator", _GRAIN_LOADER)


def ensure_absl_flags_parsed() -> None:
    """Grain's multiprocess workers read absl flags; outside ``absl.app.run`` nobody parsed them,
    and the workers fail with UnparsedFlagAccessError. Mark them parsed (their defaults)."""
    flags = optional("absl.flags", feature="grain iterators")

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


class GrainIteratorHandler(_PerProcessHandler):
    """grain iterators: ``DatasetIterator`` (``iter(dataset)``) and ``DataLoader`` iterators.

    ``get_state()`` is captured inside `save()`; each process writes
    ``process_<i>-of-<n>.json``, the same JSON Orbax's grain handler writes. Restore calls
    ``set_state`` on the target iterator (in place) and returns it; without a target it returns the
    state as a dict. Grain's multiprocess workers need absl flags parsed: this handler marks them
    parsed if nobody did (call ``absl.flags.FLAGS.mark_as_parsed()`` yourself before iterating
    outside ``absl.app.run``).
    """

    id = "cairn.grain_iterator"
    version = 1
    _suffix = ".json"
    _kind = "grain"

    def _capture(self, obj: Any) -> Sequence[bytes]:
        if not callable(getattr(obj, "get_state", None)):
            raise TypeError(
                f"GrainIteratorHandler saves grain iterators (get_state/set_state), got "
                f"{type(obj).__qualname__}"
            )
        ensure_absl_flags_parsed()
        state = obj.get_state()
        if isinstance(state, (bytes, bytearray)):  # DataLoader: JSON already, as bytes
            return [bytes(state)]
        try:
            return [json.dumps(state, indent=2, allow_nan=False).encode()]
        except (TypeError, ValueError) as e:
            raise TypeError(f"the grain iterator's state is not JSON: {e}") from None

    def _decode(self, data: bytes, stored: StoredItem) -> Any:
        state = self._load_json(data, stored)
        if not isinstance(state, dict):
            raise CorruptCheckpointError(
                f"{stored.describe_file(self._file_name())}: the grain state is a "
                f"{type(state).__name__}, not a JSON object"
            )
        return state

    def _apply(self, data: bytes, target: Any, stored: StoredItem) -> Any:
        if not callable(getattr(target, "set_state", None)):
            raise MismatchError(
                f"step {stored.step}, item {stored.name!r} holds a grain iterator state; the "
                f"target {type(target).__qualname__} has no set_state()"
            )
        ensure_absl_flags_parsed()
        state = self._decode(data, stored)  # a DataLoader parses the bytes again itself
        self._set_state(
            target.set_state, data if _GRAIN_LOADER in _type_names(target) else state, stored
        )
        return target


# ---------------------------------------------------------------------------- tf.data

TF_TYPES = ("tensorflow.python.data.ops.iterator_ops.OwnedIterator",)
_MAGIC = b"CAIRN-TFDATA-1\n"
_POLICIES = {"fail": 2, "warn": 0, "ignore": 1}
_PIECE_LIMIT = (1 << 31) - (1 << 24)  # one TensorProto must stay under protobuf's 2 GiB
_PROBE_READY = b"cairn-probe-ready\n"

log = logging.getLogger("cairn")


class TfDataIteratorState:
    """A saved tf.data iterator position, restored without a target: apply it with `restore_into`."""

    def __init__(self, data: bytes, where: str, probe_timeout: float | None) -> None:
        self._data = data
        self._where = where
        self._probe_timeout = probe_timeout

    @property
    def nbytes(self) -> int:
        return len(self._data)

    def restore_into(self, iterator: Any) -> Any:
        """Move `iterator` (``iter()`` of the same pipeline) to the saved position; returns it."""
        return _deserialize(self._data, iterator, self._where, self._probe_timeout)

    def __repr__(self) -> str:
        return f"TfDataIteratorState({self._where}, {self.nbytes} bytes)"


_TF_FUNCTIONS: dict[str, Callable[[Any], Any]] = {}


def _tf_functions() -> dict[str, Callable[[Any], Any]]:
    """Graph functions that turn the iterator's variant state into one string per piece and back.

    Each piece (one buffered element, one iterator's own state) becomes its own TensorProto, so a
    state of any total size avoids the 2 GiB limit of one proto; in a graph this is about as fast as
    one `serialize_tensor` of the whole state (eager per-piece calls, as `_save()` does, are not).
    """
    if not _TF_FUNCTIONS:
        tf = optional("tensorflow", feature="tf.data iterator state")

        spec_v, spec_s = tf.TensorSpec([None], tf.variant), tf.TensorSpec([None], tf.string)

        @tf.function(input_signature=[spec_v])
        def to_pieces(variant: Any) -> Any:
            return tf.map_fn(tf.io.serialize_tensor, variant, fn_output_signature=tf.string)

        @tf.function(input_signature=[spec_s])
        def from_pieces(pieces: Any) -> Any:
            return tf.map_fn(
                lambda p: tf.io.parse_tensor(p, tf.variant), pieces, fn_output_signature=tf.variant
            )

        _TF_FUNCTIONS.update(to_pieces=to_pieces, from_pieces=from_pieces)
    return _TF_FUNCTIONS


def _deserialize(data: bytes, iterator: Any, where: str, probe_timeout: float | None) -> Any:
    """Check the file (`_split`), try it in a probe process (`_probe`, unless `probe_timeout` is
    None), then restore here."""
    tf = optional("tensorflow", feature="tf.data iterator state")

    if getattr(iterator, "_iterator_resource", None) is None:
        raise MismatchError(
            f"{where} holds a tf.data iterator position; the target must be iter() of the same "
            f"tf.data pipeline, got {type(iterator).__qualname__}"
        )
    pieces = _split(data, where)
    error = None if probe_timeout is None else _probe(data, iterator, where, probe_timeout)
    if error is None:
        try:
            _restore_pieces(pieces, iterator._iterator_resource)
        except (tf.errors.NotFoundError, tf.errors.InvalidArgumentError) as e:
            error = _tf_message(e)
        except tf.errors.OpError as e:
            raise CorruptCheckpointError(f"{where}: {_refused(e)}") from None
    if error is not None:
        raise MismatchError(
            f"{where}: the target iterator is not over the pipeline that was saved: {error}"
        )
    return iterator


def _restore_pieces(pieces: list[bytes], resource: Any) -> None:
    tf = optional("tensorflow", feature="tf.data iterator state")

    variant = _tf_functions()["from_pieces"](tf.constant(pieces, dtype=tf.string))
    tf.raw_ops.DeserializeIterator(resource_handle=resource, serialized=variant)


def _refused(e: Any) -> str:  # a state TensorFlow refused other than as another pipeline's
    return f"TensorFlow cannot restore this state ({type(e).__name__}: {_tf_message(e)})"


def _tf_message(error: Any) -> str:
    """A TensorFlow op error's message without the function-node prefix and op suffix."""
    text = str(getattr(error, "message", "") or error).strip()
    text = re.sub(r"^\{\{function_node [^}]*\}\}\s*", "", text)
    return re.sub(r"\s*\[Op:\w+\].*$", "", text, flags=re.S)


_TF_FEATURE = "tf.data iterator state"


def _split(data: bytes, where: str) -> list[bytes]:
    """The pieces of a ``process_*.tfdata`` file (magic, count, lengths, pieces), each checked
    with `_check_piece`: CorruptCheckpointError naming `where` and the piece if any is wrong."""
    header = len(_MAGIC) + 8
    if data[: len(_MAGIC)] != _MAGIC or len(data) < header:
        raise CorruptCheckpointError(f"{where} is not a cairn tf.data state file")
    (count,) = struct.unpack_from("<Q", data, len(_MAGIC))
    if count > (len(data) - header) // 8:
        raise CorruptCheckpointError(f"{where}: {count} pieces cannot fit in {len(data)} bytes")
    lengths = struct.unpack_from(f"<{count}Q", data, header)
    offset = header + 8 * count
    if offset + sum(lengths) != len(data):
        raise CorruptCheckpointError(f"{where}: the piece lengths do not add up to the file size")
    view = memoryview(data)
    pieces = []
    for index, length in enumerate(lengths):
        pieces.append(bytes(view[offset : offset + length]))
        offset += length
        try:
            _check_piece(pieces[-1])
        except ValueError as e:
            raise CorruptCheckpointError(
                f"{where}: piece {index} of the tf.data state is damaged: {e}"
            ) from None
    return pieces


# What SerializeIterator gives, one element per piece (TensorFlow 2.x, data/serialization_utils):
# a scalar DT_VARIANT TensorProto whose tensor_content is one varint-prefixed
# VariantTensorDataProto of type "tensorflow::Iterator", its metadata the iterator's name and
# its keys joined by "@@", and its one tensor a scalar DT_VARIANT holding a CompressedElement
# (data/dataset.proto) with a component per key: dtype, shape, uncompressed sizes, snappy data.
_ITERATOR_TYPE = "tensorflow::Iterator"
_COMPRESSED_TYPE = "tensorflow.data.CompressedElement"
_DELIMITER = "@@"
_SNAPPY_EXPANSION = 22  # one 3-byte snappy copy writes at most 64 bytes


def _varint(data: bytes, offset: int) -> tuple[int, int]:
    value = 0
    for shift in range(0, 64, 7):
        if offset >= len(data):
            break
        byte = data[offset]
        offset += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, offset
    raise ValueError("a varint is cut short or too long")


def _parse(message: Any, data: bytes) -> Any:
    # protobuf comes with tensorflow, which made `message` (its top module is no extra's)
    from google.protobuf.message import DecodeError

    try:
        message.ParseFromString(data)
    except DecodeError as e:
        raise ValueError(f"not a {type(message).__name__}: {e}") from None
    return message


def _variant_value(tensor: Any) -> Any:
    """The one VariantTensorDataProto of a scalar DT_VARIANT TensorProto, in either of
    TensorFlow's encodings (``variant_val``, or a varint length and the bytes in
    ``tensor_content``)."""
    tensor_pb2 = optional("tensorflow.core.framework.tensor_pb2", feature=_TF_FEATURE)
    types_pb2 = optional("tensorflow.core.framework.types_pb2", feature=_TF_FEATURE)

    fields = {f.name for f, _ in tensor.ListFields()}
    shape = tensor.tensor_shape
    if tensor.dtype != types_pb2.DT_VARIANT or shape.dim or shape.unknown_rank:
        dims = "unknown" if shape.unknown_rank else [d.size for d in shape.dim]
        raise ValueError(f"a tensor of dtype {tensor.dtype} and shape {dims}, not a variant scalar")
    if fields - {"dtype", "tensor_shape"} == {"variant_val"} and len(tensor.variant_val) == 1:
        return tensor.variant_val[0]
    if fields - {"dtype", "tensor_shape"} != {"tensor_content"}:
        raise ValueError(f"a variant scalar with the fields {sorted(fields)}")
    size, start = _varint(tensor.tensor_content, 0)
    if start + size != len(tensor.tensor_content):
        raise ValueError("the variant's length does not match its content")
    return _parse(tensor_pb2.VariantTensorDataProto(), tensor.tensor_content[start:])


def _check_piece(piece: bytes) -> None:
    """ValueError unless `piece` has the layout above, with sizes that add up (no native code).

    This refuses damage and sizes that would make TensorFlow allocate beyond what the file holds;
    values inside the compressed data are not checked here (the probe process is for those).
    """
    dataset_pb2 = optional("tensorflow.core.framework.dataset_pb2", feature=_TF_FEATURE)
    tensor_pb2 = optional("tensorflow.core.framework.tensor_pb2", feature=_TF_FEATURE)

    state = _variant_value(_parse(tensor_pb2.TensorProto(), piece))
    if state.type_name != _ITERATOR_TYPE:
        raise ValueError(f"a variant of type {state.type_name!r}, not {_ITERATOR_TYPE!r}")
    try:
        keys = state.metadata.decode().split(_DELIMITER)[1:]
    except UnicodeDecodeError:
        raise ValueError("the iterator's keys are not UTF-8") from None
    if len(state.tensors) != (1 if keys else 0):
        raise ValueError(f"{len(state.tensors)} tensors for {len(keys)} keys")
    for inner in state.tensors:
        element = _variant_value(inner)
        if element.type_name != _COMPRESSED_TYPE or element.tensors:
            raise ValueError(f"a value of type {element.type_name!r}, not {_COMPRESSED_TYPE!r}")
        _check_compressed(_parse(dataset_pb2.CompressedElement(), element.metadata), len(keys))


def _check_compressed(element: Any, keys: int) -> None:
    tf = optional("tensorflow", feature="tf.data iterator state")

    if element.version != 0 or len(element.component_metadata) != keys:
        raise ValueError(
            f"a compressed element of version {element.version} with "
            f"{len(element.component_metadata)} components for {keys} keys"
        )
    total = 0
    for component in element.component_metadata:
        shape = component.tensor_shape
        if shape.unknown_rank or len(shape.dim) > 254 or any(d.size < 0 for d in shape.dim):
            raise ValueError(f"a component of shape {[d.size for d in shape.dim]}")
        count = math.prod(d.size for d in shape.dim)
        sizes = list(component.uncompressed_bytes)
        try:
            dtype = tf.dtypes.as_dtype(component.dtype)
        except TypeError:
            raise ValueError(f"a component of unknown dtype {component.dtype}") from None
        if dtype == tf.string:
            ok = len(sizes) == count
        elif dtype == tf.variant:
            ok = len(sizes) == 1 and count <= sizes[0]
        else:
            ok = dtype.size > 0 and not dtype._is_ref_dtype and sum(sizes) == count * dtype.size
            ok = ok and len(sizes) <= 1 and dtype != tf.resource
        if not ok:
            raise ValueError(f"a {dtype.name} component of {count} elements and sizes {sizes[:4]}")
        total += sum(sizes)
    length, _ = _varint(element.data, 0)
    if length != total or total > _SNAPPY_EXPANSION * len(element.data):
        raise ValueError(
            f"{len(element.data)} compressed bytes for {length}, the components hold {total}"
        )


def _probe(data: bytes, iterator: Any, where: str, timeout: float) -> str | None:
    """Restore the state into the same pipeline in a short-lived child process first.

    A state with a valid layout can still hold values (a count, an index, compressed bytes) that
    crash TensorFlow's restore code or make it loop, when restoring, iterating or destroying the
    iterator. The child restores it, takes an element and destroys the iterator; if it dies or
    hangs, this raises CorruptCheckpointError and no native code here saw the state. If
    TensorFlow refused it there as another pipeline's (NotFound, InvalidArgument), this returns
    its message, and the caller raises without restoring here (a failed restore leaves the target
    half-restored); refused otherwise, this raises CorruptCheckpointError. The child rebuilds the
    pipeline from its serialized graph; if it cannot, a warning is logged and this returns None.
    The child has `timeout` seconds, plus 60 per GiB of state, once TensorFlow is imported.
    """
    tf = optional("tensorflow", feature="tf.data iterator state")

    try:
        graph = tf.raw_ops.DatasetToGraphV2(
            input_dataset=iterator._dataset._variant_tensor,
            external_state_policy=_POLICIES["ignore"],
            strip_device_assignment=True,
        ).numpy()
    except (AttributeError, tf.errors.OpError) as e:
        log.warning("%s: the pipeline cannot be probed (%s); restoring without a probe", where, e)
        return None
    header = {
        "graph": graph,
        "types": [t.as_datatype_enum for t in iterator._flat_output_types],
        "shapes": [s.as_proto().SerializeToString() for s in iterator._flat_output_shapes],
        "seconds": math.ceil(timeout + 60 * len(data) / 2**30),
    }
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "2"}
    command = [
        sys.executable,
        "-c",
        "from cairn.handlers._iterators import probe_main; probe_main()",
    ]
    try:
        run = subprocess.run(
            command,
            input=b"".join([pickle.dumps(header), data]),
            capture_output=True,
            env=env,
            timeout=header["seconds"] + 600,
        )
        code, out, err = run.returncode, run.stdout, run.stderr
    except subprocess.TimeoutExpired as e:
        code, out, err = -signal.SIGKILL, e.stdout or b"", e.stderr or b""
    _, ready, verdict = out.partition(_PROBE_READY)
    if not ready:
        tail = err.decode(errors="replace").strip()[-300:]
        log.warning("%s: the probe process did not start (%s); restoring without it", where, tail)
        return None
    if code == 0 and verdict.endswith(b"\n"):
        result: dict[str, str | None] = json.loads(verdict)
        if result.get("damaged"):
            raise CorruptCheckpointError(f"{where}: {result['damaged']}")
        return result["error"]
    how = (
        f"did not finish within {header['seconds']} s"
        if code in (-signal.SIGALRM, -signal.SIGKILL)
        else f"crashed TensorFlow ({_exit_name(code)})"
    )
    raise CorruptCheckpointError(
        f"{where}: restoring this tf.data state {how} in a probe process; the file is damaged "
        "or crafted, and it was not restored"
    )


def _exit_name(code: int) -> str:
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def probe_main() -> None:
    """The probe process (`_probe`): stdin holds a pickled header from the parent, then the state.

    Prints the ready line once the pipeline is rebuilt, before the state is touched, then a JSON
    line once TensorFlow survived restoring it, producing an element and destroying the iterator:
    ``{"error": null}``, or TensorFlow's message if it refused the state. SIGALRM ends a hang.
    """
    stdin = sys.stdin.buffer
    header = pickle.load(stdin)
    data = stdin.read()
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")  # if memory runs out, the kernel kills the probe, not the trainer
    except OSError:
        pass
    tf = optional("tensorflow", feature="tf.data iterator state")
    from tensorflow.core.framework import tensor_shape_pb2

    types = [tf.dtypes.as_dtype(t) for t in header["types"]]
    shapes = [
        tf.TensorShape(tensor_shape_pb2.TensorShapeProto.FromString(s)) for s in header["shapes"]
    ]
    dataset = tf.raw_ops.DatasetFromGraph(graph_def=header["graph"])
    resource = tf.raw_ops.AnonymousIteratorV3(output_types=types, output_shapes=shapes)
    tf.raw_ops.MakeIterator(dataset=dataset, iterator=resource)
    sys.stdout.buffer.write(_PROBE_READY)
    sys.stdout.flush()
    signal.alarm(header["seconds"])
    error = damaged = None
    try:
        _restore_pieces(_split(data, "probe"), resource)
    except (tf.errors.NotFoundError, tf.errors.InvalidArgumentError) as e:
        error = _tf_message(e)
    except tf.errors.OpError as e:  # InternalError, DataLossError, ...: refused otherwise
        damaged = _refused(e)
    else:
        try:
            tf.raw_ops.IteratorGetNext(iterator=resource, output_types=types, output_shapes=shapes)
        except (tf.errors.NotFoundError, tf.errors.InvalidArgumentError) as e:
            error = _tf_message(e)
        except tf.errors.OpError:
            pass  # the end of the sequence, or an error the pipeline itself raises
    del resource  # a half-restored iterator can crash when it is destroyed
    sys.stdout.buffer.write(json.dumps({"error": error, "damaged": damaged}).encode() + b"\n")
    sys.stdout.flush()


class TfDataIteratorHandler(_PerProcessHandler):
    """tf.data iterators (``iter(dataset)``), one ``process_<i>-of-<n>.tfdata`` file per process.

    `save()` captures the iterator's position with ``SerializeIterator`` on the caller's thread
    (about 0.15-0.3 s for a shuffle buffer of 10k elements; the buffered elements are part of the
    state) and the commit thread writes it. Restore moves a fresh iterator over the same pipeline
    to the saved position, in place, and returns it; without a target it returns a
    `TfDataIteratorState` to apply later. A pipeline whose ops keep state outside tf.data (such as
    ``tf.py_function``) raises ValueError inside `save()`, before anything is written, unless
    `external_state` is ``"warn"`` or ``"ignore"`` (that state is then not saved). When None, the
    dataset's ``options().experimental_external_state_policy`` decides, and "fail" if unset.
    States of any total size are stored, each buffered element in its own piece; an element type of
    2 GiB or more is refused.

    A state read back is untrusted: its layout is checked in Python, then, with `probe` (the
    default), a child process restores it into the same pipeline first, so that a damaged or
    crafted state that crashes TensorFlow, or hangs it for `probe_timeout` seconds (plus 60 per
    GiB of state), raises CorruptCheckpointError instead of killing this process. That costs a
    few seconds per restore (the child imports TensorFlow); ``probe=False`` skips the child, for
    states you wrote yourself. See docs/reliability.md, "Iterator states from disk".
    """

    id = "cairn.tf_data_iterator"
    version = 1
    _suffix = ".tfdata"
    _kind = "tf.data"

    def __init__(
        self,
        *,
        external_state: str | None = None,
        probe: bool = True,
        probe_timeout: float = 120.0,
    ) -> None:
        if external_state is not None and external_state not in _POLICIES:
            raise ValueError(
                f"external_state must be None, 'fail', 'warn' or 'ignore', got {external_state!r}"
            )
        if not isinstance(probe, bool):
            raise TypeError(f"probe must be a bool, got {probe!r}")
        if isinstance(probe_timeout, bool) or not isinstance(probe_timeout, (int, float)):
            raise TypeError(f"probe_timeout must be a number of seconds, got {probe_timeout!r}")
        if not 0 < probe_timeout < math.inf:
            raise ValueError(f"probe_timeout must be positive and finite, got {probe_timeout!r}")
        self._external_state = external_state
        self._probe_timeout = float(probe_timeout) if probe else None

    def _policy(self, iterator: Any) -> int:
        if self._external_state is not None:
            return _POLICIES[self._external_state]
        dataset = getattr(iterator, "_dataset", None)
        option = dataset.options().experimental_external_state_policy if dataset else None
        return int(option.value) if option is not None else _POLICIES["fail"]

    def _capture(self, obj: Any) -> Sequence[bytes | memoryview]:
        tf = optional("tensorflow", feature="tf.data iterator state")

        if getattr(obj, "_iterator_resource", None) is None:
            raise TypeError(
                f"TfDataIteratorHandler saves iter(tf.data.Dataset) iterators, got "
                f"{type(obj).__qualname__}"
            )
        for spec in tf.nest.flatten(obj.element_spec):
            shape, dtype = getattr(spec, "shape", None), getattr(spec, "dtype", None)
            if shape is not None and shape.is_fully_defined() and dtype is not None:
                nbytes = shape.num_elements() * max(dtype.size, 1)
                if nbytes >= _PIECE_LIMIT:
                    raise ValueError(
                        f"a tf.data element of {spec} is {nbytes / 2**30:.1f} GiB; iterator state "
                        "pieces must stay under protobuf's 2 GiB limit: batch less per element"
                    )
        try:
            variant = tf.raw_ops.SerializeIterator(
                resource_handle=obj._iterator_resource, external_state_policy=self._policy(obj)
            )
        except tf.errors.FailedPreconditionError as e:
            raise ValueError(
                f"this tf.data iterator cannot be saved: its pipeline has state outside tf.data "
                f"({_tf_message(e)}); remove tf.py_function/stateful ops from the pipeline, or "
                "pass TfDataIteratorHandler(external_state='warn') to save without that state"
            ) from None
        pieces = _tf_functions()["to_pieces"](variant).numpy().tolist()
        lengths = np.array([len(p) for p in pieces], "<u8")
        return [_MAGIC, struct.pack("<Q", len(pieces)), lengths.tobytes(), *pieces]

    def _decode(self, data: bytes, stored: StoredItem) -> Any:
        where = stored.describe_file(self._file_name())
        _split(data, where)  # a damaged file fails now, not when applied
        return TfDataIteratorState(data, where, self._probe_timeout)

    def _apply(self, data: bytes, target: Any, stored: StoredItem) -> Any:
        where = stored.describe_file(self._file_name())
        return _deserialize(data, target, where, self._probe_timeout)
