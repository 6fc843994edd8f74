"""The on-disk format: step names, leftover names, the manifest and metrics.json (docs/format.md).

A committed step is a directory ``<prefix>_<step>`` (or just ``<step>`` with an empty prefix)
holding ``_CHECKPOINT.json``, the manifest, written last. Both JSON files carry a crc32c of their
own canonical body, so a flipped byte that still parses is caught.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Mapping
from typing import Any

import crc32c

from cairn.handlers import FileRecord
from cairn.handlers.errors import CorruptCheckpointError, UnsupportedFormatError

FORMAT_VERSION = 1
MANIFEST = "_CHECKPOINT.json"
METRICS = "metrics.json"
LOCK = ".cairn.lock"
TRASH_PREFIX = ".trash-"
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
    try:
        obj = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{where} does not parse: {e}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get(_CRC_KEY), int):
        raise CorruptCheckpointError(f"{where} has no {_CRC_KEY} field")
    crc = obj.pop(_CRC_KEY)
    if crc32c.crc32c(_canonical(obj)) != crc:
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
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Manifest:
        obj = load_checked(data, where)
        version = obj.get("format_version")
        if obj.get("format") != "cairn" or not isinstance(version, int):
            raise CorruptCheckpointError(f"{where} is not a cairn manifest")
        if version > FORMAT_VERSION:
            raise UnsupportedFormatError(
                f"{where} has format version {version}; this cairn reads up to {FORMAT_VERSION}. "
                "Upgrade cairn-ckpt to read it."
            )
        try:
            items = {
                name: ItemEntry(
                    handler=str(e["handler"]),
                    version=int(e["version"]),
                    dropped=bool(e.get("dropped", False)),
                    files=tuple(FileRecord.from_json(f) for f in e["files"]),
                )
                for name, e in obj["items"].items()
            }
            return cls(
                step=int(obj["step"]),
                items=items,
                started_at=float(obj["started_at"]),
                committed_at=float(obj["committed_at"]),
                metrics={str(k): float(v) for k, v in obj.get("metrics", {}).items()},
                metadata=dict(obj.get("metadata", {})),
                telemetry={str(k): float(v) for k, v in obj.get("telemetry", {}).items()},
                format_version=version,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CorruptCheckpointError(f"{where} is malformed: {e!r}") from None


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
        except (TypeError, ValueError):
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
    try:
        return dict(json.loads(json.dumps(metadata, allow_nan=False)))
    except (TypeError, ValueError) as e:
        raise TypeError(f"metadata is not JSON-serialisable: {e}") from None
