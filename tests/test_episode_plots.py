"""The episode page's plots (docs/guides/viewer.md): the steps on one time axis, and tokens
and cost per iteration, drawn as inline SVG from a timeline."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from durable_rlm.audit.timeline import CellView, ChildView, IterationView, SubCall, Timeline
from durable_rlm.viewer.episode_plots import LEFT, WIDTH, plots_section, step_bars, steps_svg, usage_svg
from durable_rlm.workflows.models import TokenUsage

T0 = datetime(2026, 11, 25, 12, 0, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def episode() -> Timeline:
    """Two iterations over 10 s: root call 0-2 s, cell 2-6 s with two sub-calls and a child
    (3-5 s); root call 6-8 s, cell 8-10 s. The second root call was priced."""
    child = Timeline(episode_id="e/1.0", status="completed", started_at=at(3), ended_at=at(5))
    first = IterationView(
        iteration=1,
        usage=TokenUsage(prompt_tokens=100, completion_tokens=20, cost_usd=None),
        started_at=at(0),
        ended_at=at(6),
        cells=[
            CellView(
                cell_index=1,
                code="x",
                started_at=at(2),
                ended_at=at(6),
                sub_calls=[
                    SubCall(
                        call_index=0,
                        prompt="a",
                        usage=TokenUsage(prompt_tokens=30, completion_tokens=10, cost_usd=None),
                    ),
                    SubCall(
                        call_index=1,
                        prompt="b",
                        usage=TokenUsage(prompt_tokens=30, completion_tokens=10, cost_usd=None),
                    ),
                ],
                children=[ChildView(episode_id="e/1.0", call_index=2, model="m", timeline=child)],
            )
        ],
    )
    second = IterationView(
        iteration=2,
        usage=TokenUsage(prompt_tokens=200, completion_tokens=40, cost_usd=0.5),
        started_at=at(6),
        ended_at=at(10),
        cells=[CellView(cell_index=2, code="y", started_at=at(8), ended_at=at(10))],
    )
    return Timeline(
        episode_id="e", status="completed", iterations=[first, second], started_at=at(0), ended_at=at(10)
    )


def rects(svg: str, cls: str) -> list[dict[str, str]]:
    return [
        dict(re.findall(r'([\w-]+)="([^"]*)"', m)) for m in re.findall(rf'<rect class="{cls}"([^>]*)>', svg)
    ]


def test_each_step_is_a_bar_in_its_lane_at_its_time() -> None:
    bars = [
        (b.lane, b.label, (b.start - T0).total_seconds(), (b.end - T0).total_seconds())
        for b in step_bars(episode())
    ]
    assert bars == [
        ("root model", "root call 1", 0, 2),
        ("cells", "cell 1", 2, 6),
        ("sub-calls", "cell 1: 2 sub-call(s)", 2, 6),
        ("children", "e/1.0", 3, 5),
        ("root model", "root call 2", 6, 8),
        ("cells", "cell 2", 8, 10),
    ]
    drawn = rects(steps_svg(episode()), "step")
    scale = (WIDTH - LEFT - 10) / 10
    cell_1 = next(r for r in drawn if r["data-lane"] == "cells")
    assert float(cell_1["x"]) == LEFT + 2 * scale and abs(float(cell_1["width"]) - 4 * scale) < 0.1


def test_tokens_stack_per_iteration_and_cost_is_drawn_where_known() -> None:
    svg = usage_svg(episode())
    bars = {(r["data-iteration"], r["data-kind"]): float(r["height"]) for r in rects(svg, "usage")}
    assert set(bars) == {(i, k) for i in ("1", "2") for k in ("prompt", "reply", "sub")}
    # The tallest stack (iteration 2: 240 tokens) fills the plot; the rest in proportion.
    assert bars[("2", "prompt")] + bars[("2", "reply")] == 140
    assert round(bars[("1", "sub")], 1) == round(140 * 80 / 240, 1) and bars[("2", "sub")] == 0
    assert re.findall(r'<circle class="cost" data-iteration="(\d+)"', svg) == [
        "2"
    ]  # iteration 1 has no price


def test_a_timeline_without_times_or_tokens_draws_nothing() -> None:
    bare = Timeline(episode_id="e", status="running", iterations=[IterationView(iteration=1)])
    assert plots_section(bare) == "" and plots_section(Timeline(episode_id="e", status="running")) == ""


def test_labels_are_escaped() -> None:
    t = episode()
    t.iterations[0].cells[0].children[0].episode_id = "<script>x</script>"
    assert "<script>" not in steps_svg(t) and "&lt;script&gt;" in steps_svg(t)


def test_a_forks_inherited_iterations_are_not_on_its_time_axis() -> None:
    t = episode()
    t.iterations[0].inherited_from = "source"
    assert {b.label for b in step_bars(t)} == {"root call 2", "cell 2"}
