"""Blobs in an S3-compatible object store (AWS S3, MinIO, SeaweedFS, Ceph, R2...): for
production, where workers on several hosts share blobs without a shared disk or a database
that grows with every context.

`DRLM_BLOB_STORE=s3://BUCKET/PREFIX`, the endpoint in `DRLM_S3_ENDPOINT_URL` (unset: AWS's
own, or boto3's `AWS_ENDPOINT_URL`), credentials from boto3's usual chain (`AWS_ACCESS_KEY_ID`
and `AWS_SECRET_ACCESS_KEY`, a profile, an instance role). One object per chunk or small blob,
`PREFIX/sha256/ab/<hex>` (manifests under `sha256m/`); a chunk over `MULTIPART_BYTES` goes
up as a multipart upload (parts sent in parallel). Once-only markers use a conditional put
(`If-None-Match: *`), which AWS S3, MinIO, SeaweedFS and R2 honour.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import Any
from urllib.parse import urlparse

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import ClientError

from durable_rlm.errors import ConfigurationError
from durable_rlm.store.backends import Data, StoredBlob
from durable_rlm.store.chunks import MANIFEST, RAW, split_digest

MULTIPART_BYTES = 8 * 1024 * 1024
"""Objects larger than this are uploaded in parts of this size (S3's smallest part is 5 MB)."""

_FOLDERS = {RAW: "sha256", MANIFEST: "sha256m"}
_PREFIXES = {folder: prefix for prefix, folder in _FOLDERS.items()}


def parse_s3_url(url: str) -> tuple[str, str]:
    """`s3://bucket/some/prefix` -> ("bucket", "some/prefix/")."""
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ConfigurationError(f"DRLM_BLOB_STORE {url!r} is not s3://BUCKET[/PREFIX]")
    prefix = parsed.path.strip("/")
    return parsed.netloc, f"{prefix}/" if prefix else ""


def _status(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


class S3Backend:
    def __init__(self, url: str, endpoint_url: str | None = None, client: Any = None) -> None:
        self.url = url
        self.bucket, self.prefix = parse_s3_url(url)
        self.endpoint_url = endpoint_url
        self.client = client or boto3.client(
            "s3",
            endpoint_url=endpoint_url,
            config=Config(retries={"mode": "standard", "max_attempts": 5}, max_pool_connections=16),
        )
        self.transfer = TransferConfig(
            multipart_threshold=MULTIPART_BYTES, multipart_chunksize=MULTIPART_BYTES, max_concurrency=4
        )

    def describe(self) -> str:
        where = f" at {self.endpoint_url}" if self.endpoint_url else ""
        return f"the object store {self.url}{where}"

    def check_reachable(self) -> None:
        """A missing bucket or a refused credential, said once when the store is opened."""
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            raise ConfigurationError(
                f"cannot use the blob store {self.describe()}: {_status(exc) or exc} (create the "
                "bucket, and check the credentials boto3 finds: AWS_ACCESS_KEY_ID, a profile or a role)"
            ) from None

    def _key(self, digest: str) -> str:
        prefix, hexpart = split_digest(digest)
        return f"{self.prefix}{_FOLDERS[prefix]}/{hexpart[:2]}/{hexpart}"

    def _touch(self, key: str) -> None:
        """Named again: a copy onto itself gives the object a new time (retention)."""
        self.client.copy_object(
            Bucket=self.bucket,
            Key=key,
            CopySource={"Bucket": self.bucket, "Key": key},
            MetadataDirective="REPLACE",
        )

    def write(self, digest: str, data: Data) -> None:
        key = self._key(digest)
        if len(data) <= MULTIPART_BYTES:
            if not self._put_new(key, bytes(data)):
                self._touch(key)
            return
        if self._exists(key):
            self._touch(key)
            return
        self.client.upload_fileobj(io.BytesIO(data), self.bucket, key, Config=self.transfer)

    def write_many(self, items: dict[str, bytes]) -> None:
        for digest, data in items.items():
            self.write(digest, data)

    def _put_new(self, key: str, data: bytes) -> bool:
        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=data, IfNoneMatch="*")
        except ClientError as exc:
            if _status(exc) in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                return False
            raise
        return True

    def _exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if _status(exc) in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
        return True

    def add(self, digest: str, data: bytes) -> bool:
        return self._put_new(self._key(digest), data)

    def read(self, digest: str) -> bytes | None:
        try:
            reply = self.client.get_object(Bucket=self.bucket, Key=self._key(digest))
        except ClientError as exc:
            if _status(exc) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        return reply["Body"].read()

    def listing(self) -> Iterator[StoredBlob]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix)
        for page in pages:
            for item in page.get("Contents", []):
                parts = item["Key"][len(self.prefix) :].split("/")
                if len(parts) != 3 or parts[0] not in _PREFIXES:
                    continue  # not one of ours
                digest = _PREFIXES[parts[0]] + parts[2]
                try:
                    split_digest(digest)
                except ValueError:
                    continue
                yield StoredBlob(digest, int(item["Size"]), item["LastModified"])

    def delete(self, digests: Iterable[str], written_before: datetime) -> int:
        """S3 has no delete-if-older: each object's time is looked at again just before the
        batch goes, which leaves a window of one request for a writer naming it again."""
        batch: list[dict[str, str]] = []
        deleted = 0
        for digest in digests:
            key = self._key(digest)
            try:
                head = self.client.head_object(Bucket=self.bucket, Key=key)
            except ClientError as exc:
                if _status(exc) in ("404", "NoSuchKey", "NotFound"):
                    continue
                raise
            if head["LastModified"] >= written_before:
                continue
            batch.append({"Key": key})
            if len(batch) == 1000:
                deleted += self._delete(batch)
                batch = []
        if batch:
            deleted += self._delete(batch)
        return deleted

    def _delete(self, batch: list[dict[str, str]]) -> int:
        reply = self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": False})
        return len(reply.get("Deleted", []))
