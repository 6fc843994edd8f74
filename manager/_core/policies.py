"""When to save and what to keep: tiny frozen policy dataclasses with one method each.

Save policies answer `should_save(step, context)`; keep policies answer `keep(steps)`, the set of
committed steps they want kept. `AnyOf` composes either kind (not a mix): it saves when any part
says save, and keeps what any part keeps. Main arguments are positional, options keyword-only;
bad values raise ValueError naming the argument.

A policy may be the user's own object, so its answer is checked before it is acted on
(`checked_should_save`, `checked_keep`): should_save must return a bool (NumPy's bool_ too, never
an int or a str), keep a set or frozenset of ints among the steps it was given. A wrong answer
raises TypeError (wrong type) or ValueError (a step it was not given) naming the policy and the
answer, and nothing is saved or deleted on its word.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import reprlib
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, Protocol

import numpy as np

log = logging.getLogger("cairn")

__all__ = [
    "AnyOf",
    "AtSteps",
    "EveryNSeconds",
    "EveryNSteps",
    "KeepAll",
    "KeepBest",
    "KeepEvery",
    "KeepLatest",
    "KeepPolicy",
    "LastSave",
    "OnPreemption",
    "SaveContext",
    "SavePolicy",
    "StepView",
    "checked_keep",
    "checked_should_save",
]


@dataclasses.dataclass(frozen=True)
class SaveContext:
    """What a save policy may look at besides the step.

    `latest_step`: the newest committed (or in-flight) step, None if there is none.
    `last_save_time`: wall-clock time (time.time()) the last save started, else the newest step's
    save time read from its manifest (no later than now), else None; measured on the monotonic
    clock (`LastSave`). `now`: the current time. `preempted`: the job was told to stop (SIGTERM,
    or JAX's preemption sync point reached at this step).
    """

    latest_step: int | None
    last_save_time: float | None
    now: float
    preempted: bool = False


class LastSave:
    """When the last save started, for `SaveContext.last_save_time`: held as a monotonic
    instant, so that a wall clock stepped back or forward between two saves of one process
    (NTP, a VM restored from a snapshot) neither holds `EveryNSeconds` off nor makes it save
    early. The first one comes from the newest step's manifest (`read`); a start later than
    now (a host whose clock ran ahead wrote it, this clock was since stepped back, or the
    manifest was crafted) counts as now, with one warning naming the step and the skew:
    taken as it is, no time-based save would happen until the wall clock caught up.

    Threads: the manager's caller thread only."""

    def __init__(self) -> None:
        self._at: float | None = None  # time.monotonic() when it started

    def started(self, at: float) -> None:
        """A save started at monotonic time `at`."""
        self._at = at

    def read(self, step: int, started_at: float, *, warn: bool = True) -> None:
        """The newest committed step, `step`, started at wall time `started_at` (`warn`: say so
        if that is in the future; a manager without time policies does not)."""
        now = time.time()
        if warn and started_at > now + _SKEW_WARNING_S:
            log.warning(
                "cairn: step %d started at %s, %.0f s after this host's clock says it is now "
                "(a clock that ran ahead, or stepped back since); time-based saves count from now",
                step,
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started_at)),
                started_at - now,
            )
        self._at = time.monotonic() - max(0.0, now - started_at)

    def time(self, now: float) -> float | None:
        """The wall time the last save started, as seen from `now` (time.time())."""
        return None if self._at is None else now - (time.monotonic() - self._at)


_SKEW_WARNING_S = 1.0  # a newest step this far in the future is worth a warning


@dataclasses.dataclass(frozen=True)
class StepView:
    """What a keep policy may look at: a committed step, its metrics and when it was saved."""

    step: int
    time: float
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)


class SavePolicy(Protocol):
    def should_save(self, step: int, context: SaveContext) -> bool: ...


class KeepPolicy(Protocol):
    def keep(self, steps: Sequence[StepView]) -> set[int]: ...


def _positive_int(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}")


def _positive_number(owner: str, name: str, value: object) -> None:
    try:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        ok = ok and math.isfinite(float(value)) and float(value) > 0  # type: ignore[arg-type]
    except OverflowError:
        ok = False
    if not ok:
        raise ValueError(f"{owner}: {name} must be a positive finite number, got {value!r}")


