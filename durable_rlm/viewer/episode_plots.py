"""The episode page's plots, as inline SVG drawn here: no script library, nothing fetched, so
the page stays offline and a stored timeline draws the same as a live one.

- **Steps on one time axis**: a lane each for the root model's calls, the cells, the cells'
  model sub-calls and the child episodes, from the episode's start to its end (or now).
  A root call runs from its iteration's start to its first cell (or the iteration's end);
  sub-calls have no times of their own in history, so a cell that made some is marked in
  the sub-call lane over its whole span, with their count.
- **Tokens and cost per iteration**: the root call's prompt and reply tokens and the cells'
  sub-call tokens, stacked; the cost, where a price is known, as a line of its own scale.

Linear in the timeline's size; every label is escaped.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from html import escape

from durable_rlm.audit.timeline import IterationView, Timeline

WIDTH = 900
LANE_H = 22
LEFT = 90  # room for the lane names
LANES = ("root model", "cells", "sub-calls", "children")
COLOURS = {
    "root model": "#6b8fc7",
    "cells": "#7fb77e",
    "sub-calls": "#d9a441",
    "children": "#a07cc5",
    "prompt": "#9db4d9",
    "reply": "#4c6fa8",
    "sub": "#d9a441",
    "cost": "#b0413e",
}


def _utc(moment: datetime) -> datetime:
    """History's event times come naive (UTC), a run's start time aware: one kind, to compare."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


@dataclass(frozen=True)
class Bar:
    lane: str
    start: datetime
    end: datetime
    label: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "start", _utc(self.start))
        object.__setattr__(self, "end", _utc(self.end))


def step_bars(t: Timeline) -> list[Bar]:
    """Every step with its times, lane by lane."""
    bars: list[Bar] = []
    for it in t.iterations:
        if it.inherited_from or it.started_at is None:
            continue  # a fork's inherited iterations ran in another episode, at other times
        first_cell = next((c.started_at for c in it.cells if c.started_at is not None), None)
        until = first_cell or it.ended_at
        if until is not None and _utc(until) >= _utc(it.started_at):
            bars.append(Bar("root model", it.started_at, until, f"root call {it.iteration}"))
        for cell in it.cells:
            if cell.started_at is None or cell.ended_at is None:
                continue
            bars.append(Bar("cells", cell.started_at, cell.ended_at, f"cell {cell.cell_index}"))
            if cell.sub_calls:
                label = f"cell {cell.cell_index}: {len(cell.sub_calls)} sub-call(s)"
                bars.append(Bar("sub-calls", cell.started_at, cell.ended_at, label))
            for child in cell.children:
                child_t = child.timeline
                if child_t is not None and child_t.started_at is not None:
                    end = child_t.ended_at or cell.ended_at
                    bars.append(Bar("children", child_t.started_at, end, child.episode_id))
    return bars


def steps_svg(t: Timeline, now: datetime | None = None) -> str:
    """The steps on one time axis, or "" when no step has times yet."""
    bars = step_bars(t)
    if not bars:
        return ""
    start = min([b.start for b in bars] + ([_utc(t.started_at)] if t.started_at else []))
    end = max([b.end for b in bars] + [_utc(t.ended_at or now or datetime.now(UTC))])
    span = max((end - start).total_seconds(), 1e-3)
    scale = (WIDTH - LEFT - 10) / span
    height = LANE_H * len(LANES) + 24
    parts = [
        f'<svg class="plot plot-steps" viewBox="0 0 {WIDTH} {height}" width="100%" role="img" '
        f'aria-label="steps on one time axis, {span:.1f} s in all">'
    ]
    for row, lane in enumerate(LANES):
        y = row * LANE_H
        parts.append(f'<text x="0" y="{y + 15}" font-size="12">{lane}</text>')
        rule = y + LANE_H - 2
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - 10}" y1="{rule}" y2="{rule}" stroke="#eee"/>')
    for bar in bars:
        row = LANES.index(bar.lane)
        x = LEFT + (bar.start - start).total_seconds() * scale
        w = max((bar.end - bar.start).total_seconds() * scale, 1.5)
        seconds = (bar.end - bar.start).total_seconds()
        parts.append(
            f'<rect class="step" data-lane="{bar.lane}" x="{x:.1f}" y="{row * LANE_H + 3}" width="{w:.1f}" '
            f'height="{LANE_H - 8}" fill="{COLOURS[bar.lane]}"><title>{escape(bar.label)}: '
            f"{seconds:.2f} s</title></rect>"
        )
    axis_y = LANE_H * len(LANES) + 14
    for i in range(5):
        at = span * i / 4
        x = LEFT + at * scale
        anchor = ("start", "middle", "middle", "middle", "end")[i]  # the ends stay inside the plot
        label = f'<text x="{x:.1f}" y="{axis_y}" font-size="11" text-anchor="{anchor}">{at:.1f} s</text>'
        parts.append(label)
    parts.append("</svg>")
    return "".join(parts)


