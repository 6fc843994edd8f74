"""A writer process that commits the saves a trainer hands it (``writer="process"``).

The trainer's `save()` copies the state into staging slabs in shared memory (memfds), pickles the
save job with each slab replaced by its descriptor, and sends both over a Unix socket before it
returns. From then on the step no longer depends on the trainer: the writer process maps the
slabs, runs the same commit sequence as the commit thread (`commit_step`), and answers each job,
in order, with its manifest or its error. When the trainer dies (SIGKILL, OOM, a segfault) its
end of the socket closes; the writer reads the jobs already sent to the end, commits them, and
exits. Nothing polls a pid for that.

The other way round, the trainer's waits for its writer's answers and exit have the bound of
a barrier (the manager's ``barrier_timeout``). While an answer is owed, the trainer looks at
the writer about once a second (``/proc/<pid>/stat`` and ``io``): bytes on the socket, CPU
time spent or I/O done are signs of life, however long the commit; a writer with none for the
bound (stopped by SIGSTOP or a debugger, stuck on a hung filesystem) is killed, and its job
fails with WriterTimeoutError (a WriterProcessError and a BarrierTimeoutError). `close` waits
the same bound for the writer to exit, then kills it.

The writer holds the directory with the trainer: it inherits the lock's descriptor (POSIX), or
shares the lease (object stores), as `Storage.for_writer_process` says, and the storage records
its pid (`Storage.writer_started`), so that a trainer restarted while the old writer still
commits waits for it (`wait_for_orphan`) instead of cleaning up the step being committed. A
writer whose trainer died (a hang-up without the trainer's "close") applies the trainer's
retention after its last commit and lets the lease go. In a multi-process run each process has
its own writer, and the writers meet through the storage (`StoredMeetings`).

Started as ``python -c <_ENTRY> <socket fd>``; a fresh interpreter, not a fork of a
trainer that runs JAX's threads. It imports what unpickling the jobs needs, no more.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import logging
import os
import pickle
import queue
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from cairn.handlers.errors import BarrierTimeoutError, WriterProcessError, WriterTimeoutError
from cairn.handlers.io import Slab
from cairn.manager._format import SYNC_PREFIX, Manifest, check_sync_name
from cairn.manager._storage.orphans import WRITER_MODULE

log = logging.getLogger("cairn")

_HEADER = struct.Struct("!QI")  # payload bytes, descriptors sent with the header
_MAX_FDS = 64  # slabs of one save: one per item at most


class RemoteTraceback(Exception):
    """The writer process's traceback of an error, chained to the error the trainer sees."""

    def __str__(self) -> str:
        return f"\n\nin the writer process:\n{self.args[0]}"


# ---------------------------------------------------------------------------- framing


def _send(sock: socket.socket, payload: bytes, fds: Sequence[int] = ()) -> None:
    header = _HEADER.pack(len(payload), len(fds))
    if fds:
        sent = socket.send_fds(sock, [header], list(fds))
        if sent != len(header):
            sock.sendall(header[sent:])
    else:
        sock.sendall(header)
    sock.sendall(payload)


def _recv_exactly(
    sock: socket.socket, n: int, wait: Callable[[], None] | None = None
) -> bytes | None:
    parts, got = [], 0
    while got < n:
        if wait is not None:
            wait()
        part = sock.recv(min(n - got, 1 << 20))
        if not part:
            return None
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def _recv(
    sock: socket.socket, wait: Callable[[], None] | None = None
) -> tuple[bytes, list[int]] | None:
    """One message and the descriptors that came with it; None at the end of the stream.
    `wait`, if given, is called before each read, to return once the socket has something
    to read (or raise): a peer that stops halfway through a message cannot hold us either."""
    if wait is not None:
        wait()
    data, fds, _, _ = socket.recv_fds(sock, _HEADER.size, _MAX_FDS)
    if not data:
        return None
    if len(data) < _HEADER.size:
        rest = _recv_exactly(sock, _HEADER.size - len(data), wait)
        if rest is None:
            return None
        data += rest
    size, count = _HEADER.unpack(data)
    if count != len(fds):
        for fd in fds:
            os.close(fd)
        raise WriterProcessError(f"a message said {count} descriptors and came with {len(fds)}")
    payload = _recv_exactly(sock, size, wait)
    if payload is None:
        for fd in fds:
            os.close(fd)
        return None
    return payload, fds