# ---------------------------------------------------------------------------- save policies


@dataclasses.dataclass(frozen=True)
class EveryNSteps:
    """Save when ``step % n == 0`` (step 0 included). Stateless, as Orbax's interval policy."""

    n: int

    def __post_init__(self) -> None:
        _positive_int("EveryNSteps", "n", self.n)

    def should_save(self, step: int, context: SaveContext) -> bool:
        del context
        return step % self.n == 0


@dataclasses.dataclass(frozen=True)
class AtSteps:
    """Save at exactly the listed steps."""

    steps: frozenset[int]

    def __init__(self, steps: Iterable[int]) -> None:
        if isinstance(steps, (str, bytes)) or not isinstance(steps, Iterable):
            raise ValueError(f"AtSteps: steps must be an iterable of ints, got {steps!r}")
        values = list(steps)
        for s in values:
            if isinstance(s, bool) or not isinstance(s, numbers.Integral) or int(s) < 0:
                raise ValueError(f"AtSteps: steps must be non-negative ints, got {s!r}")
        object.__setattr__(self, "steps", frozenset(int(s) for s in values))

    def should_save(self, step: int, context: SaveContext) -> bool:
        del context
        return step in self.steps


@dataclasses.dataclass(frozen=True)
class EveryNSeconds:
    """Save when at least `seconds` passed since the last save started (or if none is known)."""

    seconds: float

    def __post_init__(self) -> None:
        _positive_number("EveryNSeconds", "seconds", self.seconds)

    def should_save(self, step: int, context: SaveContext) -> bool:
        del step
        last = context.last_save_time
        return last is None or context.now - last >= self.seconds


@dataclasses.dataclass(frozen=True)
class OnPreemption:
    """Save at the first step after the job is told to stop.

    The manager watches for SIGTERM (what cluster schedulers send before they kill a job; more
    signals with `signals=`), or, in a ``jax.distributed`` run with JAX's preemption service, uses
    ``reached_preemption_sync_point(step)`` so that every process saves the same step. A save this
    policy asks for waits for its commit before `save()` returns; then
    ``manager.reached_preemption(step)`` is True and the trainer should exit. Combine it with a
    regular schedule: ``AnyOf(EveryNSteps(1000), OnPreemption())``.
    """

    signals: tuple[int, ...] = dataclasses.field(default=(15,), kw_only=True)  # SIGTERM

    def __post_init__(self) -> None:
        import signal

        valid = set(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP}
        if (
            not isinstance(self.signals, tuple)
            or not self.signals
            or any(isinstance(s, bool) or s not in valid for s in self.signals)
        ):
            raise ValueError(
                "OnPreemption: signals must be a non-empty tuple of catchable signal numbers, "
                f"got {self.signals!r}"
            )
        object.__setattr__(self, "signals", tuple(signal.Signals(s) for s in self.signals))

    def should_save(self, step: int, context: SaveContext) -> bool:
        del step
        return context.preempted


def find_on_preemption(policy: SavePolicy) -> list[OnPreemption]:
    """Every OnPreemption inside a save policy."""
    if isinstance(policy, OnPreemption):
        return [policy]
    if isinstance(policy, AnyOf):
        return [o for p in policy.policies for o in find_on_preemption(p)]  # type: ignore[arg-type]
    return []


# ---------------------------------------------------------------------------- keep policies


@dataclasses.dataclass(frozen=True)
class KeepAll:
    """Keep every committed step (the default)."""

    def keep(self, steps: Sequence[StepView]) -> set[int]:
        return {s.step for s in steps}


@dataclasses.dataclass(frozen=True)
class KeepLatest:
    """Keep the `n` newest steps (Orbax's max_to_keep, T5X's keep)."""

    n: int

    def __post_init__(self) -> None:
        _positive_int("KeepLatest", "n", self.n)

    def keep(self, steps: Sequence[StepView]) -> set[int]:
        return set(sorted(s.step for s in steps)[-self.n :])


