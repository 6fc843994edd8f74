"""Who holds whose part of a local step (`replicas.Ring`), as properties over random failure
domains: each round of a transfer is a permutation without fixed points; a part's holders are
distinct; with D domains of equal size its first D - 1 holders are each in another domain; the
ring depends on who shares a domain, not on the domains' names; and `LocalTier`'s
`failure_domain=` is checked when it is built."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn.manager import EveryNSteps, LocalTier
from cairn.manager._core.replicas import Ring


@st.composite
def domains(draw: st.DrawFn) -> list[tuple[str, str]]:
    """(rack, host) of 1..12 processes, in any order of process index."""
    count = draw(st.integers(1, 12))
    racks = draw(st.lists(st.sampled_from("abc"), min_size=count, max_size=count))
    hosts = draw(st.lists(st.integers(0, 3), min_size=count, max_size=count))
    return [(r, f"{r}{h}") for r, h in zip(racks, hosts, strict=True)]


@settings(max_examples=300, deadline=None)
@given(domains())
def test_rounds_are_permutations_and_holders_are_distinct(found: list[tuple[str, str]]) -> None:
    ring, count = Ring.of(found), len(found)
    assert sorted(ring.order) == list(range(count))
    for k in range(1, count):
        sent = [ring.holder(p, k) for p in range(count)]
        assert sorted(sent) == list(range(count))  # each process receives one part
        assert all(h != p for p, h in enumerate(sent))
        assert all(ring.owner(ring.holder(p, k), k) == p for p in range(count))
    for p in range(count):
        assert len({ring.holder(p, k) for k in range(1, count)}) == count - 1


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.randoms(use_true_random=False))
def test_equal_domains_put_the_first_holders_elsewhere(
    racks: int, size: int, rng: random.Random
) -> None:
    """Processes numbered in any order over `racks` racks of `size` each (two hosts a rack when
    it can): the first racks - 1 holders of every part are in racks other than its owner's and
    each other's."""
    slots = [(f"rack{r}", f"host{r}.{i % 2}") for r in range(racks) for i in range(size)]
    rng.shuffle(slots)
    ring = Ring.of(slots)
    for p in range(len(slots)):
        held = [ring.holder(p, k) for k in range(1, racks)]
        assert len({slots[h][0] for h in held} | {slots[p][0]}) == racks
    assert ring.sharing(slots, racks - 1) == 0


def test_the_ring_of_two_hosts_alternates_them() -> None:
    ring = Ring.of([("a",), ("a",), ("b",), ("b",)])
    assert ring.order == (0, 2, 1, 3)
    assert [ring.holder(p, 1) for p in range(4)] == [2, 3, 1, 0]
    assert ring.sharing([("a",), ("a",), ("b",), ("b",)], 1) == 0
    assert ring.sharing([("a",), ("a",), ("b",), ("b",)], 2) == 4  # the second holder: its host


def test_one_domain_is_the_process_order() -> None:
    ring = Ring.of([("host x",)] * 4)
    assert ring.order == (0, 1, 2, 3)
    assert ring.sharing([("host x",)] * 4, 1) == 0  # nothing tells them apart: nothing to warn


@settings(max_examples=200, deadline=None)
@given(domains(), st.permutations(["p", "q", "r", "s"]))
def test_names_do_not_change_the_ring(found: list[tuple[str, str]], names: list[str]) -> None:
    """A replaced host comes back under another name: renaming domains (keeping who shares
    which) leaves the ring as it was."""
    rename = dict(zip("abc", names, strict=False))
    renamed = [(rename[r], f"{rename[r]}-{h}") for r, h in found]
    assert Ring.of(renamed) == Ring.of(found)


@pytest.mark.parametrize("bad", ["", "   ", 3, b"rack", ["rack"]])
def test_a_bad_failure_domain_is_refused(bad: object) -> None:
    with pytest.raises(TypeError, match="failure_domain= must be a non-empty string"):
        LocalTier("/tmp/never", save=EveryNSteps(2), replicas=1, failure_domain=bad)  # type: ignore[arg-type]


def test_a_failure_domain_is_kept() -> None:
    tier = LocalTier("/tmp/never", save=EveryNSteps(2), replicas=1, failure_domain="rack 7")
    assert tier.failure_domain == "rack 7"
