"""Limits, sub-calls, inline fences and event loops: rlms's and ours, on one script each."""

from __future__ import annotations

from tests.rlms_compat.models import limits_and_calls


def test_limits_raise_rlms_s_exceptions_with_rlms_s_attributes(differential) -> None:
    run = differential("limits", limits_and_calls)
    assert run.ours.printed == run.theirs.printed
    said = "Error threshold exceeded: 2 consecutive errors (limit: 2)"
    assert run.theirs.printed[0] == f"Limit errors ErrorThresholdExceededError 2 2 {said}"
    assert any("BudgetExceededError 0.06 0.05" in line for line in run.theirs.printed)
    assert run.theirs.printed[-1] == "Limit none answered: none hit"


def test_sub_calls_have_no_cap_and_a_failed_one_is_an_error_string(differential) -> None:
    run = differential("subcalls", limits_and_calls)
    assert run.ours.printed == run.theirs.printed
    assert run.theirs.printed[0] == "Q69 B69 Error: 140"


def test_an_inline_fence_runs_and_completion_works_in_a_running_loop(differential) -> None:
    run = differential("fences_and_loops", limits_and_calls)
    assert run.ours.printed == run.theirs.printed == ["3 words", "in a running loop: 3 words"]
