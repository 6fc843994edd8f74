"""A filesystem of a given type mounted for one test (the tests run as root here, as CI does)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def mounted(kind: str, where: Path) -> Iterator[Path]:
    """`where` (made) with a fresh `kind` filesystem ("tmpfs", "ramfs") on it, unmounted after."""
    where.mkdir()
    subprocess.run(["mount", "-t", kind, "none", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)
