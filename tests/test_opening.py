"""An episode's first state (workflows/opening.py): the deadline counts from the start, a
child's never passes its parent's, and the opening messages hold the task."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from durable_rlm.workflows.models import EpisodeLimits, EpisodeRequest, ModelSettings
from durable_rlm.workflows.opening import first_state

START = datetime(2026, 1, 1, tzinfo=UTC)


def request(deadline: datetime | None = None) -> EpisodeRequest:
    return EpisodeRequest(
        task="count the words",
        root_model=ModelSettings(model="m"),
        limits=EpisodeLimits(max_duration=timedelta(minutes=10)),
        deadline=deadline,
    )


def test_the_deadline_is_max_duration_after_the_start() -> None:
    s = first_state(request(), seed=7, started=START)
    assert (s.seed, s.deadline, s.iteration, s.cell_count) == (7, START + timedelta(minutes=10), 0, 0)
    assert any("count the words" in m.content for m in s.pending)


def test_a_child_never_outlives_its_parents_deadline() -> None:
    parent = START + timedelta(minutes=3)
    assert first_state(request(deadline=parent), seed=7, started=START).deadline == parent
    later = START + timedelta(hours=1)
    assert first_state(request(deadline=later), seed=7, started=START).deadline == START + timedelta(
        minutes=10
    )
