"""A manual check: rlms 0.1.3's own examples, run by rlms and by durable-rlm with only their
`from rlm...` imports changed, against one scripted OpenAI-compatible server.

    python scripts/rlms_examples.py [PATH_TO_RLMS_REPOSITORY] [--tag v0.1.3]

The examples live in rlms's repository (not in its wheel), so this reads them from a
checkout (a bare clone will do: `git show TAG:examples/NAME.py`); CI has none, and runs the
scripts of tests/rlms_compat instead. Each example is pointed at the scripted server by one
more edit on both sides (`base_url` beside the example's `api_key`, as a user points it at a
gateway), and `verbose=True` is turned off on both (each library prints its own trace); the
model's replies follow each example's instructions. What depends on the prompts' own words
(token counts, a dump of the raw trajectory) is left out of the comparison, and so are the
printed lines that carry a clock, a random number or a temporary path, which differ between
any two runs, rlms's too (RANDOM below); the rest is compared word for word.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from durable_rlm.scripted import ChatRequest, Reply, ScriptedModelServer  # noqa: E402

EXAMPLES = [
    "quickstart",
    "custom_tools_example",
    "compaction_example",
    "compaction_history_retrieval_example",
    "depth_metadata_example",
    "logger_example",
    "rlm_query_batched_example",
    "lm_in_repl",
]
# Lines that differ between two runs of the same library: times, random draws, paths, ids.
RANDOM = re.compile(
    r"time[=:]|[Ee]xecution time|Model found|Actual number|Trajectory: \{|Full response|PORTKEY_API_KEY|"
    r"LM Handler started|locals:"
)


def look(request: ChatRequest) -> str:
    """Everything the model has seen, the printed context included."""
    return "\n".join(str(m.get("content", "")) for m in request.messages)


def answer(value: str) -> str:
    return f"```repl\nanswer['content'] = {value}\nanswer['ready'] = True\n```"


STEPS_A = [
    "import random\nrandom.seed(42)\ndata_a = [random.randint(1, 1000) for _ in range(50)]\nprint(data_a)",
    "data_b = [random.randint(1, 1000) for _ in range(50)]\nprint(data_b)",
    "import statistics as st\nmean_a = st.mean(data_a)\n"
    "print(mean_a, st.median(data_a), min(data_a), max(data_a), st.pstdev(data_a))",
    "mean_b = st.mean(data_b)\nprint(mean_b, st.median(data_b), min(data_b), max(data_b), st.pstdev(data_b))",
]
GROUPS = "(group_1, group_2, group_3, group_4)"
STEPS_B = [
    "import random, statistics as st\nrandom.seed(99)\n"
    "group_1 = [random.uniform(0, 100) for _ in range(40)]\nprint(group_1)",
    "group_2 = [random.uniform(0, 100) for _ in range(40)]\nprint(group_2)",
    "group_3 = [random.uniform(0, 100) for _ in range(40)]\nprint(group_3)",
    "group_4 = [random.uniform(0, 100) for _ in range(40)]\nprint(group_4)",
    f"m1, m2, m3, m4 = (st.mean(g) for g in {GROUPS})\nprint(m1, m2, m3, m4)",
    f"s1, s2, s3, s4 = (st.stdev(g) for g in {GROUPS})\nprint(s1, s2, s3, s4)",
]


def steps(request: ChatRequest, done: list[str], final: str) -> str:
    """The compaction examples: one step per root call of this run (counted per library, by
    the system prompt), then the final step."""
    key = hash(request.messages[0]["content"])
    step = COUNTS.get(key, 0)
    COUNTS[key] = step + 1
    return f"```repl\n{done[step]}\n```" if step < len(done) else answer(final)


COUNTS: dict[int, int] = {}
PRIMES = "2, 3, 5, 7, 11"
CHILD = {"prime": PRIMES, "even": "2, 4, 6, 8, 10", "square": "1, 4, 9, 16, 25"}


def model(request: ChatRequest) -> str | Reply:
    if not request.is_root:  # llm_query, or a summary request
        if "2 + 2" in request.last_user:
            return "4"
        return "SUMMARY: the steps so far are done; their values are in the REPL and in `history`."
    if request.is_compaction or request.last_user.startswith("Summarize your progress so far"):
        return "SUMMARY: the steps so far are done; their values are in the REPL and in `history`."
    seen = look(request)
    if "Step 7" in seen:
        return steps(request, STEPS_B, "round((m1 + m2 + m3 + m4) / (s1 + s2 + s3 + s4), 4)")
    if "Step 5" in seen:
        return steps(request, STEPS_A, "round(mean_a + mean_b, 2)")
    if request.turn == 0:
        return "```repl\nprint(context[:3000])\n```"
    if "SECRET_NUMBER=<digits>" in seen:
        if request.turn == 1:
            found = "found = re.search(r'SECRET_NUMBER=(\\d+)', context).group(1)"
            return f"```repl\nimport re\n{found}\nprint(found)\n```"
        return answer("found")
    if "AAPL and GOOGL" in seen:
        if request.turn == 1:
            return (
                "```repl\nprint(fetch_stock_price('AAPL'), fetch_stock_price('GOOGL'))\n"
                "print(MARKET_CONFIG['exchange'])\n"
                "total = format_currency(calculate_portfolio_value({'AAPL': 100, 'GOOGL': 100}))\n"
                "print(total)\n```"
            )
        return answer("total")
    if "rlm_query_batched()" in seen:
        if request.turn == 1:
            asked = [f"What are the first 5 {kind} numbers? Reply with just the numbers." for kind in CHILD]
            return f"```repl\nresponses = rlm_query_batched({asked!r})\nprint(responses)\n```"
        return answer("responses")
    if "Use rlm_query()" in seen:
        if request.turn == 1:
            asked = "What are the first 5 prime numbers? Reply with just the numbers separated by commas."
            return f"```repl\nprimes = rlm_query({asked!r})\nprint(primes)\n```"
        return answer("primes")
    if "sum 1 + 2 + 3 + 4 + 5" in seen:
        return (
            "```repl\ntotal = 1 + 2 + 3 + 4 + 5\nprint(total)\n```" if request.turn == 1 else answer("total")
        )
    for word, reply in CHILD.items():  # a child of the depth examples: its context is its question
        if f"first 5 {word}" in seen:
            return answer(repr(reply))
    return answer("'unscripted'")


def pointed(source: str) -> str:
    """The example pointed at the scripted server: `base_url` beside its api_key; and quiet."""
    source = source.replace(
        '"api_key": os.getenv("PORTKEY_API_KEY"),',
        '"api_key": os.getenv("PORTKEY_API_KEY"), "base_url": os.environ["OPENAI_BASE_URL"],',
    )
    source = source.replace(
        '"api_key": api_key,', '"api_key": api_key, "base_url": os.environ["OPENAI_BASE_URL"],'
    )
    # verbose=True prints each library's own trace (rlms's rich panels): compared off on both sides.
    source = source.replace("verbose=True", "verbose=False")
    return source.replace(
        'model_name="@openai/gpt-5-nano")',
        'model_name="@openai/gpt-5-nano", base_url=os.environ["OPENAI_BASE_URL"])',
    )


def ported(source: str) -> str:
    return re.sub(r"^(\s*)from rlm(?=[.\s])", r"\1from durable_rlm", source, flags=re.MULTILINE)


def run(
    source: str, server: ScriptedModelServer, cwd: Path, data_dir: Path | None
) -> tuple[int, list[str], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "TEMPORAL_", "DRLM_"))}
    env |= {
        "OPENAI_BASE_URL": server.base_url,
        "OPENAI_API_KEY": "sk-scripted",
        "PORTKEY_API_KEY": "sk-scripted",
        "PYTHONUNBUFFERED": "1",
    }
    if data_dir is not None:
        env |= {"DRLM_DATA_DIR": str(data_dir), "DRLM_SERVER_IDLE_S": "15"}
    cwd.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [sys.executable, "-c", source], capture_output=True, text=True, env=env, cwd=cwd, timeout=600
    )
    return done.returncode, done.stdout.splitlines(), done.stderr


VERBOSE = re.compile(r"[╭╮╰╯│─━┃┏┓┗┛◆▶]|^\[durable-rlm\]")


# Lines that show the prompts, which are each library's own (our built-in prompt is ours):
# their token counts, and the raw trajectory the depth example dumps (cut at 3,000 characters).
PROMPT_BOUND = re.compile(r"tokens: in=")
RAW_DUMP = ("RAW METADATA (JSON)", "SUB-CALL")


def own_lines(printed: list[str]) -> list[str]:
    """What the example itself prints: `verbose=True`'s trace (rlms's panels, our lines) and
    blank lines left out, as they are each library's own."""
    kept, dumping = [], False
    for line in printed:
        if RAW_DUMP[0] in line:
            dumping = True
        elif RAW_DUMP[1] in line:
            dumping = False
        if line.strip() and not dumping and not VERBOSE.search(line) and not PROMPT_BOUND.search(line):
            kept.append(line)
    return kept