@dataclasses.dataclass(frozen=True)
class KeepBest:
    """Keep the `n` steps with the best value of `metric` (ties go to the newer step).

    Steps that lack the metric are kept when `keep_without_metrics` (the default: an evaluation
    may still be on its way), else left to the other policies. Late metrics (record_metrics) count.
    """

    n: int
    metric: str
    mode: Literal["min", "max"] = dataclasses.field(default="min", kw_only=True)
    keep_without_metrics: bool = dataclasses.field(default=True, kw_only=True)

    def __post_init__(self) -> None:
        _positive_int("KeepBest", "n", self.n)
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError(f"KeepBest: metric must be a non-empty str, got {self.metric!r}")
        if self.mode not in ("min", "max"):
            raise ValueError(f"KeepBest: mode must be 'min' or 'max', got {self.mode!r}")
        if not isinstance(self.keep_without_metrics, bool):
            raise ValueError(
                f"KeepBest: keep_without_metrics must be a bool, got {self.keep_without_metrics!r}"
            )

    def keep(self, steps: Sequence[StepView]) -> set[int]:
        scored = [s for s in steps if _has_metric(s, self.metric)]
        sign = 1.0 if self.mode == "min" else -1.0
        # Sort best first; among equal values the newer step first.
        scored.sort(key=lambda s: (sign * float(s.metrics[self.metric]), -s.step))
        kept = {s.step for s in scored[: self.n]}
        if self.keep_without_metrics:
            kept |= {s.step for s in steps if not _has_metric(s, self.metric)}
        return kept


def _has_metric(view: StepView, metric: str) -> bool:
    value = view.metrics.get(metric)
    return value is not None and not math.isnan(float(value))


@dataclasses.dataclass(frozen=True)
class KeepEvery:
    """Keep steps that are multiples of `steps`, or one step per `seconds` of save time.

    ``KeepEvery(steps=k)`` is Orbax's keep_period and T5X's force_keep_period. With
    ``KeepEvery(seconds=s)`` the oldest step is kept, then each step saved at least `s` seconds
    after the previous kept one. Give exactly one of the two.
    """

    steps: int | None = dataclasses.field(default=None, kw_only=True)
    seconds: float | None = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if (self.steps is None) == (self.seconds is None):
            raise ValueError(
                f"KeepEvery: give exactly one of steps= or seconds=, "
                f"got steps={self.steps!r}, seconds={self.seconds!r}"
            )
        if self.steps is not None:
            _positive_int("KeepEvery", "steps", self.steps)
        if self.seconds is not None:
            _positive_number("KeepEvery", "seconds", self.seconds)

    def keep(self, steps: Sequence[StepView]) -> set[int]:
        if self.steps is not None:
            return {s.step for s in steps if s.step % self.steps == 0}
        assert self.seconds is not None
        kept: set[int] = set()
        last: float | None = None
        for view in sorted(steps, key=lambda s: (s.time, s.step)):
            if last is None or view.time - last >= self.seconds:
                kept.add(view.step)
                last = view.time
        return kept


# ---------------------------------------------------------------------------- composition


@dataclasses.dataclass(frozen=True)
class AnyOf:
    """Save when any save policy says so, or keep what any keep policy keeps. Not a mix of kinds."""

    policies: tuple[SavePolicy, ...] | tuple[KeepPolicy, ...]

    def __init__(self, *policies: SavePolicy | KeepPolicy) -> None:
        if not policies:
            raise ValueError("AnyOf: give at least one policy")
        kinds = [policy_kind(p) for p in policies]
        for p, kind in zip(policies, kinds, strict=True):
            if kind is None:
                raise ValueError(f"AnyOf: {p!r} is neither a save policy nor a keep policy")
        if len(set(kinds)) > 1:
            raise ValueError("AnyOf: compose save policies or keep policies, not a mix")
        object.__setattr__(self, "policies", tuple(policies))

    @property
    def kind(self) -> Literal["save", "keep"]:
        kind = policy_kind(self.policies[0])
        assert kind is not None
        return kind

    def should_save(self, step: int, context: SaveContext) -> bool:
        if self.kind != "save":
            raise TypeError("AnyOf of keep policies has no should_save")
        # Every part answers (no short cut), so a broken part is found whatever the others say.
        answers = [checked_should_save(p, step, context) for p in self.policies]  # type: ignore[arg-type]
        return any(answers)

    def keep(self, steps: Sequence[StepView]) -> set[int]:
        if self.kind != "keep":
            raise TypeError("AnyOf of save policies has no keep")
        kept: set[int] = set()
        for p in self.policies:
            kept |= checked_keep(p, steps)  # type: ignore[arg-type]
        return kept


