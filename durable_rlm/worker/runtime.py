"""Wiring: Temporal client, embedded dev server, and the worker of one process."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import sqlalchemy as sa
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import FixedSizeSlotSupplier, Worker, WorkerDeploymentConfig, WorkerTuner
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from durable_rlm.activities.audit import UNSETTLED, AuditActivities, AuditInterceptor, take_unsettled
from durable_rlm.activities.call_ledger import CallLedger
from durable_rlm.activities.extraction import ExtractionActivities
from durable_rlm.activities.llm import ModelActivities
from durable_rlm.activities.repl import ReplActivities
from durable_rlm.activities.sandbox_slots import WorkflowSlots
from durable_rlm.activities.sandbox_start import default_sandbox_root
from durable_rlm.activities.tools import run_tool
from durable_rlm.audit.gc import RetentionActivities
from durable_rlm.audit.projection import rebuild_episode, reconcile_audit, settle_at_close
from durable_rlm.client.episodes import ask_search_attributes
from durable_rlm.plugins import import_policy_modules, import_tool_modules
from durable_rlm.server.connection import (  # noqa: F401 - re-exported: one import for the worker side
    Services,
    connect,
    connect_client,
    first_line,
    open_stores,
)
from durable_rlm.server.deployment import adopt_if_unset
from durable_rlm.server.embedded import (  # noqa: F401 - re-exported: tests and benchmarks start servers
    SERVER_TUNING,
    EmbeddedServer,
    shared_server,
    temporal_binary,
    time_skipping_server_binary,
)
from durable_rlm.settings import Settings
from durable_rlm.store.blobs import BlobStore
from durable_rlm.store.call_ledger import LedgerRows
from durable_rlm.store.snapshot_key import snapshot_key as load_snapshot_key
from durable_rlm.telemetry.otel import forget_sandboxes, observe_sandboxes, worker_interceptors
from durable_rlm.worker.activity_polls import poll_on_a_thread
from durable_rlm.worker.admission import AdmittingActivitySlots, AdmittingWorkflowSlots, HandoffWatch
from durable_rlm.worker.build_id import code_build_id
from durable_rlm.worker.heap import return_large_buffers
from durable_rlm.worker.liveness import LivenessUnavailable, WorkerLiveness
from durable_rlm.worker.sticky import hand_back
from durable_rlm.workflows import defaults
from durable_rlm.workflows.episode import EpisodeWorkflow
from durable_rlm.workflows.retention import BlobRetentionWorkflow
from durable_rlm.workflows.session import SessionWorkflow

Takes = Literal["all", "workflows", "activities"]
"""What a worker takes from its queue (`build_workers`)."""


def workflow_runner(policy_modules: tuple[str, ...] = ()) -> SandboxedWorkflowRunner:
    # Our models and pure helpers are deterministic; passing them through avoids
    # re-importing pydantic models on every workflow run. The termination module must be
    # shared with the worker so that policies its modules registered are found.
    return SandboxedWorkflowRunner(
        restrictions=SandboxRestrictions.default.with_passthrough_modules(
            "pydantic",
            "pydantic_core",
            # Typed outputs are checked in workflow code (workflows/typed_outputs.py): the
            # validator and its dependencies are pure, and not worth re-importing per run.
            "jsonschema",
            "jsonschema_specifications",
            "referencing",
            "rpds",
            "attrs",
            "attr",
            # All the workflow code, the package with its children: a module left out
            # (it happened to the ones added since the list was written by hand) was
            # imported again for every episode's run, ~15% of a worker's CPU.
            "durable_rlm.workflows",
            *policy_modules,
        )
    )


def call_ledger(
    blobs: BlobStore, engine: sa.Engine | None, liveness: WorkerLiveness | None
) -> CallLedger | None:
    """This worker's side of the call ledger (activities/call_ledger.py), in the SQL store; it
    names its claims by the worker's liveness lock, so that a worker on this host judges them
    by it. None without a SQL store (no worker runs without one)."""
    if engine is None:
        return None
    holder = liveness.worker_id if liveness is not None else f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    alive = liveness.holder_alive if liveness is not None else None
    return CallLedger(LedgerRows(engine, blobs.keyring), holder, alive=alive)


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
    drain_grace_s: float = 0.0,
    max_sandboxes: int | None = None,
    deployment: WorkerDeploymentConfig | None = None,
    hold_new_episodes: bool = False,
    admission: AdmittingWorkflowSlots | None = None,
    liveness: WorkerLiveness | None = None,
    takes: Takes = "all",
    sandbox_files_mb: int | None = defaults.SANDBOX_FILES_MB,
) -> tuple[list[Worker], ReplActivities]:
    """Two workers on one process: the shared queue (workflows and every activity) and a
    queue only this process polls, where an episode's REPL steps come back to its sandbox.

    A command that runs an episode only while it needs it takes part of that (`takes`):
    "workflows" (and the REPL steps they run locally), no model call or tool, so that an
    update is applied at once and the episode's next call is left to the worker that will
    run it (started and abandoned as the command exits, it would be paid twice); or
    "activities", beside such a worker, once the calls it must not start are gone (the
    SDK lets one process have two workers on a queue only if they take different tasks)."""
    return_large_buffers()  # a snapshot or a reply of megabytes leaves no heap behind
    import_policy_modules(policy_modules)
    import_tool_modules(tool_modules)
    worker_queue = f"{task_queue}-repl-{uuid.uuid4().hex[:12]}"
    root = sandbox_root or default_sandbox_root()
    repl = ReplActivities(
        blobs,
        worker_queue,
        root,
        sandbox_memory_mb,
        sandbox_idle_s,
        sandbox_start=sandbox_start,
        memory_budget_mb=sandbox_budget_mb,
        snapshot_key=snapshot_key,
        max_sandboxes=max_sandboxes,
        files_mb=sandbox_files_mb,
    )
    observe_sandboxes(repl.slots, worker_queue)
    models = ModelActivities(blobs, credentials, call_ledger(blobs, engine, liveness))
    audit = AuditActivities(engine, functools.partial(_settle_episode, client, engine) if engine else None)
    if admission is None:  # unmeasured, it admits at its first rate
        admission = AdmittingWorkflowSlots(defaults.WORKFLOW_TASK_SLOTS)
    # Audit rows and telemetry of every step, written as each completes (activities/audit.py).
    interceptors = [AuditInterceptor(audit.writer), *worker_interceptors()]
    extraction = ExtractionActivities(models, blobs)
    repl_activities: list[Callable[..., object]] = [
        repl.execute_cell,
        repl.resume_cell,
        repl.read_variable,
        repl.close_sandbox,
    ]
    shared = Worker(
        client,
        task_queue=task_queue,
        workflows=[EpisodeWorkflow, SessionWorkflow, BlobRetentionWorkflow] if takes != "activities" else [],
        activities=[
            models.root_completion,
            models.sub_query,
            models.compact_conversation,
            extraction.extract_fallback,
            audit.audit_episode,
            run_tool,
            RetentionActivities(blobs, engine).collect,
            *repl_activities,
        ],
        workflow_runner=workflow_runner(policy_modules),
        # The liveness ledger outermost: it holds an attempt's token for all of the attempt.
        # Admission hears how long each activity task waited before reaching this worker.
        interceptors=[
            *([liveness.interceptor()] if liveness is not None else []),
            HandoffWatch(admission),
            *interceptors,
        ],
        # With a Worker Deployment, the server routes each episode to the deployment's
        # current build (or keeps it on its own, pinned). The per-process REPL queue below
        # stays unversioned: only this process polls it.
        deployment_config=deployment,
        # Without a deployment: the workflow code's own id, not the SDK's hash of every
        # imported module (0.4 s of a script's start; durable_rlm/worker/build_id.py).
        build_id=code_build_id(policy_modules) if deployment is None else None,
        # The poller names its liveness lock: `drlm watch` and the steering commands tell a
        # dead worker the server still lists from a busy one (durable_rlm/client/attendance.py).
        identity=liveness.identity if liveness is not None else None,
        no_remote_activities=takes == "workflows",
        # New episodes are taken while the worker's measured capacity allows
        # (durable_rlm/worker/admission.py); the rest wait on the server, where no clock runs. With
        # `hold_new_episodes`, instead, tasks of episodes new to this worker wait while its
        # sandboxes are all running steps (activities/sandbox_slots.py).
        # Each live episode may run one local REPL step at a time.
        tuner=WorkerTuner.create_composite(
            workflow_supplier=(
                WorkflowSlots(defaults.WORKFLOW_TASK_SLOTS, repl.slots) if hold_new_episodes else admission
            ),
            activity_supplier=AdmittingActivitySlots(activity_slots, lambda: admission.capacity.overloaded),
            local_activity_supplier=FixedSizeSlotSupplier(capacity),
            nexus_supplier=FixedSizeSlotSupplier(defaults.WORKFLOW_TASK_SLOTS),
        ),
        # Given at construction: the SDK hands it to its core worker (see `drain`).
        graceful_shutdown_timeout=timedelta(seconds=drain_grace_s),
        # Every live episode stays cached: an evicted one replays its history, and its REPL
        # (local steps) is rebuilt.
        max_cached_workflows=capacity,
        # A task of an episode this worker holds waits this long for it before going to the
        # shared queue (defaults.STICKY_TIMEOUT_S: a dead worker's episodes move at once, by
        # the liveness signal).
        sticky_queue_schedule_to_start_timeout=timedelta(seconds=defaults.STICKY_TIMEOUT_S),
        # Heartbeats leave every second, not at 80% of the timeout (2.4 s of 3): a busy
        # worker's late heartbeat must not pass for a dead worker and get a call paid twice.
        max_heartbeat_throttle_interval=timedelta(seconds=1),
        default_heartbeat_throttle_interval=timedelta(seconds=1),
    )
    admission.live = lambda: _cached_episodes(shared)
    if liveness is not None:
        liveness.held = lambda: _held_episodes(shared)
    # Activity tasks are polled from a thread of their own: from the worker's busy loop,
    # handed-out model calls waited seconds in the core under load
    # (durable_rlm/worker/activity_polls.py).
    poll_on_a_thread(shared)
    if takes != "all":
        return [shared], repl
    # REPL steps of episodes from before local steps come back here, to their sandbox.
    own = Worker(
        client,
        task_queue=worker_queue,
        activities=repl_activities,
        interceptors=interceptors,
        max_concurrent_activities=64,
        identity=liveness.identity if liveness is not None else None,
        build_id=code_build_id(policy_modules),
        graceful_shutdown_timeout=timedelta(seconds=drain_grace_s),
    )
    poll_on_a_thread(own)
    return [shared, own], repl


@contextlib.asynccontextmanager
async def running_workers(
    services: Services,
    credentials: Mapping[str, str] | None = None,
    *,
    drain_grace_s: float = 0.0,
    on_drained: Callable[[DrainReport], None] | None = None,
    takes: Takes = "all",
) -> AsyncIterator[ReplActivities]:
    """This process's workers, polling until the block ends; then drained (`drain`), and
    `on_drained` told what was. A grace of 0 (in-process workers) cancels calls in flight
    at once: their episodes go on when a worker next runs."""
    settings = services.settings
    admission = AdmittingWorkflowSlots(defaults.WORKFLOW_TASK_SLOTS)
    # Dead workers' calls on this machine are retried as this worker starts, not after
    # their heartbeat timeout (worker/liveness.py): the look runs while the workers are built.
    liveness = _liveness(settings, services.client)
    watching = [asyncio.create_task(liveness.watch())] if liveness is not None else []
    try:
        workers, repl = _workers_of(services, credentials, drain_grace_s, admission, liveness, takes)
    except BaseException:
        for task in watching:
            task.cancel()
        if liveness is not None:
            liveness.close()
        raise
    runs = [asyncio.create_task(w.run()) for w in workers]
    chores = [asyncio.create_task(_reap_forever(repl)), asyncio.create_task(_reconcile_forever(services))]
    if takes != "activities":  # the workflow worker runs the REPL steps (local activities)
        chores.append(asyncio.create_task(repl.warm()))  # the first step forks, not waits for a template
    chores.extend(watching)
    chores.append(asyncio.create_task(admission.run()))  # measures, and sets the window
    if settings.deployment_name is not None and settings.build_id is not None:
        chores.append(
            asyncio.create_task(_first_build(services, settings.deployment_name, settings.build_id))
        )
    try:
        yield repl
    finally:
        for chore in chores:  # no idle eviction may race the drain's own closing
            chore.cancel()
        for chore in chores:
            with contextlib.suppress(BaseException):
                await chore
        try:
            report = await drain(workers, runs, repl, drain_grace_s, services.client)
        finally:
            if liveness is not None:
                liveness.close()
        forget_sandboxes(repl.slots)
        if services.engine is not None and UNSETTLED:
            # Rows this process fenced off are settled before it goes (audit.py): bounded,
            # and best effort (any other worker's reconciler, or audit-rebuild, can too).
            with contextlib.suppress(Exception):
                await asyncio.wait_for(_settle(services), SETTLE_AT_EXIT_S)
        if on_drained is not None:
            on_drained(report)


def _liveness(settings: Settings, client: Client) -> WorkerLiveness | None:
    """This worker's liveness signal (worker/liveness.py), or None where its folder cannot
    be trusted: the worker runs, and a crash of it waits for the heartbeat timeout."""
    try:
        return WorkerLiveness.in_data_dir(settings.prepare_data_dir(), client).start()
    except (LivenessUnavailable, OSError) as exc:
        logging.getLogger(__name__).warning(
            "liveness signal off (a dead worker's calls wait for their heartbeat timeout): %s", exc
        )
        return None


def _workers_of(
    services: Services,
    credentials: Mapping[str, str] | None,
    drain_grace_s: float,
    admission: AdmittingWorkflowSlots,
    liveness: WorkerLiveness | None,
    takes: Takes = "all",
) -> tuple[list[Worker], ReplActivities]:
    """build_workers with this process's settings."""
    settings = services.settings
    return build_workers(
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
        sandbox_root=settings.sandbox_dir,
        sandbox_files_mb=settings.sandbox_files_mb,
        snapshot_key=load_snapshot_key(settings.snapshot_key, settings.data_dir),
        drain_grace_s=drain_grace_s,
        max_sandboxes=settings.max_sandboxes,
        deployment=settings.worker_deployment(),
        hold_new_episodes=settings.hold_new_episodes,
        admission=admission,
        liveness=liveness,
        takes=takes,
    )


