"""Fallback extraction (docs/behaviour/fallback-extraction.md) at the orchestrator level, on
the real Temporal dev server: submit bypasses extraction; each limit extracts with its
reason; an unparseable reply fails and keeps the history and partial outputs."""

from __future__ import annotations

import json
import uuid
from typing import Literal

import pytest
from pydantic import BaseModel, Field
from temporalio.worker import Replayer

from durable_rlm.scripted import root_and_sub
from durable_rlm.worker.runtime import workflow_runner
from durable_rlm.workflows.episode import EpisodeWorkflow
from durable_rlm.workflows.models import EpisodeLimits
from durable_rlm.workflows.typed_outputs import FieldSpec, fields_from_model
from tests.conftest import request_for, run_episode

FIELDS = [
    FieldSpec(name="colour", type="string", description="the colour"),
    FieldSpec(name="count", type="integer", description="how many"),
]
NEVER_DONE = "```repl\nresult = 'blue'\nprint('still thinking')\n```"


def limits(**kw) -> EpisodeLimits:
    return EpisodeLimits(**{"max_iterations": 3, "cell_timeout_s": 10, **kw})


async def test_submit_ends_the_episode_without_extraction(client, worker, scripted) -> None:
    server = scripted(root_and_sub(["```repl\nSUBMIT(colour='blue', count=3)\n```"]))
    request = request_for(server, output_fields=FIELDS, limits=limits(max_iterations=1))
    result = await run_episode(client, request, worker.task_queue)
    assert result.ended_by == "submitted"
    assert result.execution.variant.kind == "submitted"
    assert result.execution.outputs() == {"colour": "blue", "count": 3}
    assert result.execution.confidence() == 1.0
    assert json.loads(result.answer) == {"colour": "blue", "count": 3}
    assert server.extraction_requests() == []
    assert "SUBMIT(field=value" in server.root_requests()[0].messages[0]["content"]


async def test_an_invalid_submit_is_fed_back_and_the_episode_goes_on(client, worker, scripted) -> None:
    server = scripted(
        root_and_sub(
            [
                "```repl\nSUBMIT(colour='blue', count='three')\n```",
                "```repl\nSUBMIT(colour='blue', count=3)\n```",
            ]
        )
    )
    result = await run_episode(client, request_for(server, output_fields=FIELDS), worker.task_queue)
    assert result.iterations == 2 and result.execution.outputs() == {"colour": "blue", "count": 3}
    assert "'count' must be integer" in server.root_requests()[1].last_user


async def test_final_cannot_fill_a_typed_schema(client, worker, scripted) -> None:
    server = scripted(root_and_sub(["FINAL(blue)", "```repl\nSUBMIT(colour='blue', count=1)\n```"]))
    result = await run_episode(client, request_for(server, output_fields=FIELDS), worker.task_queue)
    assert result.ended_by == "submitted" and result.iterations == 2
    assert "call SUBMIT" in server.root_requests()[1].last_user


async def test_final_without_a_schema_is_a_submitted_answer(client, worker, scripted) -> None:
    server = scripted(root_and_sub(["FINAL(42)"]))
    result = await run_episode(client, request_for(server), worker.task_queue)
    assert result.execution.variant.kind == "submitted"
    assert result.execution.outputs() == {"answer": "42"}


async def test_max_iterations_extracts_with_the_seeds_confidence(client, worker, scripted) -> None:
    server = scripted(
        root_and_sub([NEVER_DONE], extract=lambda p: '{"answer": "blue", "_extraction_notes": "n"}')
    )
    result = await run_episode(client, request_for(server, limits=limits()), worker.task_queue)
    assert (result.ended_by, result.answer) == ("max_iterations", "blue")
    variant = result.execution.variant
    assert variant.kind == "extracted" and str(variant.reason) == "max iterations reached (3/3)"
    assert variant.extraction_notes == "n"
    # 0.5 base + 0.3 ("blue" is the variable `result`), not printed in the history: 0.8
    assert result.execution.confidence() == 0.8
    prompt = server.extraction_requests()[0].last_user
    assert "max iterations reached (3/3)" in prompt and "### Iteration 3" in prompt
    assert "- result = blue" in prompt and "still thinking" in prompt
    assert result.model_calls == 4  # three root calls and the extraction: all in the audit


async def test_max_llm_calls_extracts_with_its_reason(client, worker, scripted) -> None:
    server = scripted(
        root_and_sub(
            ["```repl\nparts = llm_query_batched(['a', 'b'])\nprint(parts)\n```"],
            str.upper,
            extract=lambda p: '```json\n{"answer": "A"}\n```',
        )
    )
    request = request_for(server, limits=limits(max_iterations=10, max_llm_calls=4))
    result = await run_episode(client, request, worker.task_queue)
    assert result.ended_by == "max_llm_calls"
    variant = result.execution.variant
    assert variant.kind == "extracted" and variant.reason.kind == "max_llm_calls"
    assert result.answer == "A"
    assert variant.confidence() == 0.7  # "A" is in the recent output, not a variable


async def test_typed_outputs_are_extracted_against_the_schema(client, worker, scripted) -> None:
    server = scripted(root_and_sub([NEVER_DONE], extract=lambda p: '{"colour": "blue", "count": null}'))
    request = request_for(server, output_fields=FIELDS, limits=limits(max_iterations=2))
    result = await run_episode(client, request, worker.task_queue)
    assert result.execution.outputs() == {"colour": "blue", "count": None}
    assert result.execution.confidence() == 0.65  # 0.5 + 0.3 - 0.3 x 1/2
    assert '"count": "integer (how many)"' in server.extraction_requests()[0].last_user