def policy_kind(policy: object) -> Literal["save", "keep"] | None:
    """Whether `policy` is a save policy, a keep policy, or neither (None)."""
    if isinstance(policy, type):  # a class, not an instance: AnyOf(KeepAll) is a mistake
        return None
    if isinstance(policy, AnyOf):
        return policy.kind
    if callable(getattr(policy, "should_save", None)):
        return "save"
    if callable(getattr(policy, "keep", None)):
        return "keep"
    return None


def find_keep_best(policy: KeepPolicy) -> list[KeepBest]:
    """Every KeepBest inside a keep policy (used for best_step when best= is not given)."""
    if isinstance(policy, KeepBest):
        return [policy]
    if isinstance(policy, AnyOf):
        return [b for p in policy.policies for b in find_keep_best(p)]  # type: ignore[arg-type]
    return []


def steps_to_delete(views: Sequence[StepView], policy: KeepPolicy) -> list[int]:
    """The committed steps retention removes: not kept by the policy and not the newest step."""
    if not views:
        return []
    newest = max(v.step for v in views)
    kept = checked_keep(policy, views) | {newest}
    return sorted(v.step for v in views if v.step not in kept)


def checked_should_save(policy: SavePolicy, step: int, context: SaveContext) -> bool:
    """`policy.should_save(step, context)`, refused unless it is a bool (or NumPy's bool_)."""
    answer = policy.should_save(step, context)
    if not isinstance(answer, (bool, np.bool_)):
        raise TypeError(
            f"save policy {policy!r}: should_save({step}) must return a bool, "
            f"got {type(answer).__name__} {reprlib.repr(answer)}"
        )
    return bool(answer)


def checked_keep(policy: KeepPolicy, views: Sequence[StepView]) -> set[int]:
    """`policy.keep(views)`, refused unless it is a set of ints among the steps given.

    A step that was not given is a bug in the policy, not a wish: read as "keep nothing else",
    it would delete every step but the newest.
    """
    answer = policy.keep(views)
    if not isinstance(answer, (set, frozenset)):
        raise TypeError(
            f"keep policy {policy!r}: keep() must return a set of step numbers, "
            f"got {type(answer).__name__} {reprlib.repr(answer)}"
        )
    wrong = [s for s in answer if isinstance(s, bool) or not isinstance(s, numbers.Integral)]
    if wrong:
        raise TypeError(
            f"keep policy {policy!r}: keep() must return a set of int step numbers, "
            f"got {reprlib.repr(answer)} (holding {type(wrong[0]).__name__} {wrong[0]!r})"
        )
    given = {v.step for v in views}
    unknown = sorted(int(s) for s in answer if s not in given)
    if unknown:
        raise ValueError(
            f"keep policy {policy!r}: keep() returned steps {reprlib.repr(unknown)} that are not "
            f"among the steps it was given {reprlib.repr(sorted(given))}"
        )
    return {int(s) for s in answer}


def uses_time(policy: Any) -> bool:
    """Whether a save policy looks at the clock (so processes could disagree)."""
    if isinstance(policy, AnyOf):
        return any(uses_time(p) for p in policy.policies)
    return not isinstance(policy, (EveryNSteps, AtSteps))


def policy_wants(
    policy: SavePolicy,
    step: int,
    known: set[int],
    last_save: LastSave,
    decide: Callable[[str, Callable[[], bool]], bool],
    what: str,
    *,
    preempted: Callable[[], bool] = lambda: False,
) -> bool:
    """A tier's save decision: False at or below its newest `known` step, else its `policy`
    asked with that context (`preempted()` asked only then); a policy that reads the clock is
    answered by `decide` (the primary decides for every process, clocks differ)."""
    if step in known or (known and step <= max(known)):
        return False
    now = time.time()
    context = SaveContext(
        latest_step=max(known) if known else None,
        last_save_time=last_save.time(now),
        now=now,
        preempted=preempted(),
    )
    if not uses_time(policy):
        return checked_should_save(policy, step, context)
    return decide(what, lambda: checked_should_save(policy, step, context))
