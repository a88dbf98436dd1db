"""The audit store at call granularity: written live by the steps, equal to its rebuild.

Several episodes share one Temporal server and one store (SQLite, then a throwaway
PostgreSQL 15 cluster): one with sub-calls and a child episode, one that continues as new,
one whose worker process is SIGKILLed mid-call, one ended by its cost budget, and one
terminated. The live tables, rebuilt from histories alone, come back equal.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from temporalio.client import Client

from durable_rlm.audit.projection import rebuild_audit, reconcile_audit
from durable_rlm.client.episodes import start_episode
from durable_rlm.scripted import Reply, root_and_sub
from durable_rlm.store import schema
from durable_rlm.store.blobs import BlobStore, SqlBackend
from durable_rlm.store.codec import data_converter
from durable_rlm.store.sql import create_engine, downgrade, migrate
from durable_rlm.worker.runtime import EmbeddedServer
from durable_rlm.workflows import defaults
from durable_rlm.workflows.models import EpisodeLimits, ModelPrice
from tests.conftest import WorkerProcess, request_for, run_episode, workers_for
from tests.test_crash import wait_until
from tests.test_recursion import by_model, tree_request

KINDS = ("tree", "long", "killed", "costly", "ended")
BATCH = "```repl\nparts = llm_query_batched(['p1', 'p2'])\n```"
TREE = "```repl\nnote = llm_query('hello')\nkid = rlm_query('abc', model='kid-m')\n```"
COUNTING = ["```repl\ncount = globals().get('count', 0) + 1\n```"] * 4 + ["FINAL_VAR(count)"]
PRICE = ModelPrice(input_usd_per_mtok=100.0, output_usd_per_mtok=200.0)  # dear: spent in a few calls


# The PostgreSQL run is slow (22 s: a cluster of its own); the default run keeps SQLite's.
@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.slow)])
def audit_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'audit.sqlite'}"
    else:
        yield request.getfixturevalue("postgres_url")


def table_rows(engine: sa.Engine) -> dict[str, list[dict[str, Any]]]:
    """Every audit row but the time it was written, in key order."""
    dump = {}
    with engine.connect() as conn:
        for table in schema.AUDIT_TABLES:
            keys = [c for c in table.primary_key.columns]
            rows = conn.execute(sa.select(table).order_by(*keys)).mappings().all()
            dump[table.name] = [{k: v for k, v in row.items() if k != "updated_at"} for row in rows]
    return dump


@pytest.mark.slow  # long end to end (issue 34: the default run near 13 min); CI runs it
@pytest.mark.chaos
async def test_the_rebuilt_audit_store_equals_the_live_one(audit_url: str, tmp_path: Path, scripted) -> None:
    engine = create_engine(audit_url)
    downgrade(engine)
    migrate(engine)
    blobs = BlobStore(SqlBackend(engine))
    store = (blobs, engine)
    args = ("--dynamic-config-value", "limit.historyCount.suggestContinueAsNew=20")
    async with EmbeddedServer(tmp_path / "temporal.sqlite", extra_args=args) as address:
        client = await Client.connect(address, data_converter=data_converter(blobs))
        queue = f"audit-{uuid.uuid4().hex[:6]}"
        ids = {
            kind: f"{kind}-{uuid.uuid4().hex[:6]}" for kind in ("tree", "long", "killed", "costly", "ended")
        }

        # The SIGKILLed worker first: a process of its own on the same queue and store.
        killed_server = scripted(
            root_and_sub(
                [
                    "```repl\nparts = llm_query_batched(['p1', 'p2'])\n```",
                    Reply("FINAL_VAR(parts)", delay_s=4),
                ],
                lambda p: f"<{p}>",
            )
        )
        first = WorkerProcess(address, audit_url, queue)
        killed = await start_episode(client, request_for(killed_server), queue, ids["killed"])
        await wait_until(lambda: any(r.turn == 1 for r in killed_server.root_requests()))
        first.kill()  # mid-call: the root call of iteration 2 is in flight
        try:
            async with workers_for(client, store, tmp_path, queue):
                assert (await asyncio.wait_for(killed.result(), 90)).answer == "['<p1>', '<p2>']"

                tree = scripted(
                    by_model(
                        {
                            "root-m": [
                                TREE,
                                "```repl\nFINAL(f'{note} {kid}')\n```",
                            ],
                            "kid-m": ["```repl\nn = len(context)\n```", "FINAL_VAR(n)"],
                        }
                    )
                )
                result = await run_episode(
                    client, tree_request(tree, "tree", ["kid-m"], max_depth=2), queue, ids["tree"]
                )
                assert result.answer == "<hello> 3" and result.tree_episodes == 2

                counting = ["```repl\ncount = globals().get('count', 0) + 1\n```"] * 4 + ["FINAL_VAR(count)"]
                long = await run_episode(
                    client, request_for(scripted(root_and_sub(counting))), queue, ids["long"]
                )
                assert long.answer == "4"

                priced = scripted(
                    root_and_sub(["```repl\nx = 1\n```"] * 9, extract=lambda _: '{"answer": "1"}')
                )
                request = request_for(priced)
                request = request.model_copy(
                    update={
                        "root_model": request.root_model.model_copy(
                            update={"price": PRICE, "max_tokens": 50}
                        ),
                        "limits": EpisodeLimits(max_iterations=8, max_cost_usd=0.3, cell_timeout_s=10),
                    }
                )
                costly = await run_episode(client, request, queue, ids["costly"])
                assert costly.ended_by == "max_cost_usd" and costly.answer_source == "extraction", (
                    costly.usage
                )
                assert costly.usage.cost_usd is not None and costly.usage.cost_usd <= 0.3

                slow = scripted(root_and_sub([Reply("```repl\ny = 2\n```", delay_s=30)]))
                ended = await start_episode(client, request_for(slow), queue, ids["ended"])
                await wait_until(lambda: len(slow.root_requests()) == 1)
                await ended.terminate("audit test")
        finally:
            first.stop()
        assert await reconcile_audit(client, engine) == 1  # the terminated episode's row

        live = table_rows(engine)
        assert await rebuild_audit(client, engine) == 6  # five episodes and the child
        rebuilt = table_rows(engine)
        for table in live:
            assert rebuilt[table] == live[table], table

    calls = [(r["episode_id"], r["call_id"]) for r in live["audit_model_calls"]]
    assert sorted(c for e, c in calls if e == ids["killed"]) == ["root:1", "root:2", "sub:1.0", "sub:1.1"]
    child = f"{ids['tree']}/1.1"
    assert {c for e, c in calls if e == ids["tree"]} == {"root:1", "root:2", "sub:1.0"}
    assert {c for e, c in calls if e == child} == {"root:1", "root:2"}
    episodes = {r["episode_id"]: r for r in live["episodes"]}
    assert (episodes[child]["parent_id"], episodes[child]["depth"]) == (ids["tree"], 1)
    assert episodes[ids["long"]]["iterations"] == 5
    assert episodes[ids["ended"]]["status"] == "terminated"
    costly_row = episodes[ids["costly"]]
    assert (costly_row["ended_by"], costly_row["fallback_reason"]) == ("max_cost_usd", "max_cost_usd")
    assert costly_row["cost_usd"] == pytest.approx(
        sum(r["cost_usd"] for r in live["audit_model_calls"] if r["episode_id"] == ids["costly"])
    )
    cells = [r for r in live["audit_cells"] if r["episode_id"] == ids["killed"]]
    assert [(c["status"], c["sub_calls"]) for c in cells] == [("completed", 2)]
    assert cells[0]["duration_s"] is not None and cells[0]["duration_s"] >= 0
    kinds = {(r["episode_id"], r["kind"]) for r in live["audit_events"]}
    assert (ids["costly"], "fallback") in kinds and (ids["ended"], "ended") in kinds
    engine.dispose()


@pytest.mark.chaos
@pytest.mark.slow  # 45 s (the closing row's whole patience); tests/test_store_outages.py keeps the kind
async def test_a_locked_audit_store_delays_no_episode_and_a_rebuild_restores_it(
    tmp_path: Path, blobs, scripted
) -> None:
    import sqlite3
    import time

    audit = tmp_path / "locked.sqlite"
    engine = create_engine(f"sqlite:///{audit}")
    migrate(engine)
    async with EmbeddedServer(tmp_path / "temporal.sqlite") as address:
        client = await Client.connect(address, data_converter=data_converter(blobs))
        queue = f"locked-{uuid.uuid4().hex[:6]}"
        server = scripted(root_and_sub(["```repl\nx = llm_query('a')\n```", "FINAL_VAR(x)"], str.upper))
        holder = sqlite3.connect(audit, isolation_level=None)
        holder.execute("BEGIN EXCLUSIVE")  # every audit write now waits for the lock
        try:
            async with workers_for(client, (blobs, engine), tmp_path, queue):
                started = time.monotonic()
                result = await run_episode(client, request_for(server), queue, "locked-episode")
                took = time.monotonic() - started
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert result.answer == "A"
        # Four steps wait 2 s each at most, the closing row AUDIT_CLOSE_PATIENCE_S at most: not
        # the store's own 30 s a write, attempt after attempt.
        assert took < 4 * 2 + defaults.AUDIT_CLOSE_PATIENCE_S + 15, took
        await rebuild_audit(client, engine)
        rows = table_rows(engine)
    assert [r["status"] for r in rows["episodes"]] == ["answered"]
    assert [r["call_id"] for r in rows["audit_model_calls"]] == ["root:1", "root:2", "sub:1.0"]
    engine.dispose()
