"""The RLM episode workflow: the loop of DESIGN.md, with limits and a durable timer.

    while not ended:
        limit reached?            -> one fallback extraction (seed 004)
        ask the root model        (compacting the conversation when it nears the window)
        act: run the reply's cells, answer their calls, resolve FINAL / FINAL_VAR
        decide: the termination policy sees the iteration (seed 003)
        observe: queue what the model sees next

Deterministic: every model call, REPL step and store write is an activity; time comes
from workflow.now() and randomness from workflow.random(). Histories recorded before the
`honest-endings` patch replay with the rules they ran under (workflows/legacy.py).

A model call whose key the provider refuses (401/403) pauses instead of ending the episode:
progress says so, and a `retry_credentials` update (sent once the worker has a fixed key)
runs the same call again. The durable timer and cancellation still end a paused episode.

For the Temporal UI (workflows/metadata.py) every step carries a summary, the episode a
memo, and, if it was started with them, search attributes (status, model, iterations,
tokens, how it ended), upserted on a pause, a resume and the end: not every iteration, so
history keeps its size per iteration.
"""

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from functools import partial
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, FailureError

with workflow.unsafe.imports_passed_through():
    from durable_rlm.workflows import defaults, forks, legacy, metadata, names, prompts, steering
    from durable_rlm.workflows.audit_writer import AuditWriter, action_events, closing_events
    from durable_rlm.workflows.budget import (
        cost_spent,
        extraction_refusal,
        extraction_reply_cap,
        limit_reached,
        root_call_limit,
    )
    from durable_rlm.workflows.compaction import needs_compaction, summary_input_chars
    from durable_rlm.workflows.deadline import DeadlineTimer
    from durable_rlm.workflows.ending import (
        CANCELLED,
        LIMIT_ENDED_BY,
        Ending,
        LimitReached,
        cancelled_ending,
        extraction_ending,
        extraction_failed_ending,
        model_error_ending,
        policy_ending,
        unextracted_ending,
    )
    from durable_rlm.workflows.fallback import (
        ANSWER_FIELDS,
        FallbackReason,
        parse_extraction_response,
    )
    from durable_rlm.workflows.models import (
        AuditEvent,
        CancelReceipt,
        CancelRequest,
        CellDecision,
        CompactionInput,
        CompactionReply,
        CredentialsReceipt,
        EpisodeCarry,
        EpisodeProgress,
        EpisodeRequest,
        EpisodeResult,
        EpisodeStatus,
        ExtractionInput,
        ExtractionReply,
        FinishUpdate,
        HintUpdate,
        LimitsUpdate,
        Message,
        PauseUpdate,
        PendingCell,
        ResumeUpdate,
        RewardReceipt,
        RewardRecord,
        RewardUpdate,
        RootCompletion,
        RootCompletionInput,
        SteeringReceipt,
    )
    from durable_rlm.workflows.outcome import (
        CellRecord,
        IterationOutcome,
        cell_answer,
        next_turn,
        text_answer,
    )
    from durable_rlm.workflows.parsing import FinalSignal, parse_reply, unquote_argument
    from durable_rlm.workflows.repl_steps import ReplSteps
    from durable_rlm.workflows.retries import (
        describe_failure,
        failure_cause,
        is_context_overflow,
        model_step_options,
        model_step_outage,
        raise_if_cancelled,
        store_pause,
        waits_for_credentials,
    )
    from durable_rlm.workflows.signals import (
        action_reward,
        build_action,
        uses_confidence,
        validate_reward_function,
    )
    from durable_rlm.workflows.steering_inbox import SteeringInbox
    from durable_rlm.workflows.termination import (
        ActionResult,
        PolicyContext,
        PolicyDecision,
        PolicyError,
        PolicyRegistry,
        TerminationPolicy,
    )

T = TypeVar("T")