class _Pickler(pickle.Pickler):
    """Pickles a save job; a shared slab travels as its memfd, not its bytes."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.fds: list[int] = []

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, Slab) and obj.fd is not None:
            self.fds.append(obj.fd)
            return ("slab", len(self.fds) - 1, obj.nbytes)
        return None


class _Mapped:
    """The writer's mappings of the trainer's slabs, kept while the last `keep` jobs use them.

    The trainer reuses its slabs save after save; mapping one afresh for each job would fault
    its pages into this process's page tables again every time (a quarter million faults per
    GiB). A slab no recent job used is unmapped, so a slab the trainer freed (its state
    shrank) is not kept alive here for long. Threads: the reader thread maps, the main
    thread trims; one lock.
    """

    def __init__(self, keep: int) -> None:
        self._keep = max(1, keep)
        self._lock = threading.Lock()
        self._slabs: dict[tuple[int, int], Slab] = {}
        self._recent: list[set[tuple[int, int]]] = []

    def get(self, fd: int, nbytes: int, used: set[tuple[int, int]]) -> Slab:
        """The slab of memfd `fd` (this call owns the descriptor), mapped once."""
        info = os.fstat(fd)
        key = (info.st_dev, info.st_ino)
        used.add(key)
        with self._lock:
            slab = self._slabs.get(key)
            if slab is not None and slab.nbytes == nbytes:
                os.close(fd)
                return slab
        slab = Slab.attach(fd, nbytes)
        with self._lock:
            self._slabs[key] = slab
        return slab

    def done(self, used: set[tuple[int, int]]) -> None:
        """A job that used `used` is done: unmap what none of the last `keep` jobs used."""
        with self._lock:
            self._recent = [*self._recent, used][-self._keep :]
            wanted = set().union(*self._recent)
            for key in [k for k in self._slabs if k not in wanted]:
                del self._slabs[key]


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, fds: list[int], mapped: _Mapped) -> None:
        super().__init__(file)
        self.fds = fds
        self.mapped = mapped
        self.used: set[tuple[int, int]] = set()

    def persistent_load(self, pid: Any) -> Any:
        kind, index, nbytes = pid
        if kind != "slab":
            raise pickle.UnpicklingError(f"unknown reference {pid!r}")
        fd, self.fds[index] = self.fds[index], -1  # the slab owns it now
        return self.mapped.get(fd, nbytes, self.used)


def pack_job(job: Any) -> tuple[bytes, list[int]]:
    """The bytes and descriptors that hand `job` (a SaveJob) to the writer process; TypeError
    naming the item whose handler or snapshot cannot be sent."""
    sendable = dataclasses.replace(job, budget=None, previous=None, settled=None)
    buffer = io.BytesIO()
    pickler = _Pickler(buffer)
    try:
        pickler.dump(("save", sendable))
    except Exception as e:
        for name, pair in job.snapshots.items():  # which item: each alone
            try:
                _Pickler(io.BytesIO()).dump(pair)
            except Exception as why:
                raise TypeError(
                    f"item {name!r}: writer='process' sends each item's handler and snapshot "
                    f"to the writer process, and {pair[0]!r} or its snapshot cannot be pickled "
                    f"({type(why).__name__}: {why}); use writer='thread' for this run"
                ) from None
        raise TypeError(
            f"writer='process' could not send step {job.step} to the writer process "
            f"({type(e).__name__}: {e})"
        ) from None
    return buffer.getvalue(), pickler.fds


_LOOK_EVERY_S = 1.0  # how often a trainer owed an answer looks at its writer process
_STATES = {  # /proc/<pid>/stat's state letters, for messages
    "R": "running",
    "S": "asleep",
    "D": "waiting on I/O that does not return (a hung filesystem?)",
    "T": "stopped (SIGSTOP or a terminal stop)",
    "t": "stopped by a debugger",
    "Z": "exited",
}


def _vitals(pid: int) -> tuple[str, tuple[int, ...]] | None:
    """Process `pid`'s state letter (`_STATES`) and the counters that move while it works:
    its CPU time (all its threads, in clock ticks) and, where they may be read, its I/O
    counters; None where /proc does not show it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2 :].split()
        state, counters = fields[0].decode("ascii", "replace"), (int(fields[11]), int(fields[12]))
    except (OSError, ValueError, IndexError):
        return None
    try:
        with open(f"/proc/{pid}/io", "rb") as f:
            io_counters = tuple(int(line.split()[1]) for line in f.read().splitlines() if line)
    except (OSError, ValueError, IndexError):
        io_counters = ()
    return state, counters + io_counters


# ---------------------------------------------------------------------------- the trainer's side


