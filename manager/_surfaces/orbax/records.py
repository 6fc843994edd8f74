"""A step's record: what the drop-in keeps per step in its cairn manifest's user metadata,
under ``"orbax"`` (each item's kind, the default-item mode, Orbax's metrics and custom metadata,
the time its retention used, its arrays' shardings), and how a step is read back as `Stored`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from cairn.handlers import OrbaxJsonHandler, OrbaxPyTreeHandler
from cairn.manager._layouts.orbax import is_orbax_step
from cairn.manager._surfaces.orbax import args as A
from cairn.manager._surfaces.orbax.modes import DEFAULT_ITEM_NAME

RECORD = "orbax"  # the key of a step's cairn metadata that holds what Orbax keeps per step
KINDS = ("standard", "pytree", "json", "array", "grain")


@dataclasses.dataclass(frozen=True)
class Stored:
    """What a step holds, for restore and metadata: each item's kind (None: not known), whether
    it is a default-item step, its Orbax metrics and custom metadata, and whether Orbax wrote
    it (then Orbax reads it)."""

    items: Mapping[str, str | None]
    default_item: bool
    metrics: Any
    custom_metadata: Mapping[str, Any]
    started_at: float
    committed_at: float
    path: Any
    foreign: bool
    shardings: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)


def read(info: Any) -> Stored:
    """What a step holds, from its cairn manifest (`CheckpointManager.info`): the record this
    surface saved with it (read as untrusted: odd types fall back to the manifest's values), or
    for a step cairn's own API or orbax-checkpoint wrote, what the manifest says."""
    record = info.metadata.get(RECORD)
    by_orbax = is_orbax_step(info.metadata, info.items)  # a user's metadata cannot say so
    if isinstance(record, Mapping) and not by_orbax:  # this surface's; untrusted all the same
        kinds = record.get("items")
        kinds = kinds if isinstance(kinds, Mapping) else {}
        when = record.get("time")
        if not (isinstance(when, (int, float)) and 0 <= when < 1e11):  # until the year 5138
            when = info.started_at
        custom = A.decode_floats(record.get("custom_metadata"))
        return Stored(
            items={n: k if k in KINDS else None for n in info.items for k in [kinds.get(n)]},
            default_item=record.get("default_item") is True and DEFAULT_ITEM_NAME in info.items,
            metrics=A.decode_floats(record.get("metrics")),
            custom_metadata=dict(custom) if isinstance(custom, Mapping) else {},
            started_at=float(when),
            committed_at=info.committed_at,
            path=info.path,
            foreign=False,
            shardings=_mapping(record.get("shardings")),
        )
    names = list(info.items)
    return Stored(
        items={n: _cairn_kind(info.items[n].handler) for n in names},
        default_item=names == [DEFAULT_ITEM_NAME],
        metrics=dict(info.metrics) or None,
        custom_metadata=dict(info.metadata.get("custom_metadata") or {}) if by_orbax else {},
        started_at=info.started_at,
        committed_at=info.committed_at,
        path=info.path,
        foreign=by_orbax,
    )


def _cairn_kind(handler_id: str) -> str | None:
    return {
        "cairn.train_state": "pytree",
        "cairn.numpy_tree": "pytree",
        "cairn.json": "json",
        "cairn.grain_iterator": "grain",
        OrbaxPyTreeHandler.id: "pytree",
        OrbaxJsonHandler.id: "json",
    }.get(handler_id)


def _mapping(value: Any) -> dict[str, Any]:
    """Mappings read from a step's metadata, by name; {} for anything else (never trusted)."""
    if not isinstance(value, Mapping):
        return {}
    return {str(k): v for k, v in value.items() if isinstance(v, Mapping)}
