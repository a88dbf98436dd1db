"""When a command that runs a cancelled episode itself may take up the episode's calls.

A `drlm cancel` of an episode nobody runs runs it in its own process until it has ended.
Its worker first takes workflow tasks only: the cancel is applied, and each episode of the
tree cancels the model or tool call it was waiting for. A call that the dead worker left
behind is by then retried on the server (its attempt failed as that worker drained, or
when the liveness reaper failed it), and a worker that polled activities at once would
start it: the model paid again, for an episode being cancelled. Only once no episode of
the tree has such a call left does the command's worker take activities too, for what the
closing needs: the sandbox's close and the audit row (and, with --extract, the extraction).
"""

from __future__ import annotations

from collections.abc import Iterable

from temporalio.api.enums.v1 import PendingActivityState
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError

from durable_rlm.workflows import names

CLOSING_STEPS = frozenset({names.AUDIT_EPISODE, names.REPL_CLOSE})
"""Activities a cancelled episode runs as it closes; every other one is work it abandons."""
MAX_TREE = 2_000
"""Episodes of a tree looked at (a tree is bounded by its limits; this bounds one look)."""


async def calls_settled(client: Client, episode_id: str, allowed: Iterable[str] = CLOSING_STEPS) -> bool:
    """Whether no running episode of `episode_id`'s tree has an activity that a worker could
    start, other than `allowed` ones: each is gone, or its cancel was requested."""
    allowed = frozenset(allowed)
    waiting = [episode_id]
    seen: set[str] = set()
    while waiting and len(seen) < MAX_TREE:
        current = waiting.pop()
        if current in seen:
            continue
        seen.add(current)
        try:
            description = await client.get_workflow_handle(current).describe()
        except RPCError:
            return False  # not known yet (a child just started), or the server did not answer
        if description.status != WorkflowExecutionStatus.RUNNING:
            continue
        raw = description.raw_description
        for pending in raw.pending_activities:
            cancelling = pending.state == PendingActivityState.PENDING_ACTIVITY_STATE_CANCEL_REQUESTED
            if pending.activity_type.name not in allowed and not cancelling:
                return False
        waiting.extend(child.workflow_id for child in raw.pending_children)
    return True