class WriterProcess:
    """The trainer's handle on its writer process.

    Concurrency: `send` runs on the trainer's thread (inside ``save()``), `result` on the
    manager's commit thread, which reads the answers in the order the jobs were sent; a lock
    keeps two sends from interleaving. Once the process is gone, `dead` says why, every job
    not yet answered fails with WriterProcessError, and the manager starts a new process at
    its next save. The waits for an answer (`result`: without a sign of life) and for the exit
    (`close`) are bounded by ``spec["barrier_timeout"]``; past it the process is killed.
    """

    def __init__(self, spec: Mapping[str, Any], pass_fds: Sequence[int]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _ENTRY, str(theirs.fileno())],
                pass_fds=(theirs.fileno(), *pass_fds),
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C for the trainer does not stop its commits
                env={**os.environ, "JAX_PLATFORMS": "cpu"},  # never an accelerator of its own
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._sock = ours
        self._send_lock = threading.Lock()
        self.dead: str | None = None
        self.pid = self._proc.pid
        self._bound = float(spec.get("barrier_timeout", 300.0))  # of every wait on it
        _OPEN.add(self)
        _send(self._sock, pickle.dumps(("init", dict(spec))))

    def __repr__(self) -> str:
        return f"WriterProcess(pid={self.pid}, dead={self.dead!r})"

    def send(self, payload: bytes, fds: Sequence[int]) -> None:
        """Hand one packed job over; once this returns, the job is the writer's (its bytes in
        the socket or read, its slabs' descriptors in the writer's hands)."""
        with self._send_lock:
            if self.dead is not None:
                raise WriterProcessError(self.dead)
            try:
                _send(self._sock, payload, fds)
            except OSError as e:
                self._died(f"could not take a save ({e})")
                raise WriterProcessError(self.dead) from None

    def result(self, step: int) -> Manifest | None:
        """The writer's answer to the oldest unanswered job (step `step`): its manifest (None
        from a process that is not the primary of a multi-process run), or its error raised
        here with the writer's traceback chained. Bounded by the barrier timeout without a sign
        of life (`_await_bytes`): WriterTimeoutError. An "alive" message is no answer (the
        writer waits at a meeting with the other processes' writers, as long as that bound)."""
        if self.dead is not None:
            raise WriterProcessError(f"{self.dead}; step {step} was not committed")
        while True:
            why = None
            try:
                message = _recv(self._sock, lambda: self._await_bytes(step))
            except WriterTimeoutError:  # a TimeoutError, so an OSError: not the socket's failure
                raise
            except OSError as e:
                message, why = None, f"its socket failed ({e})"
            if message is None:
                self._died(why)
                raise WriterProcessError(f"{self.dead}; step {step} was not committed")
            answer = pickle.loads(message[0])
            if answer[0] != "alive":  # else it waits at a meeting (`StoredMeetings`): go on
                break
        if answer[0] == "committed":
            if answer[1] != step:  # out of step with the jobs: no later answer can be trusted
                self._proc.kill()
                self._died(f"answered for step {answer[1]} when step {step} was due")
                raise WriterProcessError(f"{self.dead}; step {step} was not committed")
            manifest: Manifest | None = answer[2]
            return manifest
        _, _, error, text = answer
        error.__cause__ = RemoteTraceback(text)
        raise error

    def _await_bytes(self, step: int) -> None:
        """Commit thread, owed the answer for step `step`: return once the socket has something
        to read (bytes, the end, an error). Meanwhile look at the writer every second or so: any
        byte that arrives (each call starts the clock again), CPU time spent by any of its
        threads, or I/O counted for it is a sign of life; a long commit shows them all along,
        and a wait at a meeting says so once a second. With none for the bound (the barrier
        timeout) it is stopped (SIGSTOP, a debugger) or stuck (a hung filesystem): kill it,
        raise WriterTimeoutError."""
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        look = min(_LOOK_EVERY_S, self._bound / 10)
        seen = _vitals(self.pid)
        last = time.monotonic()
        while not poller.poll(look * 1e3):
            now, vitals = time.monotonic(), _vitals(self.pid)
            stopped = vitals is None or vitals[0] in "Tt"
            if not stopped and seen is not None and vitals is not None and vitals[1] != seen[1]:
                last = now
            seen = vitals
            if now - last >= self._bound:
                self._stalled(step, vitals)

    def _stalled(self, step: int, vitals: tuple[str, tuple[int, ...]] | None) -> NoReturn:
        """The writer showed no sign of life for the bound while step `step` was due: kill it
        (SIGKILL ends a stopped process too), so that its descriptors, its copy of the lock and
        its share of the lease go; the step is not committed. Raise WriterTimeoutError."""
        state = "?" if vitals is None else vitals[0]
        message = (
            f"the writer process (pid {self.pid}) showed no sign of life for {self._bound:g} s "
            f"(barrier_timeout) while step {step} was due from it: no answer, no CPU time, no "
            f"I/O; it is {_STATES.get(state, f'in state {state!r}')}. It was killed (SIGKILL) so "
            f"that it lets the directory go; step {step} was not committed (what it wrote is "
            "removed when the directory is next opened), and the next save starts a new writer "
            "process. If something stopped the writer (SIGSTOP, a debugger) or its filesystem "
            "hangs, see to that; if its commits can legitimately pause longer, raise "
            "barrier_timeout"
        )
        log.error("cairn: %s", message)
        self._proc.kill()
        try:
            self._proc.wait(timeout=min(5.0, self._bound))
            how = "was killed"
        except subprocess.TimeoutExpired:  # stuck in the kernel: it ends when its I/O does
            how = "was sent SIGKILL"
        self.dead = (
            f"the writer process (pid {self.pid}) {how} after no sign of life for "
            f"{self._bound:g} s (barrier_timeout)"
        )
        raise WriterTimeoutError(message)

    def _died(self, why: str | None) -> None:
        """Record that the process is gone, with its exit status when it has one."""
        if self.dead is not None:
            return
        try:
            code = self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            how = "closed its socket"
        elif code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with status {code}"
        self.dead = f"the writer process (pid {self.pid}) {how}" + (f" ({why})" if why else "")
        log.error("cairn: %s", self.dead)

    def close(self, timeout: float | None = None) -> None:
        """Tell the writer no more jobs come (it answers the ones sent, then exits) and wait
        for it to exit, up to `timeout` seconds (None: the barrier timeout, the bound of every
        wait on it); then kill it (SIGKILL ends a stopped process too), which lets its hold on
        the directory go."""
        if self._sock.fileno() < 0:
            return
        bound = self._bound if timeout is None else timeout
        with contextlib.suppress(OSError), self._send_lock:
            _send(self._sock, pickle.dumps(("close",)))  # a hang-up without it: the trainer died
            self._sock.shutdown(socket.SHUT_WR)
        if self._proc.poll() is None:
            log.info(
                "cairn: closing the writer process (pid %d); waiting up to %g s for it to exit",
                self.pid,
                bound,
            )
        try:
            self._proc.wait(timeout=bound)
        except subprocess.TimeoutExpired:
            vitals = _vitals(self.pid)
            log.error(
                "cairn: the writer process (pid %d) did not exit within %g s of close "
                "(barrier_timeout; it is %s); killing it (SIGKILL)",
                self.pid,
                bound,
                _STATES.get(vitals[0], "in state " + vitals[0]) if vitals else "gone",
            )
            self._proc.kill()
            try:
                self._proc.wait(timeout=bound)
            except subprocess.TimeoutExpired:
                log.error(
                    "cairn: the writer process (pid %d) still runs %g s after SIGKILL (stuck "
                    "in the kernel: a hung filesystem?); leaving it",
                    self.pid,
                    bound,
                )
        self._sock.close()
        self.dead = self.dead or "the writer process was closed"


