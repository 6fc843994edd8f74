"""Steps that orbax-checkpoint wrote, found in a cairn directory: read-only manifests for them.

Read through a `StepView` (`_layouts.base`), so one implementation serves every storage: a
local directory and an object store's keys alike.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from cairn.handlers import OrbaxDatasetHandler, OrbaxJsonHandler, OrbaxPyTreeHandler
from cairn.handlers.errors import CorruptCheckpointError
from cairn.handlers.io import ORBAX_COMMIT_SUCCESS as COMMIT_SUCCESS
from cairn.handlers.io import ORBAX_STEP_METADATA as STEP_METADATA
from cairn.handlers.io import orbax_listing_kind, parse_json
from cairn.manager._format import (
    ItemEntry,
    Manifest,
    check_metadata,
    check_metrics,
    item_name_problem,
)
from cairn.manager._layouts.base import StepView

log = logging.getLogger("cairn")


def orbax_step(step: int, view: StepView) -> Manifest | None:
    """A read-only manifest for a step directory orbax-checkpoint wrote, or None if it is not one.

    Orbax marks a finished step with ``commit_success.txt`` and describes it in
    ``_CHECKPOINT_METADATA`` (item handlers, metrics, times). On a filesystem, where Orbax (and
    its older versions, which only renamed a step into place) commits with a rename, a directory
    whose items Orbax would read counts too; on an object store, where Orbax writes under the
    step's final name, only ``commit_success.txt`` or the commit time Orbax's finalize writes
    into ``_CHECKPOINT_METADATA`` does, so a save in progress there is no step.

    The directory is a stranger's: no link in it is followed, an item directory whose name a
    save would refuse is left out, and metadata that cannot be read, is too long or has the
    wrong types is ignored, field by field, with a warning, so one odd Orbax step never hides
    the others.
    """
    where = f"Orbax step {step} at {view.where}"
    try:
        top = view.entries()
        mtime = view.mtime()
    except FileNotFoundError:
        raise  # deleted while listed
    except OSError as e:
        log.warning("cairn: ignoring %s: it cannot be listed: %s", where, e)
        return None
    items = {}
    for name in sorted(n for n, is_dir in top.items() if is_dir):
        try:
            kind = orbax_listing_kind(view.entries(name))
        except (OSError, CorruptCheckpointError):  # gone, unreadable: not an item cairn reads
            continue
        if kind is None:
            continue
        problem = item_name_problem(name)
        if problem is None:
            items[name] = ItemEntry(kind, 1, ())
        else:
            log.warning("cairn: %s: ignoring an item directory: %s", where, problem)

    def read_object(relpath: str) -> dict[str, Any]:
        """The JSON object in `relpath`; {} if missing, unreadable or not an object."""
        try:
            obj = parse_json(view.read(relpath), f"{view.where}/{relpath}")
        except FileNotFoundError:
            return {}
        except (OSError, CorruptCheckpointError) as e:
            log.warning("cairn: %s: ignoring its %s: %s", where, relpath, e)
            return {}
        if not isinstance(obj, dict):
            log.warning("cairn: %s: ignoring its %s: not a JSON object", where, relpath)
            return {}
        return obj

    meta = read_object(STEP_METADATA)
    # commit_success.txt: a regular file, not a link to one
    if view.renames:
        marked = bool(meta) or view.is_file(COMMIT_SUCCESS)
        done = marked or any(e.handler == "orbax.pytree" for e in items.values())
    else:  # written in place: only the commit says it is whole
        done = "commit_timestamp_nsecs" in meta or view.is_file(COMMIT_SUCCESS)
    if not items or not done:
        return None
    raw = meta.get("metrics")
    if not isinstance(raw, dict):
        if raw is not None:
            log.warning("cairn: %s: ignoring its %s metrics: not an object", where, STEP_METADATA)
        raw = {}
    if not raw:
        raw = read_object("metrics/metrics")
    metrics: dict[str, float] = {}
    for key, value in raw.items():
        try:
            number = check_metrics({key: value})[key]
        except TypeError:
            number = math.nan
        if math.isfinite(number):
            metrics[key] = number
    if len(metrics) < len(raw):
        ignored = sorted(set(raw) - set(metrics))
        log.warning("cairn: %s: ignoring metrics that are not finite numbers: %s", where, ignored)

    def seconds(key: str) -> float:
        """A timestamp in nanoseconds as seconds; the directory's mtime if absent or odd (0
        where the store keeps no times)."""
        value = meta.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63:
            return value / 1e9
        if value is not None:
            log.warning("cairn: %s: ignoring %s %.40r (not an int of ns)", where, key, value)
        return 0.0 if mtime is None else mtime

    try:
        custom = check_metadata(meta.get("custom_metadata") or {})
    except (TypeError, RecursionError) as e:
        log.warning("cairn: %s: ignoring its custom_metadata: %s", where, e)
        custom = {}
    return Manifest(
        step=step,
        items=items,
        started_at=seconds("init_timestamp_nsecs"),
        committed_at=seconds("commit_timestamp_nsecs"),
        metrics=metrics,
        metadata={"format": "orbax", "custom_metadata": custom},
    )


ORBAX_ITEMS = (OrbaxPyTreeHandler.id, OrbaxJsonHandler.id, OrbaxDatasetHandler.id)


def is_orbax_step(metadata: Any, items: Any) -> bool:
    """Whether a step's manifest (its ``metadata`` and its items, each with a ``handler``) is
    one `orbax_step` made for a step orbax-checkpoint wrote: the metadata says so and every
    item is an Orbax item, so that a user's ``metadata={"format": "orbax"}`` on a cairn step
    does not make it one."""
    return metadata.get("format") == "orbax" and all(
        getattr(i, "handler", None) in ORBAX_ITEMS for i in items.values()
    )


class OrbaxLayout:
    """orbax-checkpoint's steps (`orbax_step`), as a `Layout`."""

    name = "orbax-checkpoint"

    def read(self, step: int, view: StepView) -> Manifest | None:
        return orbax_step(step, view)
