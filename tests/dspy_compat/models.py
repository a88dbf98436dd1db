"""The scripted model the differential tests run DSPy's RLM and ours against: one OpenAI-compatible
server that speaks DSPy's chat-adapter format. The root model answers the action prompt by the
iteration DSPy's prompt names ("[[ ## iteration ## ]]" 2/5), and the extraction prompt with
the output fields; the sub-model answers each prompt it is given."""

from __future__ import annotations

import re
from collections.abc import Callable

from durable_rlm.scripted import ChatRequest, Reply, Script

ITERATION = re.compile(r"\[\[ ## iteration ## \]\]\n(\d+)/\d+")
EXTRACT_MARKER = "Based on the REPL trajectory, extract the final outputs now."


def action(reasoning: str, code: str) -> str:
    """A reply to DSPy's action prompt, as a model following its adapter writes it."""
    code_field = f"[[ ## code ## ]]\n```python\n{code}\n```"
    return f"[[ ## reasoning ## ]]\n{reasoning}\n\n{code_field}\n\n[[ ## completed ## ]]"


def fields(**values: object) -> str:
    """A reply to DSPy's extraction prompt."""
    body = "\n\n".join(f"[[ ## {name} ## ]]\n{value}" for name, value in values.items())
    return f"{body}\n\n[[ ## completed ## ]]"


def dspy_model(
    steps: list[str], extract: str | None = None, sub: Callable[[str], str] | None = None
) -> Script:
    def script(request: ChatRequest) -> Reply | str:
        system = request.messages[0].get("content", "") if request.is_root else ""
        if EXTRACT_MARKER in system:
            return extract if extract is not None else Reply(status=500, error="no extraction scripted")
        if request.is_root:
            found = ITERATION.search(request.last_user)
            step = int(found.group(1)) if found else 1
            return steps[min(step, len(steps)) - 1]
        if sub is None:
            return Reply(status=500, error="this script has no sub-model")
        return sub(request.last_user)

    return script


def incident_sub(prompt: str) -> str:
    return "auth-service times out" if "timeout" in prompt else "nothing stands out"


INCIDENT = dspy_model(
    [
        action("Look at the log first.", "print(len(log.splitlines()), question)\nprint(log[:40])"),
        action(
            "Count the errors, ask the table and the sub-model.",
            'errors = [line for line in log.splitlines() if "ERROR" in line]\nprint(len(errors))\n'
            'print(lookup(key="auth"))\nprint(llm_query("Which service is failing? " + errors[0]))',
        ),
        action("Check the running total.", "print(undefined_total)"),
        action(
            "The auth service failed most.",
            'service = "auth-service"\nfailures = len(errors)\nSUBMIT(service, failures)',
        ),
    ],
    sub=incident_sub,
)

OUT_OF_ITERATIONS = dspy_model(
    [
        action("Add the numbers.", "print(sum(numbers))"),
        action(
            "Is the target reached?",
            "running = 0\nfor n in numbers:\n    running += n\nprint(running >= target)",
        ),
    ],
    extract=fields(total=108, reached=True),
)

SHOUT = dspy_model(
    [
        action("Read the question.", "print(question.upper())"),
        action("Shout it back.", "SUBMIT(answer=question.upper())"),
    ]
)

OVER_THE_CALL_LIMIT = dspy_model(
    [
        action("Ask twice.", 'print(llm_query("first"))\nprint(llm_query("second"))'),
        action("One call it is.", 'SUBMIT(answer="one")'),
    ],
    sub=lambda prompt: f"answer to {prompt}",
)
