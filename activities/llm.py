"""Model calls: the `openai` client for any OpenAI-compatible endpoint, the `anthropic`
client for Anthropic's Messages API (ModelSettings.provider picks).

Client-side retries are off: Temporal retries, so each attempt is visible in history; how
provider errors map to retries is in activities/model_errors.py. Calls go through the
clients' raw-response API, so a reply that is not a completion is quoted, not a bare
JSONDecodeError.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import inspect
import json
import os
import re
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from temporalio import activity
from temporalio.exceptions import ApplicationError

from durable_rlm.activities.attempts import attempt_clock, beat_every_s, start_attempt_clock
from durable_rlm.activities.call_ledger import CallLedger
from durable_rlm.activities.model_errors import bad_reply, classify, compact_failures
from durable_rlm.activities.openai_chat import ChatClient, ChatError, prepare_tls
from durable_rlm.activities.providers import client_library, error_types
from durable_rlm.activities.reply_limits import (
    body_cap,
    cut_reply,
    read_capped_body,
    reading_at_most,
    text_of_cut_body,
    was_cut,
)
from durable_rlm.store import chains
from durable_rlm.store.blobs import BlobStore
from durable_rlm.workflows import defaults, dspy_program, names
from durable_rlm.workflows.compaction import resent_view
from durable_rlm.workflows.models import (
    CallFacts,
    CompactionInput,
    CompactionReply,
    Message,
    ModelSettings,
    RootCompletion,
    RootCompletionInput,
    SubQueryInput,
    SubQueryReply,
    TokenUsage,
)
from durable_rlm.workflows.parsing import shorten_middle

T = TypeVar("T")


async def with_heartbeats(work: Awaitable[T]) -> T:
    """Await `work`, heartbeating so a dead worker is noticed and cancellation arrives, every
    quarter of the heartbeat timeout (`beat_every_s`). The first beat goes at once when the
    server's heartbeat timeout, running since it handed the task out (perhaps to a poll this
    process answered only after a pause), is near."""
    every_s = beat_every_s()
    task = asyncio.ensure_future(work)
    clock = attempt_clock() if activity.in_activity() else None
    if clock is not None:
        clock.beat_if_due(every_s)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=every_s)
            if done:
                return task.result()
            if clock is not None:
                clock.beat()
    finally:
        if not task.done():
            task.cancel()


class BodyCut(Exception):
    """The reply's body was larger than its cap and was read only up to it: the text comes
    from the head read, and its token counts, which came after it, are estimated."""

    def __init__(self, head: bytes, api: str) -> None:
        super().__init__(f"reply body cut at {len(head):,} bytes")
        self.head, self.api = head, api

    def completion(self, settings: ModelSettings, messages: list[Message], elapsed: float) -> Completion:
        text, whole = text_of_cut_body(self.head, self.api)
        sent = sum(len(m.content) for m in messages)
        usage = TokenUsage.priced(
            sent // defaults.CHARS_PER_TOKEN, len(text) // defaults.CHARS_PER_TOKEN, settings.price
        )
        return Completion(text, usage, elapsed, whole=whole)


@dataclass(frozen=True)
class Completion:
    text: str
    usage: TokenUsage
    elapsed: float
    mean_logprob: float | None = None
    facts: CallFacts = dataclasses.field(default_factory=CallFacts)
    said: dict[str, Any] = dataclasses.field(default_factory=dict)  # response_* facts (CallFacts)
    whole: bool = True  # False: the body was cut inside the text (activities/reply_limits.py)

    def to_json(self) -> bytes:
        """As the call ledger keeps it (activities/call_ledger.py)."""
        return json.dumps(
            {
                "text": self.text,
                "usage": self.usage.model_dump(mode="json"),
                "elapsed": self.elapsed,
                "mean_logprob": self.mean_logprob,
                "facts": self.facts.model_dump(mode="json"),
                "said": self.said,
                "whole": self.whole,
            },
            ensure_ascii=False,
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Completion:
        kept = json.loads(data)
        return cls(
            text=kept["text"],
            usage=TokenUsage.model_validate(kept["usage"]),
            elapsed=kept["elapsed"],
            mean_logprob=kept["mean_logprob"],
            facts=CallFacts.model_validate(kept["facts"]),
            said=kept["said"],
            whole=kept["whole"],
        )

    def __post_init__(self) -> None:
        # A reply may carry a lone surrogate ("\ud800" in its JSON): no UTF-8 encodes it, so
        # it could not be recorded, sent to the sandbox or printed. It becomes U+FFFD.
        object.__setattr__(self, "text", valid_text(self.text))


def valid_text(text: str) -> str:
    """`text` as valid Unicode: each lone surrogate replaced by U+FFFD (linear, and a copy
    only when there is one)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)
    return text