def _tokens(it: IterationView) -> tuple[int, int, int, float | None]:
    """(prompt, reply, sub-call tokens, cost or None when no price is known) of an iteration."""
    prompt = it.usage.prompt_tokens if it.usage else 0
    reply = it.usage.completion_tokens if it.usage else 0
    costs = [it.usage.cost_usd] if it.usage and it.usage.cost_usd is not None else []
    sub = 0
    for cell in it.cells:
        for call in cell.sub_calls:
            if call.usage is not None:
                sub += call.usage.total_tokens
                if call.usage.cost_usd is not None:
                    costs.append(call.usage.cost_usd)
    return prompt, reply, sub, (sum(costs) if costs else None)


def usage_svg(t: Timeline) -> str:
    """Tokens (stacked: prompt, reply, sub-calls) and cost per iteration, or "" if none."""
    rows = [(it.iteration, *_tokens(it)) for it in t.iterations]
    if not rows or not any(p + r + s for _, p, r, s, _c in rows):
        return ""
    top = max(p + r + s for _, p, r, s, _c in rows) or 1
    top_cost = max((c for *_, c in rows if c is not None), default=None)
    plot_h, base = 140, 150
    slot = (WIDTH - LEFT - 10) / len(rows)
    width = max(min(slot * 0.7, 60), 2)
    parts = [
        f'<svg class="plot plot-usage" viewBox="0 0 {WIDTH} {base + 40}" width="100%" role="img" '
        f'aria-label="tokens and cost per iteration">',
        '<text x="0" y="14" font-size="12">tokens</text>',
        f'<text x="0" y="30" font-size="11">max {top:,}</text>',
    ]
    cost_points = []
    for n, (iteration, prompt, reply, sub, cost) in enumerate(rows):
        x = LEFT + n * slot + (slot - width) / 2
        y = float(base)
        for kind, value in (("prompt", prompt), ("reply", reply), ("sub", sub)):
            h = plot_h * value / top
            y -= h
            parts.append(
                f'<rect class="usage" data-iteration="{iteration}" data-kind="{kind}" '
                f'x="{x:.1f}" y="{y:.1f}" width="{width:.1f}" height="{h:.1f}" fill="{COLOURS[kind]}">'
                f"<title>iteration {iteration}: "
                f"{value:,} {kind} tokens</title></rect>"
            )
        if len(rows) <= 40 or n % max(len(rows) // 20, 1) == 0:
            parts.append(
                f'<text x="{x + width / 2:.1f}" y="{base + 14}" font-size="11" '
                f'text-anchor="middle">{iteration}</text>'
            )
        if cost is not None and top_cost:
            cost_points.append((x + width / 2, base - plot_h * cost / top_cost, iteration, cost))
    if cost_points:
        line = " ".join(f"{x:.1f},{y:.1f}" for x, y, _i, _c in cost_points)
        parts.append(f'<polyline class="cost" points="{line}" fill="none" stroke="{COLOURS["cost"]}"/>')
        parts.extend(
            f'<circle class="cost" data-iteration="{i}" cx="{x:.1f}" cy="{y:.1f}" r="3" '
            f'fill="{COLOURS["cost"]}"><title>iteration {i}: ${c:.4f}</title></circle>'
            for x, y, i, c in cost_points
        )
    legend = [("prompt", "prompt tokens"), ("reply", "reply tokens"), ("sub", "sub-call tokens")]
    if cost_points:  # every line drawn is named here, the cost's scale with it
        legend.append(("cost", f"cost, USD (its own scale: top ${top_cost:.4f})"))
    for n, (kind, text) in enumerate(legend):
        x = LEFT + n * 140
        parts.append(f'<rect x="{x}" y="{base + 24}" width="10" height="10" fill="{COLOURS[kind]}"/>')
        parts.append(f'<text x="{x + 14}" y="{base + 33}" font-size="11">{text}</text>')
    parts.append("</svg>")
    return "".join(parts)


def plots_section(t: Timeline) -> str:
    """The page's plots, or "" before there is anything to draw."""
    steps, usage = steps_svg(t), usage_svg(t)
    if not steps and not usage:
        return ""
    out = ['<section class="plots"><h2>Steps and spend</h2>']
    if steps:
        out.append(steps)
    if usage:
        out.append(usage)
    out.append("</section>")
    return "\n".join(out)
