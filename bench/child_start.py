"""What a child episode (rlm_query) costs over a plain sub-call, on the embedded dev server.

    python bench/child_start.py [--children N] [--repeats R]

Three episodes, each one cell, the scripted model on 127.0.0.1 (no think time):

- plain:      N sequential `llm_query` calls (one activity each). The baseline.
- sequential: N sequential `rlm_query` calls; each child answers in its first turn
              (one root call, no cell), so a child costs one model call, as a sub-call does.
- batched:    one `rlm_query_batched` of N prompts: the children run in parallel.

Printed: wall time per call of each, the extra time a child costs over a sub-call, and,
read from the histories, the time from the parent starting a child to the child's first
model call being scheduled (the "time to start a child").
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from temporalio.api.enums.v1 import EventType  # noqa: E402
from temporalio.client import Client  # noqa: E402

from durable_rlm.scripted import ChatRequest, Reply, ScriptedModelServer  # noqa: E402
from durable_rlm.settings import Settings  # noqa: E402
from durable_rlm.store.blobs import BlobStore, SqlBackend  # noqa: E402
from durable_rlm.store.codec import data_converter  # noqa: E402
from durable_rlm.store.sql import open_store  # noqa: E402
from durable_rlm.worker.runtime import EmbeddedServer, Services, running_workers  # noqa: E402
from durable_rlm.workflows import names  # noqa: E402
from durable_rlm.workflows.models import EpisodeLimits, EpisodeRequest, EpisodeResult, ModelSettings  # noqa: E402

CELLS = {
    "plain": "```repl\nfor i in range({n}):\n    llm_query(f'q{{i}}')\n```",
    "sequential": "```repl\nfor i in range({n}):\n    rlm_query(f'q{{i}}', model='child')\n```",
    "batched": "```repl\nrlm_query_batched([f'q{{i}}' for i in range({n})], model='child')\n```",
}


def script(cell: str) -> object:
    def answer(request: ChatRequest) -> Reply | str:
        if request.is_root and request.model == "child":
            return "FINAL(ok)"
        if request.is_root:
            return cell if request.turn == 0 else "FINAL(done)"
        return "ok"

    return answer


async def run(client: Client, kind: str, children: int) -> tuple[float, list[float]]:
    """Wall time of the episode's one cell, and each child's start-to-first-call time."""
    with ScriptedModelServer(script(CELLS[kind].format(n=children))) as server:
        model = ModelSettings(model="root", base_url=server.base_url)
        request = EpisodeRequest(
            task="bench",
            root_model=model,
            other_models=[model.model_copy(update={"model": "child"})],
            max_depth=2,
            limits=EpisodeLimits(max_children_per_batch=max(children, 1), max_llm_calls=10 * children + 10),
        )
        episode_id = f"bench-{kind}-{uuid.uuid4().hex[:6]}"
        handle = await client.start_workflow(
            names.WORKFLOW, request, id=episode_id, task_queue="bench", result_type=EpisodeResult
        )
        result = await handle.result()
        assert result.answer == "done", result
        roots = [r for r in server.requests if r.is_root and r.model == "root"]
        wall = roots[1].received_at - roots[0].received_at
        starts = await child_start_times(client, episode_id, children if kind != "plain" else 0)
        return wall, starts


async def child_start_times(client: Client, episode_id: str, children: int) -> list[float]:
    history = await client.get_workflow_handle(episode_id).fetch_history()
    initiated = {
        e.start_child_workflow_execution_initiated_event_attributes.workflow_id: e.event_time.ToDatetime()
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED
    }
    times = []
    for child_id, started in initiated.items():
        child = await client.get_workflow_handle(child_id).fetch_history()
        first = next(
            e.event_time.ToDatetime()
            for e in child.events
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
            and e.activity_task_scheduled_event_attributes.activity_type.name == names.ROOT_COMPLETION
        )
        times.append((first - started).total_seconds())
    assert len(times) == children
    return times


async def main(children: int, repeats: int) -> None:
    with tempfile.TemporaryDirectory(prefix="drlm-bench-") as tmp:
        work = Path(tmp)
        engine = open_store(f"sqlite:///{work / 'drlm.sqlite'}")
        blobs = BlobStore(SqlBackend(engine))
        async with EmbeddedServer(work / "temporal.sqlite") as address:
            client = await Client.connect(address, data_converter=data_converter(blobs))
            settings = Settings(task_queue="bench", data_dir=work)
            async with running_workers(Services(settings, blobs, engine, client)):
                await run(client, "plain", 1)  # warm up the sandbox and the model client
                walls: dict[str, list[float]] = {kind: [] for kind in CELLS}
                starts: list[float] = []
                for _ in range(repeats):
                    for kind in CELLS:
                        wall, child_starts = await run(client, kind, children)
                        walls[kind].append(wall)
                        starts += child_starts
    per_call = {kind: statistics.median(values) / children for kind, values in walls.items()}
    print(f"{children} calls per episode, median of {repeats} run(s); 0 ms model")
    for kind, seconds in per_call.items():
        print(f"  {kind:<11} {seconds * 1000:8.1f} ms per call")
    extra = per_call["sequential"] - per_call["plain"]
    print(
        f"  a child costs {extra * 1000:.1f} ms more than a sub-call "
        f"(ratio sequential/plain: {per_call['sequential'] / per_call['plain']:.2f}x)"
    )
    print(f"  batched/sequential: {per_call['batched'] / per_call['sequential']:.2f}x")
    print(
        f"  time to start a child (parent starts it -> its first model call scheduled): median "
        f"{statistics.median(starts) * 1000:.0f} ms, max {max(starts) * 1000:.0f} ms over {len(starts)}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--children", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(main(args.children, args.repeats))
    sys.stdout.flush()
    os._exit(0)
