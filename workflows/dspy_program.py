"""A DSPy program's RLM (`durable_rlm.dspy.RLM`) step by step, as DSPy 3.4's `dspy.RLM` runs it.

DSPy's RLM asks its model for two fields each iteration, `reasoning` and `code`, in the
`[[ ## name ## ]]` sections of its chat adapter; runs the code (one cell); and sends the next
request with the REPL history so far rendered into one user message ("=== Step 1 ===",
each step's output cut to `max_output_chars`, head and tail). At `max_iters` its `extract`
predictor reads that history and answers the output fields.

The prompts themselves are rendered by DSPy's own adapter in the program's process and come
in the request (`DspyPrompts`); what changes per iteration is filled in here: by the
workflow (the first message), by the root call's activity (each later one, from the
conversation chain) and by the program when it builds its Prediction (the trajectory).
One set of pure functions serves all three, so each reads the same steps. Everything runs
on model-written text in workflow code: linear in its input.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass

from durable_rlm.workflows.fallback import ParsedExtraction
from durable_rlm.workflows.models import Message, PromptTemplate
from durable_rlm.workflows.typed_outputs import FieldSpec

EMPTY_HISTORY = "You have not interacted with the REPL environment yet."
NO_OUTPUT = "(no output - did you forget to print?)"
EXTRACTED_REASONING = "Extract forced final output"
"""The Prediction's `final_reasoning` when the outputs were extracted, as DSPy words it."""

ACTION_FIELDS = ("reasoning", "code")
_HEADER = re.compile(r"\[\[ ## (\w+) ## \]\]")
_PYTHON_FENCES = frozenset({"python", "py", "python3", "py3", ""})

NO_CODE_FIELD = (
    "[Error] Your reply had no `[[ ## code ## ]]` field. Reply with `[[ ## reasoning ## ]]`, "
    "then `[[ ## code ## ]]`, then `[[ ## completed ## ]]`."
)


def fields_of(reply: str, names: tuple[str, ...] | list[str]) -> dict[str, str]:
    """The `[[ ## name ## ]]` sections of a reply that are among `names`, as DSPy's chat
    adapter reads them: a header starts a line (leading blanks aside), the first section of
    a name counts, each value is its lines joined and stripped. A name without a section is
    left out."""
    wanted = set(names)
    found: dict[str, str] = {}
    name: str | None = None
    lines: list[str] = []

    def close() -> None:
        if name is not None and name in wanted and name not in found:
            found[name] = "\n".join(lines).strip()

    for line in reply.splitlines():
        match = _HEADER.match(line.strip())
        if match is None:
            lines.append(line)
            continue
        close()
        name = match.group(1)
        # DSPy takes the rest of the line at the header's end as measured in the stripped
        # line: a header indented by n blanks loses n characters of what follows it.
        rest = line[match.end() :].strip()
        lines = [rest] if rest else []
    close()
    return found


@dataclass(frozen=True)
class Action:
    """One reply: its reasoning, the code as the history records it, the code to run
    (None: nothing runs), and the error the step shows instead of output, if any."""

    reasoning: str
    code: str
    runs: str | None
    error: str | None = None


def action_of(reply: str) -> Action:
    """What a reply asks DSPy's REPL to do. DSPy strips markdown fences from the code and
    refuses a fence that names another language; a reply without a code field is an error
    the model reads (where DSPy would ask again in JSON)."""
    fields = fields_of(reply, ACTION_FIELDS)
    reasoning = fields.get("reasoning", "")
    if "code" not in fields:
        return Action(reasoning, "", None, NO_CODE_FIELD)
    written = fields["code"]
    code, problem = strip_fences(written)
    if problem is not None:
        return Action(reasoning, written, None, f"[Error] {problem}")
    return Action(reasoning, code, code)


def strip_fences(code: str) -> tuple[str, str | None]:
    """(the Python code inside markdown fences, None), or (the text as written, why it is
    refused) when the first fence names a language other than Python. As DSPy's RLM: outer bare fence
    pairs go, then the first fence's block is the code; text with no fence is code."""
    code = written = code.strip()
    if "```" not in code:
        return code, None
    lines = code.splitlines()
    start, end = 0, len(lines)
    while end - start >= 2 and lines[start].strip() == "```" and lines[end - 1].strip() == "```":
        start, end = start + 1, end - 1
    code = "\n".join(lines[start:end]).strip()
    if "```" not in code:
        return code, None
    opening = code.find("```")
    language_line, newline, rest = code[opening + 3 :].partition("\n")
    if not newline:
        return code, None
    words = language_line.split(maxsplit=1)
    language = (words[0] if words else "").lower()
    if language not in _PYTHON_FENCES:
        return (
            written,
            f"Expected Python code but got ```{language} fence. Write Python code, not {language}.",
        )
    closing = rest.find("```")
    return (rest.strip() if closing == -1 else rest[:closing].strip()), None


# --- what a step shows -----------------------------------------------------------------------


def exception_text(error: str) -> str:
    """The exception a cell raised, without the traceback above it: DSPy's interpreter
    reports `Type: message` only."""
    if error.startswith("Traceback (most recent call last):"):
        lines = error.splitlines()
        # The frames are indented; the exception starts at the first line that is not.
        for at in range(1, len(lines)):
            if lines[at] and not lines[at][0].isspace():
                return "\n".join(lines[at:])
    return error


