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


def mark_held(rows: list[dict[str, Any]], owners: int, process: int | None) -> bool:
    """Set each row's `held` (of a local tier's directory with `owners` ``process_<q>/``):
    ``"own"`` or ``"replica"`` as `process` says (the process whose directory this is), else
    as the part's record says (`holder`, the process that committed that copy), else as the
    directory's other parts say (their one holder, or one ``process_<q>/`` alone: no
    replicas); None where none of that is known (parts saved before cairn recorded holders, or
    a damaged part among several holders). Whether some row's is None."""
    holder = process
    recorded = {_holder(row) for row in rows} - {None}
    if holder is None and len(recorded) == 1:
        holder = recorded.pop()
    elif holder is None and owners == 1:  # no replicas: the holder's own parts
        holder = rows[0]["owner"] if rows else None
    for row in rows:
        recorded_by = _holder(row)
        by = holder if process is not None or recorded_by is None else recorded_by
        row["held"] = None if by is None else ("own" if row["owner"] == by else "replica")
    return any(row["held"] is None for row in rows)


def _holder(row: dict[str, Any]) -> int | None:
    """The process that committed this copy of a part, as its record says (None if it does not,
    or says something that is not a process index)."""
    holder = row.get("part", {}).get("holder")
    return holder if type(holder) is int and holder >= 0 else None


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
