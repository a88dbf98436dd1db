"""The differential harness: one DSPy program, run by DSPy 3.4.1's RLM (with its
LocalInterpreter, no Deno) and then with only `RLM = dspy.RLM` changed to durable-rlm's, each
in a process of its own against the same scripted server that speaks DSPy's adapter format.

The programs (programs/*.py) read the server's address from the environment and print their
Prediction's fields as JSON. durable-rlm runs embedded, as a one-off program does: its own
worker, and the shared server of one data directory for the module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from durable_rlm.scripted import ChatRequest, ScriptedModelServer

PROGRAMS = Path(__file__).parent / "programs"
DSPY_LINE = "RLM = dspy.RLM\n"
SWITCHED = "from durable_rlm.dspy import RLM\n"
RUN_TIMEOUT_S = 300


def switched(source: str) -> str:
    """The program after the one-line switch."""
    assert source.count(DSPY_LINE) == 1, "the program names dspy.RLM once"
    return source.replace(DSPY_LINE, SWITCHED)


@dataclass
class Run:
    printed: dict[str, Any]
    requests: list[ChatRequest]
    stderr: str


def run(source: str, server: ScriptedModelServer, cwd: Path, data_dir: Path | None) -> Run:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "TEMPORAL_", "DRLM_"))}
    environ.update(
        DSPY_TEST_API_BASE=server.base_url,
        LITELLM_LOCAL_MODEL_COST_MAP="True",  # DSPy's model metadata: its bundled copy, no fetch
        PYTHONUNBUFFERED="1",
        # DSPy's BootstrapFewShot picks among a run's traces by a hash of pickled examples, which
        # hold sets: fixed string hashing makes its pick the same in both processes.
        PYTHONHASHSEED="0",
    )
    if data_dir is not None:
        environ.update(DRLM_DATA_DIR=str(data_dir), DRLM_SERVER_IDLE_S="15")
    cwd.mkdir(parents=True, exist_ok=True)
    before = len(server.requests)
    done = subprocess.run(
        [sys.executable, "-c", source],
        capture_output=True,
        text=True,
        env=environ,
        cwd=cwd,
        timeout=RUN_TIMEOUT_S,
    )
    library = "durable-rlm" if data_dir is not None else "dspy"
    assert done.returncode == 0, f"{library} failed:\n{done.stderr[-4000:]}\n{done.stdout[-2000:]}"
    return Run(json.loads(done.stdout.splitlines()[-1]), server.requests[before:], done.stderr)


@dataclass
class Compared:
    theirs: Run
    ours: Run


def compare(name: str, server: ScriptedModelServer, workdir: Path, data_dir: Path) -> Compared:
    source = (PROGRAMS / f"{name}.py").read_text()
    theirs = run(source, server, workdir / "dspy", None)
    ours = run(switched(source), server, workdir / "durable", data_dir)
    return Compared(theirs, ours)


def interpreter_lines(system: str) -> str:
    """A system prompt without the lines DSPy takes from its interpreter (where code runs,
    and its sub-agents when the interpreter can host them): the only lines that differ.
    The extraction prompt has none."""
    start = system.find("        Execution environment:")
    end = system.find("        Available:")
    return system[:start] + system[end:] if 0 <= start < end else system
