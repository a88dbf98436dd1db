"""`--approve risky`: which cells the static assessment flags, which it lets run, and that
it answers (never raises) on any text, since it runs inside a workflow task."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from durable_rlm.workflows.risk import MAX_ASSESSED_CHARS, MAX_REASONS, assess


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        # file writes and deletes
        ("open('out.txt', 'w').write('x')", "line 1: writes a file (open(..., 'w'))"),
        ("f = open('log', mode='a')", "writes a file (open(..., 'a'))"),
        ("open('data', 'rb+')", "writes a file (open(..., 'rb+'))"),
        ("m = 'w'\nopen('f', m)", "line 2: opens a file with a mode chosen at run time"),
        ("import io\nio.open('f', 'x')", "writes a file (open(..., 'x'))"),
        ("from pathlib import Path\nPath('p').open('w')", "writes a file (open(..., 'w'))"),
        ("from pathlib import Path\nPath('p').write_text('x')", "writes or deletes files (.write_text)"),
        ("import os\nos.remove('x')", "line 2: writes or deletes files (os.remove)"),
        ("import os as o\no.unlink('x')", "writes or deletes files (os.unlink)"),
        ("from os import remove as rm\nrm('x')", "writes or deletes files (os.remove)"),
        ("from os import *\nrmdir('d')", "writes or deletes files (os.rmdir)"),
        ("import shutil\nshutil.rmtree('/')", "writes or deletes files (shutil.rmtree)"),
        ("df.to_csv('out.csv')", "writes a file (.to_csv)"),
        ("import numpy as np\nnp.save('a.npy', x)", "writes a file (.save)"),
        # processes
        ("import subprocess", "line 1: imports subprocess (starts processes)"),
        ("import os\nos.system('ls')", "starts or signals processes (os.system)"),
        ("import os\nos.execv('/bin/sh', [])", "starts or signals processes (os.execv)"),
        ("from os import posix_spawn\nposix_spawn('x', [], {})", "os.posix_spawn"),
        ("import multiprocessing.pool", "imports multiprocessing.pool (starts processes)"),
        # networking and native code
        ("import socket", "line 1: imports socket (network or native code)"),
        ("from urllib.request import urlopen", "imports urllib.request (network or native code)"),
        ("import ctypes as c", "imports ctypes (network or native code)"),
        ("import requests, json", "imports requests (network or native code)"),
        # code chosen at run time
        ("m = __import__('o' + 's')", "runs code chosen at run time (__import__)"),
        ("exec(code)", "runs code chosen at run time (exec)"),
        ("import importlib\nimportlib.import_module(name)", "importlib.import_module"),
        ("getattr(obj, name)()", "getattr of a computed name"),
        # loops without an end, very long loops
        ("while True:\n    pass", "line 1: loop without an end (while True)"),
        ("while 1:\n    x = 1", "loop without an end (while True)"),
        ("import itertools\nfor i in itertools.count():\n    pass", "loop without an end (itertools.count)"),
        ("from itertools import cycle\nfor x in cycle([1]):\n    pass", "itertools.cycle"),
        ("for i in range(10_000_000):\n    pass", "very long loop (10,000,000 iterations)"),
        ("for i in range(10**9):\n    pass", "very long loop (1,000,000,000 iterations)"),
        ("for i in range(int(1e8)):\n    pass", "very long loop (100,000,000 iterations)"),
        ("for i in range(9**9**9):\n    pass", "very long loop"),
        (
            "for i in range(10_000):\n    for j in range(10_000):\n        pass",
            "line 2: very long loop (100,000,000 iterations counting the loops around it)",
        ),
    ],
)
def test_flagged(code: str, reason: str) -> None:
    reasons = assess(code)
    assert any(reason in found for found in reasons), reasons


@pytest.mark.parametrize(
    "code",
    [
        "print(len(context))",
        "chunks = [context[i:i+1000] for i in range(0, len(context), 1000)]",
        "answers = llm_query_batched([f'Summarise {c}' for c in chunks])",
        "text = open('notes.txt').read()",
        "text = open('notes.txt', 'r').read()",
        "from pathlib import Path\nPath('p').read_text()",
        "import os\nprint(os.path.join('a', 'b'), os.getcwd())",
        "import shutil\nshutil.which('python')",
        "import json, re, math, collections",
        "for i in range(1000):\n    for j in range(1000):\n        pass",
        "for i in range(n):\n    pass",
        "while not done:\n    done = step()",
        "import itertools\nfor x in itertools.repeat(1, 5):\n    pass",
        "getattr(obj, 'name')",
        "result.save",  # an attribute, not a call
        "x = 'import socket; os.remove(\"/\")'",  # protocol-looking data in a string
        "# import subprocess\nprint('FINAL(no)')",
    ],
)
def test_not_flagged(code: str) -> None:
    assert assess(code) == []


def test_reasons_come_in_source_order_once_each() -> None:
    code = "import os\nos.remove('a')\nimport socket\nos.remove('a')\nwhile True:\n    break\n"
    assert assess(code) == [
        "line 2: writes or deletes files (os.remove)",
        "line 3: imports socket (network or native code)",
        "line 4: writes or deletes files (os.remove)",
        "line 5: loop without an end (while True)",
    ]


def test_an_alias_bound_after_its_use_in_a_function_still_counts() -> None:
    code = "def clean():\n    remove('x')\n\nfrom os import remove\nclean()\n"
    assert assess(code) == ["line 2: writes or deletes files (os.remove)"]


def test_many_reasons_are_capped_with_a_count() -> None:
    code = "\n".join(f"os.remove('{i}')" for i in range(MAX_REASONS + 7))
    reasons = assess("import os\n" + code)
    assert len(reasons) == MAX_REASONS + 1 and reasons[-1] == "... and 7 more"


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        ("def f(:\n", "does not parse: "),
        ("x = 1\x00", "does not parse: source code string cannot contain null bytes"),
        ("x = " + "(" * 300 + ")" * 300, "does not parse: too many nested parentheses"),
        ("x = " + " + ".join(["1"] * 20_000), "too deeply nested to assess"),
        ("x = " + "-" * 20_000 + "1", "too deeply nested to assess"),
        ("x" * (MAX_ASSESSED_CHARS + 1), "too large to assess (100,001 characters)"),
    ],
)
def test_a_cell_it_cannot_read_is_flagged_with_why(code: str, reason: str) -> None:
    reasons = assess(code)
    assert len(reasons) == 1 and reasons[0].startswith(reason), reasons


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400))
def test_any_text_gets_an_answer(text: str) -> None:
    reasons = assess(text)
    assert isinstance(reasons, list) and all(isinstance(r, str) and r for r in reasons)
    assert assess(text) == reasons  # deterministic: the workflow replays it


_STATEMENTS = st.sampled_from(
    [
        "x = 1",
        "import os",
        "os.remove('a')",
        "open('f', 'w')",
        "for i in range(10**3):",
        "while True:",
        "if x:",
        "print(x)",
        "import socket",
    ]
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_STATEMENTS, st.integers(0, 6)), max_size=40))
def test_generated_programs_are_assessed_deterministically(lines: list[tuple[str, int]]) -> None:
    code = "\n".join("    " * depth + statement for statement, depth in lines)
    reasons = assess(code)
    assert reasons == assess(code)
    if "does not parse" not in "".join(reasons) and "import socket" in code:
        assert any("imports socket" in reason for reason in reasons)


def test_each_range_is_evaluated_once_however_many_loops_it_encloses(monkeypatch) -> None:
    """The walk up to enclosing loops reads their totals: a cell of 1,500 loops under one
    range of a 4,000-leaf constant expression once took 18 s (workflow tasks get 2)."""
    from durable_rlm.workflows import risk

    def balanced(n: int) -> str:
        return "1" if n == 1 else f"({balanced(n // 2)}+{balanced(n - n // 2)})"

    evaluated: list[int] = []
    original = risk._range_length
    monkeypatch.setattr(risk, "_range_length", lambda call: evaluated.append(1) or original(call))
    code = f"for i in range({balanced(4000)}):\n" + "    for j in range(2):\n        pass\n" * 1500
    assert assess(code) == []
    assert len(evaluated) == 1 + 1500
