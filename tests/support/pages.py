"""What of a file is in the page cache: how a test tells a write that went to the disk with
``O_DIRECT`` from one that went through the page cache."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

from cairn.handlers._files import resident_pages as _resident_pages

PAGE = mmap.PAGESIZE


def resident_pages(path: Path) -> int:
    """How many of the file's pages are in the page cache (mincore(2) over a mapping of it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return _resident_pages(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def evict(path: Path) -> None:
    """Drop the file's pages from the page cache (written back first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
