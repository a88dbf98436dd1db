"""The episode's last steps: one fallback extraction when a limit came before an answer
(seed 004), the result, and the close (the sandbox, the audit row, the status attribute).

An episode that ends without a result (cancelled by Temporal, failed) still closes its
sandbox and its audit row (`close`). Episodes that ended on a limit before extraction
existed completed without it, and replay so (the `fallback-extraction` patch).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from durable_rlm.workflows import names
    from durable_rlm.workflows.budget import extraction_refusal, extraction_reply_cap
    from durable_rlm.workflows.display import EpisodeDisplay
    from durable_rlm.workflows.ending import (
        LIMIT_ENDED_BY,
        Ending,
        extraction_ending,
        extraction_failed_ending,
        unextracted_ending,
    )
    from durable_rlm.workflows.fallback import FallbackReason, parse_extraction_response
    from durable_rlm.workflows.models import (
        EpisodeCarry,
        EpisodeRequest,
        EpisodeResult,
        EpisodeStatus,
        ExtractionInput,
        ExtractionReply,
        ReplState,
        ending_words,
    )
    from durable_rlm.workflows.outages import OutageWaits
    from durable_rlm.workflows.repl_steps import ReplSteps
    from durable_rlm.workflows.retries import describe_failure, model_step_options, raise_if_cancelled
    from durable_rlm.workflows.stopping import Stopping
    from durable_rlm.workflows.typed_outputs import ANSWER_FIELDS


class Closing:
    """How the episode ends, once the loop has: extraction, the result, the close."""

    def __init__(
        self,
        request: EpisodeRequest,
        state: EpisodeCarry,
        repl: ReplSteps,
        waits: OutageWaits,
        display: EpisodeDisplay,
        stop: Stopping,
        audit: Callable[..., Awaitable[None]],
        honest: bool = True,
        reserve: bool = False,
        fits: bool = False,
    ) -> None:
        self.request = request
        self.state = state
        self.repl = repl
        self.waits = waits
        self.display = display
        self.stop = stop
        self.audit = audit  # (status, result, error=): the workflow's `_audit`, its request bound
        self.honest = honest  # False only when replaying histories from before honest endings
        self.reserve = reserve  # token and cost budgets keep room for an extraction (patched)
        self.fits = fits  # extraction fits what is left of the token budget (patched)

    async def extract(self, reason: FallbackReason) -> Ending:
        """A limit came before an answer: extract the outputs from the history (seed 004)."""
        request, s = self.request, self.state
        # Episodes that ended on a limit before extraction existed completed without it.
        if not workflow.patched(names.PATCH_FALLBACK_EXTRACTION):
            return Ending(LIMIT_ENDED_BY[reason.kind], None, "none", str(reason), None)
        if not request.fallback_extraction:
            return unextracted_ending(reason, "fallback extraction is disabled")
        refusal = extraction_refusal(request, s, reserve=self.reserve, fits=self.fits)
        if refusal is not None:
            return unextracted_ending(reason, refusal)
        fields = request.output_fields or ANSWER_FIELDS
        model = request.root_model
        cap = extraction_reply_cap(request, s) if self.fits else None
        if cap is not None:  # the reply stays within what the token budget has left
            model = model.model_copy(update={"max_tokens": cap})
        self.display.set_phase(f"extracting ({reason})")
        try:
            reply = await self.waits.through_store_outages(
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
            if self.honest:
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
        """A session's turn hands its REPL and conversation to the next (none for others)."""
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
        self.stop.finished = True
        ending = ending_words(result.status)  # the vocabulary of endings, what ended it beside
        self.display.set_phase(
            f"ended: {ending}" + ("" if result.ended_by == result.status else f" ({result.ended_by})")
        )
        self.display.show(result.status, result.ended_by, result.answer_source)
        await self.repl.close()
        await self.audit(result.status, result)
        return result

    async def close(self, status: EpisodeStatus, error: str) -> None:
        """An episode that ends without a result still closes its sandbox and its audit row."""
        self.stop.finished = True
        self.display.set_phase(f"ended: {ending_words(status)}")
        self.display.show(status)
        await self.repl.close()
        await self.audit(status, error=error)
