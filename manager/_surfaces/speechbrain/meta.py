"""What a SpeechBrain-style checkpoint is: the names (`CKPT_PREFIX`, `METAFNAME`,
`PARAMFILE_EXT`), `Checkpoint`, `ckpt_recency`, and its meta: checked, encoded as JSON data in
the manifest and decoded back (`_check_meta`, `_encode_meta`, `_decode_meta`, `_checked_meta`).
"""

from __future__ import annotations

import collections
import math
import pathlib
import re
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from cairn.handlers import SpeechBrainHandler
from cairn.handlers.errors import CorruptCheckpointError, MissingDependencyError
from cairn.handlers.io import decode_state, encode_state, optional

CKPT_PREFIX = "CKPT"
METAFNAME = f"{CKPT_PREFIX}.yaml"  # the meta file of SpeechBrain's own checkpoints (read only)
PARAMFILE_EXT = SpeechBrainHandler.paramfile_ext  # ".ckpt"
_META_ITEM = "CKPT.meta"  # holds the meta of a checkpoint without recoverables
_STEP_DIR = re.compile(rf"{CKPT_PREFIX}_([0-9]+)")

Checkpoint = collections.namedtuple("Checkpoint", ["path", "meta", "paramfiles"])
Checkpoint.__doc__ = """One saved checkpoint: `path` (pathlib.Path of its directory), `meta` (a dict;
"unixtime" and "end-of-epoch" always, plus what was given to save) and `paramfiles` (recoverable
name -> pathlib.Path of its saved file). Hashed by path, so checkpoints make sets."""
Checkpoint.__hash__ = lambda self: hash(self[0])  # type: ignore[method-assign]


def ckpt_recency(ckpt: Checkpoint) -> tuple[int, float]:
    """Recency as an importance key: the save sequence number, then the save time.

    cairn numbers its checkpoints in save order, so two saves within one clock tick, or a clock
    that stepped back, still sort right. SpeechBrain's own checkpoints (no number) sort before
    cairn's, by their "unixtime".
    """
    match = _STEP_DIR.fullmatch(pathlib.Path(ckpt.path).name)
    return (int(match.group(1)) if match else -1, float(ckpt.meta["unixtime"]))


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


def _number(value: Any) -> float | None:
    """A meta value as a number for ranking: a real number that is not NaN (bools count, as in
    SpeechBrain); None for anything else, an int too large for a float included."""
    if not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return None if math.isnan(number) else number


def _checked_meta(meta: Any) -> dict[str, Any]:
    """A checkpoint's meta as this API hands it out: a mapping with str keys, a finite number
    "unixtime" and a bool "end-of-epoch" (every checkpointer writes both); CorruptCheckpointError
    otherwise."""
    if not isinstance(meta, dict) or not all(isinstance(k, str) for k in meta):
        raise CorruptCheckpointError(
            f"its meta is a {type(meta).__qualname__}, not a mapping with str keys"
        )
    unixtime = meta.get("unixtime")
    number = None if isinstance(unixtime, bool) else _number(unixtime)
    if number is None or not math.isfinite(number):
        raise CorruptCheckpointError(f"its meta's unixtime {unixtime!r:.40} is not a time")
    if not isinstance(meta.get("end-of-epoch"), bool):
        raise CorruptCheckpointError(
            f"its meta's end-of-epoch {meta.get('end-of-epoch')!r:.40} is not a bool"
        )
    return dict(meta)
