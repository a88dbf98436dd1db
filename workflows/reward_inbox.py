"""The rewards an evaluator or a person sent: the workflow's reward state in one object.

The `reward` update (workflows/episode.py) puts each one here; the next policy decision
takes what is pending (`take`). The latest `defaults.AUDITED_REWARDS` are kept for the
audit row's events, and a continue-as-new or a fork carries them (`carried`). Rewards may
arrive before the run method has set up its state: `carry_over` puts the carried ones
first. Pure state: no I/O, nothing that is not deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from durable_rlm.workflows import defaults
from durable_rlm.workflows.models import EpisodeCarry, RewardReceipt, RewardRecord, RewardUpdate


@dataclass
class RewardInbox:
    pending: float = 0.0  # summed until the next policy decision reads it
    received: int = 0
    log: list[RewardRecord] = field(default_factory=list)  # the latest, for the audit's events

    def receive(self, update: RewardUpdate, iteration: int, cumulative: float) -> RewardReceipt:
        """Take a reward; the receipt says how many were accepted and what waits."""
        self.pending += update.value
        self.received += 1
        self.log.append(
            RewardRecord(number=self.received, iteration=iteration, value=update.value, note=update.note)
        )
        del self.log[: -defaults.AUDITED_REWARDS]
        return RewardReceipt(accepted=self.received, pending=self.pending, cumulative=cumulative)

    @staticmethod
    def refuse_if_ended(finished: bool) -> None:
        if finished:
            raise ValueError("the episode has ended; it takes no more rewards")

    def carry_over(self, carry: EpisodeCarry) -> None:
        """A new run's rewards: the carried ones, before those that arrived since it began
        (those were numbered from 1: they follow the carried ones)."""
        for early in self.log:
            early.number += carry.rewards_received
        self.pending += carry.reward_inbox
        self.received += carry.rewards_received
        self.log[:0] = carry.rewards

    def take(self) -> float:
        """What is pending, for the policy decision that reads it; none is left after."""
        pending, self.pending = self.pending, 0.0
        return pending

    def carried(self) -> tuple[float, int, list[RewardRecord]]:
        """(pending, received, latest): what a next run or a fork carries."""
        return self.pending, self.received, self.log[-defaults.AUDITED_REWARDS :]
