"""The differential harness: one script of rlms's API, run by rlms 0.1.3 (installed in the
test environment) and then by durable-rlm with only its `from rlm...` imports changed, each
in a process of its own against the same scripted OpenAI-compatible server.

The scripts (scripts/*.py) are ours, shaped like rlms's examples and tests: they read the
model's address from the environment, as an rlms program does (`OPENAI_BASE_URL`), and
print what a user would look at. durable-rlm runs embedded, as a one-off program does:
its own worker, and the shared server of one data directory for the whole suite.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from durable_rlm.scripted import ScriptedModelServer

SCRIPTS = Path(__file__).parent / "scripts"
RLMS_IMPORT = re.compile(r"^(\s*)from rlm(?=[.\s])", re.MULTILINE)
RUN_TIMEOUT_S = 300


def ported(source: str) -> str:
    """The script as a durable-rlm user has it: `from rlm...` became `from durable_rlm...`."""
    changed = RLMS_IMPORT.sub(r"\1from durable_rlm", source)
    assert changed != source, "the script imports nothing from rlm"
    return changed


@dataclass
class Run:
    printed: list[str]
    model_calls: int
    stderr: str


def run(
    source: str,
    server: ScriptedModelServer,
    cwd: Path,
    data_dir: Path | None,
    env: dict[str, str] | None = None,
) -> Run:
    """One run of `source` (data_dir: durable-rlm's, None for rlms) against `server`."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "TEMPORAL_", "DRLM_"))}
    environ.update(OPENAI_BASE_URL=server.base_url, OPENAI_API_KEY="sk-scripted", PYTHONUNBUFFERED="1")
    if data_dir is not None:
        # The suite's shared server outlives one script, not the suite.
        environ.update(DRLM_DATA_DIR=str(data_dir), DRLM_SERVER_IDLE_S="15")
    environ.update(env or {})
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
    library = "durable-rlm" if data_dir is not None else "rlms"
    assert done.returncode == 0, f"{library} failed:\n{done.stderr[-4000:]}\n{done.stdout[-2000:]}"
    return Run(done.stdout.splitlines(), len(server.requests) - before, done.stderr)


@dataclass
class Compared:
    theirs: Run
    ours: Run


def compare(
    name: str, server: ScriptedModelServer, workdir: Path, data_dir: Path, env: dict[str, str] | None = None
) -> Compared:
    """scripts/<name>.py on rlms, then on durable-rlm."""
    source = (SCRIPTS / f"{name}.py").read_text()
    theirs = run(source, server, workdir / "rlms", None, env)
    ours = run(ported(source), server, workdir / "durable", data_dir, env)
    return Compared(theirs, ours)