@dataclass(frozen=True)
class DrainReport:
    """What a stopping worker did with the work it held (`python worker.py` prints it)."""

    finished: tuple[str, ...]  # activities in flight when the drain began that finished in the grace
    overran: tuple[str, ...]  # still running when the grace ran out (local REPL steps marked)
    sandboxes: int  # live sandboxes closed
    grace_s: float
    seconds: float

    def describe(self) -> str:
        cancelled = [name for name in self.overran if not name.endswith(LOCAL_MARK)]
        steps = [name.removesuffix(LOCAL_MARK) for name in self.overran if name.endswith(LOCAL_MARK)]
        said = [f"{len(self.finished)} in flight finished{_listed(self.finished)}"]
        if cancelled:
            said.append(f"{len(cancelled)} cancelled after {self.grace_s:g} s{_listed(cancelled)}")
        if steps:
            said.append(f"{len(steps)} local step(s) ran past {self.grace_s:g} s{_listed(steps)}")
        said.append(f"{self.sandboxes} sandbox{'es' if self.sandboxes != 1 else ''} closed")
        return f"drained in {self.seconds:.1f} s: " + "; ".join(said)


LOCAL_MARK = " (local)"


async def drain(
    workers: Sequence[Worker],
    runs: Sequence[asyncio.Task[None]],
    repl: ReplActivities,
    grace_s: float,
    client: Client | None = None,
) -> DrainReport:
    """Stop polling, let the work in flight finish, then close the sandboxes.

    Every worker's shutdown starts at once, so none keeps polling while another drains. The
    SDK gives the sticky queue back to the server, so an episode's next workflow task goes to
    another worker, which replays it and rebuilds its REPL from the log. An activity still
    running after `grace_s` is cancelled by the SDK: it fails, and its retry runs elsewhere.
    A local REPL step runs inside a workflow task: the SDK never cancels it and waits for it
    whatever the grace (`python worker.py` gives up after the grace, and exits as a crash
    would: another worker re-runs the step from the log)."""
    began = time.monotonic()
    in_flight = _in_flight(workers)
    stopping = asyncio.gather(*(w.shutdown() for w in workers))
    handing_back = asyncio.ensure_future(_hand_back_sticky(client, workers, stopping)) if client else None
    await asyncio.wait([stopping], timeout=grace_s)
    overran = _in_flight(workers) if not stopping.done() else {}
    with contextlib.suppress(BaseException):  # a worker's fatal error was logged by the SDK
        await stopping
    for run in runs:
        with contextlib.suppress(BaseException):
            await run
    if handing_back is not None:
        handing_back.cancel()
        with contextlib.suppress(BaseException):
            await handing_back
    sandboxes = len(repl.live_episodes())
    await repl.close_all()
    return DrainReport(
        finished=tuple(name for token, name in in_flight.items() if token not in overran),
        overran=tuple(overran.values()),
        sandboxes=sandboxes,
        grace_s=grace_s,
        seconds=time.monotonic() - began,
    )


