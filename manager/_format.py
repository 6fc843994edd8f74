"""The on-disk format: step names, leftover names, the manifest and metrics.json (docs/format.md).

A committed step is a directory ``<prefix>_<step>`` (or just ``<step>`` with an empty prefix)
holding ``_CHECKPOINT.json``, the manifest, written last. Both JSON files carry a crc32c of their
own canonical body, so a flipped byte that still parses is caught.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import uuid
from collections.abc import Iterable, Mapping
from typing import Any, TypeGuard

import crc32c

from cairn.handlers import FileRecord
from cairn.handlers.errors import CorruptCheckpointError, UnsupportedFormatError
from cairn.handlers.io import parse_json

FORMAT_VERSION = 2
MANIFEST = "_CHECKPOINT.json"
METRICS = "metrics.json"
LOCK = ".cairn.lock"
ROOT_METADATA = "cairn_metadata.json"  # the directory's own metadata, written once
TRASH_PREFIX = ".trash-"
#: the step metadata key of a local tier's part: {process, processes, save, persistent}
PART = "cairn_part"
SYNC_PREFIX = ".cairn-sync-"  # how writer processes of a multi-process run meet (_writer)
_SYNC_RE = re.compile(re.escape(SYNC_PREFIX) + r"[A-Za-z0-9_.\-]+")


def check_sync_name(name: str) -> str:
    """`name` if it names a meeting file of writer processes in the directory's root (one plain
    component); ValueError otherwise, before anything is removed."""
    if not isinstance(name, str) or not _SYNC_RE.fullmatch(name):
        raise ValueError(f"{name!r} is not the name of a writer processes' meeting file")
    return name


_TMP_RE = re.compile(r"\.tmp-[0-9a-f]{32}$")


@dataclasses.dataclass(frozen=True)
class StepNames:
    """Formats and parses step directory names: ``checkpoint_100``, ``checkpoint_000100``, ``100``."""

    prefix: str = "checkpoint"
    digits: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str) or not re.fullmatch(r"[A-Za-z0-9_\-]*", self.prefix):
            raise ValueError(
                f"step_prefix must be a str of letters, digits, '_' and '-', got {self.prefix!r}"
            )
        if self.digits is not None and (
            isinstance(self.digits, bool)
            or not isinstance(self.digits, int)
            or not 1 <= self.digits <= 20
        ):
            raise ValueError(f"step_digits must be None or an int in 1..20, got {self.digits!r}")

    def format(self, step: int) -> str:
        number = str(step) if self.digits is None else f"{step:0{self.digits}d}"
        return f"{self.prefix}_{number}" if self.prefix else number

    def parse(self, name: str) -> int | None:
        """The step a directory name stands for, or None; only the canonical spelling counts."""
        number = name
        if self.prefix:
            if not name.startswith(self.prefix + "_"):
                return None
            number = name[len(self.prefix) + 1 :]
        if not number.isascii() or not number.isdigit():
            return None
        step = int(number)
        return step if self.format(step) == name else None

    def temporary(self, step: int) -> str:
        return f"{self.format(step)}.tmp-{uuid.uuid4().hex}"

    def is_temporary(self, name: str) -> bool:
        match = _TMP_RE.search(name)
        return match is not None and self.parse(name[: match.start()]) is not None


# A step directory under some naming: ``123``, ``step_123``, ``ckpt-000123`` (`namings`).
_STEP_LIKE = re.compile(r"(?:([A-Za-z0-9_\-]*?)_)?([0-9]{1,20})")


def namings(names: Iterable[str]) -> list[tuple[StepNames, list[tuple[int, str]]]]:
    """Step-like names (``123``, ``step_123``, ``checkpoint_000123``) grouped by the naming
    that writes them (prefix, and padding where a number starts with 0), the largest group
    first, each with its (step, name), the newest first: where a directory's steps are when
    none is named as a manager expects (``Storage.other_naming``)."""
    groups: dict[tuple[str, int | None], list[tuple[int, str]]] = {}
    for name in names:
        match = _STEP_LIKE.fullmatch(name)
        if match is None:
            continue
        prefix, number = match.group(1) or "", match.group(2)
        digits = len(number) if number.startswith("0") and len(number) > 1 else None
        if StepNames(prefix, digits).format(int(number)) != name:  # "_5": no naming writes it
            continue
        groups.setdefault((prefix, digits), []).append((int(number), name))
    ranked = sorted(groups.items(), key=lambda kv: -len(kv[1]))
    return [(StepNames(p, d), sorted(steps, reverse=True)) for (p, d), steps in ranked]


_ITEM_NAME = re.compile(r"[A-Za-z0-9_\-][A-Za-z0-9_.\-]{0,127}")
_RESERVED = {MANIFEST, METRICS}


def item_name_problem(name: str) -> str | None:
    """Why `name` cannot be an item name (a directory of a step), or None if it can.

    The same rule applies to names given to save() and to names read from a manifest: letters,
    digits, '_', '-' and '.', at most 128 characters, not starting with '.', and not one of the
    files cairn writes in a step.
    """
    if _ITEM_NAME.fullmatch(name) and name not in _RESERVED:
        return None
    return (
        f"bad item name {name!r:.200}: use at most 128 letters, digits, '_', '-' and '.', not "
        f"starting with '.', and not {sorted(_RESERVED)}"
    )


def trash_name(name: str) -> str:
    return f"{TRASH_PREFIX}{name}-{uuid.uuid4().hex}"


# ---------------------------------------------------------------------------- JSON with a checksum

_CRC_KEY = "crc32c"


def _canonical(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def dump_checked(body: Mapping[str, Any]) -> bytes:
    """JSON for `body` plus a crc32c of its canonical form, human-readable (indented)."""
    if _CRC_KEY in body:
        raise ValueError(f"{_CRC_KEY!r} is reserved")
    crc = crc32c.crc32c(_canonical(body))
    return json.dumps({**body, _CRC_KEY: crc}, sort_keys=True, indent=1).encode()


def load_checked(data: bytes, where: str) -> dict[str, Any]:
    """Parse what `dump_checked` wrote; CorruptCheckpointError (naming `where`) if damaged."""
    obj = parse_json(data, where)
    if not isinstance(obj, dict) or not isinstance(obj.get(_CRC_KEY), int):
        raise CorruptCheckpointError(f"{where} has no {_CRC_KEY} field")
    crc = obj.pop(_CRC_KEY)
    try:
        canonical = _canonical(obj)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where} cannot be checked: {e}") from None
    if crc32c.crc32c(canonical) != crc:
        raise CorruptCheckpointError(f"{where} fails its crc32c check")
    return obj


# ---------------------------------------------------------------------------- manifest


@dataclasses.dataclass(frozen=True)
class ItemEntry:
    """One item of a step: the handler that wrote it, its version, and the files it wrote."""

    handler: str
    version: int
    files: tuple[FileRecord, ...]
    dropped: bool = False

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclasses.dataclass(frozen=True)
class Manifest:
    """The content of ``_CHECKPOINT.json``."""

    step: int
    items: Mapping[str, ItemEntry]
    started_at: float
    committed_at: float
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    telemetry: Mapping[str, float] = dataclasses.field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    #: the writing manager's rule for its best step (metric, "min" | "max"): `best=`, or its
    #: one KeepBest; what ``cairn metrics --plot`` marks. None where it had none.
    best: tuple[str, str] | None = None

    def with_dropped(self, item: str) -> Manifest:
        """This manifest with `item` marked dropped by per-item retention (no files)."""
        entry = dataclasses.replace(self.items[item], dropped=True, files=())
        return dataclasses.replace(self, items={**self.items, item: entry})

    def to_bytes(self) -> bytes:
        return dump_checked(
            {
                "format": "cairn",
                "format_version": self.format_version,
                "step": self.step,
                "started_at": self.started_at,
                "committed_at": self.committed_at,
                "items": {
                    name: {
                        "handler": e.handler,
                        "version": e.version,
                        "dropped": e.dropped,
                        "files": [f.to_json() for f in e.files],
                    }
                    for name, e in self.items.items()
                },
                "metrics": dict(self.metrics),
                "metadata": dict(self.metadata),
                "telemetry": dict(self.telemetry),
                **(
                    {"best": {"metric": self.best[0], "mode": self.best[1]}}
                    if self.best is not None
                    else {}
                ),
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Manifest:
        """Parse and check a manifest: every field has its documented type and range, every item
        name and file path follows the rules a save follows; CorruptCheckpointError otherwise."""
        obj = load_checked(data, where)
        version = obj.get("format_version")
        if obj.get("format") != "cairn" or not _is_int(version):
            raise CorruptCheckpointError(f"{where} is not a cairn manifest")
        if version < 1:
            raise CorruptCheckpointError(f"{where} has format version {version}")
        if version > FORMAT_VERSION:
            raise UnsupportedFormatError(
                f"{where} has format version {version}; this cairn reads up to {FORMAT_VERSION}. "
                "Upgrade cairn-ckpt to read it."
            )
        try:
            step = obj["step"]
            if not _is_int(step) or not 0 <= step < 2**63:
                raise ValueError(f"step {step!r:.40} is not an int in [0, 2**63)")
            raw_items = _expect(obj["items"], dict, "items")
            items = {name: _item(name, e, version) for name, e in raw_items.items()}
            return cls(
                step=step,
                items=items,
                started_at=unix_time(obj["started_at"], "started_at"),
                committed_at=unix_time(obj["committed_at"], "committed_at"),
                metrics=check_metrics(obj.get("metrics", {}), argument="metrics"),
                metadata=_expect(obj.get("metadata", {}), dict, "metadata"),
                telemetry={
                    str(k): _finite(v, f"telemetry[{k!r}]")
                    for k, v in _expect(obj.get("telemetry", {}), dict, "telemetry").items()
                },
                format_version=version,
                best=_best(obj.get("best")),
            )
        except KeyError as e:
            raise CorruptCheckpointError(f"{where} is malformed: field {e} is missing") from None
        except (TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"{where} is malformed: {e!s:.300}") from None


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _expect(value: Any, kind: type, what: str) -> Any:
    if not isinstance(value, kind):
        raise TypeError(f"{what} must be a {kind.__name__}, got {type(value).__name__}")
    return value


def _finite(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number, got {value!r:.40}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"{what} must be finite, got {value!r:.40}")
    return number


_LAST_TIME = 253402300800.0  # 10000-01-01: every clock and time.localtime can show what is before


def unix_time(value: Any, what: str) -> float:
    """A time read from a checkpoint or a lease: a JSON number of seconds from 1970 to 9999
    (TypeError or ValueError naming `what` otherwise: NaN, Infinity, 1e300, a bool, a string)."""
    seconds = _finite(value, what)
    if not 0 <= seconds < _LAST_TIME:
        raise ValueError(f"{what} {value!r:.40} is not a Unix time in years 1970-9999")
    return seconds


def _best(value: Any) -> tuple[str, str] | None:
    """A manifest's optional ``best``: {"metric": a metric name, "mode": "min" | "max"}."""
    if value is None:
        return None
    best = _expect(value, dict, "best")
    metric, mode = best.get("metric"), best.get("mode")
    if not (isinstance(metric, str) and 0 < len(metric) <= 200) or mode not in ("min", "max"):
        raise ValueError(f"best {value!r:.80} is not {{'metric': <name>, 'mode': 'min'|'max'}}")
    return metric, mode


