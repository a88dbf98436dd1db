"""Long episodes keep going (issue 20, item 5): compaction before the window is full, a
context-length error compacts and retries once then extracts, and long replies and outputs
are shortened in what is resent but kept whole in what is stored."""

from __future__ import annotations

import itertools
import uuid

from durable_rlm.activities.llm import split_for_compaction
from durable_rlm.audit.timeline import episode_timeline, render
from durable_rlm.scripted import COMPACTION_MARKER, SCRIPTED_SUMMARY, ChatRequest, Reply
from durable_rlm.workflows import names
from durable_rlm.workflows.compaction import estimated_request_tokens, needs_compaction, resent_view
from durable_rlm.workflows.models import EpisodeCarry, EpisodeLimits, Message, ModelSettings
from tests.conftest import request_for, run_episode

# --- when to compact (pure) -------------------------------------------------------------------


def state(prompt_tokens: int, reply_tokens: int = 0) -> EpisodeCarry:
    return EpisodeCarry(
        seed=1,
        deadline="2030-01-01T00:00:00Z",
        conversation="sha256:" + "0" * 64,
        last_prompt_tokens=prompt_tokens,
        last_reply_tokens=reply_tokens,
    )


def test_the_reply_is_reserved_before_the_window_is_full() -> None:
    limits = EpisodeLimits(context_window_tokens=10_000)  # compact at 80%: 8,000 tokens
    pending = [Message(role="user", content="x" * 4_000)]  # ~1,000 tokens
    # 5,000 + 1,000 = 6,000 input tokens fit under 8,000 ...
    assert estimated_request_tokens(state(5_000), pending, limits.resent_message_chars) == 6_000
    # ... but not with the 4,096 tokens a reply may take: rlms would not compact here.
    assert needs_compaction(state(5_000), pending, limits, ModelSettings(model="m"))
    assert not needs_compaction(state(5_000), pending, limits, ModelSettings(model="m", max_tokens=1_000))
    assert not needs_compaction(state(2_000), pending, limits, ModelSettings(model="m"))


def test_no_window_no_compaction_and_long_replies_count_as_resent() -> None:
    assert not needs_compaction(state(10**9), [], EpisodeLimits(), ModelSettings(model="m"))
    # A 1 MB reply is resent shortened, so it counts at the resend size, not its own.
    assert estimated_request_tokens(state(1_000, reply_tokens=250_000), [], 20_000) == 1_000 + 5_000


def test_compaction_keeps_the_system_prompt_the_task_and_the_latest_turns() -> None:
    messages = [Message(role="system", content="s"), Message(role="user", content="task")]
    messages += [Message(role="assistant" if i % 2 else "user", content=str(i)) for i in range(10)]
    head, middle, tail = split_for_compaction(messages, keep=2)
    assert [m.content for m in head] == ["s", "task"]
    assert [m.content for m in middle] == [str(i) for i in range(8)]
    assert [m.content for m in tail] == ["8", "9"]
    assert split_for_compaction(messages[:4], keep=2)[1] == []
    assert [m.content for m in split_for_compaction(messages, keep=0)[1]] == [str(i) for i in range(10)]


def test_earlier_long_messages_are_shortened_in_what_is_resent() -> None:
    big = "B" * 50_000
    messages = [
        Message(role="system", content=big),
        Message(role="user", content=big),
        Message(role="assistant", content=big),
        Message(role="user", content=big),
    ]
    sent = resent_view(messages, 20_000)
    assert [len(m.content) for m in sent[:2]] == [50_000, 50_000]  # system prompt and task whole
    assert len(sent[2].content) < 21_000 and "characters not repeated here" in sent[2].content
    assert sent[3].content == big  # the newest message whole
    assert messages[2].content == big  # the input is not changed


# --- episodes -----------------------------------------------------------------------------------


def counting_script(turns: list[str]) -> object:
    """Root turns by how many root calls came before (compaction rewrites the history)."""
    counter = itertools.count()

    def script(request: ChatRequest) -> Reply | str:
        if request.is_compaction:
            return SCRIPTED_SUMMARY
        if request.is_root:
            return turns[min(next(counter), len(turns) - 1)]
        if request.is_extraction:
            return '{"answer": "extracted"}'
        return request.last_user.upper()

    return script


PRINT_BIG = "```repl\nchunk = 'x' * 6000\nprint(chunk)\nseen = globals().get('seen', 0) + 1\n```"