async def test_an_unparseable_extraction_fails_and_keeps_history_and_partial_outputs(
    client, worker, scripted
) -> None:
    server = scripted(root_and_sub([NEVER_DONE], extract=lambda p: '{"colour": "blue", "count": "lots"}'))
    request = request_for(server, output_fields=FIELDS, limits=limits(max_iterations=2))
    result = await run_episode(client, request, worker.task_queue)
    variant = result.execution.variant
    assert variant.kind == "failed" and result.answer is None
    assert variant.partial_outputs == {"colour": "blue", "count": "lots"}
    assert [e.iteration for e in variant.history] == [1, 2]
    assert variant.history[0].code.startswith("result = 'blue'") and variant.history[0].success
    assert result.execution.confidence() == 0.0


async def test_garbage_extraction_fails_without_partial_outputs(client, worker, scripted) -> None:
    server = scripted(root_and_sub([NEVER_DONE], extract=lambda p: "I cannot help with that."))
    result = await run_episode(
        client, request_for(server, limits=limits(max_iterations=1)), worker.task_queue
    )
    variant = result.execution.variant
    assert variant.kind == "failed" and variant.partial_outputs is None
    assert variant.reason.startswith("Failed to parse extraction")


async def test_extraction_can_be_turned_off(client, worker, scripted) -> None:
    server = scripted(root_and_sub([NEVER_DONE]))
    request = request_for(server, limits=limits(max_iterations=1), fallback_extraction=False)
    result = await run_episode(client, request, worker.task_queue)
    assert result.execution.variant.kind == "failed" and "disabled" in result.execution.variant.reason
    assert server.extraction_requests() == []


@pytest.mark.parametrize(("status", "attempts"), [(400, 1), (500, 3)])
async def test_a_failed_extraction_call_keeps_the_history(client, worker, scripted, status, attempts) -> None:
    from durable_rlm.scripted import Reply

    server = scripted(
        root_and_sub([NEVER_DONE], extract=lambda p: Reply(status=status, error="prompt too long"))
    )
    result = await run_episode(
        client, request_for(server, limits=limits(max_iterations=2)), worker.task_queue
    )
    variant = result.execution.variant
    assert variant.kind == "failed" and variant.reason.startswith("Extraction LLM call failed")
    assert "prompt too long" in variant.reason
    assert [e.iteration for e in variant.history] == [1, 2]
    assert len(server.extraction_requests()) == attempts  # rejected: once; server errors: every attempt


class Line(BaseModel):
    sku: str
    price: float = Field(ge=0)


class Invoice(BaseModel):
    status: Literal["paid", "due"]
    lines: list[Line]


INVOICE = fields_from_model(Invoice)


async def test_a_submit_breaking_the_schema_is_fed_back_with_json_paths(client, worker, scripted) -> None:
    server = scripted(
        root_and_sub(
            [
                "```repl\nlines = [{'sku': 'a', 'price': 2}, {'sku': 'b', 'price': -3}]\n"
                "SUBMIT(status='late', lines=lines)\n```",
                "```repl\nlines[1]['price'] = 3\nSUBMIT(status='due', lines=lines)\n```",
            ]
        )
    )
    episode_id = f"typed-{uuid.uuid4().hex[:8]}"
    request = request_for(server, output_fields=INVOICE)
    result = await run_episode(client, request, worker.task_queue, episode_id)
    assert (result.ended_by, result.iterations) == ("submitted", 2)
    assert result.execution.outputs() == {
        "status": "due",
        "lines": [{"sku": "a", "price": 2}, {"sku": "b", "price": 3}],
    }
    assert '"minimum": 0' in server.root_requests()[0].messages[0]["content"]  # told the rules
    feedback = server.root_requests()[1].last_user
    assert "SUBMIT was rejected:\n- $.status: 'late' is not one of ['paid', 'due']\n" in feedback
    assert "- $.lines[1].price: -3 is less than the minimum of 0\n" in feedback
    # The check runs in the workflow sandbox and replays to the same decisions.
    history = await client.get_workflow_handle(episode_id).fetch_history()
    replayer = Replayer(
        workflows=[EpisodeWorkflow], data_converter=client.data_converter, workflow_runner=workflow_runner()
    )
    assert (await replayer.replay_workflow(history)).replay_failure is None


async def test_extraction_is_told_the_task_and_checked_against_the_schema(client, worker, scripted) -> None:
    server = scripted(
        root_and_sub(
            [NEVER_DONE], extract=lambda p: '{"status": "due", "lines": [{"sku": "a", "price": -1}]}'
        )
    )
    request = request_for(
        server, "Total the invoice in `context`.", output_fields=INVOICE, limits=limits(max_iterations=1)
    )
    result = await run_episode(client, request, worker.task_queue)
    prompt = server.extraction_requests()[0].last_user
    assert "variables.\n\n## Task\n\nTotal the invoice in `context`.\n\n## REPL History" in prompt
    variant = result.execution.variant
    assert variant.kind == "failed"
    assert variant.reason == "Failed to parse extraction: $.lines[0].price: -1 is less than the minimum of 0"
