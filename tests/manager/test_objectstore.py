"""Checkpoint directories in S3, against a real S3 server process (moto) on 127.0.0.1: what is
particular to object stores (the URL forms, storage_options, real writer processes,
steps copied between a disk and a bucket). What every backend must do is in tests/contracts/ (the
lease: test_storage_writer_hold.py)."""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import Gate
from support.countproxy import CountingProxy
from support.iterutil import Shuffled, advanced, take
from support.objectstore import hold
from support.s3util import s3_env
from support.treeutil import assert_tree_equal

from cairn.handlers import InMemoryHandler
from cairn.manager import (
    CheckpointManager,
    CommitError,
    KeepLatest,
    StepNotFoundError,
)
from cairn.manager._format import MANIFEST
from cairn.manager._storage import objectstore
from cairn.manager._storage.lease import LEASE
from cairn.manager._storage.objectstore import ObjectStore, StorageOptions

TESTS = Path(__file__).parents[1]


def state(step: int) -> dict[str, Any]:
    return {"w": np.arange(3000.0).reshape(30, 100) * step, "step": step}


def start_writer(url: str, endpoint: str, *args: str) -> subprocess.Popen[str]:
    """The crash-test writer saving to `url` (async, KeepLatest(2)) with the server's credentials."""
    return subprocess.Popen(
        [sys.executable, str(TESTS / "crash_writer.py"), url, "--keep-latest", "2", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=s3_env(endpoint),
    )


def test_save_restore_retention_and_metrics(s3_bucket: str) -> None:
    url = f"{s3_bucket}/runs/a"
    keep = KeepLatest(2)
    with CheckpointManager(url, keep=keep, keep_items={"data": KeepLatest(1)}) as mgr:
        assert mgr.directory == url
        for step in range(1, 5):
            mgr.save(
                step,
                {"state": state(step), "data": advanced(Shuffled(), step)},
                metrics={"loss": 1.0 / step},
            )
        mgr.record_metrics(4, {"eval": 0.5})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [3, 4]
        assert mgr.info(3).items["data"].dropped and not mgr.info(4).items["data"].dropped
        assert mgr.info(4).path == f"{url}/checkpoint_4"
        got = mgr.restore(items={"state": None, "data": Shuffled()})
        assert_tree_equal(got["state"], state(4))
        assert take(got["data"]) == take(advanced(Shuffled(), 4))
    with CheckpointManager(url, read_only=True, best=("loss", "min")) as reader:
        assert reader.all_steps() == [3, 4]
        assert reader.metrics(4) == {"loss": 0.25, "eval": 0.5}
        assert reader.best_step() == 4
        assert_tree_equal(reader.restore(3)["state"], state(3))
        assert reader.verify(4) == []
    store = ObjectStore(url, StorageOptions())
    keys = store.list_keys()
    assert all(k.startswith(("checkpoint_3/", "checkpoint_4/")) for k in keys), keys
    assert not [k for k in keys if "/data/" in k and k.startswith("checkpoint_3/")]


@pytest.mark.parametrize(
    ("given", "directory"),
    [
        ("{bucket}", "{bucket}"),
        ("{bucket}/", "{bucket}"),
        ("{bucket}/runs/a/", "{bucket}/runs/a"),
        ("{bucket}//runs/a", "{bucket}/runs/a"),
    ],
)
def test_url_forms(s3_bucket: str, given: str, directory: str) -> None:
    """A bucket alone, or a prefix, with or without slashes around it: one directory, named
    without them, its steps at <directory>/checkpoint_<n>."""
    url, want = given.format(bucket=s3_bucket), directory.format(bucket=s3_bucket)
    with CheckpointManager(url) as mgr:
        assert mgr.directory == want
        mgr.save(1, {"state": state(1)})
        mgr.wait_until_finished()
        assert mgr.info(1).path == f"{want}/checkpoint_1"
    with CheckpointManager(want, read_only=True) as reader:
        assert_tree_equal(reader.restore(1)["state"], state(1))
    keys = ObjectStore(s3_bucket, StorageOptions()).list_keys()
    prefix = want.removeprefix(s3_bucket).strip("/")
    assert f"{prefix}/checkpoint_1/{MANIFEST}".lstrip("/") in keys, keys


@pytest.mark.parametrize(
    "url", ["s3://", "s3:///x", "gs://", "memory://", "ftp://host/x", "file:///tmp/x", "S3://b/x"]
)
def test_urls_that_are_no_directory(url: str) -> None:
    with pytest.raises(ValueError, match="object stores are s3://bucket/prefix"):
        CheckpointManager(url)


def test_explicit_endpoint(
    s3_bucket: str, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    with CheckpointManager(s3_bucket, storage_options={"endpoint": s3_endpoint}) as mgr:
        mgr.save(1, {"state": state(1)})
    with CheckpointManager(
        s3_bucket, read_only=True, storage_options={"endpoint": s3_endpoint, "region": None}
    ) as r:
        assert r.all_steps() == [1]


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"bucket": "x"}, ValueError, r"unknown keys \['bucket'\] \(known: endpoint, region\)"),
        ({"endpoint": ""}, ValueError, r"storage_options\['endpoint'\] must be a non-empty str"),
        ({"region": 1}, ValueError, r"storage_options\['region'\] must be a non-empty str"),
        (["endpoint"], TypeError, "storage_options must be a mapping"),
    ],
)
def test_bad_storage_options(s3_bucket: str, options: Any, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        CheckpointManager(s3_bucket, storage_options=options)
    assert ObjectStore(s3_bucket, StorageOptions()).list_keys() == []  # no lease was taken


def test_storage_options_that_do_not_apply(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="apply to object stores"):
        CheckpointManager(tmp_path, storage_options={"region": "us-east-1"})
    with pytest.raises(ValueError, match="for gs:// the endpoint comes from TENSORSTORE_GCS"):
        CheckpointManager("gs://bucket/x", storage_options={"region": "us-east-1"})
    with pytest.raises(ValueError, match="for gs:// the endpoint comes from TENSORSTORE_GCS"):
        CheckpointManager("gs://bucket/x", storage_options={"endpoint": "http://127.0.0.1:1"})
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("incremental", [False, True])
def test_sigkill_of_the_writer_leaves_only_whole_steps(
    s3_bucket: str, s3_endpoint: str, incremental: bool
) -> None:
    """A real writer process saving to the bucket, SIGKILLed three times at random moments; each
    restart takes over the dead writer's lease, removes what the kill left uncommitted, and every
    listed step restores equal to what was saved. With incremental saves, the kills land among
    server-side copies too, and each restarted writer copies the dead one's files."""
    from crash_writer import expected_state

    url = f"{s3_bucket}/crash"
    previous = -1
    copied = 0
    for trial in range(3):
        proc = start_writer(url, s3_endpoint, *(["--incremental"] if incremental else []))
        assert proc.stdout is not None
        for _ in range(2 + trial):  # let it save a few steps, then kill it mid-way
            assert proc.stdout.readline().startswith("saved"), proc.stderr.read()  # type: ignore[union-attr]
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        with CheckpointManager(url) as mgr:  # a writer: takes the lease, cleans up
            steps = mgr.all_steps()
            assert steps and steps[-1] > previous, (steps, previous)
            for step in steps:
                assert_tree_equal(mgr.restore(step, fallback=False)["state"], expected_state(step))
                assert mgr.verify(step) == []
                tm = mgr.info(step).telemetry
                copied += tm["bytes_written"] < tm["bytes"]
            previous = steps[-1]
        store = ObjectStore(url, StorageOptions())
        prefixes = {k.split("/")[0] for k in store.list_keys()}
        assert prefixes == {f"checkpoint_{s}" for s in steps}, prefixes  # no uncommitted leftovers
    assert (copied > 0) == incremental  # every step but a run's first copies the frozen leaf


def test_reader_beside_the_writer(s3_bucket: str, s3_endpoint: str) -> None:
    from crash_writer import expected_state

    url = f"{s3_bucket}/live"
    writer = start_writer(url, s3_endpoint)
    assert writer.stdout is not None
    restored = 0
    try:
        assert writer.stdout.readline().startswith("saved")
        with CheckpointManager(url, read_only=True) as reader:
            while restored < 15:
                reader.reload()
                for step in reader.all_steps():
                    try:
                        got = reader.restore(step, fallback=False)
                    except StepNotFoundError:
                        continue
                    assert_tree_equal(got["state"], expected_state(step))
                    restored += 1
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.communicate()


def test_a_step_copied_from_disk_to_the_bucket_and_back(s3_bucket: str, tmp_path: Path) -> None:
    """The layout is the same on disk and in a bucket: a step copied file by file (as by
    `aws s3 cp --recursive`) restores in either place."""
    local = tmp_path / "local"
    with CheckpointManager(local) as mgr:
        mgr.save(5, {"state": state(5), "data": advanced(Shuffled(), 5)})
    url = f"{s3_bucket}/copied"
    store = ObjectStore(url, StorageOptions())
    for path in sorted((local / "checkpoint_5").rglob("*")):
        if path.is_file():
            store.write(path.relative_to(local).as_posix(), path.read_bytes())
    with CheckpointManager(url, read_only=True) as reader:
        got = reader.restore(5, {"state": None, "data": Shuffled()})
        assert_tree_equal(got["state"], state(5))
        assert take(got["data"]) == take(advanced(Shuffled(), 5))
        assert reader.verify(5) == []
    back = tmp_path / "back"
    for key in store.list_keys("checkpoint_5/"):
        data = store.read(key)
        assert data is not None
        (back / key).parent.mkdir(parents=True, exist_ok=True)
        (back / key).write_bytes(data)
    with CheckpointManager(back, read_only=True) as reader:
        assert_tree_equal(reader.restore(5)["state"], state(5))
        assert reader.verify(5) == []


def test_cairn_verify_on_a_bucket(s3_bucket: str, s3_endpoint: str) -> None:
    url = f"{s3_bucket}/cli"
    with CheckpointManager(url) as mgr:
        mgr.save(1, {"state": state(1)})
    cairn = str(Path(sys.executable).with_name("cairn"))
    out = subprocess.run(
        [cairn, "verify", url], capture_output=True, text=True, env=s3_env(s3_endpoint), timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["step 1: ok", "1 step checked, 0 damaged"]
    store = ObjectStore(url, StorageOptions())
    key = next(k for k in store.list_keys() if k.endswith("tree.json"))
    store.write(key, b"{}")  # damaged in place
    out = subprocess.run(
        [cairn, "verify", url], capture_output=True, text=True, env=s3_env(s3_endpoint), timeout=120
    )
    assert out.returncode == 1 and "tree.json" in out.stdout


def test_a_writer_leaves_foreign_prefixes_alone(s3_bucket: str) -> None:
    """Only prefixes cairn claimed count as its leftovers: an Orbax step (or anything else) in the
    same bucket prefix is never deleted by a starting writer."""
    url = f"{s3_bucket}/shared"
    store = ObjectStore(url, StorageOptions())
    store.write("checkpoint_7/commit_success.txt", b"")
    store.write("checkpoint_7/state/_METADATA", b"{}")
    store.write("checkpoint_8/.claim", b"crashed")  # a save by an older cairn that died
    store.write("checkpoint_8/state/tree.json", b"{}")
    store.write(f"checkpoint_9/{MANIFEST}", b'{"cairn_claim": "saving", "id": "0"}')  # this one
    store.write("checkpoint_9/state/tree.json", b"{}")
    with CheckpointManager(url, read_only=True) as reader:
        assert reader.all_steps() == [7]  # an Orbax step, read in place (test_layouts.py)
    with CheckpointManager(url) as mgr:
        assert mgr.all_steps() == [7]
    keys = store.list_keys()
    assert "checkpoint_7/state/_METADATA" in keys
    assert not [k for k in keys if k.startswith(("checkpoint_8/", "checkpoint_9/"))]


def test_a_crash_inside_a_delete_is_cleaned_at_the_next_start(s3_bucket: str) -> None:
    url = f"{s3_bucket}/delcrash"
    with CheckpointManager(url) as mgr:
        for step in (1, 2):
            mgr.save(step, {"state": state(step)})
    store = ObjectStore(url, StorageOptions())
    store.write("checkpoint_1/.claim", b"deleting")  # what delete_step does first,
    store.delete("checkpoint_1/_CHECKPOINT.json")  # and second; then the process died
    with CheckpointManager(url) as mgr:
        assert mgr.all_steps() == [2]
    assert store.list_keys("checkpoint_1/") == []


def test_a_writer_opens_with_one_listing(
    s3_bucket: str, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A starting writer's clean-up lists the bucket and reads every step's manifest; the
    steps it knows come from that listing, not from a second one (0.09 s of every restart on
    moto). A leftover claimed prefix is still removed (which lists that prefix alone)."""
    url = f"{s3_bucket}/once"
    with CheckpointManager(url) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"state": state(step)})
    store = ObjectStore(url, StorageOptions())
    store.write(f"checkpoint_4/{MANIFEST}", b'{"cairn_claim": "saving", "id": "0"}')
    store.write("checkpoint_4/state/tree.json", b"{}")
    with CountingProxy(s3_endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        with CheckpointManager(url) as mgr:
            assert mgr.all_steps() == [1, 2, 3]
            opened = proxy.requests()
    lists = [r for r in opened if "list-type=2" in r.query and r.query.endswith("prefix=once%2F")]
    manifests = [r.path for r in opened if r.method == "GET" and r.path.endswith(MANIFEST)]
    assert len(lists) == 1, lists
    for step in (1, 2, 3):
        assert manifests.count(f"/{url.split('/')[2]}/once/checkpoint_{step}/{MANIFEST}") == 1
    assert store.list_keys("checkpoint_4/") == []


@pytest.mark.parametrize(
    ("lost", "nth"),
    [("the claim", 0), ("the manifest", 1), ("the lease taken", 0), ("the lease refreshed", 1)],
)
def test_a_conditional_write_whose_answer_was_lost_is_known_as_ours(
    s3_bucket: str, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch, lost: str, nth: int
) -> None:
    """The server does a conditional PUT but its answer is lost on the way back (a 503 from a
    proxy, here), so TensorStore sends it again, and the retry's condition fails on the first
    one's result. The writer reads the key back, finds its own bytes, and goes on: the save
    commits, and no racing writer is imagined (the claim: StepAlreadyExistsError; the
    manifest: DirectoryLockedError; the lease: "another writer took the lease first")."""
    url = f"{s3_bucket}/lost-{nth}"
    key = f"checkpoint_1/{MANIFEST}" if "lease" not in lost else LEASE
    puts = 0

    def matches(method: str, path: str) -> bool:
        nonlocal puts
        if method != "PUT" or not path.endswith(f"/{key}"):
            return False
        puts += 1
        return puts == nth + 1

    with CountingProxy(s3_endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        proxy.lose_answer(matches)
        with CheckpointManager(url) as mgr:
            mgr.save(1, {"state": state(1)})
            mgr.wait_until_finished()
            assert mgr.all_steps() == [1]
            assert_tree_equal(mgr.restore(1)["state"], state(1))
        answered = [r.status for r in proxy.requests() if r.path.endswith(f"/{key}")]
    assert 503 in answered, answered  # the answer was lost, and the write retried


def test_a_step_committed_after_the_clean_up_listed_it_is_kept_and_listed(
    s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefix that was only claimed when the starting writer listed the bucket, and holds
    its manifest when the clean-up looks at it again (a writer that lost its lease committed
    meanwhile), stays, and is among the steps the writer knows."""
    url = f"{s3_bucket}/meanwhile"
    with CheckpointManager(url) as mgr:
        for step in (1, 2):
            mgr.save(step, {"state": state(step)})
    store = ObjectStore(url, StorageOptions())
    committed = store.read(f"checkpoint_2/{MANIFEST}")
    assert committed is not None
    store.write(f"checkpoint_2/{MANIFEST}", b'{"cairn_claim": "saving", "id": "0"}')
    listing = objectstore.KvStorage._scan

    def then_commit(self: Any, *args: Any) -> Any:
        found = listing(self, *args)
        store.write(f"checkpoint_2/{MANIFEST}", committed)  # after the listing, before the look
        return found

    monkeypatch.setattr(objectstore.KvStorage, "_scan", then_commit)
    with CheckpointManager(url) as mgr:
        assert mgr.all_steps() == [1, 2]
        monkeypatch.undo()
        assert_tree_equal(mgr.restore(2)["state"], state(2))


@pytest.mark.parametrize("removed", ["the claim", "the claimed prefix"])
def test_a_save_whose_claim_was_removed_commits_nothing(
    s3_bucket: str, gate: Gate, monkeypatch: pytest.MonkeyPatch, removed: str
) -> None:
    """Another writer deletes the claim of a step being saved (or the whole prefix) while the
    writer still holds its lease: the manifest, which may only replace that claim, is not
    written, and nothing of the step is listed."""
    url = f"{s3_bucket}/unclaimed"
    store = ObjectStore(url, StorageOptions())
    handler = InMemoryHandler()
    with CheckpointManager(url, handlers={"x": handler}) as a:
        hold("after the upload", gate, monkeypatch)
        a.save(1, {"state": state(1), "x": "first"})
        assert gate.entered.wait(60)
        if removed == "the claim":
            store.delete(f"checkpoint_1/{MANIFEST}")
        else:
            store.delete_prefix("checkpoint_1/")
        gate.release.set()
        with pytest.raises(CommitError, match="removed or replaced by another writer"):
            a.wait_until_finished()
        assert a.all_steps() == []
        with CheckpointManager(url, read_only=True) as reader:
            assert reader.all_steps() == []
        a.save(1, {"state": state(1), "x": "second"})  # the lease is intact: saves go on
        a.wait_until_finished()
        assert a.all_steps() == [1] and a.restore(1)["x"] == "second"


# ---------------------------------------------------------------------------- issue 43, point 7


@pytest.mark.parametrize(
    ("backend", "read_only"), [("s3", True), ("s3", False), ("gs", False)]
)  # fake-gcs-server lists a missing bucket as an empty one: a reader sees no step there
def test_a_missing_bucket_is_one_line(
    request: pytest.FixtureRequest, backend: str, read_only: bool
) -> None:
    """A bucket that does not exist: one line naming it and the remedy, not the service's XML
    or JSON; a writable open on S3 used to say "another writer took the lease first" (its
    conditional write of the lease was refused)."""
    bucket = request.getfixturevalue("s3_bucket" if backend == "s3" else "gcs_bucket")
    missing = f"{backend}://nobucket-{uuid.uuid4().hex[:8]}/run"
    del bucket  # the fixture points the environment at the server
    with pytest.raises(ValueError, match=r"the bucket 'nobucket-\w+' does not exist at http") as e:
        CheckpointManager(missing, read_only=read_only)
    assert "<" not in str(e.value) and "\n" not in str(e.value)


def test_an_unreachable_endpoint_says_what_it_waits_for(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing answers at the endpoint: TensorStore retries for many minutes, silently. cairn
    says what it waits for after WATCH_S, and gives up after OPEN_TIMEOUT_S (shortened here)
    with ConnectionError naming the URL, the endpoint and what to check."""
    from cairn.manager._storage import kvstore as _kvstore

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setattr(_kvstore, "WATCH_S", 1.0)
    monkeypatch.setattr(_kvstore, "OPEN_TIMEOUT_S", 3.0)
    started = time.monotonic()
    with (
        caplog.at_level(logging.WARNING, "cairn"),
        pytest.raises(ConnectionError, match="did not answer within 3 s: check the endpoint"),
    ):
        CheckpointManager("s3://some-bucket/run", read_only=True)
    assert time.monotonic() - started < 60
    assert (
        f"s3://some-bucket/run at http://127.0.0.1:{port} has not answered for 1 s" in caplog.text
    )


def test_the_command_line_says_a_missing_bucket_in_one_line(s3_bucket: str) -> None:
    cairn = str(Path(sys.executable).with_name("cairn"))
    missing = f"s3://nobucket-{uuid.uuid4().hex[:8]}/run"
    out = subprocess.run([cairn, "ls", missing], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    (line,) = out.stderr.splitlines()
    assert line.startswith(f"cairn: error: {missing}: the bucket ") and "does not exist" in line
