"""Record episode histories for the replay tests: `python -m tests.histories.record [NAME ...]`.

Keep the histories of released code: they prove that today's workflow code replays what the
released code wrote (docs: "Versioning"). Before a release, a change to workflow code
re-records them; after one, such a change goes behind a patch or a new workflow version and
the old histories stay beside new ones.

Recorded with the plain pydantic converter (no claim check) and small payloads, so the
histories replay without the blob store.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

from temporalio.api.enums.v1 import EventType, PendingActivityState
from temporalio.client import Client, WorkflowHandle, WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.runtime import Runtime, TelemetryConfig
from temporalio.worker import Worker

from durable_rlm.activities.audit import AuditActivities
from durable_rlm.activities.llm import ModelActivities
from durable_rlm.client.episodes import store_context
from durable_rlm.scripted import ScriptedModelServer, root_and_sub
from durable_rlm.settings import Settings
from durable_rlm.store.blobs import BlobStore, SqlBackend
from durable_rlm.store.sql import open_store
from durable_rlm.worker.runtime import EmbeddedServer, Services, running_workers
from durable_rlm.workflows import names
from durable_rlm.workflows.models import (
    CancelReceipt,
    CancelRequest,
    DspyPrompts,
    EpisodeLimits,
    EpisodeRequest,
    EpisodeResult,
    Message,
    ModelPrice,
    ModelSettings,
    PromptTemplate,
    RewardSpec,
    RewardUpdate,
    TerminationSpec,
)
from durable_rlm.workflows.typed_outputs import FieldSpec

HERE = Path(__file__).resolve().parent
EXTRACT_INSTRUCTIONS = "Based on the REPL trajectory, extract the final outputs"


def wanted(name: str, only: set[str]) -> bool:
    """Record `name`: every history when none is named, else the named ones."""
    return not only or name in only


SCRIPTS = {
    "multi_iteration_final_var": (
        [
            "Look first.\n```repl\nwords = context.split()\nprint(len(words))\n```",
            "```repl\nfirst = llm_query('w: ' + words[0])\nrest = llm_query_batched(words[1:])\n"
            "result = first + '|' + ','.join(rest)\n```",
            "```repl\nx = 1 / 0\n```",
            "No code this time.",
            "FINAL_VAR(result)",
        ],
        "alpha beta gamma",
    ),
    # The answer format: FINAL("hello") answers "hello", quotes included (final-as-written patch).
    "final_as_written": (["```repl\nx = 1\n```", 'FINAL("hello")'], "a context"),
}


async def save_history(client: Client, name: str, request: EpisodeRequest) -> EpisodeResult:
    """Run `request` as episode `name` on the recording queue and store its history."""
    handle = await client.start_workflow(
        names.WORKFLOW, request, id=name, task_queue="record", result_type=EpisodeResult
    )
    result = await handle.result()
    print(name, result)
    (HERE / f"{name}.json").write_text((await handle.fetch_history()).to_json())
    return result


async def record_reward_driven(client: Client, blobs: BlobStore) -> None:
    """reward_threshold decided by updates that arrive while the episode runs."""
    gates = [threading.Event() for _ in range(3)]

    def gated(request):
        if request.is_root:
            gates[min(request.turn, 2)].wait(30)
        return "```repl\nprint('working')\n```"

    with ScriptedModelServer(gated) as server:
        request = EpisodeRequest(
            task="record a reward-driven history",
            root_model=ModelSettings(model="scripted", base_url=server.base_url),
            termination=TerminationSpec(name="reward_threshold"),
            reward=RewardSpec(function="outcome"),
            seed=1,
        )
        handle = await client.start_workflow(
            names.WORKFLOW, request, id="reward_driven", task_queue="record", result_type=EpisodeResult
        )
        for turn, value in [(0, 0.3), (1, 0.35)]:
            while not any(r.turn == turn for r in server.root_requests()):
                await asyncio.sleep(0.05)
            await handle.execute_update("reward", RewardUpdate(value=value, note="recorder"))
            gates[turn].set()
        print("reward_driven", await handle.result())
        (HERE / "reward_driven.json").write_text((await handle.fetch_history()).to_json())


async def record_fallback_extracted(client: Client, blobs: BlobStore) -> None:
    """A limit reached before any answer: fallback extraction
    (docs/behaviour/fallback-extraction.md)."""
    script = root_and_sub(["```repl\nx = 41 + 1\n```"], extract=lambda p: '{"answer": "42"}')
    with ScriptedModelServer(script) as server:
        request = EpisodeRequest(
            task="record an extracted episode",
            root_model=ModelSettings(model="scripted", base_url=server.base_url),
            limits=EpisodeLimits(max_iterations=2),
            seed=1,
        )
        handle = await client.start_workflow(
            names.WORKFLOW, request, id="fallback_extracted", task_queue="record", result_type=EpisodeResult
        )
        print("fallback_extracted", await handle.result())
        (HERE / "fallback_extracted.json").write_text((await handle.fetch_history()).to_json())


async def record_new_kinds(client: Client, blobs: BlobStore, work: Path, only: set[str]) -> None:
    """Episodes of kinds that came with the honest-endings patch."""

    async def save(
        name: str,
        request: EpisodeRequest,
        queue: str = "record",
        cancel_after_turn: int | None = None,
        server: ScriptedModelServer | None = None,
    ) -> None:
        handle = await client.start_workflow(
            names.WORKFLOW, request, id=name, task_queue=queue, result_type=EpisodeResult
        )
        if cancel_after_turn is not None:
            assert server is not None
            while not any(r.turn >= cancel_after_turn for r in server.root_requests()):
                await asyncio.sleep(0.05)
            await handle.cancel()
        try:
            print(name, await handle.result())
        except Exception as exc:  # noqa: BLE001 - the cancelled one ends without a result
            print(name, type(exc).__name__, exc)
        (HERE / f"{name}.json").write_text((await handle.fetch_history()).to_json())

    model = lambda server: ModelSettings(model="scripted", base_url=server.base_url)  # noqa: E731
    if wanted("answer_from_a_cell", only):
        turns = [
            "```repl\nprint('See the Final (revised) report.')\n```",
            "```repl\nres = sum(range(10))\nFINAL(res)\n```",
        ]
        with ScriptedModelServer(root_and_sub(turns)) as server:
            await save("answer_from_a_cell", EpisodeRequest(task="t", root_model=model(server), seed=1))
    if wanted("policy_stopped", only):
        with ScriptedModelServer(root_and_sub(["```repl\n1/0\n```"])) as server:
            request = EpisodeRequest(
                task="t",
                root_model=model(server),
                termination=TerminationSpec(name="reward_threshold"),
                reward=RewardSpec(function="outcome"),
                seed=1,
            )
            await save("policy_stopped", request)
    if wanted("compacted", only):
        counter = iter(range(100))
        turns = ["```repl\nprint('z' * 3000)\n```"] * 4 + ["FINAL(compacted)"]

        def script(request):
            if request.is_compaction:
                return "summary"
            return turns[min(next(counter), len(turns) - 1)]

        with ScriptedModelServer(script, context_window_tokens=4_000) as server:
            request = EpisodeRequest(
                task="t",
                root_model=model(server).model_copy(update={"max_tokens": 200}),
                limits=EpisodeLimits(context_window_tokens=4_000),
                seed=1,
            )
            await save("compacted", request)
    if wanted("lost_cells", only):
        # A worker whose sandboxes cannot start: every REPL step fails; the cells are lost and
        # the episode goes on to the model's answer.
        settings = Settings(task_queue="record-broken", data_dir=work, sandbox_memory_mb=2**44)
        turns = ["```repl\nx = 1\n```", "FINAL(no REPL today)"]
        with ScriptedModelServer(root_and_sub(turns)) as server:
            async with running_workers(Services(settings, blobs, None, client)):
                await save(
                    "lost_cells", EpisodeRequest(task="t", root_model=model(server), seed=1), "record-broken"
                )
    if wanted("cancelled", only):
        gate = threading.Event()

        def blocks(request):
            if request.is_root and request.turn >= 1:
                gate.wait(30)
            return "```repl\nprint('working')\n```"

        with ScriptedModelServer(blocks) as server:
            request = EpisodeRequest(task="t", root_model=model(server), seed=1)
            await save("cancelled", request, cancel_after_turn=1, server=server)
            gate.set()


async def record_trees(client: Client, only: set[str]) -> None:
    """Episodes with child episodes (rlm_query): a finished tree, and a tree cancelled with
    extraction while its children ran. Each child's own history is kept too."""
    from durable_rlm.client.episodes import cancel_episode

    def by_model(turns: dict[str, list[str]]):
        def script(request):
            if request.is_extraction:
                return '{"answer": "found so far"}'
            if not request.is_root:
                return request.last_user.upper()
            if request.model == "slow-child" and request.turn >= 0:
                time.sleep(1.5)
            options = turns[request.model]
            return options[min(request.turn, len(options) - 1)]

        return script

    async def save_tree(name: str, request: EpisodeRequest, cancel: bool = False) -> None:
        handle = await client.start_workflow(
            names.WORKFLOW, request, id=name, task_queue="record", result_type=EpisodeResult
        )
        if cancel:
            while True:
                children = [c async for c in client.list_workflows(f'WorkflowId STARTS_WITH "{name}/"')]
                if len(children) == 2:
                    break
                await asyncio.sleep(0.1)
            await cancel_episode(client, name, extract=True, reason="recorded cancel")
        print(name, await handle.result())
        (HERE / f"{name}.json").write_text((await handle.fetch_history()).to_json())
        child = client.get_workflow_handle(f"{name}/1.0")
        (HERE / f"{name}_child.json").write_text((await child.fetch_history()).to_json())

    turns = {
        "root": [
            "```repl\nparts = rlm_query_batched(['1,2', '3,4'], model='child')\n"
            "plain = llm_query('hello')\nprint(parts, plain)\n```",
            "```repl\nFINAL(sum(int(p) for p in parts))\n```",
        ],
        "child": ["```repl\nt = sum(int(x) for x in context.split(','))\n```", "FINAL_VAR(t)"],
        "slow-child": ["```repl\nt = 0\n```"],
    }
    with ScriptedModelServer(by_model(turns)) as server:

        def model(name: str) -> ModelSettings:
            return ModelSettings(model=name, base_url=server.base_url)

        base = EpisodeRequest(
            task="t",
            root_model=model("root"),
            other_models=[model("child"), model("slow-child")],
            max_depth=2,
            limits=EpisodeLimits(max_model_calls=30),
            seed=1,
        )
        if wanted("children", only):
            await save_tree("children", base)
        if wanted("cancelled_tree", only):
            slow = {**turns, "root": [turns["root"][0].replace("'child'", "'slow-child'")]}
            server.script = by_model(slow)
            await save_tree("cancelled_tree", base, cancel=True)


