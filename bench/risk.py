"""Risk assessment time (`--approve risky`) against `ast.parse` alone, 1 KB to the 100 KB cap.

    python bench/risk.py

`workflows/risk.assess` runs in a workflow task on each cell before it runs, so it must
stay linear and far below Temporal's ~2 s deadlock detector. The baseline in the same run
is `ast.parse` of the same text: the ratio is what the walk adds to parsing, and the
milliseconds per KB are flat when the assessment is linear.
"""

from __future__ import annotations

import ast
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from durable_rlm.workflows.risk import MAX_ASSESSED_CHARS, assess  # noqa: E402

TYPICAL = (
    "chunks = [context[i:i+1000] for i in range(0, len(context), 1000)]\n"
    "answers = llm_query_batched([f'Summarise: {c}' for c in chunks])\n"
    "for i, a in enumerate(answers):\n    print(i, a[:80])\n"
)
RISKY = "import os, subprocess\nos.remove('x')\nsubprocess.run(['ls'])\nopen('f', 'w').write('y')\n"
NESTED = (
    "for a in range(10):\n    for b in range(10):\n        for c in range(10):\n            x = a * b * c\n"
)


def _balanced(leaves: int) -> str:
    """A constant sum of `leaves` ones, as a balanced tree: parses at any size."""
    return "1" if leaves == 1 else f"({_balanced(leaves // 2)}+{_balanced(leaves - leaves // 2)})"


SHAPES: dict[str, Callable[[int], str]] = {
    "typical cell": lambda n: (TYPICAL * (n // len(TYPICAL) + 1))[: n - n % len(TYPICAL) or len(TYPICAL)],
    "every line risky": lambda n: RISKY * max(n // len(RISKY), 1),
    "nested range loops": lambda n: NESTED * max(n // len(NESTED), 1),
    "one long expression": lambda n: "x = " + " + ".join(["1"] * max(n // 4, 1)),
    "loops under a big range": lambda n: (
        f"for i in range({_balanced(max(n // 20, 1))}):\n"
        + "    for j in range(2):\n        pass\n" * max(n // 60, 1)
    ),
}


def timed(function: Callable[[str], object], text: str, repeat: int = 5) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        function(text)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    sizes = [1_000, 10_000, MAX_ASSESSED_CHARS]
    print(f"{'shape':<22}{'size':>9}{'assess ms':>11}{'parse ms':>10}{'ratio':>7}{'ms/KB':>8}")
    for name, make in SHAPES.items():
        for size in sizes:
            text = make(size)[:MAX_ASSESSED_CHARS]
            try:
                parse_s = timed(ast.parse, text)
            except (RecursionError, SyntaxError, MemoryError):
                parse_s = float("nan")
            assess_s = timed(assess, text)
            ratio = assess_s / parse_s if parse_s == parse_s else float("nan")
            per_kb = assess_s * 1000 / (len(text) / 1000)
            figures = f"{assess_s * 1000:>11.1f}{parse_s * 1000:>10.1f}{ratio:>7.2f}{per_kb:>8.2f}"
            print(f"{name:<22}{len(text):>9,}{figures}")
    over = "x" * (MAX_ASSESSED_CHARS * 10)
    over_ms = timed(assess, over) * 1000
    print(f"over the cap ({len(over):,} chars): {over_ms:.3f} ms, unread: {assess(over)[0]}")


if __name__ == "__main__":
    main()
