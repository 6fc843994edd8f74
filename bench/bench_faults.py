"""What fresh memory costs here: faulting in 1 GiB of anonymous memory, the ways cairn could.

The staging pool's first use, and a train step whose donation JAX declined, both fault in a
whole state of fresh memory. Per round (``--rounds``, order rotated), each way on a new mapping
of ``--size`` bytes, then unmapped:

* ``4k touch``: 4 KiB pages (``MADV_NOHUGEPAGE``), a write per page, one thread (as a fresh
  array of the train step's, whose memory comes without huge pages);
* ``4k copy``: 4 KiB pages, a memcpy of a state into it (what faulting by copying costs);
* ``thp touch`` and ``thp copy``: the same with ``MADV_HUGEPAGE`` (cairn's slabs), one thread;
* ``thp copy x2``: the memcpy split over two threads (the staging copy's two threads);
* ``thp populate``: one ``madvise(MADV_POPULATE_WRITE)`` call over the whole mapping (`Slab.
  populate`, the background fault-in after a restore); ``thp populate x2``: two calls, a half
  each, on two threads;
* ``memcpy``: the memcpy into memory already faulted in (the steady state's copy), the floor.

    .venv/bin/python bench/bench_faults.py [--size 1G] [--rounds 5]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import threading
import time

import numpy as np
from _common import RESULTS, machine_facts, parse_size, spread

_MADV_POPULATE_WRITE = 23
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
WAYS = (
    "4k touch",
    "4k copy",
    "thp touch",
    "thp copy",
    "thp copy x2",
    "thp populate",
    "thp populate x2",
    "memcpy",
)


def one(way: str, size: int, src: np.ndarray, warm: np.ndarray) -> float:
    if way == "memcpy":
        t0 = time.perf_counter()
        warm[:] = src
        return time.perf_counter() - t0
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE if way.startswith("thp") else mmap.MADV_NOHUGEPAGE)
    dst = np.frombuffer(region, np.uint8)
    threads = 2 if way.endswith("x2") else 1
    step = size // threads

    def part(dst: np.ndarray, lo: int, hi: int) -> None:
        if "populate" in way:
            _libc.madvise(ctypes.c_void_p(dst.ctypes.data + lo), hi - lo, _MADV_POPULATE_WRITE)
        elif "touch" in way:
            dst[lo:hi:4096] = 1
        else:
            dst[lo:hi] = src[lo:hi]

    workers = [
        threading.Thread(
            target=part, args=(dst, k * step, size if k == threads - 1 else (k + 1) * step)
        )
        for k in range(threads)
    ]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    took = time.perf_counter() - t0
    del workers, dst
    region.close()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1G")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    size = parse_size(args.size)
    src = np.full(size, 3, np.uint8)
    warm = np.ones(size, np.uint8)
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for rnd in range(args.rounds):
        k = rnd % len(WAYS)
        for way in WAYS[k:] + WAYS[:k]:
            times[way].append(one(way, size, src, warm))
    result = {
        "benchmark": "bench/bench_faults.py",
        "size": args.size,
        "machine": machine_facts(),
        "seconds": {way: spread(t, 6) for way, t in times.items()},
    }
    (RESULTS / "faults.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"| {args.size}, {args.rounds} rounds | median (min\u2013max), ms |\n|---|---:|")
    for way, s in result["seconds"].items():
        print(
            f"| {way} | {s['median'] * 1e3:.0f} ({s['min'] * 1e3:.0f}\u2013{s['max'] * 1e3:.0f}) |"
        )


if __name__ == "__main__":
    main()
