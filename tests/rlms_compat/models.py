"""The scripted model's replies for the differential scripts: each decides from what rlms
and durable-rlm both send (the root prompt a script passes, the number of replies so far),
never from either library's own prompt text."""

from __future__ import annotations

import re

from durable_rlm.scripted import ChatRequest, Reply

STEP = re.compile(r"Session step (\d+)")

DOCUMENTS = ["First document about cats", "Second document about dogs", "Third document"]
TURN_ANSWERS = ["First cats", "Second dogs (saw turn 0)", "Third document (saw turn 1)"]

PREVIOUS_STEP = (
    "next(m['content'] for m in history_{k} if 'Session step' in m['content']).split('Session step ')[1][0]"
)


def step_of(request: ChatRequest) -> int | None:
    for message in request.messages:
        found = STEP.search(str(message.get("content", "")))
        if found:
            return int(found.group(1))
    return None


def persistent_turns(request: ChatRequest) -> str | Reply:
    """A turn of a persistent session, rlms's way: it looks at its own context_k first, then
    sets `answer["ready"]` in its second reply, quoting the step the last turn's history
    asked for. A turn that took an earlier turn's answer ends after one root call, with it."""
    step = step_of(request)
    assert request.is_root and step is not None, request.messages
    if request.turn == 0:
        return f"```repl\nwords = context_{step}.split()\nprint(len(words), words[0])\n```"
    said = "words[0] + ' ' + words[-1]"
    if step > 0:
        said += " + ' (saw turn ' + " + PREVIOUS_STEP.format(k=step - 1) + " + ')'"
    return f"```repl\nanswer['content'] = {said}\nanswer['ready'] = True\n```"


def marker(request: ChatRequest) -> str:
    """Which script's episode asks: the root prompt it was given, as both libraries send it."""
    text = "\n".join(str(m.get("content", "")) for m in request.messages[:3])
    for name in (
        "Limit errors",
        "Limit budget",
        "Limit tokens",
        "Limit none",
        "Many sub-calls",
        "Inline fence",
    ):
        if name in text:
            return name
    return ""


ANSWER = "```repl\nanswer['content'] = {value}\nanswer['ready'] = True\n```"

MANY_SUB_CALLS = """```repl
single = [llm_query(f"q{i}") for i in range(70)]
batch = llm_query_batched([f"b{i}" for i in range(70)])
failed = llm_query("fail please")
print(len(single), len(batch), failed[:6], context_0 == context)
```"""


def limits_and_calls(request: ChatRequest) -> str | Reply:
    """The replies of limits.py, subcalls.py and fences_and_loops.py."""
    if not request.is_root:
        prompt = request.last_user
        if prompt == "fail please":
            return Reply(status=400, error="the sub-model refused this prompt")
        return prompt.upper()
    name, turn = marker(request), request.turn
    if name == "Limit errors":
        return "```repl\n1 / 0\n```"
    if name == "Limit budget":
        return Reply(text="```repl\nprint('step')\n```", cost=0.02)
    if name == "Limit tokens":
        return "```repl\nprint('x' * 4000)\n```"
    if name == "Limit none":
        return "```repl\nprint('looked')\n```" if turn == 0 else ANSWER.format(value="'none hit'")
    if name == "Many sub-calls":
        if turn == 0:
            return MANY_SUB_CALLS
        return ANSWER.format(value="f'{single[69]} {batch[69]} {failed[:6]} {len(single) + len(batch)}'")
    if name == "Inline fence":
        if turn == 0:
            return "Let me look. Here: ```repl\nn = len(context.split())\nprint(n)\n``` and then we will see."
        return "Done: ```repl\nanswer['content'] = f'{n} words'\nanswer['ready'] = True\n```"
    raise AssertionError(f"no reply scripted for {request.messages[:3]}")


