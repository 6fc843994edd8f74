"""Helpers shared by the benchmarks in bench/: sizes, timing, machine limits, RSS, summaries.

Importing this module sets the environment jax/orbax read at import (CPU only, no C++ INFO lines),
so import it before either of them.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
SCRATCH = RESULTS / "tmp"  # on the repo's disk, not /tmp (which may be tmpfs elsewhere)
MiB = 1 << 20
GiB = 1 << 30

Timings = dict[str, float]


def now() -> float:
    return time.perf_counter()


# ----------------------------------------------------------------------------- sizes


def parse_size(text: str) -> int:
    """'64M', '256M', '1G', '512K' (binary units) or a plain byte count."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    units = {"K": 1 << 10, "M": MiB, "G": GiB}
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def size_label(nbytes: int) -> str:
    if nbytes % GiB == 0:
        return f"{nbytes // GiB}G"
    if nbytes % MiB == 0:
        return f"{nbytes // MiB}M"
    return f"{nbytes}B"


# ----------------------------------------------------------------------------- machine limits


class Limits:
    """Machine limits for the same bytes: memcpy, fresh copy, one-file write+fsync, read back.

    `leaves` are host arrays (NumPy arrays, or zero-copy NumPy views of jax CPU arrays); they are
    only read. The pre-faulted destination buffer exists only while `run` runs, so it does not
    add to the memory of the phases measured in between.
    """

    name = "limit"

    def __init__(self, leaves: list[np.ndarray], scratch: Path) -> None:
        self.leaves = leaves
        self.path = scratch / "plain.bin"
        self.total = sum(a.nbytes for a in leaves)

    def run(self, step: int) -> Timings:
        flat = np.empty(self.total, dtype=np.uint8)
        flat.fill(1)  # pre-fault every page, so memcpy is measured, not page faults
        dst: list[np.ndarray] = []
        offset = 0
        for a in self.leaves:
            dst.append(flat[offset : offset + a.nbytes].view(a.dtype).reshape(a.shape))
            offset += a.nbytes

        t: Timings = {}
        t0 = now()
        for src, out in zip(self.leaves, dst, strict=True):
            np.copyto(out, src)
        t["memcpy"] = now() - t0

        t0 = now()
        copies = [np.array(a, copy=True) for a in self.leaves]
        t["fresh_copy"] = now() - t0
        del copies

        t0 = now()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for a in self.leaves:
                view = memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
                while view:
                    view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        t["write_fsync"] = now() - t0

        t0 = now()
        with open(self.path, "rb", buffering=0) as f:
            view = memoryview(flat)
            got = 0
            while got < len(view):
                n = f.readinto(view[got:])
                if not n:
                    raise RuntimeError(f"{self.path} is short: {got} of {len(view)} bytes")
                got += n
        t["read"] = now() - t0
        self.path.unlink()
        del dst, flat
        return t

    def close(self) -> None:
        self.path.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- child processes


def run_in_child(script: str, label: str, options: dict[str, Any], part: Path) -> dict[str, Any]:
    """Run `script --worker label --OPTION value ... --json part` (one size in a fresh process,
    so no allocator state carries over) and return the entry it wrote to `part`."""
    cmd = [sys.executable, str(Path(script).resolve()), "--worker", label]
    for name, value in options.items():
        cmd += [f"--{name.replace('_', '-')}", str(value)]
    subprocess.run([*cmd, "--json", str(part)], check=True)
    entry: dict[str, Any] = json.loads(part.read_text())
    part.unlink()
    return entry


# ----------------------------------------------------------------------------- memory


