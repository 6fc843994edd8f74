"""What of a file is in the page cache: how a test tells a write that went to the disk with
``O_DIRECT`` from one that went through the page cache."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import numpy as np

PAGE = mmap.PAGESIZE


def resident_pages(path: Path) -> int:
    """How many of the file's pages are in the page cache (mincore(2) over a mapping of it)."""
    size = path.stat().st_size
    pages = -(-size // PAGE)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        vec = (ctypes.c_ubyte * pages)()
        buf = np.frombuffer(m, np.uint8)
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.mincore(ctypes.c_void_p(buf.ctypes.data), ctypes.c_size_t(size), vec)
        assert rc == 0, os.strerror(ctypes.get_errno())
        del buf
        return sum(v & 1 for v in vec)
