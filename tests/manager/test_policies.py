"""Save and keep policies: validation, decisions, composition, and retention properties."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn.manager import (
    AnyOf,
    AtSteps,
    EveryNSeconds,
    EveryNSteps,
    KeepAll,
    KeepBest,
    KeepEvery,
    KeepLatest,
    SaveContext,
    StepView,
)
from cairn.manager._core.policies import steps_to_delete

NAN = float("nan")
INF = float("inf")


def ctx(now: float = 0.0, last: float | None = None, latest: int | None = None) -> SaveContext:
    return SaveContext(latest_step=latest, last_save_time=last, now=now)


def views_of(*specs: tuple[int, float] | tuple[int, float, dict[str, float]]) -> list[StepView]:
    return [StepView(*spec) for spec in specs]


# ---------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("make", "name", "value"),
    [
        (lambda: EveryNSteps(0), "n", "0"),
        (lambda: EveryNSteps(-1), "n", "-1"),
        (lambda: EveryNSteps(1.5), "n", "1.5"),
        (lambda: EveryNSteps(True), "n", "True"),
        (lambda: AtSteps("abc"), "steps", "'abc'"),
        (lambda: AtSteps([-1]), "steps", "-1"),
        (lambda: AtSteps([1.0]), "steps", "1.0"),
        (lambda: AtSteps([True]), "steps", "True"),
        (lambda: AtSteps(5), "steps", "5"),
        (lambda: EveryNSeconds(0), "seconds", "0"),
        (lambda: EveryNSeconds(-2.5), "seconds", "-2.5"),
        (lambda: EveryNSeconds(NAN), "seconds", "nan"),
        (lambda: EveryNSeconds(INF), "seconds", "inf"),
        (lambda: EveryNSeconds(True), "seconds", "True"),
        (lambda: KeepLatest(0), "n", "0"),
        (lambda: KeepLatest(2.0), "n", "2.0"),
        (lambda: KeepBest(0, "m"), "n", "0"),
        (lambda: KeepBest(1, ""), "metric", "''"),
        (lambda: KeepBest(1, 3), "metric", "3"),
        (lambda: KeepBest(1, "m", mode="avg"), "mode", "'avg'"),
        (lambda: KeepBest(1, "m", keep_without_metrics=1), "keep_without_metrics", "1"),
        (lambda: KeepEvery(), "steps", "None"),
        (lambda: KeepEvery(steps=2, seconds=3), "seconds", "3"),
        (lambda: KeepEvery(steps=0), "steps", "0"),
        (lambda: KeepEvery(steps=-4), "steps", "-4"),
        (lambda: KeepEvery(seconds=0), "seconds", "0"),
        (lambda: KeepEvery(seconds=NAN), "seconds", "nan"),
    ],
)
def test_constructor_rejects_bad_value_naming_argument_and_value(make, name, value):
    """A bad argument raises ValueError whose message names the argument and the value."""
    with pytest.raises(ValueError) as info:
        make()
    message = str(info.value)
    assert re.search(rf"\b{re.escape(name)}\b", message), message
    assert value in message, message


def test_keep_every_neither_nor_both_message_names_both_arguments():
    """KeepEvery() and KeepEvery(steps=, seconds=) say to give exactly one of the two."""
    for make in (lambda: KeepEvery(), lambda: KeepEvery(steps=2, seconds=3)):
        with pytest.raises(ValueError, match="exactly one") as info:
            make()
        assert "steps=" in str(info.value) and "seconds=" in str(info.value)


@pytest.mark.parametrize(
    ("make", "pattern"),
    [
        (lambda: AnyOf(), "at least one"),
        (lambda: AnyOf(EveryNSteps(1), KeepAll()), "not a mix"),
        (lambda: AnyOf(KeepLatest(1), AtSteps([1])), "not a mix"),
        (lambda: AnyOf(AnyOf(EveryNSteps(1)), AnyOf(KeepAll())), "not a mix"),
        (lambda: AnyOf(object()), "neither a save policy nor a keep policy"),
        (lambda: AnyOf(KeepAll(), 3), "3 is neither"),
    ],
)
def test_anyof_rejects_empty_mixed_and_foreign(make, pattern):
    """AnyOf refuses no policies, a mix of save and keep policies, and non-policies."""
    with pytest.raises(ValueError, match=pattern) as info:
        make()
    assert "AnyOf" in str(info.value)


def test_bug_anyof_rejects_policy_class_instead_of_instance():
    """AnyOf(KeepAll) (a class, not an instance) is refused at construction, not at first use."""
    # The class has a callable `keep` attribute (the unbound function), so policy_kind() says
    # "keep" and the mistake only surfaces later as a TypeError inside retention.
    with pytest.raises(ValueError):
        AnyOf(KeepAll)
    with pytest.raises(ValueError):
        AnyOf(EveryNSteps)


def test_valid_arguments_accepted():
    """Good values construct, including numpy ints, generators and whole floats for seconds."""
    assert EveryNSteps(np.int64(3)).should_save(6, ctx())
    assert AtSteps(s for s in (1, 2, 3)).steps == frozenset({1, 2, 3})
    assert AtSteps(np.array([4, 5])).steps == frozenset({4, 5})
    assert AtSteps([]).steps == frozenset()
    assert EveryNSeconds(1).seconds == 1
    assert EveryNSeconds(0.5).seconds == 0.5
    assert KeepEvery(seconds=3600).seconds == 3600
    assert KeepBest(2, "loss", mode="max", keep_without_metrics=False).mode == "max"


POLICY_FACTORIES = {
    "EveryNSteps": lambda: EveryNSteps(2),
    "AtSteps": lambda: AtSteps([1, 2]),
    "EveryNSeconds": lambda: EveryNSeconds(5.0),
    "KeepAll": lambda: KeepAll(),
    "KeepLatest": lambda: KeepLatest(3),
    "KeepBest": lambda: KeepBest(1, "loss", mode="max"),
    "KeepEvery-steps": lambda: KeepEvery(steps=10),
    "KeepEvery-seconds": lambda: KeepEvery(seconds=60.0),
    "AnyOf-save": lambda: AnyOf(EveryNSteps(2), AtSteps([3])),
    "AnyOf-keep": lambda: AnyOf(KeepLatest(1), AnyOf(KeepBest(1, "loss"))),
}


@pytest.mark.parametrize("make", POLICY_FACTORIES.values(), ids=POLICY_FACTORIES.keys())
def test_policies_are_frozen_dataclasses(make):
    """Every policy is a dataclass; assigning any field raises FrozenInstanceError."""
    policy = make()
    assert dataclasses.is_dataclass(policy)
    names = [f.name for f in dataclasses.fields(policy)] or ["anything"]
    for name in names:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(policy, name, 1)


@pytest.mark.parametrize("make", POLICY_FACTORIES.values(), ids=POLICY_FACTORIES.keys())
def test_equal_policies_compare_and_hash_equal(make):
    """A policy built twice from the same arguments is equal and hashes the same."""
    assert make() == make()
    assert hash(make()) == hash(make())


def test_options_are_keyword_only():
    """Main arguments are positional; options (mode, keep_without_metrics, KeepEvery's) are not."""
    with pytest.raises(TypeError):
        KeepBest(1, "m", "max")  # type: ignore[misc]
    with pytest.raises(TypeError):
        KeepBest(1, "m", mode="max", keep_without_metrics=True, extra=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        KeepEvery(5)  # type: ignore[misc]
    assert KeepBest(1, "m", mode="max").mode == "max"
    assert EveryNSteps(4) == EveryNSteps(n=4)
    assert KeepLatest(2).n == 2
    assert EveryNSeconds(3.0).seconds == 3.0


# ---------------------------------------------------------------------------- save policies


@pytest.mark.parametrize("n", [1, 2, 3, 7, 100])
def test_every_n_steps_is_step_mod_n(n):
    """EveryNSteps(n) saves iff step % n == 0, step 0 included, regardless of context."""
    for step in range(0, 3 * n + 2):
        for context in (ctx(), ctx(now=1e9, last=1e9 - 1, latest=step - 1)):
            assert EveryNSteps(n).should_save(step, context) is (step % n == 0)
    assert EveryNSteps(n).should_save(0, ctx())


def test_at_steps_saves_exactly_listed_steps():
    """AtSteps saves at the listed steps only (duplicates and order don't matter)."""
    policy = AtSteps([10, 0, 10, 250])
    assert policy.steps == frozenset({0, 10, 250})
    saved = [s for s in range(300) if policy.should_save(s, ctx())]
    assert saved == [0, 10, 250]


def test_every_n_seconds_uses_last_save_time():
    """EveryNSeconds saves with no known last save, and when now - last >= seconds."""
    policy = EveryNSeconds(60.0)
    assert policy.should_save(5, ctx(now=0.0, last=None))
    assert policy.should_save(5, ctx(now=1000.0, last=None, latest=4))
    assert not policy.should_save(5, ctx(now=100.0, last=41.0))
    assert policy.should_save(5, ctx(now=100.0, last=40.0))
    assert policy.should_save(5, ctx(now=100.0, last=0.0))
    assert not policy.should_save(5, ctx(now=100.0, last=100.0))


def test_anyof_of_save_policies_saves_when_any_part_does():
    """AnyOf of save policies is true iff some part is true, nested AnyOf included."""
    policy = AnyOf(EveryNSteps(10), AtSteps([3, 17]))
    saved = [s for s in range(31) if policy.should_save(s, ctx())]
    assert saved == [0, 3, 10, 17, 20, 30]

    nested = AnyOf(AnyOf(EveryNSteps(7), AtSteps([2])), EveryNSeconds(60))
    assert policy.kind == nested.kind == "save"
    assert nested.should_save(14, ctx(now=10.0, last=5.0))
    assert nested.should_save(2, ctx(now=10.0, last=5.0))
    assert not nested.should_save(5, ctx(now=10.0, last=5.0))
    assert nested.should_save(5, ctx(now=65.0, last=5.0))
    assert nested.should_save(5, ctx(now=10.0, last=None))


def test_anyof_kinds_expose_only_their_own_method():
    """AnyOf of keep policies has no working should_save, and AnyOf of save policies no keep."""
    keep = AnyOf(KeepAll(), KeepLatest(1))
    save = AnyOf(EveryNSteps(1), EveryNSeconds(1))
    assert keep.kind == "keep"
    with pytest.raises(TypeError, match="should_save"):
        keep.should_save(0, ctx())
    with pytest.raises(TypeError, match="keep"):
        save.keep([StepView(0, 0.0)])
    with pytest.raises(TypeError):
        AnyOf(AnyOf(KeepAll())).should_save(0, ctx())


# ---------------------------------------------------------------------------- keep policies


def test_keep_all_keeps_every_step():
    """KeepAll keeps all steps given, and nothing for no steps."""
    views = views_of((0, 0.0), (5, 1.0), (9, 2.0))
    assert KeepAll().keep(views) == {0, 5, 9}
    assert KeepAll().keep([]) == set()


def test_keep_latest_keeps_n_highest_steps():
    """KeepLatest(n) keeps the n highest step numbers, whatever the input order."""
    views = views_of((30, 3.0), (10, 1.0), (40, 4.0), (20, 2.0))
    assert KeepLatest(1).keep(views) == {40}
    assert KeepLatest(2).keep(views) == {30, 40}
    assert KeepLatest(10).keep(views) == {10, 20, 30, 40}
    assert KeepLatest(3).keep([]) == set()


def test_keep_best_min_and_max():
    """KeepBest keeps the n lowest values in min mode and the n highest in max mode."""
    views = views_of(
        (1, 1.0, {"loss": 0.5, "acc": 0.1}),
        (2, 2.0, {"loss": 0.2, "acc": 0.7}),
        (3, 3.0, {"loss": 0.9, "acc": 0.9}),
        (4, 4.0, {"loss": 0.3, "acc": 0.4}),
    )
    assert KeepBest(1, "loss").keep(views) == {2}
    assert KeepBest(2, "loss", mode="min").keep(views) == {2, 4}
    assert KeepBest(1, "acc", mode="max").keep(views) == {3}
    assert KeepBest(2, "acc", mode="max").keep(views) == {2, 3}
    assert KeepBest(9, "acc", mode="max").keep(views) == {1, 2, 3, 4}


@pytest.mark.parametrize("mode", ["min", "max"])
def test_keep_best_ties_go_to_newer_step(mode):
    """Among equal metric values KeepBest prefers the newer (higher) step."""
    views = views_of(
        (1, 1.0, {"m": 1.0}), (2, 2.0, {"m": 1.0}), (3, 3.0, {"m": 1.0}), (4, 4.0, {"m": 1.0})
    )
    assert KeepBest(1, "m", mode=mode).keep(views) == {4}
    assert KeepBest(2, "m", mode=mode).keep(views) == {3, 4}
    better = 0.0 if mode == "min" else 2.0
    views.append(StepView(0, 0.5, {"m": better}))
    assert KeepBest(2, "m", mode=mode).keep(views) == {0, 4}


def test_keep_best_steps_without_metric():
    """Steps lacking the metric (or with NaN) are kept iff keep_without_metrics, and never rank."""
    views = views_of(
        (1, 1.0, {"loss": 0.5}),
        (2, 2.0, {}),
        (3, 3.0, {"loss": NAN}),
        (4, 4.0, {"other": 0.0}),
        (5, 5.0, {"loss": 0.7}),
    )
    assert KeepBest(1, "loss").keep(views) == {1, 2, 3, 4}
    assert KeepBest(1, "loss", keep_without_metrics=True).keep(views) == {1, 2, 3, 4}
    assert KeepBest(1, "loss", keep_without_metrics=False).keep(views) == {1}
    assert KeepBest(5, "loss", keep_without_metrics=False).keep(views) == {1, 5}
    assert KeepBest(1, "loss", mode="max", keep_without_metrics=False).keep(views) == {5}
    no_metric = views_of((1, 1.0), (2, 2.0, {"loss": NAN}))
    assert KeepBest(1, "loss", keep_without_metrics=False).keep(no_metric) == set()


def test_keep_best_infinite_values_rank():
    """Infinite metric values are real values: +inf is worst for min and best for max."""
    views = views_of((1, 1.0, {"m": INF}), (2, 2.0, {"m": 0.0}), (3, 3.0, {"m": -INF}))
    assert KeepBest(1, "m").keep(views) == {3}
    assert KeepBest(1, "m", mode="max").keep(views) == {1}


def test_keep_every_steps_keeps_multiples():
    """KeepEvery(steps=k) keeps exactly the steps that are multiples of k (step 0 included)."""
    views = [StepView(s, float(s)) for s in (0, 3, 5, 10, 12, 15, 20, 21)]
    assert KeepEvery(steps=5).keep(views) == {0, 5, 10, 15, 20}
    assert KeepEvery(steps=1).keep(views) == {0, 3, 5, 10, 12, 15, 20, 21}
    assert KeepEvery(steps=100).keep(views) == {0}


def test_keep_every_seconds_keeps_oldest_then_one_per_interval():
    """KeepEvery(seconds=s) keeps the oldest step, then each step >= s after the last kept one."""
    times = {1: 100.0, 2: 104.0, 3: 109.0, 4: 110.0, 5: 115.0, 6: 120.0, 7: 129.9, 8: 131.0}
    views = [StepView(s, t) for s, t in times.items()]
    assert KeepEvery(seconds=10).keep(views) == {1, 4, 6, 8}
    assert KeepEvery(seconds=10).keep(list(reversed(views))) == {1, 4, 6, 8}
    assert KeepEvery(seconds=1000).keep(views) == {1}
    assert KeepEvery(seconds=0.5).keep(views) == set(times)
    assert KeepEvery(seconds=10).keep([]) == set()


def test_anyof_of_keep_policies_is_union():
    """AnyOf of keep policies keeps what any part keeps, nested AnyOf included."""
    views = [StepView(s, float(s), {"loss": float(10 - s)}) for s in range(10)]
    latest, every, best = KeepLatest(2), KeepEvery(steps=4), KeepBest(1, "loss", mode="max")
    assert AnyOf(latest, every).keep(views) == {0, 4, 8, 9}
    assert AnyOf(AnyOf(latest), AnyOf(every, best)).keep(views) == {0, 4, 8, 9}
    assert AnyOf(best, KeepAll()).keep(views) == set(range(10))


def test_steps_to_delete_examples():
    """steps_to_delete removes what the policy does not keep, sparing the newest step."""
    views = [StepView(s, float(s), {"loss": 1.0}) for s in (10, 20, 30, 40)]
    assert steps_to_delete([], KeepLatest(1)) == []
    assert steps_to_delete(views, KeepAll()) == []
    assert steps_to_delete(views, KeepLatest(2)) == [10, 20]
    assert steps_to_delete(views, KeepEvery(steps=20)) == [10, 30]
    # Best is step 40 (newest on ties); the newest would be spared anyway.
    assert steps_to_delete(views, KeepBest(1, "loss")) == [10, 20, 30]
    # Unordered input still spares the highest step number.
    shuffled = [views[2], views[3], views[0], views[1]]
    assert steps_to_delete(shuffled, KeepBest(1, "missing", keep_without_metrics=False)) == [
        10,
        20,
        30,
    ]


# ---------------------------------------------------------------------------- properties

METRICS = ("loss", "acc")

metric_values = st.one_of(
    st.just(NAN),
    st.floats(allow_nan=False, allow_infinity=True, width=32),
    st.sampled_from([0.0, 1.0, -1.0]),  # frequent ties
)


@st.composite
def step_views(draw: st.DrawFn) -> list[StepView]:
    steps = sorted(draw(st.sets(st.integers(0, 200), max_size=12)))
    views = []
    time = draw(st.floats(0.0, 1e6))
    for step in steps:
        time += draw(st.floats(0.0, 50.0))
        metrics = draw(st.dictionaries(st.sampled_from(METRICS), metric_values, max_size=2))
        views.append(StepView(step, time, metrics))
    return draw(st.permutations(views))


leaf_keep_policies = st.one_of(
    st.just(KeepAll()),
    st.builds(KeepLatest, st.integers(1, 5)),
    st.builds(
        KeepBest,
        st.integers(1, 3),
        st.sampled_from(METRICS),
        mode=st.sampled_from(["min", "max"]),
        keep_without_metrics=st.booleans(),
    ),
    st.builds(KeepEvery, steps=st.integers(1, 10)),
    st.builds(KeepEvery, seconds=st.floats(0.5, 100.0)),
)

keep_policies = st.recursive(
    leaf_keep_policies,
    lambda children: st.lists(children, min_size=1, max_size=3).map(lambda ps: AnyOf(*ps)),
    max_leaves=8,
)

PROPERTY_SETTINGS = settings(max_examples=200, deadline=None)


def sub_policies(policy):
    """The policy and every policy nested inside it."""
    yield policy
    if isinstance(policy, AnyOf):
        for part in policy.policies:
            yield from sub_policies(part)


@PROPERTY_SETTINGS
@given(views=step_views(), policy=keep_policies)
def test_property_never_deletes_newest_step(views, policy):
    """steps_to_delete never deletes the highest step number."""
    deleted = steps_to_delete(views, policy)
    if views:
        assert max(v.step for v in views) not in deleted
    else:
        assert deleted == []


@PROPERTY_SETTINGS
@given(views=step_views(), policy=keep_policies)
def test_property_never_deletes_what_a_sub_policy_keeps(views, policy):
    """No step kept by any (nested) sub-policy of the policy is deleted."""
    deleted = set(steps_to_delete(views, policy))
    for part in sub_policies(policy):
        assert not (part.keep(views) & deleted), part


@PROPERTY_SETTINGS
@given(views=step_views(), policy=keep_policies)
def test_property_idempotent(views, policy):
    """Applying retention again to the surviving steps deletes nothing more."""
    deleted = set(steps_to_delete(views, policy))
    remaining = [v for v in views if v.step not in deleted]
    assert steps_to_delete(remaining, policy) == []


@PROPERTY_SETTINGS
@given(views=step_views(), policy=keep_policies)
def test_property_result_is_sorted_subset_of_input(views, policy):
    """The deleted steps are a sorted, duplicate-free subset of the input steps."""
    deleted = steps_to_delete(views, policy)
    assert deleted == sorted(set(deleted))
    assert set(deleted) <= {v.step for v in views}
    assert policy.keep(views) <= {v.step for v in views}


@PROPERTY_SETTINGS
@given(views=step_views(), policy=keep_policies)
def test_property_incremental_retention_matches_batch(views, policy):
    """Retention after every commit leaves the same steps as one retention pass at the end."""
    ordered = sorted(views, key=lambda v: v.step)
    alive: list[StepView] = []
    for view in ordered:
        alive.append(view)
        gone = set(steps_to_delete(alive, policy))
        alive = [v for v in alive if v.step not in gone]
    batch_gone = set(steps_to_delete(ordered, policy))
    assert {v.step for v in alive} == {v.step for v in ordered if v.step not in batch_gone}


@PROPERTY_SETTINGS
@given(views=step_views())
def test_property_nan_metric_same_as_missing(views):
    """A NaN metric value behaves exactly like the metric being absent, for every KeepBest."""
    cleaned = [
        StepView(
            v.step,
            v.time,
            {k: x for k, x in v.metrics.items() if not (isinstance(x, float) and math.isnan(x))},
        )
        for v in views
    ]
    for metric in METRICS:
        for mode in ("min", "max"):
            for kwm in (True, False):
                policy = KeepBest(2, metric, mode=mode, keep_without_metrics=kwm)
                assert policy.keep(views) == policy.keep(cleaned)
