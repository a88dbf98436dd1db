"""rlms's parsing helpers (rlm/utils/parsing.py): the code blocks of a reply as rlms finds
them, and an iteration formatted as the messages rlms's next prompt carries."""

from __future__ import annotations

from typing import Any

from durable_rlm.rlms.types import REPLResult, RLMIteration
from durable_rlm.workflows.parsing import inline_code_blocks

SHOWN_VARIABLE_TYPES = (str, int, float, bool, list, dict, tuple)


def find_code_blocks(text: str) -> list[str]:
    """Every ```repl block of `text`, stripped, empty ones too, as rlms finds them."""
    return inline_code_blocks(text, keep_empty=True)


def format_execution_result(result: REPLResult) -> str:
    """A block's run as the model reads it: its output, its errors, the names of its simple
    variables; "No output" when there is none."""
    parts = []
    if result.stdout:
        parts.append(f"\n{result.stdout}")
    if result.stderr:
        parts.append(f"\n{result.stderr}")
    shown = [
        name
        for name, value in result.locals.items()
        if not name.startswith("_") and isinstance(value, SHOWN_VARIABLE_TYPES)
    ]
    if shown:
        parts.append(f"REPL variables: {shown}\n")
    return "\n\n".join(parts) if parts else "No output"


def format_iteration(iteration: RLMIteration, max_character_length: int = 20000) -> list[dict[str, str]]:
    """The reply, then one message with every block's output (each cut to
    `max_character_length`), as rlms appends an iteration to its history."""
    messages = [{"role": "assistant", "content": iteration.response}]
    outputs = []
    several = len(iteration.code_blocks) > 1
    for number, block in enumerate(iteration.code_blocks, start=1):
        text = format_execution_result(block.result)
        if len(text) > max_character_length:
            text = text[:max_character_length] + f"... + [{len(text) - max_character_length} chars...]"
        outputs.append(f"{f'REPL output (block {number}):' if several else 'REPL output:'}\n{text}")
    if outputs:
        messages.append({"role": "user", "content": "\n\n".join(outputs)})
    return messages


def convert_context_for_repl(context: Any) -> tuple[Any, str | None]:
    """(data, text): a string context is text; a list of messages becomes their contents."""
    if isinstance(context, str):
        return None, context
    if isinstance(context, list) and context and isinstance(context[0], dict) and "content" in context[0]:
        return [message.get("content", "") for message in context], None
    return context, None
