"""The type check: mypy over the package as a fresh clone has it, and the ignores kept honest.

mypy reads its configuration from pyproject.toml ([tool.mypy]: the whole package, strict on
the workflows and the public API, unused ignores and ignores without a code are errors). It
runs on a copy of the files git tracks, so a module that exists only in this working tree
cannot make it pass. Every `# type: ignore[code]` also says why in words after it; their
number is printed and stated on the docs' testing page (docs/testing.md, "Types").
"""

from __future__ import annotations

import ast
import collections
import importlib
import io
import os
import re
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# What the check reads: the package, the top-level folders it links to, and worker.py.
CHECKED = ("pyproject.toml", "worker.py", "durable_rlm", "workflows", "activities", "migrations")
IGNORE = re.compile(r"#\s*type:\s*ignore\b")
# `# type: ignore[code, code]  # the reason, in words`
HONEST = re.compile(r"#\s*type:\s*ignore\[([a-z-]+(?:,\s*[a-z-]+)*)\]\s+#\s*(\S.*)$")


def ignores_in(text: str) -> list[tuple[int, str]]:
    """(line, comment) of each `type: ignore` comment in Python source (not in strings)."""
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    return [(t.start[0], t.string) for t in tokens if t.type == tokenize.COMMENT and IGNORE.search(t.string)]


def ignore_problem(comment: str) -> str | None:
    """Why an ignore comment breaks the policy, or None if it keeps it."""
    if not re.search(r"#\s*type:\s*ignore\[", comment):
        return "no error code: write `# type: ignore[code]`"
    if HONEST.search(comment) is None:
        return "no reason: follow it with `  # why, in words`"
    return None


def checked_sources() -> list[Path]:
    """The Python files mypy checks: the package's tree, through the links."""
    tree = ROOT / "durable_rlm"
    return sorted(
        Path(folder) / name
        for folder, _, files in os.walk(tree, followlinks=True)
        if "__pycache__" not in folder
        for name in files
        if name.endswith(".py")
    )


def all_ignores() -> list[tuple[str, int, str]]:
    found = []
    for path in checked_sources():
        for line, comment in ignores_in(path.read_text(encoding="utf-8")):
            found.append((str(path.relative_to(ROOT)), line, comment))
    return found


@pytest.fixture(scope="module")
def fresh_clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checked files as git tracks them (their working-tree text), links kept as links."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--", *CHECKED], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    copy = tmp_path_factory.mktemp("clone")
    for name in filter(None, listed.split("\0")):
        source, target = ROOT / name, copy / name
        if not source.is_symlink() and not source.exists():
            continue  # deleted here, not yet in git: a clone of the next commit lacks it too
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, target, follow_symlinks=False)
    return copy


def test_mypy_finds_no_error_in_a_fresh_clone(fresh_clone: Path) -> None:
    # The checkout's cache: third-party modules are at the same paths, and mypy checks each
    # of the copy's files against its text, so only what changed is read again.
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(ROOT / ".mypy_cache")],
        cwd=fresh_clone,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, (
        f"mypy (pyproject.toml [tool.mypy]) on the files git tracks:\n{run.stdout}{run.stderr}"
        "(a module git does not track yet is missing here: `git add` it)"
    )


def test_every_ignore_names_its_code_and_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    found = all_ignores()
    broken = [f"{path}:{line}: {why}" for path, line, text in found if (why := ignore_problem(text))]
    assert not broken, "\n".join(broken)
    codes = collections.Counter(
        code.strip() for *_, text in found for code in HONEST.search(text).group(1).split(",")
    )
    with capsys.disabled():
        kinds = ", ".join(f"{code} {n}" for code, n in codes.most_common())
        print(f"\nmypy: {len(found)} `type: ignore` comments ({kinds})")


def test_the_testing_page_states_how_many_ignores_there_are() -> None:
    page = (ROOT / "docs" / "testing.md").read_text(encoding="utf-8")
    stated = re.search(r"(\d+) `type: ignore` comments", page)
    assert stated is not None, "docs/testing.md, Types: say how many `type: ignore` comments there are"
    assert int(stated.group(1)) == len(all_ignores()), "update the count on docs/testing.md, Types"


@pytest.mark.parametrize(
    ("comment", "problem"),
    [
        ("# type: ignore[override]  # rlms's signature", None),
        ("# type: ignore[arg-type, union-attr]  # the JSON's own types", None),
        ("# type: ignore", "no error code"),
        ("# type: ignore  # because", "no error code"),
        ("# type: ignore[override]", "no reason"),
        ("# type: ignore[override] #", "no reason"),
    ],
)
def test_the_ignore_policy_reads_each_comment(comment: str, problem: str | None) -> None:
    found = ignore_problem(comment)
    assert (found is None) if problem is None else (found is not None and found.startswith(problem))


def test_only_comments_count_as_ignores() -> None:
    source = 'x = "# type: ignore"  # type: ignore[assignment]  # a reason\n'
    assert ignores_in(source) == [(1, "# type: ignore[assignment]  # a reason")]


def test_a_type_checker_sees_every_public_name_the_package_exports() -> None:
    """`durable_rlm` loads its names on first use (`__getattr__`), which a type checker
    cannot follow: its `if TYPE_CHECKING:` imports must name the same ones, from the same
    modules, or a user's checker sees Any."""
    import durable_rlm

    tree = ast.parse((ROOT / "durable_rlm" / "__init__.py").read_text(encoding="utf-8"))
    guarded = next(
        node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    )
    imported = {
        alias.asname or alias.name: node.module
        for node in guarded.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert sorted(imported) == durable_rlm.__all__
    for name, module in imported.items():
        assert getattr(durable_rlm, name) is getattr(importlib.import_module(module), name), name
