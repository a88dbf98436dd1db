"""The benchmarks run and print their figures (the default run takes the quick parsing
benchmark; the engine-overhead one, minutes long, runs with `pytest -m slow`)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_bench(script: str, *args: str, timeout: float) -> str:
    """Run a benchmark as a user would; its printed figures are what the test reads."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args], capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_parsing_benchmark_prints_flat_figures_per_mb() -> None:
    out = run_bench("parsing.py", "--max-mb", "0.01", "--legacy-budget-s", "1", timeout=300)
    assert "2,000 unclosed FINAL(" in out and "legacy (old histories)" in out
    slowest = re.search(r"slowest single call: (\d+) ms", out)
    assert slowest is not None


@pytest.mark.slow
def test_the_engine_overhead_benchmark_prints_its_ratio() -> None:
    out = run_bench("engine_overhead.py", "--iterations", "3", "--repeats", "1", timeout=600)
    assert re.search(r"ratio durable/direct \(overhead\): +[0-9.]+x", out), out
    assert re.search(r"ratio untuned/tuned server: +[0-9.]+x", out), out


@pytest.mark.slow
def test_the_child_start_benchmark_prints_its_figures() -> None:
    out = run_bench("child_start.py", "--children", "2", "--repeats", "1", timeout=600)
    assert re.search(r"ratio sequential/plain: [0-9.]+x", out), out
    assert re.search(r"time to start a child .*: median \d+ ms", out), out
