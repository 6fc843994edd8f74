"""The storage contract's machinery: the backends every suite of tests/contracts/test_storage_*.py
runs on, and what those suites share.

The suites are split by concern (the step lifecycle, crashes, untrusted names, the writer's hold,
shared deletion). Each holds an abstract class of tests (a subclass of `StorageContract`) that
uses only the `Storage` protocol (``open_storage``, ``scan``, ``prepare``, ``delete_step``, ...)
and the public CheckpointManager API, plus a raw view of what is stored (`Raw`: the files under a
directory, or the objects under a prefix) to look at it and tamper with it; in the pattern of
fsspec's tests/abstract. Each backend here gives the suites its places (`Place`: a checkpoint
directory, its raw view, and a raw view of its parent, where sentinels lie beside it) and the
points where a crash can be injected: POSIX (tmp_path), memory://, S3 (a real moto server), GCS
(a real fake-gcs-server). A suite's file runs it on each backend that has that part (``class
TestS3(S3Backend, SomeContract)``). Nothing is mocked; wrapping a storage's calls to make the N-th
one fail (a crash) or to record what it touches is the only intervention. Synchronisation is by
events and barriers, never by sleeping.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import functools
import itertools
import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from support.treeutil import assert_tree_equal

from cairn.handlers import (
    Destination,
    FileRecord,
    Handler,
    JsonHandler,
    StoredItem,
    TrainStateHandler,
)
from cairn.handlers._files import content_hash
from cairn.manager import CheckpointManager, StepAlreadyExistsError, StepNotFoundError
from cairn.manager._format import (
    LOCK,
    MANIFEST,
    METRICS,
    ItemEntry,
    Manifest,
    StepNames,
    dump_checked,
)
from cairn.manager._storage.base import Prepared, Storage
from cairn.manager._storage.objectstore import KvStorage, ObjectStore, StorageOptions
from cairn.manager._storage.open import open_storage

NAMES = StepNames()
HANDLERS: dict[str, Handler] = {
    "state": TrainStateHandler(chunk_bytes=2048),
    "extra": JsonHandler(),
}
CLAIM = b'{"cairn_claim": "saving", "id": "0123456789abcdef"}'  # what a dead save leaves


def state(step: int) -> dict[str, np.ndarray]:
    """A small train state: `w` in 4 chunks of 2 KiB, `b` in one."""
    return {
        "w": np.arange(2048, dtype=np.float32).reshape(32, 64) + step,
        "b": np.full(7, step, dtype=np.int64),
    }


def extra(step: int) -> dict[str, Any]:
    return {"step": step, "tag": "x" * step}


def items(step: int) -> dict[str, Any]:
    return {"state": state(step), "extra": extra(step)}


def run_together(*targets: Callable[[], None]) -> None:
    """Each target on a thread of its own, all started, then joined (a target reports its own
    errors: a thread's exception would be lost)."""
    threads = [threading.Thread(target=target) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)


def check_restored(got: Mapping[str, Any], step: int, *, live: Sequence[str]) -> None:
    """`got` holds exactly the items `live` of step `step`, each equal to what was saved."""
    assert sorted(got) == sorted(live), (step, sorted(got))
    if "state" in live:
        assert_tree_equal(got["state"], state(step))
    if "extra" in live:
        assert got["extra"] == extra(step)


def stored_keys(mgr: CheckpointManager, *, metrics: Sequence[int] = (), lock: bool) -> list[str]:
    """Every key a directory holds when it holds the manager's steps and nothing else: each
    step's manifest, metrics.json for the steps `metrics`, the files of its live items."""
    keys = {LOCK} if lock else set()
    for step in mgr.all_steps():
        name = NAMES.format(step)
        keys.add(f"{name}/{MANIFEST}")
        if step in metrics:
            keys.add(f"{name}/{METRICS}")
        for item, info in mgr.info(step).items.items():
            if not info.dropped:
                keys.update(f"{name}/{item}/{path}" for path in info.files)
    return sorted(keys)


def beside(dump: Mapping[str, bytes], name: str = "ckpt") -> dict[str, bytes]:
    """What a parent's dump holds beside its directory `name`."""
    return {k: v for k, v in dump.items() if not k.startswith(f"{name}/")}


def minimal_manifest(step: int, **fields: Any) -> bytes:
    return Manifest(step, {}, 1.7e9, 1.7e9, **fields).to_bytes()


def crafted_manifest(step: int, items: Mapping[str, Any]) -> bytes:
    """A manifest as an attacker who read docs/format.md writes it: any item names and file
    records, with a valid crc32c."""
    return dump_checked(
        {
            "format": "cairn",
            "format_version": 2,
            "step": step,
            "started_at": 1.7e9,
            "committed_at": 1.7e9,
            "items": dict(items),
            "metrics": {},
            "metadata": {},
            "telemetry": {},
        }
    )


def json_item(path: str = "data.json", data: bytes = b"{}") -> dict[str, Any]:
    """A JsonHandler item entry recording one file `path` holding `data`."""
    record = FileRecord(path, len(data), xxh3_128=content_hash(data))
    return {"handler": "cairn.json", "version": 1, "dropped": False, "files": [record.to_json()]}


class TwoPartHandler:
    """Writes ``part1``, calls `between` (a test's gate), then writes ``part2``: a save held
    there has some of its files written and is not committed."""

    id = "cairn.tests.two_part"
    version = 1

    def __init__(self, between: Callable[[], None] | None = None) -> None:
        self.between = between

    def snapshot(self, obj: Any) -> _TwoPart:
        return _TwoPart(self, json.dumps(obj).encode())

    def restore(self, stored: StoredItem, target: Any = None) -> Any:
        del target
        assert stored.read_bytes("part2") == b"done"
        return json.loads(stored.read_bytes("part1"))

    def describe(self, stored: StoredItem) -> dict[str, Any]:
        return {"kind": "two-part"}


@dataclasses.dataclass
class _TwoPart:
    handler: TwoPartHandler
    data: bytes

    def write(self, dest: Destination) -> list[FileRecord]:
        first = dest.write_file("part1", self.data)
        if self.handler.between is not None:
            self.handler.between()
        return [first, dest.write_file("part2", b"done")]


# ---------------------------------------------------------------------------- raw views


class Raw(abc.ABC):
    """What is stored under one directory or prefix, key by key ("checkpoint_1/_CHECKPOINT.json"),
    seen and changed without cairn."""

    @abc.abstractmethod
    def all_keys(self) -> list[str]:
        """Every key, sorted (on POSIX, an empty directory as "name/")."""

    @abc.abstractmethod
    def read(self, key: str) -> bytes | None: ...

    @abc.abstractmethod
    def write(self, key: str, data: bytes) -> None: ...

    @abc.abstractmethod
    def delete(self, key: str) -> None: ...

    def plant(self, key: str, data: bytes) -> None:
        """Create `key` exactly as spelled, dot segments ("a/../b") included, where it can be."""
        self.write(key, data)

    def write_many(self, files: Mapping[str, bytes]) -> None:
        for key, data in files.items():
            self.write(key, data)

    def dump(self) -> dict[str, bytes]:
        found = {key: self.read(key) for key in self.all_keys() if not key.endswith("/")}
        return {key: data for key, data in found.items() if data is not None}


class PosixRaw(Raw):
    def __init__(self, root: Path) -> None:
        self.root = root

    def all_keys(self) -> list[str]:
        out: list[str] = []

        def walk(directory: str, rel: str) -> None:
            entries = list(os.scandir(directory))
            if not entries and rel:
                out.append(rel + "/")
            for entry in entries:
                name = f"{rel}/{entry.name}" if rel else entry.name
                if entry.is_dir(follow_symlinks=False):
                    walk(entry.path, name)
                else:
                    out.append(name)

        if self.root.is_dir():
            walk(str(self.root), "")
        return sorted(out)

    def read(self, key: str) -> bytes | None:
        try:
            return (self.root / key).read_bytes()
        except FileNotFoundError:
            return None

    def write(self, key: str, data: bytes) -> None:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def delete(self, key: str) -> None:
        (self.root / key).unlink()


class KvRaw(Raw):
    """Through TensorStore's kvstore, as cairn reaches the store (`KvStorage(url).store`)."""

    def __init__(self, url: str) -> None:
        self.store = KvStorage(url, StorageOptions()).store

    def all_keys(self) -> list[str]:
        return self.store.list_keys()

    def read(self, key: str) -> bytes | None:
        return self.store.read(key)

    def write(self, key: str, data: bytes) -> None:
        self.store.write(key, data)

    def delete(self, key: str) -> None:
        self.store.delete(key)

    def write_many(self, files: Mapping[str, bytes]) -> None:
        futures = [self.store._kv.write(key, data) for key, data in files.items()]
        for future in futures:
            future.result()


class S3Raw(KvRaw):
    """A prefix in a bucket of the moto server; keys with dot segments go through boto3."""

    def __init__(self, url: str, endpoint: str) -> None:
        import boto3

        super().__init__(url)
        self.bucket, _, prefix = url.removeprefix("s3://").partition("/")
        self.prefix = prefix.strip("/") + "/"
        self.client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")

    def plant(self, key: str, data: bytes) -> None:
        """TensorStore's HTTP client resolves the dot segments of a key before sending it, so
        it cannot create such an object; other S3 clients (boto3, the console) can."""
        self.client.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data)
        assert key in self.all_keys(), f"{key!r} was not stored under its literal name"
        assert self.read(key) == data

    def read(self, key: str) -> bytes | None:
        if not any(part in (".", "..") for part in key.split("/")):
            return super().read(key)
        try:
            got = self.client.get_object(Bucket=self.bucket, Key=self.prefix + key)
        except self.client.exceptions.NoSuchKey:
            return None
        return bytes(got["Body"].read())


