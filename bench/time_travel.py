"""What a fork and a rerun cost, against the source that made them, on the embedded dev
server with a scripted model on 127.0.0.1 (0 ms think time, so the figures are the
runtime's own).

    python bench/time_travel.py [--iterations 10,40,160] [--think-ms 0]

For each source length N (N iterations, a cell each, one `llm_query` every 4th):

- source:  the episode itself, N+1 model calls and N cells. The baseline.
- history: fetching the source's history (what any reader pays).
- locate:  `fork_point(source, N)`: the history replayed through the workflow code to the
           state after iteration N (what `drlm fork` pays before it starts anything).
- fork:    a fork at N whose model answers at once: the REPL rebuilt from the cell log
           (N cells re-run, the sub-calls answered from the log), one model call.
- rerun:   `drlm rerun` of the source: N+1 calls answered from the recording.

Printed: milliseconds of each, the ratios locate/history and fork/source, and how many
model calls each made (a fork makes 1 where the source made N+1+N/4).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


from benchlib import bench_env  # noqa: E402

from durable_rlm.scripted import ChatRequest, Reply, ScriptedModelServer  # noqa: E402
from durable_rlm.settings import Settings  # noqa: E402
from durable_rlm.timetravel.fork import fork_episode, fork_point  # noqa: E402
from durable_rlm.timetravel.rerun import rerun_episodes  # noqa: E402
from durable_rlm.worker.runtime import Services, running_workers  # noqa: E402
from durable_rlm.workflows import names  # noqa: E402
from durable_rlm.workflows.models import EpisodeLimits, EpisodeRequest, EpisodeResult, ModelSettings  # noqa: E402


def source_script(iterations: int, think_s: float) -> object:
    def answer(request: ChatRequest) -> Reply | str:
        if not request.is_root:
            return Reply(text="half", delay_s=think_s)
        turn = request.turn
        if turn >= iterations:
            return Reply(text="FINAL_VAR(total)", delay_s=think_s)
        call = "\nnote = llm_query(f'about {total}')" if turn % 4 == 3 else ""
        cell = f"```repl\ntotal = globals().get('total', 0) + {turn + 1}{call}\nprint(total)\n```"
        return Reply(text=cell, delay_s=think_s)

    return answer


async def measure(services: Services, iterations: int, think_s: float) -> dict[str, float]:
    client, settings = services.client, services.settings
    figures: dict[str, float] = {}
    with ScriptedModelServer(source_script(iterations, think_s)) as server:
        request = EpisodeRequest(
            task="bench",
            root_model=ModelSettings(model="source", base_url=server.base_url),
            limits=EpisodeLimits(max_iterations=iterations + 5, max_llm_calls=iterations + 5),
        )
        source_id = f"tt-{iterations}-{uuid.uuid4().hex[:6]}"
        start = time.perf_counter()
        handle = await client.start_workflow(
            names.WORKFLOW, request, id=source_id, task_queue="bench", result_type=EpisodeResult
        )
        result = await handle.result()
        figures["source"] = time.perf_counter() - start
        figures["source calls"] = len(server.requests)
        expected = str(iterations * (iterations + 1) // 2)
        assert result.answer == expected, result

        start = time.perf_counter()
        await handle.fetch_history()
        figures["history"] = time.perf_counter() - start
        start = time.perf_counter()
        point = await fork_point(client, source_id, iterations)
        figures["locate"] = time.perf_counter() - start
        assert point.state.iteration == iterations

    with ScriptedModelServer(lambda request: Reply(text="FINAL_VAR(total)", delay_s=think_s)) as other:
        start = time.perf_counter()
        fork, _ = await fork_episode(
            client, "bench", source_id, iterations, model="m", base_url=other.base_url, settings=settings
        )
        forked = await fork.result()
        figures["fork"] = time.perf_counter() - start
        figures["fork calls"] = len(other.requests)
        assert forked.answer == expected, forked

    start = time.perf_counter()
    (report,) = await rerun_episodes(services, [source_id])
    figures["rerun"] = time.perf_counter() - start
    assert report.verdict == "same", report
    return figures


async def main(lengths: list[int], think_ms: float) -> None:
    with tempfile.TemporaryDirectory(prefix="drlm-bench-") as tmp:
        async with bench_env(Path(tmp)) as env:
            settings = Settings(task_queue="bench", data_dir=env.directory)
            services = Services(settings, env.blobs, env.engine, env.client)
            async with running_workers(services):
                await measure(services, 2, 0.0)  # warm up the sandbox and the model client
                rows = [(n, await measure(services, n, think_ms / 1000)) for n in lengths]
    print(f"model think time {think_ms:.0f} ms; milliseconds (model calls)")
    print(
        f"{'N':>5}{'source':>16}{'history':>10}{'locate':>10}{'fork':>14}{'rerun':>10}"
        f"{'locate/history':>16}{'fork/source':>13}"
    )
    for n, f in rows:
        print(
            f"{n:>5}{f['source'] * 1000:>10.0f} ({f['source calls']:>3.0f}){f['history'] * 1000:>10.0f}"
            f"{f['locate'] * 1000:>10.0f}{f['fork'] * 1000:>10.0f} ({f['fork calls']:.0f})"
            f"{f['rerun'] * 1000:>10.0f}"
            f"{f['locate'] / f['history']:>15.1f}x{f['fork'] / f['source']:>12.2f}x"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", default="10,40,160", help="source lengths, comma-separated")
    parser.add_argument(
        "--think-ms", type=float, default=0.0, help="the scripted model's think time per call"
    )
    args = parser.parse_args()
    asyncio.run(main([int(n) for n in args.iterations.split(",")], args.think_ms))
    sys.stdout.flush()
    os._exit(0)  # temporalio can crash at interpreter exit (sdk-python#300)