async def record_tools(client: Client, only: set[str]) -> None:
    """An episode whose cell calls two custom tools (one sync, one async) and one that fails."""
    if not wanted("tools", only):
        return
    from durable_rlm.tools import tool_specs
    from tests import tool_plugins  # noqa: F401 - registers the tools

    turns = [
        "```repl\np = lookup_price('widget')\nusd = convert(p)\ntry:\n    broken(1)\n"
        "except ToolError as e:\n    print(e)\n```",
        "FINAL_VAR(usd)",
    ]
    with ScriptedModelServer(root_and_sub(turns)) as server:
        request = EpisodeRequest(
            task="t",
            root_model=ModelSettings(model="scripted", base_url=server.base_url),
            tools=tool_specs(["lookup_price", "convert", "broken"]),
            seed=1,
        )
        handle = await client.start_workflow(
            names.WORKFLOW, request, id="tools", task_queue="record", result_type=EpisodeResult
        )
        print("tools", await handle.result())
        (HERE / "tools.json").write_text((await handle.fetch_history()).to_json())


async def record_local_steps(client: Client, blobs: BlobStore, work: Path, only: set[str]) -> None:
    """Episodes whose REPL steps are local activities (markers in history, not activity
    events): one with calls, an error and a FINAL_VAR read; one whose cells are lost."""
    model = lambda server: ModelSettings(model="scripted", base_url=server.base_url)  # noqa: E731

    async def save(name: str, request: EpisodeRequest, queue: str) -> None:
        handle = await client.start_workflow(
            names.WORKFLOW, request, id=name, task_queue=queue, result_type=EpisodeResult
        )
        print(name, await handle.result())
        (HERE / f"{name}.json").write_text((await handle.fetch_history()).to_json())

    if wanted("local_steps", only):
        turns, context = SCRIPTS["multi_iteration_final_var"]
        with ScriptedModelServer(root_and_sub(turns, str.upper)) as server:
            request = EpisodeRequest(
                task="record a history",
                context=store_context(blobs, context),
                root_model=model(server),
                seed=1,
            )
            await save("local_steps", request, "record")
    if wanted("local_lost", only):
        settings = Settings(task_queue="record-broken", data_dir=work, sandbox_memory_mb=2**44)
        turns = ["```repl\nx = 1\n```", "FINAL(no REPL today)"]
        with ScriptedModelServer(root_and_sub(turns)) as server:
            async with running_workers(Services(settings, blobs, None, client)):
                request = EpisodeRequest(task="t", root_model=model(server), seed=1)
                await save("local_lost", request, "record-broken")


