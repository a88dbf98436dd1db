"""The fallback extraction call (docs/behaviour/fallback-extraction.md): history from the
chains, prompt from the pure
template, one model call through the same client as the loop."""

from __future__ import annotations

import asyncio

from temporalio import activity
from temporalio.exceptions import ApplicationError

from durable_rlm.activities.attempts import start_attempt_clock
from durable_rlm.activities.llm import ModelActivities
from durable_rlm.activities.model_errors import compact_failures
from durable_rlm.store import chains
from durable_rlm.store.blobs import BlobStore
from durable_rlm.workflows import defaults, dspy_program, names, prompts
from durable_rlm.workflows.fallback import ExtractFallbackInputs, REPLHistoryEntry, extraction_prompt
from durable_rlm.workflows.models import (
    DspyExtraction,
    ExtractionInput,
    ExtractionReply,
    Message,
    TokenUsage,
)
from durable_rlm.workflows.parsing import strip_code_blocks, truncate_output


class ExtractionActivities:
    def __init__(self, models: ModelActivities, blobs: BlobStore) -> None:
        self.models = models
        self.blobs = blobs

    @activity.defn(name=names.EXTRACT_FALLBACK)
    async def extract_fallback(self, request: ExtractionInput) -> ExtractionReply:
        start_attempt_clock()
        with compact_failures():  # a failure the server can keep whole (activities/model_errors.py)
            return await self._extract_fallback(request)

    async def _extract_fallback(self, request: ExtractionInput) -> ExtractionReply:
        if request.dspy is not None:
            return await self._extract_as_dspy(request, request.dspy)
        messages = await asyncio.to_thread(chains.read_conversation, self.blobs, request.conversation)
        history = await asyncio.to_thread(self.history, messages, request.log_head)
        history = history[-request.max_history :]
        prompt = extraction_prompt(
            ExtractFallbackInputs(
                history=history,
                variables=request.variables,
                output_fields=request.output_fields,
                fallback_reason=str(request.reason),
                task=task_of(messages),
            )
        )
        return await self._call(request, [Message(role="user", content=prompt)], history)

    async def _call(
        self,
        request: ExtractionInput,
        sent: list[Message],
        history: list[REPLHistoryEntry],
        conversation: str | None = None,
    ) -> ExtractionReply:
        prompt_chars = sum(len(m.content) for m in sent)
        try:
            done = await self.models.complete(request.model, sent, request.max_reply_chars)
        except ApplicationError as exc:
            # Retry while attempts remain; on the last one, hand back the history with the
            # error so the episode's Failed result keeps it (a failed extraction keeps what
            # it could: docs/behaviour/fallback-extraction.md, "The result variants").
            if not exc.non_retryable and activity.info().attempt < request.model.max_attempts:
                raise
            return ExtractionReply(
                text="",
                usage=TokenUsage(),
                model_time_s=0.0,
                history=history,
                prompt_chars=prompt_chars,
                error=str(exc),
                conversation=conversation,
            )
        return ExtractionReply(
            text=done.text,
            usage=done.usage,
            model_time_s=done.elapsed,
            history=history,
            prompt_chars=prompt_chars,
            conversation=conversation,
            **done.facts.model_dump(),
        )

    async def _extract_as_dspy(self, request: ExtractionInput, form: DspyExtraction) -> ExtractionReply:
        """A DSPy program's extraction: its last step joins the conversation (the program
        reads its trajectory there), and the history goes in DSPy's `extract` prompt."""
        head = request.conversation
        for message in request.append:
            head = await asyncio.to_thread(chains.append_message, self.blobs, head, message)
        messages = await asyncio.to_thread(chains.read_conversation, self.blobs, head)
        steps = dspy_program.steps_of(messages[form.prefix + 1 :])
        sent = dspy_program.extraction_messages(
            messages, form.prefix, form.messages, form.user, form.max_output_chars
        )
        history = [
            REPLHistoryEntry(
                iteration=number,
                reasoning=step.reasoning or None,
                code=step.code,
                output=truncate_output(step.output, defaults.EXTRACTION_OUTPUT_CHARS),
                success=not step.output.startswith(("[Error]", "[Type Error]")),
            )
            for number, step in enumerate(steps, start=1)
        ][-request.max_history :]
        return await self._call(request, sent, history, head)

    def history(self, messages: list[Message], log_head: str | None) -> list[REPLHistoryEntry]:
        """One entry per finished cell: its iteration's reasoning, code, output, success."""
        responses = [m.content for m in messages if m.role == "assistant"]
        entries: list[REPLHistoryEntry] = []
        for cell in chains.read_cell_log(self.blobs, log_head).cells:
            if cell.status is None:
                continue  # never finished: nothing to extract from
            reasoning = responses[cell.iteration - 1] if 0 < cell.iteration <= len(responses) else None
            output = self.blobs.get_text(cell.output) if cell.output else ""
            entries.append(
                REPLHistoryEntry(
                    iteration=cell.iteration,
                    reasoning=strip_code_blocks(reasoning).strip() if reasoning else None,
                    code=cell.code,
                    output=truncate_output(output, defaults.EXTRACTION_OUTPUT_CHARS),
                    success=cell.status == "ok",
                )
            )
        return entries


def task_of(messages: list[Message]) -> str | None:
    """The episode's task, from the conversation's first user turn (compaction keeps it)."""
    first = next((m for m in messages if m.role == "user"), None)
    return prompts.task_of_opening(first.content) if first is not None else None
