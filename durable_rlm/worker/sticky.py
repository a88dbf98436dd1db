"""Giving episodes back to the shared task queue: their next workflow task goes to any
worker at once, instead of waiting on a sticky queue that nobody polls any more (a worker
that drains, or one that died) for its schedule-to-start timeout."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.workflowservice.v1 import ResetStickyTaskQueueRequest
from temporalio.client import Client

HAND_BACK_AT_ONCE = 100
"""Requests in flight at once: a dead worker may have held thousands of episodes."""


async def hand_back(client: Client, executions: Iterable[tuple[str, str]]) -> None:
    """Reset the stickiness of each (workflow id, run id); an episode that ended meanwhile
    has nothing to give back, and its error is ignored."""
    pending = [(workflow_id, run_id) for workflow_id, run_id in executions if workflow_id]
    for start in range(0, len(pending), HAND_BACK_AT_ONCE):
        await asyncio.gather(
            *(
                client.workflow_service.reset_sticky_task_queue(
                    ResetStickyTaskQueueRequest(
                        namespace=client.namespace,
                        execution=WorkflowExecution(workflow_id=workflow_id, run_id=run_id),
                    )
                )
                for workflow_id, run_id in pending[start : start + HAND_BACK_AT_ONCE]
            ),
            return_exceptions=True,
        )
