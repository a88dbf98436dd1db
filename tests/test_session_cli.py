"""A persistent session in `drlm show` and `drlm list` (issue 36 item 2): one session of many
turns, not one line per turn episode; `drlm show <session>-turn<k>` stays an episode's timeline."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import sqlalchemy as sa

from durable_rlm.store import schema
from durable_rlm.store.sql import create_engine
from durable_rlm.workflows import names
from tests.test_cli import drlm
from tests.test_sessions import expected, persistent_rlm, session_script

TURNS = 3


def test_show_and_list_give_a_session_of_three_turns(scripted, tmp_path: Path) -> None:
    server = scripted(session_script)
    rlm = persistent_rlm(server, tmp_path)
    answers = [rlm.completion(f"c{k}", root_prompt=f"Session step {k}").response for k in range(TURNS)]
    assert answers == [expected(k) for k in range(TURNS)]
    session_id = rlm.session_id
    assert session_id is not None
    turn_ids = [names.turn_episode_id(session_id, k) for k in range(TURNS)]
    # Open (no worker needed to read it): its turns from visibility and the store.
    open_view = json.loads(drlm(tmp_path, "show", session_id, "--json").stdout)
    assert (open_view["status"], open_view["ended_by"]) == ("running", None)
    assert [t["episode_id"] for t in open_view["turns"]] == turn_ids
    refreshed = drlm(tmp_path, "list", "--refresh")
    (line,) = [line for line in refreshed.stdout.splitlines() if line.startswith(session_id)]
    assert line.split(")", 1)[1].split()[0] == "running"
    rlm.close()

    shown = drlm(tmp_path, "show", session_id)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith(f"Session {session_id}: completed, {TURNS} turn(s), model gpt-x")
    assert "Ended by: closed" in shown.stdout
    for k, turn_id in enumerate(turn_ids):
        block = shown.stdout.split(f"=== turn {k}: {turn_id} (answered) ===")[1].split("=== turn")[0]
        assert f"Task: Session step {k}" in block
        assert f"Answer: {expected(k)}\n" in block
        assert "2 iteration(s), 2 model call(s)" in block and "ended by final_var" in block
        assert f"Timeline: drlm show {turn_id}" in block
    view = json.loads(drlm(tmp_path, "show", session_id, "--json").stdout)
    assert (view["kind"], view["status"], view["model"], view["ended_by"]) == (
        "session",
        "completed",
        "gpt-x",
        "closed",
    )
    assert [(t["turn"], t["episode_id"], t["answer"]) for t in view["turns"]] == [
        (k, turn_ids[k], expected(k)) for k in range(TURNS)
    ]
    assert view["tokens"] == sum(t["tokens"] for t in view["turns"]) > 0

    # A turn is an episode of its own, which says whose turn it is.
    turn = drlm(tmp_path, "show", turn_ids[1])
    assert turn.returncode == 0, turn.stderr
    assert f"turn 1 of session {session_id}: drlm show {session_id}" in turn.stdout
    assert "=== iteration 2 ===" in turn.stdout

    # An episode only named like a turn (no turn 0 beside it) is listed as itself.
    engine = create_engine(f"sqlite:///{tmp_path / 'drlm.sqlite'}")
    lonely = "lonely-turn3"
    with engine.begin() as conn:
        conn.execute(
            sa.insert(schema.episodes).values(
                episode_id=lonely,
                run_id="r",
                task="alone",
                root_model="m",
                status="completed",
                started_at=datetime.now(UTC),
            )
        )
    listing = drlm(tmp_path, "list")
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.splitlines()
    session_lines = [line for line in lines if line.startswith(session_id)]
    assert len(session_lines) == 1, listing.stdout
    assert f"{session_id} (session, {TURNS} turns)" in session_lines[0]
    assert f"turn {TURNS - 1} answered: 'Session step {TURNS - 1}" in session_lines[0]
    assert session_lines[0].endswith(f"-> {expected(TURNS - 1)}")
    assert not any(turn_id in listing.stdout for turn_id in turn_ids)
    assert any(line.startswith(lonely) for line in lines)

    entries = [json.loads(line) for line in drlm(tmp_path, "list", "--json").stdout.splitlines()]
    sessions = [e for e in entries if e.get("kind") == "session"]
    assert [e["session_id"] for e in sessions] == [session_id]
    (entry,) = sessions
    assert entry["turn_count"] == TURNS and entry["answer"] == expected(TURNS - 1)
    assert [t["episode_id"] for t in entry["turns"]] == turn_ids
    costs = [t["cost_usd"] for t in entry["turns"]]
    assert entry["cost_usd"] == (None if None in costs else sum(costs))
    assert entry["iterations"] == 2 * TURNS
    assert not any(e["episode_id"] in turn_ids for e in entries)
    plain = next(e for e in entries if e["episode_id"] == lonely)
    assert "kind" not in plain and plain["task"] == "alone"

    # With --refresh, the session's own status (the server's): closed is completed.
    refreshed = drlm(tmp_path, "list", "--refresh")
    assert refreshed.returncode == 0, refreshed.stderr
    (line,) = [line for line in refreshed.stdout.splitlines() if line.startswith(session_id)]
    assert line.split(")", 1)[1].split()[0] == "completed"
