"""`drlm rerun`: re-execute recorded episodes with the current code, every model call
answered from the recording, and say which would now end differently.

The recording is read from each source's history (and its children's): every root reply
with the digest of the messages it answered, every sub-call's reply by prompt, every
extraction and compaction. A recording server on 127.0.0.1 speaks the OpenAI API and
answers the re-run's calls from it: a root call by its messages' digest, else by its
position in its conversation (the prompt changed: the new code sends other messages); a
sub-call by its prompt. A call the recording does not have is a divergence: the re-run
stops there and says at which iteration. Nothing is paid (no provider is called) and
nothing is written to the sources: each re-run is an episode of its own, `rerun-...`,
that `drlm show` explains like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import secrets
import threading
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel
from rich.console import Console
from rich.table import Table
from temporalio.client import WorkflowFailureError
from temporalio.service import RPCError

from durable_rlm.audit.history import completed_steps
from durable_rlm.audit.timeline import episode_timeline
from durable_rlm.client.episodes import start_episode
from durable_rlm.errors import DurableRLMError
from durable_rlm.scripted import ChatRequest, Reply, ScriptedModelServer
from durable_rlm.timetravel.fork import ForkError, fork_point
from durable_rlm.viewer.export import resolve_prompts
from durable_rlm.worker.runtime import running_workers
from durable_rlm.workflows import names
from durable_rlm.workflows.episode import episode_policy
from durable_rlm.workflows.models import (
    EpisodeRequest,
    EpisodeResult,
    ExtractionReply,
    ModelSettings,
    TerminationSpec,
)
from durable_rlm.workflows.termination import PolicyError

if TYPE_CHECKING:
    from temporalio.client import Client

    from durable_rlm.audit.timeline import Timeline
    from durable_rlm.store.blobs import BlobStore
    from durable_rlm.worker.runtime import Services

DIVERGED_GRACE_S = 30.0  # a diverged re-run ends by itself within a step; then it is terminated
KEY_ENV = "DRLM_RERUN_KEY"  # the recording server's key: one per re-run, given to its worker only
Verdict = Literal["same", "different", "diverged", "failed"]


class RerunError(DurableRLMError, ValueError):
    """A rerun that cannot start: nothing was started."""


def digest(messages: Sequence[dict[str, Any]]) -> str:
    """The audit's prompt digest (activities/llm.call_facts) of messages as sent."""
    sent = [{"role": m.get("role"), "content": m.get("content")} for m in messages]
    text = json.dumps(sent, sort_keys=True, ensure_ascii=False)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


@dataclass
class Conversation:
    """One episode of the recorded tree: its root replies in order."""

    episode_id: str
    identity: str  # digest of the system prompt and the task: which conversation a call is in
    replies: list[str] = field(default_factory=list)


@dataclass
class Recording:
    source_id: str
    request: EpisodeRequest
    result: EpisodeResult
    seed: int | None = None
    conversations: list[Conversation] = field(default_factory=list)
    by_digest: dict[str, str] = field(default_factory=dict)
    sub_replies: dict[str, deque[str]] = field(default_factory=lambda: defaultdict(deque))
    extractions: list[tuple[str | None, str]] = field(default_factory=list)  # (prompt digest, reply)
    summaries: deque[str] = field(default_factory=deque)

    @property
    def calls(self) -> int:
        subs = sum(len(q) for q in self.sub_replies.values())
        return sum(len(c.replies) for c in self.conversations) + subs + len(self.extractions)


async def record_of(client: Client, blobs: BlobStore, source_id: str) -> Recording:
    """What a recorded episode's models answered, read from its history and its children's."""
    try:
        timeline = await episode_timeline(client, source_id)
    except LookupError as exc:
        raise RerunError(f"cannot rerun {source_id!r}: no episode with that id") from exc
    if timeline.result is None or timeline.request is None:
        state = (
            "is still running"
            if timeline.status == "running"
            else f"ended {timeline.status} without a result"
        )
        raise RerunError(f"cannot rerun {source_id!r}: it {state}; rerun takes episodes that ended")
    if timeline.request.fork is not None:
        raise RerunError(f"cannot rerun {source_id!r}: it is a fork; rerun its source instead")
    await asyncio.to_thread(resolve_prompts, timeline, blobs)
    recording = Recording(source_id, timeline.request, timeline.result, await _seed(client, timeline))
    await _record_tree(client, timeline, recording)
    return recording


