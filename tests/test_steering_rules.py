"""What a person's steering actions compute (workflows/steering.py), as pure functions: the
turn a hint joins, which limit changes are refused, the limits and deadline a change yields,
the action log's words, and which cells wait. The updates themselves, on a running episode,
are in tests/test_steering.py."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from pydantic import ValidationError

from durable_rlm.workflows import defaults, steering
from durable_rlm.workflows.models import (
    ActionRecord,
    CellDecision,
    EpisodeLimits,
    EpisodeRequest,
    LimitsUpdate,
    Message,
    ModelPrice,
    ModelSettings,
)

PRICE = ModelPrice(input_usd_per_mtok=1, output_usd_per_mtok=2)


def user(text: str) -> Message:
    return Message(role="user", content=text)


# --- hints ----------------------------------------------------------------------------------------


def test_a_hint_says_who_sent_it() -> None:
    assert steering.hint_message("ann", "look at line 3") == user(
        "A hint from ann, the person supervising this episode:\nlook at line 3"
    )


def test_hints_join_the_user_message_already_waiting() -> None:
    reply = Message(role="assistant", content="a")
    waiting = [user("task"), reply, user("Output: 3")]
    merged = steering.with_hints(waiting, [user("one"), user("two")])
    assert merged == [user("task"), reply, user("Output: 3\n\none\n\ntwo")]
    assert waiting == [user("task"), reply, user("Output: 3")]  # not changed
    assert steering.with_hints([user("Output: 3")], [user("one")]) == [user("Output: 3\n\none")]


def test_hints_make_a_user_message_of_their_own_after_another_role_or_nothing() -> None:
    after = [Message(role="assistant", content="a")]
    assert steering.with_hints(after, [user("one"), user("two")]) == [*after, user("one\n\ntwo")]
    assert steering.with_hints([], [user("one")]) == [user("one")]


def test_no_hints_leave_the_turn_as_it_is() -> None:
    waiting = [user("Output: 3")]
    assert steering.with_hints(waiting, []) is waiting


# --- limits ---------------------------------------------------------------------------------------


def request(*models: ModelSettings, sub: ModelSettings | None = None) -> EpisodeRequest:
    root, *others = models
    return EpisodeRequest(task="t", root_model=root, sub_model=sub, other_models=others)


def test_an_update_that_changes_nothing_is_refused() -> None:
    assert steering.limits_problem(request(ModelSettings(model="m")), LimitsUpdate(sender="ann")) == (
        "no limit was given; nothing to change"
    )


def test_limits_other_than_cost_need_nothing_of_the_episode() -> None:
    unpriced = request(ModelSettings(model="m"))
    assert steering.limits_problem(unpriced, LimitsUpdate(sender="ann", max_iterations=3)) is None
    assert steering.limits_problem(unpriced, LimitsUpdate(sender="ann", max_tokens=10)) is None


@pytest.mark.parametrize(
    ("episode", "unpriced"),
    [
        (request(ModelSettings(model="root")), "root"),
        (request(ModelSettings(model="root", price=PRICE), sub=ModelSettings(model="sub")), "sub"),
        (request(ModelSettings(model="root", price=PRICE), ModelSettings(model="other")), "other"),
        (
            request(ModelSettings(model="b"), ModelSettings(model="a"), ModelSettings(model="b")),
            "a, b",  # each once, sorted
        ),
    ],
)
def test_a_cost_limit_needs_a_price_for_every_model_the_episode_can_call(
    episode: EpisodeRequest, unpriced: str
) -> None:
    assert steering.limits_problem(episode, LimitsUpdate(sender="ann", max_cost_usd=1.0)) == (
        f"max_cost_usd needs a price for every model the episode can call; none for {unpriced}"
    )


def test_a_cost_limit_is_accepted_when_every_model_is_priced() -> None:
    priced = request(
        ModelSettings(model="root", price=PRICE),
        ModelSettings(model="other", price=PRICE),
        sub=ModelSettings(model="sub", price=PRICE),
    )
    assert steering.limits_problem(priced, LimitsUpdate(sender="ann", max_cost_usd=1.0)) is None


def test_a_cost_limit_accepts_a_model_that_reports_its_own_cost_as_the_request_does() -> None:
    reporting = ModelSettings(model="routed", reports_cost=True)
    # The request takes max_cost_usd for a model that reports its cost and has no price ...
    EpisodeRequest(task="t", root_model=reporting, limits=EpisodeLimits(max_cost_usd=1.0))
    # ... so a change of the limit should take it too.
    assert steering.limits_problem(request(reporting), LimitsUpdate(sender="ann", max_cost_usd=1.0)) is None


def test_changed_limits_keep_what_the_update_leaves_out() -> None:
    before = EpisodeLimits(max_iterations=5, max_llm_calls=9, max_tokens=1_000)
    after = steering.changed_limits(before, LimitsUpdate(sender="ann", max_iterations=8, max_cost_usd=0.5))
    assert after == EpisodeLimits(max_iterations=8, max_llm_calls=9, max_tokens=1_000, max_cost_usd=0.5)
    assert before.max_iterations == 5


def test_changed_limits_are_validated() -> None:
    update = LimitsUpdate.model_construct(sender="ann", max_iterations=0)  # skips its own check
    with pytest.raises(ValidationError):
        steering.changed_limits(EpisodeLimits(), update)


NOON = datetime(2030, 1, 1, 12, tzinfo=UTC)


def test_a_new_max_duration_moves_the_deadline_from_the_same_start() -> None:
    hour, two = timedelta(hours=1), timedelta(hours=2)
    assert steering.moved_deadline(NOON, hour, two, None) == NOON + hour
    assert steering.moved_deadline(NOON, two, hour, None) == NOON - hour


def test_a_childs_moved_deadline_never_passes_its_parents() -> None:
    hour, two = timedelta(hours=1), timedelta(hours=2)
    assert steering.moved_deadline(NOON, hour, two, NOON + timedelta(minutes=30)) == NOON + timedelta(
        minutes=30
    )
    assert steering.moved_deadline(NOON, hour, two, NOON + two) == NOON + hour
    assert steering.moved_deadline(NOON, two, hour, NOON) == NOON - hour


def test_the_action_log_names_each_change_with_its_old_value() -> None:
    before = EpisodeLimits(max_iterations=5, max_duration=timedelta(minutes=2))
    update = LimitsUpdate(
        sender="ann", max_iterations=8, max_duration=timedelta(seconds=90.5), max_tokens=100
    )
    assert steering.describe_changes(update, before) == (
        "max_iterations 5 -> 8, max_duration 120 s -> 90.5 s, max_tokens None -> 100"
    )
    assert steering.describe_changes(LimitsUpdate(sender="ann"), before) == ""


# --- cells that wait ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "code", "reasons"),
    [
        ("none", "import socket", None),
        ("risky", "print(1 + 1)", None),
        ("all", "print(1 + 1)", []),  # every cell waits, with no flag raised
    ],
)
def test_which_cells_wait_and_why(mode: str, code: str, reasons: list[str] | None) -> None:
    assert steering.gate(mode, code) == reasons  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["risky", "all"])
def test_a_risky_cell_waits_with_its_reasons(mode: str) -> None:
    reasons = steering.gate(mode, "import socket")  # type: ignore[arg-type]
    assert reasons and any("socket" in r for r in reasons)


@pytest.mark.parametrize(
    ("decision", "logged"),
    [
        (
            CellDecision(sender="ann", cell=3, approve=False, reason="no network"),
            ("reject", "cell 3: no network"),
        ),
        (
            CellDecision(sender="ann", cell=3, approve=True, code="print(2)"),
            ("edit", "cell 3 approved as edited (8 chars)"),
        ),
        (
            CellDecision(sender="ann", cell=3, approve=True, code="x = 1", reason="ok"),
            ("edit", "cell 3 approved as edited (5 chars)"),
        ),
        (CellDecision(sender="ann", cell=3, approve=True, reason="fine"), ("approve", "cell 3: fine")),
        (CellDecision(sender="ann", cell=3, approve=True), ("approve", "cell 3")),
    ],
)
def test_each_decision_is_logged_with_its_kind_and_detail(
    decision: CellDecision, logged: tuple[str, str]
) -> None:
    assert steering.describe_decision(decision) == logged


def action(number: int) -> ActionRecord:
    return ActionRecord(number=number, kind="hint", sender="ann", at=NOON, iteration=1)


def test_the_latest_actions_are_kept() -> None:
    assert defaults.AUDITED_ACTIONS == 500
    full = [action(n) for n in range(1, 501)]
    assert steering.keep_latest(full) == full
    assert [a.number for a in steering.keep_latest([*full, action(501)])] == list(range(2, 502))
    assert steering.keep_latest([]) == []
