"""The RLM episode workflow: the loop, with limits and a durable timer.

    while not ended:
        limit reached?            -> one fallback extraction (docs: "Fallback extraction")
        ask the root model        (compacting the conversation when it nears the window)
        act: run the reply's cells, answer their calls, resolve FINAL / FINAL_VAR
        decide: the termination policy sees the iteration (docs: "Termination policies")
        observe: queue what the model sees next

Deterministic: every model call, REPL step and store write is an activity; time comes
from workflow.now() and randomness from workflow.random().

The class holds the loop and declares what Temporal requires on it (the run method, the
updates and the query); each other job is a small object in a sibling module, holding the
state it owns (workflows/episode_context.py `STATE_OWNERS` says which fields of the
state each may write). The run method decides the episode's rules once and hands every
collaborator the same `EpisodeContext`:

    ask            root_calls.RootCalls      the root model's reply, compacting if needed
    act            acting.Acting             the reply's cells, its FINAL / FINAL_VAR
    decide         deciding.Decider          the termination policy, with the rewards
    the ending     closing.Closing           extraction, the result, the close
    stopping       stopping.Stopping         a cancel, the timer, Temporal; closing, finished
    waits          outages.OutageWaits       a refused key (`retry_credentials`), the store
    steering       steering_inbox.SteeringInbox   a person's updates, checked and applied
                   steering_gate.SteeringGate     where they take effect: holds, approval
    rewards        reward_inbox.RewardInbox  rewards sent, until a decision reads them
    display        display.EpisodeDisplay    progress, the UI's details and status attribute
    the audit row  audit_writer.AuditWriter  opening, actions beside the loop, then closing
    the deadline   deadline.DeadlineTimer    max_duration, on the server

For the Temporal UI (workflows/metadata.py) every step carries a summary, the episode a
memo, and, if it was started with them, search attributes (status, model, iterations,
tokens, how it ended), upserted on a pause, a resume and the end: not every iteration, so
history keeps its size per iteration.
"""

import asyncio
from collections.abc import Callable
from datetime import timedelta
from functools import partial

from temporalio import workflow
from temporalio.exceptions import ApplicationError, FailureError

with workflow.unsafe.imports_passed_through():
    from durable_rlm.workflows import forks, metadata, names, steering
    from durable_rlm.workflows.acting import Acting
    from durable_rlm.workflows.audit_writer import AuditWriter, action_events, closing_events
    from durable_rlm.workflows.budget import limit_reached
    from durable_rlm.workflows.closing import Closing
    from durable_rlm.workflows.deadline import DeadlineTimer
    from durable_rlm.workflows.deciding import Decider
    from durable_rlm.workflows.display import EpisodeDisplay
    from durable_rlm.workflows.ending import CANCELLED, Ending, LimitReached, cancelled_ending, policy_ending
    from durable_rlm.workflows.episode_context import EpisodeContext, EpisodeRules
    from durable_rlm.workflows.fallback import FallbackReason
    from durable_rlm.workflows.models import (
        AuditEvent,
        CancelReceipt,
        CancelRequest,
        CellDecision,
        CredentialsReceipt,
        EpisodeCarry,
        EpisodeProgress,
        EpisodeRequest,
        EpisodeResult,
        EpisodeStatus,
        FinishUpdate,
        HintUpdate,
        LimitsUpdate,
        PauseUpdate,
        ResumeUpdate,
        RewardReceipt,
        RewardUpdate,
        RootCompletion,
        SteeringReceipt,
    )
    from durable_rlm.workflows.opening import first_state
    from durable_rlm.workflows.outages import OutageWaits
    from durable_rlm.workflows.outcome import next_turn
    from durable_rlm.workflows.repl_steps import ReplSteps
    from durable_rlm.workflows.retries import describe_failure
    from durable_rlm.workflows.reward_inbox import RewardInbox
    from durable_rlm.workflows.root_calls import RootCalls
    from durable_rlm.workflows.signals import validate_reward_function
    from durable_rlm.workflows.steering_gate import SteeringGate
    from durable_rlm.workflows.steering_inbox import Moment, SteeringInbox
    from durable_rlm.workflows.stopping import Stopping
    from durable_rlm.workflows.termination import PolicyError, PolicyRegistry, TerminationPolicy
    from durable_rlm.workflows.typed_outputs import ANSWER_FIELDS


