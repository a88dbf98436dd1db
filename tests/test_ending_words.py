"""One vocabulary of endings (answered, extracted, no answer, failed, cancelled, terminated,
timed out), said alike by the CLI, the audit store, the page and the search attributes;
never "completed" of an episode without an answer."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from durable_rlm.audit import readonly
from durable_rlm.audit.timeline import describe_execution, ending_text, termination_text
from durable_rlm.cli import reading
from durable_rlm.store.sql import create_engine, downgrade, migrate
from durable_rlm.workflows.fallback import ExecutionResult, Failed
from durable_rlm.workflows.models import (
    ENDINGS,
    AuditEpisodeInput,
    EpisodeResult,
    TerminationDecision,
    TokenUsage,
)
from tests.test_unattended import drlm, rows

TIMELINE_COLUMNS = "episode_id, run_id, status, timeline"


def result(**fields: object) -> EpisodeResult:
    base: dict = {"answer": None, "ended_by": "final", "iterations": 3, "model_calls": 3, "sub_calls": 0}
    return EpisodeResult(usage=TokenUsage(), **{**base, **fields})


@pytest.mark.parametrize(
    ("fields", "ending", "said"),
    [
        ({"answer": "42", "answer_source": "model"}, "answered", "answered (final)"),
        ({"answer": "42", "answer_source": "policy", "ended_by": "policy"}, "answered", "answered (policy)"),
        (
            {"answer": "41", "answer_source": "extraction", "ended_by": "max_iterations"},
            "extracted",
            "extracted (max_iterations)",
        ),
        ({"ended_by": "max_iterations"}, "no_answer", "no answer (max_iterations)"),
        ({"ended_by": "policy"}, "no_answer", "no answer (policy)"),
        ({"ended_by": "model_error"}, "failed", "failed (model_error)"),
        ({"ended_by": "infrastructure_error"}, "failed", "failed (infrastructure_error)"),
        ({"ended_by": "cancelled"}, "cancelled", "cancelled"),
        ({"ended_by": "cancelled", "answer": "x", "answer_source": "extraction"}, "cancelled", "cancelled"),
    ],
)
def test_each_result_has_one_ending(fields: dict, ending: str, said: str) -> None:
    r = result(**fields)
    assert r.status == ending and ending in ENDINGS
    assert ending_text(r) == said


def test_the_lists_of_endings_agree_and_none_is_completed() -> None:
    assert readonly.ENDED == ENDINGS == reading.ENDINGS
    assert "completed" not in ENDINGS


def test_a_cancel_reads_as_a_cancel_and_a_policy_stop_names_its_iteration() -> None:
    cancelled = ExecutionResult(variant=Failed(reason="Cancelled: cancelled by request"))
    assert describe_execution(cancelled, "cancelled") == "Result: cancelled: cancelled by request"
    unextracted = ExecutionResult(variant=Failed(reason="max iterations reached (1/1); extraction failed"))
    assert describe_execution(unextracted, "no_answer").startswith("Result: no answer: max iterations")
    decision = TerminationDecision(policy="p", step=2, reason="enough", answer=None, action_type="code")
    assert termination_text(decision) == "Termination: policy p at iteration 3 (code): enough"


def test_an_audit_row_of_an_earlier_version_reads_as_its_ending() -> None:
    old = {
        "episode_id": "e",
        "run_id": "r",
        "task": "t",
        "root_model": "m",
        "status": "completed",
        "result": result(ended_by="max_iterations").model_dump(mode="json"),
    }
    assert AuditEpisodeInput.model_validate(old).status == "no_answer"
    old["result"] = result(answer="42", answer_source="model").model_dump(mode="json")
    assert AuditEpisodeInput.model_validate(old).status == "answered"


def test_the_migration_rewrites_completed_rows_to_their_endings(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'store.sqlite'}")
    migrate(engine, "0007")
    rows_before = {
        "a": ("final", "42", "model"),
        "x": ("max_iterations", "41", "extraction"),
        "n": ("max_iterations", None, "none"),
        "f": ("model_error", None, "none"),
        "c": ("cancelled", None, "none"),
    }
    with engine.begin() as conn:
        for episode_id, (ended_by, answer, source) in rows_before.items():
            conn.execute(
                sa.text(
                    "INSERT INTO episodes (episode_id, run_id, task, root_model, status, ended_by, answer,"
                    " answer_source) VALUES (:i, 'r', 't', 'm', 'completed', :e, :a, :s)"
                ),
                {"i": episode_id, "e": ended_by, "a": answer, "s": source},
            )
        timeline = {"episode_id": "n", "status": "completed", "result": result(ended_by="max_iterations")}
        conn.execute(
            sa.text(f"INSERT INTO episode_timelines ({TIMELINE_COLUMNS}) VALUES ('n', 'r', :s, :t)"),
            {"s": "completed", "t": json.dumps(timeline, default=lambda m: m.model_dump(mode="json"))},
        )
    migrate(engine)

    def statuses() -> dict[str, str]:
        with engine.connect() as conn:
            return dict(conn.execute(sa.text("SELECT episode_id, status FROM episodes")).all())

    assert statuses() == {
        "a": "answered",
        "x": "extracted",
        "n": "no_answer",
        "f": "failed",
        "c": "cancelled",
    }
    with engine.connect() as conn:
        status, text = conn.execute(sa.text("SELECT status, timeline FROM episode_timelines")).one()
    assert (status, json.loads(text)["status"]) == ("no_answer", "no_answer")
    downgrade(engine, "0007")
    assert set(statuses().values()) == {"completed", "failed", "cancelled"}
    engine.dispose()


def test_a_limit_without_an_answer_is_no_answer_everywhere(tmp_path: Path, scripted) -> None:
    """The issue's case: a limit, extraction that finds nothing, exit 3; the CLI, `show`,
    `list` and the search attribute all say "no answer"."""
    server = scripted(lambda request: "```repl\nprint(1)\n```" if not request.is_extraction else "not json")
    episode_id = f"limit-{uuid.uuid4().hex[:6]}"
    args = ("--base-url", server.base_url, "--model", "m", "--max-iterations", "1", "--id", episode_id)
    out = drlm(tmp_path, "run", "t", *args)
    assert out.returncode == 3, out.stderr
    assert "ended: no answer (max_iterations) after 1 iteration(s)" in out.stderr
    assert "completed" not in out.stderr
    shown = drlm(tmp_path, "show", episode_id)
    assert shown.stdout.splitlines()[0] == f"Episode {episode_id}: no answer (max_iterations) (1 run(s))"
    assert "Result: no answer: " in shown.stdout and "completed" not in shown.stdout
    assert rows(tmp_path)[episode_id]["status"] == "no_answer"
    listed = drlm(tmp_path, "list", "--status", "no_answer")
    assert any(line.startswith(episode_id) and " no_answer " in line for line in listed.stdout.splitlines())


def test_a_cancel_is_cancelled_everywhere(tmp_path: Path, scripted) -> None:
    server = scripted(lambda request: "FINAL(never asked)")
    episode_id = f"cancel-{uuid.uuid4().hex[:6]}"
    started = drlm(
        tmp_path, "run", "t", "--base-url", server.base_url, "--model", "m", "--id", episode_id, "--no-wait"
    )
    assert started.returncode == 0, started.stderr
    cancelled = drlm(tmp_path, "cancel", episode_id, "--reason", "changed my mind")
    assert cancelled.returncode == 0, cancelled.stderr
    err = cancelled.stderr
    # Where the cancel found it, and the count the ending gives, agree (the first iteration
    # begins, or not, in the workflow task that takes the cancel).
    accepted = re.search(
        rf"episode {episode_id}: cancel accepted (at iteration (\d+)|before its first iteration)", err
    )
    assert accepted is not None, err
    iterations = int(accepted.group(2) or 0)
    assert f"ended: cancelled after {iterations} iteration(s), 0 model call(s)" in err, err
    assert "Result: cancelled: changed my mind" in err and "history entries" not in err
    shown = drlm(tmp_path, "show", episode_id)
    assert shown.stdout.splitlines()[0] == f"Episode {episode_id}: cancelled (1 run(s))"
    again = drlm(tmp_path, "cancel", episode_id)
    assert f"episode {episode_id} has already ended (cancelled); nothing was changed" in again.stderr
    assert rows(tmp_path)[episode_id]["status"] == "cancelled"
