"""What the parts of an episode's loop share: the request, the state, the episode's rules,
and the objects every step reports to or waits on. The run method makes one
`EpisodeContext` as it begins and hands the same value to each collaborator, so a
collaborator's constructor names what is particular to it, never ten shared arguments.

`EpisodeRules` holds the episode's behaviour switches, decided once from the request. A
rule never changes during the episode: a person's `set_limits` changes a limit (the
request's `limits`, read where it is used), not a rule. A change to the workflow that would
alter the commands of histories already recorded is not a rule either: before a release
it is simply the code; after one it needs a new workflow version (docs: "Versioning").

Which part of the state (`EpisodeCarry`) each collaborator writes is stated in
`STATE_OWNERS`; tests/test_episode_state.py fails when a module writes a field it does
not own.
"""

from __future__ import annotations

from dataclasses import dataclass

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from durable_rlm.workflows.display import EpisodeDisplay
    from durable_rlm.workflows.models import EpisodeCarry, EpisodeRequest
    from durable_rlm.workflows.outages import OutageWaits
    from durable_rlm.workflows.stopping import Stopping


@dataclass(frozen=True)
class EpisodeRules:
    """An episode's behaviour switches, each decided once from its request."""

    local_repl: bool
    """REPL steps run as local activities on the worker that runs the workflow task (a saved
    dispatch and workflow task per step), instead of activities routed to the sandbox's worker."""
    approval: bool
    """A cell may wait for a person's approval before it runs (the request's `approve` mode)."""
    policy_sees_printed_output: bool
    """The termination policy reads what cells printed, not only the reply and the answer."""
    extraction: bool
    """A limit reached before an answer ends in one fallback extraction call."""
    rlms: bool
    """The episode runs an rlms program (`durable_rlm.RLM`): code blocks are found as rlms
    finds them (inline fences too), and a compaction hands the REPL rlms's `history`."""
    dspy: bool
    """The episode runs a DSPy program's RLM (`durable_rlm.dspy.RLM`): each reply's `code`
    field is its one cell, SUBMIT its only answer (workflows/dspy_program.py)."""

    @classmethod
    def of(cls, request: EpisodeRequest) -> EpisodeRules:
        return cls(
            local_repl=request.durability.local_repl,
            approval=request.approve != "none",
            policy_sees_printed_output=request.termination.scan_printed_output,
            extraction=request.fallback_extraction,
            rlms=request.rlms,
            dspy=request.dspy is not None,
        )


@dataclass(frozen=True)
class EpisodeContext:
    """The request and state of one episode, its rules, and the shared parts of its loop."""

    request: EpisodeRequest
    state: EpisodeCarry
    rules: EpisodeRules
    display: EpisodeDisplay
    stop: Stopping
    waits: OutageWaits


STATE_BUILDERS = frozenset({"opening", "forks"})
"""The modules that make an episode's first state (a new episode's, a fork's): they may set
any field."""

STATE_OWNERS: dict[str, frozenset[str]] = {
    field: frozenset(owners.split())
    for field, owners in {
        # The loop's own count and what it keeps between runs (workflows/episode.py).
        "iteration": "episode",
        "hints": "episode",
        "reward_inbox": "episode",
        "rewards_received": "episode",
        "rewards": "episode",
        "actions": "episode",
        "actions_total": "episode",
        "seed": "",
        # The deadline: moved only by a person's limit change.
        "deadline": "steering_inbox",
        # The conversation: the loop queues turns; a root call sends them and keeps the reply.
        "pending": "episode root_calls",
        "conversation": "root_calls closing",  # closing: a DSPy program's extraction adds its last step
        "last_prompt_tokens": "root_calls",
        "last_reply_tokens": "root_calls",
        "compactions": "root_calls",
        # The REPL: its cells, its log, where its sandbox is, what its variables look like.
        "cell_count": "acting root_calls",  # root_calls: the cell of rlms's compaction `history`
        "log_head": "repl_steps",
        "snapshot": "repl_steps",
        "repl_queue": "repl_steps",
        "variables": "repl_steps",
        "divergences": "repl_steps",
        "lost_cells": "repl_steps",
        # What the episode spent: `EpisodeCarry.charge` / `charge_child` (models), and what
        # the calls of a cell count besides (call_answers).
        "model_calls": "models call_answers",
        "sub_calls": "models call_answers",
        "usage": "models",
        "model_time_s": "models",
        "children": "models",
        "tree_episodes": "models",
        "tool_calls": "call_answers",
        "unaccounted_tokens": "call_answers",
        "unaccounted_cost_usd": "call_answers",
        # The termination policy's state and the rewards it has read.
        "policy_state": "deciding",
        "cumulative_reward": "deciding",
    }.items()
}
"""Each field of `EpisodeCarry` and the modules of workflows/ that may write it while the
episode runs."""
