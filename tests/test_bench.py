"""The benchmarks run and print their figures (the default run takes the quick parsing
benchmark and a smoke run of two cheap sections of the suite, bench/run.py; the
engine-overhead one, minutes long, and the rest of the suite run with `pytest -m slow`)."""

from __future__ import annotations

import json
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
    out = run_bench("parsing.py", "--max-mb", "0.01", timeout=300)
    assert "2,000 unclosed FINAL(" in out and "parse/scan" in out
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


def run_suite(tmp_path: Path, *sections: str, timeout: float) -> dict:
    """`bench/run.py --quick` for some sections, writing to tmp_path; its figures as JSON."""
    only = [arg for name in sections for arg in ("--only", name)]
    out = run_bench("run.py", "--quick", *only, "--output", str(tmp_path), timeout=timeout)
    assert "Targets" in out, out
    results = json.loads((tmp_path / "latest.json").read_text())
    assert list(results["sections"]) == list(sections)
    for section in results["sections"].values():
        assert section["error"] is None, section["error"]
        assert section["figures"], section
        for figure in section["figures"]:
            assert figure["runs"] >= 1 and figure["median"] is not None, figure
    return results


def test_the_suite_runs_its_cheap_sections_and_reports_them(tmp_path: Path) -> None:
    results = run_suite(tmp_path, "history", "rebuild", timeout=300)
    figures = {f["key"]: f for s in results["sections"].values() for f in s["figures"]}
    assert figures["slope_6"]["ratio"] is not None and figures["slope_6"]["status"] in ("PASS", "MISS")
    assert figures["rebuild_10"]["target"]["text"] == "<= 50 ms"
    assert results["meta"]["machine"]["cores"] and results["meta"]["git"]["commit"]
    assert "history.png" in results["plots"] and (tmp_path / "history.png").stat().st_size > 0
    report = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "report.py"),
            "--input",
            str(tmp_path / "latest.json"),
            "--output",
            str(tmp_path / "BENCHMARKS.md"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert report.returncode == 0, report.stderr
    page = (tmp_path / "BENCHMARKS.md").read_text()
    assert "## Targets" in page and "slope, bytes per iteration" in page and "history.png" in page


@pytest.mark.slow
def test_every_section_of_the_suite_runs_quick(tmp_path: Path) -> None:
    results = run_suite(
        tmp_path,
        "overhead",
        "rlms",
        "concurrency",
        "processes",
        "history",
        "rebuild",
        "recovery",
        timeout=1800,
    )
    assert {"overhead.png", "concurrency.png"} <= set(results["plots"])


@pytest.mark.slow
def test_the_cpu_benchmark_sets_ours_beside_rlms_on_the_same_episode() -> None:
    out = run_bench("cpu_per_episode.py", "--quick", timeout=600)
    assert "rlms 0.1.3: CPU per episode" in out and "ours / rlms" in out and "<= 110 ms" in out, out
    # Each side's server saw the episode's 11 calls (the bench fails first if not).
    assert re.search(r"rlms: model calls per episode[^\n]*\s11\s", out), out


@pytest.mark.slow  # long end to end (the default run stays near 13 minutes); CI runs it
def test_the_risk_benchmark_prints_its_ratio_to_parsing() -> None:
    out = run_bench("risk.py", timeout=300)
    assert re.search(r"typical cell\s+99,900\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+", out), out
    assert "over the cap (1,000,000 chars)" in out


@pytest.mark.slow
def test_the_containment_benchmark_judges_the_worker_after_hostile_episodes() -> None:
    out = run_bench("containment.py", "--quick", timeout=600)
    assert "hostile episodes the worker served to their end" in out, out
    assert re.search(r"worker RSS growth over the whole run\s.*(PASS|MISS)", out), out


@pytest.mark.slow
def test_the_time_travel_benchmark_prints_its_ratios() -> None:
    out = run_bench("time_travel.py", "--iterations", "4", timeout=600)
    assert re.search(r"\s+4\s+\d+ \(\s*6\)\s+\d+\s+\d+\s+\d+ \(1\)\s+\d+\s+[0-9.]+x\s+[0-9.]+x", out), out


@pytest.mark.slow
def test_the_partitions_benchmark_gives_each_worker_a_queue_and_measures_the_server() -> None:
    """Past one machine (docs/guides/production.md), in small: 1, 2 and 3 worker processes
    on task queues of their own, their throughput against one's, and the server's CPU per
    episode."""
    out = run_bench("partitions.py", "--quick", timeout=600)
    assert len(re.findall(r"[0-9.]+x of one worker's", out)) == 2, out
    assert len(re.findall(r"Temporal server CPU per episode\s+│\s+[0-9.]+ ms", out)) == 3, out
    assert "no-op workflows with the same events" in out


@pytest.mark.slow
def test_the_concurrency_benchmark_files_its_worker_output_and_counts_late_tasks() -> None:
    """A small N (5 episodes at 0.5 s): the worker's output is filed and measured, and the
    tasks past their timeout are counted apart from waits."""
    out = run_bench("concurrency.py", "--quick", timeout=600)
    assert re.search(r"N=5: tasks past their timeout .*?\s0\s", out), out
    assert "N=5: worker output per minute" in out and "N=5: episodes per minute" in out


@pytest.mark.slow
def test_the_contexts_benchmark_runs_every_case_quick() -> None:
    out = run_bench("contexts.py", "--quick", timeout=1200)
    for label in (
        "rlms 10MB: wall",
        "durable 10MB: wall",
        "on postgresql",
        "on s3",
        "RSS above",
        "host copies",
    ):
        assert label in out, out[-3000:]