@dataclasses.dataclass
class Place:
    """A checkpoint directory (maybe not there yet), what it holds, and what lies beside it."""

    directory: Path | str
    raw: Raw  # keys relative to the directory
    outside: Raw  # keys relative to the directory's parent

    def storage(self) -> Storage:
        return open_storage(self.directory, None)

    def writer(self, **kwargs: Any) -> CheckpointManager:
        return CheckpointManager(self.directory, handlers=HANDLERS, **kwargs)

    def reader(self, **kwargs: Any) -> CheckpointManager:
        return CheckpointManager(self.directory, read_only=True, **kwargs)


class Crash(BaseException):
    """The process died here. A BaseException, so no ``except Exception`` of the code under
    test handles it as an error it could recover from."""


class Crasher:
    """Counts the points at which a process can die (the storage's calls that change what is
    stored) and dies at the armed one: that call, and every one after it, raises Crash."""

    def __init__(self) -> None:
        self.at: int | None = None
        self.count = 0
        self.dead = False

    def arm(self, at: int) -> None:
        self.at, self.count, self.dead = at, 0, False

    def disarm(self) -> None:
        self.at, self.dead = None, False

    def dies_here(self) -> bool:
        if self.at is None:
            return False
        if self.dead:
            raise Crash("dead already")
        self.count += 1
        self.dead = self.count >= self.at
        return self.dead

    def point(self) -> None:
        if self.dies_here():
            raise Crash(f"crash at point {self.count}")