async def record_snapshots(client: Client, blobs: BlobStore, only: set[str]) -> None:
    """REPL snapshots: a cell that reads the clock (snapshotted after it), one that binds a
    value no snapshot can hold, and a FINAL_VAR read."""
    if not wanted("snapshots", only):
        return
    turns = [
        "```repl\nimport time\nstamp = time.time()\nsquares = (i * i for i in range(3))\n```",
        "```repl\nresult = llm_query('shout') + str(next(squares))\n```",
        "FINAL_VAR(result)",
    ]
    with ScriptedModelServer(root_and_sub(turns, str.upper)) as server:
        request = EpisodeRequest(
            task="record a history",
            root_model=ModelSettings(model="scripted", base_url=server.base_url),
            seed=1,
        )
        await save_history(client, "snapshots", request)


async def record_budgets(client: Client, only: set[str]) -> None:
    """A priced model under max_cost_usd: the loop ends while an extraction can still be paid
    (patch budget-reserve), with a reward received on the way (the audit's events)."""
    if not wanted("cost_budget", only):
        return
    script = root_and_sub(["```repl\nx = 1\n```"], extract=lambda p: '{"answer": "1"}')
    with ScriptedModelServer(script) as server:
        price = ModelPrice(input_usd_per_mtok=100.0, output_usd_per_mtok=200.0)
        request = EpisodeRequest(
            task="record a history",
            root_model=ModelSettings(model="scripted", base_url=server.base_url, max_tokens=50, price=price),
            limits=EpisodeLimits(max_iterations=8, max_cost_usd=0.2),
            seed=1,
        )
        handle = await client.start_workflow(
            names.WORKFLOW, request, id="cost_budget", task_queue="record", result_type=EpisodeResult
        )
        await handle.execute_update("reward", RewardUpdate(value=0.5, note="on the way"))
        result = await handle.result()
        assert result.ended_by == "max_cost_usd" and result.answer_source == "extraction", result
        print("cost_budget", result)
        (HERE / "cost_budget.json").write_text((await handle.fetch_history()).to_json())


