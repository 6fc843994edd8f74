"""What a background save costs the training loop: the breakdown, cairn against Orbax.

For each size (256M and 1G by default; a process per size) on the T5X-like train state of
bench_train_state.py (172 jax CPU arrays), in one run:

* limits for the same bytes: a memcpy of every leaf into a pre-faulted, page-aligned buffer, by
  one thread and by one thread per core; one file written from that buffer with ``O_DIRECT`` and
  fsynced; the same file written through the page cache and fsynced, then read back from the
  page cache into the buffer (one thread per core). The copy on every core bounds ``save()``
  blocked from below, the read bounds a restore: their ratios to Orbax's figures of the same
  round say whether a target is within the machine's reach at all.
* commit and restore, no training: per round, each system saves (``save()`` blocked, save start to
  committed) and restores into ``ShapeDtypeStruct`` targets; ratios are paired within a round.
* memory: per system, in a phase of its own, the RSS beyond the live state after three saves have
  committed (glibc's free memory returned first): what the system holds between saves.
* training under a save, on two jitted train steps that donate their state, as T5X's does: the
  ``decoder`` step of bench_train_state.py (compute-bound: a causal decoder pass and Adam) and an
  ``elementwise`` step that reads and writes every leaf once (memory-bound, as host work is).
  Per save: a baseline window with no save, then a window from ``save()`` until the first step
  that ends after the commit (and, for cairn, the removal of the retired step). Recorded:
  ``save()`` blocked; the first step's extra time over the baseline median; the extra time of
  the other steps of the window; the extra time of the loop's own code between steps; the
  training time lost (window minus steps x the baseline's time per step; the four parts add up
  to it);
  the process CPU seconds beyond what the same steps cost in the baseline; the CPU seconds of
  cairn's own threads (``cairn-*``); minor page faults beyond the baseline's per step; and
  whether each step's donation happened. The windows also run a ``plain-writer``: the state's
  bytes written with ``O_DIRECT`` by 4 threads at nice 19, nothing else, the floor for what
  any commit that writes beside training costs the steps.

Systems: ``cairn`` (the staging pool, the default), ``cairn-views`` (``zero_copy=True``, when
the cairn under test has it) and ``orbax`` (orbax-checkpoint's async CheckpointManager); on
request (``--systems``) ``cairn-incremental``, ``cairn-packed`` and ``cairn-zarr``
(``TrainStateHandler(layout=...)``; ``cairn`` is the default layout of the cairn under test:
zarr before commit 3dd0082, packed since), ``cairn-process`` (``writer="process"``, whose writer's CPU is not among
cairn's threads: it shows in the training time lost) and ``cairn-orbax`` (Orbax's own calls,
``ocp.args.StandardSave`` in a ``Composite``, on ``cairn.manager.orbax.CheckpointManager``: the
one-line swap). Run it
on another cairn with ``PYTHONPATH`` pointing at a tree whose ``cairn/manager`` and
``cairn/handlers`` are that version's folders, and ``--label`` to name it (the "before" figures
in docs/benchmarks.md). Results: bench/results/overhead[-LABEL].json, rich tables, and with
``--plot`` docs/benchmarks_overhead.png.

    .venv/bin/python bench/bench_overhead.py                 # 256M and 1G, ~12 min here
    .venv/bin/python bench/bench_overhead.py --quick         # smoke run: 16M
    .venv/bin/python bench/bench_overhead.py --markdown      # the JSON as Markdown tables
    .venv/bin/python bench/bench_overhead.py --across a,b    # the targets over runs a and b
    .venv/bin/python bench/bench_overhead.py --plot          # redraw the PNG
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import mmap
import os
import resource
import shutil
import statistics
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_train_state as bts
import numpy as np
from _common import (  # sets the environment jax reads at import: before jax
    REPO,
    RESULTS,
    SCRATCH,
    MiB,
    RssSampler,
    check_equal,
    load_average,
    machine_facts,
    now,
    parse_size,
    quiet_logs,
    run_in_child,
    spread,
)

X, D = "\u00d7", "\u2013"  # for the tables
DEFAULT_PNG = REPO / "docs" / "benchmarks_overhead.png"
WRITER_PNG = REPO / "docs" / "benchmarks_writer.png"  # --label process, with cairn-process
PACKED_PNG = REPO / "docs" / "benchmarks_packed.png"  # --label packed, with cairn-packed
BACKGROUND_PNG = REPO / "docs" / "benchmarks_background.png"  # --label background: nice 19
OVERLAP_PNG = REPO / "docs" / "benchmarks_overlap.png"  # --label overlap, against the two before
SYSTEMS = (
    "cairn",
    "cairn-views",
    "orbax",
    "cairn-incremental",
    "cairn-process",
    "cairn-packed",
    "cairn-zarr",
    "cairn-orbax",
)  # last five on request
DEFAULT_SYSTEMS = "cairn,cairn-views,orbax"
FLOOR_WRITER = "plain-writer"  # in the training windows only: see PlainWriter
STEPS = ("decoder", "elementwise")
_CLK = os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------------------- limits


def limits(leaves: list[np.ndarray], path: Path) -> dict[str, float]:
    """memcpy into a pre-faulted buffer (one thread; one per core); O_DIRECT write + fsync;
    buffered write + fsync; that file read back from the page cache."""
    total = sum(a.nbytes for a in leaves)
    size = -(-total // 4096) * 4096
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = np.frombuffer(region, np.uint8)
    flat[::4096] = 1  # every page faulted in: memcpy is measured, not page faults
    out: dict[str, float] = {}
    t0 = now()
    at = 0
    pieces = []  # (into, from) of at most 8 MiB, for the copy on every core
    for a in leaves:
        np.copyto(flat[at : at + a.nbytes].view(a.dtype).reshape(a.shape), a)
        src = a.reshape(-1).view(np.uint8)
        pieces += [
            (flat[at + i : at + min(i + _PIECE, a.nbytes)], src[i : i + _PIECE])
            for i in range(0, a.nbytes, _PIECE)
        ]
        at += a.nbytes
    out["memcpy"] = now() - t0
    view = memoryview(region)
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(lambda n: n, range(64)))  # the threads started before any clock
        # The same bytes copied by one thread per core (np.copyto lets go of the GIL), pieces
        # in slab order: the fastest copy this machine makes, a floor for save() blocked.
        t0 = now()
        list(pool.map(lambda p: np.copyto(*p), pieces))
        out["memcpy_all_cores"] = now() - t0
        del pieces
        for name, flags in (("odirect", os.O_DIRECT), ("write_fsync", 0)):
            t0 = now()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o644)
            try:
                done = 0
                while done < size:
                    done += os.write(fd, view[done : done + _PIECE])
                os.fsync(fd)
            finally:
                os.close(fd)
            out[name] = now() - t0
        # The buffered file, still in the page cache, read back into the pre-faulted buffer by
        # one thread per core: the floor for a restore of files in the page cache, had it no
        # memory to fault in (which costs this VM from 0.14 to 1.3 s per GiB), nothing to hash
        # and no arrays to make.
        out["read_cached"] = read_back(pool, path, view)
        path.unlink()
    del flat, view
    region.close()
    return out


_PIECE = 8 << 20  # of the limits' copies, writes and reads


def read_back(pool: concurrent.futures.Executor, path: Path, into: memoryview) -> float:
    """Seconds to read `path` into `into`, `_PIECE` at a time on `pool`."""
    t0 = now()
    fd = os.open(path, os.O_RDONLY)
    try:
        list(
            pool.map(
                lambda at: os.preadv(fd, [into[at : at + _PIECE]], at),
                range(0, into.nbytes, _PIECE),
            )
        )
    finally:
        os.close(fd)
    return now() - t0


# ----------------------------------------------------------------------------- the systems


class Cairn(bts.CairnRunner):
    def __init__(self, directory: Path, abstract: Any, *, name: str = "cairn") -> None:
        from cairn.handlers import TrainStateHandler
        from cairn.manager import CheckpointManager, KeepLatest

        self.name = name
        self.abstract = abstract
        extra = {
            "cairn": {},
            "cairn-views": {"zero_copy": True},
            "cairn-incremental": {"incremental": True},
            "cairn-process": {"writer": "process"},
            "cairn-packed": {"handlers": {"state": TrainStateHandler(layout="packed")}},
            "cairn-zarr": {"handlers": {"state": TrainStateHandler(layout="zarr")}},
        }[name]
        self.mgr = CheckpointManager(directory, keep=KeepLatest(1), **extra)


class PlainWriter:
    """The floor for what a commit's writes cost the train steps beside them: no cairn, no
    hash, no manifest; the state's bytes (from a pre-faulted buffer, as cairn's staging pool)
    written with ``O_DIRECT`` as 64 MiB files by 4 threads at nice 19 and fsynced, as cairn's
    packs are. Run in the training windows only, beside the systems."""

    name = FLOOR_WRITER

    def __init__(self, directory: Path, nbytes: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.root = directory
        self._size = max(4096, -(-nbytes // 4096) * 4096)
        self._region = mmap.mmap(-1, self._size)
        np.frombuffer(self._region, np.uint8)[:] = 7  # faulted in, and not zero pages
        self._done = threading.Event()

    def save(self, step: int, tree: Any) -> None:
        del step, tree
        self._done.clear()
        files = [(at, min(self._size, at + (64 << 20))) for at in range(0, self._size, 64 << 20)]
        left = [len(files)]
        lock = threading.Lock()

        def write() -> None:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            view = memoryview(self._region)
            while True:
                with lock:
                    if not files:
                        return
                    start, end = files.pop(0)
                fd = os.open(
                    self.root / f"{start}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT
                )
                try:
                    at = start
                    while at < end:
                        at += os.write(fd, view[at : min(end, at + (32 << 20))])
                    os.fsync(fd)
                finally:
                    os.close(fd)
                with lock:
                    left[0] -= 1
                    if not left[0]:
                        self._done.set()

        for k in range(4):
            threading.Thread(target=write, name=f"plain-write_{k}", daemon=True).start()

    def wait(self) -> None:
        self._done.wait()

    def wait_reclaimed(self) -> None:
        pass

    def close(self) -> None:
        self._region.close()


def has_zero_copy() -> bool:
    import inspect

    from cairn.manager import CheckpointManager

    return "zero_copy" in inspect.signature(CheckpointManager).parameters


def make_runner(name: str, directory: Path, abstract: Any) -> Any:
    if name in ("orbax", "cairn-orbax"):  # Orbax's calls, on Orbax or on the one-line swap
        runner: Any = bts.OrbaxRunner(directory, abstract, swap=name == "cairn-orbax")
    else:
        runner = Cairn(directory, abstract, name=name)
    runner.root = directory
    return runner


def page_cache(directory: Path, *, drop: bool) -> None:
    """Every file under `directory` out of the page cache (``POSIX_FADV_DONTNEED``: a cold
    restore, without dropping the whole machine's caches) or read once into it (a warm one)."""
    for path in directory.rglob("*"):
        if not path.is_file() or path.is_symlink():
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            if drop:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            else:
                while os.read(fd, 8 << 20):
                    pass
        finally:
            os.close(fd)


# ----------------------------------------------------------------------------- accounting


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class ThreadCpu:
    """Samples cairn-* threads' CPU every 5 ms during a window, keeping each thread's last
    reading, so threads that end inside the window (write pools) are counted too."""

    def __init__(self) -> None:
        self._seen: dict[str, float] = {}
        self._stop = threading.Event()
        self._base = self._read()
        self._thread = threading.Thread(target=self._run, name="bench-cpu", daemon=True)
        self._thread.start()

    def _read(self) -> dict[str, float]:
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            comm = stat[stat.index(b"(") + 1 : stat.rindex(b")")]
            if comm.startswith(b"cairn"):
                fields = stat[stat.rindex(b")") + 2 :].split()
                out[tid] = (int(fields[11]) + int(fields[12])) / _CLK
        return out

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self._seen.update(self._read())

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        self._seen.update(self._read())
        return sum(v - self._base.get(tid, 0.0) for tid, v in self._seen.items())


# ----------------------------------------------------------------------------- train steps


def make_elementwise_step() -> Callable[[Any, Any], Any]:
    """Reads and writes every leaf once (memory-bound), donating the state."""
    import jax
    import jax.numpy as jnp

    def update(x: Any) -> Any:
        if jnp.issubdtype(x.dtype, jnp.floating):
            return x * 0.999 + 1e-3
        return x + 1

    def step(state: Any, seq: Any) -> Any:
        del seq
        return jax.tree.map(update, state), jnp.float32(0)

    return jax.jit(step, donate_argnums=0)


def trainer_for(kind: str, label: str, state: list[Any], tokens: int) -> bts.Trainer:
    trainer = bts.Trainer(label, state, tokens)
    if kind == "elementwise":
        trainer.step_fn = make_elementwise_step()
    return trainer


def baseline(trainer: bts.Trainer, seconds: float) -> dict[str, float]:
    """Per step without a save: the median step time, the mean time between steps (the
    loop's own Python), CPU seconds and page faults."""
    c0, f0, t0 = cpu_s(), faults(), now()
    times, _ = trainer.run_for(seconds)
    wall = now() - t0
    steps = len(times)
    return {
        "step_s": statistics.median(times),
        "gap_s": (wall - sum(times)) / steps,
        "cpu_per_step": (cpu_s() - c0) / steps,
        "faults_per_step": (faults() - f0) / steps,
    }


def save_window(
    trainer: bts.Trainer, runner: Any, step: int, base: dict[str, float], n_leaves: int
) -> dict[str, float]:
    done = threading.Event()
    box: dict[str, Any] = {}

    def watch() -> None:
        try:
            runner.wait()
            box["committed_at"] = now()
            runner.wait_reclaimed()
        except BaseException as e:
            box["error"] = e
        done.set()

    threads = ThreadCpu()
    c0, f0 = cpu_s(), faults()
    t0 = now()
    runner.save(step, trainer.state)
    blocked = now() - t0
    watcher = threading.Thread(target=watch, name="bench-watch", daemon=True)
    watcher.start()
    times, donated = [], []
    while True:
        dt, d = trainer.step()
        times.append(dt)
        donated.append(d)
        if done.is_set():
            break
    end = now()
    watcher.join()
    cairn_cpu = threads.stop()
    if "error" in box:
        raise RuntimeError(f"{runner.name}: the save under training failed") from box["error"]
    med, gap, n = base["step_s"], base["gap_s"], len(times)
    return {
        "blocked_s": blocked,
        "first_step_extra_s": times[0] - med,
        "later_steps_extra_s": sum(t - med for t in times[1:]),
        # the loop's Python between steps, slowed by the saver's threads (the GIL, the cores)
        "between_steps_extra_s": (end - t0 - blocked - sum(times)) - n * gap,
        "lost_s": (end - t0) - n * (med + gap),
        "commit_s": box["committed_at"] - t0,
        "window_steps": n,
        "extra_cpu_s": (cpu_s() - c0) - n * base["cpu_per_step"],
        "cairn_threads_cpu_s": cairn_cpu,
        "extra_faults": (faults() - f0) - n * base["faults_per_step"],
        "declined_steps": sum(1 for x in donated if x < n_leaves),
        "first_step_donated": float(donated[0] == n_leaves),
    }


def rotated_windows(
    trainer: bts.Trainer,
    runners: dict[str, Any],
    names: list[str],
    reps: int,
    baseline_s: float,
    step: int,
    n_leaves: int,
    done: Callable[[int], None] = lambda rep: None,
) -> dict[str, list[dict[str, float]]]:
    """`reps` save windows of each runner in `names`, each after a baseline of `baseline_s`
    seconds, the order rotated at every repetition; steps numbered from `step`."""
    out: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for rep in range(reps):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            base = baseline(trainer, baseline_s)
            win = save_window(trainer, runners[name], step, base, n_leaves)
            win["baseline_step_s"] = base["step_s"]
            out[name].append(win)
            step += 1
        done(rep)
    return out


# ----------------------------------------------------------------------------- one size


def clean() -> None:
    bts.clean_memory()


def run_size(
    label: str,
    systems: list[str],
    repeats: int,
    reps: int,
    baseline_s: float,
    tokens: int,
    log: Any,
) -> dict[str, Any]:
    import jax

    quiet_logs()
    import orbax.checkpoint  # noqa: F401  (import time kept out of the measurements)

    # and cairn's modules out of "memory held between saves"
    import cairn.handlers
    import cairn.manager  # noqa: F401

    quiet_logs()
    sampler = RssSampler(0.01)
    t_start = now()
    tree = bts.build_state(label)
    leaves = jax.tree.leaves(tree)
    info = bts.describe_state(label, leaves)
    nbytes, n_leaves = info["bytes"], info["leaves"]
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
    )
    scratch = SCRATCH / f"overhead-{label}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    log(f"[{label}] {n_leaves} leaves, {nbytes / MiB:.0f} MiB")
    rounds: dict[str, list[float]] = {}

    def note(key: str, value: float) -> None:
        rounds.setdefault(key, []).append(value)

    # Memory held between saves, each system alone (its pool, its caches), measured on a second
    # manager: the first of a process also holds what any first use costs (imports, thread
    # arenas: about 1.3 MiB for cairn, with or without a pool), which is not the steady state.
    for name in systems if reps else []:  # --reps 0: commit, restore and the limits only
        for attempt in ("warm-up", "measured"):
            clean()
            before = sampler.rss()
            runner = make_runner(name, scratch / f"mem-{name}-{attempt}", abstract)
            for step in range(3):
                runner.save(step, tree)
                runner.wait()
                runner.wait_reclaimed()
            clean()
            if attempt == "measured":
                note(f"{name}.mem_held", (sampler.rss() - before) / nbytes)
            runner.close()
            del runner
    # Commit, restore and the limits, rounds rotated.
    runners = {name: make_runner(name, scratch / name, abstract) for name in systems}
    views = [np.asarray(x) for x in leaves]
    order: list[str] = ["limits", *systems]
    for rnd in range(repeats + 1):
        k = rnd % len(order)
        for name in order[k:] + order[:k]:
            clean()
            if name == "limits":
                values = limits(views, scratch / "plain.bin")
            else:
                runner = runners[name]
                values = bts.timed_save(runner, 100 + rnd, tree)
                for key, drop in (("restore", False), ("restore_cold", True)):
                    page_cache(runner.root, drop=drop)
                    t3 = now()
                    restored = jax.block_until_ready(runner.restore(100 + rnd))
                    values[key] = now() - t3
                    if rnd == 0:
                        check_equal(tree, restored, name)
                    del restored
                    clean()
            if rnd:
                for key, value in values.items():
                    note(f"{name}.{key}" if name != "limits" else f"limit.{key}", value)
        log(f"[{label}] round {rnd}/{repeats} ({now() - t_start:.0f} s)")
    for runner in runners.values():
        runner.close()
    del views, leaves
    # Training under a save, each kind of train step.
    windows: dict[str, dict[str, list[dict[str, float]]]] = {}
    state = [tree]
    del tree
    clean()
    for kind in STEPS if reps else []:
        trainer = trainer_for(kind, label, state, tokens)
        for _ in range(3):
            trainer.step()
        runners = {
            name: make_runner(name, scratch / f"{kind}-{name}", abstract) for name in systems
        }
        runners[FLOOR_WRITER] = PlainWriter(scratch / f"{kind}-{FLOOR_WRITER}", nbytes)
        in_windows = [*systems, FLOOR_WRITER]
        step = 1000
        for name in in_windows:  # two untimed saves each: compiled, pools faulted in
            for _ in range(2):
                trainer.run_for(0.5)
                save_window(
                    trainer,
                    runners[name],
                    step,
                    {"step_s": 0, "gap_s": 0, "cpu_per_step": 0, "faults_per_step": 0},
                    n_leaves,
                )
                step += 1
        windows[kind] = rotated_windows(
            trainer,
            runners,
            in_windows,
            reps,
            baseline_s,
            step,
            n_leaves,
            lambda rep, kind=kind: log(
                f"[{label}] {kind} rep {rep + 1}/{reps} ({now() - t_start:.0f} s)"
            ),
        )
        for runner in runners.values():
            runner.close()
        state = [trainer.state]
        del trainer
        clean()
    sampler.close()
    shutil.rmtree(scratch, ignore_errors=True)
    return {
        "tree": info,
        "rounds": {key: spread(values, 6) for key, values in rounds.items()},
        "paired": paired(rounds, systems, nbytes),
        "windows": {
            kind: {
                name: {key: spread([w[key] for w in rows], 6) for key in rows[0]}
                for name, rows in per.items()
            }
            for kind, per in windows.items()
        },
        "load_average_after": load_average(),
        "wall_s": round(now() - t_start, 1),
    }


