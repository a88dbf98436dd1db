"""Depth, tools, callbacks and the logger: rlms's and ours, on one script each."""

from __future__ import annotations

from tests.rlms_compat.models import depth_tree, tools_and_logger


def test_a_depth_2_run_reports_its_own_usage_and_each_child_s_trajectory(differential) -> None:
    run = differential("depth_metadata", depth_tree)
    assert run.ours.printed == run.theirs.printed
    assert run.theirs.printed[:3] == [
        "root: gpt-x response: 2, 3, 5, 7, 11",
        "  usage: gpt-x calls 3",  # the root's own calls: the children's are theirs
        "  iter 2 sub-call 1: gpt-x '2, 3, 5, 7, 11' nested=2 iteration(s)",
    ]


def test_tools_data_prompt_callbacks_and_logger_as_rlms_has_them(differential) -> None:
    run = differential("tools_and_logger", tools_and_logger)
    assert run.ours.printed == run.theirs.printed
    assert run.theirs.printed[0] == "Response: $31,975.00 AAPL"


def test_a_program_drives_a_local_repl_through_an_lm_handler(differential) -> None:
    run = differential("lm_in_repl", lambda request: "4")
    assert run.ours.printed == run.theirs.printed
    assert run.theirs.printed[3] == "response variable: '4'"
    assert run.theirs.printed[-2:] == ["error: ZeroDivisionError: division by zero", "answered: 4"]


def test_a_local_repl_keeps_rlms_s_names_versions_and_tools(differential) -> None:
    run = differential("local_repl_behaviours", lambda request: "unused")
    assert run.ours.printed == run.theirs.printed
    assert run.theirs.printed[-3:] == [
        "locals: ['answer', 'context', 'context_0', 'context_1', 'history']",
        "answer: 4 None",
        "error: NameError: name 'undefined_name' is not defined",
    ]
