"""The demo episode: find the noisiest service in a log, the RLM way.

With no OPENAI_API_KEY the root and sub-model are a scripted server on 127.0.0.1 that
plays a plausible RLM: inspect the context, chunk it, count errors per chunk through
`llm_query_batched`, aggregate in the REPL, answer with FINAL_VAR. The sub-model really
counts the lines it is given, so the answer is computed, not canned.
"""

from __future__ import annotations

import random
import re
from collections import Counter

from durable_rlm.scripted import Reply, Script, root_and_sub

SERVICES = ("auth", "billing", "search", "ingest", "notify")
TASK = "Which service logged the most ERROR lines in this log, and how many?"
LIMITS = {
    "max_iterations": 10,
    "max_llm_calls": 50,
    "max_duration": 600.0,
    "cell_timeout_s": 60.0,
    "output_truncation": 20_000,
}
"""The demo's limits: a few times what its transcript needs."""


def demo_log(lines: int = 600, seed: int = 7) -> str:
    rng = random.Random(seed)
    weights = {"auth": 0.04, "billing": 0.09, "search": 0.05, "ingest": 0.14, "notify": 0.03}
    out = []
    for i in range(lines):
        service = rng.choice(SERVICES)
        level = "ERROR" if rng.random() < weights[service] else rng.choice(("INFO", "INFO", "WARN"))
        out.append(
            f"2026-11-22T10:{i // 60:02d}:{i % 60:02d}Z {level} {service}: event {rng.randint(1, 9999)}"
        )
    return "\n".join(out)


def expected_answer(log: str) -> tuple[str, int]:
    counts = Counter(m.group(1) for m in re.finditer(r" ERROR (\w+):", log))
    service, count = counts.most_common(1)[0]
    return service, count


ROOT_TURNS = [
    """I'll look at the shape of the context first.
```repl
print(type(context).__name__, len(context))
lines = context.splitlines()
print(len(lines), "lines")
print("\\n".join(lines[:5]))
```""",
    """The log is line-oriented. I'll split it into chunks and ask a sub-model to count ERROR \
lines per service in each chunk, then add the counts up.
```repl
chunks = ["\\n".join(lines[i:i + 100]) for i in range(0, len(lines), 100)]
prompts = [
    "Count the ERROR lines per service in this log excerpt. "
    "Reply only with service=count pairs separated by commas.\\n\\n" + chunk
    for chunk in chunks
]
replies = llm_query_batched(prompts)
totals = {}
for reply in replies:
    for pair in reply.split(","):
        if "=" in pair:
            name, count = pair.strip().split("=")
            totals[name] = totals.get(name, 0) + int(count)
ranking = sorted(totals.items(), key=lambda kv: -kv[1])
print(ranking)
best, best_count = ranking[0]
result = f"{best} logged the most ERROR lines: {best_count}"
```""",
    """The counts are aggregated over all chunks.
FINAL_VAR(result)""",
]


def count_errors(prompt: str) -> Reply:
    counts = Counter(m.group(1) for m in re.finditer(r" ERROR (\w+):", prompt))
    return Reply(text=", ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "none=0")


def demo_script() -> Script:
    return root_and_sub(ROOT_TURNS, count_errors)