def _in_flight(workers: Sequence[Worker]) -> dict[bytes, str]:
    """The activities running on these workers, by task token. The SDK has no public view
    of them: read its own table, and report nothing if that ever moves."""
    running: dict[bytes, str] = {}
    for worker in workers:
        table = getattr(getattr(worker, "_activity_worker", None), "_running_activities", None)
        for token, activity in list(dict(table or {}).items()):
            info = getattr(activity, "info", None)
            name = str(getattr(info, "activity_type", "activity"))
            running[token] = name + LOCAL_MARK if getattr(info, "is_local", False) else name
    return running


HAND_BACK_EVERY_S = 0.2


async def _hand_back_sticky(client: Client, workers: Sequence[Worker], stopping: asyncio.Future) -> None:
    """While a worker drains, its episodes' next workflow tasks must not go to its sticky
    queue, which nobody polls any more: each would wait there for its schedule-to-start
    timeout (a WorkflowTaskTimedOut in history) before the server moves it. The SDK tells the
    server only once the drain is over, after the calls in flight have completed and made
    those tasks. So, from the drain's start, the stickiness of every episode this worker
    holds (or runs an activity of) is reset, again each HAND_BACK_EVERY_S while a task it
    is still completing may set it again: the next task goes to the shared queue at once."""
    while not stopping.done():
        executions: set[tuple[str, str]] = set()
        for worker in workers:
            executions.update(_held_episodes(worker))
            activities = getattr(getattr(worker, "_activity_worker", None), "_running_activities", None)
            for activity in list(dict(activities or {}).values()):
                info = getattr(activity, "info", None)
                if info is not None and not getattr(info, "is_local", False):
                    executions.add((str(info.workflow_id), str(info.workflow_run_id)))
        await hand_back(client, executions)
        await asyncio.wait([stopping], timeout=HAND_BACK_EVERY_S)


