"""A DSPy program's input at a real size: a 100 MB document is stored once and bound in the
REPL, while each model request carries only DSPy's preview of it (the head and tail)."""

from __future__ import annotations

import json
from pathlib import Path

import dspy
import pytest

from durable_rlm.dspy import RLM
from durable_rlm.settings import Settings
from tests.dspy_compat.models import action, dspy_model

pytestmark = pytest.mark.slow

MB = 1_000_000


async def test_a_100_mb_input_reaches_the_repl_and_not_the_prompt(
    temporal_address: str, session_dir: Path, scripted, worker
) -> None:
    line = "12:00 auth-service ERROR timeout\n12:01 db-primary ok\n"
    doc = line * (100 * MB // len(line))
    server = scripted(
        dspy_model(
            [
                action("How long is it?", "print(len(doc))"),
                action("Count the errors.", 'SUBMIT(doc.count("ERROR"))'),
            ]
        )
    )
    settings = Settings(temporal_address=temporal_address, task_queue=worker.task_queue, data_dir=session_dir)
    program = RLM("doc -> errors: int", max_iters=4, settings=settings, limits={"cell_timeout_s": 120})
    lm = dspy.LM("openai/root-m", api_base=server.base_url, api_key="sk-scripted", cache=False)
    with dspy.context(lm=lm):
        prediction = await program.acall(doc=doc)

    assert prediction.errors == doc.count("ERROR")
    assert prediction.trajectory[0]["output"] == str(len(doc))
    sizes = [len(json.dumps(r.messages)) for r in server.root_requests()]
    assert len(sizes) == 2 and max(sizes) < 20_000, sizes  # DSPy's preview, not the document
