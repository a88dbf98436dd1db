"""Reply parsing time per MB, 10 KB to 10 MB, on ordinary and hostile replies.

    python bench/parsing.py [--max-mb 10]

What the workflow runs on every reply (`parse_reply`: fences, code blocks, FINAL /
FINAL_VAR; for the rlms-compatible RLM, code blocks found as rlms finds them) must stay
linear and far below Temporal's ~2 s deadlock detector on any text.
Each shape is parsed at 10 KB, 100 KB, 1 MB and 10 MB; the figure is milliseconds per MB,
which is flat when the parser is linear. The baseline in the same run is a plain scan of
the same text (`str.count` of its newlines): the parser's cost is shown as a multiple of it.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from durable_rlm.workflows.parsing import parse_reply  # noqa: E402

PROSE = "The quick brown fox (jumps) over it's lazy dog; see the Final (revised) report. "


def typical(size: int) -> str:
    """What models write: prose, a few repl cells, a FINAL line."""
    block = (
        PROSE * 20 + "\n```repl\nchunks = [context[i:i+1000] for i in range(0, len(context), 1000)]\n```\n"
    )
    return (block * (size // len(block) + 1))[: size - 20] + "\nFINAL(done)"


SHAPES: dict[str, Callable[[int], str]] = {
    "typical reply": typical,
    "unclosed FINAL( lines": lambda n: ("FINAL(" + "x" * 40 + "\n") * (n // 47),
    "2,000 unclosed FINAL(": lambda n: ("FINAL(" + "w" * (n // 2000 - 7) + "\n") * 2000,
    "dense ()()()": lambda n: "FINAL(" + "()" * (n // 2),
    "nested 49 deep, repeated": lambda n: "FINAL(" + ("(" * 49 + ")" * 49) * (n // 98),
    "one deep nest": lambda n: "FINAL(" + "(" * (n // 2) + ")" * (n // 2),
    "unclosed quotes": lambda n: ('FINAL("' + "a" * 20 + "\n") * (n // 28),
    "backslashes": lambda n: 'FINAL("' + "\\" * n,
    "fence lines ```": lambda n: "```\n" * (n // 4),
    "unclosed ```python": lambda n: "```python\nFINAL(x)\n" * (n // 19),
    "inline ```repl, unclosed": lambda n: "x ```repl\n y " * (n // 13),
    "```repl + blanks, no newline": lambda n: "```repl" + " " * n,
}

SIZES = [10_000, 100_000, 1_000_000, 10_000_000]


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-mb", type=float, default=10)
    args = parser.parse_args()
    sizes = [s for s in SIZES if s <= args.max_mb * 1_000_000]
    header = f"{'shape':<26}" + "".join(f"{s // 1000:>10,} KB" for s in sizes) + "   (ms per MB)"
    print(header)
    worst = 0.0
    for name, make in SHAPES.items():
        texts = [make(size) for size in sizes]
        ours = [timed(lambda t=t: parse_reply(t, ["repl"], 16)) for t in texts]
        worst = max(worst, max(ours))
        print(f"{name:<26}" + "".join(f"{o / len(t) * 1e9:>13.1f}" for o, t in zip(ours, texts, strict=True)))
        # The rlms-compatible RLM finds code blocks as rlms does (inline fences too).
        inline = [timed(lambda t=t: parse_reply(t, ["repl"], 16, inline=True)) for t in texts]
        worst = max(worst, max(inline))
        print(
            f"{'  inline (rlms)':<26}"
            + "".join(f"{o / len(t) * 1e9:>13.1f}" for o, t in zip(inline, texts, strict=True))
        )
        scan = timed(lambda t=texts[-1]: t.count("\n")) or 1e-9
        print(
            f"{'  a plain scan of it':<26}"
            + f"{'':>13}" * (len(texts) - 1)
            + f"  parse/scan: {ours[-1] / scan:,.0f}x"
        )
    print(f"\nslowest single call: {worst * 1000:.0f} ms (Temporal's deadlock detector: ~2,000 ms)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
