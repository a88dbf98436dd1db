"""Persistent sessions, rlms's and ours, on one script."""

from __future__ import annotations

from tests.rlms_compat.models import TURN_ANSWERS, persistent_turns


def test_each_turn_of_a_persistent_session_answers_for_itself(differential) -> None:
    run = differential("persistent_turns", persistent_turns)
    assert run.theirs.printed == TURN_ANSWERS + [f"with: {a}" for a in TURN_ANSWERS]
    assert run.ours.printed == run.theirs.printed
    assert run.ours.model_calls == run.theirs.model_calls == 12  # two root calls per turn
