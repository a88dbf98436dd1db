"""What the Temporal Web UI shows of an episode: a summary on every step, a memo, and
search attributes for the list of workflows.

Summaries are user metadata: Temporal keeps them in history next to each command but does
not compare them on replay, so they change without a patch. The memo and search
attributes are written by commands (`upsert_memo`, `upsert_search_attributes`), which are
behind the `ui-metadata` patch (workflows/names.py).

Everything here reads model-written text (cells, prompts), so every function is linear in
its input whatever it holds and returns a bounded string.

Search attributes must be registered on the namespace: upserting one that is not fails
every workflow task (`BadSearchAttributes`) and the episode would hang. So an episode
upserts them only if it was started with `STATUS` set (`uses_search_attributes`): a
client that sets them at start has had them accepted by the server (a start naming an
unregistered one is refused before anything runs), and a child inherits the choice.
"""

from __future__ import annotations

import re
from typing import Any, Final

from temporalio.common import (
    SearchAttributeIndexedValueType,
    SearchAttributeKey,
    SearchAttributePair,
    SearchAttributeUpdate,
    TypedSearchAttributes,
)

from durable_rlm.workflows import names

SUMMARY_CHARS = 60  # a step's text in a timeline row: one line, readable at a glance
TASK_CHARS = 200  # the task's start in the memo and the Text attribute (far below 2 KB)
NAME_CHARS = 80  # model and variable names: free text from requests and models
DETAILS_CHARS = 500  # the workflow's current details (a query: no history, still bounded)

# --- search attributes: defined once, registered by the embedded server -------------------

TASK = SearchAttributeKey.for_text("DrlmTask")
MODEL = SearchAttributeKey.for_keyword("DrlmModel")
STATUS = SearchAttributeKey.for_keyword("DrlmStatus")  # RUNNING, PAUSED, ... below; or how it ended
ENDED_BY = SearchAttributeKey.for_keyword("DrlmEndedBy")  # final, max_iterations, ...
ANSWER_SOURCE = SearchAttributeKey.for_keyword("DrlmAnswerSource")  # model, policy, extraction, none
ITERATIONS = SearchAttributeKey.for_int("DrlmIterations")
TOKENS = SearchAttributeKey.for_int("DrlmTokens")  # with its children's, as EpisodeResult.usage

# --- DrlmStatus: the values the workflow writes, defined once ------------------------------
# An ended episode's is its ending (workflows/models.py ENDINGS: answered, extracted,
# no_answer, failed, cancelled), the word the CLI and the audit store use. `drlm pending`
# (durable_rlm/client/steering.py) asks only the episodes whose status says a cell may wait.

RUNNING: Final = "running"
WAITING: Final = "waiting"  # a step the store (or a worker) failed waits on a timer
PAUSED: Final = "paused"  # by a person, or a model call waits for a fixed key
AWAITING_APPROVAL: Final = "awaiting approval"  # a cell waits for a person's decision
FAILED: Final = "failed"
CANCELLED: Final = "cancelled"

PRIVATE_TEXT = "(encrypted)"
"""DrlmTask of an episode whose payloads are encrypted: search attributes are indexed by the
server in the clear, so they carry no task or prompt text."""

KEYS: tuple[SearchAttributeKey[Any], ...] = (TASK, MODEL, STATUS, ENDED_BY, ANSWER_SOURCE, ITERATIONS, TOKENS)

_CLI_TYPES = {
    SearchAttributeIndexedValueType.TEXT: "Text",
    SearchAttributeIndexedValueType.KEYWORD: "Keyword",
    SearchAttributeIndexedValueType.INT: "Int",
    SearchAttributeIndexedValueType.DOUBLE: "Double",
    SearchAttributeIndexedValueType.BOOL: "Bool",
    SearchAttributeIndexedValueType.DATETIME: "Datetime",
    SearchAttributeIndexedValueType.KEYWORD_LIST: "KeywordList",
}

SEARCH_ATTRIBUTES = names.SEARCH_ATTRIBUTES
if SEARCH_ATTRIBUTES != tuple((key.name, _CLI_TYPES[key.indexed_value_type]) for key in KEYS):
    raise RuntimeError("workflows/names.py SEARCH_ATTRIBUTES and metadata.KEYS disagree")  # pragma: no cover