def compared(theirs: list[str], ours: list[str]) -> tuple[int, int, list[str]]:
    """(lines that must match, lines that do, the first differences)."""
    theirs, ours = own_lines(theirs), own_lines(ours)
    fixed = [(a, b) for a, b in zip(theirs, ours, strict=False) if not (RANDOM.search(a) or RANDOM.search(b))]
    same = sum(a == b for a, b in fixed)
    diffs = [f"    rlms: {a[:150]}\n    ours: {b[:150]}" for a, b in fixed if a != b][:3]
    if len(theirs) != len(ours):
        diffs.append(f"    lines printed: rlms {len(theirs)}, ours {len(ours)}")
    return len(fixed), same, diffs


def show(repository: Path, tag: str, name: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repository), "show", f"{tag}:examples/{name}.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("repository", nargs="?", default="/work/.mirror/alexzhang13+rlm/repo")
    parser.add_argument("--tag", default="v0.1.3")
    parser.add_argument("--only", nargs="*", default=EXAMPLES)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="drlm-rlms-examples-"))
    data_dir = work / "data"
    results: list[tuple[str, str]] = []
    for name in args.only:
        source = pointed(show(Path(args.repository), args.tag, name))
        COUNTS.clear()
        with ScriptedModelServer(model) as server:
            code_r, theirs, err_r = run(source, server, work / name / "rlms", None)
            calls_r = len(server.requests)
            code_o, ours, err_o = run(ported(source), server, work / name / "durable", data_dir)
            calls_o = len(server.requests) - calls_r
        fixed, same, diffs = compared(theirs, ours)
        ok = code_r == 0 and code_o == 0 and same == fixed and len(own_lines(theirs)) == len(own_lines(ours))
        said = f"{same}/{fixed} fixed lines equal, {len(theirs)} printed; model calls {calls_r} / {calls_o}"
        results.append((name, f"{'same' if ok else 'DIFFERS'}: {said}"))
        print(f"{name}: {results[-1][1]}")
        for line in diffs:
            print(line)
        for code, err, who in ((code_r, err_r, "rlms"), (code_o, err_o, "ours")):
            if code != 0:
                print(f"    {who} exited {code}: {err[-1500:]}")
    print("\nsummary")
    for name, line in results:
        print(f"  {name:<40} {line}")
    sys.stdout.flush()
    os._exit(0)  # sdk-python#300: no interpreter teardown after temporalio ran


if __name__ == "__main__":
    main()
