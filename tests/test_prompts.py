"""What the model is told, pinned word for word: a prompt change must be deliberate.

Regenerate after an intended change with `UPDATE_GOLDEN=1 pytest tests/test_prompts.py`
and review the diff of tests/golden/prompts.txt like code.
"""

from __future__ import annotations

import os
from pathlib import Path

from durable_rlm.workflows import prompts
from durable_rlm.workflows.models import ContextRef
from durable_rlm.workflows.typed_outputs import FieldSpec

GOLDEN = Path(__file__).parent / "golden" / "prompts.txt"


def rendered() -> str:
    parts: list[str] = []
    cases = [
        ("no context", None, "repl", False, None),
        (
            "text context",
            ContextRef(digest="d", kind="text", size=1234567, type_name="str"),
            "repl",
            False,
            None,
        ),
        (
            "json context, other fence, confidence, typed outputs",
            ContextRef(digest="d", kind="json", size=42, type_name="dict"),
            "python",
            True,
            [
                FieldSpec(name="colour", type="string", description="a colour"),
                FieldSpec(name="n", type="integer", required=False),
            ],
        ),
    ]
    for title, context, fence, confidence, fields in cases:
        for message in prompts.opening_messages("Count the ERROR lines.", context, fence, confidence, fields):
            parts.append(f"=== opening, {title}: {message.role} ===\n{message.content}")
    parts.append(
        "=== observation: output and error ===\n"
        + prompts.observation(3, "x = 1\nprint(x)", "1\n", "warn\n", "ValueError: v", 1_000)
    )
    parts.append(
        "=== observation: nothing printed ===\n" + prompts.observation(4, "pass", "", "", None, 1_000)
    )
    parts.append(
        "=== observation: truncated ===\n" + prompts.observation(5, "c" * 2_100, "o" * 300, "", None, 120)
    )
    parts.append("=== next turn ===\n" + prompts.next_turn(["first", "second"]).content)
    for name in ("NO_CODE_TURN", "MISSING_VAR_TURN"):
        parts.append(f"=== {name} ===\n" + getattr(prompts, name).format(fence="repl", name="v"))
    parts.append("=== SUBMIT_REJECTED ===\n" + prompts.SUBMIT_REJECTED.format(problems="missing field 'n'"))
    parts.append("=== NEEDS_SUBMIT ===\n" + prompts.NEEDS_SUBMIT)
    parts.append(
        "=== ANSWER_NOT_ACCEPTED ===\n" + prompts.ANSWER_NOT_ACCEPTED.format(policy="reward_threshold")
    )
    parts.append("=== READ_VAR_FAILED ===\n" + prompts.READ_VAR_FAILED.format(name="v", problem="it died"))
    parts.append("=== TOO_MANY_CELLS ===\n" + prompts.TOO_MANY_CELLS.format(limit=16))
    parts.append("=== describe_context ===\n" + prompts.describe_context(None))
    return "\n\n".join(parts) + "\n"


def test_prompts_are_exactly_the_reviewed_text() -> None:
    text = rendered()
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()


def test_the_model_is_asked_for_confidence_only_when_a_policy_needs_it() -> None:
    plain = prompts.opening_messages("t", None, "repl")
    assert plain == prompts.opening_messages("t", None, "repl", False)
    assert plain != prompts.opening_messages("t", None, "repl", True)