_OPEN: weakref.WeakSet[WriterProcess] = weakref.WeakSet()


def _forget_in_child() -> None:
    """A child forked from the trainer (a data loader worker, say) closes its copies of the
    sockets: the writer sees the hang-up when the trainer ends, not when the last fork does."""
    for writer in list(_OPEN):
        writer.dead = "this is a forked child of the trainer that started the writer process"
        writer._sock.close()


os.register_at_fork(after_in_child=_forget_in_child)


class StoredMeetings:
    """How the writer processes of a multi-process run meet in `commit_step`, in place of the
    trainers' `Processes` (a writer cannot join the trainers' coordination service, and must
    meet the others when every trainer is gone): through small files in the checkpoint
    directory (`Storage.create_root_file`), ``.cairn-sync-<temporary name>.<meeting>.<index>``.

    `commit_step` meets twice, and each meeting waits one way only:
    - a barrier with no report before it (the step is claimed): the primary posts a marker,
      the others wait for it before they write;
    - reports, then a barrier (the writes are done): each process posts its report, the
      primary waits for them all; the others go on at once, as nothing after it is theirs.
    So nobody waits for a file the primary may have removed already: `forget` (the primary's,
    after the commit or its failure) removes every file of the step. A crash leaves some, which
    the next writer's `clean_leftovers` removes. Waits poll the storage (there is nothing to
    be notified by), from 5 ms to 200 ms apart, until the barrier timeout; meanwhile `alive`
    tells the trainer about once a second that its writer waits (a sign of life: see
    `WriterProcess.result`), so that the trainer's bound on its writer's silence never ends a
    wait that has a bound of its own.
    """

    def __init__(
        self,
        storage: Any,
        index: int,
        count: int,
        primary_index: int,
        alive: Callable[[], None] | None = None,
    ) -> None:
        self.storage, self.index, self.count = storage, index, count
        self.primary_index = primary_index
        self._alive = alive
        self._reported: set[str] = set()
        self._files: set[str] = set()

    @property
    def primary(self) -> bool:
        return self.index == self.primary_index

    def _file(self, name: str, index: int) -> str:
        meeting = name.removeprefix("cairn/").replace("/", ".")
        file = check_sync_name(f"{SYNC_PREFIX}{meeting}.{index}")
        self._files.add(file)
        return file

    def _post(self, name: str, body: str) -> None:
        if not self.storage.create_root_file(self._file(name, self.index), body.encode()):
            raise BarrierTimeoutError(f"process {self.index}: {name!r} was posted already")

    def _wait(self, name: str, indices: Sequence[int], timeout_s: float) -> list[bytes]:
        files = [self._file(name, i) for i in indices]
        found: dict[str, bytes] = {}
        deadline, pause = time.monotonic() + timeout_s, 0.005
        said = 0.0  # when `alive` was last called
        while True:
            if self._alive is not None and time.monotonic() - said >= _LOOK_EVERY_S:
                self._alive()
                said = time.monotonic()
            for file in files:
                if file not in found:
                    data = self.storage.read_root_file(file)
                    if data is not None:
                        found[file] = data
            if len(found) == len(files):
                return [found[f] for f in files]
            if time.monotonic() > deadline:
                missing = [i for i, f in zip(indices, files, strict=True) if f not in found]
                raise BarrierTimeoutError(
                    f"writer process of process {self.index} of {self.count}: processes "
                    f"{missing} did not reach {name!r} within {timeout_s:g} s"
                )
            time.sleep(pause)  # polling the storage: it has no notifications
            pause = min(pause * 2, 0.2)

    def barrier(self, name: str, timeout_s: float) -> None:
        if name in self._reported:  # reports, then a barrier: the primary gathers them
            if self.primary:
                self._wait(name, range(self.count), timeout_s)
        elif self.primary:  # a barrier alone: the primary announces
            self._post(name, "")
        else:
            self._wait(name, [self.primary_index], timeout_s)

    def report(self, name: str, value: str) -> None:
        self._reported.add(name)
        self._post(name, value)

    def reports(self, name: str) -> list[str]:
        return [r.decode() for r in self._wait(name, range(self.count), 0.0)]

    def forget(self, name: str) -> None:
        """Remove every file of this step's meetings (the primary, once it has them all)."""
        del name
        if self.primary:
            for index in range(self.count):  # every report, awaited or not (a failure)
                for meeting in self._reported:
                    self._file(meeting, index)
            self.storage.remove_sync_files(sorted(self._files))

    def broadcast(self, name: str, value: str | None, timeout_s: float) -> str:
        raise NotImplementedError("writer processes never broadcast")


