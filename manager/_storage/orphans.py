"""Processes a directory's lock or lease names: whether they live, and waiting for a writer
process that outlived its trainer. The storages call this before taking over a directory; the
writer process (`cairn.manager._core.writer`) is started under `WRITER_MODULE`'s name."""

from __future__ import annotations

import logging
import os
import select

log = logging.getLogger("cairn")

WRITER_MODULE = "cairn.manager._core.writer"  # in the writer process's command line
WRITER_WAIT_S = 600.0  # how long a new trainer waits for an orphaned writer process to finish
_PID_MAX = 1 << 22  # Linux's largest pid_max


def pid_alive(pid: int) -> bool | None:
    """Whether process `pid` runs on this host; None when it runs as another user (it may
    not be signalled, so it is not ours to wait for). A pid no process can have (read from a
    crafted lock or lease) is not running."""
    if not 0 < pid <= _PID_MAX:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return None
    return True


def runs_writer(pid: int) -> bool:
    """Whether process `pid` runs cairn's writer (`WRITER_MODULE`), as far as /proc tells; True where
    it cannot tell. A lease or lock file is read from the directory: it may name any live pid
    (pid 1, say), which a new trainer would otherwise wait for in vain."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return WRITER_MODULE.encode() in f.read()
    except FileNotFoundError:
        return False  # gone meanwhile
    except OSError:
        return True


def wait_for_orphan(trainer: int, writer: int, timeout: float) -> bool:
    """If `trainer` (a pid on this host) is gone and `writer`, the writer process it started,
    may still be committing what it was handed, wait up to `timeout` seconds for the writer to
    exit (on a pidfd: no polling); whether there was such a writer to wait for. A storage that
    records both pids (the lock file, the lease) calls this before taking over from a trainer
    that ended, so that it does not clean up the step being committed."""
    if pid_alive(trainer) is not False:  # the trainer lives: it holds the directory
        return False
    if not pid_alive(writer) or not runs_writer(writer):
        return True
    try:
        pidfd = os.pidfd_open(writer)
    except OSError:  # gone already
        return True
    try:
        log.warning(
            "cairn: the writer process (pid %d) of a trainer that ended (pid %d) is finishing "
            "its commits; waiting for it",
            writer,
            trainer,
        )
        select.select([pidfd], [], [], timeout)
    finally:
        os.close(pidfd)
    return True