def same_round_ratio(rounds: dict[str, list[float]], num: str, den: str) -> dict[str, Any] | None:
    """`num` ÷ `den`, round by round; None where either was not measured."""
    if num not in rounds or den not in rounds:
        return None
    return spread([a / b for a, b in zip(rounds[num], rounds[den], strict=True)], 4)


def paired(rounds: dict[str, list[float]], systems: list[str], nbytes: int) -> dict[str, Any]:
    """Same-round ratios."""

    def ratio(num: str, den: str) -> dict[str, Any] | None:
        return same_round_ratio(rounds, num, den)

    # Over 1: no copy, however it is made, can block save() for less than Orbax's views do.
    out: dict[str, Any] = {
        "copy_floor_vs_orbax_blocked": ratio("limit.memcpy_all_cores", "orbax.blocked"),
        # Under 5: no restore, however made, could be 5x as fast as Orbax's in that round.
        "orbax_restore_vs_read_floor": ratio("orbax.restore", "limit.read_cached"),
    }
    for name in systems:
        if name == "orbax":
            continue
        out[f"{name}.commit_vs_odirect"] = ratio("limit.odirect", f"{name}.commit")
        out[f"{name}.after_save_vs_odirect"] = ratio("limit.odirect", f"{name}.after_save")
        out[f"{name}.commit_vs_write_fsync"] = ratio("limit.write_fsync", f"{name}.commit")
        out[f"{name}.blocked_vs_memcpy"] = ratio(f"{name}.blocked", "limit.memcpy")
        out[f"{name}.blocked_vs_orbax"] = ratio(f"{name}.blocked", "orbax.blocked")
        out[f"{name}.blocked_vs_memcpy_all_cores"] = ratio(
            f"{name}.blocked", "limit.memcpy_all_cores"
        )
        out[f"{name}.restore_vs_orbax"] = ratio("orbax.restore", f"{name}.restore")
        out[f"{name}.restore_cold_vs_orbax"] = ratio("orbax.restore_cold", f"{name}.restore_cold")
        out[f"{name}.restore_vs_read_floor"] = ratio(f"{name}.restore", "limit.read_cached")
    return {k: v for k, v in out.items() if v is not None}


