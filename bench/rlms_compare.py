"""Section `rlms`: wall time of a durable episode against the rlms package (rlms==0.1.3).

    python bench/rlms_compare.py [--quick] [--repeats R]

One scripted 10-iteration episode (each iteration: one root call, one cell making one
`llm_query`; the tenth cell also holds the answer), served by the same scripted
OpenAI-compatible server on 127.0.0.1, run in this process, at 0, 250 and 1000 ms of model
latency:

- rlms: `RLM(backend="openai", ..., max_depth=1).completion(context, root_prompt=...)` in a
  subprocess of rlms's own virtualenv (created on first use in
  ~/.cache/drlm-bench/rlms-0.1.3, or $DRLM_BENCH_CACHE, with `python -m venv` + pip from
  PyPI). Its cell ends with `answer["content"] = ...; answer["ready"] = True`. The baseline.
- durable: our episode (same turns, ending with FINAL_VAR) on the embedded dev server as
  shipped, with this process's workers.

Each side's first run (at the first latency) is an untimed warm-up; wall time is the
`completion()` call / the workflow's execution, measured by the caller.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import benchlib
from benchlib import BENCH, Context, Section, Target, median, ratio, run_section, say, section_main

from durable_rlm.client.episodes import start_episode, store_context
from durable_rlm.scripted import Reply, ScriptedModelServer, root_and_sub
from durable_rlm.workflows.models import EpisodeLimits, EpisodeRequest, ModelSettings

RLMS_VERSION = "0.1.3"
LATENCIES_MS = (0, 250, 1000)
RLMS_RATIO = 0.95  # the scale target: wall time at 250 ms and 1 s of model latency (1.0x before it)
ROOT_PROMPT = "How many lines does the context have?"


def cache_dir() -> Path:
    return Path(os.environ.get("DRLM_BENCH_CACHE") or Path.home() / ".cache" / "drlm-bench")


def rlms_python() -> Path:
    """The rlms virtualenv's interpreter, creating the virtualenv on first use."""
    venv = cache_dir() / f"rlms-{RLMS_VERSION}"
    python = venv / "bin" / "python"
    marker = venv / ".drlm-bench-ready"
    if marker.exists() and python.exists():
        return python
    if venv.exists():
        shutil.rmtree(venv)  # a half-made one from an interrupted first use
    say(f"rlms: creating {venv} (python -m venv + pip install rlms=={RLMS_VERSION} from PyPI)")
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            f"rlms=={RLMS_VERSION}",
        ],
        capture_output=True,
        text=True,
    )
    if pip.returncode != 0:
        raise RuntimeError(f"pip install rlms=={RLMS_VERSION} failed: {(pip.stdout + pip.stderr)[-3000:]}")
    subprocess.run([str(python), "-c", "from rlm import RLM"], check=True)
    marker.write_text(RLMS_VERSION)
    return python


def rlms_version(python: Path) -> str:
    """The rlms version installed for `python` (rlms's own virtualenv)."""
    return subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('rlms'))"],
        capture_output=True,
        text=True,
    ).stdout.strip()


def cell(i: int) -> str:
    return f"v{i} = llm_query('question {i}')\nprint(len(v{i}))"


def rlms_turns(iterations: int, delay_s: float) -> list[Reply]:
    turns = [f"```repl\n{cell(i)}\n```" for i in range(iterations - 1)]
    last = iterations - 1
    turns.append(f"```repl\n{cell(last)}\nanswer['content'] = v{last}\nanswer['ready'] = True\n```")
    return [Reply(text=t, delay_s=delay_s) for t in turns]


def durable_turns(iterations: int, delay_s: float) -> list[Reply]:
    turns = [f"```repl\n{cell(i)}\n```" for i in range(iterations - 1)]
    last = iterations - 1
    turns.append(f"```repl\n{cell(last)}\n```\nFINAL_VAR(v{last})")
    return [Reply(text=t, delay_s=delay_s) for t in turns]


def script(iterations: int, delay_s: float):  # noqa: ANN201 - a scripted model serving both sides
    """Root turns by who is asking: rlms's system prompt differs from ours."""
    ours = root_and_sub(
        durable_turns(iterations, delay_s), lambda p: Reply("answer to " + p, delay_s=delay_s)
    )
    theirs = root_and_sub(rlms_turns(iterations, delay_s), lambda p: Reply("answer to " + p, delay_s=delay_s))
    side = {"now": ours}

    def answer(request):  # noqa: ANN001, ANN202
        return side["now"](request)

    answer.side = side  # type: ignore[attr-defined]
    answer.ours, answer.theirs = ours, theirs  # type: ignore[attr-defined]
    return answer