async def record_rlms_compat(client: Client, only: set[str]) -> None:
    """The rlms-compatibility patches: a 2,500-token budget that makes its root calls and extracts
    (budget-fits), and rlms's setup_code as the REPL's first cell (setup-code)."""
    if wanted("token_budget_fits", only):
        script = root_and_sub(["```repl\nprint('looking')\n```"], extract=lambda p: '{"answer": "1"}')
        with ScriptedModelServer(script) as server:
            request = EpisodeRequest(
                task="record a history",
                root_model=ModelSettings(model="scripted", base_url=server.base_url),
                limits=EpisodeLimits(max_iterations=8, max_tokens=2_500),
                seed=1,
            )
            result = await save_history(client, "token_budget_fits", request)
            assert result.ended_by == "max_tokens" and result.answer_source == "extraction", result
    if wanted("setup_code", only):
        script = root_and_sub(
            [
                "```repl\nprint(base)\n```",
                "```repl\nanswer['content'] = base + 1\nanswer['ready'] = True\n```",
            ]
        )
        with ScriptedModelServer(script) as server:
            request = EpisodeRequest(
                task="record a history",
                root_model=ModelSettings(model="scripted", base_url=server.base_url),
                setup_code="base = 41",
                seed=1,
            )
            result = await save_history(client, "setup_code", request)
            assert result.answer == "42", result


