"""The RLM episode workflow: the loop of DESIGN.md, with limits and a durable timer.

Deterministic: every model call, REPL step and store write is an activity; time comes
from workflow.now() and randomness from workflow.random().
"""

import asyncio
import json
from datetime import timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, TimeoutError, TimeoutType

with workflow.unsafe.imports_passed_through():
    from workflows import names, prompts
    from workflows.fallback import (
        ANSWER_FIELDS,
        ExecutionResult,
        ExecutionState,
        Extracted,
        Failed,
        FallbackReason,
        FallbackTrigger,
        FieldSpec,
        Submitted,
        calculate_extraction_confidence,
        check_outputs,
        parse_extraction_response,
    )
    from workflows.models import (
        AuditEpisodeInput,
        CallAnswer,
        CellOutcome,
        CloseSandboxInput,
        EndReason,
        EpisodeCarry,
        EpisodeProgress,
        EpisodeRequest,
        EpisodeResult,
        ExecuteCellInput,
        ExtractionInput,
        ExtractionReply,
        Message,
        ReadVariableInput,
        ResumeCellInput,
        RewardReceipt,
        RewardUpdate,
        RootCompletion,
        RootCompletionInput,
        SandboxRef,
        SubCallRequest,
        SubQueryInput,
        SubQueryReply,
        TerminationDecision,
        VariableValue,
    )
    from workflows.parsing import find_code_blocks, is_variable_name, parse_final_signal
    from workflows.signals import action_reward, build_action, uses_confidence, validate_reward_function
    from workflows.termination import PolicyContext, PolicyError, PolicyRegistry, TerminationPolicy

R = TypeVar("R")
_AUDIT_RETRY = RetryPolicy(maximum_attempts=5)