# ---------------------------------------------------------------------------- the writer's side


def _answer(sock: socket.socket, answer: tuple[Any, ...]) -> None:
    """Send an answer; the trainer may be gone, which changes nothing here."""
    with contextlib.suppress(OSError):
        _send(sock, pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL))


def _failure(step: int, error: BaseException) -> tuple[Any, ...]:
    text = "".join(traceback.format_exception(error))
    try:
        sent = pickle.loads(pickle.dumps(error))
    except Exception:
        sent = WriterProcessError(f"{type(error).__name__}: {error}")
    return ("failed", step, sent, text)


def _lower_session_priority() -> None:
    """With autogroup scheduling (Linux's default on desktops and many servers), the CPU is
    shared between sessions first, and nice values count only within a session: the writer,
    in a session of its own, would get as much CPU as the whole trainer whatever its threads'
    nice. So its session gets the background nice (`/proc/self/autogroup`); where autogroup
    is off, its threads' nice does the same (`lower_thread_priority`)."""
    from cairn.handlers.io import BACKGROUND_NICE

    with contextlib.suppress(OSError), open("/proc/self/autogroup", "w") as f:
        f.write(str(BACKGROUND_NICE))


_ENTRY = f"import sys; from {WRITER_MODULE} import main; sys.exit(main(int(sys.argv[1])))"


