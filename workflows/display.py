"""What a person sees of a running episode: the `progress` query, the UI's current details,
and the status search attribute (workflows/metadata.py).

The phase and the latest texts are served by a query and the current details, so they cost
no history. The status attribute is a command (`upsert_search_attributes`): it is written
on a pause, a wait, a resume and the end, never every iteration, and only by an episode
started with the attributes (`search`).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from durable_rlm.workflows import defaults, metadata
    from durable_rlm.workflows.budget import cost_spent
    from durable_rlm.workflows.models import EpisodeCarry, EpisodeProgress, EpisodeRequest
    from durable_rlm.workflows.steering_inbox import SteeringInbox


class EpisodeDisplay:
    """The phase the episode is in and the latest texts; `show` writes the status attribute."""

    def __init__(self, state: Callable[[], EpisodeCarry | None]) -> None:
        self.state = state  # None until the run method has set it up
        self.phase = "starting"
        self.phase_started: datetime | None = None
        self.last_response = ""  # the root model's latest reply, its end
        self.last_output = ""  # the latest cell's output, its end
        self.search = False  # upsert the UI's search attributes (the episode was started with them)

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self.phase_started = workflow.now()
        # The UI's "current details": served by a query, so it costs no history.
        state = self.state()
        workflow.set_current_details(metadata.current_details(state.iteration if state else 0, phase))

    def show(self, status: str, ended_by: str | None = None, source: str | None = None) -> None:
        """Keep the UI's list of episodes current, where the namespace has the attributes."""
        s = self.state()
        if not self.search or s is None:
            return
        updates = metadata.progress_updates(status, s.iteration, s.usage.total_tokens, ended_by, source)
        workflow.upsert_search_attributes(updates)

    def progress(
        self, request: EpisodeRequest | None, inbox: SteeringInbox, finished: bool, paused: str | None
    ) -> EpisodeProgress:
        """The `progress` query's answer."""
        s = self.state()
        return EpisodeProgress(
            iteration=s.iteration if s else 0,
            phase=self.phase,
            model_calls=s.model_calls if s else 0,
            sub_calls=s.sub_calls if s else 0,
            last_response=self.last_response,
            last_output=self.last_output,
            finished=finished,
            phase_started=self.phase_started,
            paused=paused,
            tokens=s.usage.total_tokens + s.unaccounted_tokens if s else 0,
            cost_usd=progress_cost(request, s),
            limits=request.limits if request else None,
            started_at=s.deadline - request.limits.max_duration if s and request else None,
            root_model=request.root_model.model if request else None,
            pending_cell=inbox.pending_cell,
            held=None if inbox.held is None else inbox.held_description(),
            approve=request.approve if request else "none",
            actions=inbox.actions[-defaults.PROGRESS_ACTIONS :],
            actions_total=inbox.actions_total,
        )


def progress_cost(request: EpisodeRequest | None, s: EpisodeCarry | None) -> float | None:
    """What the episode has cost so far, or None when that is unknown: a call had no cost,
    or before any call a model with no price (and no cost in its replies) may be called, so
    no call yet is no $0 either."""
    if s is not None and s.model_calls > 0:
        return None if s.usage.cost_usd is None else cost_spent(s)
    if request is None or request.uncosted_models():
        return None
    return 0.0 if s is None else cost_spent(s)