async def run_rlms(
    python: Path,
    server: ScriptedModelServer,
    iterations: int,
    runs: int,
    context_file: Path,
    cwd: Path,
    warmup: bool,
) -> list[float]:
    out = await asyncio.to_thread(
        subprocess.run,
        [
            str(python),
            str(BENCH / "rlms_driver.py"),
            "--base-url",
            server.base_url,
            "--iterations",
            str(iterations),
            "--runs",
            str(runs),
            "--warmup",
            "1" if warmup else "0",
            "--context-file",
            str(context_file),
            "--root-prompt",
            ROOT_PROMPT,
        ],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")},
        timeout=1800,
    )
    if out.returncode != 0:
        raise RuntimeError(f"rlms driver failed: {out.stderr[-2000:]}")
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    expected = f"answer to question {iterations - 1}"
    for row in rows:
        if row["answer"] != expected:
            raise RuntimeError(f"rlms answered {row['answer']!r}, not {expected!r}")
    return [row["wall_s"] for row in rows if not row["warmup"]]


async def run_durable(env: benchlib.BenchEnv, request: EpisodeRequest, queue: str, iterations: int) -> float:
    loop = asyncio.get_running_loop()
    started = loop.time()
    handle = await start_episode(env.client, request, queue, f"bench-rlms-{uuid.uuid4().hex[:8]}")
    result = await handle.result()
    wall = loop.time() - started
    expected = f"answer to question {iterations - 1}"
    if result.answer != expected or result.iterations != iterations:
        raise RuntimeError(f"durable episode: {result.answer!r} after {result.iterations} iterations")
    return wall


async def body(ctx: Context, section: Section) -> None:
    iterations = 3 if ctx.quick else 10
    latencies = (0,) if ctx.quick else LATENCIES_MS
    python = await asyncio.to_thread(rlms_python)
    version = rlms_version(python)
    env_dir = ctx.scratch("rlms")
    context_text = "\n".join(f"line {i}: the quick brown fox jumps over the lazy dog" for i in range(2_000))
    context_file = env_dir / "context.txt"
    context_file.write_text(context_text)
    queue = "bench-rlms"
    plot: dict[str, dict[str, list[float]]] = {}
    async with benchlib.bench_env(env_dir) as env, env.workers(queue):
        ref = store_context(env.blobs, context_text)
        for latency in latencies:
            delay = latency / 1000
            answer = script(iterations, delay)
            with ScriptedModelServer(answer) as server:
                request = EpisodeRequest(
                    task=ROOT_PROMPT,
                    context=ref,
                    root_model=ModelSettings(model="scripted", base_url=server.base_url),
                    limits=EpisodeLimits(max_iterations=iterations + 2, max_llm_calls=iterations + 5),
                )
                first = latency == latencies[0]  # warm-up runs (imports, connections) once
                say(f"rlms: {latency} ms latency, rlms {version}, {ctx.repeats} run(s)")
                answer.side["now"] = answer.theirs
                theirs = await run_rlms(python, server, iterations, ctx.repeats, context_file, env_dir, first)
                answer.side["now"] = answer.ours
                say(f"rlms: {latency} ms latency, durable, {ctx.repeats} run(s)")
                if first:
                    await run_durable(env, request, queue, iterations)
                ours = [await run_durable(env, request, queue, iterations) for _ in range(ctx.repeats)]
            plot[str(latency)] = {"rlms": theirs, "durable": ours}
            section.add(
                f"rlms_wall_{latency}ms",
                f"rlms {version} wall time, {latency} ms model",
                "s",
                theirs,
                baseline=True,
            )
            target = None
            if latency >= 250:
                target = Target("<=", RLMS_RATIO, on="ratio", text=f"<= {RLMS_RATIO:g}x rlms")
            section.add(
                f"durable_wall_{latency}ms",
                f"durable episode wall time, {latency} ms model",
                "s",
                ours,
                ratio=ratio(median(ours), median(theirs)),
                ratio_label="durable / rlms",
                target=target,
            )
    section.series["wall_s"] = plot
    section.notes.append(
        f"{iterations} iterations (root call + one cell with one llm_query each), model time "
        f"{2 * iterations} calls x latency; context 2,000 lines; rlms {version} with its local REPL "
        "(exec in its own process, no sandbox, no durability) in its own virtualenv "
        f"({python.parent.parent}); durable: embedded server as shipped, in-process workers"
    )


async def run(ctx: Context) -> Section:
    return await run_section("rlms", "2. Wall time against rlms", body, ctx)


if __name__ == "__main__":
    section_main(run, __doc__, "rlms_compare.py")
