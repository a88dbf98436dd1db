"""Writes the SQL audit projection as an episode goes: each completed step's rows on the
worker that ran it, and the episode's own row (durable_rlm/store/audit_rows.py builds them).

A write that fails or takes longer than WRITE_TIMEOUT_S is logged and dropped: the audit
never blocks or fails an episode (a rebuild from history restores what was dropped).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import sqlalchemy as sa
from temporalio import activity
from temporalio.worker import (
    ActivityInboundInterceptor,
    ExecuteActivityInput,
    Interceptor,
)

from durable_rlm.activities.attempts import attempt_clock, start_attempt_clock
from durable_rlm.store.audit_rows import Row, episode_rows, rows_of_step, write_rows
from durable_rlm.workflows import names
from durable_rlm.workflows.models import (
    AuditEpisodeInput,
)

log = logging.getLogger(__name__)

WRITE_TIMEOUT_S = 2.0
"""Longest a step waits for its audit rows; past it the step goes on and the rows are dropped."""


class AuditWriter:
    """Writes rows through one thread of its own, in the order they were handed over: a slow
    store never takes the threads blob and sandbox work need, and an earlier write of a row
    cannot land after a later one. Past MAX_QUEUED waiting writes, rows are refused."""

    def __init__(self, engine: sa.Engine | None) -> None:
        self.engine = engine
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="drlm-audit")
        self.queued = 0

    async def write(self, rows: list[Row], timeout_s: float = WRITE_TIMEOUT_S) -> None:
        """Raises on a store error, TimeoutError past `timeout_s` (the write still happens
        later, in order), RuntimeError when too many writes already wait."""
        if self.engine is None or not rows:
            return
        if self.queued >= MAX_QUEUED:
            raise RuntimeError(f"{self.queued} audit writes already wait for the store")
        self.queued += 1
        future = asyncio.get_running_loop().run_in_executor(self.executor, write_rows, self.engine, rows)
        future.add_done_callback(self._done)
        await asyncio.wait_for(asyncio.shield(future), timeout_s)

    def _done(self, future: asyncio.Future[None]) -> None:
        self.queued -= 1
        if not future.cancelled() and future.exception() is not None:
            log.warning("audit rows not written: %r", future.exception())


MAX_QUEUED = 64


class AuditActivities:
    """`settle(episode_id)` rewrites an episode's step rows from its history (the worker's
    runtime gives it: durable_rlm/audit/projection.py, which this module may not import)."""

    def __init__(
        self, engine: sa.Engine | None, settle: Callable[[str], Awaitable[None]] | None = None
    ) -> None:
        self.writer = AuditWriter(engine)
        self.settle = settle

    @activity.defn(name=names.AUDIT_EPISODE)
    async def audit_episode(self, record: AuditEpisodeInput) -> None:
        """The episode's own row: retried by its activity's policy, unlike the step rows.

        At the close, the episode's step rows are first settled from its history. A step
        whose rows the store refused (down, or too slow) is remembered only by the process
        that ran it, for its reconciler; a process SIGKILLed before the store came back
        took that with it (the soak found one such row missing). The closing write is
        retried on another worker if this one dies, so every closed episode's rows equal
        its history's. The settling writes step rows only; the closing row is this write's."""
        if record.status != "running" and self.settle is not None and self.writer.engine is not None:
            try:
                await self.settle(record.episode_id)
            except Exception as exc:  # noqa: BLE001 - the closing row still goes in; settled later
                UNSETTLED.add(record.episode_id)
                log.warning("rows of %s not settled at its close: %r", record.episode_id, exc)
        await self.writer.write(episode_rows(record), EPISODE_WRITE_TIMEOUT_S)


EPISODE_WRITE_TIMEOUT_S = 5.0


class AuditInterceptor(Interceptor):
    """Writes each completed step's rows on the worker that ran it (REPL steps that run as
    local activities included): the audit store follows the episode step by step."""

    def __init__(self, writer: AuditWriter) -> None:
        self.writer = writer

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _AuditInbound(next, self.writer) if self.writer.engine is not None else next


class _AuditInbound(ActivityInboundInterceptor):
    def __init__(self, next: ActivityInboundInterceptor, writer: AuditWriter) -> None:
        super().__init__(next)
        self.writer = writer

    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        start_attempt_clock()  # the step's life, for the fence below
        result = await super().execute_activity(input)
        info = activity.info()
        if info.activity_type == names.AUDIT_EPISODE or not input.args:
            return result
        doubt = attempt_clock().in_doubt()
        if doubt is not None:
            # Fenced: a zombie's rows must never stand over the accepted attempt's. Not
            # knowing which this is, it writes none; the reconciler settles the episode's
            # rows from its history (which holds the accepted result) on its next pass.
            UNSETTLED.add(info.workflow_id or "")
            log.info(
                "audit rows of %s in %s left to history: %s", info.activity_type, info.workflow_id, doubt
            )
            return result
        try:
            await self.writer.write(
                rows_of_step(info.workflow_id or "", info.activity_type, input.args[0], result)
            )
        except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001
            # The step is done: its result goes back whatever became of its audit rows, even
            # if a cancel arrived while they were written; the reconciler writes them from
            # history once the store answers again (a store down, a write too slow).
            UNSETTLED.add(info.workflow_id or "")
            log.warning("audit rows of %s in %s not written: %r", info.activity_type, info.workflow_id, exc)
        return result


UNSETTLED: set[str] = set()
"""Episodes some of whose step rows this process fenced off (`_AuditInbound`): the
reconciler (durable_rlm/worker/runtime.py) rewrites their rows from history, then forgets them."""


def take_unsettled() -> list[str]:
    """The fenced episodes so far, forgotten here (the caller settles them)."""
    taken = sorted(episode for episode in UNSETTLED if episode)
    UNSETTLED.clear()
    return taken
