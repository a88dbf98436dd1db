"""Connecting a process to Temporal and the stores, with no worker: what the CLI's readers
(`show --refresh`, `watch`, `list --refresh`, `reward`) need, without importing the model
clients and activities a worker needs (durable_rlm/worker/runtime.py)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import sqlalchemy as sa
from temporalio.client import Client

from durable_rlm.errors import ServerUnavailable
from durable_rlm.server.embedded import shared_server
from durable_rlm.settings import Settings, private_file
from durable_rlm.store.blobs import BlobBackend, BlobStore, DirectoryBackend, SqlBackend
from durable_rlm.store.codec import data_converter
from durable_rlm.store.sql import agree_on_blob_store, open_store
from durable_rlm.telemetry.metrics_server import metrics_runtime
from durable_rlm.telemetry.otel import client_interceptors


@dataclass
class Services:
    """What a process needs to talk to Temporal and the stores."""

    settings: Settings
    blobs: BlobStore
    engine: sa.Engine | None
    client: Client
    ui: str | None = None  # the Temporal Web UI's base URL, when there is one

    def episode_url(self, episode_id: str, run_id: str | None = None) -> str | None:
        """The UI page of an episode (of its run, when given)."""
        if self.ui is None:
            return None
        namespace = quote(self.settings.temporal_namespace, safe="")
        page = f"{self.ui.rstrip('/')}/namespaces/{namespace}/workflows/{quote(episode_id, safe='')}"
        return f"{page}/{run_id}/history" if run_id else page


def open_stores(settings: Settings) -> tuple[BlobStore, sa.Engine]:
    """The SQL store, and the blob store: its `blobs` table, or a directory."""
    if not settings.database_url:
        private_file(settings.prepare_data_dir() / "drlm.sqlite")
    engine = open_store(settings.effective_database_url)
    where, chosen_by = settings.describe_stores()["blob store"]
    hint = f"{where} ({chosen_by})"
    agree_on_blob_store(engine, settings.blob_store_name)  # a stray local blob store strands episodes
    keyring = settings.keyring()  # DRLM_ENCRYPTION_KEYS: blobs sealed at rest
    if keyring is not None:
        from durable_rlm.store.audit_rows import keep_text_out  # start-up: 0.13 s; unsealed stores skip it

        keep_text_out(engine)  # and no clear text in the audit rows either
    return BlobStore(blob_backend(settings, engine), where=hint, keyring=keyring), engine


def blob_backend(settings: Settings, engine: sa.Engine) -> BlobBackend:
    """The backend DRLM_BLOB_STORE names: the SQL store's table, an object store, a directory."""
    if settings.blob_store == "sql":
        return SqlBackend(engine)
    if settings.blob_store.startswith("s3://"):
        from durable_rlm.store.s3 import S3Backend  # start-up: boto3 (~0.3 s) only for an object store

        backend = S3Backend(settings.blob_store, settings.s3_endpoint_url)
        backend.check_reachable()
        return backend
    return DirectoryBackend(Path(settings.blob_store))


@contextlib.asynccontextmanager
async def connect(settings: Settings) -> AsyncIterator[Services]:
    """Connect to TEMPORAL_ADDRESS, or to the data directory's shared embedded server
    (started if needed, kept while this block runs: durable_rlm/server/embedded.py)."""
    blobs, engine = open_stores(settings)
    converter = data_converter(blobs, settings.claim_check_threshold, settings.keyring())
    # Also serves DRLM_METRICS_ADDRESS: a bad one fails here, before this process connects
    # (a server asked for early is let go: durable_rlm/api.py `_enter`).
    interceptors = client_interceptors(settings.tracing, metrics_address=settings.metrics_address)
    if settings.temporal_address:
        client = await connect_client(settings.temporal_address, settings, converter, interceptors)
        yield Services(settings, blobs, engine, client, settings.ui_address)
        return
    async with shared_server(settings) as lease:
        client = await connect_client(lease.address, settings, converter, interceptors)
        yield Services(settings, blobs, engine, client, lease.ui)


async def connect_client(address: str, settings: Settings, converter: Any, interceptors: Any) -> Client:
    # The Runtime whose SDK metrics DRLM_METRICS_ADDRESS serves; workers inherit the client's.
    runtime = metrics_runtime(settings.metrics_address)
    # A cluster's TLS and API key (Temporal Cloud); the embedded server is plain.
    remote = address == settings.temporal_address
    tls = settings.temporal_tls() if remote else None
    try:
        return await Client.connect(
            address,
            namespace=settings.temporal_namespace,
            data_converter=converter,
            interceptors=interceptors,
            runtime=runtime,
            tls=tls if tls is not None else False,
            api_key=settings.temporal_api_key if remote else None,
        )
    except Exception as exc:  # noqa: BLE001 - the SDK raises RuntimeError for every cause
        raise ServerUnavailable(
            f"cannot reach Temporal at {address} ({settings.origin('temporal_address')}): "
            f"{first_line(exc)}; is the server up?"
        ) from None


def first_line(exc: BaseException, limit: int = 300) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:limit]
