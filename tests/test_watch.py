"""`drlm watch`'s live view and `drlm list`'s filters, on real episodes and a real store."""

from __future__ import annotations

import asyncio
import os
import pty
import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from rich.console import Console

from durable_rlm.audit.readonly import EpisodeFilter, episode_rows, parse_moment
from durable_rlm.client.episodes import start_episode
from durable_rlm.scripted import Reply, root_and_sub
from durable_rlm.store import schema
from durable_rlm.store.sql import open_store
from durable_rlm.viewer.live import frame
from durable_rlm.workflows.display import progress_cost
from durable_rlm.workflows.models import (
    EpisodeCarry,
    EpisodeLimits,
    EpisodeProgress,
    EpisodeRequest,
    EpisodeResult,
    ModelPrice,
    ModelSettings,
)
from tests.test_crash import wait_until

DRLM = str(Path(sys.executable).with_name("drlm"))
PRICE = ModelPrice(input_usd_per_mtok=2.5, output_usd_per_mtok=10.0)
TURNS = [
    Reply("```repl\nwords = context.split() if 'context' in globals() else []\nprint('cell one ran')\n```"),
    Reply("```repl\nanswer = 'forty-two'\nprint(answer)\n```", delay_s=3),
    "FINAL_VAR(answer)",
]


def priced_request(server, limits: EpisodeLimits | None = None):  # noqa: ANN001, ANN201
    from tests.conftest import request_for

    request = request_for(server)
    model = request.root_model.model_copy(update={"price": PRICE})
    return request.model_copy(update={"root_model": model, "limits": limits or request.limits})


def text_of(progress: EpisodeProgress, episode_id: str) -> str:
    console = Console(record=True, width=110, force_terminal=False)
    console.print(frame(episode_id, progress))
    return console.export_text()


async def test_the_live_view_shows_each_budget_of_a_running_episode(client, worker, scripted) -> None:
    server = scripted(root_and_sub(TURNS))
    limits = EpisodeLimits(max_iterations=8, max_tokens=50_000, max_cost_usd=0.5, cell_timeout_s=10)
    episode_id = f"watched-{uuid.uuid4().hex[:6]}"
    handle = await start_episode(client, priced_request(server, limits), worker.task_queue, episode_id)
    await wait_until(lambda: len(server.root_requests()) == 2)  # iteration 2's call is in flight
    progress = await handle.query("progress", result_type=EpisodeProgress)
    screen = text_of(progress, episode_id)
    assert progress.iteration == 2 and progress.tokens > 0 and progress.cost_usd and progress.cost_usd > 0
    assert "waiting for the root model" in screen
    assert "2 / 8" in screen  # iterations against max_iterations
    assert f"{progress.tokens:,} / 50,000" in screen
    assert f"${progress.cost_usd:.4f} / $0.5000" in screen
    assert "(no limit)" in screen  # max_model_calls was not set
    assert "cell one ran" in screen  # the last output
    assert (await handle.result()).answer == "forty-two"


def test_an_unpriced_model_shows_an_unknown_cost() -> None:
    progress = EpisodeProgress(
        iteration=1, phase="cell 1", model_calls=1, sub_calls=0, cost_usd=None, limits=EpisodeLimits()
    )
    assert "unknown (a model has no price)" in text_of(progress, "e")


@pytest.mark.parametrize(
    ("price", "cost"), [(None, None), (ModelPrice(input_usd_per_mtok=1, output_usd_per_mtok=1), 0.0)]
)
def test_before_any_call_the_cost_is_zero_only_for_priced_models(
    price: ModelPrice | None, cost: float | None
) -> None:
    """No call yet is $0 for a priced model, and still unknown for one with no price (it will
    be called): the progress query says which, from the episode's first moment."""
    request = EpisodeRequest(task="t", root_model=ModelSettings(model="m", price=price))
    for state in (None, EpisodeCarry(seed=1, deadline=datetime(2030, 1, 1, tzinfo=UTC))):
        assert progress_cost(request, state) == cost


@pytest.mark.slow  # long end to end (the default run stays near 13 minutes); CI runs it
async def test_drlm_watch_on_a_terminal_draws_the_view_and_exits_with_the_runs_code(
    client, worker, scripted, temporal_address: str, session_dir: Path
) -> None:
    server = scripted(root_and_sub(TURNS))
    episode_id = f"tty-{uuid.uuid4().hex[:6]}"
    await start_episode(client, priced_request(server), worker.task_queue, episode_id)
    controller, terminal = pty.openpty()  # stderr is a terminal: the live view is drawn
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "DRLM_"))}
    env.update(
        TEMPORAL_ADDRESS=temporal_address,
        DRLM_DATABASE_URL=f"sqlite:///{session_dir / 'drlm.sqlite'}",
        DRLM_DATA_DIR=str(session_dir),
        COLUMNS="120",
    )
    watcher = subprocess.Popen(
        [DRLM, "watch", episode_id], stdout=subprocess.PIPE, stderr=terminal, env=env, text=True
    )
    os.close(terminal)
    drawn = bytearray()

    def read_terminal() -> None:
        while True:
            try:
                chunk = os.read(controller, 65_536)
            except OSError:
                return
            if not chunk:
                return
            drawn.extend(chunk)

    reader = asyncio.get_running_loop().run_in_executor(None, read_terminal)
    stdout = await asyncio.get_running_loop().run_in_executor(
        None, lambda: watcher.communicate(timeout=90)[0]
    )
    await reader
    os.close(controller)
    screen = drawn.decode(errors="replace")
    assert watcher.returncode == 0, screen
    assert stdout.strip() == "forty-two"
    for label in (
        "iterations",
        "model calls",
        "tokens",
        "cost",
        "last response",
        "ended: answered (final_var)",
    ):
        assert label in screen, label


