"""The mutation score of the pure workflow modules, in one command.

    .venv/bin/python scripts/mutation_score.py                  # mutmut run, then the score
    .venv/bin/python scripts/mutation_score.py --max-children 1 # on a machine others share
    .venv/bin/python scripts/mutation_score.py --no-run         # the score of the last run

mutmut (configured in pyproject.toml's [tool.mutmut]) mutates the eleven pure workflow modules
(parsing, termination, fallback, typed_outputs, signals, prompts, budget, compaction, steering,
ending, outcome) and runs their unit tests against each mutant. This script reads its
results, prints the score per module and every survivor, marks the survivors that
docs/mutation.md has reviewed, and exits non-zero when fewer than 90% of the mutants are
killed, in all or in any one module (a weak module must not hide behind strong ones). A
timeout counts as killed: the mutant made the tests hang, which a real run notices.

mutmut runs in a staged copy of the tree laid out as the wheel installs it (`mutation/`:
durable_rlm/ with workflows/, activities/ and migrations/ inside). mutmut names a mutant by
the path it mutated and its trampoline looks it up by the function's `__module__`; the
code's modules are `durable_rlm.workflows.*`, so the mutated files must sit at that path.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections import Counter
from pathlib import Path

from mutmut.stats import status_by_exit_code
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
REVIEWED = ROOT / "docs" / "mutation.md"
STAGE = ROOT / "mutation"  # the staged tree (git-ignored); its mutants/ holds mutmut's results
MAPPED = ("workflows", "activities", "migrations")  # top-level here, inside durable_rlm installed
THRESHOLD = 0.90
KILLED = {"killed", "timeout", "caught by type check"}


def results() -> dict[str, dict[str, str]]:
    """Status of every mutant, by module, from mutmut's own meta files."""
    by_module: dict[str, dict[str, str]] = {}
    for meta in sorted((STAGE / "mutants").rglob("*.py.meta")):
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        module = str(meta.relative_to(STAGE / "mutants")).removesuffix(".meta").removeprefix("durable_rlm/")
        by_module[module] = {key: status_by_exit_code[code] for key, code in codes.items()}
    return by_module


def reviewed_names() -> set[str]:
    """Mutant names that docs/mutation.md lists (in backticks) as reviewed survivors."""
    if not REVIEWED.exists():
        return set()
    return set(re.findall(r"`(durable_rlm\.workflows\.[\w.]+__mutmut_\d+)`", REVIEWED.read_text()))


def stage() -> None:
    """The installed layout under STAGE, with pyproject's [tool.mutmut] pointed at it."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    if STAGE.exists():
        shutil.rmtree(STAGE)
    shutil.copytree(ROOT / "durable_rlm", STAGE / "durable_rlm", ignore=skip)
    for folder in MAPPED:
        shutil.copytree(ROOT / folder, STAGE / "durable_rlm" / folder, ignore=skip)
    shutil.copytree(ROOT / "tests", STAGE / "tests", ignore=skip)
    text = (ROOT / "pyproject.toml").read_text()
    config = tomllib.loads(text)["tool"]["mutmut"]
    head, _, rest = text.partition("[tool.mutmut]")
    tail = rest[rest.index("\n[", 1) :] if "\n[" in rest[1:] else ""
    others = sorted(p.name + ("/" if p.is_dir() else "") for p in (STAGE / "durable_rlm").iterdir())
    staged = {
        **config,
        "source_paths": ["durable_rlm/workflows/"],
        "only_mutate": ["durable_rlm/" + path for path in config["only_mutate"]],
        "also_copy": ["durable_rlm/" + name for name in others if name != "workflows/"],
    }
    lines = ["[tool.mutmut]", *(f"{key} = {json.dumps(value)}" for key, value in staged.items())]
    (STAGE / "pyproject.toml").write_text(head + "\n".join(lines) + "\n" + tail)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--no-run", action="store_true", help="score the last run without running mutmut")
    parser.add_argument(
        "--max-children",
        type=int,
        metavar="N",
        help="run at most N mutants at once (mutmut's default: one per core)",
    )
    args = parser.parse_args()
    console = Console(soft_wrap=True)  # mutant names stay whole, for copy and paste
    if not args.no_run:
        env = {**os.environ, "HYPOTHESIS_PROFILE": os.environ.get("HYPOTHESIS_PROFILE", "mutation")}
        command = [sys.executable, "-m", "mutmut", "run"]
        if args.max_children is not None:
            command += ["--max-children", str(args.max_children)]
        stage()
        run = subprocess.run(command, cwd=STAGE, env=env)
        if run.returncode not in (0, 1):
            console.print(f"[red]mutmut run failed with exit code {run.returncode}[/red]")
            return run.returncode
    by_module = results()
    if not by_module:
        console.print("[red]no mutmut results: run without --no-run first[/red]")
        return 1

    table = Table(title="Mutation score (mutmut), durable_rlm/workflows/")
    for column in ("module", "mutants", "killed", "timeout", "survived", "other", "score"):
        table.add_column(column, justify="left" if column == "module" else "right", no_wrap=True)
    total = Counter()
    survivors: list[str] = []
    below: list[str] = []
    for module, statuses in by_module.items():
        counts = Counter(statuses.values())
        killed = sum(counts[s] for s in KILLED)
        other = len(statuses) - killed - counts["survived"]
        total.update(mutants=len(statuses), killed=killed, survived=counts["survived"], other=other)
        survivors += sorted(key for key, status in statuses.items() if status == "survived")
        if killed / max(1, len(statuses)) < THRESHOLD:
            below.append(module.removeprefix("workflows/"))
        table.add_row(
            module.removeprefix("workflows/"),
            str(len(statuses)),
            str(counts["killed"] + counts["caught by type check"]),
            str(counts["timeout"]),
            str(counts["survived"]),
            str(other),
            f"{killed / max(1, len(statuses)):.1%}",
        )
    score = total["killed"] / max(1, total["mutants"])
    table.add_row(
        "all",
        str(total["mutants"]),
        "",
        "",
        str(total["survived"]),
        str(total["other"]),
        f"{score:.1%}",
        style="bold",
    )
    console.print(table)

    known = reviewed_names()
    unreviewed = [name for name in survivors if name not in known]
    reviewed = len(survivors) - len(unreviewed)
    console.print(f"{len(survivors)} survivors, {reviewed} reviewed in docs/mutation.md")
    for name in survivors:
        console.print(f"  {'reviewed  ' if name in known else 'UNREVIEWED'} {name}")
    if unreviewed:
        console.print(f"see one with: cd mutation && ../.venv/bin/mutmut show {unreviewed[0]}")
    if score < THRESHOLD:
        console.print(f"[red]score {score:.1%} is below {THRESHOLD:.0%}[/red]")
        return 1
    if below:
        console.print(f"[red]below {THRESHOLD:.0%}: {', '.join(below)}[/red]")
        return 1
    console.print(f"[green]score {score:.1%} >= {THRESHOLD:.0%}[/green]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