def start_search_attributes(task: str, model: str) -> TypedSearchAttributes:
    """What a client sets when it starts an episode on a server that registered `KEYS`:
    every key, so the start itself checks they are all registered."""
    return TypedSearchAttributes(
        [
            SearchAttributePair(TASK, shorten(task, TASK_CHARS)),
            SearchAttributePair(MODEL, shorten(model, NAME_CHARS)),
            SearchAttributePair(STATUS, RUNNING),
            SearchAttributePair(ENDED_BY, ""),
            SearchAttributePair(ANSWER_SOURCE, "none"),
            SearchAttributePair(ITERATIONS, 0),
            SearchAttributePair(TOKENS, 0),
        ]
    )


def uses_search_attributes(started_with: TypedSearchAttributes) -> bool:
    """Whether this episode may upsert `KEYS`: it was started with them (so they exist)."""
    return started_with.get(STATUS) is not None


def progress_updates(
    status: str, iterations: int, tokens: int, ended_by: str | None = None, answer_source: str | None = None
) -> list[SearchAttributeUpdate[Any]]:
    """The attributes that change while an episode runs and when it ends."""
    updates: list[SearchAttributeUpdate[Any]] = [
        STATUS.value_set(status),
        ITERATIONS.value_set(iterations),
        TOKENS.value_set(tokens),
    ]
    if ended_by is not None:
        updates.append(ENDED_BY.value_set(ended_by))
    if answer_source is not None:
        updates.append(ANSWER_SOURCE.value_set(answer_source))
    return updates


PAUSED_MEMO = "paused"
"""The memo key that says why an episode waits for a fixed model key (removed on the retry)."""


def episode_memo(task: str, model: str, depth: int) -> dict[str, Any]:
    """The memo the UI shows on the episode's page (short: the task's start, not the task)."""
    return {"task": shorten(task, TASK_CHARS), "model": shorten(model, NAME_CHARS), "depth": depth}


# --- summaries ------------------------------------------------------------------------------

_NON_BLANK = re.compile(r"\S")


def shorten(text: str, limit: int = SUMMARY_CHARS) -> str:
    """The first non-blank line of `text`, on one line, at most `limit` characters; "…" says
    that more followed. Linear in `text` (one scan for its first and for a later non-blank
    character), and it copies at most `limit + 1` characters however long the line."""
    first = _NON_BLANK.search(text)
    if first is None:
        return ""
    start = first.start()
    window = text[start : start + limit + 1]
    newline = window.find("\n")
    line = window if newline < 0 else window[:newline]
    shown = "".join(c if c.isprintable() else " " for c in line).rstrip()
    # Cut: a line longer than the limit, or more (non-blank) text after it.
    if len(shown) > limit or _NON_BLANK.search(text, start + len(line)) is not None:
        head = shown[: limit - 1]
        if len(shown) >= limit:
            space = head.rfind(" ", limit // 2)  # end on a whole word if one ends late enough
            head = head[:space] if space > 0 else head
        return head.rstrip() + "…"
    return shown


def code_summary(code: str) -> str:
    """A cell's first line as inline code (a backtick inside would end it early)."""
    line = shorten(code).replace("`", "'")
    return f"`{line}`" if line else "(blank)"


def cell_summary(cell_index: int, code: str) -> str:
    return f"cell {cell_index}: {code_summary(code)}"


def call_summary(kind: str, cell_index: int, call_index: int, prompt: str, model: str | None = None) -> str:
    """A sub-call as `llm_query 2.1: Describe…`; the model when the code named one."""
    named = f" ({shorten(model, NAME_CHARS)})" if model else ""
    return f"{shorten(kind, NAME_CHARS)} {cell_index}.{call_index}{named}: {shorten(prompt)}"


def child_details(depth: int, model: str, parent_id: str, cell_index: int, call_index: int, size: int) -> str:
    """The child episode's static details: where it comes from (the prompt is its context)."""
    return (
        f"Child episode at depth {depth}, model {shorten(model, NAME_CHARS)}: "
        f"call {call_index} of cell {cell_index} of {shorten(parent_id, TASK_CHARS)}; "
        f"its context is the prompt ({size:,} characters)."
    )


def current_details(iteration: int, phase: str) -> str:
    """The workflow's current details: what it does now (served by a query, not history)."""
    return f"iteration {iteration}: {phase}"[:DETAILS_CHARS]