def main(sock_fd: int) -> int:
    """The writer process: commit each job the trainer sends, in order, until it hangs up."""
    from cairn.handlers.io import WriteBudget, lower_thread_priority
    from cairn.manager._core.commit import commit_step
    from cairn.manager._core.multihost import SINGLE, Meetings
    from cairn.manager._format import StepNames
    from cairn.manager._storage.open import open_storage

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer's Ctrl-C is not ours
    _lower_session_priority()
    lower_thread_priority()
    sock = socket.socket(fileno=sock_fd)
    first = _recv(sock)
    if first is None:
        return 0
    kind, spec = pickle.loads(first[0])
    assert kind == "init", kind
    storage = open_storage(spec["directory"], spec.get("storage_options"))
    storage.join_writer_process(spec)
    names = StepNames(spec["step_prefix"], spec["step_digits"])
    rate = spec.get("max_write_bytes_per_s")
    budget = WriteBudget(rate) if rate is not None else None
    jobs: queue.Queue[Any] = queue.Queue()
    mapped = _Mapped(spec.get("max_pending", 1) + 1)

    def read() -> None:  # every job sent is taken at once, so a send never waits for a commit
        while True:
            try:
                message = _recv(sock)
            except OSError:
                message = None
            if message is None:  # the trainer closed or died: finish what it sent, then exit
                jobs.put(None)
                return
            payload, fds = message
            try:
                unpickler = _Unpickler(io.BytesIO(payload), fds, mapped)
                loaded = unpickler.load()
                jobs.put(loaded if loaded[0] == "close" else (*loaded, unpickler.used))
            except Exception as e:
                jobs.put(("broken", e))
            finally:
                for fd in fds:
                    if fd >= 0:
                        os.close(fd)

    threading.Thread(target=read, name="cairn-writer-read", daemon=True).start()
    closed = False  # by the trainer; else it died, and the directory is ours to let go
    committed = False  # a step, since this writer started
    while True:
        message = jobs.get()
        if message is None:
            break
        if message[0] == "close":
            closed = True
            continue
        if message[0] == "broken":
            log.error("cairn: the writer process could not read a save: %s", message[1])
            _answer(sock, _failure(-1, message[1]))
            continue
        job = message[1]
        job.budget = budget
        try:
            procs: Meetings = SINGLE
            if spec.get("process_count", 1) > 1:
                procs = StoredMeetings(
                    storage,
                    spec["process_index"],
                    spec["process_count"],
                    spec["primary_index"],
                    alive=functools.partial(_answer, sock, ("alive",)),
                )
            manifest = commit_step(storage, names, job, procs, timeout_s=spec["barrier_timeout"])
        except BaseException as e:
            log.error("cairn: the writer process failed to commit step %d: %s", job.step, e)
            _answer(sock, _failure(job.step, e))
        else:
            committed = True
            _answer(sock, ("committed", job.step, manifest))
        mapped.done(message[2])
        del job, message
    if not closed:  # the trainer died
        if committed and spec.get("process_index", 0) == spec.get("primary_index", 0):
            _retention_after_trainer(storage, names, spec.get("retention"))
        with contextlib.suppress(Exception):  # an object store's lease: no wait for its expiry
            storage.release()
    storage.close()
    return 0


def _retention_after_trainer(storage: Any, names: Any, packed: bytes | None) -> None:
    """The trainer died: apply its retention to the steps this writer committed for it, as its
    commit thread would have after each answer (it may have died before)."""
    from cairn.manager._core.catalog import Catalog, read_record
    from cairn.manager._core.retention import Retention

    try:
        if packed is None:
            raise ValueError("the trainer could not send its policies")
        keep, keep_items = pickle.loads(packed)
    except Exception as e:  # a policy class the writer cannot import, say
        log.warning(
            "cairn: the writer process cannot apply the trainer's retention (%s); the next "
            "writable manager's first save will",
            e,
        )
        return
    catalog = Catalog()
    catalog.replace({listed.step: read_record(listed) for listed in storage.scan(names)})

    try:
        Retention(storage, names, catalog, keep, keep_items, reclaim=lambda work: work()).apply()
    except Exception as e:
        log.error("cairn: the writer process's retention after the trainer died failed: %s", e)
