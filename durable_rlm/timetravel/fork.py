"""`drlm fork`: a new episode that starts from another's state after iteration K.

The state is read by replaying the source's history through the workflow code itself (a
subclass whose only change is to keep each iteration's end), so it is the state the
source held, not a reconstruction: chain heads, counters, policy state, rewards. Nothing
of the source is written: its history, audit rows and blobs stay as they are (chains and
snapshots are content-addressed, so the fork's new entries are its own).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError
from temporalio import workflow
from temporalio.worker import Replayer, UnsandboxedWorkflowRunner

from durable_rlm.audit.history import decode, episode_runs
from durable_rlm.client.episodes import start_episode
from durable_rlm.endpoints import model_settings
from durable_rlm.errors import DurableRLMError
from durable_rlm.prices import PriceTable
from durable_rlm.settings import Settings
from durable_rlm.store.blobs import BlobStore
from durable_rlm.store.snapshot_key import lineage_mac, snapshot_key
from durable_rlm.store.snapshot_pins import pin_snapshot
from durable_rlm.workflows import names
from durable_rlm.workflows.budget import limit_reached
from durable_rlm.workflows.episode import EpisodeWorkflow, episode_policy
from durable_rlm.workflows.forks import Boundary
from durable_rlm.workflows.models import (
    EpisodeCarry,
    EpisodeRequest,
    EpisodeResult,
    ForkOrigin,
    ModelSettings,
    TerminationSpec,
)
from durable_rlm.workflows.termination import PolicyError

if TYPE_CHECKING:
    from temporalio.client import Client

    from durable_rlm.worker.runtime import Services


class ForkError(DurableRLMError, ValueError):
    """A fork that cannot start: nothing was started."""


@workflow.defn(name=names.WORKFLOW, sandboxed=False)
class _Probe(EpisodeWorkflow):
    """The episode workflow, keeping the state at each iteration's end (replay only)."""

    seen: ClassVar[dict[str, dict[int, Boundary | None]]] = {}  # run -> iteration -> state if wanted
    wanted: ClassVar[int] = 0
    _probing = True

    @workflow.run
    async def run(self, request: EpisodeRequest) -> EpisodeResult:
        return await super().run(request)

    def _iteration_ended(self, iteration: int, state: Callable[[], Boundary]) -> None:
        # Only the wanted iteration's state is copied: a long source stays linear.
        kept = state() if iteration == _Probe.wanted else None
        _Probe.seen.setdefault(workflow.info().run_id, {})[iteration] = kept


_LOCKS: dict[int, asyncio.Lock] = {}


def _replaying() -> asyncio.Lock:
    return _LOCKS.setdefault(id(asyncio.get_running_loop()), asyncio.Lock())


@dataclass
class ForkPoint:
    """The source's state after iteration K, and the request it ran with."""

    source_id: str
    run_id: str
    iteration: int
    boundary: Boundary
    request: EpisodeRequest
    running: bool
    iterations_done: int
    changes: list[str] = field(default_factory=list)

    @property
    def state(self) -> EpisodeCarry:
        return self.boundary.state


async def fork_point(client: Client, source_id: str, iteration: int) -> ForkPoint:
    """Replay the source's runs until one ends iteration K; clear errors otherwise."""
    if iteration < 1:
        raise ForkError(f"--at must be 1 or more (the last iteration the fork inherits), not {iteration}")
    try:
        runs = await episode_runs(client, source_id)
    except LookupError as exc:
        raise ForkError(f"cannot fork {source_id!r}: no episode with that id") from exc
    running = runs[-1].status is not None and runs[-1].status.name == "RUNNING"
    replayer = Replayer(
        workflows=[_Probe],
        data_converter=client.data_converter,
        workflow_runner=UnsandboxedWorkflowRunner(),
    )
    done = 0
    for run in runs:
        handle = client.get_workflow_handle(source_id, run_id=run.run_id)
        history = await handle.fetch_history()
        started = history.events[0].workflow_execution_started_event_attributes
        request = await decode(client, started.input, EpisodeRequest)
        if request.fork is not None and iteration <= request.fork.iteration:
            # A fork's inherited iterations ran in its source: the state there is the source's.
            return await fork_point(client, request.fork.source_id, iteration)
        async with _replaying():  # one probe at a time per process: the probe's fields are shared
            _Probe.wanted = iteration
            result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
            seen = _Probe.seen.pop(run.run_id, {})
        kept = seen.get(iteration)
        if kept is not None:
            return ForkPoint(source_id, run.run_id, iteration, kept, request, running, max(seen))
        unfinished = running and run is runs[-1]  # a running history ends mid-task: not a failure
        if result.replay_failure is not None and not unfinished:
            raise ForkError(
                f"cannot fork {source_id!r}: this code cannot replay its history ({result.replay_failure})"
            )
        done = max([done, *seen])
    so_far = " so far (it is still running)" if running else ""
    raise ForkError(
        f"cannot fork {source_id!r} at iteration {iteration}: it has {done} finished iteration(s){so_far}; "
        f"--at takes 1 to {done}"
        if done
        else f"cannot fork {source_id!r}: it has no finished iteration{so_far}"
    )


