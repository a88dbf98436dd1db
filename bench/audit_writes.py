"""What the call-granular audit costs a step: the rows one step writes, timed.

    python bench/audit_writes.py [--steps N] [--url sqlite:///path]

Each step of a synthetic episode (a root call, three sub-calls, a cell suspended once and
resumed) goes through `rows_of_step` and `write_rows`, the interceptor's path, on a fresh
store. Baseline in the same run: the episode row alone (what the store wrote per episode
before: one upsert). Printed: milliseconds per step, the ratio to the baseline write, and
the rebuild rate (the same rows again over a dropped store, as `drlm audit-rebuild` does
once history is read).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from durable_rlm.store import schema  # noqa: E402
from durable_rlm.store.audit_rows import episode_rows, rows_of_step, write_rows  # noqa: E402
from durable_rlm.store.sql import open_store  # noqa: E402
from durable_rlm.workflows import names  # noqa: E402
from durable_rlm.workflows.models import (  # noqa: E402
    AuditEpisodeInput,
    CellOutcome,
    ExecuteCellInput,
    ModelSettings,
    ResumeCellInput,
    RootCompletion,
    RootCompletionInput,
    SandboxRef,
    SubCallRequest,
    SubQueryInput,
    SubQueryReply,
    TokenUsage,
)

MODEL = ModelSettings(model="gpt-4o-mini")
USAGE = TokenUsage(prompt_tokens=1_200, completion_tokens=150, cost_usd=0.00027)


def iteration_steps(episode: str, n: int) -> list[tuple[str, object, object]]:
    now = datetime.now(UTC)
    box = SandboxRef(
        episode_id=episode, context=None, seed=1, log_head=None, cell_timeout_s=10, output_truncation=1000
    )
    reply = RootCompletion(
        text="```repl\nx = llm_query_batched(p)\n```" * 5,
        conversation="c",
        usage=USAGE,
        model_time_s=0.8,
        started_at=now,
        prompt_digest="sha256:" + "0" * 64,
    )
    steps: list[tuple[str, object, object]] = [
        (
            names.ROOT_COMPLETION,
            RootCompletionInput(episode_id=episode, iteration=n, model=MODEL, conversation="c", append=[]),
            reply,
        )
    ]
    requests = [SubCallRequest(call_index=i, prompt="p" * 500, prompt_digest="d") for i in range(3)]
    steps.append(
        (
            names.REPL_EXECUTE,
            ExecuteCellInput(sandbox=box, iteration=n, cell_index=n, code="x = 1\n" * 20),
            CellOutcome(
                status="suspended",
                log_head="h",
                worker_queue="q",
                requests=requests,
                started_at=now,
                ended_at=now,
            ),
        )
    )
    for i in range(3):
        steps.append(
            (
                names.SUB_QUERY,
                SubQueryInput(
                    episode_id=episode, iteration=n, cell_index=n, call_index=i, model=MODEL, prompt="p" * 500
                ),
                SubQueryReply(text="answer " * 30, usage=USAGE, model_time_s=0.5, started_at=now),
            )
        )
    steps.append(
        (
            names.REPL_RESUME,
            ResumeCellInput(sandbox=box, cell_index=n, answers=[]),
            CellOutcome(
                status="completed",
                log_head="h",
                worker_queue="q",
                stdout="out\n" * 50,
                started_at=now,
                ended_at=now,
            ),
        )
    )
    return steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--url")
    args = parser.parse_args()
    url = args.url or f"sqlite:///{tempfile.mkdtemp(prefix='drlm-bench-')}/audit.sqlite"
    engine = open_store(url)
    record = AuditEpisodeInput(episode_id="bench", run_id="r", task="t", root_model="m", status="running")

    baseline = []
    for _ in range(args.iterations):
        started = time.perf_counter()
        write_rows(engine, episode_rows(record))
        baseline.append(time.perf_counter() - started)

    per_step, all_rows = [], []
    for n in range(1, args.iterations + 1):
        for activity, arg, result in iteration_steps("bench", n):
            rows = rows_of_step("bench", activity, arg, result)
            all_rows.append(rows)
            started = time.perf_counter()
            write_rows(engine, rows)
            per_step.append(time.perf_counter() - started)

    with engine.begin() as conn:
        for table in schema.AUDIT_TABLES:
            conn.execute(table.delete())
    started = time.perf_counter()
    for rows in all_rows:
        write_rows(engine, rows)
    rebuild_s = time.perf_counter() - started

    base_ms = statistics.median(baseline) * 1e3
    step_ms = statistics.median(per_step) * 1e3
    p95 = sorted(per_step)[int(len(per_step) * 0.95)] * 1e3
    print(f"store: {engine.url.render_as_string(hide_password=True)}")
    print(f"baseline (the episode row alone): median {base_ms:.2f} ms")
    print(
        f"one step's audit rows: median {step_ms:.2f} ms, p95 {p95:.2f} ms "
        f"({step_ms / base_ms:.2f}x the baseline); {len(per_step)} steps"
    )
    print(
        f"rebuild writes: {len(all_rows) / rebuild_s:,.0f} steps/s "
        f"({args.iterations} iterations in {rebuild_s:.2f} s; reading history not included)"
    )
    engine.dispose()


if __name__ == "__main__":
    main()