def xfail_here(test: Callable[..., None], reason: str) -> Callable[..., None]:
    """`test` as a subclass's own method, marked xfail(strict) for that subclass only."""

    @functools.wraps(test)
    def mine(self: Any, *args: Any, **kwargs: Any) -> None:
        test(self, *args, **kwargs)

    return pytest.mark.xfail(strict=True, reason=reason)(mine)


def write_one_step(prepared: Prepared, step: int, writer: int) -> Manifest:
    """What a save's write phase puts into a prepared step; the manifest to commit it with."""
    handler = TrainStateHandler(chunk_bytes=256)
    dest = prepared.destination("state")
    snapshot = handler.snapshot({"w": np.full(300, float(writer))})
    records = dest.finish(handler.id, tuple(snapshot.write(dest)))
    prepared.sync()
    entry = ItemEntry(handler.id, handler.version, records)
    return Manifest(step, {"state": entry}, time.time(), time.time(), metadata={"writer": writer})


def step_2_whole_or_gone(place: Place, mgr: CheckpointManager) -> str:
    """A `crash_everywhere` check around a deletion of step 2: whole (restores, verifies, its
    metrics) or gone, nothing in between."""
    steps = mgr.all_steps()
    assert steps in ([1, 2, 3], [1, 3]), steps
    if 2 not in steps:
        with pytest.raises(StepNotFoundError):
            mgr.restore(2)
        return "gone"
    assert mgr.verify(2) == []
    check_restored(mgr.restore(2, fallback=False), 2, live=["state", "extra"])
    assert mgr.metrics(2) == {"loss": 0.5, "eval": 0.5}
    return "whole"