def fork_request(
    point: ForkPoint,
    *,
    root_model: ModelSettings | None = None,
    sub_model: ModelSettings | None = None,
    policy: str | None = None,
    policy_config: dict[str, Any] | None = None,
    max_iterations: int | None = None,
    max_duration: timedelta | None = None,
    signed_for: tuple[str, bytes] | None = None,
) -> EpisodeRequest:
    """The fork's request: the source's, with its state at K and the settings changed.
    A setting that does not validate raises ForkError before anything starts.
    `signed_for` (the fork's id, the snapshot key) signs its lineage: without it, the
    fork's REPL is rebuilt by re-running the source's cells instead of from its snapshot."""
    source = point.request
    changes: list[str] = []
    update: dict[str, Any] = {}
    if root_model is not None and root_model != source.root_model:
        update["root_model"] = root_model.model_dump()
        changes.append(f"model {source.root_model.model} -> {root_model.model}")
        if source.sub_model is None and sub_model is None:  # the sub-model follows the root's
            changes.append(f"sub-model {source.root_model.model} -> {root_model.model}")
    if sub_model is not None and sub_model != source.effective_sub_model:
        update["sub_model"] = sub_model.model_dump()
        changes.append(f"sub-model {source.effective_sub_model.model} -> {sub_model.model}")
    termination = source.termination
    if policy is not None or policy_config is not None:
        termination = TerminationSpec(
            name=policy or termination.name,
            config=policy_config if policy_config is not None else termination.config,
            scan_printed_output=termination.scan_printed_output,
        )
        if termination != source.termination:
            update["termination"] = termination.model_dump()
            changes.append(f"policy {source.termination.name} -> {termination.name}")
    state = point.state.model_copy(deep=True)
    if "termination" in update:
        state.policy_state = {}  # another policy starts from its own first state
    limits = point.boundary.limits  # as they were at K: a person may have changed them
    if max_iterations is not None:
        if max_iterations <= point.iteration:
            raise ForkError(
                f"--max-iterations {max_iterations} leaves the fork no iteration after {point.iteration}"
            )
        changes.append(f"max_iterations {limits.max_iterations} -> {max_iterations}")
        limits = limits.model_copy(update={"max_iterations": max_iterations})
    if max_duration is not None:
        changes.append(f"max_duration {limits.max_duration} -> {max_duration}")
        limits = limits.model_copy(update={"max_duration": max_duration})
    spent = point.boundary.elapsed_s
    if spent >= limits.max_duration.total_seconds():
        raise ForkError(
            f"the source had spent {spent:.0f} s of max_duration by iteration {point.iteration}: "
            f"give the fork a longer --max-duration than {limits.max_duration.total_seconds():.0f} s"
        )
    origin = ForkOrigin(
        source_id=point.source_id,
        source_run_id=point.run_id,
        iteration=point.iteration,
        elapsed_s=spent,
        source_running=point.running,
        changes=changes,
        ancestors=source.fork.lineage if source.fork is not None else [],
    )
    if signed_for is not None:
        fork_id, key = signed_for
        origin.lineage_mac = lineage_mac(key, fork_id, origin.lineage)
    data = {
        **source.model_dump(),
        **update,
        "limits": limits.model_dump(),
        "carry": state.model_dump(),
        "fork": origin.model_dump(),
        "parent": None,  # a fork of a child episode is an episode of its own
        "deadline": None,
    }
    try:
        request = EpisodeRequest.model_validate(data)
        episode_policy(request).set_state(state.policy_state)  # what the fork's first task does
    except PolicyError as exc:
        raise ForkError(f"invalid fork: {exc}") from exc
    except ValueError as exc:
        raise ForkError(f"invalid fork: {exc}") from exc
    # The fork's first loop check, on the source's budgets at K: a fork that could only
    # extract is refused before it pays for that.
    reached = limit_reached(request, state, timedelta(seconds=spent))
    if reached is not None:
        raise ForkError(
            f"the fork would end at once: by iteration {point.iteration} the source had reached "
            f"its {reached.kind} ({reached.value:g} of {reached.limit:g}); raise it for the fork "
            "(e.g. --max-iterations)"
        )
    point.changes = changes
    return request


