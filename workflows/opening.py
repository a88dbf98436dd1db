"""An episode's first state: its seed, its deadline and the opening messages.

The workflow draws the seed (`workflow.random()`, unless the request set one) and reads the
start time; from those this is pure. A fork's first run starts from its source's state
instead (workflows/forks.py), and a later run from the state the last one carried. A
persistent session's turn starts with a new conversation over the REPL its last turn left.
"""

from __future__ import annotations

from datetime import datetime

from durable_rlm.workflows import dspy_program, prompts
from durable_rlm.workflows.models import EpisodeCarry, EpisodeRequest, Message, ReplState
from durable_rlm.workflows.signals import uses_confidence


def first_state(request: EpisodeRequest, seed: int, started: datetime) -> EpisodeCarry:
    """The state before the first turn; the budget counts from `started`."""
    deadline = started + request.limits.max_duration
    if request.deadline is not None:  # a child never outlives its parent's deadline
        deadline = min(deadline, request.deadline)
    repl = request.session.repl if request.session is not None else ReplState()
    return EpisodeCarry(
        seed=seed,
        deadline=deadline,
        # A session's turn starts from the REPL the last turn left (a new conversation).
        log_head=repl.log_head,
        cell_count=repl.cell_count,
        snapshot=repl.snapshot,
        variables=dict(repl.variables),
        pending=opening_messages(request),
    )


def opening_messages(request: EpisodeRequest) -> list[Message]:
    """The first turn's messages: a DSPy program's as DSPy rendered them, else our own."""
    if request.dspy is not None:
        first = f"1/{request.limits.max_iterations}"
        return [*request.dspy.action, dspy_program.first_message(request.dspy.action_user, first)]
    return prompts.opening_messages(
        request.task,
        request.context,
        request.code_fences[0],
        ask_confidence=uses_confidence(request.termination.name, request.termination.config),
        output_fields=request.output_fields,
        child_batch_cap=request.limits.max_children_per_batch if request.spawns_children else None,
        tools=request.tools,
        system_prompt=request.system_prompt,
        repl_values=request.repl_values,
        composed=request.rlms,
        history_note=request.rlms and request.limits.context_window_tokens is not None,
    )
