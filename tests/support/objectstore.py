"""Helpers for tests of object-store directories: the lease object, and holding a commit."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from conftest import Gate

from cairn.manager._format import LOCK
from cairn.manager._storage import objectstore as _objectstore
from cairn.manager._storage.objectstore import ObjectStore, StorageOptions


def put_lease(url: str, owner: str, expires: float) -> ObjectStore:
    store = ObjectStore(url, StorageOptions())
    store.write(LOCK, json.dumps({"owner": owner, "expires": expires}).encode())
    return store


def lease_of(store: ObjectStore) -> dict[str, Any]:
    data = store.read(LOCK)
    assert data is not None
    return dict(json.loads(data))


def hold(where: str, gate: Gate, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hold the next commit of a step on `gate` once its files are written: before the commit
    starts, or right after the lease check that follows the upload (just before the manifest).
    Once."""
    uploaded, held = threading.Event(), threading.Event()
    commit, check = _objectstore._KvPrepared.commit, _objectstore.Lease.check
    finish = _objectstore._KvDestination.finish

    def finished(self: Any, *args: Any) -> Any:
        out = finish(self, *args)
        uploaded.set()
        return out

    def held_commit(self: Any, manifest: Any) -> None:
        if where == "after the upload" and not held.is_set():
            held.set()
            gate()
        commit(self, manifest)

    def held_check(self: Any) -> None:
        check(self)
        if where == "after the lease check" and uploaded.is_set() and not held.is_set():
            held.set()
            gate()

    monkeypatch.setattr(_objectstore._KvDestination, "finish", finished)
    monkeypatch.setattr(_objectstore._KvPrepared, "commit", held_commit)
    monkeypatch.setattr(_objectstore.Lease, "check", held_check)