def test_list_filters_by_status_model_time_and_cost(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'list.sqlite'}"
    engine = open_store(url)
    now = datetime.now(UTC)
    rows = [
        ("cheap-new", "completed", "gpt-4o-mini", 0.01, now - timedelta(hours=1), None),
        ("dear-old", "completed", "gpt-4o", 3.5, now - timedelta(days=10), None),
        ("dear-new", "failed", "gpt-4o", 2.5, now - timedelta(hours=2), None),
        ("unpriced", "completed", "local-llama", None, now - timedelta(hours=3), None),
        ("dear-new/1.0", "completed", "gpt-4o", 1.0, now - timedelta(hours=2), "dear-new"),
    ]
    with engine.begin() as conn:
        for episode_id, status, model, cost, started, parent in rows:
            conn.execute(
                schema.episodes.insert().values(
                    episode_id=episode_id,
                    run_id="r",
                    task=f"task of {episode_id}",
                    root_model=model,
                    status=status,
                    cost_usd=cost,
                    started_at=started,
                    parent_id=parent,
                    depth=1 if parent else 0,
                )
            )

    def ids(**where: object) -> list[str]:
        return [r.episode_id for r in episode_rows(engine, 20, EpisodeFilter(**where))]  # type: ignore[arg-type]

    assert ids() == ["cheap-new", "dear-new", "dear-new/1.0", "unpriced", "dear-old"]  # newest first
    assert ids(min_cost=2.0) == ["dear-new", "dear-old"]  # "spent more than $2"
    assert ids(min_cost=2.0, since=parse_moment("7d")) == ["dear-new"]  # "... last week"
    assert ids(status="completed", model="gpt-4o") == ["dear-new/1.0", "dear-old"]
    assert ids(max_cost=0.5) == ["cheap-new"]  # unknown cost is not "cheap"
    assert ids(until=parse_moment("1d"), roots_only=True) == ["dear-old"]

    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "DRLM_", "TEMPORAL_"))}
    env.update(DRLM_DATABASE_URL=url, DRLM_DATA_DIR=str(tmp_path), COLUMNS="200")
    listed = subprocess.run(
        [DRLM, "list", "--min-cost", "2", "--since", "7d"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].split()[:4] == ["episode", "status", "ended", "by"]
    assert len(lines) == 2 and lines[1].split()[:2] == ["dear-new", "failed"] and "2.5000" in lines[1]
    none = subprocess.run([DRLM, "list", "--model", "nope"], env=env, capture_output=True, text=True)
    assert (none.returncode, none.stdout, none.stderr) == (0, "", "no episodes match these filters\n")
    bad = subprocess.run([DRLM, "list", "--since", "yesterday"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "neither a date or time" in bad.stderr
    engine.dispose()


async def test_the_progress_query_reports_tokens_and_cost_at_the_end(client, worker, scripted) -> None:
    server = scripted(root_and_sub(["FINAL(done)"]))
    handle = await start_episode(
        client, priced_request(server), worker.task_queue, f"p-{uuid.uuid4().hex[:6]}"
    )
    result: EpisodeResult = await handle.result()
    progress = await handle.query("progress", result_type=EpisodeProgress)
    assert progress.finished and progress.tokens == result.usage.total_tokens
    assert (
        progress.cost_usd
        == result.usage.cost_usd
        == PRICE.cost(result.usage.prompt_tokens, result.usage.completion_tokens)
    )


def test_sql_the_readme_shows_runs_on_the_audit_tables(tmp_path: Path) -> None:
    engine = open_store(f"sqlite:///{tmp_path / 'q.sqlite'}")
    with engine.connect() as conn:
        conn.execute(sa.text(README_QUERY)).all()  # the README's query is valid on the schema
    engine.dispose()


README_QUERY = """
SELECT e.episode_id, e.ended_by, e.cost_usd, c.call_id, c.model, c.prompt_tokens,
       c.completion_tokens, c.cost_usd AS call_cost, c.latency_s
FROM episodes e JOIN audit_model_calls c ON c.episode_id = e.episode_id
WHERE e.cost_usd > 2 AND e.started_at >= datetime('now', '-7 days')
ORDER BY e.episode_id, c.started_at
"""


def test_list_reads_a_store_from_before_the_audit_columns(tmp_path: Path) -> None:
    from durable_rlm.store.sql import create_engine, migrate

    url = f"sqlite:///{tmp_path / 'old.sqlite'}"
    engine = create_engine(url)
    migrate(engine, "0003")  # a user's store, not migrated since
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO episodes (episode_id, run_id, task, root_model, status, updated_at) "
                "VALUES ('old-one', 'r', 'an old task', 'gpt-4o', 'completed', CURRENT_TIMESTAMP)"
            )
        )
    engine.dispose()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "DRLM_", "TEMPORAL_"))}
    env.update(DRLM_DATABASE_URL=url, DRLM_DATA_DIR=str(tmp_path), COLUMNS="200")
    listed = subprocess.run([DRLM, "list"], env=env, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and "old-one" in listed.stdout, listed
    filtered = subprocess.run([DRLM, "list", "--min-cost", "1"], env=env, capture_output=True, text=True)
    assert filtered.returncode == 2 and "drlm list --refresh" in filtered.stderr, filtered