def malloc_trim() -> None:
    """Give glibc's free heap memory back to the kernel (so RSS baselines start clean)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class RssSampler:
    """A daemon thread reading this process's RSS (/proc/self/statm) every `interval` seconds.

    ``start_window()`` returns the RSS now and restarts the peak; ``peak()`` is the highest RSS
    seen since (one last reading included), so a phase's peak memory is bracketed by the two.
    """

    def __init__(self, interval: float = 0.01) -> None:
        self.interval = interval
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._fd = os.open("/proc/self/statm", os.O_RDONLY)
        self._lock = threading.Lock()
        self._peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def rss(self) -> int:
        return int(os.pread(self._fd, 256, 0).split()[1]) * self._page

    def _note(self, value: int) -> None:
        with self._lock:
            self._peak = max(self._peak, value)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._note(self.rss())

    def start_window(self) -> int:
        value = self.rss()
        with self._lock:
            self._peak = value
        return value

    def peak(self) -> int:
        self._note(self.rss())
        with self._lock:
            return self._peak

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        os.close(self._fd)


# ----------------------------------------------------------------------------- checks


def flatten(tree: Any, path: str = "") -> dict[str, Any]:
    """{'/a/b': leaf} for a tree of dicts (Orbax gives dicts back with sorted keys)."""
    if isinstance(tree, dict):
        return {p: v for k in tree for p, v in flatten(tree[k], f"{path}/{k}").items()}
    return {path: tree}


def check_equal(expected: Any, got: Any, who: str) -> None:
    """Compare two trees of arrays (NumPy or jax) by key path; AssertionError if they differ."""
    want, have = flatten(expected), flatten(got)
    bad = sorted(
        p for p in want if p not in have or not np.array_equal(np.asarray(want[p]), have[p])
    )
    if bad or set(have) != set(want):
        raise AssertionError(f"{who}: the restored tree differs from the saved one at {bad[:3]}")


# ----------------------------------------------------------------------------- summaries


def summarize(values: list[float], nbytes: int | None = None) -> dict[str, Any]:
    """Median, min, max, n and the samples of timings in seconds (GiB/s when `nbytes` is given)."""
    med = statistics.median(values)
    out: dict[str, Any] = {
        "median_s": round(med, 6),
        "min_s": round(min(values), 6),
        "max_s": round(max(values), 6),
    }
    if nbytes is not None:
        out["gib_per_s"] = round(nbytes / GiB / med, 3) if med > 0 else None
    out["n"] = len(values)
    out["samples_s"] = [round(v, 5) for v in values]
    return out


def spread(values: list[float], digits: int = 4) -> dict[str, Any]:
    """Median, min, max, n and the samples of unitless values (ratios, fractions)."""
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
        "n": len(values),
        "samples": [round(v, digits) for v in values],
    }


def fmt_range(med: float, lo: float, hi: float) -> str:
    """'217 ms (208-390)' or '3.42 s (1.81-5.04)': one unit, chosen by the median."""
    if med < 0.01:
        return f"{med * 1e3:.1f} ms ({lo * 1e3:.1f}-{hi * 1e3:.1f})"
    if med < 1:
        return f"{med * 1e3:.0f} ms ({lo * 1e3:.0f}-{hi * 1e3:.0f})"
    return f"{med:.2f} s ({lo:.2f}-{hi:.2f})"


def fmt_s(seconds: float) -> str:
    if seconds < 0.1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.3f} s"


# ----------------------------------------------------------------------------- environment


def machine_facts() -> dict[str, Any]:
    facts: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    try:
        meminfo = Path("/proc/meminfo").read_text().split("\n")
        kib = int(next(line for line in meminfo if line.startswith("MemTotal")).split()[1])
        facts["mem_gib"] = round(kib / (1 << 20), 1)
    except (OSError, StopIteration, ValueError):
        pass
    fs = scratch_filesystem()
    if fs:
        facts["scratch_fs"] = fs
    for dist in ("numpy", "jax", "jaxlib", "orbax-checkpoint", "tensorstore", "cairn-ckpt"):
        try:
            facts[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            facts[dist] = None
    return facts


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def scratch_filesystem() -> str | None:
    """The filesystem type of the mount holding the scratch directory (from /proc/mounts)."""
    try:
        mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return None
    target = str(SCRATCH.resolve())
    best = ("", "")
    for fields in mounts:
        if len(fields) < 3:
            continue
        mount = fields[1]
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best[0]):
            best = (mount, fields[2])
    return f"{best[1]} on {best[0]}" if best[0] else None


def quiet_logs() -> None:
    """Orbax logs every save through absl at INFO/WARNING; keep only errors."""
    warnings.filterwarnings("ignore", module="orbax")
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.ERROR)
    except ImportError:
        pass
    for name in ("absl", "orbax", "jax", "cairn"):
        logging.getLogger(name).setLevel(logging.ERROR)
