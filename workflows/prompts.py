"""Prompt text of an episode. Pure: the same request gives the same messages on replay."""

from __future__ import annotations

from durable_rlm.workflows import defaults
from durable_rlm.workflows.models import ContextRef, Message, ToolSpec
from durable_rlm.workflows.parsing import truncate_output
from durable_rlm.workflows.signals import CONFIDENCE_INSTRUCTION
from durable_rlm.workflows.typed_outputs import FieldSpec, format_output_fields

SYSTEM_PROMPT = """\
You answer a query with the help of a Python REPL. The query's context lives in the REPL, \
not in this conversation: inspect it with code instead of asking for it.

The REPL provides:
1. `context` - {context_description}
2. `llm_query(prompt: str) -> str` - asks a sub-model (it can read a large prompt). Use it \
to analyse chunks of the context semantically.
3. `llm_query_batched(prompts: list[str]) -> list[str]` - many independent sub-model \
queries at once, answers in the same order. Much faster than a loop of `llm_query`.
4. `SHOW_VARS()` - lists the variables you have created.
5. `print(...)` - the only way to see values; long outputs are truncated, so print \
summaries and keep intermediate results in variables.{recursion}

Variables persist between your turns. To run code, put it in a fenced block whose \
language is {fence}:
```{fence}
chunk = context[:1000]
print(llm_query(f"Summarise: {{chunk}}"))
```

When you are done, give the answer on a line of its own, outside any code, in one of \
these forms:
FINAL(your answer here)
FINAL_VAR(variable_name)   <- returns the value of a REPL variable you created
Inside a cell you may instead call `FINAL(value)` or `FINAL_VAR("variable_name")`, or set \
`answer["content"] = ...` and `answer["ready"] = True`. Text your code prints is never \
taken as your answer.
Do not answer before you have looked at the context."""

RECURSION = """
6. `rlm_query(prompt: str, model: str | None = None) -> str` - hands a sub-problem to a \
whole sub-episode with its own REPL, whose `context` is the prompt; returns its answer, or \
a string starting with "Error:". Use it for sub-problems that need code, not one reading.
7. `rlm_query_batched(prompts: list[str], model: str | None = None) -> list[str]` - several \
sub-episodes in parallel (at most {cap} per call), answers in the same order."""

TOOLS = """
Custom tools (each runs on the worker; a failure raises `ToolError`, which you may catch). \
Arguments and results are JSON values:"""


VALUES = "\nData the REPL holds for you as variables (set before your first turn):"


def _tool_line(spec: ToolSpec) -> str:
    doc = spec.doc.strip().splitlines()[0] if spec.doc.strip() else "(no description)"
    return f"\n- `{spec.name}{spec.signature}` - {doc}"


CHILD_TASK = (
    "Answer the request given in `context` (a parent episode handed it to you). Read it in "
    "the REPL, do the work it asks for, and give the answer with FINAL(...)."
)

FIRST_TURN = """\
Query: {task}

You have not looked at the context yet. Start by inspecting it in the REPL; do not give \
a final answer in this turn."""


NEXT_TURN = "Continue with the REPL, or give FINAL(...) / FINAL_VAR(...) when you are sure."

NO_CODE_TURN = (
    "Your last reply had no ```{fence}``` block and no FINAL(...) / FINAL_VAR(...) line. "
    "Write code in a ```{fence}``` block, or give the final answer."
)

SUBMIT_INSTRUCTION = """\
This task needs structured outputs. Instead of FINAL(...), finish by calling
`SUBMIT(field=value, ...)` in a code cell with exactly these fields:
{fields}"""

SUBMIT_REJECTED = "SUBMIT was rejected: {problems}. Fix the values and call SUBMIT again."

SUBMIT_REJECTED_LIST = "SUBMIT was rejected:\n{problems}\nFix the values and call SUBMIT again."

NEEDS_SUBMIT = (
    "This episode needs structured outputs: call SUBMIT(...) in a code cell with the fields "
    "listed in the instructions instead of FINAL(...)."
)

ANSWER_NOT_ACCEPTED = (
    "Your answer was noted, but the episode's termination policy ({policy}) has not ended the "
    "episode yet. Keep working, and give your answer again when you are done."
)

READ_VAR_FAILED = (
    "FINAL_VAR({name}) could not be read from the REPL: {problem}. The episode goes on; give "
    "the answer again when the REPL is back."
)

TOO_MANY_CELLS = "Only the first {limit} code blocks of your reply were run; put less in one reply."

MISSING_VAR_TURN = (
    "FINAL_VAR({name}) names no REPL variable. Create it in a ```{fence}``` block first, "
    "or answer with FINAL(...)."
)


