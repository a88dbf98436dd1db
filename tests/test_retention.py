"""Retention (`drlm gc`): blobs only histories gone past retention named are removed; a blob a
live history, a snapshot a fork or a rebuild may load, or a fork still needs, never is; and
`drlm verify --all` passes after it. On a server and a store of this test's own, so that the
walk sees only what the test made."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.workflowservice.v1 import DeleteWorkflowExecutionRequest
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from durable_rlm.audit.gc import collect_garbage, schedule_collection
from durable_rlm.audit.timeline import episode_timeline
from durable_rlm.audit.timeline_store import store_timeline
from durable_rlm.audit.verify import verify
from durable_rlm.client.episodes import store_context
from durable_rlm.scripted import root_and_sub
from durable_rlm.settings import Settings
from durable_rlm.store import schema
from durable_rlm.store.blobs import BlobNotFound, BlobStore, SqlBackend
from durable_rlm.store.chunks import CHUNK_BYTES
from durable_rlm.store.codec import data_converter
from durable_rlm.store.sql import open_store
from durable_rlm.timetravel.fork import fork_episode
from durable_rlm.worker.runtime import EmbeddedServer
from durable_rlm.workflows import names
from durable_rlm.workflows.retention import GcSummary
from tests.conftest import request_for, run_episode, workers_for

TURNS = [
    "```repl\nx = len(context)\nprint('x is', x)\n```",
    "```repl\ny = x % 97\nhalf = llm_query(f'half of {y}')\nprint(half)\n```",
    "```repl\nz = int(half) + 1\nprint(z)\n```",
    "FINAL_VAR(z)",
]


def _halves(prompt: str) -> str:
    return str(int(prompt.rsplit(" ", 1)[-1]) // 2)


class Deployment:
    def __init__(self, client: Client, blobs: BlobStore, engine: sa.Engine, directory: Path) -> None:
        self.client, self.blobs, self.engine, self.directory = client, blobs, engine, directory


@pytest.fixture
async def deployment(tmp_path: Path) -> AsyncIterator[Deployment]:
    engine = open_store(f"sqlite:///{tmp_path / 'drlm.sqlite'}")
    blobs = BlobStore(SqlBackend(engine), cache_entries=0)
    async with EmbeddedServer(tmp_path / "temporal.sqlite") as address:
        client = await Client.connect(address, data_converter=data_converter(blobs))
        yield Deployment(client, blobs, engine, tmp_path)
    engine.dispose()


def _age_everything(engine: sa.Engine) -> None:
    """Every blob written two days ago: from here on only a reference keeps one."""
    with engine.begin() as conn:
        conn.execute(sa.text("update blobs set created_at = datetime('now', '-2 days')"))


async def _delete_history(client: Client, workflow_id: str) -> None:
    """What the server does to a closed workflow once the namespace's retention has passed."""
    await client.workflow_service.delete_workflow_execution(
        DeleteWorkflowExecutionRequest(
            namespace=client.namespace, workflow_execution=WorkflowExecution(workflow_id=workflow_id)
        )
    )
    for _ in range(600):  # the server deletes in the background
        try:
            await client.get_workflow_handle(workflow_id).describe()
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                return
            raise
        await asyncio.sleep(0.1)
    raise AssertionError(f"{workflow_id} was not deleted")


