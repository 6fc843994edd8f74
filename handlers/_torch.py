"""TorchStateHandler: a torch module, optimizer, LR scheduler or tensor as its ``state_dict``.

No pickle anywhere: the state dict's structure (dicts with ``str`` or ``int`` keys, lists,
tuples, ``int``/``float``/``bool``/``None``/``str`` values) is written as JSON in
``state.json``, each tensor as ``tensors/<i>.npy`` (``allow_pickle=False``; bfloat16 stored as
its uint16 bits, the dtype recorded in the JSON). Every file is checksummed through the
manifest, and only the files it lists are read.

The snapshot (caller's thread) copies every tensor to the CPU, so training may change the
parameters as soon as ``save()`` returns. Restore with a module, optimizer or scheduler as the
target checks each tensor's shape and dtype against the target's own ``state_dict()`` (a
MismatchError names the key path) and loads it with ``load_state_dict``, returning the target;
what ``load_state_dict`` refuses (a key only one side has: torch's message names it) is a
MismatchError too, with torch's error chained (torch may have loaded the other keys by then). A
state that cannot be a state dict (not a dict with str keys) is CorruptCheckpointError; a saved
tensor restored into a module, or a state dict into a tensor, a MismatchError. Without a target
it returns the state dict (a tensor for a saved tensor). torch is imported only when a torch
object is saved or such an item restored.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from cairn.handlers._files import Destination, FileRecord, StoredItem, as_destination
from cairn.handlers._optional import optional
from cairn.handlers.errors import CorruptCheckpointError, MismatchError

__all__ = ["TORCH_TYPES", "TorchStateHandler"]

# Registered by name: torch is not imported to register them. Subclasses (every model,
# every optimizer) find these through their MRO.
TORCH_TYPES = (
    "torch.nn.modules.module.Module",
    "torch.optim.optimizer.Optimizer",
    "torch.optim.lr_scheduler.LRScheduler",
    "torch.Tensor",
)

_STRUCTURE = "state.json"
_FEATURE = "saving or restoring a torch module, optimizer or tensor"
# Tensor dtypes by name, and how each is stored in a .npy file (bfloat16 as its bits).
_DTYPES = {
    "float64": "float64",
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "uint16",
    "int64": "int64",
    "int32": "int32",
    "int16": "int16",
    "int8": "int8",
    "uint8": "uint8",
    "bool": "bool",
    "complex64": "complex64",
    "complex128": "complex128",
}


def _torch() -> Any:
    return optional("torch", feature=_FEATURE)


def _path(keys: Sequence[Any]) -> str:
    return "/".join(str(k) for k in keys) or "<root>"


def _encode(value: Any, keys: list[Any], tensors: list[np.ndarray], torch: Any) -> Any:
    """The JSON of one node; tensors appended to `tensors` as CPU copies in NumPy."""
    if isinstance(value, torch.Tensor):
        name = str(value.dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise TypeError(f"key {_path(keys)!r}: tensors of dtype {name} are not supported")
        if value.layout != torch.strided:
            raise TypeError(f"key {_path(keys)!r}: only dense tensors are supported")
        cpu = value.detach().to("cpu", copy=True).contiguous()
        if name == "bfloat16":  # NumPy has no bfloat16: its 16 bits, as uint16
            cpu = cpu.view(torch.int16)
        tensors.append(cpu.numpy().view(_DTYPES[name]))
        return {"tensor": len(tensors) - 1, "dtype": name, "shape": list(value.shape)}
    if isinstance(value, dict):
        entries = []
        for k, v in value.items():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise TypeError(f"key {_path([*keys, k])!r}: keys must be str or int, got {k!r}")
            entries.append([k, _encode(v, [*keys, k], tensors, torch)])
        return {"dict": entries}
    if isinstance(value, (list, tuple)):
        kind = "list" if isinstance(value, list) else "tuple"
        return {kind: [_encode(v, [*keys, i], tensors, torch) for i, v in enumerate(value)]}
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}  # nan, inf, -inf
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise TypeError(
        f"key {_path(keys)!r}: {type(value).__qualname__} is not a tensor, number, str, None, "
        "dict, list or tuple (TorchStateHandler writes no pickle)"
    )


class _TorchSnapshot:
    def __init__(self, structure: bytes, tensors: list[np.ndarray]) -> None:
        self._structure, self._tensors = structure, tensors

    def write(self, dest: Destination) -> Sequence[FileRecord]:
        dest = as_destination(dest)
        records = [dest.write_file(_STRUCTURE, self._structure)]
        for i, array in enumerate(self._tensors):
            buffer = io.BytesIO()
            np.save(buffer, array, allow_pickle=False)
            records.append(dest.write_file(f"tensors/{i}.npy", buffer.getbuffer()))
        return records


class TorchStateHandler:
    """Saves a torch object's ``state_dict()`` (or a tensor) without pickle; see the module."""

    id = "cairn.torch_state"
    version = 1

    def snapshot(self, obj: Any) -> _TorchSnapshot:
        torch = _torch()
        if isinstance(obj, torch.Tensor):
            kind, state = "tensor", obj
        elif callable(getattr(obj, "state_dict", None)):
            kind, state = type(obj).__qualname__, obj.state_dict()
        elif isinstance(obj, dict):
            kind, state = "dict", obj
        else:
            raise TypeError(
                f"TorchStateHandler saves torch modules, optimizers, schedulers, tensors and "
                f"dicts of tensors, not {type(obj).__qualname__}"
            )
        tensors: list[np.ndarray] = []
        tree = _encode(state, [], tensors, torch)
        body = json.dumps({"kind": kind, "tree": tree}, allow_nan=False).encode()
        return _TorchSnapshot(body, tensors)

    def restore(self, stored: StoredItem, target: Any = None) -> Any:
        torch = _torch()
        doc = _parse_json(stored)
        if not isinstance(doc, dict) or "tree" not in doc:
            raise CorruptCheckpointError(f"{stored.describe_file(_STRUCTURE)}: no state tree")
        state = self._decode(doc["tree"], [], stored, torch)
        if target is None:
            return state
        if isinstance(target, torch.Tensor):
            if not isinstance(state, torch.Tensor):
                raise MismatchError(
                    f"item {stored.name!r}, key '<root>': the checkpoint holds a "
                    f"{type(state).__qualname__}, the target a tensor"
                )
            _check(target, state, [], stored)
            with torch.no_grad():
                target.copy_(state)
            return target
        if not callable(getattr(target, "load_state_dict", None)):
            raise TypeError(
                f"item {stored.name!r}: a target must be a torch module, optimizer, scheduler or "
                f"tensor, got {type(target).__qualname__}"
            )
        if isinstance(state, torch.Tensor):
            raise MismatchError(
                f"item {stored.name!r}, key '<root>': the checkpoint holds a tensor, the target "
                f"a {type(target).__qualname__}"
            )
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            what = "a dict with keys that are not str" if isinstance(state, dict) else None
            raise CorruptCheckpointError(
                f"{stored.describe_file(_STRUCTURE)}: the state is "
                f"{what or 'a ' + type(state).__qualname__}, not a state dict (a dict with str "
                "keys)"
            )
        _check(target.state_dict(), state, [], stored)
        try:
            target.load_state_dict(state)
        except (RuntimeError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            # torch's own checks of a well-formed state dict against the target: keys one side
            # lacks (its message names them), optimizer groups of other sizes, values of the
            # wrong kind; it may have loaded the other keys by then
            raise MismatchError(
                f"item {stored.name!r}: {type(target).__qualname__}.load_state_dict refuses "
                f"the checkpoint's state: {type(e).__name__}: {e!s:.1000}"
            ) from e
        return target

    def _decode(self, node: Any, keys: list[Any], stored: StoredItem, torch: Any) -> Any:
        where = f"{stored.describe_file(_STRUCTURE)}, key {_path(keys)!r}"
        if not isinstance(node, dict) or len(node) not in (1, 3):
            raise CorruptCheckpointError(f"{where}: not a node of the state tree")
        if len(node) == 3:  # {"tensor", "dtype", "shape"}, each checked there
            return self._tensor(node, where, stored, torch)
        ((kind, body),) = node.items()
        if kind == "dict" and isinstance(body, list):
            out = {}
            for entry in body:
                if (
                    not (isinstance(entry, list) and len(entry) == 2)
                    or not isinstance(entry[0], (str, int))
                    or isinstance(entry[0], bool)  # never written: True would be the key 1
                ):
                    raise CorruptCheckpointError(f"{where}: a dict entry is not [key, node]")
                out[entry[0]] = self._decode(entry[1], [*keys, entry[0]], stored, torch)
            return out
        if kind in ("list", "tuple") and isinstance(body, list):
            items = [self._decode(v, [*keys, i], stored, torch) for i, v in enumerate(body)]
            return items if kind == "list" else tuple(items)
        if kind == "float" and body in ("nan", "inf", "-inf"):
            return float(body)
        if kind == "value" and (body is None or isinstance(body, (bool, int, float, str))):
            return body
        raise CorruptCheckpointError(f"{where}: unknown node {kind!r}")

    def _tensor(self, node: dict[str, Any], where: str, stored: StoredItem, torch: Any) -> Any:
        index, dtype, shape = node.get("tensor"), node.get("dtype"), node.get("shape")
        if (
            not isinstance(index, int)
            or isinstance(index, bool)
            or index < 0
            or dtype not in _DTYPES
            or not isinstance(shape, list)
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
        ):
            raise CorruptCheckpointError(f"{where}: a tensor needs an index, a dtype and a shape")
        relpath = f"tensors/{index}.npy"
        data = stored.read_bytes(relpath)  # only a file the manifest lists, checksummed
        try:
            array = np.load(io.BytesIO(data), allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise CorruptCheckpointError(f"{stored.describe_file(relpath)}: {e}") from None
        if array.dtype != np.dtype(_DTYPES[dtype]) or list(array.shape) != shape:
            raise CorruptCheckpointError(
                f"{stored.describe_file(relpath)} holds {array.dtype}{list(array.shape)}, "
                f"{_STRUCTURE} says {dtype}{shape}"
            )
        if dtype == "bfloat16":
            return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
        return torch.from_numpy(np.array(array, order="C", copy=True))  # 0-d stays 0-d

    def describe(self, stored: StoredItem) -> dict[str, Any]:
        doc = _parse_json(stored)
        kind = doc.get("kind") if isinstance(doc, dict) else None
        return {
            "kind": "torch",
            "object": kind if isinstance(kind, str) else "?",
            "tensors": sum(1 for f in stored.files if f.startswith("tensors/")),
            "bytes": sum(r.size for r in stored.files.values()),
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _parse_json(stored: StoredItem) -> Any:
    data = stored.read_bytes(_STRUCTURE)
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{stored.describe_file(_STRUCTURE)}: {e!s:.200}") from None


def _check(want: Any, got: Any, keys: list[Any], stored: StoredItem) -> None:
    """MismatchError where the target's state holds a tensor of another shape or dtype than the
    checkpoint at the same key path (keys only one side has are left to load_state_dict)."""
    torch = _torch()
    if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor):
        if tuple(want.shape) != tuple(got.shape) or want.dtype != got.dtype:
            raise MismatchError(
                f"item {stored.name!r}, key {_path(keys)!r}: the checkpoint holds "
                f"{str(got.dtype).removeprefix('torch.')}{list(got.shape)}, the target "
                f"{str(want.dtype).removeprefix('torch.')}{list(want.shape)}"
            )
    elif isinstance(want, dict) and isinstance(got, dict):
        for k in want:  # in the target's order: the first mismatch is named
            if k in got:
                _check(want[k], got[k], [*keys, k], stored)
    elif isinstance(want, (list, tuple)) and isinstance(got, (list, tuple)):
        for i, (w, g) in enumerate(zip(want, got, strict=False)):
            _check(w, g, [*keys, i], stored)
