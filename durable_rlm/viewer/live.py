"""The live view of `drlm watch`: where a running episode is, against its budgets.

One frame is a function of the episode's `progress` query (no history is read), drawn with
rich: a bar per budget the request set (iterations, model calls, tokens, cost, time), what
is being waited for, and the tail of the last response and cell output. Every text a model,
a cell or a person wrote is plain rich Text (no markup) passed through
durable_rlm/terminal.py.
"""

from __future__ import annotations

from datetime import UTC, datetime

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from durable_rlm.terminal import safe
from durable_rlm.workflows.models import EpisodeProgress

TAIL_LINES = 8


def frame(episode_id: str, progress: EpisodeProgress, now: datetime | None = None) -> RenderableType:
    """One screen of the live view."""
    now = now or datetime.now(UTC)
    limits = progress.limits
    head = Text.assemble(
        ("episode ", "dim"),
        (safe(episode_id), "bold"),
        ("  model ", "dim"),
        (safe(progress.root_model or "?"), "bold"),
        ("  iteration ", "dim"),
        (str(progress.iteration), "bold cyan"),
    )
    phase = Text(safe(progress.phase), style="yellow" if progress.paused or progress.held else "green")
    if progress.phase_started is not None and not progress.finished:
        phase.append(f"  ({(now - progress.phase_started).total_seconds():.0f} s)", style="dim")
    bars = Table.grid(padding=(0, 1))
    bars.add_column(width=12)
    bars.add_column(width=40)
    bars.add_column()
    if limits is not None:
        _bar(bars, "iterations", progress.iteration, limits.max_iterations)
        _bar(bars, "model calls", progress.model_calls, limits.max_model_calls)
        _bar(bars, "REPL calls", progress.sub_calls, limits.max_llm_calls)
        _bar(bars, "tokens", progress.tokens, limits.max_tokens)
        cost = progress.cost_usd
        if cost is None:
            bars.add_row("cost", "", Text("unknown (a model has no price)", style="dim"))
        else:
            _bar(bars, "cost", cost, limits.max_cost_usd, money=True)
        if progress.started_at is not None:
            elapsed = max((now - progress.started_at).total_seconds(), 0.0)
            _bar(bars, "time", elapsed, limits.max_duration.total_seconds(), unit=" s")
    parts: list[RenderableType] = [head, phase, bars]
    if progress.pending_cell is not None:
        waiting = progress.pending_cell
        lines = [f"risk: {r}" for r in waiting.reasons] + waiting.code.splitlines()[-TAIL_LINES:]
        title = Text(
            safe(f"cell {waiting.cell} waits: drlm approve {waiting.approval_id} | drlm reject ... --reason")
        )
        parts.append(
            Panel(Text(safe("\n".join(lines))), title=title, title_align="left", border_style="yellow")
        )
    if progress.actions:
        actions = Text()
        for a in progress.actions[-5:]:
            actions.append(safe(f"{a.at:%H:%M:%S} {a.kind} by {a.sender}: {a.detail}"[:200]) + "\n")
        parts.append(Panel(actions, title=f"actions ({progress.actions_total})", title_align="left"))
    if progress.last_response:
        parts.append(Panel(_tail(progress.last_response), title="last response", title_align="left"))
    if progress.last_output:
        parts.append(Panel(_tail(progress.last_output), title="last output", title_align="left"))
    return Group(*parts)


def _bar(
    table: Table, label: str, value: float, limit: float | None, money: bool = False, unit: str = ""
) -> None:
    shown = f"${value:.4f}" if money else f"{value:,.0f}{unit}"
    if limit is None:
        table.add_row(label, "", Text(f"{shown}  (no limit)", style="dim"))
        return
    total = f"${limit:.4f}" if money else f"{limit:,.0f}{unit}"
    style = "red" if value >= limit else "yellow" if value >= 0.8 * limit else "green"
    table.add_row(
        label,
        ProgressBar(
            total=float(limit), completed=min(float(value), float(limit)), width=40, complete_style=style
        ),
        f"{shown} / {total}",
    )


def _tail(text: str) -> Text:
    lines = text.rstrip().splitlines()[-TAIL_LINES:]
    return Text(safe("\n".join(line[:200] for line in lines)))