COMPACTION_STEPS = [
    "```repl\nimport random\nrandom.seed(42)\ndata_a = [random.randint(1, 1000) for _ in range(50)]\n"
    "print(data_a)\nprint('PAD' * 4000)\n```",
    "```repl\ndata_b = [random.randint(1, 1000) for _ in range(50)]\nprint(data_b)\nprint('PAD' * 4000)\n```",
    "```repl\nmean_a = sum(data_a) / len(data_a)\nprint('mean_a', mean_a)\nprint('PAD' * 4000)\n```",
    "```repl\nmean_b = sum(data_b) / len(data_b)\nprint('mean_b', mean_b)\nprint('PAD' * 4000)\n```",
    "```repl\nsummaries = [e for e in history if isinstance(e, dict) and e.get('type') == 'summary']\n"
    "segments = [e for e in history if isinstance(e, list)]\n"
    "seen = any('data_a = ' in m['content'] for segment in segments for m in segment)\n"
    "answer['content'] = f'{round(mean_a + mean_b, 2)} summarised={bool(summaries)} found_data_a={seen}'\n"
    "answer['ready'] = True\n```",
]
COMPACTED_SUMMARY = "SUMMARY: data_a and data_b were generated; the means come next."


class CompactingModel:
    """The root model of compaction.py: step k of COMPACTION_STEPS on its k-th root call
    (counted per library: each sends its own system prompt), a summary when asked for one,
    by rlms (its progress question) or by us (our compaction call)."""

    def __init__(self) -> None:
        self.calls: dict[int, int] = {}

    def __call__(self, request: ChatRequest) -> str | Reply:
        if request.is_compaction or request.last_user.startswith("Summarize your progress so far"):
            return COMPACTED_SUMMARY
        assert request.is_root, request.messages
        key = hash(request.messages[0]["content"])
        step = self.calls.get(key, 0)
        self.calls[key] = step + 1
        return COMPACTION_STEPS[min(step, len(COMPACTION_STEPS) - 1)]


DEPTH_ROOT = {
    "Depth one call": [
        "```repl\nprimes = rlm_query('What are the first 5 primes? Reply with just the numbers.')\n"
        "print(primes)\n```",
        "```repl\nanswer['content'] = primes\nanswer['ready'] = True\n```",
    ],
    "Depth batched calls": [
        "```repl\nresponses = rlm_query_batched(['primes please', 'evens please', 'squares please'])\n"
        "print(responses)\n```",
        "```repl\nanswer['content'] = ' | '.join(responses)\nanswer['ready'] = True\n```",
    ],
}
CHILD_ANSWERS = {"primes": "2, 3, 5, 7, 11", "evens": "2, 4, 6, 8, 10", "squares": "1, 4, 9, 16, 25"}


def depth_tree(request: ChatRequest) -> str | Reply:
    """depth_metadata.py's model. Its prompt is the context, which rlms and we both show only
    to code: every episode prints `context` first; the root then asks its children and
    answers, a child (whose context is its prompt) answers from a table."""
    assert request.is_root, request.messages
    if request.turn == 0:
        return "```repl\nprint(context)\n```"
    seen = "\n".join(str(m.get("content", "")) for m in request.messages)
    for name, turns in DEPTH_ROOT.items():
        if name in seen:
            return turns[min(request.turn - 1, len(turns) - 1)]
    key = next(k for k in CHILD_ANSWERS if k in seen)
    return f"```repl\nanswer['content'] = {CHILD_ANSWERS[key]!r}\nanswer['ready'] = True\n```"


TOOLS_TURNS = [
    "Let me look.\n```repl\nprint(SHOW_VARS())\naapl = fetch_stock_price('AAPL')['price']\n"
    "googl = fetch_stock_price('googl')['price']\n"
    "print(type(MARKET_CONFIG['opened']).__name__, type(SYMBOLS).__name__, sorted(holidays(2024))[0])\n```",
    "```repl\ntotal = format_currency(100 * (aapl + googl))\nanswer['content'] = f'{total} {SYMBOLS[0]}'\n"
    "answer['ready'] = True\n```",
]


def tools_and_logger(request: ChatRequest) -> str | Reply:
    """tools_and_logger.py's model; the system prompt must be rlms's composition."""
    assert request.is_root, request.messages
    system = request.messages[0]["content"]
    assert system.startswith("You are a trading desk assistant.\n6. Custom tools and data available"), system
    assert (
        "- `fetch_stock_price`: Price data for a symbol" in system
        and "- `SYMBOLS`: A custom tuple value" in system
    )
    return TOOLS_TURNS[min(request.turn, len(TOOLS_TURNS) - 1)]
