"""Provider faults through whole episodes, against the scripted servers and the real
`openai` client: transient ones are retried with backoff and the episode completes;
permanent ones end it (or pause it, for a refused key) with a clear recorded failure and
its history kept; a sub-call's context-length error reaches the cell as an exception the
code can handle."""

from __future__ import annotations

import threading
import uuid

import pytest

from durable_rlm.scripted import ChatRequest, Reply
from durable_rlm.workflows.models import EpisodeLimits, ModelSettings
from tests.conftest import request_for, run_episode

TURNS = ["```repl\nr = llm_query('ping')\n```", "FINAL_VAR(r)"]


def faulty_first_root(fault: Reply, times: int = 1):
    """The first `times` root calls meet `fault`; then the episode's turns, sub-calls shouted."""
    lock = threading.Lock()
    seen = {"root": 0}

    def script(request: ChatRequest) -> Reply | str:
        if not request.is_root:
            return request.last_user.upper()
        with lock:
            seen["root"] += 1
            n = seen["root"]
        if n <= times:
            return fault
        return TURNS[min(n - times - 1, len(TURNS) - 1)]

    return script


TRANSIENT = {
    "429 with retry-after": Reply(status=429, error="slow down", headers={"retry-after": "1"}),
    "500": Reply(status=500, error="internal"),
    "503": Reply(status=503, error="unavailable"),
    "connection reset": Reply(reset=True),
    "read timeout": Reply(text="too late", delay_s=3.0),
    "malformed JSON": Reply(raw='{"choices": [{"message": '),
    "empty choices": Reply(raw='{"id": "x", "object": "chat.completion", "choices": []}'),
    "an HTML error page": Reply(status=502, raw="<html>bad gateway</html>", content_type="text/html"),
}


@pytest.mark.parametrize("fault", list(TRANSIENT), ids=list(TRANSIENT))
async def test_a_transient_fault_is_retried_and_the_episode_completes(
    client, worker, scripted, fault
) -> None:
    server = scripted(faulty_first_root(TRANSIENT[fault]))
    request = request_for(server)
    request.root_model = ModelSettings(
        model="scripted", base_url=server.base_url, max_attempts=4, request_timeout_s=1.5
    )
    result = await run_episode(client, request, worker.task_queue)
    assert (result.answer, result.error) == ("PING", None)
    assert len(server.root_requests()) == 3  # the failed attempt, then the episode's two turns


async def test_a_rejected_request_ends_the_episode_with_its_reason_and_keeps_its_history(
    client, worker, scripted
) -> None:
    server = scripted(
        faulty_first_root(Reply(status=400, error="unsupported parameter: frobnicate"), times=99)
    )
    episode_id = f"rejected-{uuid.uuid4().hex[:6]}"
    result = await run_episode(client, request_for(server), worker.task_queue, episode_id)
    assert result.answer is None and "frobnicate" in (result.error or "")
    assert len(server.root_requests()) == 1  # not retried: it would be rejected again
    history = await client.get_workflow_handle(episode_id).fetch_history()
    assert history.events  # the record is there to audit


async def test_a_refused_key_pauses_with_the_reason_instead_of_failing(client, worker, scripted) -> None:
    from durable_rlm.workflows.models import EpisodeProgress

    server = scripted(faulty_first_root(Reply(status=401, error="invalid api key"), times=99))
    limits = EpisodeLimits(max_iterations=4, max_duration=__import__("datetime").timedelta(seconds=20))
    handle = await client.start_workflow(
        "RlmEpisode",
        request_for(server, limits=limits),
        id=f"key-{uuid.uuid4().hex[:6]}",
        task_queue=worker.task_queue,
    )
    for _ in range(100):
        progress = await handle.query("progress", result_type=EpisodeProgress)
        if progress.paused:
            break
        await __import__("asyncio").sleep(0.1)
    assert progress.paused is not None and "OPENAI_API_KEY" in progress.paused
    await handle.cancel()


async def test_a_sub_calls_context_length_error_is_an_exception_the_cell_handles(
    client, worker, scripted
) -> None:
    def script(request: ChatRequest) -> Reply | str:
        if not request.is_root:
            return Reply(
                status=400,
                error="This model's maximum context length is 8192 tokens. However, your messages "
                "resulted in 90000 tokens.",
            )
        turns = [
            "```repl\ntry:\n    r = llm_query('x' * 1000)\nexcept Exception as e:\n"
            "    r = 'handled: ' + ('context' if 'context length' in str(e) else str(e))\n```",
            "FINAL_VAR(r)",
        ]
        return turns[min(request.turn, 1)]

    server = scripted(script)
    result = await run_episode(client, request_for(server), worker.task_queue)
    assert result.answer == "handled: context"
    assert len(server.sub_requests()) == 1  # a context-length error is not retried
