"""The benchmarks run and print their figures (the default run takes the quick parsing
benchmark; the engine-overhead one, minutes long, runs with `pytest -m slow`)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_parsing_benchmark_prints_flat_figures_per_mb() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "parsing.py"), "--max-mb", "0.01", "--legacy-budget-s", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "2,000 unclosed FINAL(" in out.stdout and "legacy (old histories)" in out.stdout
    slowest = re.search(r"slowest single call: (\d+) ms", out.stdout)
    assert slowest is not None


@pytest.mark.slow
def test_the_engine_overhead_benchmark_prints_its_ratio() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "engine_overhead.py"), "--iterations", "3", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert re.search(r"ratio durable/direct \(overhead\): +[0-9.]+x", out.stdout), out.stdout