async def _seed(client: Client, timeline: Timeline) -> int | None:
    """The seed the source ran with: its request's, else the one its first run drew (read
    by replaying that run, as `drlm fork` does)."""
    assert timeline.request is not None
    if timeline.request.seed is not None or not timeline.iterations:
        return timeline.request.seed
    try:
        return (await fork_point(client, timeline.episode_id, 1)).state.seed
    except ForkError:
        return None


async def _record_tree(client: Client, timeline: Timeline, recording: Recording) -> None:
    conversation: Conversation | None = None
    for it in timeline.iterations:
        prompt = [m.model_dump() for m in it.prompt or []]
        if conversation is None:
            conversation = Conversation(timeline.episode_id, digest(prompt[:2]))
            recording.conversations.append(conversation)
        if it.response is None:
            continue
        conversation.replies.append(it.response)
        recording.by_digest.setdefault(digest(prompt), it.response)
        recording.summaries.extend(it.compactions)
        for cell in it.cells:
            for call in cell.sub_calls:
                if call.error is None and call.reply is not None:
                    recording.sub_replies[call.prompt].append(call.reply)
            for child in cell.children:
                if child.timeline is not None:
                    await _record_tree(client, child.timeline, recording)
    async for step in completed_steps(client, timeline.episode_id):
        if step.activity == names.EXTRACT_FALLBACK and isinstance(step.result, ExtractionReply):
            if step.result.error is None:
                recording.extractions.append((step.result.prompt_digest, step.result.text))


@dataclass
class Answerer:
    """The recording server's script: answers from the recording, notes what it could not."""

    recording: Recording
    diverged: str | None = None
    iteration: int = 0
    prompt_changed_at: int | None = None
    answered: int = 0
    timed_out: str | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)  # the server answers from threads

    def __call__(self, request: ChatRequest) -> Reply | str:
        with self.lock:
            return self._reply(request)

    def _reply(self, request: ChatRequest) -> Reply | str:
        if self.diverged is not None:
            return self._refuse("the re-run already diverged")
        if request.is_extraction:
            return self._answer(self._extraction(digest(request.messages)), "a fallback extraction")
        if request.is_compaction:
            summary = self.recording.summaries.popleft() if self.recording.summaries else None
            return self._answer(summary, "a conversation compaction")
        if request.is_root:
            return self._root(request)
        replies = self.recording.sub_replies.get(request.last_user)
        return self._answer(replies.popleft() if replies else None, "a sub-call with this prompt")

    def _root(self, request: ChatRequest) -> Reply | str:
        position = request.turn  # replies the conversation already holds
        conversation = self._conversation(digest(request.messages[:2]))
        if conversation is self.recording.conversations[0]:
            self.iteration = position + 1
        text = self.recording.by_digest.get(digest(request.messages))
        if text is None and position < len(conversation.replies):
            text = conversation.replies[position]  # the new code sent other messages
            if conversation is self.recording.conversations[0] and self.prompt_changed_at is None:
                self.prompt_changed_at = position + 1
        what = f"root call {position + 1} of {conversation.episode_id}"
        return self._answer(text, what)

    def _extraction(self, sent: str) -> str | None:
        """The recorded extraction of these messages, else the next one recorded: each once."""
        recorded = self.recording.extractions
        index = next((i for i, (d, _) in enumerate(recorded) if d == sent), 0 if recorded else None)
        return recorded.pop(index)[1] if index is not None else None

    def _conversation(self, identity: str) -> Conversation:
        for conversation in self.recording.conversations:
            if conversation.identity == identity:
                return conversation
        return self.recording.conversations[0]  # a changed system prompt: the source's own

    def _answer(self, text: str | None, what: str) -> Reply | str:
        if text is None:
            self.diverged = f"the new code asked for {what}, which the recording does not have"
            self.stop.set()
            return self._refuse(self.diverged)
        self.answered += 1
        return text

    @staticmethod
    def _refuse(why: str) -> Reply:
        return Reply(status=400, error=f"drlm rerun: {why}")


