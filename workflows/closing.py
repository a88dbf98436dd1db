"""The episode's last steps: one fallback extraction when a limit came before an answer
(docs: "Fallback extraction"), the result, and the close (the sandbox, the audit row, the
status attribute).

An episode that ends without a result (cancelled by Temporal, failed) still closes its
sandbox and its audit row (`close`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from durable_rlm.workflows import dspy_program, names
    from durable_rlm.workflows.budget import extraction_refusal, extraction_reply_cap
    from durable_rlm.workflows.ending import (
        Ending,
        extraction_ending,
        extraction_failed_ending,
        unextracted_ending,
    )
    from durable_rlm.workflows.episode_context import EpisodeContext
    from durable_rlm.workflows.fallback import FallbackReason, parse_extraction_response
    from durable_rlm.workflows.models import (
        DspyExtraction,
        EpisodeResult,
        EpisodeStatus,
        ExtractionInput,
        ExtractionReply,
        ReplState,
        ending_words,
    )
    from durable_rlm.workflows.repl_steps import ReplSteps
    from durable_rlm.workflows.retries import describe_failure, model_step, raise_if_cancelled
    from durable_rlm.workflows.typed_outputs import ANSWER_FIELDS


class Closing:
    """How the episode ends, once the loop has: extraction, the result, the close."""

    def __init__(self, ctx: EpisodeContext, repl: ReplSteps, audit: Callable[..., Awaitable[None]]) -> None:
        self.ctx = ctx
        self.request = ctx.request
        self.state = ctx.state
        self.repl = repl
        self.audit = audit  # (status, result, error=): the workflow's `_audit`, its request bound

    async def extract(self, reason: FallbackReason) -> Ending:
        """A limit came before an answer: extract the outputs from the history."""
        request, s = self.request, self.state
        if not self.ctx.rules.extraction:
            return unextracted_ending(reason, "fallback extraction is disabled")
        refusal = extraction_refusal(request, s)
        if refusal is not None:
            return unextracted_ending(reason, refusal)
        fields = request.output_fields or ANSWER_FIELDS
        model = request.root_model
        cap = extraction_reply_cap(request, s)
        if cap is not None:  # the reply stays within what the token budget has left
            model = model.model_copy(update={"max_tokens": cap})
        self.ctx.display.set_phase(f"extracting ({reason})")
        try:
            reply = await self.ctx.waits.through_store_outages(
                lambda: model_step(
                    names.EXTRACT_FALLBACK,
                    ExtractionInput(
                        episode_id=workflow.info().workflow_id,
                        model=model,
                        conversation=s.conversation,
                        log_head=s.log_head,
                        variables=s.variables,
                        output_fields=fields,
                        reason=reason,
                        max_reply_chars=request.limits.max_reply_chars,
                        dspy=self._dspy_extraction(),
                        append=s.pending if request.dspy is not None else [],
                    ),
                    result_type=ExtractionReply,
                    summary=f"extraction after {reason.kind}",
                    model=model,
                    durability=request.durability,
                )
            )
        except ActivityError as err:
            raise_if_cancelled(err)
            return extraction_failed_ending(
                reason, f"Extraction LLM call failed: {describe_failure(err)}", []
            )
        s.charge(reply.usage, reply.model_time_s)
        if reply.conversation is not None:
            s.conversation = reply.conversation  # now with the last step: the program's trajectory
        if reply.error is not None:
            return extraction_failed_ending(
                reason, f"Extraction LLM call failed: {reply.error}", reply.history
            )
        if request.dspy is not None:
            parsed = dspy_program.extracted(reply.text, fields)
        else:
            parsed = parse_extraction_response(reply.text, fields)
        return extraction_ending(reason, parsed, reply.history, s.variables, fields)

    def _dspy_extraction(self) -> DspyExtraction | None:
        dspy = self.request.dspy
        if dspy is None:
            return None
        return DspyExtraction(
            prefix=len(dspy.action),
            messages=dspy.extract,
            user=dspy.extract_user,
            max_output_chars=dspy.max_output_chars,
        )

    def result(self, ending: Ending) -> EpisodeResult:
        s = self.state
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
            depth=self.request.depth,
            tree_episodes=s.tree_episodes,
            children=s.children,
            unaccounted_tokens=s.unaccounted_tokens,
            unaccounted_cost_usd=s.unaccounted_cost_usd,
            **self._session_fields(),
        )

    def _session_fields(self) -> dict[str, Any]:
        """A session's turn hands its REPL and conversation to the next; a DSPy program
        reads its trajectory from the conversation (none for others)."""
        if self.request.dspy is not None:
            return {"conversation": self.state.conversation}
        if self.request.session is None:
            return {}
        s = self.state
        repl = ReplState(
            log_head=s.log_head, cell_count=s.cell_count, snapshot=s.snapshot, variables=s.variables
        )
        return {"repl": repl, "conversation": s.conversation}

    async def finish(self, ending: Ending) -> EpisodeResult:
        """The episode's result, once its sandbox and its audit row are closed."""
        result = self.result(ending)
        display = self.ctx.display
        self.ctx.stop.finished = True
        words = ending_words(result.status)  # the vocabulary of endings, what ended it beside
        display.set_phase(
            f"ended: {words}" + ("" if result.ended_by == result.status else f" ({result.ended_by})")
        )
        display.show(result.status, result.ended_by, result.answer_source)
        await self.repl.close()
        await self.audit(result.status, result)
        return result

    async def close(self, status: EpisodeStatus, error: str) -> None:
        """An episode that ends without a result still closes its sandbox and its audit row."""
        display = self.ctx.display
        self.ctx.stop.finished = True
        display.set_phase(f"ended: {ending_words(status)}")
        display.show(status)
        await self.repl.close()
        await self.audit(status, error=error)