def _running_workflows(worker: Worker) -> dict[str, Any]:
    """A worker's cache of episodes, by run id. The SDK has no public view of it: read its
    own table, and find none if that ever moves."""
    return dict(getattr(getattr(worker, "_workflow_worker", None), "_running_workflows", None) or {})


def _cached_episodes(worker: Worker) -> int:
    """The episodes a worker holds in its cache."""
    return len(_running_workflows(worker))


def _held_episodes(worker: Worker) -> list[tuple[str, str]]:
    """(workflow id, run id) of each episode in a worker's cache."""
    running = _running_workflows(worker)
    return [(str(getattr(run, "workflow_id", "")), str(run_id)) for run_id, run in running.items()]


def _listed(names: Sequence[str]) -> str:
    """Names with their counts, in parentheses: ` (drlm.root_completion, drlm.sub_query x3)`."""
    counts = sorted(collections.Counter(names).items())
    return f" ({', '.join(name if n == 1 else f'{name} x{n}' for name, n in counts)})" if counts else ""


@contextlib.asynccontextmanager
async def session(
    settings: Settings, credentials: Mapping[str, str] | None = None, work: bool = True
) -> AsyncIterator[Services]:
    """Connected to Temporal and the stores; with `work` in embedded mode, with this
    process's worker running too (the CLI and the Python API open sessions this one way)."""
    async with connect(settings) as services:
        ask_search_attributes(services.client)  # answered while the worker starts: start_episode needs it
        if work and settings.embedded:
            async with running_workers(services, credentials):
                yield services
        else:
            yield services


