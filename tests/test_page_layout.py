"""The episode page as a person reads it: how it ended and the answer at the top, each
cell's code once, a reply's lines kept as lines, every plotted line named in a legend."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from durable_rlm.audit.timeline import CellView, IterationView, Timeline
from durable_rlm.viewer.episode_plots import usage_svg
from durable_rlm.viewer.page_html import Renderer, TimelineView
from durable_rlm.workflows.models import EpisodeResult, TokenUsage

T0 = datetime(2026, 11, 27, 12, 0, tzinfo=UTC)
CODE = "total = sum(range(10_001))\nprint('the total is', total)"


def three_iterations() -> Timeline:
    iterations = []
    for n in (1, 2, 3):
        cell = CellView(
            cell_index=n, code=f"{CODE}  # step {n}", stdout=f"the total is 50005000 ({n})\n",
            started_at=T0 + timedelta(seconds=n), ended_at=T0 + timedelta(seconds=n, milliseconds=500),
        )  # fmt: skip
        reply = f"Step {n}: I sum it.\n```repl\n{cell.code}\n```" if n < 3 else "I have it.\nFINAL_VAR(total)"
        iterations.append(
            IterationView(
                iteration=n, response=reply, cells=[cell] if n < 3 else [],
                usage=TokenUsage(prompt_tokens=100 * n, completion_tokens=20, cost_usd=0.001 * n),
                started_at=T0 + timedelta(seconds=n - 1), ended_at=T0 + timedelta(seconds=n),
            )
        )  # fmt: skip
    result = EpisodeResult(
        episode_id="laid-out", answer="50005000", answer_source="model", confidence=1.0,
        stop_reason="the model answered (final_var)", ended_by="final_var", iterations=3, model_calls=3,
        sub_calls=0, usage=TokenUsage(prompt_tokens=600, completion_tokens=60, cost_usd=0.006),
    )  # fmt: skip
    return Timeline(
        episode_id="laid-out", status="answered", task="sum to 10000", runs=1, iterations=iterations,
        result=result, started_at=T0, ended_at=T0 + timedelta(seconds=3),
    )  # fmt: skip


def visible(page: str) -> str:
    """The page without the collapsed "reply as sent" copies."""
    return re.sub(r'<details class="raw".*?</details>', "", page, flags=re.S)


def test_the_answer_and_how_it_ended_come_first() -> None:
    page = TimelineView(Renderer(), "/s").body(three_iterations())
    ending = page.index('<section class="ending">')
    assert ending < page.index('id="iteration-1"') and ending < page.index('class="budgets"')
    assert page.index("50005000</pre>") < page.index('id="iteration-1"')
    assert "Ended: answered (final_var) after 3 iteration(s)" in page


def test_each_cell_s_code_is_shown_once() -> None:
    page = visible(TimelineView(Renderer(), "/s").body(three_iterations()))
    for n in (1, 2):
        assert page.count(f"# step {n}") == 1, n  # in its cell, not in the reply above it too
    assert page.count("(this code is shown once, in its cell below)") == 2


def test_a_final_line_stays_a_line_of_its_own() -> None:
    html = Renderer().markdown("I have it.\nFINAL_VAR(total)")
    assert re.search(r"I have it\.<br\s*/?>\s*FINAL_VAR\(total\)", html), html


def test_every_line_of_the_usage_plot_is_in_its_legend() -> None:
    svg = usage_svg(three_iterations())
    legend = re.findall(r'<text x="\d+" y="\d+" font-size="11">([^<]+)</text>', svg)
    for name in ("prompt tokens", "reply tokens", "sub-call tokens"):
        assert name in legend, legend
    assert any(text.startswith("cost, USD (its own scale: top $0.0030)") for text in legend), legend
    assert "cost max" not in svg
