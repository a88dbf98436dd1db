"""Where imports go (docs/architecture/decisions.md#rooms-floors-and-imports-with-a-reason):
at the top of the module, unless there is a reason on the line.

An import inside a function hides a dependency from the reader, from import-linter's view of
the floors until the function runs, and from the start-up probes (tests/test_startup.py). It is
allowed for two reasons only, said on the import itself:

- `# start-up: <what it costs, who avoids it>`: a measured cost a start-up path does not pay
  (`drlm list` and `from durable_rlm import DurableRLM` import neither temporalio nor SQLAlchemy);
- `# optional: <the extra that provides it>`: a dependency the base install does not have.

The comment may sit on any line of the statement (a long one is wrapped in parentheses).

And the repository's `workflows/`, `activities/`, `migrations/` are only ever imported as
`durable_rlm.workflows` etc.: the same file under two names is two modules (two sets of
classes, a workflow registered twice, isinstance checks that fail across them).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("durable_rlm", "activities", "workflows")
REASON = re.compile(r"#\s*(?:start-up|optional):\s*\S")
TOP_LEVEL_TWINS = ("workflows", "activities", "migrations")


def unexplained_imports(source: str) -> list[int]:
    """The first line of each import inside a function (nested ones too) that gives no reason."""
    lines = source.splitlines()
    found: set[int] = set()
    for function in ast.walk(ast.parse(source)):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(function):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            statement = lines[node.lineno - 1 : (node.end_lineno or node.lineno)]
            if not any(REASON.search(line) for line in statement):
                found.add(node.lineno)
    return sorted(found)


def test_the_scan_sees_an_import_without_a_reason() -> None:
    source = (
        "import os\n"
        "def f():\n"
        "    import json\n"  # 3: no reason
        "    import sqlite3  # start-up: 5 ms that nobody pays\n"
        "    from a import (  # optional: the a extra\n"
        "        b,\n"
        "    )\n"
        "    from c import (\n"  # 8: a reason on a later line of the statement counts
        "        d,  # start-up: c is slow\n"
        "    )\n"
        "    class K:\n"
        "        async def g(self):\n"
        "            import re  # start-up:\n"  # 13: a reason needs words
        "    import zlib  # why not\n"  # 14: another comment is no reason
    )
    assert unexplained_imports(source) == [3, 13, 14]


def test_every_import_inside_a_function_says_why() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {path.read_text().splitlines()[line - 1].strip()}"
        for folder in SCANNED
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line in unexplained_imports(path.read_text())
    ]
    assert not offenders, (
        f"{len(offenders)} import(s) inside functions with no `# start-up: ...` or "
        "`# optional: ...` reason: move them to the top of the module, or say why\n" + "\n".join(offenders)
    )


def test_the_repository_s_folders_are_imported_only_inside_the_package() -> None:
    """From the checkout, where a stray `import workflows` would succeed."""
    code = (
        "import durable_rlm.worker.runtime, durable_rlm.api, durable_rlm.supervisor\n"
        "import json, sys\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = json.loads(out.stdout.splitlines()[-1])
    twins = [m for m in loaded if m.split(".")[0] in TOP_LEVEL_TWINS]
    assert twins == []
    assert "durable_rlm.workflows.episode" in loaded  # the probe saw the package's own


def dspy_imports(source: str) -> list[int]:
    """Lines that import dspy (or a module of it), anywhere in a module."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "dspy" for a in node.names):
            found.append(node.lineno)
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").split(".")[0] == "dspy"
        ):
            found.append(node.lineno)
    return found


def test_only_the_dspy_room_imports_dspy() -> None:
    """DSPy is an optional extra (`durable-rlm[dspy]`): `durable_rlm.dspy` alone imports it."""
    assert dspy_imports("import dspy\nfrom dspy.adapters import x\nfrom .dspy import y\n") == [1, 2]
    room = ROOT / "durable_rlm" / "dspy"
    offenders = [
        f"{path.relative_to(ROOT)}:{line}"
        for folder in SCANNED
        for path in sorted((ROOT / folder).rglob("*.py"))
        if room not in path.parents
        for line in dspy_imports(path.read_text())
    ]
    assert offenders == []
    assert dspy_imports((room / "module.py").read_text())  # the room itself does


def test_the_runtime_loads_without_dspy() -> None:
    code = (
        "import durable_rlm, durable_rlm.worker.runtime, durable_rlm.api, durable_rlm.cli\n"
        "import sys\nprint('dspy' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "False"
