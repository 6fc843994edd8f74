"""Foreign layouts on every storage (manager/_layouts): steps that the real orbax-checkpoint wrote,
copied key by key into a bucket (moto's S3, fake-gcs-server's GCS, the in-memory kvstore), are
listed, read and restored there as on a local disk, read-only; crafted keys and metadata in the
bucket are handled as on POSIX (tests/test_untrusted_foreign.py)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import boto3
import numpy as np
import pytest
from support.s3util import s3_env
from test_orbax_interop import assert_tree, write_orbax

from cairn.manager import (
    CheckpointManager,
    CorruptCheckpointError,
    KeepBest,
    KeepLatest,
    ReadOnlyError,
)
from cairn.manager._layouts.base import MAX_READ, LocalStepView
from cairn.manager._layouts.orbax import orbax_step
from cairn.manager._storage.objectstore import ObjectStore, StorageOptions


@pytest.fixture(scope="module")
def orbax_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Orbax steps 1, 2, 3: item "state" (StandardSave, OCDBT), metrics/metrics, no prefix."""
    root = tmp_path_factory.mktemp("orbax") / "run"
    write_orbax(root, [1, 2, 3])
    return root


def upload(local: Path, url: str) -> ObjectStore:
    """Every file under `local`, one object each, keys relative to it (as ``gsutil cp -r``)."""
    store = ObjectStore(url, StorageOptions())
    for path in sorted(local.rglob("*")):
        if path.is_file():
            store.write(path.relative_to(local).as_posix(), path.read_bytes())
    return store


@pytest.fixture(params=["s3", "gcs", "memory"])
def bucket(request: pytest.FixtureRequest) -> str:
    if request.param == "memory":
        return f"memory://layouts-{os.urandom(6).hex()}"
    return str(request.getfixturevalue(f"{request.param}_bucket"))


def downloads(mgr: CheckpointManager) -> list[str]:
    """What is left of the private downloads of foreign items (none once a restore is done)."""
    local = mgr._storage._local  # type: ignore[attr-defined]
    return [] if local is None else sorted(os.listdir(local))


def test_orbax_steps_in_a_bucket_are_listed_read_and_restored(orbax_run: Path, bucket: str) -> None:
    url = f"{bucket}/run"
    upload(orbax_run, url)
    with CheckpointManager(url, read_only=True, step_prefix="", best=("loss", "min")) as mgr:
        assert mgr.all_steps() == [1, 2, 3]
        assert mgr.best_step() == 3  # from Orbax's metrics
        assert mgr.metrics(2) == {"loss": 1.0 / 3}
        info = mgr.info(3)
        assert info.metadata["format"] == "orbax"
        assert info.items["state"].handler == "orbax.pytree"
        assert 0 < info.committed_at < 2**40  # Orbax's commit time: a bucket keeps none
        assert_tree(mgr.restore()["state"], 3)  # bit-exact: assert_array_equal
        assert_tree(mgr.restore(1)["state"], 1)
        assert downloads(mgr) == []
        assert mgr.verify(2) == []
        assert mgr.describe(2)["state"]["path"] == f"{url}/2/state"


def test_a_writer_never_changes_orbax_steps_in_a_bucket(orbax_run: Path, s3_bucket: str) -> None:
    url = f"{s3_bucket}/mixed"
    store = upload(orbax_run, url)
    before = store.list_keys()
    with CheckpointManager(url, step_prefix="", keep=KeepLatest(1), best=("loss", "min")) as mgr:
        assert mgr.best_step() == 3
        for step in (4, 5, 6):
            mgr.save(step, {"s": {"w": np.ones(2)}}, metrics={"loss": 1.0})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 2, 3, 6]  # retention leaves Orbax steps alone
        with pytest.raises(ReadOnlyError, match="written by orbax-checkpoint"):
            mgr.delete(1)
        with pytest.raises(ReadOnlyError, match="written by orbax-checkpoint"):
            mgr.record_metrics(2, {"eval": 1.0})
        assert_tree(mgr.restore(3)["state"], 3)
    with CheckpointManager(url, step_prefix="", keep=KeepLatest(1)) as mgr:  # clean at start
        assert mgr.all_steps() == [1, 2, 3, 6]
    assert set(before) <= set(store.list_keys())


