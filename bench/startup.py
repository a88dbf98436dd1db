"""Section `startup`: fast to first answer, against rlms 0.1.3 in the same run (issue 36, item 7).

    python bench/startup.py [--quick] [--repeats R] [--merge]

Every figure is the wall time of a new process, from spawn to exit, as a user's shell sees
it (median of several runs, after an untimed warm-up; the runs of the compared commands take
turns, so a burst of load on the machine falls on both sides alike):

- imports: `from rlm import RLM` in rlms's own virtualenv (the baseline; created on first use
  as in bench/rlms_compare.py), `import durable_rlm` and `from durable_rlm import RLM,
  DurableRLM` (target <= 0.5 s), and `python -c pass` (the interpreter alone, for scale).
- the CLI: `drlm --help`, a usage error (`drlm nosuchcommand`), `drlm list` and `drlm show
  ID` of an ended episode (its timeline kept in the store), each <= 0.35 s; `drlm show ID`
  the first time, read from the server's history, is reported without a target (the server
  bounds it). Beside each, what our own imports cost in it (`-X importtime`).
- a one-off script in a new process (import, one three-iteration `completion()` at 0 ms model
  latency, exit): one script, run by rlms's interpreter and by ours with its one import
  changed (`from rlm import RLM` -> `from durable_rlm import RLM`), against one scripted
  model on 127.0.0.1 (two root turns run a cell, the third sets `answer`); median of 5 each.
  Ours within 0.5 s of rlms's while the shared embedded server is up (this process holds a
  lease), and within 1.5 s when the script must start it (the data directory's server
  stopped before each run, as after `DRLM_SERVER_IDLE_S`).

`--merge` adds the section to bench/results/latest.json (as `python bench/run.py --only
startup` would, without replacing the other sections' figures).
"""

from __future__ import annotations

import asyncio
import compileall
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchlib import Context, Section, Target, ratio, run_section, say, section_main
from rlms_compare import rlms_python

import durable_rlm
from durable_rlm.scripted import ChatRequest, ScriptedModelServer
from durable_rlm.server.embedded import ServerFiles, acquire
from durable_rlm.settings import Settings

IMPORT_TARGET_S = 0.5
CLI_TARGET_S = 0.35
WARM_WITHIN_S = 0.5
COLD_WITHIN_S = 1.5
ITERATIONS = 3

SCRIPT = """
import json, sys
from rlm import RLM
rlm = RLM(
    backend="openai",
    backend_kwargs={"model_name": "gpt-x", "base_url": sys.argv[1], "api_key": "sk-scripted"},
    max_iterations=3,
)
result = rlm.completion("a\\nb\\nc", root_prompt="How many lines does the context have?")
print(json.dumps({"response": result.response}))
"""
ROOT_TURNS = [
    "```repl\nlines = context.splitlines()\nprint(len(lines))\n```",
    "```repl\ncount = len(lines)\nprint(count)\n```",
    "```repl\nanswer['content'] = str(count)\nanswer['ready'] = True\n```",
]
EXPECTED = "3"


@dataclass
class Run:
    wall_s: float
    cpu_s: float
    code: int
    stdout: str
    stderr: str