def step_paths(manifest: Manifest) -> list[str]:
    """The paths of a step's live files, relative to the step, sorted (as a job shares them out
    among its processes for a shared deletion)."""
    return sorted(
        f"{item}/{f.path}"
        for item, entry in manifest.items.items()
        if not entry.dropped
        for f in entry.files
    )


# ---------------------------------------------------------------------------- the backends


class StorageContract:
    """The base of every storage suite; a backend subclass provides `places` and the hooks."""

    #: whether a second prepare of a step already claimed fails at once (object stores claim
    #: the manifest's key; POSIX writes into a temporary directory and fails at the rename)
    claims_at_prepare: ClassVar[bool]
    #: whether the lock file stays when its writer is gone (POSIX; a lease object does not)
    lock_stays: ClassVar[bool]
    #: whether the processes of a job share a step's deletion out (object stores; not POSIX)
    shares_deletion: ClassVar[bool]
    #: how many committed steps test_listing_many_steps writes directly
    many: ClassVar[int] = 10_000
    #: rounds of the reader-beside-writer tests
    rounds: ClassVar[int] = 30
    #: the largest share of a listing's time the test allows per step, seconds
    listing_s_per_step: ClassVar[float] = 0.05

    @pytest.fixture
    def places(self) -> Callable[[str], Place]:
        raise NotImplementedError

    @pytest.fixture
    def place(self, places: Callable[[str], Place]) -> Place:
        return places("ckpt")

    def install_crashes(self, monkeypatch: pytest.MonkeyPatch, crasher: Crasher) -> None:
        """Make every call by which the storage changes what is stored a crash point."""
        raise NotImplementedError

    def is_refusal(self, error: object) -> bool:
        """Whether `error` is how a commit of a step that another writer committed fails."""
        return isinstance(error, StepAlreadyExistsError)

    def watch(self, place: Place) -> contextlib.AbstractContextManager[list[str]]:
        """Everything the storage touches outside `place.directory` while the block runs."""
        raise NotImplementedError

    def can_store(self, key: str) -> bool:
        """Whether this backend can hold `key` at all (a POSIX name has no "/" in a part)."""
        return True

    def crash_everywhere(
        self,
        places: Callable[[str], Place],
        monkeypatch: pytest.MonkeyPatch,
        operation: Callable[[Storage], None],
        check: Callable[[Place, CheckpointManager], str],
    ) -> tuple[list[str], list[list[str]]]:
        """Steps 1, 2 and 3 (step 2 with late metrics), copied afresh into a new directory for
        each N; `operation` runs on a writer's storage and the process dies at its N-th change
        of what is stored, for every N until the operation completes. After each, the lock
        goes with the dead process, a new writable manager opens the directory, and `check`
        says what it found. Returns those findings (the last one the completed operation's),
        and for each N the keys left that belong to no listed step (none, if the writer's start
        cleaned up all that the crash left)."""
        origin = places("origin")
        with origin.writer() as mgr:
            for step in (1, 2, 3):
                mgr.save(step, items(step), metrics={"loss": 1.0 / step})
            mgr.record_metrics(2, {"eval": 0.5})
        dump = origin.raw.dump()
        crasher = Crasher()
        self.install_crashes(monkeypatch, crasher)
        found: list[str] = []
        strays: list[list[str]] = []
        for n in itertools.count(1):
            assert n < 100, "the operation never completed"
            place = places(f"crash-{n}")
            place.raw.write_many(dump)
            storage = place.storage()
            storage.acquire()
            crasher.arm(n)
            try:
                operation(storage)
                completed = True
            except Crash:
                completed = False
            finally:
                crasher.disarm()
                storage.release()  # the lock dies with the process
                storage.close()
            with place.writer() as mgr:  # the next start: takes the lock, cleans up
                found.append(check(place, mgr))
                assert mgr.verify(1) == [] and mgr.verify(3) == []
                check_restored(mgr.restore(1), 1, live=["state", "extra"])
                check_restored(mgr.restore(3), 3, live=["state", "extra"])
                metrics = [2] if 2 in mgr.all_steps() else []
                want = stored_keys(mgr, metrics=metrics, lock=True)
                have = place.raw.all_keys()
                assert set(want) <= set(have), (n, sorted(set(want) - set(have)))
                strays.append(sorted(set(have) - set(want)))
            if completed:
                return found, strays
        raise AssertionError("unreachable")


