"""The build id a worker without a Worker Deployment reports (durable_rlm/worker/build_id.py):
the workflow code's own, stamped by the server on every workflow task the worker completes,
and moved only by what decides an episode's steps."""

from __future__ import annotations

import importlib
import sys
import uuid
from pathlib import Path

import pytest

from durable_rlm.scripted import root_and_sub
from durable_rlm.worker import build_id
from durable_rlm.worker.build_id import code_build_id
from tests.conftest import request_for, run_episode


def test_the_id_names_the_version_and_hashes_the_workflow_code() -> None:
    first = code_build_id()
    assert first.startswith("durable-rlm-") and len(first.rsplit("-", 1)[1]) == 16
    assert code_build_id() == first  # the same code, the same id


def test_a_policy_module_the_worker_loads_moves_the_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"policy_{uuid.uuid4().hex[:8]}"
    module_file = tmp_path / f"{name}.py"
    module_file.write_text("LIMIT = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module(name)
    try:
        with_policy = code_build_id((name,))
        assert with_policy != code_build_id()
        module_file.write_text("LIMIT = 2\n")  # the policy's code changed: a new build
        build_id._build_id.cache_clear()
        assert code_build_id((name,)) != with_policy
    finally:
        sys.modules.pop(name, None)
        build_id._build_id.cache_clear()


async def test_the_history_names_the_build_that_decided_each_step(client, worker, scripted) -> None:
    server = scripted(root_and_sub(["```repl\nprint(1)\n```", "FINAL(done)"]))
    episode_id = f"build-{uuid.uuid4().hex[:8]}"
    await run_episode(client, request_for(server), worker.task_queue, episode_id)
    history = await client.get_workflow_handle(episode_id).fetch_history()
    stamped = [
        e.workflow_task_completed_event_attributes.worker_version.build_id
        for e in history.events
        if e.HasField("workflow_task_completed_event_attributes")
    ]
    assert stamped and set(stamped) == {code_build_id()}