# ----------------------------------------------------------------------------- targets


def targets(
    entry: dict[str, Any], system: str = "cairn"
) -> list[tuple[str, str, float, bool | None]]:
    """(what, measured as text, median ratio, met: None where only reported) for the issue's
    targets; with `system` "limits", what the machine allows whatever the system."""
    rows: list[tuple[str, str, float, bool | None]] = []
    p = entry["paired"]

    def paired_row(key: str, what: str, met: Callable[[float], bool] | None) -> None:
        if (s := p.get(key)) is not None:
            r = s["median"]
            text = f"{r:.2f}{X} ({s['min']:.2f}{D}{s['max']:.2f})"
            rows.append((what, text, r, None if met is None else met(r)))

    if system == "limits":
        memcpy = entry["rounds"]["limit.memcpy"]["median"]
        for kind in STEPS:
            if (floor := entry["windows"].get(kind, {}).get(FLOOR_WRITER)) is None:
                continue
            first = floor["first_step_extra_s"]["median"]
            rows.append(
                (
                    f"first step after save() ({kind}), extra ÷ memcpy, beside a plain O_DIRECT "
                    "writer of the same bytes at nice 19 (the floor for any commit that writes "
                    "while training runs)",
                    f"{first * 1e3:.1f} ms ÷ {memcpy * 1e3:.1f} ms = {first / memcpy:.2f}{X}",
                    first / memcpy,
                    None,
                )
            )
        paired_row(
            "copy_floor_vs_orbax_blocked",
            "memcpy on every core ÷ Orbax's save() blocked (over 1: no copy can block for less)",
            None,
        )
        paired_row(
            "orbax_restore_vs_read_floor",
            "Orbax's restore ÷ reading the bytes from the page cache (under 5: no restore can be 5x as fast as Orbax's)",
            None,
        )
        return rows
    w = entry["windows"]
    memcpy = entry["rounds"]["limit.memcpy"]["median"]
    for kind in STEPS:
        if "orbax" not in w.get(kind, {}) or system not in w[kind]:
            continue
        ours = w[kind][system]["lost_s"]["median"]
        theirs = w[kind]["orbax"]["lost_s"]["median"]
        r = ours / theirs if theirs > 0 else float("inf")
        rows.append(
            (
                f"training time lost per save ({kind}) ÷ Orbax's, ≤ 0.25",
                f"{ours:.3f} s ÷ {theirs:.3f} s = {r:.2f}{X}",
                r,
                r <= 0.25,
            )
        )
        first = w[kind][system]["first_step_extra_s"]["median"]
        r = first / memcpy
        rows.append(
            (
                f"first step after save() ({kind}), extra ÷ memcpy, ≤ 0.2",
                f"{first * 1e3:.1f} ms ÷ {memcpy * 1e3:.1f} ms = {r:.2f}{X}",
                r,
                r <= 0.2,
            )
        )
    for key, what, met in (
        ("blocked_vs_orbax", "save() blocked ÷ Orbax's, ≤ 1", lambda r: r <= 1.0),
        ("blocked_vs_memcpy_all_cores", "save() blocked ÷ memcpy on every core", None),
        ("blocked_vs_memcpy", "save() blocked ÷ memcpy, ≤ 1.5", lambda r: r <= 1.5),
        ("commit_vs_odirect", "commit throughput ÷ O_DIRECT write, ≥ 0.95", lambda r: r >= 0.95),
        (
            "after_save_vs_odirect",
            "commit throughput after save() returns ÷ O_DIRECT write (the copy left out)",
            None,
        ),
        (
            "restore_vs_orbax",
            "restore throughput ÷ Orbax's (page cache warm), ≥ 5",
            lambda r: r >= 5.0,
        ),
        ("restore_cold_vs_orbax", "restore throughput ÷ Orbax's (files not cached)", None),
        ("restore_vs_read_floor", "restore time ÷ reading the bytes from the page cache", None),
    ):
        paired_row(f"{system}.{key}", what, met)
    mem = entry["rounds"].get(f"{system}.mem_held")
    if mem:
        goal = 0.25 if system == "cairn-views" else 1.0
        r = mem["median"]
        rows.append(
            (f"memory held beyond the state ({system}), ≤ {goal}", f"{r:.4f}{X}", r, r <= goal)
        )
    return rows