class PosixBackend(StorageContract):
    claims_at_prepare = False
    lock_stays = True
    shares_deletion = False
    listing_s_per_step = 0.005

    @pytest.fixture
    def places(self, tmp_path: Path) -> Callable[[str], Place]:
        def make(name: str) -> Place:
            return Place(tmp_path / name, PosixRaw(tmp_path / name), PosixRaw(tmp_path))

        return make

    def can_store(self, key: str) -> bool:
        return ".." not in key.split("/")

    def install_crashes(self, monkeypatch: pytest.MonkeyPatch, crasher: Crasher) -> None:
        """Every change: renames and replacements, removals (those of shutil.rmtree too),
        and each fsync (of a file, or of a directory's entries)."""
        for name in ("rename", "replace", "unlink", "rmdir", "fsync"):
            original = getattr(os, name)

            def crashing(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                crasher.point()
                return _original(*args, **kwargs)

            monkeypatch.setattr(os, name, crashing)

    @contextlib.contextmanager
    def watch(self, place: Place) -> Iterator[list[str]]:
        """Every file opened, removed or renamed (an audit hook, which sees Python's file
        calls) beside the directory, links resolved."""
        assert isinstance(place.directory, Path)
        if not _AUDITING:
            sys.addaudithook(_audit)  # for the rest of the process: hooks cannot be removed
            _AUDITING.append(True)
        inside = os.path.realpath(place.directory)
        around = os.path.dirname(inside)
        touched: list[str] = []

        def check(event: str, path: Any) -> None:
            if isinstance(path, int):
                return
            real = os.path.realpath(os.fsdecode(path))
            within = real == inside or real.startswith(inside + os.sep)
            if real.startswith(around + os.sep) and not within:
                touched.append(f"{event} {real}")

        _AUDIT.append(check)
        try:
            yield touched
        finally:
            _AUDIT.remove(check)


_AUDIT: list[Callable[[str, Any], None]] = []  # the checks of the watches open now
_AUDITING: list[bool] = []  # whether the hook is installed
_AUDITED = {"open", "os.remove", "os.rmdir", "os.rename", "shutil.rmtree"}


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _AUDIT and event in _AUDITED:
        for check in list(_AUDIT):
            check(event, args[0])
            if event == "os.rename":
                check(event, args[1])


class ObjectStoreBackend(StorageContract):
    """Backends over TensorStore's kvstore; keys may hold any characters, dot segments too."""

    claims_at_prepare = True
    lock_stays = False
    shares_deletion = True

    def install_crashes(self, monkeypatch: pytest.MonkeyPatch, crasher: Crasher) -> None:
        """Every write and delete of an object; a range deletion can also die half-way."""
        write, delete, delete_range = (
            ObjectStore.write,
            ObjectStore.delete,
            ObjectStore.delete_range,
        )

        def crashing_write(self: ObjectStore, *args: Any, **kwargs: Any) -> Any:
            crasher.point()
            return write(self, *args, **kwargs)

        def crashing_delete(self: ObjectStore, *args: Any, **kwargs: Any) -> None:
            crasher.point()
            delete(self, *args, **kwargs)

        def crashing_delete_range(self: ObjectStore, start: str, stop: str) -> None:
            crasher.point()
            if crasher.dies_here():  # after the first half of the keys (in key order) went
                doomed = [k for k in self.list_keys() if start <= k < stop]
                for key in doomed[: len(doomed) // 2]:
                    delete(self, key)
                raise Crash("crash half-way through a range deletion")
            delete_range(self, start, stop)

        monkeypatch.setattr(ObjectStore, "write", crashing_write)
        monkeypatch.setattr(ObjectStore, "delete", crashing_delete)
        monkeypatch.setattr(ObjectStore, "delete_range", crashing_delete_range)

    @contextlib.contextmanager
    def watch(self, place: Place) -> Iterator[list[str]]:
        """Every key the storage asks for that is not a plain path of names (a dot segment
        could resolve outside the prefix)."""
        touched: list[str] = []
        with pytest.MonkeyPatch.context() as monkeypatch:
            for name in ("read", "read_with_generation", "read_prefix", "write", "delete"):
                monkeypatch.setattr(
                    ObjectStore, name, _watched(getattr(ObjectStore, name), touched)
                )
            yield touched


def _watched(method: Callable[..., Any], touched: list[str]) -> Callable[..., Any]:
    def watched(self: ObjectStore, key: str, *args: Any, **kwargs: Any) -> Any:
        if any(part in ("", ".", "..") for part in key.split("/")):
            touched.append(f"{method.__name__} {key}")
        return method(self, key, *args, **kwargs)

    return watched


class MemoryBackend(ObjectStoreBackend):
    listing_s_per_step = 0.005

    @pytest.fixture
    def places(self) -> Callable[[str], Place]:
        root = f"memory://m-{uuid.uuid4().hex[:12]}"

        def make(name: str) -> Place:
            return Place(f"{root}/{name}", KvRaw(f"{root}/{name}"), KvRaw(root))

        return make


class S3Backend(ObjectStoreBackend):
    many = 1_000
    rounds = 12

    @pytest.fixture
    def places(self, s3_bucket: str, s3_endpoint: str) -> Callable[[str], Place]:
        root = f"{s3_bucket}/run"

        def make(name: str) -> Place:
            url = f"{root}/{name}"
            return Place(url, S3Raw(url, s3_endpoint), S3Raw(root, s3_endpoint))

        return make


GCS_CONDITIONS = (
    "fake-gcs-server ignores ifGenerationMatch on TensorStore's uploads and deletes "
    "(tests/manager/test_gcs_emulator.py), so a second claim of a step is not refused"
)


class GcsBackend(ObjectStoreBackend):
    many = 1_000
    rounds = 12

    @pytest.fixture
    def places(self, gcs_bucket: str) -> Callable[[str], Place]:
        root = f"{gcs_bucket}/run"

        def make(name: str) -> Place:
            return Place(f"{root}/{name}", KvRaw(f"{root}/{name}"), KvRaw(root))

        return make
