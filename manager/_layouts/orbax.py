"""Steps that orbax-checkpoint wrote, found in a cairn directory: read-only manifests for them."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import stat
from pathlib import Path
from typing import Any

from cairn.handlers.errors import CorruptCheckpointError
from cairn.handlers.io import ORBAX_COMMIT_SUCCESS as COMMIT_SUCCESS
from cairn.handlers.io import ORBAX_STEP_METADATA as STEP_METADATA
from cairn.handlers.io import orbax_items, parse_json
from cairn.handlers.io import read_orbax_metadata as read_metadata
from cairn.manager._format import (
    ItemEntry,
    Manifest,
    check_metadata,
    check_metrics,
    item_name_problem,
)

log = logging.getLogger("cairn")


def orbax_step(step: int, path: Path) -> Manifest | None:
    """A read-only manifest for a step directory orbax-checkpoint wrote, or None if it is not one.

    Orbax marks a finished step with ``commit_success.txt`` and describes it in
    ``_CHECKPOINT_METADATA`` (item handlers, metrics, times); older versions only renamed it
    into place, so a directory whose items Orbax would read counts too.

    The directory is a stranger's: no link in it is followed, an item directory whose name a
    save would refuse is left out, and metadata that cannot be read or has the wrong types is
    ignored, field by field, with a warning, so one odd Orbax step never hides the others.
    """
    where = f"Orbax step {step} at {path}"
    try:
        found = orbax_items(path)
        mtime = os.lstat(path).st_mtime
    except FileNotFoundError:
        raise  # deleted while listed
    except OSError as e:
        log.warning("cairn: ignoring %s: it cannot be listed: %s", where, e)
        return None
    items = {}
    for name, kind in found.items():
        problem = item_name_problem(name)
        if problem is None:
            items[name] = ItemEntry(kind, 1, ())
        else:
            log.warning("cairn: %s: ignoring an item directory: %s", where, problem)

    def read_object(relpath: str) -> dict[str, Any]:
        """The JSON object in `relpath`; {} if missing, unreadable or not an object."""
        try:
            obj = parse_json(read_metadata(path, relpath), str(path / relpath))
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
    marked = bool(meta)
    with contextlib.suppress(OSError):  # commit_success.txt: a regular file, not a link to one
        marked = marked or stat.S_ISREG(os.lstat(path / COMMIT_SUCCESS).st_mode)
    if not items or not (marked or any(e.handler == "orbax.pytree" for e in items.values())):
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
        """A timestamp in nanoseconds as seconds; the directory's mtime if absent or odd."""
        value = meta.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63:
            return value / 1e9
        if value is not None:
            log.warning("cairn: %s: ignoring %s %.40r (not an int of ns)", where, key, value)
        return mtime

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