_SURROGATE = re.compile("[\ud800-\udfff]")


def call_facts(messages: list[Message]) -> CallFacts:
    """When the call started and a digest of what it sent (the audit's prompt digest)."""
    sent = json.dumps([m.model_dump() for m in messages], sort_keys=True, ensure_ascii=False)
    digest = "sha256:" + hashlib.sha256(sent.encode()).hexdigest()
    return CallFacts(started_at=datetime.now(UTC), prompt_digest=digest)


def response_facts(response: Any, finish_reason: Any) -> dict[str, Any]:
    """What the provider said of its reply (CallFacts' response_* fields), where it said it."""
    said: dict[str, Any] = {}
    if isinstance(model := getattr(response, "model", None), str) and model:
        said["response_model"] = model
    if isinstance(reply_id := getattr(response, "id", None), str) and reply_id:
        said["response_id"] = reply_id
    if isinstance(finish_reason, str) and finish_reason:
        said["finish_reasons"] = [finish_reason]
    return said


def body_text(raw: Any) -> str:
    """The body of a raw client response, as far as it was read."""
    try:
        return str(raw.http_response.text)
    except Exception:  # noqa: BLE001 - only quoted in an error message
        return ""


def mean_logprob(choice: Any) -> float | None:
    """Mean token log-probability of a choice, when the provider returned logprobs."""
    tokens = getattr(getattr(choice, "logprobs", None), "content", None) or []
    values = [t.logprob for t in tokens if isinstance(getattr(t, "logprob", None), (int, float))]
    return sum(values) / len(values) if values else None


def client_errors() -> tuple[type[BaseException], ...]:
    """What a model client raises for a failed request: ours for OpenAI-compatible endpoints,
    anthropic's where that library was imported."""
    return (ChatError, *error_types("AnthropicError"))