def _item(name: Any, entry: Any, version: int) -> ItemEntry:
    """One item entry of a manifest, checked as a save would have written it."""
    problem = item_name_problem(name) if isinstance(name, str) else f"item name {name!r}"
    if problem:
        raise ValueError(problem)
    entry = _expect(entry, dict, f"item {name!r}")
    handler, handler_version, dropped = (
        entry["handler"],
        entry["version"],
        entry.get("dropped", False),
    )
    if not isinstance(handler, str) or not handler or len(handler) > 200:
        raise ValueError(f"item {name!r}: handler {handler!r:.80} is not a handler id")
    if not _is_int(handler_version) or handler_version < 0:
        raise ValueError(f"item {name!r}: version {handler_version!r:.40} is not an int >= 0")
    if not isinstance(dropped, bool):
        raise TypeError(f"item {name!r}: dropped must be a bool, got {dropped!r:.40}")
    files = tuple(
        FileRecord.from_json(f) for f in _expect(entry["files"], list, f"item {name!r} files")
    )
    paths = [f.path for f in files]
    if len(set(paths)) != len(paths):
        raise ValueError(f"item {name!r} lists a file twice")
    if dropped and files:
        raise ValueError(f"item {name!r} is dropped but lists files")
    if version >= 2 and any(f.xxh3_128 is None for f in files):
        raise ValueError(f"item {name!r}: a format-{version} file record must carry xxh3_128")
    return ItemEntry(handler=handler, version=handler_version, dropped=dropped, files=files)