@workflow.defn(name=names.WORKFLOW)
class EpisodeWorkflow:
    def __init__(self) -> None:
        self._s: EpisodeCarry | None = None
        self._phase = "starting"
        self._last_response = ""
        self._last_output = ""
        self._finished = False
        self._policy: TerminationPolicy | None = None
        # Rewards may arrive before the run method has set up its state.
        self._reward_inbox = 0.0
        self._rewards_received = 0

    @workflow.run
    async def run(self, request: EpisodeRequest) -> EpisodeResult:
        try:
            self._policy = episode_policy(request)
        except PolicyError as exc:
            raise ApplicationError(
                f"invalid episode request: {exc}", type=names.INVALID_REQUEST, non_retryable=True
            ) from exc
        carry = request.carry
        if carry is None:
            seed = request.seed if request.seed is not None else workflow.random().randint(0, 2**31 - 1)
            carry = EpisodeCarry(
                seed=seed,
                deadline=workflow.now() + request.limits.max_duration,
                pending=prompts.opening_messages(
                    request.task,
                    request.context,
                    request.code_fences[0],
                    ask_confidence=uses_confidence(request.termination.name, request.termination.config),
                    output_fields=request.output_fields,
                ),
            )
            await self._audit(request, None)
        else:
            self._policy.set_state(carry.policy_state)
        self._reward_inbox += carry.reward_inbox
        self._rewards_received += carry.rewards_received
        self._s = carry

        # The durable timer: it lives on the server, so it fires even while no worker runs.
        remaining = max((carry.deadline - workflow.now()).total_seconds(), 0.001)
        loop = asyncio.ensure_future(self._loop(request))
        timer = asyncio.ensure_future(asyncio.sleep(remaining))
        await workflow.wait([loop, timer], return_when=asyncio.FIRST_COMPLETED)
        if loop.done():
            timer.cancel()
            result = loop.result()  # re-raises continue-as-new
        else:
            loop.cancel()
            try:
                await loop
            except asyncio.CancelledError:
                pass
            reason = FallbackReason(
                kind="timeout",
                value=self._elapsed(request).total_seconds(),
                limit=request.limits.max_duration.total_seconds(),
            )
            result = await self._fallback(request, reason)

        self._finished, self._phase = True, f"ended: {result.ended_by}"
        await self._close_sandbox()
        await self._audit(request, result)
        return result

    @workflow.update(name="reward")
    def reward(self, update: RewardUpdate) -> RewardReceipt:
        """A reward from an evaluator or a person; the next policy decision reads it."""
        self._reward_inbox += update.value
        self._rewards_received += 1
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
        )

    # --- the loop -----------------------------------------------------------------------

    async def _loop(self, request: EpisodeRequest) -> EpisodeResult:
        s = self._state
        limits = request.limits
        fence = request.code_fences[0]
        trigger = FallbackTrigger(limits.max_iterations, limits.max_llm_calls, limits.max_duration)
        fields = request.output_fields or ANSWER_FIELDS
        while True:
            reason = trigger.should_trigger(
                ExecutionState(iterations=s.iteration, llm_calls=s.sub_calls, elapsed=self._elapsed(request))
            )
            if reason is not None:
                return await self._fallback(request, reason)
            if workflow.info().is_continue_as_new_suggested():
                s.reward_inbox, s.rewards_received = self._reward_inbox, self._rewards_received
                workflow.continue_as_new(request.model_copy(update={"carry": s}))

            s.iteration += 1
            self._phase = "model"
            try:
                reply = await self._root_completion(request)
            except ActivityError as err:
                error = describe_failure(err)
                failed = Failed(reason=f"model call failed: {error}")
                return self._result(
                    "model_error", None, error=error, execution=ExecutionResult(variant=failed)
                )
            self._last_response = reply.text[-2_000:]

            observations: list[str] = []
            outputs: list[tuple[str, str, str | None]] = []
            answer: str | None = None
            submitted: dict[str, Any] | None = None
            kind: EndReason | None = None
            blocks = find_code_blocks(reply.text, request.code_fences)
            for code in blocks:
                s.cell_count += 1
                self._phase = f"cell {s.cell_count}"
                outcome = await self._run_cell(request, s.cell_count, code)
                text = prompts.observation(
                    s.cell_count,
                    code,
                    outcome.stdout,
                    outcome.stderr,
                    outcome.error,
                    limits.output_truncation,
                )
                observations.append(text)
                outputs.append((outcome.stdout, outcome.stderr, outcome.error))
                self._last_output = text[-2_000:]
                if outcome.variables or outcome.ok:
                    s.variables = outcome.variables
                if outcome.submitted is not None:
                    problems = check_outputs(outcome.submitted, fields, allow_null=False)
                    if problems:
                        observations.append(prompts.SUBMIT_REJECTED.format(problems="; ".join(problems)))
                    else:
                        submitted, kind = outcome.submitted, "submitted"
                        answer = answer_text(submitted, fields)
                        break
                if outcome.answer is not None:
                    answer, kind = outcome.answer, "answer_ready"
                    break

            signal = parse_final_signal(reply.text) if answer is None else None
            if signal is not None and signal.kind == "final":
                answer, kind = signal.value, "final"
            elif signal is not None:
                value = await self._read_variable(request, signal.value)
                if value is not None:
                    answer, kind = value, "final_var"
                else:
                    observations.append(prompts.MISSING_VAR_TURN.format(name=signal.value, fence=fence))

            if answer is not None and submitted is None:
                submitted = answer_outputs(answer, fields)
                if submitted is None:  # FINAL cannot fill a typed schema
                    answer, kind = None, None
                    observations.append(prompts.NEEDS_SUBMIT)

            action = build_action(answer, outputs, reply.text, reply.mean_logprob)
            decision = self._decide(request, action)
            if decision is not None:
                ended_by = kind if action.action_type == "final" and kind else "policy"
                if submitted is None or action.action_type != "final":
                    submitted = {f.name: None for f in fields}
                    submitted[fields[0].name] = decision.answer
                execution = ExecutionResult(
                    variant=Submitted(outputs=submitted, iterations=s.iteration, llm_calls=s.sub_calls)
                )
                return self._result(ended_by, decision.answer, decision=decision, execution=execution)

            if answer is not None:
                observations.append(prompts.ANSWER_NOT_ACCEPTED.format(policy=request.termination.name))
            if not observations:
                s.pending = [Message(role="user", content=prompts.NO_CODE_TURN.format(fence=fence))]
            else:
                s.pending = [prompts.next_turn(observations)]

    def _decide(self, request: EpisodeRequest, action: Any) -> TerminationDecision | None:
        """Feed the iteration to the termination policy (seed 003); its state is workflow
        state, so replay, a crash and continue-as-new all reach the same decision."""
        s = self._state
        policy = self._policy
        assert policy is not None
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
        policy.last_reason = None
        try:
            stop, answer = policy.should_terminate(action, context)
        except Exception as exc:
            raise ApplicationError(
                f"termination policy {request.termination.name!r} raised {type(exc).__name__}: {exc}",
                type=names.POLICY_FAILURE,
                non_retryable=True,
            ) from exc
        s.policy_state = policy.get_state()
        if not stop:
            return None
        return TerminationDecision(
            policy=request.termination.name,
            step=context.step,
            reason=policy.last_reason or f"{request.termination.name} decided to stop",
            answer=answer,
            action_type=action.action_type,
        )

    async def _root_completion(self, request: EpisodeRequest) -> RootCompletion:
        s = self._state
        model = request.root_model
        reply = await workflow.execute_activity(
            names.ROOT_COMPLETION,
            RootCompletionInput(
                episode_id=workflow.info().workflow_id,
                iteration=s.iteration,
                model=model,
                conversation=s.conversation,
                append=s.pending,
            ),
            result_type=RootCompletion,
            start_to_close_timeout=timedelta(seconds=model.request_timeout_s + 30),
            heartbeat_timeout=timedelta(seconds=request.durability.heartbeat_timeout_s),
            retry_policy=model_retry_policy(model.max_attempts),
        )
        s.conversation, s.pending = reply.conversation, []
        s.model_calls += 1
        s.usage = s.usage.add(reply.usage)
        s.model_time_s += reply.model_time_s
        return reply

    # --- the REPL -----------------------------------------------------------------------

    async def _run_cell(self, request: EpisodeRequest, cell_index: int, code: str) -> CellOutcome:
        s = self._state
        try:
            outcome = await self._repl(
                request,
                names.REPL_EXECUTE,
                ExecuteCellInput(
                    sandbox=self._sandbox(request),
                    iteration=s.iteration,
                    cell_index=cell_index,
                    code=code,
                ),
                CellOutcome,
            )
            while outcome.status == "suspended":
                self._phase = f"cell {cell_index}: {len(outcome.requests)} model call(s)"
                answers = await self._answer_calls(request, cell_index, outcome.requests)
                outcome = await self._repl(
                    request,
                    names.REPL_RESUME,
                    ResumeCellInput(sandbox=self._sandbox(request), cell_index=cell_index, answers=answers),
                    CellOutcome,
                )
        except ActivityError as err:
            # The sandbox step failed beyond its retries: an observation, not a lost episode.
            # The next step rebuilds the REPL from the last head the workflow accepted.
            s.repl_queue = None
            return CellOutcome(
                status="completed",
                log_head=s.log_head or "",
                worker_queue="",
                error=f"REPL failure: {describe_failure(err)}",
            )
        s.divergences += len(outcome.divergences)
        return outcome

    async def _read_variable(self, request: EpisodeRequest, name: str) -> str | None:
        if not is_variable_name(name):
            return None
        try:
            value = await self._repl(
                request,
                names.REPL_READ_VARIABLE,
                ReadVariableInput(sandbox=self._sandbox(request), name=name),
                VariableValue,
            )
        except ActivityError:
            self._state.repl_queue = None
            return None
        return value.value if value.found else None

    async def _repl(self, request: EpisodeRequest, activity: str, arg: Any, result: type[R]) -> R:
        """A REPL step, routed to the worker that holds this episode's sandbox.

        If that worker is gone (the step is not picked up in time), the step goes to the
        shared queue, where any worker rebuilds the sandbox from the cell log.
        """
        s = self._state
        while True:
            sticky = s.repl_queue
            try:
                outcome = await workflow.execute_activity(
                    activity,
                    arg,
                    result_type=result,
                    task_queue=sticky or workflow.info().task_queue,
                    schedule_to_start_timeout=(
                        timedelta(seconds=request.durability.sticky_schedule_to_start_s) if sticky else None
                    ),
                    start_to_close_timeout=timedelta(seconds=request.limits.cell_timeout_s + 120),
                    heartbeat_timeout=timedelta(seconds=request.durability.heartbeat_timeout_s),
                    retry_policy=RetryPolicy(
                        maximum_attempts=2 if sticky else 3,
                        non_retryable_error_types=[names.SANDBOX_FAILURE],
                    ),
                )
            except ActivityError as err:
                if sticky and is_timeout(err):
                    s.repl_queue = None
                    continue
                raise
            s.log_head = outcome.log_head or s.log_head  # type: ignore[attr-defined]
            s.repl_queue = outcome.worker_queue  # type: ignore[attr-defined]
            return outcome

    async def _answer_calls(
        self, request: EpisodeRequest, cell_index: int, requests: list[SubCallRequest]
    ) -> list[CallAnswer]:
        """Run a suspended cell's model calls as activities, a batch in parallel waves."""
        s = self._state
        limits = request.limits
        model = request.effective_sub_model
        answers: list[CallAnswer] = []
        width = limits.max_parallel_subcalls
        for start in range(0, len(requests), width):
            wave = requests[start : start + width]
            calls: list[asyncio.Future[SubQueryReply] | None] = []
            for call in wave:
                if s.sub_calls >= limits.max_llm_calls:
                    calls.append(None)
                    continue
                s.sub_calls += 1
                s.model_calls += 1
                calls.append(
                    asyncio.ensure_future(
                        workflow.execute_activity(
                            names.SUB_QUERY,
                            SubQueryInput(
                                episode_id=workflow.info().workflow_id,
                                iteration=s.iteration,
                                cell_index=cell_index,
                                call_index=call.call_index,
                                model=model,
                                prompt=call.prompt,
                            ),
                            result_type=SubQueryReply,
                            start_to_close_timeout=timedelta(seconds=model.request_timeout_s + 30),
                            heartbeat_timeout=timedelta(seconds=request.durability.heartbeat_timeout_s),
                            retry_policy=model_retry_policy(model.max_attempts),
                        )
                    )
                )
            for call, future in zip(wave, calls, strict=True):
                answers.append(await self._answer(call, future, limits.max_llm_calls))
        return answers

    async def _answer(
        self, call: SubCallRequest, future: asyncio.Future[SubQueryReply] | None, budget: int
    ) -> CallAnswer:
        s = self._state
        if future is None:
            return CallAnswer(
                call_index=call.call_index,
                prompt_digest=call.prompt_digest,
                ok=False,
                text=f"max_llm_calls ({budget}) reached: the call was not made",
            )
        try:
            reply = await future
        except ActivityError as err:
            return CallAnswer(
                call_index=call.call_index,
                prompt_digest=call.prompt_digest,
                ok=False,
                text=describe_failure(err),
            )
        s.usage = s.usage.add(reply.usage)
        s.model_time_s += reply.model_time_s
        return CallAnswer(
            call_index=call.call_index, prompt_digest=call.prompt_digest, ok=True, text=reply.text
        )

    def _sandbox(self, request: EpisodeRequest) -> SandboxRef:
        s = self._state
        return SandboxRef(
            episode_id=workflow.info().workflow_id,
            context=request.context,
            seed=s.seed,
            log_head=s.log_head,
            cell_timeout_s=request.limits.cell_timeout_s,
            output_truncation=request.limits.output_truncation,
        )

    # --- ending -------------------------------------------------------------------------

    @property
    def _state(self) -> EpisodeCarry:
        assert self._s is not None
        return self._s

    def _result(
        self,
        ended_by: EndReason,
        answer: str | None,
        error: str | None = None,
        decision: TerminationDecision | None = None,
        execution: ExecutionResult | None = None,
    ) -> EpisodeResult:
        s = self._state
        return EpisodeResult(
            answer=answer,
            ended_by=ended_by,
            iterations=s.iteration,
            model_calls=s.model_calls,
            sub_calls=s.sub_calls,
            usage=s.usage,
            model_time_s=round(s.model_time_s, 6),
            error=error,
            replay_divergences=s.divergences,
            termination=decision,
            cumulative_reward=s.cumulative_reward,
            execution=execution,
        )

    def _elapsed(self, request: EpisodeRequest) -> timedelta:
        started = self._state.deadline - request.limits.max_duration
        return workflow.now() - started

    async def _fallback(self, request: EpisodeRequest, reason: FallbackReason) -> EpisodeResult:
        """A limit came before a submit: extract the outputs from the history (seed 004)."""
        s = self._state
        ended_by: EndReason = {
            "max_iterations": "max_iterations",
            "max_llm_calls": "max_llm_calls",
            "timeout": "max_duration",
        }[reason.kind]
        # Episodes that ended on a limit before extraction existed completed without it.
        if not workflow.patched("fallback-extraction"):
            return self._result(ended_by, None)
        fields = request.output_fields or ANSWER_FIELDS
        if not request.fallback_extraction:
            failed = Failed(reason=f"{reason}; fallback extraction is disabled")
            return self._result(ended_by, None, execution=ExecutionResult(variant=failed))
        self._phase = f"extracting ({reason})"
        model = request.root_model
        try:
            reply = await workflow.execute_activity(
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
                start_to_close_timeout=timedelta(seconds=model.request_timeout_s + 30),
                heartbeat_timeout=timedelta(seconds=request.durability.heartbeat_timeout_s),
                retry_policy=model_retry_policy(model.max_attempts),
            )
        except ActivityError as err:
            failed = Failed(reason=f"Extraction LLM call failed: {describe_failure(err)}")
            return self._result(ended_by, None, execution=ExecutionResult(variant=failed))
        s.model_calls += 1
        s.usage = s.usage.add(reply.usage)
        s.model_time_s += reply.model_time_s
        if reply.error is not None:
            failed = Failed(reason=f"Extraction LLM call failed: {reply.error}", history=reply.history)
            return self._result(ended_by, None, execution=ExecutionResult(variant=failed))
        parsed = parse_extraction_response(reply.text, fields)
        if parsed.outputs is None:
            failed = Failed(
                reason=parsed.error or "extraction failed",
                partial_outputs=parsed.partial,
                history=reply.history,
            )
            return self._result(ended_by, None, execution=ExecutionResult(variant=failed))
        extracted = Extracted(
            outputs=parsed.outputs,
            confidence=calculate_extraction_confidence(parsed.outputs, reply.history, s.variables),
            reason=reason,
            extraction_notes=parsed.notes,
        )
        answer = answer_text(parsed.outputs, fields)
        return self._result(ended_by, answer, execution=ExecutionResult(variant=extracted))

    async def _close_sandbox(self) -> None:
        queue = self._state.repl_queue
        if queue is None:
            return
        try:
            await workflow.execute_activity(
                names.REPL_CLOSE,
                CloseSandboxInput(episode_id=workflow.info().workflow_id),
                result_type=bool,
                task_queue=queue,
                schedule_to_start_timeout=timedelta(seconds=10),
                start_to_close_timeout=timedelta(seconds=30),
                retry_policy=RetryPolicy(maximum_attempts=1),
            )
        except ActivityError:
            pass  # the worker is gone, and its sandbox with it; idle reaping covers the rest

    async def _audit(self, request: EpisodeRequest, result: EpisodeResult | None) -> None:
        info = workflow.info()
        try:
            await workflow.execute_activity(
                names.AUDIT_EPISODE,
                AuditEpisodeInput(
                    episode_id=info.workflow_id,
                    run_id=info.run_id,
                    task=request.task,
                    root_model=request.root_model.model,
                    status="running" if result is None else "completed",
                    result=result,
                ),
                start_to_close_timeout=timedelta(seconds=30),
                retry_policy=_AUDIT_RETRY,
            )
        except ActivityError:
            workflow.logger.warning("audit store write failed; history remains the record")


