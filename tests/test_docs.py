"""The documentation site builds strictly, and says what the code says.

`mkdocs build --strict` fails on a broken internal link or anchor, a page left out of the
navigation, or a reference page whose generator fails (docs/_hooks/reference.py writes the
CLI and settings pages from the code). CI runs the same build; this test makes a broken link
fail locally too. The README is the site's front door: its links must lead somewhere. And
the repository's text names nothing a reader cannot open: a comment says the rule, or points
at the docs page that holds it, and that pointer leads to a heading.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify

from durable_rlm.cli import build_parser
from durable_rlm.settings import Settings

ROOT = Path(__file__).resolve().parent.parent


def build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = build(ROOT / "mkdocs.yml", out)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def page_text(site: Path, page: str) -> str:
    html = (site / page / "index.html").read_text(encoding="utf-8")
    return re.sub(r"<[^>]+>", "", html)


def test_the_cli_reference_lists_every_command_and_flag_of_the_parser(site: Path) -> None:
    text = page_text(site, "reference/cli")
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name, command in commands.items():
        assert f"drlm {name}" in text, name
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue  # every command has -h; the page does not repeat it
            for option in action.option_strings:
                assert option in text, f"drlm {name} {option}"


def test_the_settings_reference_lists_every_variable(site: Path) -> None:
    text = page_text(site, "reference/settings")
    for variable in Settings.variables().values():
        assert variable in text, variable


def test_the_api_reference_is_generated_from_docstrings(site: Path) -> None:
    text = page_text(site, "reference/python-api")
    assert "DurableRLM" in text and "EpisodeResult" in text and "TerminationPolicy" in text
    assert "should_terminate" in text  # a member, documented from its docstring


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs, ignore=shutil.ignore_patterns("_*"))
    page = docs / "getting-started.md"
    page.write_text(page.read_text() + "\nSee [a page that is not there](nowhere.md).\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text(
        f"INHERIT: {ROOT / 'mkdocs.yml'}\n"
        f"docs_dir: {docs}\n"
        f"hooks:\n  - {ROOT / 'docs' / '_hooks' / 'reference.py'}\n"
    )
    done = build(config, tmp_path / "site")
    assert done.returncode != 0
    assert "nowhere.md" in done.stderr


def test_every_link_of_the_readme_leads_to_a_file() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert targets
    for target in targets:
        if "://" in target:
            continue
        path = ROOT / target.split("#", 1)[0]
        assert path.is_file(), f"README links to {target}, which is not a file"


def test_the_readme_is_a_front_page() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    for command in (
        'python3 -m venv .venv && .venv/bin/pip install -e ".[dev]" && .venv/bin/drlm demo',
        'python3 -m venv .venv && .venv/bin/pip install -e ".[dev]" && .venv/bin/pytest',
    ):
        assert command in readme
    assert "source .venv/bin/activate" in readme


def test_every_drlm_run_of_the_front_pages_names_its_model() -> None:
    """There is no built-in default model: a `drlm run` that names none stops before it
    starts, so the README's and getting started's examples must name one to run as written."""
    for page in (ROOT / "README.md", ROOT / "docs" / "getting-started.md"):
        text = page.read_text(encoding="utf-8").replace("\\\n", " ")
        runs = [line for line in text.splitlines() if line.lstrip().startswith("drlm run ")]
        assert runs, page
        for line in runs:
            assert "--model " in line, f"{page.name}: {line.strip()}"


# Names a reader of the repository cannot open: the project's early specifications ("seed"
# and a number, one spec's number), its design note and its numbered issues. The pages that
# define them (the decisions page's table, the behaviour pages) are the only place for them;
# anywhere else a comment says the rule itself or points at the docs page that holds it.
UNOPENABLE = re.compile(r"\b(?:[Ss]eed[ -]?[0-9]+|[Ii]ssues? #?[0-9]+|SPEC-[0-9]+|" + "DES" + r"IGN)\b")
DEFINING_PAGES = ("docs/architecture/decisions.md", "docs/behaviour/")
DOCS_POINTER = re.compile(r"\bdocs/([\w/.-]+\.md)#([\w-]+)")


def repository_text() -> dict[str, str]:
    """Every text file git knows of or would add (tracked, or new and not ignored)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        capture_output=True,
        cwd=ROOT,
        check=True,
    ).stdout.decode()
    texts = {}
    for name in filter(None, listed.split("\0")):
        path = ROOT / name
        if not path.is_file():
            continue  # deleted in the working tree
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary: a screenshot, a plot
        texts[name] = data.decode("utf-8", errors="replace")
    return texts


def test_no_reference_a_reader_cannot_open_outside_the_pages_that_define_it() -> None:
    found = [
        f"{name}:{number}: {line.strip()[:120]}"
        for name, text in repository_text().items()
        if not name.startswith(DEFINING_PAGES)
        for number, line in enumerate(text.splitlines(), 1)
        if UNOPENABLE.search(line)
    ]
    assert not found, (
        "say the rule itself, or point at the docs page that holds it "
        "(docs/architecture/decisions.md has a section for each reason):\n" + "\n".join(found)
    )


def test_the_guard_catches_each_kind_of_reference() -> None:
    caught = (  # every kind as it was written (built here, so this file holds none of them)
        " ".join(("(seed", "004)")),
        " ".join(("Seed", "001's table")),
        " ".join(("issue", "38, item 4")),
        " ".join(("issues", "33")),
        "SPEC-" + "27",
        "DES" + "IGN note",
    )
    for text in caught:
        assert UNOPENABLE.search(text), text
    for text in ("random.seed(7)", "the seed is drawn once", "a design note", "PYTHONHASHSEED=0", "seed=1"):
        assert not UNOPENABLE.search(text), text


def heading_anchors(page: Path) -> set[str]:
    """The anchors MkDocs gives a page's headings (the toc extension's own slugify), and any
    set with attr_list's `{#id}`."""
    anchors = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            continue
        title = line.lstrip("#").strip()
        if explicit := re.search(r"\{#([\w-]+)\}\s*$", title):
            anchors.add(explicit.group(1))
            continue
        anchors.add(slugify(re.sub(r"[`*]", "", title), "-"))
    return anchors


def test_every_pointer_into_the_docs_leads_to_a_heading() -> None:
    """A comment that points at `docs/<page>.md#<anchor>` instead of repeating the reason must
    lead somewhere: the page exists and has that heading (the site's build checks only links
    between its own pages)."""
    anchors: dict[str, set[str]] = {}
    broken = []
    for name, text in repository_text().items():
        for page, anchor in DOCS_POINTER.findall(text):
            path = ROOT / "docs" / page
            if page not in anchors:
                anchors[page] = heading_anchors(path) if path.is_file() else set()
            if anchor not in anchors[page]:
                broken.append(f"{name}: docs/{page}#{anchor}")
    assert not broken, "\n".join(broken)
