"""Server-side copies inside one bucket: how an incremental save to an object store reuses a file
of the previous step without uploading it again (S3 CopyObject, GCS objects.rewrite).

TensorStore's kvstore cannot copy (its S3 and GCS drivers answer "CopyRange not supported"), so
these requests go through the services' own APIs: boto3 for S3 (the same endpoint, region and
credentials as TensorStore's: `StorageOptions`, then the AWS environment and credential chain),
the JSON API for GCS (google-auth's default credentials; TensorStore's
``TENSORSTORE_GCS_HTTP_URL`` and ``GOOGLE_AUTH_TOKEN_FOR_TESTING`` for an emulator).

A copy is made only of the very object the writer knows: `copy` is given the source's
generation as TensorStore reported it when this process wrote or read the object (S3: its ETag;
GCS: its generation number). It checks that generation first (HEAD; a metadata GET) and sends it
as the copy's condition (``x-amz-copy-source-if-match``; ``ifSourceGenerationMatch``), so an
object replaced since is never copied: the services enforce the condition atomically; the
emulators of the tests (moto, fake-gcs-server) ignore it, and the check before it is what the
tests exercise. Returns the copy's generation in TensorStore's encoding, or None where the
source is not that object any more (the caller then uploads the bytes).

Threads: one `Copier` serves the writer threads of every save of its store at once (boto3's
client is thread-safe; GCS uses one HTTP session per thread).
"""

from __future__ import annotations

import os
import threading
import urllib.parse
from typing import Any, Protocol

from cairn.handlers.io import optional

# TensorStore's StorageGeneration: a flags byte, then the service's identifier of the object.
_FLAGS = b"\x00"
_TIMEOUT_S = 300.0
_GCS_SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"


class Copier(Protocol):
    def copy(self, source: str, target: str, generation: bytes) -> bytes | None:
        """Copy the object `source` to `target` (keys in the bucket) if `source` is still at
        `generation`; the target's generation, or None where the source changed or is gone.
        Any other failure raises."""


def s3_etag(generation: bytes) -> str | None:
    """The ETag (quotes included) that TensorStore's S3 generation holds, or None."""
    if generation[:1] != _FLAGS or generation[1:2] != b'"':
        return None
    return generation[1:].decode("ascii", errors="replace")


def gcs_generation(generation: bytes) -> int | None:
    """The object generation number that TensorStore's GCS generation holds, or None."""
    if len(generation) != 9 or generation[:1] != _FLAGS:
        return None
    return int.from_bytes(generation[1:], "little")


class S3Copier:
    """CopyObject with boto3."""

    def __init__(self, bucket: str, prefix: str, endpoint: str | None, region: str) -> None:
        boto3 = optional("boto3", feature="an incremental save to s3:// (server-side copies)")
        botocore_config = optional("botocore.config", feature="an incremental save to s3://")
        self._bucket, self._prefix = bucket, prefix
        self._client = boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint,
            region_name=region,
            config=botocore_config.Config(max_pool_connections=32, retries={"mode": "standard"}),
        )
        self._client_error = optional("botocore.exceptions", feature="s3").ClientError

    def copy(self, source: str, target: str, generation: bytes) -> bytes | None:
        etag = s3_etag(generation)
        if etag is None:
            return None
        try:
            source, target = self._prefix + source, self._prefix + target
            if self._client.head_object(Bucket=self._bucket, Key=source)["ETag"] != etag:
                return None
            done = self._client.copy_object(
                Bucket=self._bucket,
                Key=target,
                CopySource={"Bucket": self._bucket, "Key": source},
                CopySourceIfMatch=etag,
            )
        except self._client_error as e:
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status in (404, 412):  # gone, or replaced between the check and the copy
                return None
            raise
        return _FLAGS + str(done["CopyObjectResult"]["ETag"]).encode("ascii")


class GcsCopier:
    """objects.rewrite through the JSON API (one call for a copy within a bucket and storage
    class; the loop follows ``rewriteToken`` for the others)."""

    def __init__(self, bucket: str, prefix: str) -> None:
        self._requests = optional("requests", feature="an incremental save to gs://")
        endpoint = os.environ.get("TENSORSTORE_GCS_HTTP_URL") or "https://storage.googleapis.com"
        self._objects = f"b/{_quote(bucket)}/o/"  # a key of the bucket follows, quoted
        self._base = f"{endpoint.rstrip('/')}/storage/v1/{self._objects}"
        self._prefix = prefix
        self._token = os.environ.get("GOOGLE_AUTH_TOKEN_FOR_TESTING")
        self._credentials: Any = None
        if not self._token:
            google_auth = optional("google.auth", feature="an incremental save to gs://")
            self._credentials, _ = google_auth.default(scopes=[_GCS_SCOPE])
        self._local = threading.local()

    def _session(self) -> Any:
        session = getattr(self._local, "session", None)
        if session is None:
            if self._credentials is not None:
                transport = optional("google.auth.transport.requests", feature="gs://")
                session = transport.AuthorizedSession(self._credentials)
            else:
                session = self._requests.Session()
                session.headers["Authorization"] = f"Bearer {self._token}"
            retry = optional("urllib3.util.retry", feature="gs://").Retry(
                total=4,
                backoff_factor=0.5,
                status_forcelist=(429, 500, 502, 503, 504),
                allowed_methods=None,  # a rewrite repeated copies the same object again
            )
            session.mount("https://", self._requests.adapters.HTTPAdapter(max_retries=retry))
            session.mount("http://", self._requests.adapters.HTTPAdapter(max_retries=retry))
            self._local.session = session
        return session

    def copy(self, source: str, target: str, generation: bytes) -> bytes | None:
        number = gcs_generation(generation)
        if number is None:
            return None
        session = self._session()
        source_url = self._base + _quote(self._prefix + source)
        got = session.get(source_url, params={"fields": "generation"}, timeout=_TIMEOUT_S)
        if got.status_code == 404:
            return None
        got.raise_for_status()
        if int(got.json()["generation"]) != number:
            return None
        url = f"{source_url}/rewriteTo/{self._objects}{_quote(self._prefix + target)}"
        params: dict[str, Any] = {"ifSourceGenerationMatch": number}
        while True:
            done = session.post(url, params=params, timeout=_TIMEOUT_S)
            if done.status_code in (404, 412):
                return None
            done.raise_for_status()
            body = done.json()
            if body.get("done"):
                return _FLAGS + int(body["resource"]["generation"]).to_bytes(8, "little")
            params["rewriteToken"] = body["rewriteToken"]


class MemoryCopier:
    """``memory://``: a read and a write in this process (the store lives in its memory)."""

    def __init__(self, kv: Any) -> None:
        self._kv = kv

    def copy(self, source: str, target: str, generation: bytes) -> bytes | None:
        got = self._kv.read(source).result()
        if got.state != "value" or got.stamp.generation != generation:
            return None
        return bytes(self._kv.write(target, got.value).result().generation)


def _quote(key: str) -> str:
    return urllib.parse.quote(key, safe="")