class ModelActivities:
    """Holds the credentials (never in history) and one client per endpoint."""

    def __init__(
        self, blobs: BlobStore, credentials: Mapping[str, str] | None = None, ledger: CallLedger | None = None
    ) -> None:
        self.blobs = blobs
        self.credentials = dict(credentials or {})
        self.ledger = ledger  # no call paid twice (activities/call_ledger.py); None: not kept
        self._clients: dict[tuple[str, str | None, str, float], Any] = {}
        prepare_tls()  # ready by the first call (activities/openai_chat.py says why)

    def _env(self, name: str) -> str | None:
        return self.credentials.get(name) or os.environ.get(name)

    def _base_url(self, settings: ModelSettings) -> str | None:
        variable = "ANTHROPIC_BASE_URL" if settings.provider == "anthropic" else "OPENAI_BASE_URL"
        return settings.base_url or self._env(variable)

    def _client(self, settings: ModelSettings) -> Any:
        base_url = self._base_url(settings)
        key = self._env(settings.api_key_env)
        if not key:
            if base_url is None:
                raise ApplicationError(
                    f"no API key for {settings.provider} model {settings.model!r}: set "
                    f"{settings.api_key_env} (or --api-key) in the worker's environment",
                    type=names.MODEL_AUTH_FAILED,
                    non_retryable=True,
                )
            key = "EMPTY"  # local servers often need no key
        cache_key = (settings.provider, base_url, key, settings.request_timeout_s)
        client = self._clients.get(cache_key)
        if client is None:
            if settings.provider == "anthropic":
                library = client_library("anthropic")
                client = library.AsyncAnthropic(
                    api_key=key,
                    base_url=base_url,
                    max_retries=0,
                    timeout=settings.request_timeout_s,
                    # The library's own client, plus a hook that reads the body within its cap.
                    http_client=library.DefaultAsyncHttpxClient(event_hooks={"response": [read_capped_body]}),
                )
            else:  # plain HTTP, not the openai library: activities/openai_chat.py says why
                client = ChatClient(key, base_url, settings.request_timeout_s)
            self._clients[cache_key] = client
        return client

    async def complete(
        self,
        settings: ModelSettings,
        messages: list[Message],
        max_reply_chars: int = defaults.MAX_REPLY_CHARS,
    ) -> Completion:
        """One call; of its reply at most `max_reply_chars` characters are read, and a longer
        reply is cut there and says so (activities/reply_limits.py). In a step, made at most
        once however often the step runs (activities/call_ledger.py)."""
        ledger = self.ledger
        named = ledger.key_here(attempt_clock().next_call()) if ledger is not None else None
        if ledger is None or named is None:
            return await self._complete(settings, messages, max_reply_chars)
        key, workflow_id = named
        return await ledger.once(
            key,
            workflow_id,
            lambda: self._complete(settings, messages, max_reply_chars),
            Completion.to_json,
            Completion.from_json,
        )

    async def _complete(
        self, settings: ModelSettings, messages: list[Message], max_reply_chars: int
    ) -> Completion:
        facts = call_facts(messages)
        began = time.monotonic()
        with reading_at_most(body_cap(max_reply_chars)):
            try:
                if settings.provider == "anthropic":
                    done = await self._complete_anthropic(settings, messages)
                else:
                    done = await self._complete_openai(settings, messages)
            except BodyCut as cut:
                done = cut.completion(settings, messages, time.monotonic() - began)
        text, cut_at = cut_reply(done.text, max_reply_chars, whole=done.whole)
        said = {**done.said, "reply_cut_at": cut_at} if cut_at is not None else done.said
        return dataclasses.replace(done, text=text, facts=facts.model_copy(update=said))

    async def _complete_openai(self, settings: ModelSettings, messages: list[Message]) -> Completion:
        client: ChatClient = self._client(settings)
        base_url = client.base_url
        body: dict[str, Any] = {"model": settings.model, "messages": [m.model_dump() for m in messages]}
        if settings.temperature is not None:
            body["temperature"] = settings.temperature
        if settings.max_tokens is not None:
            body["max_tokens"] = settings.max_tokens
        if settings.top_p is not None:
            body["top_p"] = settings.top_p
        if settings.stop:
            body["stop"] = settings.stop
        if settings.logprobs:
            body["logprobs"] = True
        if settings.extra_body:
            body.update(settings.extra_body)  # merged last, as the openai library merges it
        started = time.monotonic()
        response, raw = await self._send(settings, base_url, client.create(body))
        elapsed = time.monotonic() - started
        if isinstance(response, str):  # a content type other than JSON: the client hands back text
            raise bad_reply(settings, base_url, "a body that is not JSON", response)
        choices: Any = getattr(response, "choices", None)
        message = getattr(choices[0], "message", None) if choices else None
        if message is None:
            what = "a chat completion without choices" if not choices else "a choice without a message"
            raise bad_reply(settings, base_url, what, body_text(raw))
        choice = choices[0]
        usage = TokenUsage.priced(
            getattr(response.usage, "prompt_tokens", 0) or 0,
            getattr(response.usage, "completion_tokens", 0) or 0,
            settings.price,
        ).with_reported_cost(getattr(response.usage, "cost", None))
        said = response_facts(response, getattr(choice, "finish_reason", None))
        return Completion(message.content or "", usage, elapsed, mean_logprob(choice), said=said)

    async def _send(self, settings: ModelSettings, base_url: str, request: Awaitable[Any]) -> tuple[Any, Any]:
        """The parsed reply and the raw response (to quote a body that is not a reply).
        Client errors become the ApplicationError Temporal should retry or not, `from None`:
        their chain is too long for the server to keep (activities/model_errors.py). A
        paused worker whose attempt the server gave up sends nothing (AttemptClock)."""
        if activity.in_activity():
            try:
                attempt_clock().ensure_current(f"the request to model {settings.model!r}")
            except ApplicationError:
                with contextlib.suppress(Exception):
                    request.close()  # type: ignore[attr-defined]  # the coroutine was never awaited
                raise
        try:
            raw = await with_heartbeats(request)
        except client_errors() as exc:
            raise classify(exc, settings, base_url) from None
        if was_cut(getattr(raw, "http_response", None)):
            raise BodyCut(raw.http_response.content, settings.provider)
        try:
            parsed = raw.parse()
            if inspect.isawaitable(parsed):  # anthropic's async raw responses parse asynchronously
                parsed = await parsed
        except client_errors() as exc:
            raise classify(exc, settings, base_url) from None
        except ValueError:  # JSONDecodeError: declared JSON, but it is not
            raise bad_reply(settings, base_url, "a body that is not JSON", body_text(raw)) from None
        return parsed, raw

    async def _complete_anthropic(self, settings: ModelSettings, messages: list[Message]) -> Completion:
        """The Messages API: the system prompt is a field of its own, turns alternate (ours
        are merged when two of a role follow each other), and max_tokens is required."""
        client = self._client(settings)
        base_url = str(client.base_url)
        system = "\n\n".join(m.content for m in messages if m.role == "system")
        turns: list[dict[str, str]] = []
        for m in messages:
            if m.role == "system":
                continue
            # The API refuses an empty turn; a model's empty reply must not end the episode.
            content = m.content if m.content.strip() else EMPTY_TURN
            if turns and turns[-1]["role"] == m.role:
                turns[-1]["content"] += "\n\n" + content
            else:
                turns.append({"role": m.role, "content": content})
        kwargs: dict[str, Any] = {"max_tokens": settings.max_tokens or defaults.ANTHROPIC_MAX_TOKENS}
        if system:
            kwargs["system"] = system
        if settings.stop:
            kwargs["stop_sequences"] = settings.stop
        # Sent in the body: recent client versions no longer take temperature and top_p as
        # arguments, while the API (for the models that accept them) still reads them.
        extra = dict(settings.extra_body)
        if settings.temperature is not None:
            extra["temperature"] = settings.temperature
        if settings.top_p is not None:
            extra["top_p"] = settings.top_p
        if extra:
            kwargs["extra_body"] = extra
        started = time.monotonic()
        response, raw = await self._send(
            settings,
            base_url,
            client.messages.with_raw_response.create(model=settings.model, messages=turns, **kwargs),
        )
        elapsed = time.monotonic() - started
        if isinstance(response, str):
            raise bad_reply(settings, base_url, "a body that is not JSON", response)
        blocks = getattr(response, "content", None)
        if blocks is None:  # an empty list is an empty reply; no list at all is not a message
            raise bad_reply(settings, base_url, "a message without content", body_text(raw))
        text = "".join(getattr(block, "text", "") or "" for block in blocks)
        usage = TokenUsage.priced(
            getattr(response.usage, "input_tokens", 0) or 0,
            getattr(response.usage, "output_tokens", 0) or 0,
            settings.price,
        )
        return Completion(
            text, usage, elapsed, said=response_facts(response, getattr(response, "stop_reason", None))
        )

    @activity.defn(name=names.ROOT_COMPLETION)
    async def root_completion(self, request: RootCompletionInput) -> RootCompletion:
        start_attempt_clock()
        with compact_failures():
            return await self._root_completion(request)

    async def _root_completion(self, request: RootCompletionInput) -> RootCompletion:
        head, messages = await asyncio.to_thread(self._extend, request.conversation, request.append)
        turn = request.dspy
        if turn is not None:  # a DSPy program's: its history rendered into one user message
            sent = dspy_program.action_messages(
                messages, turn.prefix, turn.user, turn.iteration, turn.max_output_chars
            )
        else:
            sent = resent_view(messages, request.resent_message_chars)
        done = await self.complete(request.model, sent, request.max_reply_chars)
        head = await asyncio.to_thread(
            chains.append_message, self.blobs, head, Message(role="assistant", content=done.text)
        )
        return RootCompletion(
            text=done.text,
            conversation=head,
            usage=done.usage,
            model_time_s=done.elapsed,
            mean_logprob=done.mean_logprob,
            sent_chars=sum(len(m.content) for m in sent),
            **done.facts.model_dump(),
        )

    @activity.defn(name=names.SUB_QUERY)
    async def sub_query(self, request: SubQueryInput) -> SubQueryReply:
        start_attempt_clock()
        with compact_failures():
            done = await self.complete(
                request.model, [Message(role="user", content=request.prompt)], request.max_reply_chars
            )
        return SubQueryReply(
            text=done.text, usage=done.usage, model_time_s=done.elapsed, **done.facts.model_dump()
        )

    @activity.defn(name=names.COMPACT_CONVERSATION)
    async def compact_conversation(self, request: CompactionInput) -> CompactionReply:
        """Replace the middle of the conversation by a summary the model writes; the system
        prompt, the task and the latest turns stay verbatim. Recorded as its own step."""
        start_attempt_clock()
        with compact_failures():
            return await self._compact_conversation(request)

    async def _compact_conversation(self, request: CompactionInput) -> CompactionReply:
        messages = await asyncio.to_thread(chains.read_conversation, self.blobs, request.conversation)
        head, middle, tail = split_for_compaction(messages, request.keep_messages)
        if not middle:
            return CompactionReply(
                conversation=request.conversation or "",
                conversation_chars=sum(len(m.content) for m in messages),
                summary="",
                removed_messages=0,
                kept_messages=len(messages),
                usage=TokenUsage(),
                model_time_s=0.0,
            )
        done = await self._summarise(request.model, middle, request.input_chars, request.max_reply_chars)
        summary = Message(role="user", content=f"{COMPACTED_PREFIX}\n{done.text.strip()}")
        kept = [*head, summary, *tail]
        new_head = await asyncio.to_thread(self._rewrite, kept)
        return CompactionReply(
            conversation=new_head,
            conversation_chars=sum(len(m.content) for m in kept),
            summary=done.text,
            removed_messages=len(middle),
            kept_messages=len(kept),
            usage=done.usage,
            model_time_s=done.elapsed,
            history=history_entries(middle, done.text) if request.history else None,
            **done.facts.model_dump(),
        )

    async def _summarise(
        self, model: ModelSettings, middle: list[Message], input_chars: int, max_reply_chars: int
    ) -> Completion:
        """The summary call; when even it does not fit the window (unknown to us), it reads
        half as much of the earlier turns and tries again."""
        while True:
            prompt = compaction_prompt(middle, input_chars)
            try:
                return await self.complete(model, [Message(role="user", content=prompt)], max_reply_chars)
            except ApplicationError as exc:
                if exc.type != names.MODEL_CONTEXT_OVERFLOW or input_chars <= MIN_SUMMARY_INPUT_CHARS:
                    raise
                input_chars //= 2

    def _rewrite(self, messages: list[Message]) -> str:
        head: str | None = None
        for message in messages:
            head = chains.append_message(self.blobs, head, message)
        assert head is not None
        return head

    def _extend(self, head: str | None, new: list[Message]) -> tuple[str | None, list[Message]]:
        for message in new:
            head = chains.append_message(self.blobs, head, message)
        return head, chains.read_conversation(self.blobs, head)


