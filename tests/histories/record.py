"""Record episode histories for the replay tests: `python -m tests.histories.record`.

Recorded with the plain pydantic converter (no claim check) and small payloads, so the
histories replay without the blob store. Re-record only for a deliberate, patched change.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
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
from workflows.models import EpisodeRequest, EpisodeResult, ModelSettings

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


async def record() -> None:
    work = Path(tempfile.mkdtemp(prefix="drlm-record-"))
    engine = open_store(f"sqlite:///{work / 'drlm.sqlite'}")
    blobs = BlobStore(SqlBackend(engine))
    async with EmbeddedServer(work / "temporal.sqlite") as address:
        client = await Client.connect(address, data_converter=pydantic_data_converter)
        settings = Settings(task_queue="record", data_dir=work)
        async with running_workers(Services(settings, blobs, engine, client)):
            for name, (turns, context) in SCRIPTS.items():
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


if __name__ == "__main__":
    asyncio.run(record())
    sys.stdout.flush()
    os._exit(0)
