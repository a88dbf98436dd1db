"""Seed 001: FINAL / FINAL_VAR extraction, and code blocks, on spec rows and real output."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from workflows.parsing import (
    extract_balanced_paren_content,
    find_code_blocks,
    find_final_answer,
    parse_final_signal,
    truncate_output,
)

TRACE = Path(__file__).resolve().parent / "fixtures" / "rlms_trace_gpt4o.jsonl"


class LocalEnvironment:
    """The rlms environment protocol: execute_code(code) -> object with .stdout."""

    def __init__(self, **variables: object) -> None:
        self.namespace: dict[str, object] = dict(variables)
        self.executed: list[str] = []

    def execute_code(self, code: str) -> SimpleNamespace:
        self.executed.append(code)
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            exec(code, self.namespace)
        return SimpleNamespace(stdout=buffer.getvalue(), stderr="")


# --- seed 001 example table -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("snippet", "expected"),
    [
        ("FINAL(42)", "42"),
        ('FINAL("hello")', '"hello"'),
        ("FINAL(answer (with nested) parens)", "answer (with nested) parens"),
    ],
)
def test_seed_001_final_examples(snippet: str, expected: str) -> None:
    assert find_final_answer(snippet) == expected


def test_seed_001_final_var_example_reads_the_environment() -> None:
    env = LocalEnvironment(result="ok")
    assert find_final_answer("FINAL_VAR(result)", environment=env) == "ok"


# --- format rules -----------------------------------------------------------------------------


def test_final_must_start_a_line() -> None:
    assert find_final_answer("The answer is FINAL(42) as computed.") is None


def test_leading_whitespace_before_final_is_allowed() -> None:
    assert find_final_answer("Done.\n   FINAL(7)\n") == "7"


def test_first_line_start_occurrence_wins_over_inline_mentions() -> None:
    text = "I will call FINAL(wrong) later.\nFINAL(right)"
    assert find_final_answer(text) == "right"


def test_parentheses_inside_string_literals_are_ignored() -> None:
    assert find_final_answer('FINAL("a) b")') == '"a) b"'
    assert find_final_answer("FINAL('(' + x)") == "'(' + x"
    assert find_final_answer('FINAL("""tri ) ple""")') == '"""tri ) ple"""'


def test_escaped_quote_does_not_end_the_string() -> None:
    assert find_final_answer(r'FINAL("say \") ok")') == r'"say \") ok"'


def test_multiline_final_content() -> None:
    assert find_final_answer("FINAL(line one\nline two (2))") == "line one\nline two (2)"


def test_unbalanced_final_is_no_answer() -> None:
    assert find_final_answer("FINAL(42") is None


def test_final_var_takes_precedence_over_final() -> None:
    env = LocalEnvironment(x="from var")
    assert find_final_answer("FINAL(literal)\nFINAL_VAR(x)", environment=env) == "from var"


def test_final_var_without_environment_is_none_not_final() -> None:
    assert find_final_answer("FINAL(literal)\nFINAL_VAR(x)") is None


def test_final_var_of_missing_variable_is_none() -> None:
    assert find_final_answer("FINAL_VAR(nope)", environment=LocalEnvironment()) is None


def test_final_var_accepts_a_quoted_name() -> None:
    env = LocalEnvironment(result=4950)
    assert find_final_answer("FINAL_VAR('result')", environment=env) == "4950"


def test_final_var_name_cannot_inject_code() -> None:
    env = LocalEnvironment()
    assert find_final_answer("FINAL_VAR(__import__('os').system('id'))", environment=env) is None
    assert env.executed == []


def test_final_var_keeps_multiline_values() -> None:
    env = LocalEnvironment(report="a\nb\n")
    assert find_final_answer("FINAL_VAR(report)", environment=env) == "a\nb\n"


def test_parse_signal_kinds() -> None:
    assert parse_final_signal("FINAL_VAR(v)").kind == "final_var"
    assert parse_final_signal("FINAL_VAR(v)").value == "v"
    assert parse_final_signal("FINAL(1)").kind == "final"
    assert parse_final_signal("nothing here") is None
    assert parse_final_signal(None) is None


def test_balanced_extraction_requires_an_open_paren() -> None:
    with pytest.raises(ValueError):
        extract_balanced_paren_content("abc", 0)


# --- code blocks ------------------------------------------------------------------------------


def test_code_blocks_of_the_configured_fences_only() -> None:
    text = "```repl\nx = 1\n```\n```python\ny = 2\n```\n```\nz = 3\n```"
    assert find_code_blocks(text) == ["x = 1"]
    assert find_code_blocks(text, ["repl", "python"]) == ["x = 1", "y = 2"]


def test_empty_code_blocks_are_skipped() -> None:
    assert find_code_blocks("```repl\n\n```") == []


def test_truncation_says_how_much_was_cut() -> None:
    assert truncate_output("abcdef", 3) == "abc\n... [3 more characters truncated]"
    assert truncate_output("abc", 3) == "abc"


# --- real model output (gpt-4o through rlms) --------------------------------------------------


def _trace_iterations() -> list[dict]:
    rows = [json.loads(line) for line in TRACE.read_text().splitlines()]
    return [r for r in rows if r["type"] == "iteration"]


@pytest.mark.parametrize("row", _trace_iterations(), ids=lambda r: f"iteration{r['iteration']}")
def test_real_trace_final_answers_match_the_rlms_log(row: dict) -> None:
    assert find_final_answer(row["response"]) == row["final_answer"]


@pytest.mark.parametrize("row", _trace_iterations(), ids=lambda r: f"iteration{r['iteration']}")
def test_real_trace_code_blocks_match_the_rlms_log(row: dict) -> None:
    assert find_code_blocks(row["response"]) == [b["code"] for b in row["code_blocks"]]
