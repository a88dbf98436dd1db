"""Ask: the root model's next reply, compacting the conversation when it nears the window.

A request that would pass `compact_at` of the model's window first replaces older turns by
a model-written summary (a step of its own in history, workflows/compaction.py); a model
that still says the request exceeds its window gets one more compaction and one retry. A
refused key or a store outage waits (workflows/outages.py) and runs the same call again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from durable_rlm.workflows import defaults, names, prompts
    from durable_rlm.workflows.budget import root_call_limit
    from durable_rlm.workflows.compaction import needs_compaction, summary_input_chars
    from durable_rlm.workflows.ending import Ending, LimitReached, model_error_ending
    from durable_rlm.workflows.episode_context import EpisodeContext
    from durable_rlm.workflows.fallback import FallbackReason
    from durable_rlm.workflows.models import (
        CompactionInput,
        CompactionReply,
        DspyTurn,
        RootCompletion,
        RootCompletionInput,
    )
    from durable_rlm.workflows.retries import (
        describe_failure,
        failure_cause,
        is_context_overflow,
        model_step,
        raise_if_cancelled,
    )

if TYPE_CHECKING:
    from durable_rlm.workflows.repl_steps import ReplSteps


class RootCalls:
    """The root model's steps: a completion, and the compaction that makes room for it."""

    def __init__(self, ctx: EpisodeContext, repl: ReplSteps | None = None) -> None:
        self.request = ctx.request
        self.state = ctx.state
        self.waits = ctx.waits
        self.display = ctx.display
        self.repl = repl  # runs the cell that gives rlms's `history` what a compaction removed

    async def ask(self) -> RootCompletion | Ending | LimitReached:
        """The root model's next reply. A context overflow compacts and retries once."""
        request, s = self.request, self.state
        compacts = request.dspy is None  # a DSPy program's turns are DSPy's, whole
        if compacts and needs_compaction(s, s.pending, request.limits, request.root_model, request.rlms):
            over = root_call_limit(request, s, calls=2)
            if over is not None:
                return LimitReached(over)
            share = f"{request.limits.compact_at:.0%}"
            failed = await self.compact(f"the next request would pass {share} of the window")
            if failed is not None:
                return failed
        try:
            return await self.completion()
        except ActivityError as err:
            raise_if_cancelled(err)
            if not is_context_overflow(err):
                return model_error_ending(describe_failure(err), failure_cause(err))
            if request.dspy is not None:
                # DSPy's RLM resends its whole history and has no compaction: nothing to cut.
                return LimitReached(FallbackReason(kind="context_overflow", value=s.compactions, limit=0))
        over = root_call_limit(request, s, calls=2)
        if over is not None:
            return LimitReached(over)
        failed = await self.compact("the model said the request exceeds its context window", keep=0)
        if failed is not None:
            return failed
        try:
            return await self.completion(after_compaction=True)
        except ActivityError as err:
            raise_if_cancelled(err)
            if is_context_overflow(err):
                return LimitReached(FallbackReason(kind="context_overflow", value=s.compactions, limit=0))
            return model_error_ending(describe_failure(err), failure_cause(err))

    async def completion(self, after_compaction: bool = False) -> RootCompletion:
        """One root call: the conversation so far and the pending turn; the reply is charged."""
        request, s = self.request, self.state
        again = " (after compaction)" if after_compaction else ""
        model = request.root_model
        self.display.set_phase("waiting for the root model")
        reply: RootCompletion = await self.waits.with_credentials(
            lambda: model_step(
                names.ROOT_COMPLETION,
                RootCompletionInput(
                    episode_id=workflow.info().workflow_id,
                    iteration=s.iteration,
                    model=model,
                    conversation=s.conversation,
                    append=s.pending,
                    resent_message_chars=request.limits.resent_message_chars,
                    max_reply_chars=request.limits.max_reply_chars,
                    dspy=self._dspy_turn(),
                ),
                result_type=RootCompletion,
                summary=f"root call {s.iteration}{again}",
                model=model,
                durability=request.durability,
            )
        )
        s.conversation, s.pending = reply.conversation, []
        s.charge(reply.usage, reply.model_time_s)
        s.last_prompt_tokens = reply.usage.prompt_tokens or reply.sent_chars // defaults.CHARS_PER_TOKEN
        s.last_reply_tokens = reply.usage.completion_tokens or len(reply.text) // defaults.CHARS_PER_TOKEN
        self.display.last_response = reply.text[-defaults.PROGRESS_TEXT_CHARS :]
        return reply

    def _dspy_turn(self) -> DspyTurn | None:
        """A DSPy program's turn: the request's template, this iteration as DSPy counts it."""
        request = self.request
        if request.dspy is None:
            return None
        return DspyTurn(
            prefix=len(request.dspy.action),
            user=request.dspy.action_user,
            iteration=f"{self.state.iteration}/{request.limits.max_iterations}",
            max_output_chars=request.dspy.max_output_chars,
        )

    async def compact(self, why: str, keep: int = defaults.COMPACTION_KEEP_MESSAGES) -> Ending | None:
        """Replace older turns by a model-written summary: a step of its own in history."""
        request, s = self.request, self.state
        model = request.root_model
        self.display.set_phase(f"compacting the conversation ({why})")
        try:
            reply = await self.waits.with_credentials(
                lambda: model_step(
                    names.COMPACT_CONVERSATION,
                    CompactionInput(
                        episode_id=workflow.info().workflow_id,
                        iteration=s.iteration,
                        model=model,
                        conversation=s.conversation,
                        keep_messages=keep,
                        input_chars=summary_input_chars(request.limits, model, request.rlms),
                        reason=why,
                        max_reply_chars=request.limits.max_reply_chars,
                        history=request.rlms,
                    ),
                    result_type=CompactionReply,
                    summary=f"compaction: {why}",
                    model=model,
                    durability=request.durability,
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
        if reply.history is not None and self.repl is not None:
            # rlms's `history`: the turns just summarised and the summary, for the model's code.
            s.cell_count += 1
            await self.repl.run_cell(s.iteration, s.cell_count, prompts.history_cell(reply.history))
        return None
