"""Where the multi-process tests keep their checkpoints: a local directory (a shared filesystem
on one machine), a prefix in a real S3 server (moto) and one in a real GCS server
(fake-gcs-server), each started by the session fixtures of tests/support/s3util.py and tests/support/gcsutil.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from cairn.manager._storage.objectstore import ObjectStore, StorageOptions


@dataclasses.dataclass(frozen=True)
class Place:
    """A checkpoint directory the worker processes share, and what is in it."""

    directory: str

    def listing(self) -> list[str]:
        """Every file (or object) under the directory, relative to it, sorted."""
        if "://" in self.directory:
            return ObjectStore(self.directory, StorageOptions()).list_keys()
        root = Path(self.directory)
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir())

    def steps(self) -> list[str]:
        """The top-level names that hold anything but the lock or lease."""
        return sorted({k.split("/")[0] for k in self.listing() if "/" in k})


@pytest.fixture(params=["posix", "s3", "gcs"])
def place(request: pytest.FixtureRequest, tmp_path: Path) -> Place:
    if request.param == "posix":
        return Place(str(tmp_path))
    bucket = request.getfixturevalue(f"{request.param}_bucket")
    return Place(f"{bucket}/run")
