"""`drlm list`'s table: one line per episode from the audit store (one per persistent session,
for all its turns), drawn with rich; and `drlm show <session>`'s text."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from durable_rlm.terminal import safe


def print_table(table: Table, console: Console | None = None) -> None:
    """Lines as wide as they need (a pipe or a file gets whole ids, not wrapped ones)."""
    (console or Console(soft_wrap=True, width=1_000 if not Console().is_terminal else None)).print(table)


def episode_table(rows: Sequence[Any], unattended: Collection[str] = ()) -> Table:
    """A line per episode; a running one that no worker runs says so in its status."""
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
        table.add_column(name, justify=justify, no_wrap=name != "task / answer")  # type: ignore[arg-type]  # rich's "left" or "right"
    for row in rows:
        if hasattr(row, "summary"):  # a persistent session (audit/readonly.py's SessionRows)
            table.add_row(*_plain(_session_cells(row.summary())))
            continue
        tokens = (row.prompt_tokens or 0) + (row.completion_tokens or 0)
        started = row.started_at.strftime("%Y-%m-%d %H:%M:%S") if row.started_at else "-"
        answer = (row.answer or "").replace("\n", " ")
        cells = [
            ("  " * (row.depth or 0)) + row.episode_id,
            "running, no worker" if row.episode_id in unattended else row.status,
            row.ended_by or "-",
            row.root_model,
            _number(row.iterations),
            _number(row.model_calls),
            _number(tokens if row.prompt_tokens is not None else None),
            "-" if row.cost_usd is None else f"{row.cost_usd:.4f}",
            started,
            f"{row.task[:40]!r} -> {answer[:40]}" if answer else repr(row.task[:40]),
        ]
        table.add_row(*_plain(cells))
    return table


def _plain(cells: list[str]) -> list[Text]:
    """Cells as plain text: a task or an answer (a user's, a model's) is neither rich markup
    (`[link=...]` would make a link) nor control sequences."""
    return [Text(safe(cell)) for cell in cells]


def _session_cells(line: dict[str, Any]) -> list[str]:
    """Its turns summed (iterations, calls, tokens, cost); its last turn's status and answer."""
    tokens = (line["prompt_tokens"] or 0) + (line["completion_tokens"] or 0)
    started = line["started_at"].strftime("%Y-%m-%d %H:%M:%S") if line["started_at"] else "-"
    answer = (line["answer"] or "").replace("\n", " ")
    status = line["session_status"] or "-"
    count = line["turn_count"]
    last = f"turn {count - 1} {line['last_turn_status']}"
    return [
        f"{line['session_id']} (session, {count} turn{'s' if count != 1 else ''})",
        status,
        line["ended_by"] or "-",
        line["root_model"],
        _number(line["iterations"]),
        _number(line["model_calls"]),
        _number(tokens if line["prompt_tokens"] is not None else None),
        "-" if line["cost_usd"] is None else f"{line['cost_usd']:.4f}",
        started,
        f"{last}: {line['task'][:40]!r} -> {answer[:40]}" if answer else f"{last}: {line['task'][:40]!r}",
    ]


def session_text(view: dict[str, Any], width: int = 2_000) -> str:
    """`drlm show <session>`: the session, then a block per turn (its own `drlm show` has the
    turn's whole timeline)."""

    def clip(text: str | None) -> str:
        text = text or ""
        return text if len(text) <= width else text[:width] + f" ... [{len(text) - width} more chars]"

    turns = view["turns"]
    lines = [
        f"Session {view['session_id']}: {view['status']}, {len(turns)} turn(s), model {view['model'] or '-'}"
    ]
    if view.get("ended_by"):
        lines.append(f"Ended by: {view['ended_by']}" + (f" ({view['reason']})" if view.get("reason") else ""))
    cost = view.get("cost_usd")
    lines.append(
        f"Total: {_number(view.get('tokens'))} tokens, cost $" + ("-" if cost is None else f"{cost:.4f}")
    )
    for turn in turns:
        lines.append(f"\n=== turn {turn['turn']}: {turn['episode_id']} ({turn['status']}) ===")
        lines.append(f"Task: {clip(turn['task'])}")
        lines.append(f"Answer: {clip(turn['answer']) if turn['answer'] is not None else '(none)'}")
        if turn.get("error"):
            lines.append(f"Error: {clip(turn['error'])}")
        iterations, calls = _number(turn.get("iterations")), _number(turn.get("model_calls"))
        counts = f"{iterations} iteration(s), {calls} model call(s)"
        cost = turn.get("cost_usd")
        lines.append(
            f"{counts}, {_number(turn.get('tokens'))} tokens, cost $"
            + ("-" if cost is None else f"{cost:.4f}")
            + f", ended by {turn.get('ended_by') or '-'}"
        )
        lines.append(f"Timeline: drlm show {turn['episode_id']}")
    if not turns:
        lines.append("\n(no turn yet)")
    return safe("\n".join(lines))


def _number(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"
