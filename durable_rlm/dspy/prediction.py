"""The Prediction a DSPy program's episode returns, as DSPy's RLM returns it, and the traces
DSPy's optimizers read.

The steps come from the episode's conversation (each reply, and the output the model read
after it); the episode's result says how it ended: SUBMIT (the last reply's reasoning is the
`final_reasoning`, its step's output "FINAL: {...}") or DSPy's `extract` (its fields, and
"Extract forced final output"). While an optimizer traces a run (`dspy.settings.trace`),
each step is recorded as DSPy's `generate_action` predictor would have recorded its own
call, and the extraction as `extract`'s: the same inputs and outputs, so bootstrapped demos
are the demos DSPy's RLM would have given.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from dspy import Prediction
from dspy.dsp.utils.settings import settings as dspy_settings
from dspy.primitives.repl_types import REPLHistory

from durable_rlm.dspy.outputs import parsed
from durable_rlm.errors import DurableRLMError
from durable_rlm.workflows import dspy_program
from durable_rlm.workflows.fallback import Extracted, Submitted
from durable_rlm.workflows.models import EpisodeResult, Message


class NoPrediction(DurableRLMError, RuntimeError):
    """The episode ended without the outputs a Prediction needs (its stop reason says why)."""


@dataclass(frozen=True)
class Run:
    """What a finished episode gives a Prediction: its outputs, its steps, how it ended."""

    outputs: dict[str, Any]
    steps: list[dspy_program.Step]
    replies: list[str]  # each step's reply, for the traces (the code as the model wrote it)
    final: dspy_program.Step | None  # the step SUBMIT ended, None when extracted
    final_reply: str | None


def run_of(signature: Any, result: EpisodeResult, conversation: list[Message], prefix: int) -> Run:
    turns = conversation[prefix + 1 :]
    steps = dspy_program.steps_of(turns)
    replies = [m.content for m in turns if m.role == "assistant"][: len(steps)]
    variant = result.execution.variant if result.execution is not None else None
    if isinstance(variant, Submitted):
        outputs = parsed(signature, variant.outputs)
        last = dspy_program.last_reply(turns) or ""
        action = dspy_program.action_of(last)
        final = dspy_program.Step(action.reasoning, action.code, dspy_program.final_output(outputs))
        return Run(outputs, steps, replies, final, last)
    if isinstance(variant, Extracted):
        return Run(parsed(signature, variant.outputs), steps, replies, None, None)
    raise NoPrediction(f"the episode {result.episode_id} ended with no outputs: {result.stop_reason}")


def prediction_of(run: Run) -> Prediction:
    """The Prediction, its fields in the order DSPy's RLM gives them."""
    if run.final is not None:
        trajectory = [_entry(step) for step in [*run.steps, run.final]]
        return Prediction(**run.outputs, trajectory=trajectory, final_reasoning=run.final.reasoning)
    trajectory = [_entry(step) for step in run.steps]
    return Prediction(trajectory=trajectory, final_reasoning=dspy_program.EXTRACTED_REASONING, **run.outputs)


def _entry(step: dspy_program.Step) -> dict[str, str]:
    return {"reasoning": step.reasoning, "code": step.code, "output": step.output}


def record_traces(
    run: Run,
    generate_action: Any,
    extract: Any,
    variables: list[Any],
    max_iters: int,
    max_output_chars: int,
) -> None:
    """Each step as `generate_action` would have traced it, and the extraction as `extract`,
    when a trace is being kept (an optimizer's bootstrapping, `dspy.context(trace=[])`).

    Built as DSPy's RLM builds them, down to which values are one object: BootstrapFewShot
    picks among a run's traces by a hash of their pickled demos, and pickle writes a value
    met twice once. So each call gets its own `variables_info` (DSPy formats the variables
    anew each iteration), and a step's reasoning in the history is the very string its
    call returned, its field names the very strings DSPy's are."""
    trace = dspy_settings.trace
    if trace is None or dspy_settings.max_trace_size <= 0:
        return
    steps = [*run.steps, *([run.final] if run.final is not None else [])]
    replies = [*run.replies, *([run.final_reply] if run.final_reply is not None else [])]
    history = REPLHistory(max_output_chars=max_output_chars)
    calls: list[tuple[Any, dict[str, Any], Prediction]] = []
    for number, (step, reply) in enumerate(zip(steps, replies, strict=True), start=1):
        # The names as DSPy's are: interned (a signature's field names are identifiers).
        fields = {
            sys.intern(name): text
            for name, text in dspy_program.fields_of(reply, dspy_program.ACTION_FIELDS).items()
        }
        inputs = {
            "variables_info": [variable.format() for variable in variables],
            "repl_history": history,
            "iteration": f"{number}/{max_iters}",
        }
        calls.append((generate_action, inputs, Prediction(**fields)))
        written = fields.get("code", "")
        code, problem = dspy_program.strip_fences(written)
        history = history.append(
            reasoning=fields.get("reasoning", ""), code=written if problem else code, output=step.output
        )
    if run.final is None:
        inputs = {"variables_info": [variable.format() for variable in variables], "repl_history": history}
        calls.append((extract, inputs, Prediction(**run.outputs)))
    for call in calls:
        if len(trace) >= dspy_settings.max_trace_size:
            trace.pop(0)
        trace.append(call)
