"""The episode's REPL as the workflow drives it: steps routed to the worker that holds the
sandbox, a suspended cell's calls answered through the routing table, and a step that
fails on every attempt recorded as a lost cell instead of a broken REPL.

Each step names the cell-log head it expects. A cell's steps append to the log; if the
cell is lost, the workflow goes back to the head it had before the cell, so the next step
rebuilds a clean REPL from the cells that did finish (the lost one is not in its log).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

from durable_rlm.workflows import defaults, metadata, names
from durable_rlm.workflows.call_answers import CallAnswerer
from durable_rlm.workflows.episode_context import EpisodeContext
from durable_rlm.workflows.models import (
    CallAnswer,
    CellOutcome,
    CloseSandboxInput,
    EpisodeRequest,
    ExecuteCellInput,
    ReadVariableInput,
    ResumeCellInput,
    SandboxRef,
    SubCallRequest,
    VariableValue,
)
from durable_rlm.workflows.parsing import is_variable_name
from durable_rlm.workflows.retries import (
    STEP_FAILURES,
    describe_failure,
    describe_lost_step,
    error_type,
    is_timeout,
    raise_if_cancelled,
    waits_for_store,
)
from durable_rlm.workflows.typed_outputs import ANSWER_FIELDS

R = TypeVar("R", CellOutcome, VariableValue)  # a step's reply: it names the cell-log head


def sandbox_name(request: EpisodeRequest) -> str:
    """The name the REPL runs under: the episode's id, or a session's for all its turns, so
    that each turn finds the REPL the last one left (its sandbox, or its own snapshots)."""
    return request.session.session_id if request.session is not None else workflow.info().workflow_id


LOST_CELL = (
    "{cause}; its effects are discarded and variables from earlier cells are restored. "
    "Run it again if you still need it (split long work into shorter cells)."
)


@dataclass(frozen=True)
class VariableRead:
    value: str | None
    problem: str | None = None  # why it could not be read, when the read itself failed


async def close_sandbox_here(summary: str) -> None:
    """Close this workflow's sandbox on the worker that runs it (a local activity, one
    attempt): the episode's last step and a session's end. The caller decides what a failure
    means; idle reaping covers a sandbox left open."""
    await workflow.execute_local_activity(
        names.REPL_CLOSE,
        CloseSandboxInput(episode_id=workflow.info().workflow_id),
        result_type=bool,
        start_to_close_timeout=timedelta(seconds=defaults.CLOSE_SANDBOX_TIMEOUT_S),
        retry_policy=RetryPolicy(maximum_attempts=1),
        summary=summary,
    )


class ReplSteps:
    """The episode's REPL steps: a cell run to its end (its calls answered), a variable read,
    the sandbox closed. Owns the REPL's part of the state: the log head, where the sandbox
    is, the latest snapshot, the variables' summary, lost cells and divergences."""

    def __init__(self, ctx: EpisodeContext) -> None:
        self.ctx = ctx
        self.request = ctx.request
        self.state = ctx.state
        self.local = ctx.rules.local_repl

    def _sandbox(self) -> SandboxRef:
        return SandboxRef(
            episode_id=sandbox_name(self.request),
            context=self.request.context,
            seed=self.state.seed,
            log_head=self.state.log_head,
            cell_timeout_s=self.request.limits.cell_timeout_s,
            output_truncation=self.request.limits.output_truncation,
            child_batch_cap=(
                self.request.limits.max_children_per_batch if self.request.spawns_children else None
            ),
            tools=self.request.tools,
            rlms=self.request.rlms,
            dspy_outputs=self._dspy_outputs(),
            snapshots=self.request.durability.snapshots,
            # A fork starts from its source's latest snapshot: it may load that episode's.
            lineage=self.request.fork.lineage if self.request.fork is not None else [],
            lineage_mac=self.request.fork.lineage_mac if self.request.fork is not None else None,
        )

    def _dspy_outputs(self) -> list[str] | None:
        """A DSPy program's REPL: SUBMIT's fields, in the signature's order."""
        if self.request.dspy is None:
            return None
        return [f.name for f in self.request.output_fields or ANSWER_FIELDS]

    async def run_cell(self, iteration: int, cell_index: int, code: str) -> CellOutcome:
        """Run a cell to completion, answering its calls; never raises for a lost step."""
        state = self.state
        head_before, snapshot_before = state.log_head, state.snapshot
        rebuild = None
        try:
            outcome = await self._step(
                names.REPL_EXECUTE,
                ExecuteCellInput(
                    sandbox=self._sandbox(), iteration=iteration, cell_index=cell_index, code=code
                ),
                CellOutcome,
                metadata.cell_summary(cell_index, code),
            )
            rebuild = outcome.rebuild
            while outcome.status == "suspended":
                kind = outcome.requests[0].kind if outcome.requests else "model"
                self.ctx.display.set_phase(f"cell {cell_index}: {len(outcome.requests)} {kind} call(s)")
                answers = await self.answer_calls(iteration, cell_index, outcome.requests)
                outcome = await self._step(
                    names.REPL_RESUME,
                    ResumeCellInput(sandbox=self._sandbox(), cell_index=cell_index, answers=answers),
                    CellOutcome,
                    f"cell {cell_index} resumed with {len(answers)} answer(s)",
                )
                rebuild = outcome.rebuild or rebuild
        except STEP_FAILURES as err:
            raise_if_cancelled(err)
            state.log_head, state.repl_queue, state.snapshot = head_before, None, snapshot_before
            state.lost_cells += 1
            return CellOutcome(
                status="completed",
                log_head=head_before or "",
                worker_queue="",
                error=LOST_CELL.format(cause=describe_lost_step(err)),
                cell_status="lost",
            )
        state.divergences += len(outcome.divergences)
        if outcome.variables or outcome.ok:
            state.variables = outcome.variables
        if outcome.snapshot is not None:
            state.snapshot = outcome.snapshot
        if rebuild is not None and outcome.rebuild is None:
            outcome = outcome.model_copy(update={"rebuild": rebuild})  # its notes reach the model
        return outcome

    async def read_variable(self, name: str) -> VariableRead:
        if not is_variable_name(name):
            return VariableRead(None)
        try:
            value = await self._step(
                names.REPL_READ_VARIABLE,
                ReadVariableInput(sandbox=self._sandbox(), name=name),
                VariableValue,
                f"read variable {metadata.shorten(name, metadata.NAME_CHARS)}",
            )
        except STEP_FAILURES as err:
            raise_if_cancelled(err)
            self.state.repl_queue = None
            return VariableRead(None, describe_failure(err))
        return VariableRead(value.value if value.found else None)

    async def close(self) -> None:
        """Close the sandbox; the next step (after a pause) may go to any worker."""
        queue, self.state.repl_queue = self.state.repl_queue, None
        if self.local:
            try:
                await close_sandbox_here("close the sandbox")
            except STEP_FAILURES:
                pass  # idle reaping covers a sandbox that would not close
            return
        if queue is None:
            return
        try:
            await workflow.execute_activity(
                names.REPL_CLOSE,
                CloseSandboxInput(episode_id=workflow.info().workflow_id),
                result_type=bool,
                task_queue=queue,
                schedule_to_start_timeout=timedelta(seconds=defaults.CLOSE_SANDBOX_TIMEOUT_S),
                start_to_close_timeout=timedelta(seconds=3 * defaults.CLOSE_SANDBOX_TIMEOUT_S),
                retry_policy=RetryPolicy(maximum_attempts=1),
                summary="close the sandbox",
            )
        except STEP_FAILURES:
            pass  # the worker is gone, and its sandbox with it; idle reaping covers the rest

    async def _step(self, activity: str, arg: Any, result: type[R], summary: str) -> R:
        """A REPL step, routed to the worker that holds this episode's sandbox.

        If that worker is gone (the step is not picked up in time), the step goes to the
        shared queue, where any worker rebuilds the sandbox from the cell log.

        A local step runs on the worker running this workflow task, which is where the
        sandbox lives as long as the episode stays in that worker's cache; on any other
        worker it rebuilds. It saves an activity dispatch and a workflow task per step.
        """
        if self.local:
            return await self._local_step(activity, arg, result, summary)
        state = self.state
        durability = self.request.durability
        outages = 0
        while True:
            sticky = state.repl_queue
            try:
                outcome: R = await workflow.execute_activity(
                    activity,
                    arg,
                    result_type=result,
                    task_queue=sticky or workflow.info().task_queue,
                    schedule_to_start_timeout=(
                        timedelta(seconds=durability.sticky_schedule_to_start_s) if sticky else None
                    ),
                    start_to_close_timeout=timedelta(
                        seconds=self.request.limits.cell_timeout_s + defaults.REPL_SLACK_S
                    ),
                    heartbeat_timeout=timedelta(seconds=durability.heartbeat_timeout_s),
                    retry_policy=RetryPolicy(
                        maximum_attempts=(
                            defaults.REPL_ATTEMPTS_STICKY if sticky else defaults.REPL_ATTEMPTS_SHARED
                        ),
                        non_retryable_error_types=[names.SANDBOX_FAILURE],
                    ),
                    summary=summary,
                )
            except ActivityError as err:
                if sticky and is_timeout(err):
                    state.repl_queue = None
                    continue
                if waits_for_store(err):
                    await self.ctx.waits.wait_for_store(
                        f"waiting for the store: {describe_failure(err)}", outages
                    )
                    outages += 1
                    continue
                raise
            state.log_head = outcome.log_head or state.log_head
            state.repl_queue = outcome.worker_queue
            return outcome

    async def _local_step(self, activity: str, arg: Any, result: type[R], summary: str) -> R:
        outages = 0
        while True:
            try:
                outcome: R = await workflow.execute_local_activity(
                    activity,
                    arg,
                    result_type=result,
                    start_to_close_timeout=timedelta(
                        seconds=self.request.limits.cell_timeout_s + defaults.REPL_SLACK_S
                    ),
                    retry_policy=RetryPolicy(
                        maximum_attempts=defaults.REPL_ATTEMPTS_LOCAL,
                        non_retryable_error_types=[
                            names.SANDBOX_FAILURE,
                            names.REPL_STEP_ABANDONED,
                            names.SANDBOXES_BUSY,
                        ],
                    ),
                    summary=summary,
                )
                break
            except (ActivityError, ApplicationError) as err:  # a local step's failure can come bare
                if waits_for_store(err):
                    # The store failed the step on every attempt: not the cell's fault, so
                    # not a lost cell. Wait for the store and ask the same step again.
                    await self.ctx.waits.wait_for_store(
                        f"waiting for the store: {describe_failure(err)}", outages
                    )
                    outages += 1
                    continue
                if error_type(err) != names.SANDBOXES_BUSY:
                    raise
                # Every sandbox of the worker ran a step for the whole wait: not a failure of
                # this step, and not one of its attempts (which would end in a lost cell, its
                # paid sub-calls with it). Ask again. (A new failure type: no history before
                # it holds one, so no patch is needed.)
                await workflow.sleep(defaults.SANDBOX_BUSY_PAUSE_S, summary="every sandbox busy: ask again")
        self.state.log_head = outcome.log_head or self.state.log_head
        return outcome

    async def answer_calls(
        self, iteration: int, cell_index: int, requests: list[SubCallRequest]
    ) -> list[CallAnswer]:
        """Answer a suspended cell's calls (workflows/call_answers.py)."""
        return await CallAnswerer(self.ctx).answer(iteration, cell_index, requests)