class RerunReport(BaseModel):
    source_id: str
    rerun_id: str
    verdict: Verdict
    detail: str
    source_answer: str | None
    answer: str | None = None
    source_ended_by: str
    ended_by: str | None = None
    diverged_at: int | None = None
    prompt_changed_at: int | None = None
    calls_answered: int = 0


@dataclass(frozen=True)
class PolicyChange:
    """What a rerun changes of each source's termination policy (None: the source's)."""

    name: str | None = None
    config: dict[str, Any] | None = None
    scan_printed_output: bool | None = None

    def applied(self, spec: TerminationSpec) -> TerminationSpec:
        return TerminationSpec(
            name=self.name or spec.name,
            config=self.config if self.config is not None else spec.config if self.name is None else {},
            scan_printed_output=spec.scan_printed_output
            if self.scan_printed_output is None
            else self.scan_printed_output,
        )


def rerun_request(recording: Recording, base_url: str, change: PolicyChange | None) -> EpisodeRequest:
    """The source's request against the recording server: the same task, context, limits
    and seed; no person to approve cells (the source's approvals are in the past)."""

    def recorded(model: ModelSettings | None) -> dict[str, Any] | None:
        if model is None:
            return None
        data = model.model_dump(exclude={"extra_body", "logprobs"})
        return {**data, "provider": "openai", "base_url": base_url, "api_key_env": KEY_ENV, "max_attempts": 1}

    source = recording.request
    data = {
        **source.model_dump(),
        "root_model": recorded(source.root_model),
        "sub_model": recorded(source.sub_model),
        "other_models": [recorded(m) for m in source.other_models],
        "approve": "none",
        "carry": None,
        "seed": recording.seed,  # the sandbox's random numbers as the source drew them
        "parent": None,  # a re-run of a child episode is an episode of its own ...
        "deadline": None,  # ... with its own max_duration, not its old parent's deadline
    }
    if change is not None:
        data["termination"] = change.applied(source.termination).model_dump()
    return EpisodeRequest.model_validate(data)


async def _rerun(
    client: Client,
    task_queue: str,
    key: str,
    recording: Recording,
    change: PolicyChange | None,
    timeout_s: float = 600.0,
) -> RerunReport:
    """Re-run one recorded episode (its request checked) against the current code, on
    `task_queue`, where only this process's worker, holding `key`, polls; its report."""
    answerer = Answerer(recording)  # answering consumes the recording: it is used once
    with ScriptedModelServer(answerer, api_key=key) as server:
        request = rerun_request(recording, server.base_url, change)
        rerun_id = f"rerun-{recording.source_id}-{secrets.token_hex(3)}"
        handle = await start_episode(client, request, task_queue, rerun_id)
        result = await _result_or_divergence(handle, answerer, timeout_s)
    return _report(recording, rerun_id, answerer, result)


async def _result_or_divergence(handle: Any, answerer: Answerer, timeout_s: float) -> EpisodeResult | None:
    ending = asyncio.ensure_future(handle.result())
    stopped = asyncio.ensure_future(asyncio.to_thread(answerer.stop.wait, timeout_s))
    try:
        await asyncio.wait([ending, stopped], return_when=asyncio.FIRST_COMPLETED, timeout=timeout_s)
    finally:
        answerer.stop.set()  # ends the waiting thread
    if ending.done():
        try:
            return ending.result()
        except WorkflowFailureError:
            return None
    if answerer.diverged is not None:
        # The refused call fails the step at once: let the episode end on its own (its
        # history then says why), and terminate it only if it does not.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(ending), DIVERGED_GRACE_S)
    if not ending.done():
        ending.cancel()
        if answerer.diverged is None:
            answerer.timed_out = f"terminated: no end within {timeout_s:.0f} s"
        reason = answerer.diverged or answerer.timed_out
        with contextlib.suppress(RPCError):  # it ended meanwhile
            await handle.terminate(f"drlm rerun: {reason}")
    return None


