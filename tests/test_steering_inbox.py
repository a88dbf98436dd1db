"""The steering updates' rules and effects (workflows/steering_inbox.py), on the inbox
alone: what each update is refused for, what it changes, what its receipt says and how the
action log numbers it. The same updates on a running episode are in tests/test_steering.py."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from durable_rlm.workflows.models import (
    CellDecision,
    EpisodeCarry,
    EpisodeLimits,
    EpisodeRequest,
    FinishUpdate,
    HintUpdate,
    LimitsUpdate,
    Message,
    ModelSettings,
    PauseUpdate,
    PendingCell,
    ResumeUpdate,
)
from durable_rlm.workflows.steering_inbox import Moment, SteeringInbox

START = datetime(2026, 1, 1, tzinfo=UTC)


def at(seconds: float, iteration: int = 3) -> Moment:
    return Moment(episode_id="ep", at=START + timedelta(seconds=seconds), iteration=iteration)


def request(max_duration_s: float = 600) -> EpisodeRequest:
    return EpisodeRequest(
        task="t",
        root_model=ModelSettings(model="m"),
        limits=EpisodeLimits(max_duration=timedelta(seconds=max_duration_s)),
    )


def state(deadline_s: float = 600) -> EpisodeCarry:
    return EpisodeCarry(seed=1, deadline=START + timedelta(seconds=deadline_s))


def waiting(inbox: SteeringInbox, cell: int = 2) -> SteeringInbox:
    inbox.pending_cell = PendingCell(
        episode_id="ep", cell=cell, iteration=1, code="x = 1", reasons=[], mode="all", since=START
    )
    return inbox


class Moves:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> None:
        self.count += 1


# --- refusals -------------------------------------------------------------------------------------


def test_every_update_is_refused_once_the_episode_is_over() -> None:
    inbox = waiting(SteeringInbox())
    refusals = [
        lambda: inbox.refuse_if_over("hint", over=True),
        lambda: inbox.refuse_limits(LimitsUpdate(sender="ann", max_iterations=3), request(), state(), True),
        lambda: inbox.refuse_pause(over=True),
        lambda: inbox.refuse_finish(over=True),
        lambda: inbox.refuse_decision(CellDecision(sender="ann", cell=2, approve=True), over=True),
    ]
    for refuse in refusals:
        with pytest.raises(ValueError, match="already ended or is closing"):
            refuse()


def test_a_limit_change_waits_until_the_episode_has_its_state() -> None:
    inbox = SteeringInbox()
    update = LimitsUpdate(sender="ann", max_iterations=3)
    with pytest.raises(ValueError, match="the episode is starting"):
        inbox.refuse_limits(update, None, None, over=False)
    with pytest.raises(ValueError, match="no limit was given"):
        inbox.refuse_limits(LimitsUpdate(sender="ann"), request(), state(), over=False)
    inbox.refuse_limits(update, request(), state(), over=False)


def test_a_second_pause_and_a_pause_after_answer_now_are_refused() -> None:
    inbox = SteeringInbox()
    inbox.refuse_pause(over=False)
    inbox.pause(PauseUpdate(sender="ann"), at(0))
    with pytest.raises(ValueError, match=r"already paused \(by ann\)"):
        inbox.refuse_pause(over=False)
    asked = SteeringInbox()
    asked.finish_now(FinishUpdate(sender="bob"), at(0))
    with pytest.raises(ValueError, match="asked to answer now; there is nothing to pause"):
        asked.refuse_pause(over=False)
    with pytest.raises(ValueError, match=r"already asked to answer now \(by bob\)"):
        asked.refuse_finish(over=False)


def test_resume_is_refused_unless_paused_and_names_a_key_wait() -> None:
    inbox = SteeringInbox()
    with pytest.raises(ValueError, match="^it is not paused$"):
        inbox.refuse_resume(over=False, waits_for_key=False)
    with pytest.raises(ValueError, match=r"it is not paused; it waits for a fixed key \(retry_credentials\)"):
        inbox.refuse_resume(over=False, waits_for_key=True)
    inbox.pause(PauseUpdate(sender="ann"), at(0))
    inbox.refuse_resume(over=False, waits_for_key=False)


def test_a_decision_is_refused_for_a_cell_that_does_not_wait() -> None:
    inbox = SteeringInbox()
    decision = CellDecision(sender="ann", cell=2, approve=True)
    with pytest.raises(ValueError, match="no cell waits for approval"):
        inbox.refuse_decision(decision, over=False)
    waiting(inbox, cell=4)
    with pytest.raises(ValueError, match="cell 2 does not wait for approval; cell 4 does"):
        inbox.refuse_decision(decision, over=False)
    waiting(inbox, cell=2)
    inbox.refuse_decision(decision, over=False)
    inbox.decide_cell(decision, at(0))
    with pytest.raises(ValueError, match="no cell waits for approval"):  # already decided
        inbox.refuse_decision(decision, over=False)


# --- effects and receipts -------------------------------------------------------------------------


def test_a_hint_waits_for_the_next_turn_and_is_numbered() -> None:
    inbox = SteeringInbox()
    receipt = inbox.hint(HintUpdate(sender="ann", text="look at line 3"), at(5))
    assert inbox.hints == [
        Message(role="user", content="A hint from ann, the person supervising this episode:\nlook at line 3")
    ]
    assert (receipt.episode_id, receipt.iteration, receipt.action) == ("ep", 3, 1)
    assert receipt.message == "hint accepted at iteration 3: the model reads it on its next turn"
    [logged] = inbox.actions
    assert (logged.kind, logged.sender, logged.detail, logged.at) == (
        "hint",
        "ann",
        "look at line 3",
        at(5).at,
    )


def test_new_limits_are_the_requests_and_a_new_max_duration_moves_the_deadline_and_the_timer() -> None:
    the_request, the_state, moves = request(max_duration_s=600), state(deadline_s=600), Moves()
    update = LimitsUpdate(sender="ann", max_iterations=7, max_duration=timedelta(seconds=900))
    receipt = SteeringInbox().set_limits(update, the_request, the_state, at(1), moves)
    assert the_request.limits.max_iterations == 7
    assert the_state.deadline == START + timedelta(seconds=900)
    assert moves.count == 1
    assert receipt.message.endswith(", from the next step boundary")
    assert "max_iterations" in receipt.message and "600 s -> 900 s" in receipt.message


def test_new_limits_without_a_duration_leave_the_deadline_and_the_timer() -> None:
    the_state, moves = state(deadline_s=600), Moves()
    update = LimitsUpdate(sender="ann", max_iterations=7)
    SteeringInbox().set_limits(update, request(), the_state, at(1), moves)
    assert the_state.deadline == START + timedelta(seconds=600)
    assert moves.count == 0


def test_a_pause_that_holds_the_clock_moves_the_deadline_by_its_length_on_resume() -> None:
    inbox, the_state, moves = SteeringInbox(), state(deadline_s=600), Moves()
    paused = inbox.pause(PauseUpdate(sender="ann", hold_clock=True, reason="lunch"), at(10))
    assert inbox.clock_held()
    assert inbox.held_description() == "paused by ann: lunch"
    assert paused.message.endswith("pauses at the next step boundary; max_duration stops counting")
    assert inbox.actions[-1].detail == "lunch (max_duration stops counting)"
    resumed = inbox.resume(ResumeUpdate(sender="bob"), the_state, at(70), moves)
    assert the_state.deadline == START + timedelta(seconds=660)
    assert moves.count == 1
    assert inbox.held is None and inbox.held_since is None and not inbox.clock_held()
    assert inbox.actions[-1].detail == "after 60 s paused"
    assert (resumed.action, resumed.message) == (
        2,
        "resume accepted at iteration 3: goes on (its REPL is rebuilt from the log)",
    )


def test_a_pause_that_lets_the_clock_run_leaves_the_deadline_on_resume() -> None:
    inbox, the_state, moves = SteeringInbox(), state(deadline_s=600), Moves()
    inbox.pause(PauseUpdate(sender="ann"), at(10))
    assert not inbox.clock_held()
    assert inbox.actions[-1].detail == "(max_duration keeps counting)"
    inbox.resume(ResumeUpdate(sender="ann"), the_state, at(70), moves)
    assert the_state.deadline == START + timedelta(seconds=600)
    assert moves.count == 0


def test_answer_now_ends_a_cells_wait() -> None:
    inbox = waiting(SteeringInbox())
    assert not inbox.gate_moved()
    receipt = inbox.finish_now(FinishUpdate(sender="ann", reason="enough"), at(0))
    assert inbox.gate_moved()
    assert (
        receipt.message == "finish accepted at iteration 3: answers by extraction at the next step boundary"
    )


@pytest.mark.parametrize(
    ("decision", "kind", "effect"),
    [
        (CellDecision(sender="ann", cell=2, approve=True), "approve", "cell 2 runs"),
        (CellDecision(sender="ann", cell=2, approve=True, code="y = 2"), "edit", "cell 2 runs"),
        (
            CellDecision(sender="ann", cell=2, approve=False, reason="no"),
            "reject",
            "cell 2 is not run; the model reads the reason",
        ),
    ],
)
def test_a_decision_is_kept_for_the_loop_and_logged_by_its_kind(
    decision: CellDecision, kind: str, effect: str
) -> None:
    inbox = waiting(SteeringInbox())
    receipt = inbox.decide_cell(decision, at(0))
    assert inbox.decision == decision and inbox.gate_moved()
    assert inbox.actions[-1].kind == kind
    assert receipt.message == f"{kind} accepted at iteration 3: {effect}"


def test_actions_that_came_before_the_run_follow_the_carried_ones() -> None:
    inbox = SteeringInbox()
    inbox.hint(HintUpdate(sender="ann", text="early"), at(0))
    carried = SteeringInbox()
    carried.hint(HintUpdate(sender="bob", text="carried"), at(0))
    inbox.carry_over(carried.actions, 5, carried.hints)
    assert [a.number for a in inbox.actions] == [1, 6]
    assert inbox.actions_total == 6
    assert [h.content.rsplit("\n", 1)[-1] for h in inbox.hints] == ["carried", "early"]
