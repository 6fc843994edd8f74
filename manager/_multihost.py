"""Which process this is, and how processes meet: barriers and broadcasts with timeouts.

Built on JAX's coordination service (the one ``jax.distributed.initialize`` starts), as Orbax's
multihost utilities are: a barrier is ``wait_at_barrier`` with a deadline, a broadcast a key the
primary sets and the others read with a deadline. A process that dies or never arrives makes the
others raise BarrierTimeoutError within the timeout instead of hanging. Without
``jax.distributed`` (or without JAX loaded) there is one process and both are no-ops.

The manager uses it for multi-process saves (docs/multihost.md).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from cairn.handlers.errors import BarrierTimeoutError

__all__ = ["SINGLE", "Processes"]


@dataclasses.dataclass(frozen=True)
class Processes:
    """This process's index among `count` processes; index 0 is the primary."""

    index: int = 0
    count: int = 1
    client: Any = dataclasses.field(default=None, repr=False, compare=False)

    @classmethod
    def detect(cls) -> Processes:
        """The processes of an initialised ``jax.distributed`` run, else a single process."""
        if "jax" not in sys.modules:
            return cls()
        from jax._src import distributed

        state = distributed.global_state
        if state.client is None or not state.num_processes or state.num_processes <= 1:
            return cls()
        return cls(int(state.process_id), int(state.num_processes), state.client)

    @property
    def primary(self) -> bool:
        return self.index == 0

    def barrier(self, name: str, timeout_s: float) -> None:
        """Wait until every process reaches `name`; BarrierTimeoutError after `timeout_s`."""
        if self.count == 1:
            return
        try:
            self.client.wait_at_barrier(name, _millis(timeout_s))
        except Exception as e:
            raise BarrierTimeoutError(
                f"process {self.index} of {self.count}: not every process reached barrier "
                f"{name!r} within {timeout_s:g} s ({_first_line(e)})"
            ) from e

    def broadcast(self, name: str, value: str | None, timeout_s: float) -> str:
        """The primary's `value` on every process (others pass None); timeout as for barriers."""
        if self.count == 1:
            if value is None:
                raise ValueError(f"broadcast {name!r}: the primary must give a value")
            return value
        if self.primary:
            if value is None:
                raise ValueError(f"broadcast {name!r}: the primary must give a value")
            self._set(name, value)
            return value
        try:
            return str(self.client.blocking_key_value_get(name, _millis(timeout_s)))
        except Exception as e:
            raise BarrierTimeoutError(
                f"process {self.index} of {self.count}: the primary did not publish {name!r} "
                f"within {timeout_s:g} s ({_first_line(e)})"
            ) from e

    def report(self, name: str, value: str) -> None:
        """Publish this process's `value` under `name` (read back with `reports`)."""
        if self.count > 1:
            self._set(f"{name}/{self.index}", value)

    def reports(self, name: str, timeout_s: float) -> list[str]:
        """Every process's `report` under `name`, in process order."""
        if self.count == 1:
            raise ValueError(f"reports {name!r}: a single process has nobody to hear from")
        out = []
        for index in range(self.count):
            try:
                out.append(
                    str(self.client.blocking_key_value_get(f"{name}/{index}", _millis(timeout_s)))
                )
            except Exception as e:
                raise BarrierTimeoutError(
                    f"process {index} did not report {name!r} within {timeout_s:g} s ({_first_line(e)})"
                ) from e
        return out

    def _set(self, name: str, value: str) -> None:
        try:
            self.client.key_value_set(name, value)
        except Exception as e:  # the coordination service is gone (its process died)
            raise BarrierTimeoutError(
                f"process {self.index} of {self.count}: could not publish {name!r} "
                f"({_first_line(e)})"
            ) from e


SINGLE = Processes()


def _millis(timeout_s: float) -> int:
    if not timeout_s > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout_s!r}")
    return max(1, int(timeout_s * 1000))


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