def answer_outputs(answer: str, fields: list[FieldSpec]) -> dict[str, Any] | None:
    """FINAL(...) fills the default single `answer` field, and nothing else."""
    if [f.name for f in fields] == ["answer"]:
        return {"answer": answer}
    return None


def answer_text(outputs: dict[str, Any], fields: list[FieldSpec]) -> str | None:
    """The answer as text: the `answer` field when that is the schema, else the JSON."""
    if [f.name for f in fields] == ["answer"]:
        value = outputs.get("answer")
        return None if value is None else value if isinstance(value, str) else json.dumps(value)
    return json.dumps(outputs, sort_keys=True)


def episode_policy(request: EpisodeRequest) -> TerminationPolicy:
    """The request's termination policy, built and checked; raises PolicyError."""
    validate_reward_function(request.reward.function, request.reward.config)
    return PolicyRegistry.get_termination(request.termination.name, request.termination.config)


def model_retry_policy(max_attempts: int) -> RetryPolicy:
    return RetryPolicy(
        initial_interval=timedelta(seconds=1),
        backoff_coefficient=2.0,
        maximum_interval=timedelta(seconds=60),
        maximum_attempts=max_attempts,
        non_retryable_error_types=[names.MODEL_REQUEST_REJECTED],
    )


def is_timeout(err: ActivityError) -> bool:
    cause = err.cause
    return isinstance(cause, TimeoutError) and cause.type in (
        TimeoutType.SCHEDULE_TO_START,
        TimeoutType.HEARTBEAT,
        TimeoutType.START_TO_CLOSE,
    )


def describe_failure(err: BaseException) -> str:
    """The most specific message in a failure chain: what the user needs to read."""
    messages: list[str] = []
    current: BaseException | None = err
    while current is not None:
        if isinstance(current, (ApplicationError, TimeoutError)) and str(current):
            messages.append(str(current))
        current = current.__cause__ or getattr(current, "cause", None)
    return messages[0] if messages else str(err)
