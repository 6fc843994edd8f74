"""Steps and root metadata that orbax-checkpoint wrote into the drop-in's directory, read by
orbax-checkpoint itself: cairn lists such steps (`cairn.manager._layouts`), this module hands
them to orbax with the user's args, around the checks cairn's own reader of them makes (no link
or FIFO handed to orbax, orbax's reads finished, errors naming the step)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from cairn.handlers.errors import (
    CairnError,
    CorruptCheckpointError,
    MismatchError,
    UnsupportedFormatError,
)
from cairn.handlers.io import check_orbax_tree, orbax_reads_finish, parse_json, read_no_follow
from cairn.manager._surfaces.orbax import args as A

ocp = A.ocp
log = logging.getLogger("cairn")


def step_metadata(step: int, path: Any) -> Any:
    """The StepMetadata of a step orbax-checkpoint wrote, read by orbax-checkpoint."""
    with _reading(step, path, []), ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as c:
        return c.metadata(os.fspath(path))


def restore(step: int, path: Any, wanted: Mapping[str, Any]) -> dict[str, Any]:
    """A step orbax-checkpoint wrote, restored by orbax-checkpoint."""
    with (
        _reading(step, path, list(wanted)),
        ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer,
    ):
        restored = checkpointer.restore(os.fspath(path), A.composite(wanted))
    return dict(restored.items())


# How TensorStore (under orbax) words a read of files that are missing or damaged.
_TENSORSTORE_DAMAGE = ("NOT_FOUND", "DATA_LOSS", "OUT_OF_RANGE", "Error reading", "Error opening")


@contextlib.contextmanager
def _reading(step: int, path: Any, items: list[str]) -> Iterator[None]:
    """Around orbax's reads of a step it wrote: the items' trees hold only directories and
    regular files (orbax follows links and blocks on FIFOs), orbax's reads end before its
    event loop closes, and its errors name the step: damage (a missing, undecodable or
    unreadable file) is CorruptCheckpointError, other ValueErrors MismatchError; a missing
    item stays orbax's KeyError."""
    where = f"step {step} (written by orbax-checkpoint, {path})"
    if not isinstance(path, Path):  # not damage: restore(None) must not pass over it
        raise UnsupportedFormatError(
            f"{where}: cairn.manager.orbax hands steps Orbax wrote to orbax from local disk "
            "only; restore this one with cairn.manager.CheckpointManager (step_prefix as "
            "Orbax named it), which downloads its items"
        )
    for name in items:
        if (path / name).exists() or (path / name).is_symlink():
            check_orbax_tree(path / name, f"{where}, item {name!r}")
    try:
        with orbax_reads_finish():
            yield
    except (KeyError, CairnError):
        raise
    except (OSError, UnicodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"{where}: orbax could not read it: {e!r:.500}") from e
    except ValueError as e:
        if any(mark in str(e) for mark in _TENSORSTORE_DAMAGE):  # its data is not all there
            raise CorruptCheckpointError(f"{where}: orbax could not read it: {e!s:.500}") from e
        raise MismatchError(f"{where}: orbax could not restore it: {e!s:.500}") from e


_ROOT_METADATA = ("metadata/_ROOT_METADATA", "metadata/metadata")  # new, legacy


def root_metadata(where: str) -> dict[str, Any] | None:
    """The root metadata an Orbax run wrote into a local directory (its ``custom_metadata``),
    or None; an unreadable file is logged and ignored."""
    for relpath in _ROOT_METADATA:
        path = os.path.join(where, relpath)
        if "://" in where or not os.path.isfile(path):
            continue
        try:
            data = parse_json(read_no_follow(Path(path)), path)
        except (OSError, CairnError) as e:
            log.warning("cairn: ignoring Orbax's root metadata %s: %s", path, e)
            return None
        if relpath.endswith("_ROOT_METADATA") and isinstance(data, dict):
            data = data.get("custom_metadata")
        if isinstance(data, dict):
            return data
        log.warning("cairn: ignoring Orbax's root metadata %s: not a JSON object", path)
        return None
    return None
