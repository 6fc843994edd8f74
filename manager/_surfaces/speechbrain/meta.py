"""cairn's SpeechBrain-style checkpoints: their step names (`STEP_NAMES`), `ckpt_recency`, and
their meta, checked, encoded as JSON data in the manifest and decoded back (`_check_meta`,
`_encode_meta`, `_decode_meta`). What any SpeechBrain checkpoint is (`Checkpoint`, the names,
`_checked_meta`) and SpeechBrain's own directories: `cairn.manager._layouts.speechbrain`.
"""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from cairn.handlers.errors import MissingDependencyError
from cairn.handlers.io import decode_state, encode_state, optional
from cairn.manager._format import StepNames
from cairn.manager._layouts.speechbrain import CKPT_PREFIX, Checkpoint

_META_ITEM = "CKPT.meta"  # holds the meta of a checkpoint without recoverables
STEP_NAMES = StepNames(CKPT_PREFIX)  # cairn's checkpoints: CKPT_0, CKPT_1, ... in save order


def ckpt_recency(ckpt: Checkpoint) -> tuple[int, float]:
    """Recency as an importance key: the save sequence number, then the save time.

    cairn numbers its checkpoints in save order, so two saves within one clock tick, or a clock
    that stepped back, still sort right. SpeechBrain's own checkpoints (no number) sort before
    cairn's, by their "unixtime".
    """
    step = STEP_NAMES.parse(pathlib.Path(ckpt.path).name)
    return (-1 if step is None else step, float(ckpt.meta["unixtime"]))


def _check_meta(meta: Any) -> dict[str, Any]:
    """Meta as stored in the manifest (`_encode_meta` of each value); TypeError naming the key
    for a value that cannot be stored, ValueError for the keys the checkpointer sets."""
    if meta is None:
        return {}
    if not isinstance(meta, Mapping) or not all(isinstance(k, str) for k in meta):
        raise TypeError(f"meta must be a mapping with str keys, got {meta!r:.200}")
    out = {}
    for key, value in meta.items():
        if key in ("unixtime", "end-of-epoch"):
            raise ValueError(f"meta key {key!r} is set by the checkpointer")
        out[key] = _encode_meta(value, f"[{key!r}]")
    return out


_TAG = "__cairn__"  # as in encode_state: a key no meta mapping may use


def _encode_meta(value: Any, where: str) -> Any:
    """A meta value as JSON data that `_decode_meta` turns back into it: what JSON holds, NaN and
    the infinities, tuples, bytes, NumPy arrays, torch tensors (0-d ones and NumPy scalars as
    Python numbers) and paths (``pathlib.Path``); TypeError naming `where` for anything else."""
    if isinstance(value, pathlib.PurePath):
        return {_TAG: "path", "value": str(value)}
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if value.ndim == 0:
            return _encode_meta(value.item(), where)
        try:
            array = value.detach().to("cpu").numpy()
        except (TypeError, RuntimeError) as e:
            raise TypeError(f"meta{where}: a {value.dtype} tensor cannot be stored: {e}") from None
        return {_TAG: "tensor", "array": encode_state(array)}
    if isinstance(value, np.generic) or (isinstance(value, np.ndarray) and value.ndim == 0):
        value = value.item()
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"meta{where}: mapping keys must be str")
        if _TAG in value:
            raise TypeError(f"meta{where}: the key {_TAG!r} is reserved")
        return {k: _encode_meta(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, list):
        return [_encode_meta(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {
            _TAG: "tuple",
            "items": [_encode_meta(v, f"{where}[{i}]") for i, v in enumerate(value)],
        }
    try:
        return encode_state(value, where)
    except TypeError:
        raise TypeError(
            f"meta{where} is a {type(value).__qualname__}; meta values must be JSON data, NaN or "
            "infinite floats, tuples, bytes, NumPy arrays, torch tensors or pathlib paths"
        ) from None


def _decode_meta(value: Any) -> Any:
    """The meta value `_encode_meta` stored as `value`. Input it did not write raises ValueError,
    KeyError, TypeError or RecursionError (the caller reports the checkpoint as damaged)."""
    if isinstance(value, list):
        return [_decode_meta(v) for v in value]
    if not isinstance(value, dict):
        return value
    tag = value.get(_TAG)
    if tag is None:
        return {k: _decode_meta(v) for k, v in value.items()}
    if tag == "path":
        if not isinstance(value["value"], str):
            raise TypeError("a path in the meta is not a str")
        return pathlib.Path(value["value"])
    if tag == "tuple":
        if not isinstance(value["items"], list):
            raise TypeError("a tuple in the meta is not a list")
        return tuple(_decode_meta(v) for v in value["items"])
    if tag == "tensor":
        array = decode_state(value["array"])
        if not isinstance(array, np.ndarray):
            raise TypeError("a tensor in the meta is not an array")
        try:
            torch = optional("torch", feature="a torch tensor in a checkpoint's meta")
        except MissingDependencyError:
            return array  # saved where torch was; read here as the NumPy array it holds
        return torch.from_numpy(array)
    return decode_state(value)