# ----------------------------------------------------------------------------- output


WINDOW_ROWS = [
    ("baseline_step_s", "step time, no save", 1e3, "ms"),
    ("blocked_s", "save() blocked", 1e3, "ms"),
    ("first_step_extra_s", "first step after save(): extra", 1e3, "ms"),
    ("later_steps_extra_s", "later steps of the window: extra, summed", 1e3, "ms"),
    ("between_steps_extra_s", "the loop between steps: extra, summed", 1e3, "ms"),
    ("lost_s", "training time lost per save", 1e3, "ms"),
    ("commit_s", "save start -> committed, under training", 1e3, "ms"),
    ("extra_cpu_s", "process CPU beyond the baseline's", 1e3, "ms"),
    ("cairn_threads_cpu_s", "CPU of cairn-* threads", 1e3, "ms"),
    ("extra_faults", "minor page faults beyond the baseline's", 1, ""),
    ("declined_steps", "steps whose donation JAX declined", 1, ""),
]
ROUND_ROWS = [
    ("limit.memcpy", "memcpy into a pre-faulted buffer"),
    ("limit.memcpy_all_cores", "the same memcpy, one thread per core"),
    ("limit.odirect", "one file, O_DIRECT write + fsync"),
    ("limit.write_fsync", "one file, buffered write + fsync"),
    ("limit.read_cached", "that file read from the page cache, one thread per core"),
    *(
        (f"{s}.{k}", f"{s}: {w}")
        for s in SYSTEMS
        for k, w in (
            ("blocked", "save() blocked"),
            ("commit", "save start -> committed"),
            ("after_save", "save() returned -> committed"),
            ("restore", "restore, files in the page cache"),
            ("restore_cold", "restore, files out of the page cache"),
        )
    ),
]


