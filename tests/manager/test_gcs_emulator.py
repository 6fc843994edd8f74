"""What the GCS emulator (fake-gcs-server, tests/support/gcsutil.py) does with the TensorStore kvstore
operations cairn's object store relies on: plain reads, writes, lists and deletes work as on GCS;
of the write conditions, it honours none.

TensorStore sends every condition as `ifGenerationMatch` (0 for "only if absent"), on a media
upload (`POST /upload/...?uploadType=media`) or on the DELETE itself. The released server
(v1.54.0) ignores that parameter on both, so a conditional write or delete that real GCS would
refuse with 412 (TensorStore then returns the generation b"" and leaves the object as it was)
goes through here. Each test below asserts what the emulator does, and checks in its request log
that TensorStore did send the condition, so the gap is the server's, not the client's.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest
import tensorstore as ts
from support.gcsutil import gcs_requests

KeyRange = ts.KvStore.KeyRange


@pytest.fixture
def kv(gcs_bucket: str) -> Any:
    bucket = gcs_bucket.removeprefix("gs://")
    return ts.KvStore.open({"driver": "gcs", "bucket": bucket, "path": "prefix/"}).result()


def bucket_of(kv: Any) -> str:
    return str(kv.spec().to_json()["bucket"])


def object_names(endpoint: str, bucket: str) -> list[str]:
    """Every object name in the bucket, through the server's JSON API (not through TensorStore)."""
    with urllib.request.urlopen(f"{endpoint}/storage/v1/b/{bucket}/o", timeout=10) as response:
        return sorted(item["name"] for item in json.load(response).get("items", []))


def last_request(endpoint: str, method: str, needle: str) -> tuple[str, int]:
    """The last request `method` whose path contains `needle`, and its status."""
    found = [
        (r, s) for r, s in gcs_requests(endpoint) if r.startswith(f"{method} ") and needle in r
    ]
    assert found, f"no {method} request for {needle!r} in the server's log"
    return found[-1]


def value(kv: Any, key: str) -> bytes | None:
    result = kv.read(key).result()
    return bytes(result.value) if result.state == "value" else None


def absent(kv: Any) -> Any:
    """The generation TensorStore gives a missing key: as a condition, "only if absent"."""
    return kv.read("no-such-key").result().stamp.generation


def test_write_read_and_missing(kv: Any, gcs_endpoint: str) -> None:
    stamp = kv.write("a", b"one").result()
    assert stamp.generation != b""
    result = kv.read("a").result()
    assert result.state == "value"
    assert bytes(result.value) == b"one"
    assert result.stamp.generation == stamp.generation

    missing = kv.read("nope").result()
    assert missing.state == "missing"
    assert bytes(missing.value) == b""
    assert missing.stamp.generation not in (b"", stamp.generation)
    assert kv.read("other").result().stamp.generation == missing.stamp.generation  # one for all

    assert object_names(gcs_endpoint, bucket_of(kv)) == ["prefix/a"]  # the path is a key prefix
    assert last_request(gcs_endpoint, "POST", "name=prefix%2Fa")[0].startswith(
        "POST /upload/storage/v1/b/"
    )


def test_generation_changes_on_every_write(kv: Any) -> None:
    first = kv.write("a", b"one").result().generation
    second = kv.write("a", b"two").result().generation
    same_bytes = kv.write("a", b"two").result().generation
    assert len({first, second, same_bytes}) == 3
    assert kv.read("a").result().stamp.generation == same_bytes


def test_list_with_key_range(kv: Any, gcs_bucket: str) -> None:
    for key in ["c", "d/1", "d/2", "d0", "e/1"]:
        kv.write(key, b"x").result()
    outside = ts.KvStore.open(
        {"driver": "gcs", "bucket": gcs_bucket.removeprefix("gs://"), "path": "prefiy/"}
    ).result()
    outside.write("d/3", b"x").result()  # same bucket, another prefix: never listed

    assert sorted(kv.list().result()) == [b"c", b"d/1", b"d/2", b"d0", b"e/1"]
    assert sorted(kv.list(KeyRange("d/", "d0")).result()) == [b"d/1", b"d/2"]
    assert sorted(kv.list(KeyRange("d/2", "e/1")).result()) == [b"d/2", b"d0"]  # [min, max)
    assert kv.list(KeyRange("f", "g")).result() == []


def test_delete_range(kv: Any, gcs_endpoint: str) -> None:
    for key in ["c", "d/1", "d/2", "d0", "e/1"]:
        kv.write(key, b"x").result()
    kv.delete_range(KeyRange("d/", "d0")).result()
    assert sorted(kv.list().result()) == [b"c", b"d0", b"e/1"]
    assert object_names(gcs_endpoint, bucket_of(kv)) == ["prefix/c", "prefix/d0", "prefix/e/1"]
    kv.delete_range(KeyRange()).result()
    assert kv.list().result() == []
    assert object_names(gcs_endpoint, bucket_of(kv)) == []


# --- write if absent (if_equal=<generation of a missing key>, sent as ifGenerationMatch=0) ---


