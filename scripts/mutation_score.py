"""The mutation score of the pure workflow modules and of the host's boundaries, in one command.

    .venv/bin/python scripts/mutation_score.py                   # both sets: mutmut run, then the score
    .venv/bin/python scripts/mutation_score.py --set host        # one set
    .venv/bin/python scripts/mutation_score.py --max-children 1  # on a machine others share
    .venv/bin/python scripts/mutation_score.py --no-run          # the score of the last runs

Two sets of modules, each a mutmut configuration in pyproject.toml:
- `workflows` ([tool.mutmut]): the eleven pure workflow modules (parsing, termination,
  fallback, typed_outputs, signals, prompts, budget, compaction, steering, ending, outcome);
- `host` ([tool.mutation_score.host]): what stands between the worker and what it does not
  trust: the sandbox protocol (sandbox_protocol.py, and the sandbox's framing.py and
  values.py), the calls a cell makes (host_calls.py), and the codec and page server
  (codec_requests.py, codec_server.py, codec_wire.py).
mutmut runs each set's unit tests against each mutant (tests with no Temporal server and no
sandbox: a sandbox child cannot load a mutated module, and each mutant reruns them). This
script reads the results, prints the score per module and every survivor, marks the
survivors that docs/mutation.md has reviewed, and exits non-zero when fewer than 90% of the
mutants are killed, in a set or in any one module (a weak module must not hide behind strong
ones). A timeout counts as killed: the mutant made the tests hang, which a real run notices.

mutmut runs in a staged copy of the tree per set (`mutation/<set>/`, with the package as the
wheel installs it: durable_rlm/ with workflows/, activities/ and migrations/ inside, the
repository's links resolved) and that set's configuration as its [tool.mutmut]. mutmut names
a mutant by the path it mutated and its trampoline looks it up by the function's
`__module__`; the code's modules are `durable_rlm.*`, so the mutated files must sit at that path.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from collections import Counter
from pathlib import Path
from typing import Any

from mutmut.stats import status_by_exit_code
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
REVIEWED = ROOT / "docs" / "mutation.md"
STAGES = ROOT / "mutation"  # a staged tree per set (git-ignored); its mutants/ holds mutmut's results
SETS = ("workflows", "host")
MAPPED = ("workflows/", "activities/", "migrations/")  # top-level here, inside durable_rlm installed
THRESHOLD = 0.90
KILLED = {"killed", "timeout", "caught by type check"}


def configuration(name: str) -> dict[str, Any]:
    """A set's mutmut configuration, with the paths as the repository names them."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
    return dict(tool["mutmut"] if name == "workflows" else tool["mutation_score"][name])


def installed(path: str) -> str:
    """A repository path as the wheel lays it out (`activities/x.py` -> `durable_rlm/activities/x.py`)."""
    return "durable_rlm/" + path if path.startswith(MAPPED) else path


def results(name: str) -> dict[str, dict[str, str]]:
    """Status of every mutant of a set, by module, from mutmut's own meta files."""
    mutants = STAGES / name / "mutants"
    by_module: dict[str, dict[str, str]] = {}
    for meta in sorted(mutants.rglob("*.py.meta")):
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        module = str(meta.relative_to(mutants)).removesuffix(".meta").removeprefix("durable_rlm/")
        by_module[module] = {key: status_by_exit_code[code] for key, code in codes.items()}
    return by_module


def reviewed_names() -> set[str]:
    """Mutant names that docs/mutation.md lists (in backticks) as reviewed survivors."""
    if not REVIEWED.exists():
        return set()
    return set(re.findall(r"`(durable_rlm\.[\w.]+__mutmut_\d+)`", REVIEWED.read_text()))


