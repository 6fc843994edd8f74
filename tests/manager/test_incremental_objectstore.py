"""Incremental saves to object stores (``incremental=True`` on ``s3://`` and ``gs://``): a file
whose content the newest committed step already has is a server-side copy of that step's object
(S3 CopyObject, GCS objects.rewrite), so its bytes are not uploaded again and every step stays
whole on its own. Against the real servers of the tests (moto, fake-gcs-server), each behind a
counting proxy that records every request this process sends."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.countproxy import CountingProxy, Request
from support.treeutil import assert_tree_equal

from cairn.handlers.io import KnownFiles
from cairn.manager import CheckpointManager, CorruptCheckpointError, KeepLatest
from cairn.manager._format import MANIFEST
from cairn.manager._storage import objectstore as _objectstore
from cairn.manager._storage.objectstore import ObjectStore, StorageOptions

FROZEN = "state/arrays/0/0"  # the frozen leaf's one chunk ("frozen" sorts before "lora")
LORA = "state/arrays/1/0"
FROZEN_BYTES = 1 << 20

# What the zarr layout writes and shares, file by file (tests/handlers/test_packed.py: packs).
pytestmark = pytest.mark.usefixtures("zarr_layout")


def state(step: int) -> dict[str, Any]:
    return {
        "frozen": jnp.arange(FROZEN_BYTES // 4, dtype=jnp.float32),
        "lora": jnp.full(1000, float(step)),
    }


def host(tree: Any) -> Any:
    return jax.tree.map(np.asarray, tree)


@pytest.fixture(params=["s3", "gs"])
def bucket(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[str, CountingProxy]]:
    """A fresh bucket (s3:// or gs://) whose requests from this process go through a proxy."""
    if request.param == "s3":
        url = request.getfixturevalue("s3_bucket")
        upstream, variable = request.getfixturevalue("s3_endpoint"), "AWS_ENDPOINT_URL"
    else:
        url = request.getfixturevalue("gcs_bucket")
        upstream, variable = request.getfixturevalue("gcs_endpoint"), "TENSORSTORE_GCS_HTTP_URL"
    with CountingProxy(upstream) as proxy:
        monkeypatch.setenv(variable, proxy.url)
        yield f"{url}/run", proxy


def is_copy(r: Request) -> bool:
    # S3: a PUT without a body (x-amz-copy-source names the source); GCS: objects.rewrite
    return "/rewriteTo/" in r.path or (
        r.method == "PUT" and r.sent == 0 and "/checkpoint_" in r.path
    )


def uploaded(requests: list[Request]) -> int:
    return sum(r.sent for r in requests)


def records(url: str, step: int) -> dict[str, dict[str, Any]]:
    data = ObjectStore(url, StorageOptions()).read(f"checkpoint_{step}/{MANIFEST}")
    assert data is not None
    manifest = json.loads(data)
    return {f"{item}/{f['path']}": f for item, e in manifest["items"].items() for f in e["files"]}


def save(mgr: CheckpointManager, proxy: CountingProxy, step: int) -> list[Request]:
    """Save `step` and return the requests that save sent."""
    before = len(proxy.requests())
    mgr.save(step, {"state": state(step)})
    mgr.wait_until_finished()
    return proxy.requests()[before:]


def test_unchanged_files_are_copied_on_the_server(bucket: tuple[str, CountingProxy]) -> None:
    url, proxy = bucket
    with CheckpointManager(url, incremental=True) as mgr:
        sent = {step: save(mgr, proxy, step) for step in (1, 2, 3)}
        assert uploaded(sent[1]) > FROZEN_BYTES
        assert not any(map(is_copy, sent[1]))
        for step in (2, 3):
            got = records(url, step)
            reused = [path for path, r in got.items() if r.get("reused")]
            assert reused == [FROZEN]  # the files under 1 MiB are uploaded (COPY_MIN)
            assert uploaded(sent[step]) < 0.05 * uploaded(sent[1])  # the lora chunk, manifests
            assert sum(map(is_copy, sent[step])) == len(reused)
            # the process knows what it wrote: nothing of the previous step was read back
            assert sum(r.received for r in sent[step]) < FROZEN_BYTES // 10
            tm = mgr.info(step).telemetry
            assert tm["bytes_written"] < 0.01 * tm["bytes"]
        for step in (1, 2, 3):
            assert_tree_equal(host(mgr.restore(step)["state"]), host(state(step)))
            assert mgr.verify(step) == []
        mgr.delete(1)
        mgr.delete(2)  # the steps step 3 copied from: it holds its own objects
        assert_tree_equal(host(mgr.restore(3)["state"]), host(state(3)))
        assert mgr.verify(3) == []


def test_an_object_replaced_since_it_was_written_is_uploaded_again(
    bucket: tuple[str, CountingProxy],
) -> None:
    url, proxy = bucket
    store = ObjectStore(url, StorageOptions())
    with CheckpointManager(url, incremental=True) as mgr:
        save(mgr, proxy, 1)
        data = bytearray(store.read(f"checkpoint_1/{FROZEN}") or b"")
        data[100] ^= 0xFF  # same size, other content: the manifest's hash no longer holds
        store.write(f"checkpoint_1/{FROZEN}", bytes(data))
        sent = save(mgr, proxy, 2)
        assert "reused" not in records(url, 2)[FROZEN]
        assert uploaded(sent) > FROZEN_BYTES
        assert_tree_equal(host(mgr.restore(2)["state"]), host(state(2)))
        with pytest.raises(CorruptCheckpointError, match=r"step 1"):
            mgr.restore(1)


def test_a_new_process_reads_an_object_once_before_copying_it(
    bucket: tuple[str, CountingProxy],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Objects this process neither wrote nor read are read whole and hashed before their first
    copy (then known); a damaged one is uploaded afresh, with a warning."""
    url, proxy = bucket
    with CheckpointManager(url, incremental=True) as mgr:
        save(mgr, proxy, 1)
    monkeypatch.setattr(_objectstore, "_KNOWN", KnownFiles())  # as after a restart
    with CheckpointManager(url, incremental=True) as mgr:
        sent = {step: save(mgr, proxy, step) for step in (2, 3)}
    assert records(url, 2)[FROZEN].get("reused") is True
    assert FROZEN_BYTES <= sum(r.received for r in sent[2]) < 2 * FROZEN_BYTES
    assert sum(r.received for r in sent[3]) < FROZEN_BYTES // 10  # known now: not read again
    assert uploaded(sent[2]) < FROZEN_BYTES // 10

    store = ObjectStore(url, StorageOptions())
    data = bytearray(store.read(f"checkpoint_3/{FROZEN}") or b"")
    data[7] ^= 0x01
    store.write(f"checkpoint_3/{FROZEN}", bytes(data))
    monkeypatch.setattr(_objectstore, "_KNOWN", KnownFiles())
    with (
        caplog.at_level(logging.WARNING, logger="cairn"),
        CheckpointManager(url, incremental=True) as mgr,
    ):
        sent[4] = save(mgr, proxy, 4)
        assert_tree_equal(host(mgr.restore(4)["state"]), host(state(4)))
    assert "does not hold what its manifest records" in caplog.text
    assert "reused" not in records(url, 4)[FROZEN]
    assert uploaded(sent[4]) > FROZEN_BYTES


def test_without_server_side_copies_every_file_is_uploaded(
    s3_bucket: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """boto3 missing (as in an install without the s3 extra): one warning, every file uploaded,
    every step whole."""
    url = f"{s3_bucket}/nocopy"
    monkeypatch.setitem(sys.modules, "boto3", None)  # `import boto3` raises ImportError
    with (
        caplog.at_level(logging.WARNING, logger="cairn"),
        CheckpointManager(url, keep=KeepLatest(2), incremental=True) as mgr,
    ):
        for step in (1, 2, 3):
            mgr.save(step, {"state": state(step)})
            mgr.wait_until_finished()
            tm = mgr.info(step).telemetry
            assert tm["bytes_written"] == tm["bytes"]
        assert_tree_equal(host(mgr.restore(3)["state"]), host(state(3)))
    warned = [r for r in caplog.records if "cannot copy files on the server" in r.getMessage()]
    assert len(warned) == 1 and "boto3" in warned[0].getMessage()
    assert all("reused" not in r for r in records(url, 3).values())


def test_memory_store() -> None:
    """``memory://`` reuses files too (a copy inside this process's store)."""
    url = "memory://incremental-test/run"
    with CheckpointManager(url, incremental=True) as mgr:
        for step in (1, 2):
            mgr.save(step, {"state": state(step)})
            mgr.wait_until_finished()
        assert records(url, 2)[FROZEN]["reused"] is True
        assert_tree_equal(host(mgr.restore(2)["state"]), host(state(2)))
        assert mgr.verify(2) == []


def test_an_unchanged_jax_array_is_copied_unread_or_written_from_memory(
    bucket: tuple[str, CountingProxy],
) -> None:
    """The same jax.Array object as in the previous save: its chunk is copied on the server by
    the records that save returned, without hashing its bytes; after its object was replaced
    by hand, the copy is refused and the chunk is uploaded from the array."""
    url, proxy = bucket
    frozen = jnp.arange(FROZEN_BYTES // 4, dtype=jnp.float32)
    store = ObjectStore(url, StorageOptions())

    def save_same(mgr: CheckpointManager, step: int) -> list[Request]:
        before = len(proxy.requests())
        mgr.save(step, {"state": {"frozen": frozen, "lora": jnp.full(1000, float(step))}})
        mgr.wait_until_finished()
        return proxy.requests()[before:]

    with CheckpointManager(url, incremental=True) as mgr:
        for step in (1, 2):
            sent = save_same(mgr, step)
        assert records(url, 2)[FROZEN]["reused"] is True
        assert sum(map(is_copy, sent)) == 1 and uploaded(sent) < FROZEN_BYTES // 10
        data = bytearray(store.read(f"checkpoint_2/{FROZEN}") or b"")
        data[0] ^= 0x01
        store.write(f"checkpoint_2/{FROZEN}", bytes(data))
        sent = save_same(mgr, 3)
        assert "reused" not in records(url, 3)[FROZEN]
        assert not any(map(is_copy, sent)) and uploaded(sent) > FROZEN_BYTES
        got = mgr.restore(3)["state"]
        np.testing.assert_array_equal(np.asarray(got["frozen"]), np.asarray(frozen))
