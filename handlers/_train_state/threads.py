"""The process's shared thread pools (copies into the staging pool, chunk reads), and `_Tickets`,
which bound the memory that casts in flight take."""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Iterator

_POOLS: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _shared_pool(name: str, workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """The process's pool of `workers` threads named `name`, made on first use (copies into the
    staging pool in save(), chunk reads in restore)."""
    with _POOLS_LOCK:
        if name not in _POOLS:
            _POOLS[name] = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=name)
        return _POOLS[name]


class _Tickets:
    """A count of megabytes that casts in flight may take (`max_inflight_bytes`); a writer takes
    all it needs at once or waits, so two writers never each hold part and wait for the rest.

    Threads: `taking` may be entered from any number of threads at once."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._free = total
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def taking(self, n: int) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: self._free >= n)
            self._free -= n
        try:
            yield
        finally:
            with self._cond:
                self._free += n
                self._cond.notify_all()
