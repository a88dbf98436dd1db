"""A DSPy program's steps (workflows/dspy_program.py) against DSPy 3.4.1's own code: replies
read as its chat adapter reads them, code fences stripped as its RLM strips them, the REPL
history rendered as its REPLHistory renders it, and the prompt filled in as its adapter
formats it. Each is the peer's function and ours on the same input."""

from __future__ import annotations

import dspy
import pytest
from dspy.adapters.chat_adapter import ChatAdapter
from dspy.predict.rlm import _strip_code_fences
from dspy.primitives.repl_types import REPLHistory
from dspy.utils.exceptions import AdapterParseError
from hypothesis import given
from hypothesis import strategies as st

from durable_rlm.dspy.outputs import output_fields
from durable_rlm.dspy.prompts import _stand_ins, rendered
from durable_rlm.workflows import dspy_program
from durable_rlm.workflows.dspy_program import Step
from durable_rlm.workflows.models import Message, PromptTemplate
from durable_rlm.workflows.typed_outputs import check_outputs

ACTION = dspy.Signature("question -> reasoning, code")

REPLIES = [
    "[[ ## reasoning ## ]]\nLook.\n\n[[ ## code ## ]]\n```python\nprint(1)\n```\n\n[[ ## completed ## ]]",
    "[[ ## reasoning ## ]] inline\n[[ ## code ## ]] x = 1",
    "  [[ ## reasoning ## ]]   indented header\n[[ ## code ## ]]\ncode",  # DSPy's offset quirk
    "preamble\n[[ ## code ## ]]\nfirst\n[[ ## code ## ]]\nsecond\n[[ ## reasoning ## ]]\nlast",
    "[[ ## reasoning ## ]]\nno code here",
    "[[ ## Reasoning ## ]]\nwrong case\n[[ ## code ## ]]\n",
    "",
    "[[ ## reasoning ## ]]\r\nwindows\r\n[[ ## code ## ]]\r\nprint(2)\r\n",
]


def dspy_fields(reply: str) -> dict[str, str] | None:
    try:
        return ChatAdapter().parse(ACTION, reply)
    except AdapterParseError:
        return None


@pytest.mark.parametrize("reply", REPLIES)
def test_a_reply_is_read_as_dspy_s_chat_adapter_reads_it(reply: str) -> None:
    ours = dspy_program.fields_of(reply, ("reasoning", "code"))
    theirs = dspy_fields(reply)
    assert (ours if set(ours) == {"reasoning", "code"} else None) == theirs


LINES = st.sampled_from(
    [
        "[[ ## reasoning ## ]]",
        "[[ ## code ## ]]",
        " [[ ## code ## ]] tail",
        "[[ ## other ## ]]",
        "",
        "text",
        "  x  ",
    ]
)


@given(st.lists(st.one_of(LINES, st.text(max_size=12)), max_size=12))
def test_any_reply_is_read_as_dspy_reads_it(lines: list[str]) -> None:
    reply = "\n".join(lines)
    ours = dspy_program.fields_of(reply, ("reasoning", "code"))
    assert (ours if set(ours) == {"reasoning", "code"} else None) == dspy_fields(reply)


def dspy_strip(code: str) -> tuple[str, str | None]:
    try:
        return _strip_code_fences(code), None
    except SyntaxError as exc:
        return code.strip(), str(exc)


FENCED = [
    "print(1)",
    "```python\nprint(1)\n```",
    "```\n```python\nx = 1\n```\n```",
    "Here:\n```py\ny = 2\n```\nand more ```",
    "```js\nconsole.log(1)\n```",
    "```python",
    "```python\nunclosed = True",
    "```Python3 extra words\nz = 3\n```",
    "  ```\n  a = 1\n  ```  ",
]


@pytest.mark.parametrize("code", FENCED)
def test_code_fences_are_stripped_as_dspy_strips_them(code: str) -> None:
    assert dspy_program.strip_fences(code) == dspy_strip(code)


@given(st.lists(st.sampled_from(["```", "```python", "```js", "x = 1", "", " ``` "]), max_size=8))
def test_any_fences_are_stripped_as_dspy_strips_them(lines: list[str]) -> None:
    code = "\n".join(lines)
    assert dspy_program.strip_fences(code) == dspy_strip(code)


STEPS = [
    Step("Look first.", "print(len(doc))", "60"),
    Step("", "x = 1", dspy_program.NO_OUTPUT),
    Step("Long.", "print('a' * 50)", "a" * 50 + "\n" + "b" * 30),
]


@pytest.mark.parametrize("max_chars", [10_000, 40, 7, 1, 0])
def test_the_history_is_rendered_as_dspy_s_repl_history(max_chars: int) -> None:
    theirs = REPLHistory(max_output_chars=max_chars)
    for step in STEPS:
        theirs = theirs.append(reasoning=step.reasoning, code=step.code, output=step.output)
    assert dspy_program.history_text(STEPS, max_chars) == theirs.format()
    assert dspy_program.history_text([], max_chars) == REPLHistory().format()


