"""The local tier's shared decisions, as pure functions of what every process reported: which
steps every process can get its part of (`complete`), and the restore plan (`plan`): the
newest such step, and for each process where its part comes from.

A report is one process's listing of the parts it holds, ``{owner: {step: part}}``: its own
(owner = itself) and the replicas it holds of others' parts. A part is its record (`PART` in
the step's metadata): ``{"process", "processes", "save", "persistent"}``; the parts of one save
share its ``save`` id. Every key is a string (the reports travel as JSON).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

Report = Mapping[str, Mapping[str, Mapping[str, Any]]]
#: (owner, step, source) that failed to read: "local" (its own part), "peer" (every replica of
#: it), "persistent" (the persistent step, for everyone)
Bad = set[tuple[int, int, str]]


def _index(reports: Sequence[Report]) -> dict[tuple[int, int], dict[str, list[tuple[int, bool]]]]:
    """(step, owner) -> save id -> [(holder, whether that save also went persistent)]."""
    index: dict[tuple[int, int], dict[str, list[tuple[int, bool]]]] = {}
    for holder, report in enumerate(reports):
        for owner, parts in report.items():
            for step, part in parts.items():
                key = (int(step), int(owner))
                entry = (holder, bool(part.get("persistent")))
                index.setdefault(key, {}).setdefault(str(part["save"]), []).append(entry)
    return index


def _sources(
    index: Mapping[tuple[int, int], Mapping[str, list[tuple[int, bool]]]],
    step: int,
    save: str,
    count: int,
    bad: Bad,
) -> list[Any] | None:
    """For each process, where it gets its part of `step` from save `save`: "local" (its own
    directory) or ["peer", holder] (the holder with the fewest parts to send so far); None if
    some process has no source."""
    load: Counter[int] = Counter()
    sources: list[Any] = []
    for owner in range(count):
        holders = [h for h, _ in index.get((step, owner), {}).get(save, [])]
        others = [h for h in holders if h != owner]
        if owner in holders and (owner, step, "local") not in bad:
            sources.append("local")
        elif others and (owner, step, "peer") not in bad:
            holder = min(others, key=lambda h: (load[h], h))
            load[holder] += 1
            sources.append(["peer", holder])
        else:
            return None
    return sources


def complete(reports: Sequence[Report], count: int) -> list[int]:
    """The steps for which every process can get its part from some process's local tier."""
    index = _index(reports)
    steps = {s for s, _ in index}
    return sorted(
        s
        for s in steps
        if any(
            _sources(index, s, save, count, set()) is not None
            for save in {sv for o in range(count) for sv in index.get((s, o), {})}
        )
    )


def plan(
    reports: Sequence[Report],
    persistent: Iterable[int],
    step: int | None,
    bad: Bad,
    count: int,
) -> dict[str, Any]:
    """The restore plan: the newest step (or `step`) every process has a source for. First the
    local tier (own parts, else a peer's replica, all from one save); else, if the persistent
    tier holds the step, the persistent step, except for a process that holds its own part
    from the very save that wrote the persistent step. ``{"step": None}`` if there is none."""
    index = _index(reports)
    persistent = set(persistent)
    held = {s for s, _ in index}
    candidates = [step] if step is not None else sorted(held | persistent, reverse=True)
    for s in candidates:
        saves = sorted({sv for o in range(count) for sv in index.get((s, o), {})})
        for save in saves:
            sources = _sources(index, s, save, count, bad)
            if sources is not None:
                return {"step": s, "save": save, "sources": sources}
        if s in persistent and not any((p, s, "persistent") in bad for p in range(count)):
            sources = []
            for owner in range(count):
                own = [
                    h
                    for entries in index.get((s, owner), {}).values()
                    for h, went in entries
                    if h == owner and went
                ]
                usable = own and (owner, s, "local") not in bad
                sources.append("local" if usable else "persistent")
            return {"step": s, "save": None, "sources": sources}
    return {"step": None}
