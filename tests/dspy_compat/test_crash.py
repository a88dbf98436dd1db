"""A DSPy program's RLM call survives its worker: the worker process is SIGKILLed while the
model thinks about the second step, another worker finishes the episode, and the program's
`acall` returns the Prediction DSPy's RLM returns for the same script, with no model or tool
call paid twice but the one cut mid-flight."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import dspy
import pytest
from dspy.primitives import LocalInterpreter

from durable_rlm.dspy import RLM
from durable_rlm.scripted import ChatRequest, Reply
from durable_rlm.settings import Settings
from tests.dspy_compat.models import ITERATION, action, dspy_model
from tests.tool_plugins import lookup_price

pytestmark = pytest.mark.chaos

SIGNATURE = "item_name -> item: str, total: float"


def steps(thinking_s: float) -> list[str | Reply]:
    return [
        action(
            "Price it and ask.",
            'price = lookup_price(item=item_name)\nprint(price)\nprint(llm_query(f"is {price} cheap?"))',
        ),
        Reply(text=action("Double it.", "total = price * 2\nprint(total)"), delay_s=thinking_s),
        action("Done.", "SUBMIT(item_name, total)"),
    ]


def iteration(request: ChatRequest) -> int:
    found = ITERATION.search(request.last_user)
    return int(found.group(1)) if found else 0


def tool_calls(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


async def wait_until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def test_a_worker_killed_mid_run_still_gives_the_prediction_and_pays_no_call_twice(
    temporal_address: str, session_dir: Path, scripted, worker_processes, monkeypatch, tmp_path: Path
) -> None:
    log = tmp_path / "tools.log"
    monkeypatch.setenv("DRLM_TOOL_MODULES", "tests.tool_plugins")  # the workers' tools
    monkeypatch.setenv("DRLM_TEST_TOOL_LOG", str(log))

    reference = scripted(dspy_model(steps(0.0), sub=lambda prompt: "yes"))
    lm = dspy.LM("openai/root-m", api_base=reference.base_url, api_key="sk-scripted", cache=False)
    with dspy.context(lm=lm):
        expected = dspy.RLM(
            SIGNATURE, max_iters=5, tools=[lookup_price], interpreter_factory=LocalInterpreter
        )(item_name="widget")
    log.unlink()

    server = scripted(dspy_model(steps(4.0), sub=lambda prompt: "yes"))
    settings = Settings(
        temporal_address=temporal_address, task_queue=worker_processes.queue, data_dir=session_dir
    )
    program = RLM(SIGNATURE, max_iters=5, tools=[lookup_price], settings=settings)
    first = worker_processes()
    lm = dspy.LM("openai/root-m", api_base=server.base_url, api_key="sk-scripted", cache=False)
    with dspy.context(lm=lm):
        call = asyncio.ensure_future(program.acall(item_name="widget"))
        await wait_until(lambda: any(iteration(r) == 2 for r in server.root_requests()))
        first.kill()  # mid-flight: the model is still thinking about step 2
        worker_processes()
        prediction = await asyncio.wait_for(call, 120)

    assert dict(prediction.items()) == dict(expected.items())
    assert (prediction.item, prediction.total) == ("widget", 25.0)
    assert sorted(iteration(r) for r in server.root_requests()) == [1, 2, 2, 3]  # the cut call, again
    assert len(server.sub_requests()) == 1
    assert tool_calls(log) == [["lookup_price", "widget"]]