def _report(
    recording: Recording, rerun_id: str, answerer: Answerer, result: EpisodeResult | None
) -> RerunReport:
    source = recording.result
    report = RerunReport(
        source_id=recording.source_id,
        rerun_id=rerun_id,
        verdict="failed",
        detail="",
        source_answer=source.answer,
        source_ended_by=source.ended_by,
        prompt_changed_at=answerer.prompt_changed_at,
        calls_answered=answerer.answered,
    )
    if answerer.diverged is not None:
        report.verdict, report.diverged_at = "diverged", max(answerer.iteration, 1)
        report.detail = f"diverged at iteration {report.diverged_at}: {answerer.diverged}"
    elif result is None:
        why = answerer.timed_out or "ended without a result"
        report.detail = f"the re-run {why} (see `drlm show {rerun_id}`)"
    else:
        report.answer, report.ended_by = result.answer, result.ended_by
        if result.answer == source.answer:
            report.verdict = "same"
            report.detail = f"same answer ({result.ended_by} after {result.iterations} iteration(s))"
            if result.ended_by != source.ended_by:
                report.detail += f"; the source ended by {source.ended_by}"
        else:
            report.verdict = "different"
            report.detail = (
                f"different answer: {_short(result.answer)} ({result.ended_by} after {result.iterations} "
                f"iteration(s)) instead of {_short(source.answer)} ({source.ended_by} after "
                f"{source.iterations})"
            )
    if answerer.prompt_changed_at is not None:
        report.detail += (
            f"; the prompt differs from the recording from iteration {answerer.prompt_changed_at}"
        )
    return report


def _short(text: str | None, width: int = 60) -> str:
    if text is None:
        return "no answer"
    return repr(text if len(text) <= width else text[: width - 3] + "...")


async def rerun_episodes(
    services: Services,
    source_ids: Sequence[str],
    change: PolicyChange | None = None,
    on_report: Callable[[RerunReport], None] | None = None,
) -> list[RerunReport]:
    """Re-run each recorded episode in turn, on a task queue of this call's own served by a
    worker in this process: no other worker sees the re-runs' steps (or the recording
    server's key). Every source and the policy are checked before the first starts: a bad
    one is an error and nothing runs."""
    client, blobs = services.client, services.blobs

    if not source_ids:
        raise RerunError("rerun needs at least one episode id")
    recordings = []
    for source_id in dict.fromkeys(source_ids):
        recording = await record_of(client, blobs, source_id)
        try:
            episode_policy(rerun_request(recording, "http://127.0.0.1:9/v1", change))
        except PolicyError as exc:
            raise RerunError(f"invalid rerun of {source_id!r}: {exc}") from exc
        recordings.append(recording)
    queue, key = f"drlm-rerun-{secrets.token_hex(4)}", secrets.token_urlsafe(24)
    settings = services.settings.model_copy(update={"task_queue": queue, "metrics_address": None})
    reports = []
    async with running_workers(replace(services, settings=settings), {KEY_ENV: key}):
        for recording in recordings:
            report = await _rerun(client, queue, key, recording, change)
            reports.append(report)
            if on_report is not None:
                on_report(report)
    return reports


def report_table(reports: Sequence[RerunReport]) -> None:
    """The reports as a table on standard output (rich), a row per episode."""
    table = Table(title="drlm rerun")
    for column in ("episode", "verdict", "answer then", "answer now", "re-run"):
        table.add_column(column)
    styles = {"same": "green", "different": "yellow", "diverged": "yellow", "failed": "red"}
    for r in reports:
        verdict = r.verdict if r.diverged_at is None else f"diverged at {r.diverged_at}"
        table.add_row(
            r.source_id,
            f"[{styles[r.verdict]}]{verdict}[/]",
            _short(r.source_answer, 30),
            _short(r.answer, 30) if r.verdict != "diverged" else "-",
            r.rerun_id,
        )
    same = sum(r.verdict == "same" for r in reports)
    console = Console(width=200)
    console.print(table)
    console.print(f"{same} of {len(reports)} end as recorded")
