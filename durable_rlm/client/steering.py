"""Client side of steering: a person's actions on a running episode, and the cells that
wait for approval across episodes. Each action is a Temporal update (workflows/episode.py):
answered once the workflow has applied it, or refused with the workflow's reason."""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import os
from datetime import timedelta
from typing import Any

from pydantic import BaseModel
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError

from durable_rlm.client.episodes import has_search_attributes, update_running
from durable_rlm.workflows import metadata, names
from durable_rlm.workflows.models import (
    CellDecision,
    EpisodeProgress,
    FinishUpdate,
    HintUpdate,
    LimitsUpdate,
    PauseUpdate,
    PendingCell,
    ResumeUpdate,
    SteeringReceipt,
)

PENDING_QUERIES = 8  # episodes asked at once by `pending_cells`
PENDING_QUERY_TIMEOUT = timedelta(seconds=5)
"""How long `pending_cells` waits for one episode's answer: a running episode no worker
polls (its process exited) answers no query, and must not hold up the list of the others."""
WAITING_STATUSES = (metadata.AWAITING_APPROVAL, metadata.PAUSED)
"""The `DrlmStatus` of an episode whose cell may wait for approval (a pause keeps it waiting)."""


def default_sender() -> str:
    """Who an action is from unless told (`--as NAME`): the OS user."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (a container's arbitrary uid)
        return os.environ.get("USER") or f"uid {os.getuid()}"


class SteeringOutcome(BaseModel):
    """What an action did: accepted (and the workflow's receipt), or why nothing changed."""

    episode_id: str
    accepted: bool
    message: str
    receipt: SteeringReceipt | None = None


async def _send(client: Client, episode_id: str, update: str, arg: BaseModel) -> SteeringOutcome:
    receipt, refused = await update_running(
        client, episode_id, update, arg, SteeringReceipt, "nothing was changed"
    )
    if refused is not None:
        return SteeringOutcome(episode_id=episode_id, accepted=False, message=refused)
    return SteeringOutcome(
        episode_id=episode_id,
        accepted=True,
        message=f"episode {episode_id}: {receipt.message}",
        receipt=receipt,
    )


async def send_hint(client: Client, episode_id: str, text: str, sender: str | None = None) -> SteeringOutcome:
    update = HintUpdate(sender=sender or default_sender(), text=text)
    return await _send(client, episode_id, names.HINT, update)


async def change_limits(
    client: Client, episode_id: str, sender: str | None = None, **limits: Any
) -> SteeringOutcome:
    """Raise or lower limits (max_iterations, max_llm_calls, max_duration, max_model_calls,
    max_tokens, max_cost_usd); None leaves one as it is."""
    given = {k: v for k, v in limits.items() if v is not None}
    if isinstance(given.get("max_duration"), int | float):
        given["max_duration"] = timedelta(seconds=given["max_duration"])
    update = LimitsUpdate(sender=sender or default_sender(), **given)
    return await _send(client, episode_id, names.SET_LIMITS, update)


async def pause_episode(
    client: Client, episode_id: str, sender: str | None = None, hold_clock: bool = False, reason: str = ""
) -> SteeringOutcome:
    update = PauseUpdate(sender=sender or default_sender(), hold_clock=hold_clock, reason=reason)
    return await _send(client, episode_id, names.PAUSE, update)


async def resume_episode(client: Client, episode_id: str, sender: str | None = None) -> SteeringOutcome:
    return await _send(client, episode_id, names.RESUME, ResumeUpdate(sender=sender or default_sender()))


async def finish_episode(
    client: Client, episode_id: str, sender: str | None = None, reason: str = ""
) -> SteeringOutcome:
    update = FinishUpdate(sender=sender or default_sender(), reason=reason)
    return await _send(client, episode_id, names.FINISH_NOW, update)


def parse_approval_id(approval_id: str) -> tuple[str, int | None]:
    """`EPISODE#CELL` (as `drlm pending` lists it), or an episode id alone (its waiting cell)."""
    episode, sep, cell = approval_id.rpartition("#")
    if sep and cell.isdigit() and episode:
        return episode, int(cell)
    return approval_id, None


async def decide_cell(
    client: Client,
    approval_id: str,
    approve: bool,
    sender: str | None = None,
    code: str | None = None,
    reason: str = "",
) -> SteeringOutcome:
    """Approve the waiting cell (as written, or `code` edited) or reject it with a reason.
    Without a cell number the cell that waits now is meant."""
    episode_id, cell = parse_approval_id(approval_id)
    if cell is None:
        waiting = await waiting_cell(client, episode_id)
        if waiting is None:
            return SteeringOutcome(
                episode_id=episode_id,
                accepted=False,
                message=f"episode {episode_id}: no cell waits for approval",
            )
        cell = waiting.cell
    decision = CellDecision(
        sender=sender or default_sender(), cell=cell, approve=approve, code=code, reason=reason
    )
    return await _send(client, episode_id, names.DECIDE_CELL, decision)


async def progress_of(
    client: Client, episode_id: str, rpc_timeout: timedelta | None = None
) -> EpisodeProgress:
    handle = client.get_workflow_handle(episode_id)
    return await handle.query("progress", result_type=EpisodeProgress, rpc_timeout=rpc_timeout)


async def waiting_cell(
    client: Client, episode_id: str, rpc_timeout: timedelta | None = None
) -> PendingCell | None:
    return (await progress_of(client, episode_id, rpc_timeout)).pending_cell


async def pending_cells(client: Client, unanswered: list[str] | None = None) -> list[PendingCell]:
    """Every cell waiting for approval, across the running episodes, oldest first.

    Only the episodes that may hold one are asked: those whose status says they wait (or
    are paused), and those started without the status attribute, which cannot say. A
    running episode no worker polls answers no query; it is passed over after
    PENDING_QUERY_TIMEOUT (before, every running episode was asked, and a namespace with a
    few worker-less ones took a minute to list), and its id added to `unanswered`."""
    query = f'WorkflowType = "{names.WORKFLOW}" AND ExecutionStatus = "Running"'
    if await has_search_attributes(client):
        waiting = ", ".join(f'"{status}"' for status in WAITING_STATUSES)
        query += f" AND ({metadata.STATUS.name} IN ({waiting}) OR {metadata.STATUS.name} IS NULL)"
    ids = [execution.id async for execution in client.list_workflows(query)]
    gate = asyncio.Semaphore(PENDING_QUERIES)

    async def ask(episode_id: str) -> PendingCell | None:
        async with gate:
            try:
                return await waiting_cell(client, episode_id, PENDING_QUERY_TIMEOUT)
            except RPCError:
                with contextlib.suppress(RPCError):
                    if unanswered is not None and await is_running(client, episode_id):
                        unanswered.append(episode_id)  # no worker runs it, or its worker is busy
                return None  # ended meanwhile, or its history cannot be read here

    found = await asyncio.gather(*(ask(i) for i in dict.fromkeys(ids)))
    return sorted((p for p in found if p is not None), key=lambda p: (p.since, p.episode_id))


async def is_running(client: Client, episode_id: str) -> bool:
    description = await client.get_workflow_handle(episode_id).describe()
    return description.status == WorkflowExecutionStatus.RUNNING