def test_the_filled_template_is_the_message_dspy_s_adapter_formats() -> None:
    rlm = dspy.RLM("doc, question -> answer, count: int", max_iters=5)
    signature, adapter = rlm.generate_action.signature, ChatAdapter()
    variables = [v.format() for v in rlm._build_variables(doc="hello " * 300, question="what?")]
    holes = _stand_ins()
    inputs = {"variables_info": variables, "repl_history": holes["history"], "iteration": holes["iteration"]}
    prefix, template = rendered(adapter, signature, [], inputs, holes)
    history = REPLHistory(max_output_chars=20)
    for step in STEPS:
        history = history.append(reasoning=step.reasoning, code=step.code, output=step.output)
    theirs = adapter.format(
        signature, [], {"variables_info": variables, "repl_history": history, "iteration": "4/5"}
    )
    assert [Message(**m) for m in theirs] == [
        *prefix,
        Message(
            role="user", content=dspy_program.filled(template, dspy_program.history_text(STEPS, 20), "4/5")
        ),
    ]


def test_steps_pair_each_reply_with_what_the_model_read_after_it() -> None:
    reply = "[[ ## reasoning ## ]]\nr{}\n[[ ## code ## ]]\n```python\nprint({})\n```"
    turns = [
        Message(role="assistant", content=reply.format(1, 1)),
        Message(role="user", content="1"),
        Message(role="user", content="a person's hint"),
        Message(role="assistant", content=reply.format(2, 2)),
        Message(role="user", content="2"),
        Message(role="assistant", content=reply.format(3, 3)),
    ]
    assert dspy_program.steps_of(turns) == [
        Step("r1", "print(1)", "1\n\na person's hint"),
        Step("r2", "print(2)", "2"),
    ]
    assert dspy_program.last_reply(turns) == reply.format(3, 3)
    assert dspy_program.last_reply(turns[:5]) is None


@pytest.mark.parametrize(
    ("stdout", "stderr", "error", "shown"),
    [
        ("60 what?\n", "", None, "60 what?"),
        ("", "", None, dspy_program.NO_OUTPUT),
        ("out\n", "warn\n", None, "out\n\nwarn"),
        (
            "printed before\n",
            "",
            "Traceback (most recent call last):\n"
            '  File "<cell 3>", line 1, in <module>\n'
            "NameError: name 'x' is not defined",
            "[Error] NameError: name 'x' is not defined",
        ),
        (
            "",
            "",
            "TimeoutError: cell exceeded its 60 s time limit",
            "[Error] TimeoutError: cell exceeded its 60 s time limit",
        ),
    ],
)
def test_a_step_shows_its_output_as_dspy_s_history_records_it(
    stdout: str, stderr: str, error: str | None, shown: str
) -> None:
    assert dspy_program.cell_output(stdout, stderr, error) == shown


def test_a_reply_without_code_or_with_another_language_runs_nothing() -> None:
    missing = dspy_program.action_of("[[ ## reasoning ## ]]\nthinking")
    assert (missing.runs, missing.error) == (None, dspy_program.NO_CODE_FIELD)
    foreign = dspy_program.action_of("[[ ## reasoning ## ]]\nr\n[[ ## code ## ]]\n```js\nx()\n```")
    assert foreign.runs is None
    assert foreign.code == "```js\nx()\n```"  # the history keeps what was written, as DSPy's does
    assert foreign.error == "[Error] Expected Python code but got ```js fence. Write Python code, not js."


def test_extraction_is_read_field_by_field_and_a_missing_field_is_a_failure() -> None:
    fields = output_fields(dspy.Signature("q -> answer, count: int"))
    done = dspy_program.extracted(
        "[[ ## answer ## ]]\nforty\n\n[[ ## count ## ]]\n3\n\n[[ ## completed ## ]]", fields
    )
    assert (done.outputs, done.error) == ({"answer": "forty", "count": "3"}, None)
    failed = dspy_program.extracted("[[ ## answer ## ]]\nforty", fields)
    assert failed.outputs is None
    assert failed.partial == {"answer": "forty"}
    assert "[[ ## count ## ]]" in (failed.error or "")


def test_typed_outputs_refuse_what_dspy_s_parse_refuses_and_take_any_value_for_a_str() -> None:
    from typing import Literal

    signature = dspy.Signature(
        {
            "q": dspy.InputField(),
            "answer": dspy.OutputField(),
            "count": (int, dspy.OutputField()),
            "tags": (list[str], dspy.OutputField()),
            "kind": (Literal["a", "b"], dspy.OutputField()),
        }
    )
    fields = output_fields(signature)
    good = {"answer": 42, "count": 3, "tags": ["x"], "kind": "a"}
    assert check_outputs(good, fields, allow_null=False) == []
    bad = {"answer": "ok", "count": "three", "tags": [1], "kind": "c"}
    assert len(check_outputs(bad, fields, allow_null=False)) == 3


def test_a_hint_before_the_first_reply_follows_the_first_message() -> None:
    template = PromptTemplate(parts=["H:", " I:", "."], holes=["history", "iteration"])
    opening = [Message(role="system", content="s"), Message(role="user", content="first")]
    sent = dspy_program.action_messages(
        [*opening, Message(role="user", content="a hint")], 1, template, "1/3", 10
    )
    assert sent == [
        opening[0],
        Message(role="user", content=f"H:{dspy_program.EMPTY_HISTORY} I:1/3.\n\na hint"),
    ]
