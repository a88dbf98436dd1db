"""What the opening system prompt offers beyond the built-in REPL (workflows/prompts.py):
custom tools, data the setup cell bound, recursion when depth allows it, and an rlms-style
custom system prompt. Pure; the full built-in text is pinned in tests/golden/prompts.txt."""

from __future__ import annotations

from durable_rlm.workflows import prompts
from durable_rlm.workflows.models import ToolSpec

TOOLS = [ToolSpec(name="lookup", signature="(key)", doc="  Find a key.\nMore text."), ToolSpec(name="ping")]
OFFERED_TOOLS = prompts.TOOLS + "\n- `lookup(key)` - Find a key.\n- `ping()` - (no description)"
OFFERED_VALUES = prompts.VALUES + "\n- rows: a list of 3 dicts\n- key: 'a'"


def system(**options: object) -> str:
    return prompts.opening_messages("t", None, "repl", **options)[0].content  # type: ignore[arg-type]


def test_tools_are_listed_by_signature_and_the_first_line_of_their_doc() -> None:
    assert "keep intermediate results in variables." + OFFERED_TOOLS + "\n\nVariables persist" in system(
        tools=TOOLS
    )
    assert prompts.TOOLS not in system() and prompts.TOOLS not in system(tools=[])


def test_data_the_setup_cell_bound_is_listed_after_the_tools() -> None:
    values = ["rows: a list of 3 dicts", "key: 'a'"]
    both = system(tools=TOOLS, repl_values=values)
    assert "variables." + OFFERED_TOOLS + OFFERED_VALUES + "\n\nVariables persist" in both
    assert "variables." + OFFERED_VALUES + "\n\nVariables persist" in system(repl_values=values)
    assert prompts.VALUES not in system(repl_values=[])


def test_rlm_query_is_offered_only_when_children_may_start_with_their_batch_cap() -> None:
    assert "variables." + prompts.RECURSION.format(cap=4) + "\n\nVariables persist" in system(
        child_batch_cap=4
    )
    assert "(at most 4 per call)" in system(child_batch_cap=4)
    assert "rlm_query" not in system()


def test_a_custom_system_prompt_replaces_the_built_in_one_with_the_tools_and_data_it_asks_for() -> None:
    template = "You are careful.{custom_tools_section}"
    custom = system(system_prompt=template, tools=TOOLS, repl_values=["rows: a list of 3 dicts", "key: 'a'"])
    assert custom == "You are careful." + OFFERED_TOOLS + OFFERED_VALUES
    assert system(system_prompt=template) == "You are careful."


def test_a_custom_system_prompt_that_is_no_template_is_used_as_it_is() -> None:
    assert system(system_prompt="Answer in {braces} only.", tools=TOOLS) == "Answer in {braces} only."
    assert system(system_prompt="Odd { brace", tools=TOOLS) == "Odd { brace"
    assert prompts.custom_system_prompt("{0}", "x") == "{0}"


def test_the_task_is_read_back_only_from_a_whole_first_turn() -> None:
    turn = prompts.opening_messages("Count the lines.", None, "repl")[1].content
    assert prompts.task_of_opening(turn) == "Count the lines."
    head = prompts.FIRST_TURN.split("{task}")[0]
    assert prompts.task_of_opening(head + "Count") == head + "Count"  # not a whole first turn
    assert prompts.task_of_opening("just text") == "just text"