async def _reap_forever(repl: ReplActivities) -> None:
    while True:
        await asyncio.sleep(60)
        await repl.reap_idle()


async def _first_build(services: Services, name: str, build_id: str) -> None:
    """The deployment's first build makes itself current (durable_rlm/server/deployment.py)."""
    try:
        if await adopt_if_unset(services.client, name, build_id):
            logging.getLogger(__name__).warning(
                "deployment %s had no current build: %s is now current", name, build_id
            )
    except Exception:  # noqa: BLE001 - an operator can still run `drlm deployment set-current`
        logging.getLogger(__name__).warning(
            "deployment %s: could not make the first build %s current", name, build_id, exc_info=True
        )


SETTLE_EVERY_S = 2.0
SETTLE_AT_EXIT_S = 15.0


SETTLE_AT_CLOSE_S = 5.0
"""How long the closing audit write spends settling the episode's rows first (then it writes
the row anyway; the reconciler settles what is left)."""


async def _settle_episode(client: Client, engine: sa.Engine, episode_id: str) -> None:
    """One episode's step rows from its history (the closing audit write's first part)."""
    await asyncio.wait_for(settle_at_close(client, engine, episode_id), SETTLE_AT_CLOSE_S)


async def _settle(services: Services) -> None:
    """Rewrite from history the rows of episodes whose steps' rows were fenced off."""
    assert services.engine is not None
    again: list[str] = []
    for episode_id in take_unsettled():  # each on its own: one that fails holds up no other
        try:
            await rebuild_episode(services.client, services.engine, episode_id)
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:  # not in this namespace: nothing to settle
                again.append(episode_id)
        except Exception:  # noqa: BLE001 - the store still failing: the next pass tries again
            again.append(episode_id)
    UNSETTLED.update(again)


