"""Which process this is, and how processes meet: barriers and broadcasts with timeouts.

Built on JAX's coordination service (the one ``jax.distributed.initialize`` starts), as Orbax's
multihost utilities are: a barrier is ``wait_at_barrier`` with a deadline, a broadcast a key the
primary sets and the others read with a deadline. A process that dies or never arrives makes the
others raise BarrierTimeoutError within the timeout instead of hanging. Without
``jax.distributed`` (or without JAX loaded) there is one process and both are no-ops.

The manager uses it for multi-process saves (docs/multihost.md).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import sys
from collections.abc import Iterator
from typing import Any, Protocol

from cairn.handlers.errors import BarrierTimeoutError

log = logging.getLogger("cairn")

__all__ = ["SINGLE", "Processes"]


class Meetings(Protocol):
    """What `commit_step` needs of the processes it commits with: `Processes` (the trainers,
    through JAX's coordination service) or `_writer.StoredMeetings` (writer processes,
    through the storage)."""

    @property
    def index(self) -> int: ...

    @property
    def count(self) -> int: ...

    @property
    def primary(self) -> bool: ...

    def barrier(self, name: str, timeout_s: float) -> None: ...

    def report(self, name: str, value: str) -> None: ...

    def reports(self, name: str) -> list[str]: ...

    def forget(self, name: str) -> None: ...


_ALONE: contextvars.ContextVar[bool] = contextvars.ContextVar("cairn_alone", default=False)


@contextlib.contextmanager
def alone() -> Iterator[None]:
    """`Processes.detect` finds this process alone (a local tier's manager: each process
    commits its own part into a directory only it sees, meeting nobody)."""
    token = _ALONE.set(True)
    try:
        yield
    finally:
        _ALONE.reset(token)


@dataclasses.dataclass(frozen=True)
class Processes:
    """This process's index among `count` processes, and which of them is the primary (the one
    that changes the directory and commits; process 0 unless chosen otherwise)."""

    index: int = 0
    count: int = 1
    client: Any = dataclasses.field(default=None, repr=False, compare=False)
    primary_index: int = 0

    @classmethod
    def detect(cls, primary: int = 0) -> Processes:
        """The processes of an initialised ``jax.distributed`` run, else a single process;
        ValueError if `primary` is not one of its process indices."""
        count, found = 1, cls()
        if "jax" in sys.modules and not _ALONE.get():
            from jax._src import distributed

            state = distributed.global_state
            if state.client is not None and state.num_processes and state.num_processes > 1:
                count = int(state.num_processes)
                found = cls(int(state.process_id), count, state.client)
        if not 0 <= primary < count:
            raise ValueError(f"primary_process={primary!r}: this run has processes 0..{count - 1}")
        return dataclasses.replace(found, primary_index=primary)

    @property
    def primary(self) -> bool:
        return self.index == self.primary_index

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

    def reports(self, name: str) -> list[str]:
        """Every process's `report` under `name`, in process order, in one request to the
        coordination service; call it after a barrier that follows every report (and `forget`
        them when done)."""
        if self.count == 1:
            raise ValueError(f"reports {name!r}: a single process has nobody to hear from")
        try:
            found = dict(self.client.key_value_dir_get(f"{name}/"))
        except Exception as e:
            raise BarrierTimeoutError(
                f"process {self.index}: could not read the reports {name!r} ({_first_line(e)})"
            ) from e
        missing = [i for i in range(self.count) if f"{name}/{i}" not in found]
        if missing:
            raise BarrierTimeoutError(f"processes {missing} did not report {name!r}")
        return [str(found[f"{name}/{i}"]) for i in range(self.count)]

    def forget(self, name: str) -> None:
        """Delete the key `name` and every key under ``name/`` from the coordination service
        (which keeps every key until then, in process 0's memory)."""
        if self.count > 1:
            try:
                self.client.key_value_delete(name)
            except Exception as e:  # the service is gone; nothing to free
                log.debug("cairn: could not delete %r from the coordination service: %r", name, e)

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