def describe_context(context: ContextRef | None) -> str:
    if context is None:
        return "None (this query has no separate context)."
    if context.kind == "documents":
        return (
            f"a list of {context.documents:,} documents (strings, or for .json files their values), "
            f"{context.size:,} characters in all; `context.names` lists their file names."
        )
    if context.view == "mapped":
        return (
            f"a read-only view of {context.size:,} characters of ASCII text, too large to copy: "
            "slices, find, count and `context.lines()` give strings; `str(context)` would copy all of it."
        )
    return f"a {context.type_name} of {context.size:,} characters."


HISTORY_CELL = "# rlms's `history`: the turns a compaction summarised, and its summary\n"


def history_cell(entries_json: str) -> str:
    """The cell that hands rlms's `history` list (bound by the setup cell) what a compaction
    took out of the conversation; the export leaves it out of the model's own code blocks."""
    return f"{HISTORY_CELL}history.extend(__import__('json').loads({entries_json!r}))"


HISTORY_NOTE = (
    "\n\nThe full conversation history (trajectory segments and any summaries) "
    "is available in the REPL variable `history` as a list."
)
"""rlms's note on `history`, added to the system prompt when compaction is on."""


SETUP_FAILED = "The REPL's setup code failed; names it should have defined may be missing:\n{error}"


def custom_system_prompt(template: str, offered: str) -> str:
    """rlms's custom_system_prompt is a str.format template whose `{custom_tools_section}`
    lists the tools and data; a text that is no such template is used as it is."""
    try:
        return template.format(custom_tools_section=offered)
    except (KeyError, IndexError, ValueError):
        return template


def opening_messages(
    task: str,
    context: ContextRef | None,
    fence: str,
    ask_confidence: bool = False,
    output_fields: list[FieldSpec] | None = None,
    child_batch_cap: int | None = None,
    tools: list[ToolSpec] | None = None,
    system_prompt: str | None = None,
    repl_values: list[str] | None = None,
    composed: bool = False,
    history_note: bool = False,
) -> list[Message]:
    """`child_batch_cap` is set when rlm_query starts child episodes (depth allows it). A
    `system_prompt` (rlms's custom_system_prompt) replaces the built-in one, its
    `{custom_tools_section}` filled; `composed`: it is the whole system message already
    (the rlms-compatible RLM composes it as rlms does); `history_note`: rlms's note on the
    `history` list that compaction fills."""
    offered = TOOLS + "".join(_tool_line(t) for t in tools) if tools else ""
    if repl_values:
        offered += VALUES + "".join(f"\n- {line}" for line in repl_values)
    recursion = "" if child_batch_cap is None else RECURSION.format(cap=child_batch_cap)
    system = SYSTEM_PROMPT.format(
        context_description=describe_context(context), fence=fence, recursion=recursion + offered
    )
    if system_prompt is not None:
        system = system_prompt if composed else custom_system_prompt(system_prompt, offered)
    if history_note:
        system += HISTORY_NOTE
    if output_fields:
        system += "\n" + SUBMIT_INSTRUCTION.format(fields=format_output_fields(output_fields))
    if ask_confidence:
        system += "\n" + CONFIDENCE_INSTRUCTION
    return [
        Message(role="system", content=system),
        Message(role="user", content=FIRST_TURN.format(task=task)),
    ]


def observation(cell_number: int, code: str, stdout: str, stderr: str, error: str | None, limit: int) -> str:
    """What the model sees of one executed cell, bounded by the output truncation limit."""
    parts = [stdout]
    if stderr:
        parts.append(f"[stderr]\n{stderr}")
    if error:
        parts.append(f"[error]\n{error}")
    body = "\n".join(p for p in parts if p) or "(no output)"
    return (
        f"Cell {cell_number}:\n```python\n{truncate_output(code, defaults.CODE_SHOWN_CHARS)}\n```\n"
        f"Output:\n{truncate_output(body, limit)}"
    )


def submit_rejected(problems: list[str], listed: bool) -> str:
    """Why SUBMIT was refused. Schema-checked outputs give one violation per line, each with
    its JSON path; fields without a schema keep the one-line wording older histories saw."""
    if not listed:
        return SUBMIT_REJECTED.format(problems="; ".join(problems))
    return SUBMIT_REJECTED_LIST.format(problems="\n".join(f"- {p}" for p in problems))


def task_of_opening(first_turn: str) -> str:
    """The task a FIRST_TURN message was made from (the whole text if it is not one): the
    extraction call reads it back from the conversation, which always keeps that turn."""
    prefix, suffix = FIRST_TURN.split("{task}")
    if first_turn.startswith(prefix) and first_turn.endswith(suffix):
        return first_turn[len(prefix) : len(first_turn) - len(suffix)]
    return first_turn


def next_turn(observations: list[str]) -> Message:
    return Message(role="user", content="\n\n".join([*observations, NEXT_TURN]))
