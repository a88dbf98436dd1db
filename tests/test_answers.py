"""Answers you can trust: only the model gives an answer; data never ends an episode; the
result says where its answer came from and why the episode stopped
(docs/behaviour/endings.md). Real Temporal dev server, real sandbox, the real openai client
against a scripted server."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta

import pytest

from durable_rlm.client.episodes import start_episode, store_context
from durable_rlm.scripted import Reply, root_and_sub
from durable_rlm.workflows.models import EpisodeLimits, RewardSpec, TerminationSpec
from tests.conftest import request_for, run_episode

DOCUMENT = (
    "Quarterly notes.\nSee the Final (revised) report.\nclass Report:\n    def final(self):\n        pass\n"
)


@pytest.mark.parametrize(
    "printing",
    [
        "print(context)",  # a document that mentions "Final (revised)" and `def final(self)`
        "print('FINAL(42)')",  # data shaped exactly like the protocol
        "print(\"FINAL_VAR('x')\")\nx = 'leaked'",
        "print('```\\nFINAL(fenced)\\n```')",
    ],
)
async def test_printed_data_never_ends_an_episode(client, blobs, worker, scripted, printing: str) -> None:
    server = scripted(root_and_sub([f"```repl\n{printing}\n```", "Read it.\nFINAL(the model decided)"]))
    request = request_for(server, context=store_context(blobs, DOCUMENT))
    result = await run_episode(client, request, worker.task_queue)
    assert (result.answer, result.ended_by, result.iterations) == ("the model decided", "final", 2)
    assert result.answer_source == "model"


async def test_final_called_in_a_cell_answers_with_the_value_not_the_name(client, worker, scripted) -> None:
    server = scripted(root_and_sub(["```repl\nres = sum(range(10))\nFINAL(res)\n```"]))
    result = await run_episode(client, request_for(server), worker.task_queue)
    assert (result.answer, result.ended_by, result.iterations) == ("45", "final", 1)
    assert result.answer_source == "model" and result.confidence == 1.0


async def test_final_var_called_in_a_cell_answers_with_the_variable(client, worker, scripted) -> None:
    server = scripted(root_and_sub(["```repl\nreport = 'all good'\nFINAL_VAR('report')\n```"]))
    result = await run_episode(client, request_for(server), worker.task_queue)
    assert (result.answer, result.ended_by) == ("all good", "final_var")


async def test_final_var_of_a_value_is_an_error_the_model_can_fix(client, worker, scripted) -> None:
    server = scripted(root_and_sub(["```repl\nres = 'Paris'\nFINAL_VAR(res)\n```", "FINAL_VAR(res)"]))
    result = await run_episode(client, request_for(server), worker.task_queue)
    assert (result.answer, result.iterations) == ("Paris", 2)
    assert "no variable named 'Paris'" in server.root_requests()[1].last_user


async def test_a_final_in_an_example_block_is_not_an_answer(client, worker, scripted) -> None:
    example = (
        "Here is how I will answer:\n```python\nFINAL(example)\n```\nFirst I look.\n```repl\nprint(1)\n```"
    )
    server = scripted(root_and_sub([example, "FINAL(real)"]))
    result = await run_episode(client, request_for(server), worker.task_queue)
    assert (result.answer, result.iterations) == ("real", 2)


@pytest.mark.parametrize(
    ("reply", "answer"),
    [
        ("FINAL(It's a dog)", "It's a dog"),
        ('FINAL("It\'s a dog")', '"It\'s a dog"'),
        ('FINAL("Blue")', '"Blue"'),
    ],
)
async def test_prose_answers_come_back_as_written(client, worker, scripted, reply: str, answer: str) -> None:
    server = scripted(root_and_sub([reply]))
    result = await run_episode(client, request_for(server), worker.task_queue)
    assert (result.answer, result.ended_by) == (answer, "final")


@pytest.mark.parametrize(
    ("reply", "answer"),
    [
        ("FINAL(42)", "42"),
        ('FINAL("hello")', '"hello"'),  # "including quotes in content"
        ("FINAL(answer (with nested) parens)", "answer (with nested) parens"),
    ],
)
async def test_seed_001_examples_are_the_answer_a_user_sees(
    client, worker, scripted, reply: str, answer: str
) -> None:
    server = scripted(root_and_sub([f"I know it.\n{reply}"]))
    result = await run_episode(client, request_for(server), worker.task_queue)
    assert (result.answer, result.ended_by, result.answer_source) == (answer, "final", "model")


async def test_seed_001_final_var_example_is_the_answer_a_user_sees(client, worker, scripted) -> None:
    server = scripted(root_and_sub(['```repl\nresult = "ok"\n```', "FINAL_VAR(result)"]))
    result = await run_episode(client, request_for(server), worker.task_queue)
    assert (result.answer, result.ended_by, result.iterations) == ("ok", "final_var", 2)


async def test_an_extracted_answer_says_so(client, worker, scripted) -> None:
    server = scripted(
        root_and_sub(["```repl\nx = 41 + 1\nprint(x)\n```"], extract=lambda prompt: '{"answer": "42"}')
    )
    limits = EpisodeLimits(max_iterations=2, cell_timeout_s=10)
    result = await run_episode(client, request_for(server, limits=limits), worker.task_queue)
    assert (result.answer, result.answer_source, result.ended_by) == ("42", "extraction", "max_iterations")
    assert result.confidence == pytest.approx(0.99)  # in a variable and in the recent output
    assert result.stop_reason == "max iterations reached (2/2); the answer was extracted from the history"
    assert result.episode_id


async def test_a_limit_without_extraction_has_no_answer(client, worker, scripted) -> None:
    server = scripted(root_and_sub(["```repl\nprint('working')\n```"]))
    limits = EpisodeLimits(max_iterations=2, cell_timeout_s=10)
    result = await run_episode(
        client, request_for(server, limits=limits, fallback_extraction=False), worker.task_queue
    )
    assert (result.answer, result.answer_source, result.confidence) == (None, "none", None)
    assert result.stop_reason.endswith("fallback extraction is disabled")
    assert server.extraction_requests() == []


async def test_a_negative_streak_stops_without_an_answer(client, worker, scripted) -> None:
    server = scripted(root_and_sub(["```repl\n1/0\n```"]))
    request = request_for(
        server, termination=TerminationSpec(name="reward_threshold"), reward=RewardSpec(function="outcome")
    )
    result = await run_episode(client, request, worker.task_queue)
    assert (result.answer, result.answer_source, result.ended_by) == (None, "none", "policy")
    assert result.execution.variant.kind == "stopped"
    assert result.execution.outputs() is None and result.execution.confidence() is None
    assert "3 consecutive negative rewards" in result.stop_reason


@pytest.mark.slow  # long end to end (the default run stays near 13 minutes); CI runs it
async def test_the_deadline_during_extraction_does_not_start_a_second_one(client, worker, scripted) -> None:
    """The iteration limit starts an extraction; the deadline passes while it runs."""
    server = scripted(
        root_and_sub(
            ["```repl\nx = 1\n```"],
            extract=lambda prompt: Reply(text='{"answer": "slow"}', delay_s=4),
        )
    )
    limits = EpisodeLimits(max_iterations=1, max_duration=timedelta(seconds=3), cell_timeout_s=10)
    handle = await start_episode(
        client, request_for(server, limits=limits), worker.task_queue, f"one-extract-{uuid.uuid4().hex[:6]}"
    )
    result = await asyncio.wait_for(handle.result(), 60)
    assert len(server.extraction_requests()) == 1
    assert (result.answer, result.ended_by) == ("slow", "max_iterations")


async def test_a_model_error_names_itself_and_gives_no_answer(client, worker, scripted) -> None:
    server = scripted(root_and_sub(["FINAL(x)"]), models={"other"})
    result = await run_episode(client, request_for(server), worker.task_queue)
    assert (result.ended_by, result.answer, result.answer_source) == ("model_error", None, "none")
    # A 404 is the request's fault (a model the provider does not have): the ending says so.
    assert (result.status, result.failure_cause) == ("failed", "request")
    assert result.stop_reason.startswith("the root model refused the request:")
    assert "HTTP 404" in result.stop_reason


async def test_the_deadline_during_a_cell_ends_the_loop_at_once(client, worker, scripted) -> None:
    """The timer cancels the running REPL step: that ends the loop; it is not a lost cell."""
    server = scripted(root_and_sub(["```repl\nimport time\ntime.sleep(20)\n```"]))
    limits = EpisodeLimits(max_iterations=5, max_duration=timedelta(seconds=3), cell_timeout_s=30)
    result = await run_episode(client, request_for(server, limits=limits), worker.task_queue)
    assert (result.ended_by, result.iterations, result.lost_cells) == ("max_duration", 1, 0)
    assert len(server.root_requests()) == 1 and len(server.extraction_requests()) == 1
