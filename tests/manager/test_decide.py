"""The local tier's restore decision (`decide.plan`, `decide.complete`) as properties over random
reports: every process gets a source that really holds its part, from one save; no newer step
had one; a struck-out source is never chosen; senders share the load."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from cairn.manager._core import decide

COUNT = 3
STEPS = [2, 4, 6, 8]


@st.composite
def situations(draw: st.DrawFn) -> tuple[list[dict[str, Any]], list[int], decide.Bad]:
    """Each process's report: for some (owner, step), a part from save "a" or "b" (two
    timelines of a step), with or without the persistent flag; persistent steps; struck sources."""
    reports: list[dict[str, Any]] = [{} for _ in range(COUNT)]
    for holder in range(COUNT):
        for owner in range(COUNT):
            for step in STEPS:
                if draw(st.booleans()):
                    save = draw(st.sampled_from(["a", "b"]))
                    part = {"process": owner, "processes": COUNT, "save": f"{step}{save}"}
                    part["persistent"] = draw(st.booleans())
                    reports[holder].setdefault(str(owner), {})[str(step)] = part
    persistent = draw(st.lists(st.sampled_from(STEPS), unique=True))
    bad = draw(
        st.sets(
            st.tuples(
                st.integers(0, COUNT - 1),
                st.sampled_from(STEPS),
                st.sampled_from(["local", "peer", "persistent"]),
            )
        )
    )
    return reports, persistent, bad


def holds(reports: list[dict[str, Any]], holder: int, owner: int, step: int) -> Any:
    return reports[holder].get(str(owner), {}).get(str(step))


@settings(max_examples=120, deadline=None)
@given(situations())
def test_every_process_gets_a_real_source_of_one_save(situation: Any) -> None:
    reports, persistent, bad = situation
    plan = decide.plan(reports, persistent, None, bad, COUNT)
    if plan["step"] is None:
        return
    step, sources = plan["step"], plan["sources"]
    assert len(sources) == COUNT
    for owner, source in enumerate(sources):
        if source == "persistent":
            assert step in persistent
            assert not any((p, step, "persistent") in bad for p in range(COUNT))
            continue
        holder = owner if source == "local" else source[1]
        part = holds(reports, holder, owner, step)
        assert part is not None, (owner, source)
        assert (owner, step, "local" if source == "local" else "peer") not in bad
        if plan["save"] is not None:  # all from the local tier: one save
            assert part["save"] == plan["save"]
        else:  # the persistent step: a process's own part only if that save went persistent
            assert source == "local" and part["persistent"]
    loads = [s[1] for s in sources if isinstance(s, list)]
    assert max((loads.count(h) for h in loads), default=0) <= COUNT


@settings(max_examples=120, deadline=None)
@given(situations())
def test_no_newer_step_had_a_source_for_everyone(situation: Any) -> None:
    reports, persistent, bad = situation
    plan = decide.plan(reports, persistent, None, bad, COUNT)
    chosen = plan["step"] if plan["step"] is not None else -1
    for step in STEPS:
        if step <= chosen:
            continue
        assert decide.plan(reports, persistent, step, bad, COUNT)["step"] is None, step


@settings(max_examples=100, deadline=None)
@given(situations())
def test_complete_steps_are_those_a_plan_without_the_persistent_tier_finds(situation: Any) -> None:
    reports, _, _ = situation
    complete = decide.complete(reports, COUNT)
    for step in STEPS:
        found = decide.plan(reports, [], step, set(), COUNT)["step"] is not None
        assert found == (step in complete), step


def test_a_part_of_another_save_never_completes_a_step() -> None:
    """Process 1's part of step 4 comes from another save (a timeline the run left)."""
    part = {"processes": 2, "persistent": False}
    reports = [
        {"0": {"4": {**part, "process": 0, "save": "x"}}},
        {"1": {"4": {**part, "process": 1, "save": "y"}}},
    ]
    assert decide.complete(reports, 2) == []
    assert decide.plan(reports, [], None, set(), 2) == {"step": None}
    assert decide.plan(reports, [4], None, set(), 2)["sources"] == ["persistent", "persistent"]