def cell(s: dict[str, Any] | None, scale: float = 1e3, unit: str = "ms") -> str:
    if s is None:
        return ""
    if unit == "ms":
        return f"{s['median'] * scale:.0f} ({s['min'] * scale:.0f}{D}{s['max'] * scale:.0f})"
    return f"{s['median']:.0f} ({s['min']:.0f}{D}{s['max']:.0f})"


def across(labels: list[str]) -> str:
    """The targets over several runs (``overhead-LABEL.json`` each), as Markdown: per target
    and size, the median of the runs' medians, their range, and in how many runs it was met."""
    per: dict[tuple[str, str], list[tuple[float, bool | None]]] = {}
    for label in labels:
        result = json.loads((RESULTS / f"overhead-{label}.json").read_text())
        for size, entry in result["sizes"].items():
            for what, _, ratio, met in targets(entry):
                per.setdefault((what, size), []).append((ratio, met))
    sizes = sorted({size for _, size in per}, key=parse_size)
    lines = [f"| target | {' | '.join(sizes)} |", "|---|" + "---|" * len(sizes)]
    for what in dict.fromkeys(w for w, _ in per):
        cells = []
        for size in sizes:
            got = per.get((what, size), [])
            ratios = [r for r, _ in got]
            met = [m for _, m in got if m is not None]
            n = 4 if what.startswith("memory") else 2
            text = (
                f"{statistics.median(ratios):.{n}f}{X} ({min(ratios):.{n}f}{D}{max(ratios):.{n}f})"
                if got
                else ""
            )
            cells.append(text + (f", {sum(met)} of {len(got)} runs" if met else ""))
        lines.append(f"| {what} | {' | '.join(cells)} |")
    return "\n".join(lines)


