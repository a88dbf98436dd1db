"""The rewards a running episode was sent (workflows/reward_inbox.py): counted, summed until a
decision reads them, the latest kept for the audit, and carried by a continue-as-new. The
`reward` update on a running episode is in tests/test_episode.py."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from durable_rlm.workflows import defaults
from durable_rlm.workflows.models import EpisodeCarry, RewardRecord, RewardUpdate
from durable_rlm.workflows.reward_inbox import RewardInbox


def test_a_reward_is_numbered_and_summed_until_a_decision_takes_it() -> None:
    inbox = RewardInbox()
    inbox.receive(RewardUpdate(value=0.5, note="good"), iteration=2, cumulative=0.0)
    receipt = inbox.receive(RewardUpdate(value=-0.25), iteration=3, cumulative=1.5)
    assert (receipt.accepted, receipt.pending, receipt.cumulative) == (2, 0.25, 1.5)
    assert inbox.log == [
        RewardRecord(number=1, iteration=2, value=0.5, note="good"),
        RewardRecord(number=2, iteration=3, value=-0.25),
    ]
    assert inbox.take() == 0.25
    assert inbox.take() == 0.0
    assert inbox.received == 2  # taking does not forget them


def test_only_the_latest_rewards_are_kept() -> None:
    inbox = RewardInbox()
    for n in range(defaults.AUDITED_REWARDS + 3):
        inbox.receive(RewardUpdate(value=1.0), iteration=n, cumulative=0.0)
    assert len(inbox.log) == defaults.AUDITED_REWARDS
    assert inbox.log[0].number == 4
    assert inbox.pending == defaults.AUDITED_REWARDS + 3


def test_rewards_after_the_episode_ended_are_refused() -> None:
    RewardInbox.refuse_if_ended(False)
    with pytest.raises(ValueError, match="the episode has ended; it takes no more rewards"):
        RewardInbox.refuse_if_ended(True)


def test_a_new_run_puts_the_carried_rewards_before_those_that_came_early() -> None:
    inbox = RewardInbox()
    inbox.receive(RewardUpdate(value=2.0), iteration=0, cumulative=0.0)  # before the run set up
    carried = [RewardRecord(number=7, iteration=5, value=1.0)]
    carry = EpisodeCarry(
        seed=1,
        deadline=datetime(2026, 1, 1, tzinfo=UTC),
        reward_inbox=0.5,
        rewards_received=7,
        rewards=carried,
    )
    inbox.carry_over(carry)
    assert [r.number for r in inbox.log] == [7, 8]
    assert (inbox.pending, inbox.received) == (2.5, 8)
    assert inbox.carried() == (2.5, 8, inbox.log)