def describe_fork(point: ForkPoint) -> str:
    """One line for people: where the fork branched and what it changed."""
    running = " (still running: its state at that iteration all the same)" if point.running else ""
    if point.boundary.ended:
        running += " (where the source ended: the fork asks its model again)"
    changed = "; ".join(point.changes) if point.changes else "same settings"
    return f"forked from {point.source_id} at iteration {point.iteration}{running}: {changed}"


def fork_id(source_id: str, iteration: int) -> str:
    return f"{source_id}-fork{iteration}-{secrets.token_hex(2)}"


class ForkChanges(BaseModel):
    """What a fork changes from its source: the one list of fork settings, read by
    `DurableRLM.fork(...)`, `drlm fork` and `fork_episode`. None keeps the source's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    episode_id: str | None = None  # default: SOURCE-forkK-xxxx
    model: str | None = None
    base_url: str | None = None
    sub_model: str | None = None
    sub_base_url: str | None = None
    policy: str | None = None
    policy_config: dict[str, Any] | None = None
    max_iterations: int | None = None
    max_duration: timedelta | None = None  # a number is seconds

    @classmethod
    def of(cls, changes: dict[str, Any]) -> ForkChanges:
        """The changes, or a ForkError that names a misspelt or mistyped setting."""
        try:
            return cls.model_validate(changes)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'fork'}: "
                + ("not a fork setting" if e["type"] == "extra_forbidden" else e["msg"])
                for e in exc.errors()
            )
            raise ForkError(
                f"invalid fork: {problems} (fork settings: {', '.join(cls.model_fields)})"
            ) from None

    @classmethod
    def from_args(cls, args: Any) -> ForkChanges:
        """`drlm fork`'s flags: each setting has its flag (`--id` is the episode id)."""
        fields = {name: getattr(args, name, None) for name in cls.model_fields}
        fields["episode_id"] = args.id
        return cls.of(fields)


async def fork_episode(
    client: Client,
    task_queue: str,
    source_id: str,
    at: int,
    *,
    settings: Settings | None = None,
    blobs: BlobStore | None = None,
    **changes: Any,
) -> tuple[Any, ForkPoint]:
    """Check everything, then start a fork of `source_id` after iteration `at`: (its
    handle, where it branched). `changes` are ForkChanges' fields. A changed model gets the
    price table's price (`settings` names a user price file; without it, the shipped table).
    With `blobs`, the snapshot the fork starts from is pinned first, so its source's quota
    never deletes it (the fork's first rebuild pins it too, if the source still holds it)."""

    wanted = ForkChanges.of(changes)
    point = await fork_point(client, source_id, at)
    source = point.request
    root = sub = None
    if wanted.model or wanted.base_url:
        root = _model(source.root_model, wanted.model, wanted.base_url, settings)
    if wanted.sub_model or wanted.sub_base_url:
        sub = _model(source.effective_sub_model, wanted.sub_model, wanted.sub_base_url, settings)
    chosen = wanted.episode_id or fork_id(source_id, at)
    settings = settings or Settings.from_env()
    request = fork_request(
        point,
        root_model=root,
        sub_model=sub,
        policy=wanted.policy,
        policy_config=wanted.policy_config,
        max_iterations=wanted.max_iterations,
        max_duration=wanted.max_duration,
        signed_for=(chosen, snapshot_key(settings.snapshot_key, settings.data_dir)),
    )
    if blobs is not None and point.state.snapshot is not None:
        await asyncio.to_thread(pin_snapshot, blobs, point.state.snapshot.digest)
    handle = await start_episode(client, request, task_queue, chosen)
    return handle, point


def _model(
    current: ModelSettings, name: str | None, base_url: str | None, settings: Settings | None
) -> ModelSettings:
    """Another model on the current one's endpoint and options, priced from the table."""

    base = current.model_dump(exclude={"model", "price"})
    if base_url:
        base["base_url"] = base_url
    chosen = model_settings(name or current.model, base)
    return PriceTable.load(settings or Settings.from_env()).priced(chosen)


async def fork_command(
    services: Services, settings: Settings, args: Any, say: Callable[[str], None] | None
) -> Any:
    """`drlm fork`: check everything, then start the fork; its handle."""
    changes = ForkChanges.from_args(args)
    handle, point = await fork_episode(
        services.client,
        settings.task_queue,
        args.episode_id,
        args.at,
        settings=settings,
        blobs=services.blobs,
        **changes.model_dump(),
    )
    if say is not None:
        say(f"episode {handle.id} started: {describe_fork(point)}")
    return handle
