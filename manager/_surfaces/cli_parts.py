"""What ``cairn ls`` shows of a local tier's parts (docs/multitier.md): the ``process_<q>/``
directories of a local tier's directory, and the columns of a part: `process` (its owner),
`held` (the holder's own part, or a replica; in a local tier's directory only), `save` (the
save's id, short) and `persistent` (whether that save went to the persistent tier too).
What a cell holds comes from the directory: the command line prints it as text (cli.py)."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Any

_OWNER_DIRECTORY = re.compile(r"process_(0|[1-9][0-9]*)")


def owner_directories(directory: str) -> dict[int, Path]:
    """The ``process_<q>/`` directories in `directory`, by owner q (none in an object store,
    or in a directory that cannot be read)."""
    if "://" in directory:
        return {}
    found = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            match = _OWNER_DIRECTORY.fullmatch(entry.name)
            if match and entry.is_dir():
                found[int(match.group(1))] = Path(entry.path)
    return found


def part_columns(*, local: bool) -> list[str]:
    """The part columns' headers (`held` only in a local tier's directory)."""
    return ["process", *(["held"] if local else []), "save", "persistent"]


def short_save(save: object) -> str:
    """A save id as `ls` shows it: 8 hex digits (a multi-process save's id names its temporary
    directory, ``checkpoint_10.tmp-<digits>``: the digits); ``-`` for none."""
    return save.rsplit("-", 1)[-1][:8] if isinstance(save, str) and save else "-"


def part_cells(row: dict[str, Any], *, local: bool) -> list[str]:
    """The part columns of an `ls` row (`part`: the step's record; `owner` and `held`: its
    directory's, in a local tier's directory); ``-`` for what is not known."""
    part = row.get("part", {})
    cells = [str(row["owner"] if local else part.get("process", "-"))]
    if local:
        cells.append(row["held"] or "-")
    persistent = part.get("persistent")
    yes_no = "yes" if persistent is True else "no" if persistent is False else "-"
    return [*cells, short_save(part.get("save")), yes_no]