def run_process(argv: list[str], env: dict[str, str], cwd: Path, timeout: float = 300) -> Run:
    """One process, spawn to exit: its wall time and its own CPU time (os.wait4's rusage)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env, cwd=cwd)
        deadline = started + timeout
        while True:
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                process.kill()
                raise RuntimeError(f"{argv} ran past {timeout:g} s")
            time.sleep(0.002)
        wall = time.perf_counter() - started
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return Run(
            wall,
            usage.ru_utime + usage.ru_stime,
            process.returncode,
            out.read().decode(errors="replace"),
            err.read().decode(errors="replace"),
        )


def checked(run: Run, what: str, code: int = 0) -> Run:
    if run.code != code:
        raise RuntimeError(f"{what}: exit {run.code} (expected {code}): {run.stderr[-2000:]}")
    return run


def own_import_ms(importtime_stderr: str) -> float:
    """What a process's imports cost, from `-X importtime`: the sum of its top-level imports
    (cumulative microseconds), interpreter start-up (`site` and what it loads) left out."""
    total = 0
    for line in importtime_stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        _, cumulative, name = line.split("|", 2)
        if name.startswith("  ") or not cumulative.strip().isdigit():
            continue  # an import inside another one: counted in its parent's cumulative time
        if name.strip() in ("site", "encodings", "_frozen_importlib_external", "zipimport"):
            continue
        total += int(cumulative)
    return total / 1000


def episode_ids(drlm: Path, env: dict[str, str], cwd: Path) -> list[str]:
    run = checked(run_process([str(drlm), "list", "--json", "--limit", "1000"], env, cwd), "drlm list --json")
    return [json.loads(line)["episode_id"] for line in run.stdout.splitlines() if line.startswith("{")]


async def server_stopped(files: ServerFiles, timeout: float = 180) -> None:
    """Wait for the data directory's server to stop (its idle time after the last lease, and
    the timelines it keeps for `drlm show` first)."""
    deadline = time.monotonic() + timeout
    while files.read_state() is not None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the embedded server of {files.state.parent} did not stop in {timeout:g} s")
        await asyncio.sleep(0.1)


def compile_sources() -> int:
    """Compile the package's source folders: durable_rlm's own, and in a checkout the
    top-level folders it maps in (durable_rlm/__init__.py puts the checkout on its path)."""
    own, *checkouts = (Path(entry) for entry in durable_rlm.__path__)
    mapped = ("activities", "workflows", "migrations")
    folders = [own, *(root / name for root in checkouts for name in mapped)]
    for folder in folders:
        if folder.is_dir():
            compileall.compile_dir(folder, quiet=1, workers=1)
    return sum(folder.is_dir() for folder in folders)


async def body(ctx: Context, section: Section) -> None:
    load_before = os.getloadavg()
    fast_runs = 2 if ctx.quick else max(9, ctx.repeats)
    warm_runs = 1 if ctx.quick else max(5, ctx.repeats)
    cold_runs = 1 if ctx.quick else max(5, ctx.repeats)
    theirs_python = await asyncio.to_thread(rlms_python)
    ours_python = Path(sys.executable)
    drlm = ours_python.parent / "drlm"
    work = ctx.scratch("startup")
    data = work / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "TEMPORAL_", "DRLM_"))}
    # Short idle time: the cold runs wait for the server to stop; the warm ones hold a lease.
    env |= {"DRLM_DATA_DIR": str(data), "DRLM_SERVER_IDLE_S": "1"}
    settings = Settings.from_env(env)
    files = ServerFiles.of(settings)
    script = work / "theirs.py"
    script.write_text(SCRIPT)
    ours_script = work / "ours.py"
    ours_script.write_text(SCRIPT.replace("from rlm import RLM", "from durable_rlm import RLM"))

    def spawn(argv: list[str], what: str, code: int = 0) -> Run:
        return checked(run_process(argv, env, work), what, code)

    # Bytecode as an installed wheel has it (pip compiles at install time): where
    # PYTHONDONTWRITEBYTECODE is set, an editable checkout's __pycache__ goes stale with each
    # edit and every import compiles the source again (~0.1-0.2 s of `drlm show` on 2026-11-27).
    compiled = compile_sources()
    say(f"startup: bytecode of {compiled} source folder(s) brought up to date")

    # --- imports and the CLI without episodes: each command in turn, every repetition -------
    commands: dict[str, tuple[list[str], int]] = {
        "python": ([str(ours_python), "-c", "pass"], 0),
        "rlms_import": ([str(theirs_python), "-c", "from rlm import RLM"], 0),
        "import_package": ([str(ours_python), "-c", "import durable_rlm"], 0),
        "import_api": ([str(ours_python), "-c", "from durable_rlm import RLM, DurableRLM"], 0),
        "help": ([str(drlm), "--help"], 0),
        "usage_error": ([str(drlm), "nosuchcommand"], 2),
    }
    say(f"startup: imports and CLI, {fast_runs} run(s) each")
    walls: dict[str, list[float]] = {name: [] for name in commands}
    cpus: dict[str, list[float]] = {name: [] for name in commands}
    for repetition in range(fast_runs + 1):
        for name, (argv, code) in commands.items():
            result = await asyncio.to_thread(spawn, argv, name, code)
            if repetition:  # the first round warms the file cache
                walls[name].append(result.wall_s)
                cpus[name].append(result.cpu_s)

    # --- a three-iteration completion(): a scripted model, the shared server stopped / up -------
    def answer(request: ChatRequest) -> str:
        return ROOT_TURNS[min(request.turn, ITERATIONS - 1)] if request.is_root else "not asked"

    completions: dict[str, list[float]] = {"rlms": [], "cold": [], "warm": []}
    # CPU time of the process and what it waited for (the sandbox): a figure load moves less.
    completion_cpu: dict[str, list[float]] = {"rlms": [], "cold": [], "warm": []}
    with ScriptedModelServer(answer) as model:
        url = model.base_url

        def completion(python: Path, path: Path, what: str) -> float:
            before = len(model.requests)
            result = spawn([str(python), str(path), url], what)
            response = json.loads(result.stdout.strip().splitlines()[-1])["response"]
            calls = len(model.requests) - before
            if response != EXPECTED or calls != ITERATIONS:
                raise RuntimeError(f"{what}: answered {response!r} after {calls} model call(s)")
            if what in completion_cpu:
                completion_cpu[what].append(result.cpu_s)
            return result.wall_s

        say("startup: warm-up (rlms; ours creates the data directory and its server)")
        await asyncio.to_thread(completion, theirs_python, script, "rlms warm-up")
        await asyncio.to_thread(completion, ours_python, ours_script, "durable warm-up")
        for i in range(cold_runs):
            say(f"startup: completion, server stopped first ({i + 1}/{cold_runs})")
            await server_stopped(files)
            completions["cold"].append(await asyncio.to_thread(completion, ours_python, ours_script, "cold"))
            completions["rlms"].append(await asyncio.to_thread(completion, theirs_python, script, "rlms"))
        await server_stopped(files)
        before_warm = set(await asyncio.to_thread(episode_ids, drlm, env, work))
        lease = await acquire(settings)
        try:
            await asyncio.to_thread(completion, ours_python, ours_script, "durable warm-up (server up)")
            for i in range(warm_runs):
                say(f"startup: completion, shared server up ({i + 1}/{warm_runs})")
                completions["warm"].append(
                    await asyncio.to_thread(completion, ours_python, ours_script, "warm")
                )
                completions["rlms"].append(await asyncio.to_thread(completion, theirs_python, script, "rlms"))

            # --- list and show, against the episodes just run (the server still up) -------
            fresh = [i for i in await asyncio.to_thread(episode_ids, drlm, env, work) if i not in before_warm]
            if not fresh:
                raise RuntimeError("no episode of the warm runs in `drlm list`")
            say(f"startup: drlm list / show, {fast_runs} run(s) each")
            first_show = [
                (await asyncio.to_thread(spawn, [str(drlm), "show", episode], "first show")).wall_s
                for episode in fresh
            ]
            shown, listed = fresh[0], len(before_warm) + len(fresh)
            cli = {"list": [str(drlm), "list"], "show": [str(drlm), "show", shown]}
            for name in cli:
                walls[name], cpus[name] = [], []
            for repetition in range(fast_runs + 1):
                for name, argv in cli.items():
                    result = await asyncio.to_thread(spawn, argv, f"drlm {name}")
                    if repetition:
                        walls[name].append(result.wall_s)
                        cpus[name].append(result.cpu_s)

            def imports(python: Path, argv: list[str], what: str) -> float:
                """The median of three -X importtime runs (one is at the mercy of a burst)."""
                runs = [spawn([str(python), "-X", "importtime", *argv], what).stderr for _ in range(3)]
                return statistics.median(own_import_ms(err) for err in runs)

            imports_ms = {
                name: await asyncio.to_thread(imports, ours_python, argv, name)
                for name, argv in {
                    "import_api": ["-c", "from durable_rlm import RLM, DurableRLM"],
                    "help": [str(drlm), "--help"],
                    "list": [str(drlm), "list"],
                    "show": [str(drlm), "show", shown],
                }.items()
            }
            rlms_import_ms = await asyncio.to_thread(
                imports, theirs_python, ["-c", "from rlm import RLM"], "rlms"
            )
        finally:
            lease.release()
        await server_stopped(files)  # nothing of this run left running

    # --- figures ----------------------------------------------------------------------------
    rlms_import = statistics.median(walls["rlms_import"])
    section.add("python_start", "python -c pass (the interpreter alone)", "s", walls["python"])
    section.add("rlms_import", "rlms: from rlm import RLM", "s", walls["rlms_import"], baseline=True)

    def vs_rlms(key: str, label: str, target_s: float | None, note: str = "") -> None:
        cpu = f"CPU {statistics.median(cpus[key]):.2f} s"
        section.add(
            key,
            label,
            "s",
            walls[key],
            ratio=ratio(statistics.median(walls[key]), rlms_import),
            ratio_label="/ rlms import",
            target=None if target_s is None else Target("<=", target_s, text=f"<= {target_s:g} s"),
            note=f"{cpu}; {note}" if note else cpu,
        )

    vs_rlms("import_package", "import durable_rlm", IMPORT_TARGET_S)
    vs_rlms(
        "import_api",
        "from durable_rlm import RLM, DurableRLM",
        IMPORT_TARGET_S,
        f"imports {imports_ms['import_api']:.0f} ms (rlms's: {rlms_import_ms:.0f} ms)",
    )
    vs_rlms("help", "drlm --help", CLI_TARGET_S, f"imports {imports_ms['help']:.0f} ms")
    vs_rlms("usage_error", "drlm nosuchcommand (a usage error)", CLI_TARGET_S)
    vs_rlms("list", "drlm list", CLI_TARGET_S, f"{listed} episodes; imports {imports_ms['list']:.0f} ms")
    vs_rlms(
        "show",
        "drlm show ID (an ended episode, its timeline kept)",
        CLI_TARGET_S,
        f"imports {imports_ms['show']:.0f} ms",
    )
    section.add(
        "show_first",
        "drlm show ID the first time (history read from the running server)",
        "s",
        first_show,
        ratio=ratio(statistics.median(first_show), rlms_import),
        ratio_label="/ rlms import",
        note="bound by the server's history; kept in the store for the next show",
    )
    theirs = statistics.median(completions["rlms"])
    section.add(
        "completion_rlms",
        "rlms: new process, three-iteration completion()",
        "s",
        completions["rlms"],
        baseline=True,
    )
    for key, label, within in (
        ("warm", "durable: new process, three-iteration completion(), shared server up", WARM_WITHIN_S),
        ("cold", "durable: new process, three-iteration completion(), server started by it", COLD_WITHIN_S),
    ):
        ours = statistics.median(completions[key])
        section.add(
            f"completion_{key}",
            label,
            "s",
            completions[key],
            ratio=ratio(ours, theirs),
            ratio_label="durable / rlms",
            target=Target(
                "<=", theirs + within, text=f"within {within:g} s of rlms (<= {theirs + within:.2f} s)"
            ),
            note=f"{ours - theirs:+.2f} s against rlms; CPU {statistics.median(completion_cpu[key]):.2f} s "
            f"(rlms's {statistics.median(completion_cpu['rlms']):.2f} s)",
        )
    version = subprocess.run(
        [str(theirs_python), "-c", "import importlib.metadata as m; print(m.version('rlms'))"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    section.notes.append(
        "wall time of a new process, spawn to exit, as a shell sees it; the compared commands take "
        f"turns in each round ({fast_runs} rounds after a warm-up round); rlms {version} in its own "
        f"virtualenv ({theirs_python.parent.parent})"
    )
    section.notes.append(
        "completion(): the same script under both (one changed import), three root calls each (checked), "
        "rlms's local REPL (exec in its own process) against our sandboxed REPL, durable episode, "
        "embedded server as shipped (DRLM_SERVER_IDLE_S=1 so that each cold run finds it stopped); "
        "'imports' = the sum of the top-level imports' cumulative times under -X importtime"
    )
    loads = ", ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(load_before, os.getloadavg(), strict=True))
    section.notes.append(f"load average (1, 5, 15 min) before/after this section: {loads}")


async def run(ctx: Context) -> Section:
    return await run_section("startup", "9. Start-up: fast to first answer, against rlms", body, ctx)


if __name__ == "__main__":
    section_main(run, __doc__, "startup.py")