MIN_SUMMARY_INPUT_CHARS = 2_000
EMPTY_TURN = "(empty reply)"
COMPACTED_PREFIX = "[Summary of the earlier turns of this episode, written to stay within the context window]"

COMPACTION_PROMPT = """You are compacting the working memory of an agent that answers a query \
with a Python REPL. Below are the earlier turns of its conversation: its replies (reasoning and \
code) and what the REPL printed. Write a summary the agent can continue from: what it has \
learned about the context, the REPL variables it created and what they hold, what it tried \
that failed, and what remains to do. Keep exact numbers, names and variable names. Do not \
invent results. Plain text, at most a few hundred words.

{turns}"""


def split_for_compaction(
    messages: list[Message], keep: int
) -> tuple[list[Message], list[Message], list[Message]]:
    """(system prompt and task, the turns to summarise, the latest turns kept verbatim)."""
    fixed = 2 if len(messages) >= 2 else len(messages)
    head, rest = messages[:fixed], messages[fixed:]
    if len(rest) <= keep:
        return head, [], rest
    return head, rest[: len(rest) - keep], rest[len(rest) - keep :]


def history_entries(middle: list[Message], summary: str) -> str:
    """rlms's `history` entries for what a compaction removed, as JSON: each turn's messages
    (the reply, then what the REPL printed) as one list, then {"type": "summary", ...}. An
    earlier summary is in `history` already."""
    entries: list[Any] = []
    for message in middle:
        if message.content.startswith(COMPACTED_PREFIX):
            continue
        if message.role == "assistant" or not entries or not isinstance(entries[-1], list):
            entries.append([])
        entries[-1].append({"role": message.role, "content": message.content})
    entries.append({"type": "summary", "content": summary})
    return json.dumps(entries)


def compaction_prompt(middle: list[Message], input_chars: int) -> str:
    each = max(200, input_chars // max(1, len(middle)))
    turns = "\n\n".join(f"[{m.role}]\n{shorten_middle(m.content, each)}" for m in middle)
    return COMPACTION_PROMPT.format(turns=shorten_middle(turns, input_chars))