async def record_dspy(client: Client, blobs: BlobStore, only: set[str]) -> None:
    """A DSPy program's episodes (durable_rlm.dspy.RLM): its prompts, one cell per reply from
    the `code` field, SUBMIT (dspy_submitted) and DSPy's extract at its limit (dspy_extracted)."""

    def reply(reasoning: str, code: str) -> str:
        fenced = f"```python\n{code}\n```"
        return f"[[ ## reasoning ## ]]\n{reasoning}\n\n[[ ## code ## ]]\n{fenced}\n\n[[ ## completed ## ]]"

    def template(*parts: str) -> PromptTemplate:
        return PromptTemplate(parts=list(parts), holes=["history", "iteration"][: len(parts) - 1])

    prompts = DspyPrompts(
        action=[Message(role="system", content="Produce `total` from `numbers`; SUBMIT(total).")],
        action_user=template("[[ ## repl_history ## ]]\n", "\n\n[[ ## iteration ## ]]\n", "\n"),
        extract=[
            Message(role="system", content="Based on the REPL trajectory, extract the final outputs now.")
        ],
        extract_user=template("[[ ## repl_history ## ]]\n", "\n"),
        max_output_chars=100,
        inputs=["numbers"],
    )
    steps = [
        reply("Add them.", "total = sum(numbers)\nprint(llm_query(str(total)))"),
        reply("Done.", "SUBMIT(total)"),
    ]

    def dspy_script(request: Any) -> str:
        system = request.messages[0]["content"] if request.is_root else ""
        if system.startswith(EXTRACT_INSTRUCTIONS):
            return "[[ ## total ## ]]\n6\n\n[[ ## completed ## ]]"
        if request.is_root:  # DSPy's prompt names the iteration: "[[ ## iteration ## ]]\n2/5"
            return steps[0] if "\n1/" in request.last_user else steps[1]
        return request.last_user.upper()

    for name, limit in (("dspy_submitted", 5), ("dspy_extracted", 1)):
        if not wanted(name, only):
            continue
        with ScriptedModelServer(dspy_script) as server:
            request = EpisodeRequest(
                task="DSPy RLM: numbers -> total",
                context=store_context(blobs, {"numbers": [1, 2, 3]}),
                root_model=ModelSettings(model="scripted", base_url=server.base_url),
                limits=EpisodeLimits(max_iterations=limit, max_cells_per_reply=1),
                output_fields=[FieldSpec(name="total", type="integer", json_schema={"type": "integer"})],
                dspy=prompts,
                seed=1,
            )
            result = await save_history(client, name, request)
            assert result.execution is not None and result.execution.outputs() in (
                {"total": 6},
                {"total": "6"},
            ), result


async def record_audit_aside(client: Client, only: set[str]) -> None:
    """The opening audit written beside the loop, the closing one bounded (audit-aside)."""
    if not wanted("audit_aside", only):
        return
    turns = ["```repl\nx = llm_query('shout')\n```", "FINAL_VAR(x)"]
    with ScriptedModelServer(root_and_sub(turns, str.upper)) as server:
        request = EpisodeRequest(
            task="record a history",
            root_model=ModelSettings(model="scripted", base_url=server.base_url),
            seed=1,
        )
        await save_history(client, "audit_aside", request)