LEDGER_KEPT_AFTER_END = timedelta(minutes=10)
"""A call ledger row stays this long after its episode's audit row closed: by then its reply
is in the episode's history (the closing write and the last calls go in one workflow task)."""
LEDGER_KEPT_AT_MOST = timedelta(days=30)
"""Any row goes after this, audit row or not (an episode that never wrote one)."""


async def _forget_ledger_rows(engine: sa.Engine) -> None:
    """The call ledger's rows no step can ask for again (durable_rlm/store/call_ledger.py)."""
    rows = LedgerRows(engine)
    await asyncio.to_thread(rows.forget_ended, LEDGER_KEPT_AFTER_END, LEDGER_KEPT_AT_MOST)


async def _reconcile_forever(services: Services, every_s: float = 60.0) -> None:
    """Audit rows of episodes that ended without running code (terminated, timed out)."""
    while services.engine is not None:
        # The first pass runs at start: a row left `running` by a worker killed while it
        # closed an episode is settled now, not a minute later (most workers live less).
        passes = (
            functools.partial(reconcile_audit, services.client, services.engine),
            functools.partial(_settle, services),  # steps whose rows were fenced off or refused
            functools.partial(_forget_ledger_rows, services.engine),
        )
        for chore in passes:
            try:
                await chore()
            except Exception:  # noqa: BLE001 - the projection is best effort; history is the record
                logging.getLogger(__name__).warning("audit reconciliation failed", exc_info=True)
        waited = 0.0
        while waited < every_s:  # rows left unsettled are looked at again within seconds
            await asyncio.sleep(SETTLE_EVERY_S)
            waited += SETTLE_EVERY_S
            if UNSETTLED:
                break
