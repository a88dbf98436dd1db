"""The episode's audit row, written from the workflow (activities/audit.py stores it).

The row is written when the episode opens, when a person's actions were accepted, and when
it closes. The first two run beside the loop (a slow store delays no step) and the closing
write cancels them, since it holds all they would; the
closing write is the one a reader trusts, so its attempts are short and go on, backing off,
for AUDIT_CLOSE_PATIENCE_S. A write that fails for good is logged: history stays the record
(`durable_rlm/audit/projection.py` rebuilds the row from it).

The events a row carries (rewards, actions, a cancel request) are built by the pure
functions below from the workflow's state.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, CancelledError

with workflow.unsafe.imports_passed_through():
    from durable_rlm.workflows import defaults, names
    from durable_rlm.workflows.models import (
        ActionRecord,
        AuditEpisodeInput,
        AuditEvent,
        CancelRequest,
        EpisodeRequest,
        EpisodeResult,
        EpisodeStatus,
        RewardRecord,
    )

RETRY = RetryPolicy(maximum_attempts=defaults.AUDIT_ATTEMPTS)
CLOSE_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1), backoff_coefficient=2.0, maximum_interval=timedelta(seconds=15)
)


def action_events(actions: Sequence[ActionRecord]) -> list[AuditEvent]:
    """A row per steering action, with who sent it and when it was accepted."""
    return [
        AuditEvent(
            key=f"action:{a.number}",
            kind=f"action_{a.kind}",
            iteration=a.iteration,
            detail=a.detail,
            sender=a.sender,
            at=a.at,
        )
        for a in actions
    ]


def closing_events(
    rewards: Sequence[RewardRecord],
    actions: Sequence[ActionRecord],
    cancel: CancelRequest | None,
    iteration: int,
) -> list[AuditEvent]:
    """What the workflow received that no step's result holds: rewards, actions, a cancel."""
    events = [
        AuditEvent(
            key=f"reward:{r.number}", kind="reward", iteration=r.iteration, value=r.value, detail=r.note
        )
        for r in rewards
    ]
    events.extend(action_events(actions))
    if cancel is not None:
        events.append(
            AuditEvent(
                key="cancel",
                kind="cancel_requested",
                iteration=iteration,
                value=1.0 if cancel.extract else 0.0,
                detail=cancel.reason,
            )
        )
    return events


class AuditWriter:
    """Writes the row; keeps the writes that run beside the loop, to cancel them at the close."""

    def __init__(self) -> None:
        self.opening: asyncio.Future[None] | None = None
        self.action_writes: list[asyncio.Future[None]] = []
        self.actions_written = 0  # the count of actions the last action write held

    def beside(self, write: Callable[[], Awaitable[None]]) -> asyncio.Future[None]:
        return asyncio.ensure_future(write())

    def actions_beside(self, total: int, write: Callable[[], Awaitable[None]]) -> None:
        """Actions accepted since the last write reach the store now, beside the loop (the
        closing write holds them all, so a slow or failed one loses nothing)."""
        if total == self.actions_written:
            return
        self.actions_written = total
        self.action_writes = [w for w in self.action_writes if not w.done()]
        self.action_writes.append(self.beside(write))

    async def write(
        self,
        request: EpisodeRequest,
        status: EpisodeStatus,
        events: Callable[[], list[AuditEvent]],
        result: EpisodeResult | None = None,
        error: str | None = None,
    ) -> None:
        """Write the row; `events` is read after the writes beside are cancelled, as it was."""
        info = workflow.info()
        running = status == "running"
        if not running:
            for aside in (self.opening, *self.action_writes):
                if aside is not None and not aside.done():
                    aside.cancel()  # the closing row holds all an earlier one would
                    with contextlib.suppress(asyncio.CancelledError):
                        await aside
        whole = timedelta(seconds=defaults.AUDIT_CLOSE_S)
        attempt: timedelta | None = None  # each attempt may take the whole
        retry = RETRY
        if not running:
            # The closing row is the one a reader trusts: each attempt is short (a worker
            # killed mid-write is replaced at once), and attempts go on, backing off, for
            # AUDIT_CLOSE_PATIENCE_S.
            whole = timedelta(seconds=defaults.AUDIT_CLOSE_PATIENCE_S)
            attempt = timedelta(seconds=defaults.AUDIT_CLOSE_S)
            retry = CLOSE_RETRY
        try:
            await workflow.execute_activity(
                names.AUDIT_EPISODE,
                AuditEpisodeInput.of(
                    request,
                    episode_id=info.workflow_id,
                    run_id=info.run_id,
                    status=status,
                    result=result,
                    error=error,
                    started_at=info.workflow_start_time,  # the first run's: the episode's start
                    ended_at=None if running else workflow.now(),
                    events=events(),
                ),
                retry_policy=retry,
                summary=f"audit: {status}",
                schedule_to_close_timeout=whole,
                start_to_close_timeout=attempt,
            )
        except ActivityError as err:
            if isinstance(err.cause, CancelledError):
                return  # a write beside the loop, cancelled at the close: the closing row holds it
            workflow.logger.warning("audit store write failed; history remains the record")
