"""A plain Python iterator with state methods, and helpers to advance and compare iterators."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

AHEAD = 6  # elements compared after a restore


def take(iterator: Any, n: int = AHEAD) -> list[Any]:
    return [np.asarray(x).tolist() for x in itertools.islice(iterator, n)]


class Shuffled:
    """A plain Python iterator with a NumPy permutation and RNG state (get_state/set_state)."""

    def __init__(self, n: int = 50, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.order = self.rng.permutation(n)
        self.pos = 0
        self.epoch = (0, "train")

    def __iter__(self) -> Shuffled:
        return self

    def __next__(self) -> int:
        if self.pos == len(self.order):
            self.order, self.pos = self.rng.permutation(len(self.order)), 0
            self.epoch = (self.epoch[0] + 1, "train")
        self.pos += 1
        return int(self.order[self.pos - 1])

    def get_state(self) -> dict[str, Any]:
        return {
            "order": self.order.copy(),
            "pos": np.int64(self.pos),
            "rng": self.rng.bit_generator.state,
            "epoch": self.epoch,
            "seen": {3: b"\x00\xff", "nan": float("nan")},
        }

    def set_state(self, state: dict[str, Any]) -> None:
        self.order, self.pos = state["order"].copy(), int(state["pos"])
        self.rng.bit_generator.state = state["rng"]
        self.epoch = state["epoch"]


class TorchStyle(Shuffled):
    """The same iterator with state_dict()/load_state_dict() instead."""

    def state_dict(self) -> dict[str, Any]:
        return Shuffled.get_state(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        Shuffled.set_state(self, state)

    get_state = None  # type: ignore[assignment]
    set_state = None  # type: ignore[assignment]


def advanced(iterator: Any, n: int = 7) -> Any:
    for _ in range(n):
        next(iterator)
    return iterator