async def test_a_long_episode_compacts_before_it_overflows(client, worker, scripted) -> None:
    turns = [PRINT_BIG] * 6 + ["FINAL_VAR(seen)"]
    server = scripted(counting_script(turns), context_window_tokens=6_000)
    limits = EpisodeLimits(max_iterations=10, cell_timeout_s=10, context_window_tokens=6_000)
    episode_id = f"compact-{uuid.uuid4().hex[:6]}"
    request = request_for(server, limits=limits)
    request.root_model.max_tokens = 500  # the reply's reservation: the server counts it too
    result = await run_episode(client, request, worker.task_queue, episode_id)
    assert (result.answer, result.ended_by) == ("6", "final_var")  # the REPL kept every variable
    assert result.compactions >= 1
    root = server.root_requests()
    assert all(sum(len(m["content"]) for m in r.messages) // 4 <= 6_000 for r in root)  # none rejected
    compacted = [r for r in root if any(SCRIPTED_SUMMARY in m["content"] for m in r.messages)]
    assert compacted, "no root request carried the summary"
    history = await client.get_workflow_handle(episode_id).fetch_history()
    steps = [
        e.activity_task_scheduled_event_attributes.activity_type.name
        for e in history.events
        if e.HasField("activity_task_scheduled_event_attributes")
    ]
    assert steps.count(names.COMPACT_CONVERSATION) == result.compactions  # a step of its own
    timeline = await episode_timeline(client, episode_id)
    shown = [c for it in timeline.iterations for c in it.compactions]
    assert len(shown) == result.compactions and SCRIPTED_SUMMARY in shown[0]
    assert "Lost cells: 0; compactions:" in render(timeline)


async def test_a_context_length_error_compacts_and_retries_once(client, worker, scripted) -> None:
    turns = [PRINT_BIG] * 5 + ["FINAL_VAR(seen)"]
    server = scripted(counting_script(turns), context_window_tokens=5_000)
    limits = EpisodeLimits(max_iterations=10, cell_timeout_s=10)  # the window is not configured
    result = await run_episode(client, request_for(server, limits=limits), worker.task_queue)
    assert (result.answer, result.ended_by) == ("5", "final_var"), result.stop_reason
    rejected = [r for r in server.root_requests() if sum(len(m["content"]) for m in r.messages) // 4 > 5_000]
    assert len(rejected) == result.compactions >= 1  # each overflow: one compaction, one retry


async def test_an_overflow_compaction_cannot_fix_ends_in_extraction(client, worker, scripted) -> None:
    server = scripted(counting_script(["FINAL(never)"]), context_window_tokens=2_000)
    request = request_for(server, task="t" * 12_000)  # the task alone is over the window
    result = await run_episode(client, request, worker.task_queue)
    assert (result.ended_by, result.answer, result.answer_source) == (
        "context_overflow",
        "extracted",
        "extraction",
    )
    assert "no longer fits the root model's context window" in result.stop_reason
    assert len(server.compaction_requests()) == 0  # nothing in the middle to summarise
    assert len(server.root_requests()) == 2  # the call and its one retry


async def test_a_huge_reply_is_stored_whole_and_resent_shortened(client, worker, scripted, blobs) -> None:
    huge = "```repl\nx = 1\n```\n" + "word " * 190_000  # a ~1 MB reply, within max_reply_chars
    turns = [huge, "```repl\nprint('y' * 100_000)\n```", "```repl\nprint(x)\n```", "FINAL_VAR(x)"]
    server = scripted(counting_script(turns))
    episode_id = f"huge-{uuid.uuid4().hex[:6]}"
    result = await run_episode(client, request_for(server), worker.task_queue, episode_id)
    assert result.answer == "1"
    last = server.root_requests()[-1].messages
    assert all(len(m["content"]) < 25_000 for m in last[2:])  # neither the reply nor the output
    assert "characters not repeated here" in last[2]["content"]
    timeline = await episode_timeline(client, episode_id)
    assert timeline.iterations[0].response == huge  # history keeps the reply whole
    assert timeline.iterations[1].cells[0].stdout == "y" * 100_000 + "\n"  # and the output


def test_the_summary_prompt_is_recognised_by_the_scripted_server() -> None:
    from durable_rlm.activities.llm import COMPACTION_PROMPT

    assert COMPACTION_PROMPT.startswith(COMPACTION_MARKER)