def test_write_if_absent_creates_a_missing_key(kv: Any, gcs_endpoint: str) -> None:
    stamp = kv.write("new", b"first", if_equal=absent(kv)).result()
    assert stamp.generation != b""
    assert value(kv, "new") == b"first"
    request, status = last_request(gcs_endpoint, "POST", "name=prefix%2Fnew")
    assert "uploadType=media" in request and "ifGenerationMatch=0" in request
    assert status == 200


def test_write_if_absent_is_ignored_on_an_existing_key(kv: Any, gcs_endpoint: str) -> None:
    old = kv.write("a", b"old").result().generation
    stamp = kv.write("a", b"new", if_equal=absent(kv)).result()
    request, status = last_request(gcs_endpoint, "POST", "ifGenerationMatch=0")
    assert "name=prefix%2Fa" in request  # TensorStore did send the condition...
    # ...and the emulator ignored it: real GCS answers 412, TensorStore returns b"" and "old" stays.
    assert status == 200
    assert stamp.generation not in (b"", old)
    assert value(kv, "a") == b"new"


# --- write if at a generation (if_equal=<generation>, sent as ifGenerationMatch=<number>) ---


def test_write_if_generation_matches(kv: Any, gcs_endpoint: str) -> None:
    current = kv.write("a", b"one").result().generation
    stamp = kv.write("a", b"two", if_equal=current).result()
    assert stamp.generation not in (b"", current)
    assert value(kv, "a") == b"two"
    request, status = last_request(gcs_endpoint, "POST", "name=prefix%2Fa&ifGenerationMatch=")
    assert "ifGenerationMatch=0" not in request and status == 200


def test_write_if_generation_is_ignored_when_stale(kv: Any, gcs_endpoint: str) -> None:
    stale = kv.write("a", b"one").result().generation
    current = kv.write("a", b"two").result().generation
    stamp = kv.write("a", b"three", if_equal=stale).result()
    request, status = last_request(gcs_endpoint, "POST", "name=prefix%2Fa&ifGenerationMatch=")
    assert "ifGenerationMatch=0" not in request  # the stale generation was sent...
    # ...and ignored: real GCS answers 412, TensorStore returns b"" and "two" stays.
    assert status == 200
    assert stamp.generation not in (b"", stale, current)
    assert value(kv, "a") == b"three"


# --- delete if at a generation / if absent (kv.write(key, None, if_equal=...)) ---


def test_delete_if_generation_matches(kv: Any, gcs_endpoint: str) -> None:
    current = kv.write("a", b"one").result().generation
    stamp = kv.write("a", None, if_equal=current).result()
    assert stamp.generation == absent(kv)
    assert kv.read("a").result().state == "missing"
    request, status = last_request(gcs_endpoint, "DELETE", "prefix%2Fa?ifGenerationMatch=")
    assert "ifGenerationMatch=0" not in request and status == 200


def test_delete_if_generation_is_ignored_when_stale(kv: Any, gcs_endpoint: str) -> None:
    stale = kv.write("a", b"one").result().generation
    kv.write("a", b"two").result()
    stamp = kv.write("a", None, if_equal=stale).result()
    request, status = last_request(gcs_endpoint, "DELETE", "prefix%2Fa?ifGenerationMatch=")
    assert "ifGenerationMatch=0" not in request  # one DELETE carrying the stale generation...
    # ...which the emulator ignored: real GCS answers 412, TensorStore returns b"", "two" stays.
    assert status == 200
    assert stamp.generation == absent(kv)
    assert kv.read("a").result().state == "missing"


def test_delete_if_absent_is_ignored_on_an_existing_key(kv: Any, gcs_endpoint: str) -> None:
    kv.write("a", b"one").result()
    stamp = kv.write("a", None, if_equal=absent(kv)).result()
    request, status = last_request(gcs_endpoint, "DELETE", "prefix%2Fa")
    assert request.endswith("?ifGenerationMatch=0")  # "only if absent" was sent...
    # ...and ignored: real GCS answers 412 for an existing object; here it is deleted.
    assert status == 200
    assert stamp.generation == absent(kv)
    assert kv.read("a").result().state == "missing"


def test_many_requests_do_not_stall_the_server(kv: Any, gcs_endpoint: str) -> None:
    """600+ requests, 32 at a time (TensorStore's default GCS concurrency): the server's log
    goes to a file, so it never blocks on a full pipe."""
    before = len(gcs_requests(gcs_endpoint))
    keys = [f"k/{i:04d}" for i in range(300)]
    for future in [kv.write(key, key.encode()) for key in keys]:
        future.result(timeout=60)
    reads = [kv.read(key) for key in keys]
    assert [bytes(f.result(timeout=60).value) for f in reads] == [k.encode() for k in keys]
    assert sorted(kv.list(KeyRange("k/", "k0")).result()) == [k.encode() for k in keys]
    kv.delete_range(KeyRange("k/", "k0")).result(timeout=60)
    assert kv.list().result() == []
    served = gcs_requests(gcs_endpoint)[before:]
    assert len(served) >= 900  # 300 uploads, 300 reads, 300 deletes, and the lists
    assert all(status in (200, 204) for _, status in served)