@pytest.mark.slow  # the dev server deletes a history in the background: ~32 s here
async def test_gc_after_a_fork_keeps_what_the_fork_needs_and_verify_passes(
    deployment: Deployment, scripted: Any
) -> None:
    client, blobs, engine = deployment.client, deployment.blobs, deployment.engine
    queue = f"gc-{uuid.uuid4().hex[:8]}"
    server = scripted(root_and_sub(TURNS, _halves))
    context = ("a line of the source's context\n" * (CHUNK_BYTES // 15))[: CHUNK_BYTES + 1000]
    async with workers_for(client, (blobs, engine), deployment.directory, queue):
        ref = store_context(blobs, context)
        assert ref.digest.startswith("sha256m:")  # a context of chunks and a manifest
        source_id = f"gc-src-{uuid.uuid4().hex[:6]}"
        source = await run_episode(client, request_for(server, context=ref), queue, source_id)
        assert source.answer == str((len(context) % 97) // 2 + 1)
        settings = Settings(task_queue=queue, data_dir=deployment.directory)
        handle, _ = await fork_episode(client, queue, source_id, 2, settings=settings)
        fork = await handle.result()
        assert fork.answer == source.answer

        orphan = blobs.put(b"written by a client that never started its episode " + uuid.uuid4().bytes)
        big_orphan = blobs.put_stream([b"o" * (CHUNK_BYTES + 5)]).digest
        # `drlm show` kept the source's timeline (it names the source's blobs too).
        timeline = await episode_timeline(client, source_id)
        assert store_timeline(
            engine, timeline, (await client.get_workflow_handle(source_id).describe()).run_id
        )
        _age_everything(engine)
        await _delete_history(client, source_id)  # the source passed retention; the fork did not

        dry = await collect_garbage(client, blobs, engine, timedelta(hours=1), dry_run=True)
        assert dry.removed >= 4 and blobs.get(orphan)  # counted, nothing removed
        report = await collect_garbage(client, blobs, engine, timedelta(hours=1))
        assert report.removed == dry.removed and report.expired_timelines == 1
        for gone in (orphan, big_orphan):
            with pytest.raises(BlobNotFound):
                blobs.get(gone)

        checked = await verify(client, blobs, engine)
        assert checked.ok, checked.lines()
        assert source_id not in checked.episodes and handle.id in checked.episodes
        assert checked.chunks == 2  # the context's chunks, read and checked after the sweep
        with engine.connect() as conn:
            expired = conn.execute(
                sa.select(schema.episode_timelines.c.blobs_expired_at).where(
                    schema.episode_timelines.c.episode_id == source_id
                )
            ).scalar_one()
        assert expired is not None

        # The fork's REPL is rebuilt from what the source left (cell log, context, replies):
        # a fork of the fork, before its last iteration, runs to the same answer.
        again, _ = await fork_episode(client, queue, handle.id, 3, settings=settings)
        assert (await again.result()).answer == source.answer
        assert (await verify(client, blobs, engine)).ok


async def test_a_young_unnamed_blob_and_an_old_named_one_both_stay(
    deployment: Deployment, scripted: Any
) -> None:
    client, blobs, engine = deployment.client, deployment.blobs, deployment.engine
    queue = f"gc-{uuid.uuid4().hex[:8]}"
    server = scripted(root_and_sub(TURNS, _halves))
    async with workers_for(client, (blobs, engine), deployment.directory, queue):
        ref = store_context(blobs, "a live episode's context")
        await run_episode(client, request_for(server, context=ref), queue)
        _age_everything(engine)
        young = blobs.put(b"a context stored a moment ago, its episode not started yet")
        # A local step's start markers (activities/attempts.py) are named by no history: once
        # old they are all that goes.
        markers = {
            b.digest
            for b in blobs.backend.listing()
            if blobs.get(b.digest).startswith(b"drlm-local-step-start")
        }
        report = await collect_garbage(client, blobs, engine, timedelta(hours=1))
        assert report.kept_young == 1 and report.removed == len(markers) > 0
        assert (await verify(client, blobs, engine)).ok
        assert blobs.get(young) and blobs.get_text(ref.digest) == "a live episode's context"


async def test_a_temporal_schedule_runs_the_collection_on_a_worker(deployment: Deployment) -> None:
    client, blobs, engine = deployment.client, deployment.blobs, deployment.engine
    queue = f"gc-{uuid.uuid4().hex[:8]}"
    async with workers_for(client, (blobs, engine), deployment.directory, queue):
        orphan = blobs.put(b"nobody names this " + uuid.uuid4().bytes)
        _age_everything(engine)
        said = await schedule_collection(client, queue, timedelta(hours=6), timedelta(hours=1))
        assert "created" in said
        assert "updated" in await schedule_collection(client, queue, timedelta(hours=12), timedelta(hours=1))
        schedule = client.get_schedule_handle(names.GC_SCHEDULE_ID)
        await schedule.trigger()
        for _ in range(300):
            runs = (await schedule.describe()).info.recent_actions
            if runs:
                break
            await asyncio.sleep(0.1)
        run = client.get_workflow_handle(
            runs[0].action.workflow_id, run_id=runs[0].action.first_execution_run_id, result_type=GcSummary
        )
        summary = await run.result()
        assert summary.removed == 1 and not summary.dry_run
        with pytest.raises(BlobNotFound):
            blobs.get(orphan)
        await schedule.delete()


async def test_verify_names_a_corrupt_or_missing_chunk_of_a_large_context(
    deployment: Deployment, scripted: Any
) -> None:
    client, blobs, engine = deployment.client, deployment.blobs, deployment.engine
    queue = f"gc-{uuid.uuid4().hex[:8]}"
    server = scripted(root_and_sub(TURNS, _halves))
    async with workers_for(client, (blobs, engine), deployment.directory, queue):
        ref = store_context(blobs, "x" * (CHUNK_BYTES + 10))
        episode_id = f"verify-{uuid.uuid4().hex[:6]}"
        await run_episode(client, request_for(server, context=ref), queue, episode_id)
    manifest = blobs.manifest(ref.digest)
    assert manifest is not None
    second = manifest.chunks[1][0]
    with engine.begin() as conn:
        conn.execute(sa.text("update blobs set data = :d where digest = :k"), {"d": b"y" * 10, "k": second})
    report = await verify(client, blobs, engine)
    problem = report.problems[ref.digest]
    assert problem.state == "corrupt" and second in problem.detail
    assert {r.episode_id for r in problem.references} == {episode_id}
    with engine.begin() as conn:
        conn.execute(sa.text("delete from blobs where digest = :k"), {"k": second})
    report = await verify(client, blobs, engine)
    assert report.problems[ref.digest].state == "missing" and second in report.problems[ref.digest].detail
