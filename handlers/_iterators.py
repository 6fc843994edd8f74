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
import re
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cairn.handlers._files import ChecksummedFile, FileRecord, StoredItem, writing_process
from cairn.handlers._tree import dtype_from_name, dtype_name
from cairn.handlers.errors import CorruptCheckpointError, MismatchError

__all__ = [
    "GrainIteratorHandler",
    "StatefulIteratorHandler",
    "TfDataIteratorHandler",
    "TfDataIteratorState",
]

_PROCESS_FILE = re.compile(r"process_(\d+)-of-(\d+)\.")


def _type_names(obj: Any) -> set[str]:
    return {f"{t.__module__}.{t.__qualname__}" for t in type(obj).__mro__}


class _BytesSnapshot:
    """Captured bytes (in pieces), written as this process's file on the commit thread."""

    def __init__(self, pieces: Sequence[bytes | memoryview], suffix: str) -> None:
        self._pieces = pieces
        self._suffix = suffix

    def write(self, directory: Path) -> Sequence[FileRecord]:
        index, count = writing_process()
        with ChecksummedFile(directory, f"process_{index}-of-{count}{self._suffix}") as f:
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

    def restore(self, stored: StoredItem, target: Any = None) -> Any:
        index, count = writing_process()
        name = f"process_{index}-of-{count}{self._suffix}"
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

    def describe(self, stored: StoredItem) -> dict[str, Any]:
        return {
            "kind": self._kind,
            "processes": {p: r.size for p, r in sorted(stored.files.items())},
            "bytes": sum(r.size for r in stored.files.values()),
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


# ---------------------------------------------------------------------------- get/set_state objects

_TAG = "__cairn__"


def _encode(value: Any, path: str) -> Any:
    """A JSON value for a state: dicts, lists, str, numbers, bool, None as JSON; tuples, bytes,
    numpy arrays and scalars and non-str dict keys tagged so they come back as they were."""
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
        if array.dtype.hasobject:
            raise TypeError(f"state{path}: object arrays cannot be stored")
        return {
            _TAG: "ndarray" if isinstance(value, np.ndarray) else "scalar",
            "dtype": dtype_name(array.dtype),
            "shape": list(array.shape),
            "data": base64.b64encode(np.ascontiguousarray(array).tobytes()).decode(),
        }
    if isinstance(value, (bytes, bytearray)):
        return {_TAG: "bytes", "data": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, tuple):
        return {_TAG: "tuple", "items": [_encode(v, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if _TAG in value:
            raise TypeError(f"state{path}: the key {_TAG!r} is reserved")
        if all(isinstance(k, str) for k in value):
            return {k: _encode(v, f"{path}[{k!r}]") for k, v in value.items()}
        return {
            _TAG: "dict",
            "items": [
                [_encode(k, f"{path}(key {k!r})"), _encode(v, f"{path}[{k!r}]")]
                for k, v in value.items()
            ],
        }
    raise TypeError(
        f"state{path} is a {type(value).__qualname__}; iterator state must be JSON data, bytes, "
        "tuples or numpy arrays"
    )


def _decode_value(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode_value(v) for v in value]
    if not isinstance(value, dict):
        return value
    tag = value.get(_TAG)
    if tag is None:
        return {k: _decode_value(v) for k, v in value.items()}
    if tag == "float":
        return float(value["value"])
    if tag in ("ndarray", "scalar"):
        raw = base64.b64decode(value["data"])
        array = np.frombuffer(raw, dtype_from_name(value["dtype"])).reshape(value["shape"]).copy()
        return array if tag == "ndarray" else array[()]
    if tag == "bytes":
        return base64.b64decode(value["data"])
    if tag == "tuple":
        return tuple(_decode_value(v) for v in value["items"])
    if tag == "dict":
        return {_decode_value(k): _decode_value(v) for k, v in value["items"]}
    raise ValueError(f"unknown tag {tag!r}")


def _state_methods(obj: Any) -> tuple[str, str] | None:
    for get, put in (("get_state", "set_state"), ("state_dict", "load_state_dict")):
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
        body = {"methods": list(methods), "state": _encode(state, "")}
        return [json.dumps(body, allow_nan=False).encode()]

    def _parse(self, data: bytes, stored: StoredItem) -> tuple[list[str], Any]:
        try:
            body = json.loads(data)
            return body["methods"], _decode_value(body["state"])
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptCheckpointError(
                f"step {stored.step}, item {stored.name!r}: the iterator state does not parse: {e}"
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
        setter(state)
        return target


# ---------------------------------------------------------------------------- grain

_GRAIN_LOADER = "grain._src.python.data_loader.DataLoaderIterator"
GRAIN_TYPES = ("grain._src.python.dataset.dataset.DatasetIterator", _GRAIN_LOADER)


def ensure_absl_flags_parsed() -> None:
    """Grain's multiprocess workers read absl flags; outside ``absl.app.run`` nobody parsed them,
    and the workers fail with UnparsedFlagAccessError. Mark them parsed (their defaults)."""
    from absl import flags

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
        try:
            return json.loads(data)
        except ValueError as e:
            raise CorruptCheckpointError(
                f"step {stored.step}, item {stored.name!r}: the grain state does not parse: {e}"
            ) from None

    def _apply(self, data: bytes, target: Any, stored: StoredItem) -> Any:
        if not callable(getattr(target, "set_state", None)):
            raise MismatchError(
                f"step {stored.step}, item {stored.name!r} holds a grain iterator state; the "
                f"target {type(target).__qualname__} has no set_state()"
            )
        ensure_absl_flags_parsed()
        state = data if _GRAIN_LOADER in _type_names(target) else self._decode(data, stored)
        try:
            target.set_state(state)
        except (KeyError, ValueError, TypeError) as e:
            raise MismatchError(
                f"step {stored.step}, item {stored.name!r}: the target iterator does not accept "
                f"the saved state (a different pipeline?): {type(e).__name__}: {e}"
            ) from e
        return target


# ---------------------------------------------------------------------------- tf.data

TF_TYPES = ("tensorflow.python.data.ops.iterator_ops.OwnedIterator",)
_MAGIC = b"CAIRN-TFDATA-1\n"
_POLICIES = {"fail": 2, "warn": 0, "ignore": 1}
_PIECE_LIMIT = (1 << 31) - (1 << 24)  # one TensorProto must stay under protobuf's 2 GiB


class TfDataIteratorState:
    """A saved tf.data iterator position, restored without a target: apply it with `restore_into`."""

    def __init__(self, data: bytes, where: str) -> None:
        self._data = data
        self._where = where

    @property
    def nbytes(self) -> int:
        return len(self._data)

    def restore_into(self, iterator: Any) -> Any:
        """Move `iterator` (``iter()`` of the same pipeline) to the saved position; returns it."""
        return _deserialize(self._data, iterator, self._where)

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
        import tensorflow as tf

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


def _deserialize(data: bytes, iterator: Any, where: str) -> Any:
    import tensorflow as tf

    if getattr(iterator, "_iterator_resource", None) is None:
        raise MismatchError(
            f"{where} holds a tf.data iterator position; the target must be iter() of the same "
            f"tf.data pipeline, got {type(iterator).__qualname__}"
        )
    pieces = _split(data, where)
    try:
        variant = _tf_functions()["from_pieces"](tf.constant(pieces, dtype=tf.string))
        tf.raw_ops.DeserializeIterator(
            resource_handle=iterator._iterator_resource, serialized=variant
        )
    except (tf.errors.NotFoundError, tf.errors.InvalidArgumentError) as e:
        raise MismatchError(
            f"{where}: the target iterator is not over the pipeline that was saved: "
            f"{_tf_message(e)}"
        ) from None
    return iterator


def _tf_message(error: Any) -> str:
    """A TensorFlow op error's message without the function-node prefix and op suffix."""
    text = str(getattr(error, "message", "") or error).strip()
    text = re.sub(r"^\{\{function_node [^}]*\}\}\s*", "", text)
    return re.sub(r"\s*\[Op:\w+\].*$", "", text, flags=re.S)


def _split(data: bytes, where: str) -> list[bytes]:
    """The pieces of a ``process_*.tfdata`` file: magic, count, lengths, then the pieces."""
    view = memoryview(data)
    header = len(_MAGIC) + 8
    if bytes(view[: len(_MAGIC)]) != _MAGIC or len(data) < header:
        raise CorruptCheckpointError(f"{where} is not a cairn tf.data state file")
    (count,) = struct.unpack_from("<Q", data, len(_MAGIC))
    lengths = np.frombuffer(data, "<u8", count, header) if count else np.zeros(0, np.uint64)
    offset = header + 8 * count
    if offset + int(lengths.sum()) != len(data):
        raise CorruptCheckpointError(f"{where}: the piece lengths do not add up to the file size")
    pieces = []
    for length in lengths.tolist():
        pieces.append(bytes(view[offset : offset + length]))
        offset += length
    return pieces


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
    """

    id = "cairn.tf_data_iterator"
    version = 1
    _suffix = ".tfdata"
    _kind = "tf.data"

    def __init__(self, *, external_state: str | None = None) -> None:
        if external_state is not None and external_state not in _POLICIES:
            raise ValueError(
                f"external_state must be None, 'fail', 'warn' or 'ignore', got {external_state!r}"
            )
        self._external_state = external_state

    def _policy(self, iterator: Any) -> int:
        if self._external_state is not None:
            return _POLICIES[self._external_state]
        dataset = getattr(iterator, "_dataset", None)
        option = dataset.options().experimental_external_state_policy if dataset else None
        return int(option.value) if option is not None else _POLICIES["fail"]

    def _capture(self, obj: Any) -> Sequence[bytes | memoryview]:
        import tensorflow as tf

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
        where = f"step {stored.step}, item {stored.name!r}"
        _split(data, where)  # a damaged file fails now, not when applied
        return TfDataIteratorState(data, where)

    def _apply(self, data: bytes, target: Any, stored: StoredItem) -> Any:
        return _deserialize(data, target, f"step {stored.step}, item {stored.name!r}")