def test_the_naming_hint_finds_orbax_steps_in_a_bucket(orbax_run: Path, s3_bucket: str) -> None:
    url = f"{s3_bucket}/named"
    store = upload(orbax_run, url)
    before = store.list_keys()
    with pytest.raises(ValueError, match="written by orbax-checkpoint") as raised:
        CheckpointManager(url, read_only=True)
    assert "CheckpointManager(..., step_prefix='')" in str(raised.value)
    with pytest.raises(ValueError, match="written by orbax-checkpoint"):
        CheckpointManager(url)
    assert store.list_keys() == before


def test_an_orbax_save_in_progress_in_a_bucket_is_no_step(orbax_run: Path, s3_bucket: str) -> None:
    """Orbax writes a step in place on an object store and marks it done at the end (the commit
    time in _CHECKPOINT_METADATA, or commit_success.txt): before that it is no step, and no
    writer removes it."""
    url = f"{s3_bucket}/partial"
    store = upload(orbax_run, url)
    store.write("2/_CHECKPOINT_METADATA", b'{"init_timestamp_nsecs": 1}')  # not finalized
    store.delete("2/commit_success.txt")
    with CheckpointManager(url, step_prefix="") as mgr:
        assert mgr.all_steps() == [1, 3]
    assert "2/state/_METADATA" in store.list_keys()
    store.write("2/commit_success.txt", b"")  # done, as Orbax marks it on GCS
    with CheckpointManager(url, read_only=True, step_prefix="") as mgr:
        assert mgr.all_steps() == [1, 2, 3]
        assert_tree(mgr.restore(2)["state"], 2)


def test_the_same_view_on_disk_and_in_a_bucket(orbax_run: Path) -> None:
    """One implementation: the manifest read through a local directory's view and through a
    bucket's keys is the same (but for times: a bucket's listing has none)."""
    url = f"memory://layouts-{os.urandom(6).hex()}"
    upload(orbax_run, url)
    with CheckpointManager(url, read_only=True, step_prefix="") as mgr:
        remote = mgr.info(2)
    local = orbax_step(2, LocalStepView(orbax_run / "2"))
    assert local is not None
    assert {n: e.handler for n, e in local.items.items()} == {
        n: i.handler for n, i in remote.items.items()
    }
    assert local.metrics == remote.metrics and local.committed_at == remote.committed_at


# ---------------------------------------------------------------------------- crafted buckets


