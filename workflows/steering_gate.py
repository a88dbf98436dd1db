"""Where a person's steering takes effect in the loop: at a step boundary and before a cell.

At each boundary (`checkpoint`) a pause holds the loop, without a sandbox, until `resume`;
a request to answer now ends the loop by the limit path (fallback extraction). Before a
cell runs, the approval gate (`approved`) holds it until a person approves it (perhaps
edited) or rejects it, when the request's `approve` mode says it must wait
(workflows/steering.py `gate`). The updates themselves put their effects in the
`SteeringInbox`; this reads them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from durable_rlm.workflows import metadata, steering
    from durable_rlm.workflows.audit_writer import AuditWriter
    from durable_rlm.workflows.ending import LimitReached
    from durable_rlm.workflows.episode_context import EpisodeContext
    from durable_rlm.workflows.fallback import FallbackReason
    from durable_rlm.workflows.models import PendingCell
    from durable_rlm.workflows.outcome import CellRecord, IterationOutcome
    from durable_rlm.workflows.repl_steps import ReplSteps
    from durable_rlm.workflows.steering_inbox import Moment, SteeringInbox


class SteeringGate:
    """The loop's side of steering: holds, the approval gate, and the audit of actions."""

    def __init__(
        self,
        ctx: EpisodeContext,
        repl: ReplSteps,
        inbox: SteeringInbox,
        audit_writer: AuditWriter,
        write_running: Callable[[], Awaitable[None]],
    ) -> None:
        self.request = ctx.request
        self.state = ctx.state
        self.display = ctx.display
        self.stop = ctx.stop
        self.repl = repl
        self.inbox = inbox
        self.audit_writer = audit_writer
        self.write_running = write_running  # the audit row, as a running episode's

    async def checkpoint(self) -> LimitReached | None:
        """Where a person's actions take effect, between steps: a pause holds here; a
        request to answer now ends the loop by the limit path (fallback extraction)."""
        self.audit_actions()
        if self.inbox.held is not None and self.inbox.finish is None:
            await self.hold()
        if self.inbox.finish is not None:
            asked = self.inbox.finish
            detail = f"by {asked.sender}" + (f": {asked.reason}" if asked.reason else "")
            return LimitReached(
                FallbackReason(kind="finish_requested", value=self.state.iteration, limit=0, detail=detail)
            )
        return None

    async def hold(self, status: str = metadata.RUNNING) -> None:
        """Paused by a person: the sandbox is closed (the next step rebuilds it from the
        log) and the workflow waits on a condition, so it holds no worker slot either."""
        display = self.display
        phase = display.phase
        display.set_phase(self.inbox.held_description())
        display.show(metadata.PAUSED)
        await self.repl.close()  # the next step may go to any worker
        await self.stop.until(lambda: self.inbox.held is None or self.inbox.finish is not None)
        self.audit_actions()
        display.set_phase(phase)
        display.show(status)  # what it was before the pause

    async def approved(self, outcome: IterationOutcome, code: str) -> str | None:
        """The code to run for this cell: as written when it needs no approval, else as a
        person approved it (perhaps edited). None when it must not run: rejected (the
        model reads why) or the episode was asked to answer now meanwhile."""
        s, request, inbox, display = self.state, self.request, self.inbox, self.display
        reasons = steering.gate(request.approve, code)
        if reasons is None:
            return code
        cell = s.cell_count
        inbox.pending_cell = PendingCell(
            episode_id=workflow.info().workflow_id,
            cell=cell,
            iteration=s.iteration,
            code=code,
            reasons=reasons,
            mode=request.approve,
            since=workflow.now(),
        )
        why = "; ".join(reasons) if reasons else "every cell waits (--approve all)"
        moment = Moment(workflow.info().workflow_id, workflow.now(), s.iteration)
        inbox.accept(moment, "gate", "drlm", f"cell {cell} waits for approval: {why}", "waits")
        self.audit_actions()
        display.show(metadata.AWAITING_APPROVAL)
        try:
            while True:
                display.set_phase(f"cell {cell} waits for approval")
                await self.stop.until(inbox.gate_moved)
                if inbox.decision is not None or inbox.finish is not None:
                    break
                await self.hold(metadata.AWAITING_APPROVAL)  # the cell still waits, without a sandbox
        finally:  # plain state only: on eviction this runs outside the workflow's event loop
            inbox.pending_cell = None
        decision, inbox.decision = inbox.decision, None
        display.show(metadata.RUNNING)
        if decision is None:
            return None
        if not decision.approve:
            outcome.cells.append(
                CellRecord(
                    index=cell,
                    code=code,
                    status="rejected",
                    error=steering.CELL_REJECTED.format(sender=decision.sender, reason=decision.reason),
                )
            )
            outcome.notes.append(steering.CELLS_SKIPPED.format(cell=cell, sender=decision.sender))
            return None
        if decision.code is not None:
            outcome.notes.append(steering.CELL_EDITED.format(cell=cell, sender=decision.sender))
            return decision.code
        return code

    def audit_actions(self) -> None:
        """Actions accepted since the last write reach the audit store now, beside the loop
        (the closing write holds them all, so a slow or failed one loses nothing)."""
        self.audit_writer.actions_beside(self.inbox.actions_total, self.write_running)
