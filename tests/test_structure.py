"""The house: what the wheel installs, and the floors the rooms keep.

The wheel is built and installed for real (`pip install --no-deps --target`), and everything
is checked on what it installed: only `durable_rlm` at the top, the repository's
`workflows/`, `activities/` and `migrations/` inside it, the worker runnable from it, a user
project with its own `workflows` package unharmed beside it, and import-linter's contract
(pyproject.toml [tool.importlinter]: a cycle or an arrow against the floors breaks it) kept
with no exception listed.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
BIN = Path(PYTHON).parent


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, installed into a folder of its own (its dependencies are this venv's)."""
    target = tmp_path_factory.mktemp("wheel")
    # From a copy: setuptools builds in the source tree (build/), which a run beside must not share.
    source = tmp_path_factory.mktemp("source") / "durable-rlm"
    skip = shutil.ignore_patterns(".venv", ".git", "build", "mutation", "mutants", "__pycache__", "*.egg-*")
    shutil.copytree(ROOT, source, ignore=skip)
    subprocess.run(
        [PYTHON, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(source)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return target


def run_beside(installed: Path, code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter that finds durable_rlm only in the installed wheel."""
    return subprocess.run(
        [PYTHON, "-I", "-c", f"import sys; sys.path[:0] = [{str(cwd)!r}, {str(installed)!r}]\n{code}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def test_the_wheel_installs_only_the_project_s_package(installed: Path) -> None:
    tops = {p.name for p in installed.iterdir() if not p.name.endswith(".dist-info") and p.name != "bin"}
    assert tops == {"durable_rlm"}
    (info,) = installed.glob("durable_rlm-*.dist-info")
    assert (info / "top_level.txt").read_text().split() == ["durable_rlm"]
    package = installed / "durable_rlm"
    for folder in ("workflows", "activities", "activities/sandbox", "migrations", "migrations/versions"):
        assert (package / folder / "__init__.py").is_file(), folder
    assert (package / "migrations" / "script.py.mako").is_file()
    assert (package / "prices.json").is_file() and list((package / "viewer" / "static").iterdir())
    assert (package / "py.typed").is_file()  # a user's type checker reads our types, not Any
    # Every package of the checkout's tree is in the wheel (setuptools finds them through
    # the links), and nothing else is.
    found = {
        ".".join(("durable_rlm", *p.parent.relative_to(package).parts)) for p in package.rglob("__init__.py")
    }
    assert found == packages_of_the_checkout()


def packages_of_the_checkout() -> set[str]:
    """The packages under `durable_rlm/` as the import system sees the checkout: through the
    links to the top-level folders (os.walk follows them only when asked)."""
    tree = ROOT / "durable_rlm"
    return {
        ".".join(("durable_rlm", *Path(folder).relative_to(tree).parts))
        for folder, _, files in os.walk(tree, followlinks=True)
        if "__init__.py" in files and "__pycache__" not in folder
    }


def test_the_top_level_folders_are_the_package_s_through_links() -> None:
    """One tree, one name: `durable_rlm/workflows` (and activities, migrations) is a link to
    the repository's top-level folder, so no tool needs a mapping of its own."""
    for folder in ("workflows", "activities", "migrations"):
        link = ROOT / "durable_rlm" / folder
        assert link.is_symlink() and link.resolve() == ROOT / folder, folder
        assert (ROOT / folder / "__init__.py").is_file()
    assert "package-dir" not in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_the_checkout_holds_no_stray_package() -> None:
    """The repository's tests, benchmarks and docs are not importable as parts of the package
    (an `__path__` reaching up to the checkout once made `durable_rlm.tests` import)."""
    code = (
        "import importlib.util, json\n"
        "names = ['durable_rlm.tests', 'durable_rlm.bench', 'durable_rlm.docs', 'durable_rlm.workflows']\n"
        "print(json.dumps([importlib.util.find_spec(n) is not None for n in names]))"
    )
    done = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[false, false, false, true]"


def test_a_user_s_own_workflows_package_is_not_shadowed(installed: Path, tmp_path: Path) -> None:
    """The reported failure: a project with its own `workflows` could not import ours."""
    (tmp_path / "workflows").mkdir()
    (tmp_path / "workflows" / "__init__.py").write_text("MINE = True\n")
    (tmp_path / "activities.py").write_text("MINE = True\n")
    code = (
        "import workflows, activities\n"
        "from durable_rlm import DurableRLM, EpisodeRequest\n"
        "import durable_rlm.workflows.models, durable_rlm.worker.main, durable_rlm.store.sql as sql\n"
        "assert workflows.MINE and activities.MINE\n"
        "assert durable_rlm.workflows.models.__file__.startswith(sys.path[1])\n"
        "assert (sql.MIGRATIONS_DIR / 'env.py').is_file(), sql.MIGRATIONS_DIR\n"
        "from durable_rlm.viewer import episode_page\n"
        "assert all(episode_page.static_asset(name) for name in episode_page.STATIC)\n"
        "print('ok')\n"
    )
    done = run_beside(installed, code, tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_installed_worker_runs_its_command_line(installed: Path, tmp_path: Path) -> None:
    """`drlm worker` and `python worker.py` both start durable_rlm.worker.main; from the
    wheel it parses its flags (a bad one is a usage error naming it)."""
    code = "from durable_rlm.worker.main import main\nmain(['--processes', 'many'])"
    done = run_beside(installed, code, tmp_path)
    assert done.returncode == 2 and "many" in done.stderr, done.stderr


@pytest.mark.parametrize("where", ["wheel", "checkout"])
def test_the_floors_hold_with_no_exception(installed: Path, where: str) -> None:
    """import-linter on what the wheel installed and on the checkout itself (as a fresh clone
    has it): no cycle, no arrow up the floors, every room on a floor (`exhaustive`), and no
    `ignore_imports` to hide one."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    for contract in config["contracts"]:
        assert "ignore_imports" not in contract and "skip_descendants" not in contract
        assert contract.get("exhaustive", contract["type"] != "layers") is True
    path = installed if where == "wheel" else ROOT
    done = subprocess.run(
        [str(BIN / "lint-imports"), str(ROOT / "pyproject.toml"), "--no-cache"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=path,
        env={"PYTHONPATH": str(path), "PATH": str(BIN)},
    )
    assert done.returncode == 0, done.stdout[-4000:]
    assert "2 kept, 0 broken" in done.stdout


def test_every_safety_mechanism_of_the_matrix_is_found_where_it_says() -> None:
    """scripts/safety_matrix.py switches each mechanism off by replacing one text in one file:
    a text that moved (a split, a rename) would make its run fail to start, unnoticed until
    someone runs the matrix. Each must be found exactly once."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import safety_matrix
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    stale = [
        f"{m.name}: {m.file}"
        for m in safety_matrix.MECHANISMS
        if not (ROOT / m.file).is_file() or (ROOT / m.file).read_text().count(m.find) != 1
    ]
    assert stale == []


ACTIVITY_USERS = {
    "durable_rlm.worker.runtime": "registers the activities and their interceptors",
    "durable_rlm.worker.main": "the worker's command line",
    "durable_rlm.cli.doctor": "checks each sandbox layer by starting a real sandbox",
    "durable_rlm.rlms.local_repl": "rlms's LocalREPL: a program drives a sandboxed REPL itself",
    "durable_rlm.cli.run": "how large a context one sandbox of this host can hold",
    "durable_rlm.client.context_input": "the same room, for a context read from files",
    "durable_rlm.client.episodes": "an embedded worker's context cache, filled as the context is stored",
}
"""The modules outside activities/ that import it, and why. activities/ holds the activity
definitions and what only they use; a helper that another room needs lives in that room or
below it (durable_rlm/store: chains, audit rows, store outages; durable_rlm/host: processes,
files, owned directories), so a new import of activities/ from elsewhere fails here until
it is moved down, or listed with its reason."""


def test_activities_are_imported_only_by_the_rooms_that_run_them() -> None:
    found: set[str] = set()
    package = ROOT / "durable_rlm"
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package)
        if relative.parts[0] in ("activities", "workflows", "migrations"):
            continue  # the links to the top-level folders
        module = ".".join(("durable_rlm", *relative.with_suffix("").parts)).removesuffix(".__init__")
        if any(name.split(".")[:2] == ["durable_rlm", "activities"] for name in runtime_imports(path)):
            found.add(module)
    assert sorted(found) == sorted(ACTIVITY_USERS)


def runtime_imports(path: Path) -> list[str]:
    """The modules `path` imports when it runs: not those for annotations only
    (`if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test).endswith("TYPE_CHECKING")
        for node in ast.walk(block)
    }
    names = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    return names