def markdown(result: dict[str, Any]) -> str:
    lines = []
    for label, entry in result["sizes"].items():
        systems = [s for s in SYSTEMS if f"{s}.commit" in entry["rounds"]]
        lines += [
            f"**{label}** ({entry['tree']['bytes'] / MiB:.0f} MiB, {entry['tree']['leaves']} leaves), median (min{D}max):",
            "",
        ]
        for kind in (k for k in STEPS if k in entry["windows"]):
            columns = [s for s in [*systems, FLOOR_WRITER] if s in entry["windows"][kind]]
            lines.append(f"| {kind} step | " + " | ".join(columns) + " |")
            lines.append("|---|" + "---:|" * len(columns))
            for key, what, scale, unit in WINDOW_ROWS:
                cells = [cell(entry["windows"][kind][s].get(key), scale, unit) for s in columns]
                lines.append(
                    f"| {what}{' (ms)' if unit == 'ms' else ''} | " + " | ".join(cells) + " |"
                )
            lines.append("")
        lines.append(f"| no training, n rounds | median (min{D}max), ms |")
        lines.append("|---|---:|")
        for key, what in ROUND_ROWS:
            if key in entry["rounds"]:
                lines.append(f"| {what} | {cell(entry['rounds'][key])} |")
        for s in systems:
            m = entry["rounds"].get(f"{s}.mem_held")
            if m:
                lines.append(
                    f"| {s}: memory held between saves, {X} state | {m['median']:.2f} ({m['min']:.2f}{D}{m['max']:.2f}) |"
                )
        lines.append("")
        lines.append("| target | measured | met |")
        lines.append("|---|---|---|")
        for s in ["limits", *(s for s in systems if s != "orbax")]:
            for what, text, _r, met in targets(entry, s):
                verdict = "" if met is None else "yes" if met else "**no**"
                lines.append(f"| {s}: {what} | {text} | {verdict} |")
        lines.append("")
    return "\n".join(lines)


