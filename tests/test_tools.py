"""Custom tools: plain functions registered on the workers, called from the REPL, run as
activities with their own timeouts and retries, recorded so a rebuilt REPL does not call
them again."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import pytest

from durable_rlm.client.episodes import start_episode
from durable_rlm.scripted import Reply, root_and_sub
from durable_rlm.settings import ConfigurationError
from durable_rlm.tools import ToolRegistrationError, tool, tool_specs
from durable_rlm.workflows.models import ToolSpec
from tests import tool_plugins
from tests.conftest import request_for, run_episode

TOOLS = ["lookup_price", "convert"]
PRICE_TURNS = [
    "```repl\np = lookup_price('widget')\nusd = convert(p, currency='USD')\nprint(p, usd)\n```",
    "FINAL_VAR(usd)",
]


async def test_an_answer_that_needs_a_sync_and_an_async_tool(
    client, scripted, worker, store, tmp_path: Path, monkeypatch
) -> None:
    import sqlalchemy as sa

    from durable_rlm.store import schema

    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("DRLM_TEST_TOOL_LOG", str(log))
    server = scripted(root_and_sub(PRICE_TURNS))
    request = request_for(server, tools=tool_specs(TOOLS))
    episode_id = f"tools-{uuid.uuid4().hex[:6]}"
    result = await run_episode(client, request, worker.task_queue, episode_id)
    events = schema.events
    with store[1].connect() as conn:
        audited = conn.execute(
            sa.select(events.c.event_key, events.c.detail)
            .where(events.c.episode_id == episode_id, events.c.kind == "tool_call")
            .order_by(events.c.event_key)
        ).all()
    assert [key for key, _ in audited] == ["tool:1.0", "tool:1.1"]  # the audit lists each tool call
    assert audited[0][1].startswith("lookup_price(") and audited[0][1].endswith("-> 12.5")

    assert result.answer == "13.75"
    assert result.tool_calls == 2 and result.sub_calls == 0
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls == [["lookup_price", "widget"], ["convert", 12.5, "USD"]]
    system = server.root_requests()[0].messages[0]["content"]
    assert "- `lookup_price(item)` - The list price of an item, in EUR." in system
    assert "- `convert(amount, currency='USD')` - Convert an amount in EUR to another currency." in system


async def test_tool_failures_are_errors_the_cell_can_catch(client, scripted, worker) -> None:
    ghost = ToolSpec(name="ghost", doc="registered nowhere")
    cell = (
        "```repl\n"
        "for label, thunk in [('broken', lambda: broken(3)), ('hangs', hangs), ('not_json', not_json),\n"
        "                     ('ghost', ghost), ('args', lambda: lookup_price()),\n"
        "                     ('odd_arg', lambda: lookup_price(object()))]:\n"
        "    try:\n        thunk()\n    except (ToolError, TypeError) as e:\n"
        "        print(label, type(e).__name__, e)\n"
        "print('price', lookup_price('gadget'))\n"
        "print('value', type(not_json()).__name__, sorted(not_json()))\n"
        "try:\n    broken(4)\nexcept ToolError as e:\n    print('cause', repr(e.__cause__))\n```"
    )
    server = scripted(root_and_sub([cell, "FINAL(done)"]))
    specs = [*tool_specs(["broken", "hangs", "not_json", "lookup_price"]), ghost]
    result = await run_episode(client, request_for(server, tools=specs), worker.task_queue)

    assert result.answer == "done"
    output = server.root_requests()[1].last_user
    assert "broken ToolError broken failed: ValueError: no luck with 3" in output
    assert "hangs ToolError hangs failed: hangs timed out (1 s per attempt)" in output
    # Not JSON: the cell gets the object itself (pickled to the sandbox), as rlms hands it back.
    assert "not_json ToolError" not in output
    assert "value set [1, 2]" in output
    assert "cause ValueError('no luck with 4')" in output  # the tool's own exception, kept
    assert "ghost ToolError ghost failed: tool 'ghost' is not registered on this worker" in output
    assert "args TypeError missing a required argument: 'item'" in output
    # An argument outside the closed set the worker decodes is refused in the cell.
    assert "odd_arg TypeError lookup_price: a object cannot be sent; the values that can: None," in output
    assert "price 40.0" in output


def test_bad_registrations_and_unknown_tools_are_clear_errors() -> None:
    with pytest.raises(ToolRegistrationError, match="not a free Python identifier"):
        tool(name="llm_query")(lambda: None)
    with pytest.raises(ToolRegistrationError, match="the default of 'x' is not a JSON value"):

        @tool
        def bad_default(x: object = object()) -> None: ...

    with pytest.raises(ConfigurationError, match="unknown tool\\(s\\) nope; registered: .*lookup_price"):
        tool_specs(["nope"])
    assert tool_plugins.PRICES  # the plugin module is what registered the tools


@pytest.mark.slow  # long end to end (issue 34: the default run near 13 min); CI runs it
@pytest.mark.chaos
async def test_a_worker_killed_between_tool_calls_repeats_neither(
    client, scripted, worker_processes, tmp_path: Path, monkeypatch
) -> None:
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("DRLM_TEST_TOOL_LOG", str(log))
    monkeypatch.setenv("DRLM_TOOL_MODULES", "tests.tool_plugins")
    turns = [
        "```repl\np = lookup_price('widget')\n```",
        Reply(text="```repl\nusd = convert(p, currency='GBP')\n```", delay_s=3),
        "FINAL_VAR(usd)",
    ]
    server = scripted(root_and_sub(turns))
    first = worker_processes()
    episode_id = f"tools-crash-{uuid.uuid4().hex[:6]}"
    handle = await start_episode(
        client, request_for(server, tools=tool_specs(TOOLS)), worker_processes.queue, episode_id
    )
    while not any(r.turn == 1 for r in server.root_requests()):
        await asyncio.sleep(0.05)
    first.kill()  # after the first tool call, before the second
    worker_processes()
    result = await asyncio.wait_for(handle.result(), 90)

    assert result.answer == "10.62"
    calls = [json.loads(line)[0] for line in log.read_text().splitlines()]
    assert calls == ["lookup_price", "convert"]  # the rebuilt REPL got the price from the log


async def test_tool_calls_are_bounded_and_names_cannot_hide_the_repl(client, scripted, worker) -> None:
    from pydantic import ValidationError

    from durable_rlm.workflows.models import EpisodeLimits

    cell = (
        "```repl\nprint(lookup_price('widget'))\n"
        "try:\n    lookup_price('gadget')\nexcept ToolError as e:\n    print(e)\n```"
    )
    server = scripted(root_and_sub([cell, "FINAL(done)"]))
    limits = EpisodeLimits(max_iterations=3, max_tool_calls=1, cell_timeout_s=10)
    request = request_for(server, tools=tool_specs(["lookup_price"]), limits=limits)
    result = await run_episode(client, request, worker.task_queue)
    assert result.tool_calls == 1
    assert (
        "lookup_price failed: max_tool_calls (1) reached: the tool was not called"
        in server.root_requests()[1].last_user
    )
    with pytest.raises(ValidationError, match="would hide the REPL's own llm_query"):
        ToolSpec(name="llm_query")