def cell_output(stdout: str, stderr: str, error: str | None) -> str:
    """A step's output as DSPy's RLM records it: what the code printed (trailing newlines
    dropped), "[Error] ..." when it raised (what it printed is then not shown), or the
    reminder to print."""
    if error is not None:
        return f"[Error] {exception_text(error)}"
    printed = "\n".join(part for part in (stdout, stderr) if part).rstrip("\n")
    return printed or NO_OUTPUT


def submit_rejected(problems: list[str]) -> str:
    """Why SUBMIT's values were refused, in DSPy's words' shape (its type check continues
    the run with the reason as the step's output)."""
    return "[Type Error] " + "; ".join(problems)


def final_output(outputs: dict[str, object]) -> str:
    """The last step's output when SUBMIT ended the run (outputs: as the Prediction has them)."""
    return f"FINAL: {outputs}"


# --- the REPL history, as DSPy renders it ------------------------------------------------------


@dataclass(frozen=True)
class Step:
    reasoning: str
    code: str
    output: str


def format_output(output: str, max_chars: int) -> str:
    """One step's output in the history: its length, then the head and tail when longer
    than `max_chars`, with how much was left out."""
    length = len(output)
    if length > max_chars:
        head = max_chars // 2
        tail = max_chars - head if max_chars > 0 else head
        output = (
            output[:head]
            + f"\n\n... ({length - max_chars:,} characters omitted) ...\n\n"
            # DSPy takes output[-tail:]: with no room at all (tail 0) that is the whole output.
            + (output[length - tail :] if tail else output)
        )
    return f"Output ({length:,} chars):\n{output}"


def history_text(steps: list[Step], max_chars: int) -> str:
    if not steps:
        return EMPTY_HISTORY
    return "\n".join(
        f"=== Step {number} ===\n"
        + (f"Reasoning: {step.reasoning}\n" if step.reasoning else "")
        + f"Code:\n```python\n{step.code}\n```\n{format_output(step.output, max_chars)}"
        for number, step in enumerate(steps, start=1)
    )


def filled(template: PromptTemplate, history: str, iteration: str = "") -> str:
    values = {"history": history, "iteration": iteration}
    pieces = [template.parts[0]]
    for hole, part in zip(template.holes, template.parts[1:], strict=True):
        pieces.extend((values[hole], part))
    return "".join(pieces)


def first_message(template: PromptTemplate, iteration: str) -> Message:
    return Message(role="user", content=filled(template, EMPTY_HISTORY, iteration))


def steps_of(turns: list[Message]) -> list[Step]:
    """The steps of a conversation after its first user message: each reply with the user
    messages after it (its output, and any note or hint the model read with it). A reply
    nothing followed yet has no step: its output is not known."""
    steps: list[Step] = []
    for reply, outputs in _turns(turns):
        if outputs:
            action = action_of(reply)
            steps.append(Step(action.reasoning, action.code, "\n\n".join(outputs)))
    return steps


def last_reply(turns: list[Message]) -> str | None:
    """The reply that no output followed (the one whose SUBMIT ended the run), if any."""
    pairs = list(_turns(turns))
    return pairs[-1][0] if pairs and not pairs[-1][1] else None


def _turns(turns: list[Message]) -> Iterator[tuple[str, list[str]]]:
    reply: str | None = None
    outputs: list[str] = []
    for message in turns:
        if message.role == "assistant":
            if reply is not None:
                yield reply, outputs
            reply, outputs = message.content, []
        elif reply is not None:
            outputs.append(message.content)
    if reply is not None:
        yield reply, outputs


def action_messages(
    messages: list[Message], prefix: int, template: PromptTemplate, iteration: str, max_chars: int
) -> list[Message]:
    """What a root call sends: the system message and demos, then the user message with
    the history so far (`messages`: the whole conversation). What came before the first
    reply (a person's hint; DSPy's prompt has no place for one) follows the message."""
    turns = messages[prefix + 1 :]
    history = history_text(steps_of(turns), max_chars)
    early = [m.content for m in itertools.takewhile(lambda m: m.role != "assistant", turns)]
    content = "\n\n".join([filled(template, history, iteration), *early])
    return [*messages[:prefix], Message(role="user", content=content)]


def extraction_messages(
    conversation: list[Message],
    prefix: int,
    messages: list[Message],
    template: PromptTemplate,
    max_chars: int,
) -> list[Message]:
    """What extraction sends: its own system message and demos, then the history."""
    history = history_text(steps_of(conversation[prefix + 1 :]), max_chars)
    return [*messages, Message(role="user", content=filled(template, history))]


def extracted(reply: str, fields: list[FieldSpec]) -> ParsedExtraction:
    """Extraction's reply read as DSPy's `extract` reads it: a section per output field, its
    text as it is (the program turns it into the field's type, as DSPy's adapter does)."""
    names = [f.name for f in fields]
    found = fields_of(reply, names)
    missing = [name for name in names if name not in found]
    if missing:
        listed = ", ".join(f"[[ ## {name} ## ]]" for name in missing)
        return ParsedExtraction(None, None, f"Failed to parse extraction: no {listed} in the reply", found)
    return ParsedExtraction({name: found[name] for name in names}, None, None, found)