@workflow.defn(name=names.WORKFLOW)
class EpisodeWorkflow:
    def __init__(self) -> None:
        self._s: EpisodeCarry | None = None
        self._request: EpisodeRequest | None = None
        self._repl: ReplSteps | None = None
        self._policy: TerminationPolicy | None = None
        self._honest = True
        self._phase = "starting"
        self._phase_started: datetime | None = None
        self._last_response = ""
        self._last_output = ""
        self._finished = False
        # Rewards may arrive before the run method has set up its state.
        self._reward_inbox = 0.0
        self._rewards_received = 0
        self._reward_log: list[RewardRecord] = []  # the latest rewards, for the audit's events
        self._cancel: CancelRequest | None = None
        self._stopping = False  # the loop is being cancelled: a request, the timer, Temporal
        self._stop_sticks = False  # the loop stops itself once `_stopping` (see `_stop_loop`)
        self._closing = False  # the loop is over: a cancel request would change nothing
        self._depth = 0
        # Model calls paused on a refused key: each waits for a retry_credentials update
        # sent after it paused (the count of updates so far is the epoch).
        self._credentials_epoch = 0
        self._paused_calls = 0
        self._paused: str | None = None
        # Steps the store failed, each waiting on a timer before it is asked again.
        self._store_waits = 0
        self._waiting_for: str | None = None
        self._phase_before_store = ""
        self._phase_before_pause = ""
        self._search = False  # upsert the UI's search attributes (started with them, patched)
        self._reserve = False  # token and cost budgets keep room for an extraction (patched)
        self._fits = False  # the first call needs only to fit; extraction fits what is left (patched)
        self._audit_writer = AuditWriter()  # the row: opening and actions beside the loop, then closing
        # Steering (a person's updates; workflows/steering.py). They may arrive before the
        # run method has set up its state, like rewards.
        self._steering = False  # the timer follows the deadline; cells may wait (patched)
        self._inbox = SteeringInbox()
        self._timer = DeadlineTimer(lambda: self._state.deadline, self._clock_held)

    @workflow.run
    async def run(self, request: EpisodeRequest) -> EpisodeResult:
        self._honest = workflow.patched(names.PATCH_HONEST_ENDINGS)
        self._request = request
        try:
            self._policy = episode_policy(request)
        except PolicyError as exc:
            raise ApplicationError(
                f"invalid episode request: {exc}", type=names.INVALID_REQUEST, non_retryable=True
            ) from exc
        # A fork's first run starts from its source's state; its later runs carry their own.
        forked_now = request.fork is not None and workflow.info().continued_run_id is None
        self._s = request.carry or self._first_state(request)
        if forked_now:
            self._s = forks.starting_state(request, workflow.info().workflow_start_time)
        if request.carry is not None:
            self._policy.set_state(self._s.policy_state)
        self._depth = request.depth
        limits = request.limits
        if limits.max_tokens is not None or limits.max_cost_usd is not None:
            self._reserve = workflow.patched(names.PATCH_BUDGET_RESERVE)
            self._fits = self._reserve and workflow.patched(names.PATCH_BUDGET_FITS)
        if workflow.patched(names.PATCH_UI_METADATA):
            workflow.upsert_memo(metadata.episode_memo(request.task, request.root_model.model, request.depth))
            self._search = metadata.uses_search_attributes(workflow.info().typed_search_attributes)
        # Rewards that arrived before this point were numbered from 1: they follow the carried ones.
        for early in self._reward_log:
            early.number += self._s.rewards_received
        self._reward_inbox += self._s.reward_inbox
        self._rewards_received += self._s.rewards_received
        self._reward_log[:0] = self._s.rewards
        self._steering = workflow.patched(names.PATCH_STEERING)
        self._inbox.carry_over(self._s.actions, self._s.actions_total, self._s.hints)
        self._audit_writer.actions_written = self._s.actions_total
        self._s.hints = []
        local = request.durability.local_repl and workflow.patched(names.PATCH_LOCAL_REPL)
        self._repl = ReplSteps(
            request,
            self._s,
            self._set_phase,
            stop_on_cancel=self._honest,
            stopping=lambda: self._stopping,
            local=local,
            wait_for_credentials=self._wait_for_credentials,
            wait_for_store=self._wait_for_store,
            reserve=self._reserve,
        )

        try:
            self._audit_writer.aside = workflow.patched(names.PATCH_AUDIT_ASIDE)
            opening = request.carry is None or forked_now
            if opening and self._audit_writer.aside:
                # The episode's row is written beside the loop: a slow store delays nothing.
                writer = self._audit_writer
                writer.opening = writer.beside(lambda: self._audit(request, "running"))
            elif opening:
                await self._audit(request, "running")
            ending = await self._episode(request)
        except asyncio.CancelledError:
            if self._honest:
                await self._close(request, "cancelled", CANCELLED)
            raise
        except FailureError as exc:
            if self._honest:
                await self._close(request, "failed", describe_failure(exc))
            raise
        result = self._result(ending)
        self._finished = True
        self._set_phase(f"ended: {result.ended_by}")
        self._show_progress(result.status, result.ended_by, result.answer_source)
        await self._repl.close()
        await self._audit(request, result.status, result)
        return result

    @workflow.update(name="reward")
    def reward(self, update: RewardUpdate) -> RewardReceipt:
        """A reward from an evaluator or a person; the next policy decision reads it."""
        self._reward_inbox += update.value
        self._rewards_received += 1
        self._reward_log.append(
            RewardRecord(
                number=self._rewards_received,
                iteration=self._s.iteration if self._s else 0,
                value=update.value,
                note=update.note,
            )
        )
        del self._reward_log[: -defaults.AUDITED_REWARDS]
        if update.note:
            workflow.logger.info("reward %s: %s", update.value, update.note)
        return RewardReceipt(
            accepted=self._rewards_received,
            pending=self._reward_inbox,
            cumulative=self._s.cumulative_reward if self._s else 0.0,
        )

    @reward.validator
    def _reward_allowed(self, update: RewardUpdate) -> None:
        if self._finished:
            raise ValueError("the episode has ended; it takes no more rewards")

    @workflow.update(name="cancel")
    def cancel(self, request: CancelRequest) -> CancelReceipt:
        """Stop this episode and every descendant; with `extract`, extract what was found."""
        self._cancel = request
        return CancelReceipt(
            episode_id=workflow.info().workflow_id,
            iteration=self._s.iteration if self._s else 0,
            extract=request.extract,
        )

    @cancel.validator
    def _cancel_allowed(self, request: CancelRequest) -> None:
        if self._finished or self._closing:
            raise ValueError("the episode has already ended or is closing; nothing was changed")
        if self._cancel is not None:
            raise ValueError("the episode is already being cancelled")

    @workflow.update(name=names.RETRY_CREDENTIALS)
    def retry_credentials(self) -> CredentialsReceipt:
        """The worker's key was fixed: every model call paused on a refused key runs again."""
        waiting = self._paused_calls
        self._credentials_epoch += 1
        self._paused = None  # a progress query right after this update sees it resumed
        return CredentialsReceipt(episode_id=workflow.info().workflow_id, waiting_calls=waiting)

    @retry_credentials.validator
    def _retry_allowed(self) -> None:
        """Refused (and so not written to history) unless a call waits for a key."""
        if self._finished or self._closing:
            raise ValueError("the episode has already ended or is closing; nothing to retry")
        if self._paused_calls == 0:
            raise ValueError("it is not waiting for credentials; nothing to retry")

    # --- steering: a person's actions (workflows/steering.py) --------------------------------
    # Each is validated first: a refused one changes nothing and writes nothing to history.

    @workflow.update(name=names.HINT)
    def hint(self, update: HintUpdate) -> SteeringReceipt:
        """The root model reads it as a user message on its next turn."""
        self._inbox.hints.append(steering.hint_message(update.sender, update.text))
        return self._record("hint", update.sender, update.text, "the model reads it on its next turn")

    @hint.validator
    def _hint_allowed(self, update: HintUpdate) -> None:
        self._refuse_if_over("hint")

    @workflow.update(name=names.SET_LIMITS)
    def set_limits(self, update: LimitsUpdate) -> SteeringReceipt:
        """New limits, from the next step boundary; one already passed ends the episode by
        the normal limit path (fallback extraction)."""
        request, s = self._request, self._s
        assert request is not None and s is not None
        before = request.limits
        request.limits = steering.changed_limits(before, update)  # every reader shares the request
        if update.max_duration is not None:
            s.deadline = steering.moved_deadline(
                s.deadline, before.max_duration, update.max_duration, request.deadline
            )
            self._timer.move()  # the durable timer is set again
        detail = steering.describe_changes(update, before)
        return self._record("limits", update.sender, detail, f"{detail}, from the next step boundary")

    @set_limits.validator
    def _limits_allowed(self, update: LimitsUpdate) -> None:
        self._refuse_if_over("limit change")
        if self._request is None or self._s is None:
            raise ValueError("the episode is starting; send it again in a moment")
        problem = steering.limits_problem(self._request, update)
        if problem is not None:
            raise ValueError(problem)

    @workflow.update(name=names.PAUSE)
    def pause(self, update: PauseUpdate) -> SteeringReceipt:
        """Hold at the next step boundary, without a sandbox, until `resume`."""
        self._inbox.held, self._inbox.held_since = update, workflow.now()
        clock = "max_duration stops counting" if update.hold_clock else "max_duration keeps counting"
        detail = update.reason + (" " if update.reason else "") + f"({clock})"
        return self._record("pause", update.sender, detail, f"pauses at the next step boundary; {clock}")

    @pause.validator
    def _pause_allowed(self, update: PauseUpdate) -> None:
        self._refuse_if_over("pause")
        if (problem := self._inbox.pause_refusal()) is not None:
            raise ValueError(problem)

    @workflow.update(name=names.RESUME)
    def resume(self, update: ResumeUpdate) -> SteeringReceipt:
        held, since = self._inbox.held, self._inbox.held_since
        assert held is not None and since is not None
        paused_for = workflow.now() - since
        if held.hold_clock and self._s is not None:
            self._s.deadline += paused_for  # the pause did not count against max_duration
            self._timer.move()
        self._inbox.held = self._inbox.held_since = None
        detail = f"after {paused_for.total_seconds():.0f} s paused"
        return self._record("resume", update.sender, detail, "goes on (its REPL is rebuilt from the log)")

    @resume.validator
    def _resume_allowed(self, update: ResumeUpdate) -> None:
        self._refuse_if_over("resume")
        if self._inbox.held is None:
            raise ValueError(
                "it is not paused"
                + ("; it waits for a fixed key (retry_credentials)" if self._paused_calls else "")
            )

    @workflow.update(name=names.FINISH_NOW)
    def finish_now(self, update: FinishUpdate) -> SteeringReceipt:
        """Answer now: stop at the next step boundary, then fallback extraction over the
        history so far."""
        self._inbox.finish = update
        return self._record(
            "finish", update.sender, update.reason, "answers by extraction at the next step boundary"
        )

    @finish_now.validator
    def _finish_allowed(self, update: FinishUpdate) -> None:
        self._refuse_if_over("finish request")
        if (problem := self._inbox.finish_refusal()) is not None:
            raise ValueError(problem)

    @workflow.update(name=names.DECIDE_CELL)
    def decide_cell(self, decision: CellDecision) -> SteeringReceipt:
        """Approve the waiting cell (as written or edited) or reject it with a reason."""
        self._inbox.decision = decision
        kind, detail = steering.describe_decision(decision)
        what = "runs" if decision.approve else "is not run; the model reads the reason"
        return self._record(kind, decision.sender, detail, f"cell {decision.cell} {what}")

    @decide_cell.validator
    def _decision_allowed(self, decision: CellDecision) -> None:
        self._refuse_if_over("decision")
        if (problem := self._inbox.decision_refusal(decision)) is not None:
            raise ValueError(problem)

    def _refuse_if_over(self, what: str) -> None:
        if self._finished or self._closing:
            raise ValueError(f"the episode has already ended or is closing; the {what} changed nothing")
        if self._request is not None and not self._steering:
            raise ValueError(f"the episode began before steering existed; the {what} changed nothing")

    def _record(self, kind: str, sender: str, detail: str, effect: str) -> SteeringReceipt:
        """Log an action the workflow accepted; the receipt tells the sender what happens."""
        iteration = self._s.iteration if self._s else 0
        number = self._inbox.record(kind, sender, detail, workflow.now(), iteration)
        return SteeringReceipt(
            episode_id=workflow.info().workflow_id,
            iteration=iteration,
            action=number,
            message=f"{kind} accepted at iteration {iteration}: {effect}",
        )

    @workflow.query(name="progress")
    def progress(self) -> EpisodeProgress:
        s = self._s
        return EpisodeProgress(
            iteration=s.iteration if s else 0,
            phase=self._phase,
            model_calls=s.model_calls if s else 0,
            sub_calls=s.sub_calls if s else 0,
            last_response=self._last_response,
            last_output=self._last_output,
            finished=self._finished,
            phase_started=self._phase_started,
            paused=self._paused,
            tokens=s.usage.total_tokens + s.unaccounted_tokens if s else 0,
            cost_usd=(None if s.usage.cost_usd is None else cost_spent(s)) if s else 0.0,
            limits=self._request.limits if self._request else None,
            started_at=s.deadline - self._request.limits.max_duration if s and self._request else None,
            root_model=self._request.root_model.model if self._request else None,
            pending_cell=self._inbox.pending_cell,
            held=None if self._inbox.held is None else self._held_description(),
            approve=self._request.approve if self._request else "none",
            actions=self._inbox.actions[-defaults.PROGRESS_ACTIONS :],
            actions_total=self._inbox.actions_total,
        )

    def _held_description(self) -> str:
        return self._inbox.held_description()

    # --- the episode: the loop raced against the durable timer ------------------------------

    def _first_state(self, request: EpisodeRequest) -> EpisodeCarry:
        seed = request.seed if request.seed is not None else workflow.random().randint(0, 2**31 - 1)
        # The budget counts from submission, not from the first task a worker ran.
        started = workflow.info().workflow_start_time if self._honest else workflow.now()
        deadline = started + request.limits.max_duration
        if request.deadline is not None:  # a child never outlives its parent's deadline
            deadline = min(deadline, request.deadline)
        return EpisodeCarry(
            seed=seed,
            deadline=deadline,
            pending=prompts.opening_messages(
                request.task,
                request.context,
                request.code_fences[0],
                ask_confidence=uses_confidence(request.termination.name, request.termination.config),
                output_fields=request.output_fields,
                child_batch_cap=request.limits.max_children_per_batch if request.spawns_children else None,
                tools=request.tools,
                system_prompt=request.system_prompt,
                repl_values=request.repl_values,
            ),
        )

    async def _episode(self, request: EpisodeRequest) -> Ending:
        # The durable timer lives on the server, so it fires even while no worker runs.
        remaining = max((self._state.deadline - workflow.now()).total_seconds(), 0.001)
        loop = asyncio.ensure_future(self._loop(request))
        timer = asyncio.ensure_future(
            self._timer.run() if self._steering else self._timer.sleep(remaining)  # asyncio.sleep's command
        )
        cancel = asyncio.ensure_future(workflow.wait_condition(lambda: self._cancel is not None))
        try:
            await workflow.wait([loop, timer, cancel], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            self._closing = True
            await self._stop_loop(loop, timer, cancel)
            raise
        cancel.cancel()
        self._closing = True
        if loop.done():
            ending = loop.result()  # re-raises continue-as-new
        elif self._cancel is not None:
            # Cancelling the loop cancels the step in flight and, through it, every child.
            await self._stop_loop(loop)
            why = self._cancel.reason
            if self._cancel.extract:
                reason = FallbackReason(kind="cancelled", value=self._state.iteration, limit=0, detail=why)
                ending = LimitReached(reason)
            else:
                ending = cancelled_ending(why)
        else:
            await self._stop_loop(loop)
            ending = LimitReached(
                FallbackReason(
                    kind="timeout",
                    value=self._elapsed(request).total_seconds(),
                    limit=request.limits.max_duration.total_seconds(),
                )
            )
        if isinstance(ending, LimitReached):
            # One extraction, whatever fires during it: the timer is no longer raced.
            ending = await self._extract(request, ending.reason)
        timer.cancel()
        return ending

    async def _stop_loop(self, loop: asyncio.Future[Any], *rest: asyncio.Future[Any]) -> None:
        """Cancel the loop (and `rest`, after it: the order of the commands is history's)
        and wait until the loop has ended.

        A step's handle absorbs a cancel that arrives in the activation that also brings
        the step's result (the result wins), and the loop would go on. So the cancel also
        sticks: with `_stop_sticks`, the loop ends itself at its next boundary or wait
        (`_halt_if_stopping`, `_until`). Histories from before the patch keep the old path."""
        self._stopping = True
        self._stop_sticks = workflow.patched(names.PATCH_CANCEL_STICKS)
        loop.cancel()
        for other in rest:
            other.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
        self._stop_sticks = False  # what follows the loop (extraction, closing) runs on

    def _halted(self) -> bool:
        return self._stopping and self._stop_sticks

    def _halt_if_stopping(self) -> None:
        """Where the loop goes on after a step: end it here if it is being cancelled."""
        if self._halted():
            raise asyncio.CancelledError()

    async def _until(self, condition: Callable[[], bool]) -> None:
        """Wait for `condition`, or for the loop to be stopped (then end it)."""
        await workflow.wait_condition(lambda: condition() or self._halted())
        self._halt_if_stopping()

    def _clock_held(self) -> bool:
        return self._inbox.held is not None and self._inbox.held.hold_clock

    async def _loop(self, request: EpisodeRequest) -> Ending | LimitReached:
        s = self._state
        if request.setup_code and s.iteration == 0 and s.cell_count == 0:
            if workflow.patched(names.PATCH_SETUP_CODE):
                await self._setup(request, request.setup_code)
        while True:
            self._halt_if_stopping()
            if self._steering:
                asked = await self._checkpoint(request)
                if asked is not None:
                    return asked
            limits = request.limits  # a person may change them (set_limits)
            reason = limit_reached(request, s, self._elapsed(request), reserve=self._reserve, fits=self._fits)
            if reason is not None:
                if self._honest:
                    return LimitReached(reason)
                return await self._extract(request, reason)  # as old histories did it
            if self._inbox.hints:
                s.pending = steering.with_hints(s.pending, self._inbox.hints)
                self._inbox.hints = []
            if workflow.info().is_continue_as_new_suggested() and self._cancel is None:
                s.reward_inbox, s.rewards_received, s.rewards = self._reward_state()
                inbox = self._inbox
                s.actions, s.actions_total = steering.keep_latest(inbox.actions), inbox.actions_total
                workflow.continue_as_new(request.model_copy(update={"carry": s}))

            s.iteration += 1
            reply = await self._ask(request)
            self._halt_if_stopping()
            if not isinstance(reply, RootCompletion):
                return reply
            outcome = await self._act(request, reply)
            action, decision = self._decide(request, outcome)
            fields = request.output_fields or ANSWER_FIELDS
            ending = policy_ending(
                outcome, decision, request.termination.name, action.action_type, fields, s.sub_calls
            )
            declined = request.termination.name if ending is None and outcome.answer is not None else None
            turn = next_turn(outcome, request.code_fences[0], limits.output_truncation, declined)
            if self._probing:
                rewards, elapsed, ended = self._reward_state(), self._elapsed(request), ending is not None
                state = partial(forks.boundary, request, s, turn, rewards, elapsed, ended)
                self._iteration_ended(s.iteration, state)
            if ending is not None:
                return ending
            s.pending.extend(turn)

    async def _setup(self, request: EpisodeRequest, code: str) -> None:
        """rlms's setup_code: the REPL's first cell, before the model's first turn. It is in
        the cell log like any cell, so a rebuilt REPL runs it again; if it fails, the model
        reads why in its first turn."""
        s = self._state
        assert self._repl is not None
        s.cell_count += 1
        self._set_phase("setup code")
        ran = await self._repl.run_cell(0, s.cell_count, code)
        if ran.error is not None:
            s.pending.append(Message(role="user", content=prompts.SETUP_FAILED.format(error=ran.error)))

    # --- ask --------------------------------------------------------------------------------

    async def _ask(self, request: EpisodeRequest) -> RootCompletion | Ending | LimitReached:
        """The root model's next reply. A context overflow compacts and retries once."""
        s = self._state
        if self._honest and needs_compaction(s, s.pending, request.limits, request.root_model):
            over = root_call_limit(request, s, calls=2, reserve=self._reserve, fits=self._fits)
            if over is not None:
                return LimitReached(over)
            share = f"{request.limits.compact_at:.0%}"
            failed = await self._compact(request, f"the next request would pass {share} of the window")
            if failed is not None:
                return failed
        try:
            return await self._root_completion(request)
        except ActivityError as err:
            if self._honest:
                raise_if_cancelled(err)
            if not (self._honest and is_context_overflow(err)):
                return model_error_ending(describe_failure(err), failure_cause(err))
        over = root_call_limit(request, s, calls=2, reserve=self._reserve, fits=self._fits)
        if over is not None:
            return LimitReached(over)
        failed = await self._compact(request, "the model said the request exceeds its context window", keep=0)
        if failed is not None:
            return failed
        try:
            return await self._root_completion(request, after_compaction=True)
        except ActivityError as err:
            raise_if_cancelled(err)
            if is_context_overflow(err):
                return LimitReached(FallbackReason(kind="context_overflow", value=s.compactions, limit=0))
            return model_error_ending(describe_failure(err), failure_cause(err))

    async def _root_completion(
        self, request: EpisodeRequest, after_compaction: bool = False
    ) -> RootCompletion:
        s = self._state
        again = " (after compaction)" if after_compaction else ""
        model = request.root_model
        self._set_phase("waiting for the root model")
        reply = await self._with_credentials(
            lambda: workflow.execute_activity(
                names.ROOT_COMPLETION,
                RootCompletionInput(
                    episode_id=workflow.info().workflow_id,
                    iteration=s.iteration,
                    model=model,
                    conversation=s.conversation,
                    append=s.pending,
                    resent_message_chars=request.limits.resent_message_chars,
                ),
                result_type=RootCompletion,
                summary=f"root call {s.iteration}{again}",
                **model_step_options(model, request.durability),
            )
        )
        s.conversation, s.pending = reply.conversation, []
        s.charge(reply.usage, reply.model_time_s)
        s.last_prompt_tokens = reply.usage.prompt_tokens or reply.sent_chars // defaults.CHARS_PER_TOKEN
        s.last_reply_tokens = reply.usage.completion_tokens or len(reply.text) // defaults.CHARS_PER_TOKEN
        self._last_response = reply.text[-defaults.PROGRESS_TEXT_CHARS :]
        return reply

    async def _compact(
        self, request: EpisodeRequest, why: str, keep: int = defaults.COMPACTION_KEEP_MESSAGES
    ) -> Ending | None:
        """Replace older turns by a model-written summary: a step of its own in history."""
        s = self._state
        model = request.root_model
        self._set_phase(f"compacting the conversation ({why})")
        try:
            reply = await self._with_credentials(
                lambda: workflow.execute_activity(
                    names.COMPACT_CONVERSATION,
                    CompactionInput(
                        episode_id=workflow.info().workflow_id,
                        iteration=s.iteration,
                        model=model,
                        conversation=s.conversation,
                        keep_messages=keep,
                        input_chars=summary_input_chars(request.limits, model),
                        reason=why,
                    ),
                    result_type=CompactionReply,
                    summary=f"compaction: {why}",
                    **model_step_options(model, request.durability),
                )
            )
        except ActivityError as err:
            raise_if_cancelled(err)
            return model_error_ending(
                f"compacting the conversation failed: {describe_failure(err)}", failure_cause(err)
            )
        if reply.removed_messages == 0:
            return None  # nothing between the task and the latest turns to summarise
        s.conversation = reply.conversation
        s.compactions += 1
        s.charge(reply.usage, reply.model_time_s)
        s.last_prompt_tokens = reply.conversation_chars // defaults.CHARS_PER_TOKEN
        s.last_reply_tokens = 0
        return None

    async def _with_credentials(self, call: Callable[[], Awaitable[T]]) -> T:
        """Run a model step; if the provider refuses the key, wait for a fixed one and run
        the same step again (its input is unchanged: nothing was charged or appended). A
        store outage is waited out the same way, by a timer (`_wait_for_store`)."""
        outages = 0
        while True:
            self._halt_if_stopping()  # a cancel a wait's last step absorbed
            try:
                return await call()
            except ActivityError as err:
                outage = model_step_outage(err)
                if outage is not None:
                    await self._wait_for_store(outage, outages)
                    outages += 1
                    continue
                if not waits_for_credentials(err):
                    raise
                await self._wait_for_credentials(describe_failure(err))

    async def _through_store_outages(self, call: Callable[[], Awaitable[T]]) -> T:
        """Run a step; while the store fails it, wait (a durable timer) and run it again."""
        outages = 0
        while True:
            self._halt_if_stopping()  # a cancel a wait's last step absorbed
            try:
                return await call()
            except ActivityError as err:
                outage = model_step_outage(err)
                if outage is None:
                    raise
                await self._wait_for_store(outage, outages)
                outages += 1

    async def _wait_for_store(self, problem: str, outages: int) -> None:
        """The store (or a worker) failed a step: say so (progress, `drlm watch`, the status
        attribute) and wait before the step is asked again. Never an ending: only the
        deadline (which cancels the loop, and this wait with it) or a person ends a waiting
        episode. `problem` is the phase's text ("waiting for the store: ...")."""
        if self._store_waits == 0:
            self._phase_before_store = self._phase
            self._show_progress("waiting")
        self._store_waits += 1
        self._waiting_for = problem
        self._set_phase(self._waiting_for)
        try:
            await workflow.sleep(store_pause(outages), summary=f"wait, then ask again: {problem}"[:200])
        finally:  # plain state only: on eviction this runs outside the workflow's event loop
            self._store_waits -= 1
            if self._store_waits == 0:
                self._waiting_for = None
        if self._store_waits == 0:
            self._set_phase(self._phase_before_store)
            self._show_progress("running")

    async def _wait_for_credentials(self, problem: str) -> None:
        """Pause until a retry_credentials update arrives: no model call, no iteration, no
        budget is spent meanwhile. The timer and a cancel still end the episode (they
        cancel the loop, and with it this wait)."""
        epoch = self._credentials_epoch
        if self._paused_calls == 0:
            self._phase_before_pause = self._phase
            self._show_progress("paused")
        self._paused_calls += 1
        self._paused = f"{problem}. Fix it, then run `drlm resume {workflow.info().workflow_id}`"
        self._set_phase(f"paused: {self._paused}")
        try:
            await self._until(lambda: self._credentials_epoch > epoch)
        finally:  # plain state only: on eviction this runs outside the workflow's event loop
            self._paused_calls -= 1
            if self._paused_calls == 0:
                self._paused = None
        if self._paused_calls == 0:
            self._set_phase(self._phase_before_pause)
            self._show_progress("running")

    # --- steering at a step boundary ----------------------------------------------------------

    async def _checkpoint(self, request: EpisodeRequest) -> LimitReached | None:
        """Where a person's actions take effect, between steps: a pause holds here; a
        request to answer now ends the loop by the limit path (fallback extraction)."""
        self._audit_actions(request)
        if self._inbox.held is not None and self._inbox.finish is None:
            await self._hold(request)
        if self._inbox.finish is not None:
            asked = self._inbox.finish
            detail = f"by {asked.sender}" + (f": {asked.reason}" if asked.reason else "")
            return LimitReached(
                FallbackReason(kind="finish_requested", value=self._state.iteration, limit=0, detail=detail)
            )
        return None

    async def _hold(self, request: EpisodeRequest, status: str = "running") -> None:
        """Paused by a person: the sandbox is closed (the next step rebuilds it from the
        log) and the workflow waits on a condition, so it holds no worker slot either."""
        assert self._repl is not None
        phase = self._phase
        self._set_phase(self._held_description())
        self._show_progress("paused")
        await self._repl.close()
        self._state.repl_queue = None  # the next step may go to any worker
        await self._until(lambda: self._inbox.held is None or self._inbox.finish is not None)
        self._audit_actions(request)
        self._set_phase(phase)
        self._show_progress(status)  # what it was before the pause

    async def _approved(self, request: EpisodeRequest, outcome: IterationOutcome, code: str) -> str | None:
        """The code to run for this cell: as written when it needs no approval, else as a
        person approved it (perhaps edited). None when it must not run: rejected (the
        model reads why) or the episode was asked to answer now meanwhile."""
        s = self._state
        reasons = steering.gate(request.approve, code)
        if reasons is None:
            return code
        cell = s.cell_count
        self._inbox.pending_cell = PendingCell(
            episode_id=workflow.info().workflow_id,
            cell=cell,
            iteration=s.iteration,
            code=code,
            reasons=reasons,
            mode=request.approve,
            since=workflow.now(),
        )
        why = "; ".join(reasons) if reasons else "every cell waits (--approve all)"
        self._record("gate", "drlm", f"cell {cell} waits for approval: {why}", "waits")
        self._audit_actions(request)
        self._show_progress("awaiting approval")
        try:
            while True:
                self._set_phase(f"cell {cell} waits for approval")
                await self._until(self._inbox.gate_moved)
                if self._inbox.decision is not None or self._inbox.finish is not None:
                    break
                await self._hold(request, "awaiting approval")  # the cell still waits, without a sandbox
        finally:  # plain state only: on eviction this runs outside the workflow's event loop
            self._inbox.pending_cell = None
        decision, self._inbox.decision = self._inbox.decision, None
        self._show_progress("running")
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

    def _audit_actions(self, request: EpisodeRequest) -> None:
        """Actions accepted since the last write reach the audit store now, beside the loop
        (the closing write holds them all, so a slow or failed one loses nothing)."""
        self._audit_writer.actions_beside(self._inbox.actions_total, lambda: self._audit(request, "running"))

    # --- act --------------------------------------------------------------------------------

    async def _act(self, request: EpisodeRequest, reply: RootCompletion) -> IterationOutcome:
        """Run the reply's cells and resolve its answer: what the model did this turn."""
        s = self._state
        repl = self._repl
        assert repl is not None
        fields = request.output_fields or ANSWER_FIELDS
        outcome = IterationOutcome(s.iteration, reply.text, reply.mean_logprob)
        signal: FinalSignal | None
        if self._honest:
            parsed = parse_reply(reply.text, request.code_fences, request.limits.max_cells_per_reply)
            blocks, signal = parsed.code_blocks, parsed.signal
            if parsed.more_blocks:
                outcome.notes.append(prompts.TOO_MANY_CELLS.format(limit=request.limits.max_cells_per_reply))
        else:
            blocks, signal = legacy.find_code_blocks(reply.text, request.code_fences), None
        for written in blocks:
            self._halt_if_stopping()
            if self._steering and await self._checkpoint(request) is not None:
                return outcome  # asked to answer now: the loop's next boundary ends it
            s.cell_count += 1
            code: str | None = written
            if self._steering and request.approve != "none":
                code = await self._approved(request, outcome, written)
                if code is None:
                    return outcome  # rejected (the model reads why), or asked to answer now
            self._set_phase(f"cell {s.cell_count}")
            ran = await repl.run_cell(s.iteration, s.cell_count, code)
            self._halt_if_stopping()
            cell = CellRecord.of(s.cell_count, code, ran)
            outcome.cells.append(cell)
            if ran.rebuild is not None:
                outcome.notes.extend(ran.rebuild.notes)  # which names a rebuild re-created, and how
            self._last_output = (cell.stdout + (cell.error or ""))[-defaults.PROGRESS_TEXT_CHARS :]
            answer, notes, answered = cell_answer(cell, fields)
            outcome.notes.extend(notes)
            if answered:
                outcome.answer = answer
                return outcome
        if not self._honest:
            signal = legacy.parse_final_signal(reply.text)
        if signal is not None and signal.kind == "final":
            stated = signal.value
            if self._honest and not workflow.patched(names.PATCH_FINAL_AS_WRITTEN):
                stated = unquote_argument(stated)  # recorded before seed 001's rule was kept
            outcome.answer, note = text_answer(stated, "final", fields)
        elif signal is not None:
            read = await repl.read_variable(signal.value)
            self._halt_if_stopping()
            if read.value is None:
                note = (
                    prompts.READ_VAR_FAILED.format(name=signal.value, problem=read.problem)
                    if read.problem
                    else prompts.MISSING_VAR_TURN.format(name=signal.value, fence=request.code_fences[0])
                )
            else:
                outcome.answer, note = text_answer(read.value, "final_var", fields)
        else:
            note = None
        if note is not None:
            outcome.notes.append(note)
        return outcome

    # --- decide -----------------------------------------------------------------------------

    def _decide(
        self, request: EpisodeRequest, outcome: IterationOutcome
    ) -> tuple[ActionResult, PolicyDecision]:
        """Feed the iteration to the termination policy (seed 003); its state is workflow
        state, so replay, a crash and continue-as-new all reach the same decision."""
        s = self._state
        policy = self._policy
        assert policy is not None
        scan = request.termination.scan_printed_output or not self._honest
        action = build_action(
            outcome.answer.text if outcome.answer is not None else None,
            [cell.printed for cell in outcome.cells],
            outcome.reply,
            outcome.mean_logprob,
            show_printed=scan,
            limit=defaults.POLICY_TEXT_CHARS if self._honest else None,
        )
        reward = self._reward_inbox + action_reward(request.reward.function, request.reward.config, action)
        self._reward_inbox = 0.0
        s.cumulative_reward += reward
        context = PolicyContext(
            task=request.task,
            step=s.iteration - 1,
            variables=dict(s.variables),
            metrics={
                "last_reward": reward,
                "cumulative_reward": s.cumulative_reward,
                "iteration": s.iteration,
                "model_calls": s.model_calls,
                "sub_calls": s.sub_calls,
            },
        )
        try:
            decision = policy.decide(action, context)
            s.policy_state = policy.get_state()
        except Exception as exc:
            raise ApplicationError(
                f"termination policy {request.termination.name!r} raised {type(exc).__name__}: {exc}",
                type=names.POLICY_FAILURE,
                non_retryable=True,
            ) from exc
        return action, decision

    # --- ending -----------------------------------------------------------------------------

    async def _extract(self, request: EpisodeRequest, reason: FallbackReason) -> Ending:
        """A limit came before an answer: extract the outputs from the history (seed 004)."""
        s = self._state
        # Episodes that ended on a limit before extraction existed completed without it.
        if not workflow.patched(names.PATCH_FALLBACK_EXTRACTION):
            return Ending(LIMIT_ENDED_BY[reason.kind], None, "none", str(reason), None)
        if not request.fallback_extraction:
            return unextracted_ending(reason, "fallback extraction is disabled")
        refusal = extraction_refusal(request, s, reserve=self._reserve, fits=self._fits)
        if refusal is not None:
            return unextracted_ending(reason, refusal)
        fields = request.output_fields or ANSWER_FIELDS
        model = request.root_model
        cap = extraction_reply_cap(request, s) if self._fits else None
        if cap is not None:  # the reply stays within what the token budget has left
            model = model.model_copy(update={"max_tokens": cap})
        self._set_phase(f"extracting ({reason})")
        try:
            reply = await self._through_store_outages(
                lambda: workflow.execute_activity(
                    names.EXTRACT_FALLBACK,
                    ExtractionInput(
                        episode_id=workflow.info().workflow_id,
                        model=model,
                        conversation=s.conversation,
                        log_head=s.log_head,
                        variables=s.variables,
                        output_fields=fields,
                        reason=reason,
                    ),
                    result_type=ExtractionReply,
                    summary=f"extraction after {reason.kind}",
                    **model_step_options(model, request.durability),
                )
            )
        except ActivityError as err:
            if self._honest:
                raise_if_cancelled(err)
            return extraction_failed_ending(
                reason, f"Extraction LLM call failed: {describe_failure(err)}", []
            )
        s.charge(reply.usage, reply.model_time_s)
        if reply.error is not None:
            return extraction_failed_ending(
                reason, f"Extraction LLM call failed: {reply.error}", reply.history
            )
        parsed = parse_extraction_response(reply.text, fields)
        return extraction_ending(reason, parsed, reply.history, s.variables, fields)

    def _result(self, ending: Ending) -> EpisodeResult:
        s = self._state
        return EpisodeResult(
            episode_id=workflow.info().workflow_id,
            answer=ending.answer,
            answer_source=ending.source,
            answer_policy=ending.policy if ending.source == "policy" else None,
            confidence=ending.confidence,
            stop_reason=ending.stop_reason,
            ended_by=ending.ended_by,
            iterations=s.iteration,
            model_calls=s.model_calls,
            sub_calls=s.sub_calls,
            usage=s.usage,
            model_time_s=round(s.model_time_s, 6),
            error=ending.error,
            failure_cause=ending.failure_cause,
            replay_divergences=s.divergences,
            termination=ending.decision,
            cumulative_reward=s.cumulative_reward,
            execution=ending.execution,
            compactions=s.compactions,
            lost_cells=s.lost_cells,
            tool_calls=s.tool_calls,
            depth=self._depth,
            tree_episodes=s.tree_episodes,
            children=s.children,
            unaccounted_tokens=s.unaccounted_tokens,
            unaccounted_cost_usd=s.unaccounted_cost_usd,
        )

    async def _close(self, request: EpisodeRequest, status: EpisodeStatus, error: str) -> None:
        """An episode that ends without a result still closes its sandbox and its audit row."""
        self._finished = True
        self._set_phase(f"ended: {status}")
        self._show_progress(status)
        if self._repl is not None:
            await self._repl.close()
        await self._audit(request, status, error=error)

    async def _audit(
        self,
        request: EpisodeRequest,
        status: EpisodeStatus,
        result: EpisodeResult | None = None,
        error: str | None = None,
    ) -> None:
        def events() -> list[AuditEvent]:
            if status == "running":
                return action_events(self._inbox.actions)
            iteration = self._s.iteration if self._s else 0
            return closing_events(self._reward_log, self._inbox.actions, self._cancel, iteration)

        await self._audit_writer.write(request, status, events, result, error)

    # --- small helpers ----------------------------------------------------------------------

    @property
    def _state(self) -> EpisodeCarry:
        assert self._s is not None
        return self._s

    def _set_phase(self, phase: str) -> None:
        self._phase = phase
        self._phase_started = workflow.now()
        # The UI's "current details": served by a query, so it costs no history.
        workflow.set_current_details(metadata.current_details(self._s.iteration if self._s else 0, phase))

    def _show_progress(self, status: str, ended_by: str | None = None, source: str | None = None) -> None:
        """Keep the UI's list of episodes current, where the namespace has the attributes."""
        if not self._search or self._s is None:
            return
        s = self._s
        updates = metadata.progress_updates(status, s.iteration, s.usage.total_tokens, ended_by, source)
        workflow.upsert_search_attributes(updates)

    def _reward_state(self) -> tuple[float, int, list[RewardRecord]]:
        """(inbox, received, latest) of the rewards: what a next run or a fork carries."""
        return self._reward_inbox, self._rewards_received, self._reward_log[-defaults.AUDITED_REWARDS :]

    _probing = False  # set by durable_rlm/timetravel/fork.py's replay, which reads each iteration's end

    def _iteration_ended(self, iteration: int, state: Callable[[], forks.Boundary]) -> None:
        """An iteration ended; `state()` is the state after it, as a fork would start from
        it (a replay hook: only durable_rlm/timetravel/fork.py's probe sets `_probing`)."""

    def _elapsed(self, request: EpisodeRequest) -> timedelta:
        started = self._state.deadline - request.limits.max_duration
        return workflow.now() - started


def episode_policy(request: EpisodeRequest) -> TerminationPolicy:
    """The request's termination policy, built and checked; raises PolicyError."""
    validate_reward_function(request.reward.function, request.reward.config)
    return PolicyRegistry.get_termination(request.termination.name, request.termination.config)