def stage(name: str) -> Path:
    """The installed layout under mutation/<name>/, with that set's configuration as its
    pyproject's [tool.mutmut], its paths pointed at the staged package."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    staged_tree = STAGES / name
    if staged_tree.exists():
        shutil.rmtree(staged_tree)
    # durable_rlm/workflows, activities and migrations are links to the top-level folders:
    # copied as the folders they point at (the stage is the installed package).
    shutil.copytree(ROOT / "durable_rlm", staged_tree / "durable_rlm", ignore=skip)
    shutil.copytree(ROOT / "tests", staged_tree / "tests", ignore=skip)
    text = (ROOT / "pyproject.toml").read_text()
    config = configuration(name)
    mutated = [installed(path) for path in config["only_mutate"]]
    folders = {path.rpartition("/")[0] + "/" for path in mutated}
    sources = sorted(f for f in folders if not any(f != o and f.startswith(o) for o in folders))
    others = sorted(
        f"durable_rlm/{p.name}" + ("/" if p.is_dir() else "") for p in (staged_tree / "durable_rlm").iterdir()
    )
    staged = {
        **config,
        "source_paths": sources,
        "only_mutate": mutated,
        # Everything else of the package, as it is (a mutated module's folder is copied by mutmut).
        "also_copy": [path for path in others if not any(source.startswith(path) for source in sources)],
    }
    head, _, rest = text.partition("[tool.mutmut]")
    tail = rest[rest.index("\n[", 1) :] if "\n[" in rest[1:] else ""
    lines = ["[tool.mutmut]", *(f"{key} = {json.dumps(value)}" for key, value in staged.items())]
    (staged_tree / "pyproject.toml").write_text(head + "\n".join(lines) + "\n" + tail)
    return staged_tree


def score(name: str, known: set[str], console: Console) -> bool:
    """Print one set's table and survivors; whether every module of it reaches THRESHOLD."""
    by_module = results(name)
    if not by_module:
        console.print(f"[red]no mutmut results for {name}: run without --no-run first[/red]")
        return False
    table = Table(title=f"Mutation score (mutmut), {name}")
    for column in ("module", "mutants", "killed", "timeout", "survived", "other", "score"):
        table.add_column(column, justify="left" if column == "module" else "right", no_wrap=True)
    total: Counter[str] = Counter()
    survivors: list[str] = []
    below: list[str] = []
    for module, statuses in by_module.items():
        counts = Counter(statuses.values())
        killed = sum(counts[s] for s in KILLED)
        other = len(statuses) - killed - counts["survived"]
        total.update(mutants=len(statuses), killed=killed, survived=counts["survived"], other=other)
        survivors += sorted(key for key, status in statuses.items() if status == "survived")
        if killed / max(1, len(statuses)) < THRESHOLD:
            below.append(module)
        table.add_row(
            module,
            str(len(statuses)),
            str(counts["killed"] + counts["caught by type check"]),
            str(counts["timeout"]),
            str(counts["survived"]),
            str(other),
            f"{killed / max(1, len(statuses)):.1%}",
        )
    overall = total["killed"] / max(1, total["mutants"])
    table.add_row(
        "all",
        str(total["mutants"]),
        "",
        "",
        str(total["survived"]),
        str(total["other"]),
        f"{overall:.1%}",
        style="bold",
    )
    console.print(table)

    unreviewed = [survivor for survivor in survivors if survivor not in known]
    reviewed = len(survivors) - len(unreviewed)
    console.print(f"{len(survivors)} survivors, {reviewed} reviewed in docs/mutation.md")
    for survivor in survivors:
        console.print(f"  {'reviewed  ' if survivor in known else 'UNREVIEWED'} {survivor}")
    if unreviewed:
        console.print(f"see one with: cd mutation/{name} && ../../.venv/bin/mutmut show {unreviewed[0]}")
    if overall < THRESHOLD:
        console.print(f"[red]{name}: score {overall:.1%} is below {THRESHOLD:.0%}[/red]")
        return False
    if below:
        console.print(f"[red]{name}: below {THRESHOLD:.0%}: {', '.join(below)}[/red]")
        return False
    console.print(f"[green]{name}: score {overall:.1%} >= {THRESHOLD:.0%}[/green]")
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--no-run", action="store_true", help="score the last run without running mutmut")
    parser.add_argument(
        "--set",
        choices=(*SETS, "all"),
        default="all",
        help="which modules: the pure workflow modules, the host's boundaries, or both (the default)",
    )
    parser.add_argument(
        "--max-children",
        type=int,
        metavar="N",
        help="run at most N mutants at once (mutmut's default: one per core)",
    )
    args = parser.parse_args()
    console = Console(soft_wrap=True)  # mutant names stay whole, for copy and paste
    chosen = SETS if args.set == "all" else (args.set,)
    env = {**os.environ, "HYPOTHESIS_PROFILE": os.environ.get("HYPOTHESIS_PROFILE", "mutation")}
    passed = True
    for name in chosen:
        if not args.no_run:
            command = [sys.executable, "-m", "mutmut", "run"]
            if args.max_children is not None:
                command += ["--max-children", str(args.max_children)]
            began = time.monotonic()
            run = subprocess.run(command, cwd=stage(name), env=env)
            console.print(f"{name}: mutmut ran {(time.monotonic() - began) / 60:.1f} min")
            if run.returncode not in (0, 1):
                console.print(f"[red]mutmut run ({name}) failed with exit code {run.returncode}[/red]")
                return run.returncode
        passed = score(name, reviewed_names(), console) and passed
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