@workflow.defn(name=names.WORKFLOW)
class EpisodeWorkflow:
    # The loop's collaborators: the run method sets them up with the request and the state.
    _root: RootCalls
    _acting: Acting
    _decider: Decider
    _gate: SteeringGate
    _end: Closing

    def __init__(self) -> None:
        self._s: EpisodeCarry | None = None
        self._request: EpisodeRequest | None = None
        # What updates and the query reach, perhaps before the run method has set up its state.
        self._stop = Stopping()
        self._display = EpisodeDisplay(lambda: self._s)
        self._waits = OutageWaits(self._display, self._stop)
        self._rewards = RewardInbox()
        self._inbox = SteeringInbox()  # a person's steering (workflows/steering.py)
        self._timer = DeadlineTimer(lambda: self._state.deadline, self._inbox.clock_held)
        self._audit_writer = AuditWriter()  # the row: opening and actions beside the loop, then closing

    @workflow.run
    async def run(self, request: EpisodeRequest) -> EpisodeResult:
        self._request = request
        try:
            policy = episode_policy(request)
        except PolicyError as exc:
            raise ApplicationError(
                f"invalid episode request: {exc}", type=names.INVALID_REQUEST, non_retryable=True
            ) from exc
        # A fork's first run starts from its source's state; its later runs carry their own.
        forked_now = request.fork is not None and workflow.info().continued_run_id is None
        self._s = request.carry or self._first_state(request)
        if forked_now:
            self._s = forks.starting_state(request, workflow.info().workflow_start_time)
        s = self._s
        if request.carry is not None:
            policy.set_state(s.policy_state)
        workflow.upsert_memo(metadata.episode_memo(request.task, request.root_model.model, request.depth))
        self._display.search = metadata.uses_search_attributes(workflow.info().typed_search_attributes)
        self._rewards.carry_over(s)
        self._inbox.carry_over(s.actions, s.actions_total, s.hints)
        self._audit_writer.actions_written = s.actions_total
        s.hints = []
        self._set_up(request, s, policy)

        try:
            if request.carry is None or forked_now:
                # The episode's row is written beside the loop: a slow store delays nothing.
                writer = self._audit_writer
                writer.opening = writer.beside(lambda: self._audit(request, "running"))
            ending = await self._episode(request)
        except asyncio.CancelledError:
            await self._end.close(metadata.CANCELLED, CANCELLED)
            raise
        except FailureError as exc:
            await self._end.close(metadata.FAILED, describe_failure(exc))
            raise
        return await self._end.finish(ending)

    def _first_state(self, request: EpisodeRequest) -> EpisodeCarry:
        seed = request.seed if request.seed is not None else workflow.random().randint(0, 2**31 - 1)
        # The budget counts from submission, not from the first task a worker ran.
        return first_state(request, seed, workflow.info().workflow_start_time)

    def _set_up(self, request: EpisodeRequest, s: EpisodeCarry, policy: TerminationPolicy) -> None:
        """The loop's collaborators, each given the one context of this episode."""
        ctx = EpisodeContext(request, s, EpisodeRules.of(request), self._display, self._stop, self._waits)
        repl = ReplSteps(ctx)
        self._root = RootCalls(ctx, repl)
        running = partial(self._audit, request, "running")
        self._gate = SteeringGate(ctx, repl, self._inbox, self._audit_writer, running)
        self._acting = Acting(ctx, repl, self._gate)
        self._decider = Decider(request, s, policy, self._rewards)
        self._end = Closing(ctx, repl, partial(self._audit, request))

    # --- rewards, cancel, credentials ---------------------------------------------------------

    @workflow.update(name="reward")
    def reward(self, update: RewardUpdate) -> RewardReceipt:
        """A reward from an evaluator or a person; the next policy decision reads it."""
        s = self._s
        receipt = self._rewards.receive(update, s.iteration if s else 0, s.cumulative_reward if s else 0.0)
        if update.note:
            workflow.logger.info("reward %s: %s", update.value, update.note)
        return receipt

    @reward.validator
    def _reward_allowed(self, update: RewardUpdate) -> None:
        self._rewards.refuse_if_ended(self._stop.finished)

    @workflow.update(name="cancel")
    def cancel(self, request: CancelRequest) -> CancelReceipt:
        """Stop this episode and every descendant; with `extract`, extract what was found."""
        moment = self._moment()
        return self._stop.request_cancel(request, moment.episode_id, moment.iteration)

    @cancel.validator
    def _cancel_allowed(self, request: CancelRequest) -> None:
        self._stop.refuse_cancel()

    @workflow.update(name=names.RETRY_CREDENTIALS)
    def retry_credentials(self) -> CredentialsReceipt:
        """The worker's key was fixed: every model call paused on a refused key runs again."""
        return self._waits.retry(workflow.info().workflow_id)

    @retry_credentials.validator
    def _retry_allowed(self) -> None:
        self._waits.refuse_retry()

    # --- steering: a person's actions (workflows/steering_inbox.py) ---------------------------
    # Each is validated first: a refused one changes nothing and writes nothing to history.

    @workflow.update(name=names.HINT)
    def hint(self, update: HintUpdate) -> SteeringReceipt:
        """The root model reads it as a user message on its next turn."""
        return self._inbox.hint(update, self._moment())

    @hint.validator
    def _hint_allowed(self, update: HintUpdate) -> None:
        self._inbox.refuse_if_over("hint", self._stop.over())

    @workflow.update(name=names.SET_LIMITS)
    def set_limits(self, update: LimitsUpdate) -> SteeringReceipt:
        """New limits, from the next step boundary (one already passed: fallback extraction)."""
        return self._inbox.set_limits(update, self._request, self._s, self._moment(), self._timer.move)

    @set_limits.validator
    def _limits_allowed(self, update: LimitsUpdate) -> None:
        self._inbox.refuse_limits(update, self._request, self._s, self._stop.over())

    @workflow.update(name=names.PAUSE)
    def pause(self, update: PauseUpdate) -> SteeringReceipt:
        """Hold at the next step boundary, without a sandbox, until `resume`."""
        return self._inbox.pause(update, self._moment())

    @pause.validator
    def _pause_allowed(self, update: PauseUpdate) -> None:
        self._inbox.refuse_pause(self._stop.over())

    @workflow.update(name=names.RESUME)
    def resume(self, update: ResumeUpdate) -> SteeringReceipt:
        return self._inbox.resume(update, self._s, self._moment(), self._timer.move)

    @resume.validator
    def _resume_allowed(self, update: ResumeUpdate) -> None:
        self._inbox.refuse_resume(self._stop.over(), waits_for_key=self._waits.paused_calls > 0)

    @workflow.update(name=names.FINISH_NOW)
    def finish_now(self, update: FinishUpdate) -> SteeringReceipt:
        """Answer now: stop at the next step boundary, then fallback extraction."""
        return self._inbox.finish_now(update, self._moment())

    @finish_now.validator
    def _finish_allowed(self, update: FinishUpdate) -> None:
        self._inbox.refuse_finish(self._stop.over())

    @workflow.update(name=names.DECIDE_CELL)
    def decide_cell(self, decision: CellDecision) -> SteeringReceipt:
        """Approve the waiting cell (as written or edited) or reject it with a reason."""
        return self._inbox.decide_cell(decision, self._moment())

    @decide_cell.validator
    def _decision_allowed(self, decision: CellDecision) -> None:
        self._inbox.refuse_decision(decision, self._stop.over())

    @workflow.query(name="progress")
    def progress(self) -> EpisodeProgress:
        return self._display.progress(self._request, self._inbox, self._stop.finished, self._waits.paused)

    def _moment(self) -> Moment:
        """Where an update finds the episode, for its receipt and the action log."""
        return Moment(workflow.info().workflow_id, workflow.now(), self._s.iteration if self._s else 0)

    # --- the episode: the loop raced against the durable timer ------------------------------

    async def _episode(self, request: EpisodeRequest) -> Ending:
        stop = self._stop
        # The durable timer lives on the server, so it fires even while no worker runs.
        loop = asyncio.ensure_future(self._loop(request))
        timer = asyncio.ensure_future(self._timer.run())
        cancel = asyncio.ensure_future(workflow.wait_condition(lambda: stop.cancel is not None))
        try:
            await workflow.wait([loop, timer, cancel], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            stop.closing = True
            await stop.stop_loop(loop, timer, cancel)
            raise
        cancel.cancel()
        stop.closing = True
        if loop.done():
            ending = loop.result()  # re-raises continue-as-new
        elif stop.cancel is not None:
            # Cancelling the loop cancels the step in flight and, through it, every child.
            await stop.stop_loop(loop)
            why = stop.cancel.reason
            if stop.cancel.extract:
                reason = FallbackReason(kind="cancelled", value=self._state.iteration, limit=0, detail=why)
                ending = LimitReached(reason)
            else:
                ending = cancelled_ending(why)
        else:
            await stop.stop_loop(loop)
            ending = LimitReached(
                FallbackReason(
                    kind="timeout",
                    value=self._elapsed(request).total_seconds(),
                    limit=request.limits.max_duration.total_seconds(),
                )
            )
        if isinstance(ending, LimitReached):
            # One extraction, whatever fires during it: the timer is no longer raced.
            ending = await self._end.extract(ending.reason)
        timer.cancel()
        return ending

    async def _loop(self, request: EpisodeRequest) -> Ending | LimitReached:
        s, stop, inbox = self._state, self._stop, self._inbox
        # A session's turn runs its setup cell (binding context_k, history_j) over the REPL it
        # inherits; an episode's setup cell is the REPL's first.
        first_cell = request.session.repl.cell_count if request.session is not None else 0
        if request.setup_code and s.iteration == 0 and s.cell_count == first_cell:
            failed = await self._acting.setup(request.setup_code)
            if failed is not None:
                s.pending.append(failed)  # the model reads why in its first turn
        while True:
            stop.halt_if_stopping()
            if stop.cancel is not None:
                # A cancel taken at this boundary: no iteration begins after it (`_episode`
                # stops the loop here), so the result counts only iterations that began.
                await stop.until(lambda: False)
            asked = await self._gate.checkpoint()
            if asked is not None:
                return asked
            limits = request.limits  # a person may change them (set_limits)
            reason = limit_reached(request, s, self._elapsed(request))
            if reason is not None:
                return LimitReached(reason)
            if inbox.hints:
                s.pending = steering.with_hints(s.pending, inbox.hints)
                inbox.hints = []
            if workflow.info().is_continue_as_new_suggested() and stop.cancel is None:
                s.reward_inbox, s.rewards_received, s.rewards = self._rewards.carried()
                s.actions, s.actions_total = steering.keep_latest(inbox.actions), inbox.actions_total
                workflow.continue_as_new(request.model_copy(update={"carry": s}))

            s.iteration += 1
            reply = await self._root.ask()
            stop.halt_if_stopping()
            if not isinstance(reply, RootCompletion):
                return reply
            outcome = await self._acting.act(reply)
            action, decision = self._decider.decide(outcome)
            fields = request.output_fields or ANSWER_FIELDS
            ending = policy_ending(
                outcome, decision, request.termination.name, action.action_type, fields, s.sub_calls
            )
            declined = request.termination.name if ending is None and outcome.answer is not None else None
            turn = next_turn(outcome, request.code_fences[0], limits.output_truncation, declined)
            if self._probing:
                rewards, elapsed, ended = self._rewards.carried(), self._elapsed(request), ending is not None
                state = partial(forks.boundary, request, s, turn, rewards, elapsed, ended)
                self._iteration_ended(s.iteration, state)
            if ending is not None:
                return ending
            s.pending.extend(turn)

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
            return closing_events(self._rewards.log, self._inbox.actions, self._stop.cancel, iteration)

        await self._audit_writer.write(request, status, events, result, error)

    # --- small helpers ----------------------------------------------------------------------

    @property
    def _state(self) -> EpisodeCarry:
        assert self._s is not None
        return self._s

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