def test_bad_step_metadata_in_a_bucket_is_ignored_with_a_warning(
    orbax_run: Path, s3_bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"{s3_bucket}/badmeta"
    store = upload(orbax_run, url)
    store.write("2/_CHECKPOINT_METADATA", b"{not json")
    store.write("2/commit_success.txt", b"")
    store.write("3/_CHECKPOINT_METADATA", b'{"commit_timestamp_nsecs": 5, "pad": "')
    store.delete("3/commit_success.txt")
    store.write("1/_CHECKPOINT_METADATA", b" " * MAX_READ + b"{}")  # too long to read
    store.write("1/commit_success.txt", b"")
    with (
        caplog.at_level(logging.WARNING, logger="cairn"),
        CheckpointManager(url, read_only=True, step_prefix="") as mgr,
    ):
        # 3 has no commit mark left that cairn can read: as an unfinished save, no step
        assert mgr.all_steps() == [1, 2]
        assert mgr.metrics(2) == {"loss": 1.0 / 3}  # from metrics/metrics
        assert mgr.info(2).metadata == {"format": "orbax", "custom_metadata": {}}
        assert mgr.info(1).committed_at == 0.0  # no time anywhere: a bucket keeps none
        assert_tree(mgr.restore(2)["state"], 2)
    assert "Orbax step 2" in caplog.text and "does not parse" in caplog.text
    assert "Orbax step 1" in caplog.text and "longer than" in caplog.text


def test_an_item_with_a_bad_name_in_a_bucket_is_left_out(
    orbax_run: Path, bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"{bucket}/badname"
    store = upload(orbax_run, url)
    for name in ("with space", "x" * 200, ".hidden", "_CHECKPOINT.json"):
        store.write(f"2/{name}/_METADATA", b"{}")
    with (
        caplog.at_level(logging.WARNING, logger="cairn"),
        CheckpointManager(url, read_only=True, step_prefix="") as mgr,
    ):
        assert set(mgr.info(2).items) == {"state"}
        assert_tree(mgr.restore(2)["state"], 2)
    assert "ignoring an item directory" in caplog.text


def keys_with_dots(store: ObjectStore, url: str) -> list[str]:
    """Keys with '..' segments written into the bucket as they are, if the client allows it:
    boto3 for S3 (TensorStore's HTTP client collapses them), the kvstore itself in memory."""
    keys = ["2/state/../../escape", "2/state/d/../x"]
    if url.startswith("s3://"):
        bucket, _, prefix = url[len("s3://") :].partition("/")
        client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
        for key in keys:
            client.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=b"x")
    else:
        for key in keys:
            store.write(key, b"x")
    return [k for k in store.list_keys() if ".." in k.split("/")]


@pytest.mark.parametrize("backend", ["s3", "memory"])
def test_a_key_with_dot_segments_stops_the_download(
    orbax_run: Path, backend: str, request: pytest.FixtureRequest
) -> None:
    """A key such as ``2/state/../../escape`` is not downloaded, nor anything of the item: a
    request for it could reach outside the directory, and a file for it outside the download."""
    bucket = (
        request.getfixturevalue("s3_bucket")
        if backend == "s3"
        else f"memory://layouts-{os.urandom(6).hex()}"
    )
    url = f"{bucket}/dots"
    store = upload(orbax_run, url)
    odd = keys_with_dots(store, url)
    if not odd:
        pytest.skip("the server collapsed the dot segments: no such key to test with")
    with CheckpointManager(url, read_only=True, step_prefix="") as mgr:
        assert mgr.all_steps() == [1, 2, 3]
        with pytest.raises(CorruptCheckpointError, match=r"step 2, item 'state'.*\.\."):
            mgr.restore(2)
        assert downloads(mgr) == []
        assert_tree(mgr.restore(1)["state"], 1)
    with CheckpointManager(url, step_prefix="") as mgr:  # a writer's start leaves them alone
        mgr.save(4, {"s": [1]})
    assert set(odd) <= set(store.list_keys())


def test_a_key_that_is_a_file_and_a_folder_stops_the_download(orbax_run: Path, bucket: str) -> None:
    url = f"{bucket}/clash"
    store = upload(orbax_run, url)
    store.write("2/state/d", b"x")
    store.write("2/state/d/e", b"y")
    with CheckpointManager(url, read_only=True, step_prefix="") as mgr:
        with pytest.raises(CorruptCheckpointError, match=r"step 2, item 'state'.*both"):
            mgr.restore(2)
        assert downloads(mgr) == []


@pytest.mark.parametrize("case", ["damaged _METADATA", "a chunk file missing"])
def test_a_damaged_orbax_item_in_a_bucket_is_corrupt(
    orbax_run: Path, s3_bucket: str, case: str
) -> None:
    url = f"{s3_bucket}/damaged-{case.split()[1]}"
    store = upload(orbax_run, url)
    if case == "damaged _METADATA":
        store.write("2/state/_METADATA", b"{}")
    else:
        for key in store.list_keys("2/state/"):
            if "/d/" in key:
                store.delete(key)
    with CheckpointManager(url, read_only=True, step_prefix="") as mgr:
        with pytest.raises(CorruptCheckpointError, match=r"step 2, item 'state'"):
            mgr.restore(2)
        assert downloads(mgr) == []
        assert_tree(mgr.restore(3)["state"], 3)


@pytest.mark.parametrize("failure", ["vanished", "network"])
def test_a_download_that_fails_leaves_nothing_behind(
    orbax_run: Path, failure: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An object gone between the listing and its GET is damage of that step and item; a
    network error is raised as it is (not damage: no fallback past a whole step). Either way
    the download is removed."""
    url = f"memory://layouts-{os.urandom(6).hex()}/fail"
    upload(orbax_run, url)
    real = ObjectStore.read_chunk

    def read_chunk(self: ObjectStore, key: str, offset: int, size: int) -> bytes | None:
        if key.endswith("/_METADATA") and key.startswith("2/state/"):
            if failure == "vanished":
                return None
            raise ValueError("UNAVAILABLE: connection reset")
        return real(self, key, offset, size)

    monkeypatch.setattr(ObjectStore, "read_chunk", read_chunk)
    with CheckpointManager(url, read_only=True, step_prefix="") as mgr:
        error = CorruptCheckpointError if failure == "vanished" else ValueError
        with pytest.raises(error, match=r"_METADATA|UNAVAILABLE") as raised:
            mgr.restore(2)
        if failure == "vanished":
            assert "step 2, item 'state'" in str(raised.value)
        else:
            assert not isinstance(raised.value, CorruptCheckpointError)
        assert downloads(mgr) == []
        assert_tree(mgr.restore(1)["state"], 1)


def test_best_of_retention_beside_orbax_steps_as_on_disk(
    orbax_run: Path, s3_bucket: str, tmp_path: Path
) -> None:
    """As on disk: best_step reads the Orbax steps' metrics (losses 1/2, 1/3, 1/4) with cairn's,
    and KeepBest ranks cairn's own steps only (the Orbax steps are never its to delete)."""
    local = tmp_path / "run"
    shutil.copytree(orbax_run, local)
    url = f"{s3_bucket}/best"
    store = upload(orbax_run, url)
    before = store.list_keys()
    for directory in (str(local), url):
        with CheckpointManager(
            directory, step_prefix="", keep=KeepBest(2, "loss"), best=("loss", "min")
        ) as mgr:
            for step, loss in ((4, 0.5), (5, 0.4), (6, 0.45), (7, 0.6)):
                mgr.save(step, {"s": [step]}, metrics={"loss": loss})
            mgr.wait_until_finished()
            assert mgr.all_steps() == [1, 2, 3, 5, 6, 7], directory  # 4 ranks third; 7 newest
            assert mgr.best_step() == 3, directory
    assert set(before) <= set(store.list_keys())


def test_the_command_line_on_orbax_steps_in_a_bucket(
    orbax_run: Path, s3_bucket: str, s3_endpoint: str
) -> None:
    url = f"{s3_bucket}/cli"
    upload(orbax_run, url)
    cairn = str(Path(sys.executable).with_name("cairn"))
    env = s3_env(s3_endpoint)
    ls = subprocess.run(
        [cairn, "ls", url, "--step-prefix", "", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert ls.returncode == 0, ls.stderr
    rows = json.loads(ls.stdout)
    assert [(r["step"], r["format"], r["metrics"]) for r in rows] == [
        (1, "orbax", {"loss": 0.5}),
        (2, "orbax", {"loss": 1 / 3}),
        (3, "orbax", {"loss": 0.25}),
    ]
    verify = subprocess.run(
        [cairn, "verify", url, "--step-prefix", ""],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert verify.returncode == 0, verify.stderr
    assert verify.stdout.splitlines()[0] == "step 1: orbax step, no checksums to verify"


def test_folder_markers_in_a_bucket_are_directories(orbax_run: Path) -> None:
    """tf.io.gfile and cloud consoles write zero-byte ``state/`` keys: folders, not files."""
    url = f"memory://layouts-{os.urandom(6).hex()}/markers"
    store = upload(orbax_run, url)
    for key in ("2/", "2/state/", "2/state/d/"):
        store.write(key, b"")
    with CheckpointManager(url, read_only=True, step_prefix="") as mgr:
        assert_tree(mgr.restore(2)["state"], 2)
        assert downloads(mgr) == []
