"""Engine overhead per iteration on the embedded dev server, against a direct baseline.

    python bench/engine_overhead.py [--iterations N] [--repeats R] [--latency-ms MS]

Each iteration: one root-model call, one REPL cell making one `llm_query`. The model is the
scripted server on 127.0.0.1 (no think time unless --latency-ms), so what remains is the engine.

- durable: the episode as a Temporal workflow (embedded dev server, SQLite, claim check).
- direct:  the same activities (same model client, same sandbox, same blob store) called in
           a plain Python loop: no Temporal, no durability. The baseline.

Overhead per iteration = (wall time - model time) / iterations. The durable episodes run on
the embedded server as shipped (tuned) and, in the same run, on one with the dev server's
own defaults. `bench/overhead.py` (a section of `bench/run.py`) reuses `durable` and `direct`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from temporalio.client import Client  # noqa: E402

from durable_rlm.activities.llm import ModelActivities  # noqa: E402
from durable_rlm.activities.repl import ReplActivities  # noqa: E402
from durable_rlm.client.episodes import start_episode  # noqa: E402
from durable_rlm.scripted import Reply, ScriptedModelServer, root_and_sub  # noqa: E402
from durable_rlm.settings import Settings  # noqa: E402
from durable_rlm.store.blobs import BlobStore, SqlBackend  # noqa: E402
from durable_rlm.store.codec import data_converter  # noqa: E402
from durable_rlm.store.sql import open_store  # noqa: E402
from durable_rlm.worker.runtime import EmbeddedServer, Services, running_workers  # noqa: E402
from durable_rlm.workflows import prompts  # noqa: E402
from durable_rlm.workflows.models import (  # noqa: E402
    CallAnswer,
    DurabilitySettings,
    EpisodeLimits,
    EpisodeRequest,
    ExecuteCellInput,
    ModelSettings,
    ResumeCellInput,
    RootCompletionInput,
    SandboxRef,
    SubQueryInput,
)
from durable_rlm.workflows.parsing import find_code_blocks, parse_final_signal  # noqa: E402


def script(iterations: int, delay_s: float = 0.0) -> list[Reply]:
    """Root turns: `iterations` cells of one llm_query each, then FINAL(done); each reply
    takes `delay_s` (the model's latency)."""
    turns = [f"```repl\nv{i} = llm_query('question {i}')\nprint(len(v{i}))\n```" for i in range(iterations)]
    return [Reply(text=t, delay_s=delay_s) for t in [*turns, "FINAL(done)"]]


def sub_answer(delay_s: float = 0.0):  # noqa: ANN201 - a scripted sub-model
    return lambda prompt: Reply(text="answer to " + prompt, delay_s=delay_s)


async def durable(
    client: Client,
    task_queue: str,
    server: ScriptedModelServer,
    iterations: int,
    local_model_calls: bool = False,
) -> tuple:
    request = EpisodeRequest(
        task="benchmark",
        root_model=ModelSettings(model="scripted", base_url=server.base_url),
        limits=EpisodeLimits(max_iterations=iterations + 1, max_llm_calls=iterations + 1),
        durability=DurabilitySettings(local_model_calls=local_model_calls),
    )
    episode_id = f"bench-{uuid.uuid4().hex[:8]}"
    started = time.perf_counter()
    handle = await start_episode(client, request, task_queue, episode_id)  # as `drlm run` starts it
    result = await handle.result()
    wall = time.perf_counter() - started
    assert result.answer == "done", result
    history = await client.get_workflow_handle(episode_id).fetch_history()
    history_bytes = sum(e.ByteSize() for e in history.events)
    return wall, result.model_time_s, result.iterations, history_bytes, len(history.events)


async def direct(blobs: BlobStore, root: Path, server: ScriptedModelServer, iterations: int) -> tuple:
    """The same steps without Temporal: the baseline a durable engine is measured against."""
    models = ModelActivities(blobs)
    repl = ReplActivities(blobs, "direct", root)
    model = ModelSettings(model="scripted", base_url=server.base_url)
    episode_id = f"direct-{uuid.uuid4().hex[:8]}"
    conversation, pending = None, prompts.opening_messages("benchmark", None, "repl")
    head, model_time, cell, iteration = None, 0.0, 0, 0
    started = time.perf_counter()
    try:
        while True:
            iteration += 1
            reply = await models.root_completion(
                RootCompletionInput(
                    episode_id=episode_id,
                    iteration=iteration,
                    model=model,
                    conversation=conversation,
                    append=pending,
                )
            )
            conversation, model_time = reply.conversation, model_time + reply.model_time_s
            observations = []
            for code in find_code_blocks(reply.text):
                cell += 1
                ref = SandboxRef(
                    episode_id=episode_id,
                    context=None,
                    seed=1,
                    log_head=head,
                    cell_timeout_s=60,
                    output_truncation=20_000,
                )
                outcome = await repl.execute_cell(
                    ExecuteCellInput(sandbox=ref, iteration=iteration, cell_index=cell, code=code)
                )
                while outcome.status == "suspended":
                    answers = []
                    for r in outcome.requests:
                        sub = await models.sub_query(
                            SubQueryInput(
                                episode_id=episode_id,
                                iteration=iteration,
                                cell_index=cell,
                                call_index=r.call_index,
                                model=model,
                                prompt=r.prompt,
                            )
                        )
                        model_time += sub.model_time_s
                        answers.append(
                            CallAnswer(
                                call_index=r.call_index, prompt_digest=r.prompt_digest, ok=True, text=sub.text
                            )
                        )
                    ref = ref.model_copy(update={"log_head": outcome.log_head})
                    outcome = await repl.resume_cell(
                        ResumeCellInput(sandbox=ref, cell_index=cell, answers=answers)
                    )
                head = outcome.log_head
                observations.append(
                    prompts.observation(cell, code, outcome.stdout, outcome.stderr, outcome.error, 20_000)
                )
            signal = parse_final_signal(reply.text)
            if signal is not None:
                assert signal.value == "done"
                break
            pending = [prompts.next_turn(observations)]
    finally:
        await repl.close_all()
    return time.perf_counter() - started, model_time, iteration


async def on_server(
    work: Path,
    blobs: BlobStore,
    engine: object,
    server: ScriptedModelServer,
    iterations: int,
    repeats: int,
    tuned: bool,
) -> list[tuple]:
    """Durable episodes on a fresh embedded server, tuned (what we ship) or with the dev
    server's own defaults."""
    rows = []
    name = "tuned" if tuned else "untuned"
    async with EmbeddedServer(work / f"temporal-{name}.sqlite", tuned=tuned) as address:
        client = await Client.connect(address, data_converter=data_converter(blobs))
        settings = Settings(task_queue=f"bench-{name}", data_dir=work)
        async with running_workers(Services(settings, blobs, engine, client)):  # type: ignore[arg-type]
            await durable(client, settings.task_queue, server, iterations)  # warm-up: caches, imports
            for _ in range(repeats):
                rows.append(await durable(client, settings.task_queue, server, iterations))
    return rows


async def main(iterations: int, repeats: int, latency_ms: float = 0.0) -> None:
    work = Path(tempfile.mkdtemp(prefix="drlm-bench-"))
    sandboxes = Path(tempfile.mkdtemp(prefix="drlm-bench-sb-", dir="/tmp"))
    sandboxes.chmod(0o711)
    engine = open_store(f"sqlite:///{work / 'drlm.sqlite'}")
    blobs = BlobStore(SqlBackend(engine))
    direct_rows = []
    delay = latency_ms / 1000
    try:
        with ScriptedModelServer(root_and_sub(script(iterations, delay), sub_answer(delay))) as server:
            durable_rows = await on_server(work, blobs, engine, server, iterations, repeats, tuned=True)
            untuned_rows = await on_server(work, blobs, engine, server, iterations, repeats, tuned=False)
            for _ in range(repeats):
                direct_rows.append(await direct(blobs, sandboxes, server, iterations))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(sandboxes, ignore_errors=True)

    def per_iteration(rows: list[tuple]) -> float:
        return statistics.median((wall - model) / its for wall, model, its, *_ in rows)

    durable_overhead, direct_overhead = per_iteration(durable_rows), per_iteration(direct_rows)
    untuned_overhead = per_iteration(untuned_rows)
    wall_d = statistics.median(r[0] for r in durable_rows)
    wall_b = statistics.median(r[0] for r in direct_rows)
    _, _, its, history_bytes, events = durable_rows[-1]
    print(f"iterations per episode:             {its} (1 root call + 1 cell + 1 llm_query each)")
    print(f"repeats:                            {repeats} (medians below)")
    print(f"durable episode wall time:          {wall_d:.3f} s")
    print(f"direct loop wall time (baseline):   {wall_b:.3f} s")
    print(f"durable engine overhead/iteration:  {durable_overhead * 1000:.1f} ms (tuned embedded server)")
    print(f"  on the untuned dev server:        {untuned_overhead * 1000:.1f} ms")
    print(f"ratio untuned/tuned server:         {untuned_overhead / durable_overhead:.2f}x")
    print(f"direct overhead/iteration:          {direct_overhead * 1000:.1f} ms")
    print(f"ratio durable/direct (overhead):    {durable_overhead / direct_overhead:.2f}x")
    print(f"history: {events} events, {history_bytes} bytes, {history_bytes / its:.0f} bytes/iteration")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--latency-ms", type=float, default=0.0, help="the scripted model's think time")
    args = parser.parse_args()
    asyncio.run(main(args.iterations, args.repeats, args.latency_ms))
    sys.stdout.flush()
    os._exit(0)