async def record_steering(client: Client, only: set[str]) -> None:
    """Every steering action on one episode: approve, hint, edit, reject, pause, resume
    (holding the clock), a change of limits, and answer now."""
    if not wanted("steering", only):
        return
    from durable_rlm.client import steering

    turns = [
        "```repl\nx = 41\n```",
        "```repl\nprint(x + 1)\n```",
        "```repl\nimport subprocess\n```",
        "```repl\nprint(x)\n```",
        "Thinking.",
    ]
    extract = '{"answer": "82", "_extraction_notes": "from the history"}'
    with ScriptedModelServer(root_and_sub(turns, str.upper, lambda prompt: extract)) as server:
        request = EpisodeRequest(
            task="record a history",
            root_model=ModelSettings(model="scripted", base_url=server.base_url),
            seed=1,
            approve="all",
        )
        handle = await client.start_workflow(
            names.WORKFLOW, request, id="steering", task_queue="record", result_type=EpisodeResult
        )

        async def waiting(cell: int) -> None:
            while True:
                progress = await steering.progress_of(client, "steering")
                if progress.pending_cell is not None and progress.pending_cell.cell == cell:
                    return
                await asyncio.sleep(0.1)

        await waiting(1)
        await steering.decide_cell(client, "steering#1", True, "bob")
        await steering.send_hint(client, "steering", "x is the answer minus one", "alice")
        await waiting(2)
        await steering.decide_cell(client, "steering#2", True, "bob", code="print(x * 2)")
        await waiting(3)
        await steering.decide_cell(client, "steering#3", False, "carol", reason="no processes")
        await waiting(4)
        await steering.pause_episode(client, "steering", "eve", hold_clock=True, reason="lunch")
        while (await steering.progress_of(client, "steering")).held is None:
            await asyncio.sleep(0.1)
        await steering.resume_episode(client, "steering", "eve")
        await steering.change_limits(client, "steering", "eve", max_iterations=20)
        await steering.decide_cell(client, "steering#4", True, "bob")
        while len(server.root_requests()) < 5:
            await asyncio.sleep(0.05)
        await steering.finish_episode(client, "steering", "dave", "enough")
        print("steering", await handle.result())
        (HERE / "steering.json").write_text((await handle.fetch_history()).to_json())


async def record_fork(client: Client, only: set[str]) -> None:
    """A fork: a source's state after iteration 2 (a sub-call's answer in its cell log),
    continued by another model whose first cell needs the REPL rebuilt."""
    if not wanted("fork", only):
        return
    from durable_rlm.timetravel.fork import fork_episode

    source_turns = [
        "```repl\nx = 6\n```",
        "```repl\ny = llm_query('shout')\n```",
        "FINAL_VAR(y)",
    ]
    fork_turns = ["-", "-", "```repl\nz = f'{x} {y}'\n```", "FINAL_VAR(z)"]
    with (
        ScriptedModelServer(root_and_sub(source_turns, str.upper)) as server,
        ScriptedModelServer(root_and_sub(fork_turns, str.upper)) as other,
    ):
        request = EpisodeRequest(
            task="record a history",
            root_model=ModelSettings(model="scripted", base_url=server.base_url),
            seed=1,
        )
        await save_history(client, "fork_source", request)
        handle, _ = await fork_episode(
            client, "record", "fork_source", 2, episode_id="fork", model="other", base_url=other.base_url
        )
        print("fork", await handle.result())
        (HERE / "fork.json").write_text((await handle.fetch_history()).to_json())
    (HERE / "fork_source.json").unlink()  # an ordinary episode: histories enough hold those


async def record_sandboxes_busy(
    client: Client, blobs: BlobStore, engine: object, work: Path, only: set[str]
) -> None:
    """A worker with one sandbox, busy with another episode's long cell: the recorded
    episode's first step waits, runs out of wait (SandboxesBusy), and is asked again after a
    timer, without losing the cell."""
    if not wanted("sandboxes_busy", only):
        return
    settings = Settings(task_queue="record-busy", data_dir=work, max_sandboxes=1)
    busy = root_and_sub(["```repl\nimport time\ntime.sleep(3)\n```", "FINAL(done)"])
    turns = ["```repl\nx = llm_query('shout')\n```", "FINAL_VAR(x)"]
    async with running_workers(Services(settings, blobs, engine, client)) as repl:
        repl.slots.wait_s = 0.2
        with (
            ScriptedModelServer(busy) as other,
            ScriptedModelServer(root_and_sub(turns, str.upper)) as server,
        ):
            blocker = await client.start_workflow(
                names.WORKFLOW,
                EpisodeRequest(
                    task="hold the sandbox",
                    root_model=ModelSettings(model="scripted", base_url=other.base_url),
                ),
                id="sandboxes_busy_blocker",
                task_queue="record-busy",
                result_type=EpisodeResult,
            )
            await asyncio.sleep(1.0)  # its 3 s cell holds the only sandbox
            handle = await client.start_workflow(
                names.WORKFLOW,
                EpisodeRequest(
                    task="record a history",
                    root_model=ModelSettings(model="scripted", base_url=server.base_url),
                    seed=1,
                ),
                id="sandboxes_busy",
                task_queue="record-busy",
                result_type=EpisodeResult,
            )
            result = await handle.result()
            await blocker.result()
    assert result.answer == "SHOUT" and result.lost_cells == 0 and repl.slots.busy >= 1, result
    print("sandboxes_busy", result)
    (HERE / "sandboxes_busy.json").write_text((await handle.fetch_history()).to_json())


