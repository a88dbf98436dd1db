"""Giving episodes back to the shared task queue: their next workflow task goes to any
worker at once, instead of waiting on a sticky queue that nobody polls any more (a worker
that drains, or one that died) for its schedule-to-start timeout."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from datetime import timedelta

from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.workflowservice.v1 import ResetStickyTaskQueueRequest
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

HAND_BACK_AT_ONCE = 100
"""Requests in flight at once: a dead worker may have held thousands of episodes."""
REQUEST_TIMEOUT = timedelta(seconds=5)
"""A server that takes a request and never answers must not hold the look that sent it."""


async def hand_back(client: Client, executions: Iterable[tuple[str, str]]) -> int:
    """Reset the stickiness of each (workflow id, run id); how many the server did not answer
    (an episode that ended meanwhile has nothing to give back: that answer counts as one)."""
    pending = [(workflow_id, run_id) for workflow_id, run_id in executions if workflow_id]
    unanswered = 0
    for start in range(0, len(pending), HAND_BACK_AT_ONCE):
        results = await asyncio.gather(
            *(
                client.workflow_service.reset_sticky_task_queue(
                    ResetStickyTaskQueueRequest(
                        namespace=client.namespace,
                        execution=WorkflowExecution(workflow_id=workflow_id, run_id=run_id),
                    ),
                    timeout=REQUEST_TIMEOUT,
                )
                for workflow_id, run_id in pending[start : start + HAND_BACK_AT_ONCE]
            ),
            return_exceptions=True,
        )
        unanswered += sum(isinstance(result, BaseException) and not _answered(result) for result in results)
    return unanswered


def _answered(error: BaseException) -> bool:
    """An error that is the server's answer about the episode (gone, ended, or never known),
    not its silence."""
    return isinstance(error, RPCError) and error.status in (
        RPCStatusCode.NOT_FOUND,
        RPCStatusCode.INVALID_ARGUMENT,
        RPCStatusCode.FAILED_PRECONDITION,
    )