def check_metrics(metrics: Any, *, argument: str = "metrics") -> dict[str, float]:
    """Metrics as {str: float}; TypeError naming the key for anything that is not a real number."""
    if not isinstance(metrics, Mapping):
        raise TypeError(
            f"{argument} must be a mapping of str to number, got {type(metrics).__qualname__}"
        )
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"{argument}: keys must be non-empty str, got {key!r}")
        if isinstance(value, bool):
            raise TypeError(f"{argument}[{key!r}] must be a number, got a bool")
        try:
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            raise TypeError(
                f"{argument}[{key!r}] must be a real number, got {type(value).__qualname__}"
            ) from None
        out[key] = number
    return out


def check_metadata(metadata: Any) -> dict[str, Any]:
    """A JSON round-trip copy of user metadata; TypeError (nothing written) if it is not JSON."""
    if not isinstance(metadata, Mapping) or not all(isinstance(k, str) for k in metadata):
        raise TypeError(
            f"metadata must be a mapping with str keys, got {type(metadata).__qualname__}"
        )
    if PART in metadata:
        raise ValueError(f"metadata key {PART!r} is cairn's own (a local tier's part record)")
    try:
        return dict(json.loads(json.dumps(metadata, allow_nan=False)))
    except (TypeError, ValueError) as e:
        raise TypeError(f"metadata is not JSON-serialisable: {e}") from None