async def root_step(handle: WorkflowHandle[Any, Any], identity: str | None) -> None:
    """Until the episode's root step runs (on the worker of `identity`, if given)."""
    while True:
        pending = (await handle.describe()).raw_description.pending_activities
        if any(
            p.activity_type.name == names.ROOT_COMPLETION
            and p.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED
            and identity in (None, p.last_worker_identity)
            for p in pending
        ):
            return
        await asyncio.sleep(0.1)


async def cancel_beside_a_reply(
    client: Client,
    workers: Callable[[], AbstractAsyncContextManager[object]],
    blobs: BlobStore,
    queue: str,
    episode_id: str,
    request: EpisodeRequest,
    release: threading.Event,
) -> tuple[CancelReceipt, EpisodeResult, WorkflowHistory]:
    """The worst moment for a cancel: the root model's reply (held by `release`) is in
    history, no worker has read it, and then the cancel arrives, so a worker reads both in
    one activation (where the reply's handle absorbs the cancel). Made, not hoped for: the
    root step runs on a worker that polls activities only, while no `workers` run."""
    # A worker of its own connection: one client may not run two workers of one queue.
    other = await Client.connect(
        client.service_client.config.target_host,
        data_converter=client.data_converter,
        runtime=Runtime(telemetry=TelemetryConfig()),
    )
    steps = Worker(
        other,
        task_queue=queue,
        activities=[ModelActivities(blobs).root_completion, AuditActivities(None).audit_episode],
        identity="steps-only",
    )
    async with steps:
        async with workers():
            handle = await client.start_workflow(
                names.WORKFLOW, request, id=episode_id, task_queue=queue, result_type=EpisodeResult
            )
            await asyncio.wait_for(root_step(handle, None), 60)
        # Only `steps` polls now: the root step (retried there if it ran on the workers just
        # stopped) is the last thing that happens before the cancel.
        await asyncio.wait_for(root_step(handle, "steps-only"), 60)
        release.set()
        while not any(
            e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED
            for e in (await handle.fetch_history()).events
        ):
            await asyncio.sleep(0.1)
        cancel = asyncio.create_task(
            handle.execute_update("cancel", CancelRequest(reason="enough"), result_type=CancelReceipt)
        )
        # The update reaches the server and waits with the reply (1.5 s was once too short
        # in the full suite on 2 cores: a worker took the reply alone, the update after).
        await asyncio.sleep(3.0)
        async with workers():
            receipt = await asyncio.wait_for(cancel, 60)
            result = await asyncio.wait_for(handle.result(), 60)
    return receipt, result, await handle.fetch_history()


async def record_cancel_sticks(client: Client, blobs: BlobStore, work: Path, only: set[str]) -> None:
    """A cancel read in one activation with the root model's reply (cancel-sticks patch):
    the episode ends cancelled, and the reply's cell never runs."""
    if not wanted("cancel_sticks", only):
        return
    release = threading.Event()

    def script(request):
        if request.is_root and request.turn == 0:
            release.wait(60)
        return "```repl\nprint('working')\n```"

    settings = Settings(task_queue="record-sticky", data_dir=work)
    with ScriptedModelServer(script) as server:
        request = EpisodeRequest(
            task="record a history",
            root_model=ModelSettings(model="scripted", base_url=server.base_url),
            approve="all",
            seed=1,
        )
        receipt, result, history = await cancel_beside_a_reply(
            client,
            lambda: running_workers(Services(settings, blobs, None, client)),
            blobs,
            "record-sticky",
            "cancel_sticks",
            request,
            release,
        )
    assert result.ended_by == "cancelled", result
    print("cancel_sticks", receipt, result)
    (HERE / "cancel_sticks.json").write_text(history.to_json())


