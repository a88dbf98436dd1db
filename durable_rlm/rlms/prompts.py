"""A custom system prompt as rlms 0.1.3 composes it (rlm/utils/prompts.py,
`build_rlm_system_prompt`): the user's text, a `str.format` template whose
`{custom_tools_section}` lists the custom tools and data, then rlms's orchestrator
addendum. The addendum's words are rlms's (MIT licence, Copyright (c) 2025 Alex Zhang): a
program that wrote its prompt for rlms gets the same system message here.
"""

from __future__ import annotations

from typing import Any

from durable_rlm.rlms.environments import format_tools_for_prompt

ORCHESTRATOR_ADDENDUM = "\n\n".join(
    [
        "As an RLM, you should act as an orchestrator, not a solver.",
        "Directly after you probe the `context` and understand your task, pause and plan: "
        "state explicitly how the task decomposes into sub-LLM / REPL steps, and sketch "
        "the concrete sequence of turns — what each turn computes and which sub-LLM call "
        "(if any) it issues — like a condensed trajectory, before you execute them. "
        "Then execute one turn at a time: after each step `print` a small sample of the "
        'result, verify it looks right, and only flip `answer["ready"] = True` once you '
        "have actually printed the candidate answer. If you are running out of turns "
        "without a confirmed answer, submit your best inference rather than letting the "
        "rollout terminate unsubmitted.",
        "Your own context window is small. Push every long-context operation that would "
        "not fit comfortably in your own working window — reading, summarizing, "
        "classifying, verifying, answering sub-questions, even recapping your own "
        "progress — into `llm_query` / `llm_query_batched` calls instead of pulling that "
        "text into your own message stream. (Conversely: if a Python keyword / regex "
        "search over `context` would already pin the answer, or if a single visible "
        "passage already contains it, just read it directly — sub-LMs are for when the "
        "raw text won't fit or the question needs semantic interpretation.) Long REPL "
        "stdout pollutes history the same way raw `context` does: if you want a recap, "
        "ask `llm_query` for a 1–2 sentence summary and `print` only that. Aggregate "
        "the small results back in the REPL.",
        "Sub-LLMs have no REPL; they only see the prompt and the `context` slice you pass "
        "them. Hand them clean, focused inputs and ask for terse, structured outputs you "
        "can manipulate programmatically.",
        "Sub-call budget is finite on two independent axes, and `llm_query_batched` only "
        "parallelizes — it does not relax either. (1) Per-prompt capacity: a single "
        "sub-call answers well only when its input stays modestly sized — a useful rough "
        "ceiling is ~100K characters per prompt, less when the text is dense. Pack each "
        "prompt close to that capacity (a chunk of many items, a whole document) so one "
        "call accomplishes a lot of work. (2) Per-batch fan-out: `llm_query_batched` "
        "concurrency is bounded too — a useful rough ceiling is ~20 prompts per batch. "
        "Tiny-prompt mega-batches (hundreds or thousands of single-item prompts) are the "
        "anti-pattern; fat-prompt small batches are correct. For many independent units, "
        "use several ~20-wide batches of full-capacity prompts in sequence, not one "
        "mega-batch of tiny prompts. When the work can be expressed either as a "
        "sequential loop of `llm_query`s or as one comparably-sized batched call, "
        "prefer batched — same total work, far fewer turns burned. After Python-side "
        "filtering has narrowed the candidate set, batch-extract the survivors rather "
        "than reading them by hand. If the raw workload exceeds both budgets at once "
        "(e.g. a context far larger than ~20 × 100K chars), don't brute-force it: "
        "filter aggressively in Python first to a tractable subset, or stage the task — "
        "a cheap coarse pass narrows candidates, then a targeted second pass extracts "
        "from the survivors.",
        "Reserve your own tokens for high-level decisions: what to ask next, how to combine "
        "sub-LM outputs, when to finalize. Delegate everything else.",
    ]
)


def tools_section(custom_tools: dict[str, Any] | None) -> str:
    """rlms's `{custom_tools_section}`: each tool or data value on a line, with its
    description (or what it is)."""
    lines = format_tools_for_prompt(custom_tools)
    return f"\n6. Custom tools and data available in the REPL:\n{lines}" if lines else ""


def composed_system_prompt(
    template: str, custom_tools: dict[str, Any] | None, orchestrator: bool = True
) -> str:
    """The system message rlms sends for `custom_system_prompt=template`. Like rlms, a
    template with other braces than `{custom_tools_section}` is an error: it is refused
    when the RLM is made, not when the first completion runs."""
    text = template.format(custom_tools_section=tools_section(custom_tools))
    return f"{text}\n\n{ORCHESTRATOR_ADDENDUM}" if orchestrator else text
