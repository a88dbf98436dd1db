"""Record episode histories for the replay tests: `python -m tests.histories.record [NAME ...]`.

Keep old histories: they prove that today's workflow code replays what yesterday's wrote.

Recorded with the plain pydantic converter (no claim check) and small payloads, so the
histories replay without the blob store. Re-record only for a deliberate, patched change.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import threading
from pathlib import Path

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from durable_rlm.blobs import BlobStore, SqlBackend
from durable_rlm.episodes import store_context
from durable_rlm.runtime import EmbeddedServer, Services, running_workers
from durable_rlm.scripted import ScriptedModelServer, root_and_sub
from durable_rlm.settings import Settings
from durable_rlm.store import open_store
from workflows import names
from workflows.models import (
    EpisodeLimits,
    EpisodeRequest,
    EpisodeResult,
    ModelSettings,
    RewardSpec,
    RewardUpdate,
    TerminationSpec,
)

HERE = Path(__file__).resolve().parent

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
}


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
    """A limit reached before any answer: fallback extraction (seed 004)."""
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
            if not only or "reward_driven" in only:
                await record_reward_driven(client, blobs)
            if not only or "fallback_extracted" in only:
                await record_fallback_extracted(client, blobs)


if __name__ == "__main__":
    asyncio.run(record(set(sys.argv[1:])))
    sys.stdout.flush()
    os._exit(0)