async def record_session(client: Client, blobs: BlobStore, only: set[str]) -> None:
    """A persistent session of two turns, closed: the session's history (the workflow
    SessionWorkflow) and its second turn's (an episode over the REPL the first left), in
    sessions/, apart from the episodes' histories that the other replay tests read."""
    if not wanted("session", only):
        return
    from durable_rlm.client.sessions import close_session, run_turn, setup_cell, start_session, turn_history
    from durable_rlm.workflows.session_models import SessionStart, TurnRequest

    turns = {
        0: ["```repl\nseen = [context_0]\n```", "FINAL_VAR(seen)"],
        1: ["```repl\nseen.append(context_1)\nn = len(history_0)\n```", "FINAL_VAR(seen)"],
    }

    def script(request):
        step = 1 if any("second" in str(m.get("content", "")) for m in request.messages) else 0
        return turns[step][min(request.turn, 1)]

    folder = HERE / "sessions"
    folder.mkdir(exist_ok=True)
    with ScriptedModelServer(script) as server:
        template = EpisodeRequest(
            task="template", root_model=ModelSettings(model="scripted", base_url=server.base_url), seed=1
        )
        await start_session(client, SessionStart(template=template), "record", "session")
        context = store_context(blobs, "first")
        first = TurnRequest(
            turn=0,
            task="first",
            context=context,
            setup_code=setup_cell(0, "first", True, {}),
            context_index=0,
        )
        done = await run_turn(client, "session", first)
        print("turn 0", done)
        assert done.result is not None and done.result.answer == "['first']", done
        history = turn_history(blobs, done.result.conversation)
        second = TurnRequest(
            turn=1,
            task="second",
            setup_code=setup_cell(1, "again", False, {0: history}),
            context_index=1,
            history_turns=[0],
        )
        done = await run_turn(client, "session", second)
        print("turn 1", done)
        assert done.result is not None and done.result.answer == "['first', 'again']", done
        await close_session(client, "session", "recorded")
        handle = client.get_workflow_handle("session")
        print("session", await handle.result())
        (folder / "session.json").write_text((await handle.fetch_history()).to_json())
        turn = client.get_workflow_handle(names.turn_episode_id("session", 1))
        (folder / "session_turn1.json").write_text((await turn.fetch_history()).to_json())


async def record(only: set[str]) -> None:
    work = Path(tempfile.mkdtemp(prefix="drlm-record-"))
    engine = open_store(f"sqlite:///{work / 'drlm.sqlite'}")
    blobs = BlobStore(SqlBackend(engine))
    async with EmbeddedServer(work / "temporal.sqlite") as address:
        client = await Client.connect(address, data_converter=pydantic_data_converter)
        settings = Settings(task_queue="record", data_dir=work)
        async with running_workers(Services(settings, blobs, engine, client)):
            for name, (turns, context) in SCRIPTS.items():
                if only and name not in only:
                    continue
                with ScriptedModelServer(root_and_sub(turns, str.upper)) as server:
                    request = EpisodeRequest(
                        task="record a history",
                        context=store_context(blobs, context),
                        root_model=ModelSettings(model="scripted", base_url=server.base_url),
                        seed=1,
                    )
                    handle = await client.start_workflow(
                        names.WORKFLOW, request, id=name, task_queue="record", result_type=EpisodeResult
                    )
                    print(name, await handle.result())
                    history = await handle.fetch_history()
                    (HERE / f"{name}.json").write_text(history.to_json())
            if wanted("reward_driven", only):
                await record_reward_driven(client, blobs)
            if wanted("fallback_extracted", only):
                await record_fallback_extracted(client, blobs)
            await record_new_kinds(client, blobs, work, only)
            await record_trees(client, only)
            await record_tools(client, only)
            await record_local_steps(client, blobs, work, only)
            await record_snapshots(client, blobs, only)
            await record_budgets(client, only)
            await record_rlms_compat(client, only)
            await record_dspy(client, blobs, only)
            await record_audit_aside(client, only)
            await record_steering(client, only)
            await record_fork(client, only)
            await record_session(client, blobs, only)
        await record_sandboxes_busy(client, blobs, engine, work, only)
        await record_cancel_sticks(client, blobs, work, only)


if __name__ == "__main__":
    asyncio.run(record(set(sys.argv[1:])))
    sys.stdout.flush()
    os._exit(0)
