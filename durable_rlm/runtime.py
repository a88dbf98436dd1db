"""Wiring: Temporal client, embedded dev server, and the worker of one process."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import tempfile
import uuid
from collections.abc import AsyncIterator, Mapping
from datetime import timedelta
from pathlib import Path

import sqlalchemy as sa
from temporalio.client import Client
from temporalio.worker import Worker
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from activities.audit import AuditActivities, AuditInterceptor
from activities.extraction import ExtractionActivities
from activities.llm import ModelActivities
from activities.repl import ReplActivities
from activities.tools import run_tool
from durable_rlm.blobs import BlobStore
from durable_rlm.connection import (  # noqa: F401 - re-exported: one import for the worker side
    Services,
    connect,
    connect_client,
    first_line,
    open_stores,
)
from durable_rlm.server import (  # noqa: F401 - re-exported: tests and benchmarks start servers
    SERVER_TUNING,
    EmbeddedServer,
    free_port,
    shared_server,
    temporal_binary,
    time_skipping_server_binary,
)
from durable_rlm.settings import ConfigurationError, Settings
from durable_rlm.snapshot_key import snapshot_key as load_snapshot_key
from durable_rlm.telemetry import worker_interceptors
from durable_rlm.tools import import_tool_modules
from workflows import defaults
from workflows.episode import EpisodeWorkflow


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
    # Audit rows and telemetry of every step, written as each completes (activities/audit.py).
    interceptors = [AuditInterceptor(audit.writer), *worker_interceptors()]
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
        interceptors=interceptors,
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
    own = Worker(
        client,
        task_queue=worker_queue,
        activities=repl_activities,
        interceptors=interceptors,
        max_concurrent_activities=64,
    )
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
