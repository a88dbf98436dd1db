"""A manual check: rlms 0.1.3's own tests of its public API, run against durable-rlm with only
their `from rlm...` imports changed.

    python scripts/rlms_tests.py [PATH_TO_RLMS_REPOSITORY] [--tag v0.1.3] [pytest arguments]

The tests live in rlms's repository (a bare clone will do: `git show TAG:tests/NAME.py`); CI
has none, and runs tests/rlms_compat instead. Only the test files that use rlms's public API
are taken: the others patch `rlm.core.rlm.get_client`, talk to its socket protocol or read
private attributes, so they test rlms's insides, not what a program sees.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

PUBLIC_API_TESTS = [
    "tests/test_parsing.py",
    "tests/test_types.py",
    "tests/test_local_repl.py",
    "tests/test_local_repl_persistent.py",
    "tests/test_rlm_query.py",
    "tests/repl/test_custom_tools.py",
    "tests/repl/test_local_repl.py",
]
IMPORTS = re.compile(r"^(\s*)from rlm(?=[.\s])", re.MULTILINE)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("repository", nargs="?", default="/work/.mirror/alexzhang13+rlm/repo")
    parser.add_argument("--tag", default="v0.1.3")
    args, pytest_args = parser.parse_known_args()
    work = Path(tempfile.mkdtemp(prefix="drlm-rlms-tests-"))
    for path in PUBLIC_API_TESTS:
        source = subprocess.run(
            ["git", "-C", args.repository, "show", f"{args.tag}:{path}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        target = work / ("test_rlms_" + path.removeprefix("tests/").replace("/", "_"))
        target.write_text(IMPORTS.sub(r"\1from durable_rlm", source))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(work), *pytest_args]
    return subprocess.run(command, cwd=work).returncode


if __name__ == "__main__":
    sys.exit(main())
