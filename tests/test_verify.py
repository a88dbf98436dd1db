"""`drlm verify`: real episodes, then a blob deleted or corrupted in the real blob store;
the report names the blob, the episodes it breaks and what still works."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

from durable_rlm.audit.timeline import episode_timeline
from durable_rlm.audit.verify import verify
from durable_rlm.client.episodes import store_context
from durable_rlm.scripted import root_and_sub
from durable_rlm.settings import Settings
from durable_rlm.store import schema
from durable_rlm.store.blobs import text_digest
from durable_rlm.store.codec import ENCODING as CLAIM_CHECK
from tests.conftest import request_for, run_episode
from tests.test_recursion import by_model, tree_request

DRLM = str(Path(sys.executable).with_name("drlm"))
TURNS = [
    "```repl\nn = len(context.splitlines())\nprint(n)\n```",
    "```repl\nlabel = llm_query('name for ' + str(n))\n```",
    "FINAL_VAR(label)",
]


def drlm(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "TEMPORAL_", "DRLM_"))}
    environ.update(DRLM_DATA_DIR=str(data_dir), DRLM_SERVER_IDLE_S="2")
    return subprocess.run([DRLM, *args], capture_output=True, text=True, timeout=180, env=environ)


def delete_blob(engine: sa.Engine, digest: str) -> None:
    with engine.begin() as conn:
        assert conn.execute(schema.blobs.delete().where(schema.blobs.c.digest == digest)).rowcount == 1


def corrupt_blob(engine: sa.Engine, digest: str) -> None:
    with engine.begin() as conn:
        changed = conn.execute(
            schema.blobs.update().where(schema.blobs.c.digest == digest).values(data=b"not what it was")
        )
        assert changed.rowcount == 1


@pytest.mark.slow  # long end to end (the default run stays near 13 minutes); CI runs it
def test_a_deleted_context_blob_names_its_episode_and_what_still_works(tmp_path: Path, scripted) -> None:
    server = scripted(root_and_sub(TURNS, lambda p: p.upper()))
    text = f"one\ntwo\nthree {uuid.uuid4().hex}\n"
    (tmp_path / "context.txt").write_text(text)
    base = ("--base-url", server.base_url, "--model", "scripted")
    context = str(tmp_path / "context.txt")
    out = drlm(tmp_path, "run", "count the lines", "--context", context, *base, "--json")
    assert out.returncode == 0, out.stderr
    episode_id = json.loads(out.stdout)["episode_id"]

    intact = drlm(tmp_path, "verify", "--all")
    assert intact.returncode == 0, intact.stdout + intact.stderr
    assert "0 missing, 0 corrupt" in intact.stdout

    (database,) = tmp_path.rglob("drlm.sqlite")
    engine = sa.create_engine(f"sqlite:///{database}")
    delete_blob(engine, text_digest(text))

    broken = drlm(tmp_path, "verify", episode_id)
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert f"MISSING {text_digest(text)}" in broken.stdout
    assert f"breaks: {episode_id}" in broken.stdout
    assert "the context in the episode's request" in broken.stdout
    assert "a REPL rebuild cannot load `context`" in broken.stdout
    assert "still works: the answer is in history ('NAME FOR 3'); drlm show; drlm export" in broken.stdout
    assert drlm(tmp_path, "verify", "--all").returncode == 1
    report = json.loads(drlm(tmp_path, "verify", episode_id, "--json").stdout)
    assert report["ok"] is False
    assert report["broken_episodes"][0]["answer_in_history"] == "NAME FOR 3"

    rebuilt = drlm(tmp_path, "audit-rebuild")
    assert rebuilt.returncode == 1, rebuilt.stdout + rebuilt.stderr
    assert text_digest(text) in rebuilt.stderr and episode_id in rebuilt.stderr


async def test_a_corrupt_conversation_blob_is_named_with_the_iteration_it_breaks(
    client: Client, scripted, store, worker
) -> None:
    blobs, engine = store
    server = scripted(root_and_sub(TURNS, lambda p: p.upper()))
    context = store_context(blobs, f"a\nb {uuid.uuid4().hex}\n")
    result = await run_episode(client, request_for(server, context=context), worker.task_queue)
    assert (await verify(client, blobs, engine, result.episode_id)).ok

    head = (await episode_timeline(client, result.episode_id)).iterations[2].conversation
    assert head is not None
    corrupt_blob(engine, head)
    report = await verify(client, blobs, engine, result.episode_id)
    (problem,) = report.problems.values()
    assert (problem.digest, problem.state) == (head, "corrupt")
    assert {(r.episode_id, r.kind) for r in problem.references} == {(result.episode_id, "conversation")}
    assert any("iteration 3" in r.what for r in problem.references)
    works = report.still_works(report.episodes[result.episode_id], {"conversation"})
    assert "drlm show" in works and "drlm export" not in works


async def test_a_missing_claim_checked_payload_breaks_the_history_but_the_answer_is_there(
    client: Client, scripted, store, worker
) -> None:
    blobs, engine = store
    long_turn = "```repl\nx = 7\n```\n" + f"thinking {uuid.uuid4().hex} " * 500  # over the claim check
    server = scripted(root_and_sub([long_turn, "FINAL_VAR(x)"]))
    result = await run_episode(client, request_for(server), worker.task_queue)
    history = await client.get_workflow_handle(result.episode_id).fetch_history()
    (digest,) = [
        e.activity_task_completed_event_attributes.result.payloads[0].data.decode()
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED
        and e.activity_task_completed_event_attributes.result.payloads[0].metadata.get("encoding")
        == CLAIM_CHECK
    ]
    delete_blob(engine, digest)
    report = await verify(client, blobs, engine, result.episode_id)
    assert not report.ok
    assert [(r.episode_id, r.kind) for r in report.problems[digest].references] == [
        (result.episode_id, "payload")
    ]
    lines = "\n".join(report.lines())
    assert "the payload of the result of drlm.root_completion" in lines
    assert "still works: the answer is in history ('7')" in lines and "drlm show" not in lines


async def test_a_childs_missing_prompt_breaks_the_child_and_its_parent(
    client: Client, scripted, store, worker
) -> None:
    blobs, engine = store
    prompt = f"child prompt {uuid.uuid4().hex}"
    server = scripted(
        by_model(
            {
                "root-m": [f"```repl\na = rlm_query({prompt!r}, model='child-m')\n```", "FINAL_VAR(a)"],
                "child-m": ["```repl\nsize = len(context)\n```", "FINAL_VAR(size)"],
            }
        )
    )
    result = await run_episode(
        client, tree_request(server, "one child", ["child-m"], max_depth=2), worker.task_queue
    )
    (child,) = result.children
    assert (await verify(client, blobs, engine, result.episode_id)).ok
    delete_blob(engine, text_digest(prompt))
    report = await verify(client, blobs, engine, result.episode_id)
    problem = report.problems[text_digest(prompt)]
    assert problem.state == "missing"
    # The parent's export needs it as the call's prompt; the child's REPL as its context.
    assert {(r.episode_id, r.kind) for r in problem.references} == {
        (result.episode_id, "prompt"),
        (child.episode_id, "context"),
    }
    assert set(report.episodes) == {result.episode_id, child.episode_id}


async def test_an_encrypted_store_is_verified_through_its_seals(
    temporal_address: str, tmp_path: Path, scripted
) -> None:
    """Payloads and blobs sealed (DRLM_ENCRYPTION_KEYS): each is opened before it is checked,
    so a sealed blob is whole and the context named inside a sealed request is found."""
    import base64

    from durable_rlm.server.connection import connect
    from durable_rlm.worker.runtime import running_workers

    queue = f"enc-{uuid.uuid4().hex[:8]}"
    settings = Settings(
        temporal_address=temporal_address,
        task_queue=queue,
        data_dir=tmp_path,
        database_url=f"sqlite:///{tmp_path / 'store.sqlite'}",
        encryption_keys="k1=" + base64.b64encode(os.urandom(32)).decode(),
        claim_check_threshold=256,
    )
    server = scripted(root_and_sub(TURNS, lambda p: p.upper()))
    text = f"sealed\ncontext {uuid.uuid4().hex}\n"
    async with connect(settings) as services, running_workers(services):
        request = request_for(server, context=store_context(services.blobs, text))
        result = await run_episode(services.client, request, queue)
        assert (await verify(services.client, services.blobs, services.engine, result.episode_id)).ok
        delete_blob(services.engine, text_digest(text))
        report = await verify(services.client, services.blobs, services.engine, result.episode_id)
    assert [(p.digest, p.state) for p in report.problems.values()] == [(text_digest(text), "missing")]
    assert not report.unreadable
