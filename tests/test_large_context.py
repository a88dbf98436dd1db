"""An episode over a context larger than 1 GB on the embedded default (SQLite blobs, the
embedded server): `drlm run --context FILE` streams it into the store (SQLite holds no value
over 1,000,000,000 bytes: chunks of 16 MB), the worker makes its one copy, the sandbox maps
it into one `str`, and the answer counts every line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from durable_rlm.scripted import root_and_sub
from tests.test_everyday import drlm

MB = 1024 * 1024
LINE = "2026-11-27 17:00:00 INFO service-7 request 0123456789 handled in 12 ms, status ok\n"


@pytest.mark.slow
def test_an_episode_over_a_context_larger_than_1_gb(tmp_path: Path, scripted) -> None:  # noqa: ANN001
    path = tmp_path / "big.log"
    block = LINE * (MB // len(LINE))
    blocks = 1100 * MB // len(block) + 1
    with open(path, "w") as handle:
        for _ in range(blocks):
            handle.write(block)
    size = path.stat().st_size
    assert size > 1_073_741_824
    turns = [
        "```repl\nn = context.count(chr(10))\nsize = len(context)\nprint(n, size)\n```",
        "```repl\nresult = f'{n} {size} {context[-20:].strip()}'\n```",
        "FINAL_VAR(result)",
    ]
    server = scripted(root_and_sub(turns))
    run = ("run", "count the lines", "--context", "big.log", "--base-url", server.base_url, "--model", "m")
    out = drlm(tmp_path, tmp_path, *run, "--json", "--cell-timeout", "600", timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["answer"] == f"{blocks * block.count(chr(10))} {size} in 12 ms, status ok"