def print_tables(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markdown import Markdown

    Console(width=160).print(Markdown(markdown(result)))


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="256M,1G")
    parser.add_argument(
        "--systems",
        default=DEFAULT_SYSTEMS,
        help=f"comma-separated, of {', '.join(SYSTEMS)} (default {DEFAULT_SYSTEMS})",
    )
    parser.add_argument("--repeats", type=int, default=5, help="commit/restore rounds (default 5)")
    parser.add_argument(
        "--reps",
        type=int,
        default=5,
        help="save windows per system and step (default 5; 0: no training windows and no "
        "memory phase, only the commit, restore and limits rounds)",
    )
    parser.add_argument("--baseline-s", type=float, default=2.0)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--label", default="", help="names the result file: overhead-LABEL.json")
    parser.add_argument("--quick", action="store_true", help="smoke run: 16M, 2 rounds, 2 windows")
    parser.add_argument("--markdown", action="store_true", help="print the JSON as Markdown")
    parser.add_argument(
        "--across",
        default="",
        help="comma-separated labels: the targets over those runs' JSON, as Markdown",
    )
    parser.add_argument("--plot", action="store_true", help="redraw docs/benchmarks_overhead.png")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    name = "overhead" + (f"-{args.label}" if args.label else "") + ("-quick" if args.quick else "")
    json_path = args.json or RESULTS / f"{name}.json"
    if args.markdown:
        print(markdown(json.loads(json_path.read_text())))
        return 0
    if args.across:
        print(across([s.strip() for s in args.across.split(",") if s.strip()]))
        return 0
    if args.plot:
        import plot

        plot.plot_overhead(RESULTS / "overhead.json", RESULTS / "overhead-before.json", DEFAULT_PNG)
        print(f"wrote {DEFAULT_PNG}")
        if (RESULTS / "overhead-process.json").exists():  # the writer process against the thread
            plot.plot_overhead(RESULTS / "overhead-process.json", Path("-"), WRITER_PNG)
            print(f"wrote {WRITER_PNG}")
        if (RESULTS / "overhead-packed.json").exists():  # the packed layout against the zarr one
            plot.plot_overhead(RESULTS / "overhead-packed.json", Path("-"), PACKED_PNG)
            print(f"wrote {PACKED_PNG}")
        if (RESULTS / "overhead-background.json").exists():  # hashing after writes, nice 19
            plot.plot_overhead(RESULTS / "overhead-background.json", Path("-"), BACKGROUND_PNG)
            print(f"wrote {BACKGROUND_PNG}")
        if (RESULTS / "overhead-overlap.json").exists():  # writes while save() copies
            runs = [
                ("before, run 1 (background)", RESULTS / "overhead-background.json"),
                ("before, run 2 (background-2)", RESULTS / "overhead-background-2.json"),
                ("writing while save() copies, run 1 (overlap)", RESULTS / "overhead-overlap.json"),
                ("run 2 (overlap-2)", RESULTS / "overhead-overlap-2.json"),
            ]
            plot.plot_commit_ratio(runs, OVERLAP_PNG)
            print(f"wrote {OVERLAP_PNG}")
        return 0
    if args.quick:
        args.sizes, args.repeats, args.reps, args.baseline_s = "16M", 2, 2, 0.5
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"--systems: unknown {unknown}; choose from {list(SYSTEMS)}")
    systems = [s for s in systems if s != "cairn-views" or has_zero_copy()]
    t0 = now()

    def log(msg: str) -> None:
        print(f"{now() - t0:7.1f}s  {msg}", file=sys.stderr, flush=True)

    if args.worker:
        entry = run_size(
            args.worker, systems, args.repeats, args.reps, args.baseline_s, args.tokens, log
        )
        json_path.write_text(json.dumps(entry) + "\n")
        return 0
    import cairn.manager

    result: dict[str, Any] = {
        "benchmark": "bench/bench_overhead.py",
        "label": args.label or "current",
        "cairn_from": str(Path(cairn.manager.__file__).resolve().parent),
        "git": subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "config": {
            "repeats": args.repeats,
            "reps": args.reps,
            "baseline_s": args.baseline_s,
            "tokens": args.tokens,
            "systems": systems,
        },
        "machine": machine_facts(),
        "sizes": {},
    }
    log(f"cairn from {result['cairn_from']}; systems {systems}; load {load_average()}")
    for label in [s.strip().upper() for s in args.sizes.split(",") if s.strip()]:
        options = {
            "systems": ",".join(systems),
            "repeats": args.repeats,
            "reps": args.reps,
            "baseline_s": args.baseline_s,
            "tokens": args.tokens,
        }
        result["sizes"][label] = run_in_child(
            __file__,
            label,
            options,
            RESULTS / f".overhead-{label}.partial.json",
        )
        log(f"[{label}] done")
    result["wall_s"] = round(now() - t0, 1)
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    print_tables(result)
    log(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
