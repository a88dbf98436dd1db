"""`drlm list`'s table: one line per episode from the audit store, drawn with rich."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table


def print_table(table: Table, console: Console | None = None) -> None:
    """Lines as wide as they need (a pipe or a file gets whole ids, not wrapped ones)."""
    (console or Console(soft_wrap=True, width=1_000 if not Console().is_terminal else None)).print(table)


def episode_table(rows: Sequence[Any]) -> Table:
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name, justify in (
        ("episode", "left"),
        ("status", "left"),
        ("ended by", "left"),
        ("model", "left"),
        ("iter", "right"),
        ("calls", "right"),
        ("tokens", "right"),
        ("cost $", "right"),
        ("started (UTC)", "left"),
        ("task / answer", "left"),
    ):
        table.add_column(name, justify=justify, no_wrap=name != "task / answer")  # type: ignore[arg-type]
    for row in rows:
        tokens = (row.prompt_tokens or 0) + (row.completion_tokens or 0)
        started = row.started_at.strftime("%Y-%m-%d %H:%M:%S") if row.started_at else "-"
        answer = (row.answer or "").replace("\n", " ")
        table.add_row(
            ("  " * (row.depth or 0)) + row.episode_id,
            row.status,
            row.ended_by or "-",
            row.root_model,
            _number(row.iterations),
            _number(row.model_calls),
            _number(tokens if row.prompt_tokens is not None else None),
            "-" if row.cost_usd is None else f"{row.cost_usd:.4f}",
            started,
            f"{row.task[:40]!r} -> {answer[:40]}" if answer else repr(row.task[:40]),
        )
    return table


def _number(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"
