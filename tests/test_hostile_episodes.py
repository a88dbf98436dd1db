"""Hostile code through real episodes (the workflow, the worker, its sandboxes), all at once
beside an honest episode: for each attack the worker survives, the episode records the
cell's error and goes on to its answer, the honest episode answers right, and a canary
secret in the worker's environment and data directory appears in no result, history,
timeline or audit row. (tests/test_escape.py attacks each sandbox layer alone.)"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from durable_rlm.audit.timeline import episode_timeline, render
from durable_rlm.scripted import ChatRequest, Reply
from durable_rlm.workflows.models import EpisodeLimits
from tests.conftest import request_for, run_episode

CANARY = f"canary-{uuid.uuid4().hex}"


def attacks(canary_file: Path, temporal_port: int) -> dict[str, str]:
    return {
        "fork bomb": "import os\nwhile True:\n    os.fork()",
        "memory bomb": "x = bytearray(16 * 1024 ** 3)",
        "loop ignoring SIGALRM": (
            "import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True:\n    pass"
        ),
        "deep recursion": "def f(n):\n    return f(n + 1)\nf(0)",
        "recursion past the C stack": (
            "import sys\nsys.setrecursionlimit(10 ** 9)\ndef f(n):\n    return f(n + 1)\nf(0)"
        ),
        "worker environment": "import os\nprint(dict(os.environ))\nprint(open('/proc/1/environ').read())",
        "data directory": f"print(open({str(canary_file)!r}).read())",
        "Temporal on 127.0.0.1": (
            f"import socket\ns = socket.socket()\ns.settimeout(2)\ns.connect(('127.0.0.1', {temporal_port}))"
        ),
        "kill the worker": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
        "os._exit": "import os\nos._exit(3)",
        "undecodable text": (
            "print('\\udcff lone surrogate')\nimport sys\n"
            "sys.stdout.write(bytes(range(256)).decode('latin-1'))"
        ),
        "helpers overwritten": "llm_query = None\nFINAL_VAR = None\nSUBMIT = None\ncontext = 'replaced'",
        # The other episodes: their sandboxes' files, and every process on the host.
        "other sandboxes' files": (
            "import glob\nprint(glob.glob('/tmp/**/context*', recursive=True))\n"
            "print([open(p).read() for p in glob.glob('/tmp/**/context*', recursive=True)])"
        ),
        "kill every process": (
            "import os\nkilled = 0\nfor pid in range(2, 100_000):\n    try:\n"
            "        os.kill(pid, 9)\n        killed += 1\n    except Exception:\n        pass\n"
            "print('killed', killed)"
        ),
    }


AFTER = "```repl\nprint(llm_query('ping'))\n```"
"""The turn after the attack: the REPL's helpers are the episode's again."""


def hostile_script(cell: str):
    def script(request: ChatRequest) -> Reply | str:
        if not request.is_root:
            return request.last_user.upper()
        turns = [f"```repl\n{cell}\n```", AFTER, "FINAL(survived)"]
        return turns[min(request.turn, 2)]

    return script


async def test_every_attack_ends_in_an_observation_and_nothing_leaks(
    client, worker, scripted, store, session_dir: Path, temporal_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DRLM_HOSTILE_CANARY", CANARY)  # the worker's environment (this process)
    canary_file = session_dir / "hostile-canary.txt"  # in the worker's data directory
    canary_file.write_text(CANARY)
    canary_file.chmod(0o644)
    port = int(temporal_address.rsplit(":", 1)[1])
    limits = EpisodeLimits(max_iterations=5, cell_timeout_s=3)
    named = attacks(canary_file, port)
    ids = {name: f"hostile-{i}-{uuid.uuid4().hex[:6]}" for i, name in enumerate(named)}
    honest = scripted(
        lambda r: (
            ["```repl\nr = llm_query('ping')\n```", "FINAL_VAR(r)"][min(r.turn, 1)]
            if r.is_root
            else r.last_user.upper()
        )
    )
    runs = [
        run_episode(
            client, request_for(scripted(hostile_script(cell)), limits=limits), worker.task_queue, ids[name]
        )
        for name, cell in named.items()
    ]
    # The honest episode's context holds the canary too: another episode reading it leaks it.
    from durable_rlm.client.episodes import store_context

    secret_context = store_context(store[0], f"the honest episode's {CANARY}")
    honest_run = run_episode(client, request_for(honest, context=secret_context), worker.task_queue)
    *results, honest_result = await asyncio.gather(*runs, honest_run)

    assert honest_result.answer == "PING"
    blobs, engine = store
    for (name, _), result in zip(named.items(), results, strict=True):
        assert result.answer == "survived", (name, result)
        timeline = await episode_timeline(client, ids[name])
        cell, after = timeline.iterations[0].cells[0], timeline.iterations[1].cells[0]
        assert cell.error or cell.stdout or name == "helpers overwritten", name  # an observation
        assert after.stdout.startswith("PING"), (name, after)  # the REPL serves the episode again
        shown = render(timeline) + result.model_dump_json()
        history = await client.get_workflow_handle(ids[name]).fetch_history()
        assert CANARY not in shown and CANARY not in history.to_json(), name
    with engine.connect() as conn:
        for table in ("audit_cells", "audit_model_calls", "audit_events", "episodes"):
            rows = conn.execute(sa.text(f"SELECT * FROM {table}")).fetchall()  # noqa: S608 - our table names
            assert all(CANARY not in str(row) for row in rows), table
