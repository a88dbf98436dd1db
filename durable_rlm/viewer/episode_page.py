"""The episode page: read, follow and steer an RLM episode in a browser.

Served by the shared server's supervisor beside its codec server (durable_rlm/viewer/codec_server.py
routes `/<secret>/episodes...` here), so it has the codec server's capability: the owner's
uid and the secret path prefix; nobody else reads it. Everything it shows is rendered from
`episode_timeline` (durable_rlm/audit/timeline.py), the model `drlm show` prints, so the two agree
by construction. Every action calls the function the CLI calls (durable_rlm/client/steering.py,
`cancel_episode`), with the page's user as the sender.

Model text is hostile: every string is escaped here, Markdown is rendered without raw HTML,
links or images, and the page's Content-Security-Policy lets only its own script and style
run. Nothing is loaded from elsewhere (the page works offline).
"""

from __future__ import annotations

import asyncio
import hashlib
import html
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote

from markdown_it import MarkdownIt
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import PythonLexer
from temporalio.service import RPCError

from durable_rlm.activities.sandbox_reaper import start_time
from durable_rlm.audit import readonly
from durable_rlm.audit.timeline import (
    ActionView,
    CellView,
    ChildView,
    IterationView,
    Timeline,
    cost_text,
    describe_execution,
    episode_timeline,
    fork_line,
)
from durable_rlm.client import steering
from durable_rlm.client.episodes import cancel_episode
from durable_rlm.client.steering import default_sender, progress_of
from durable_rlm.server.connection import connect_client
from durable_rlm.server.embedded import ServerFiles
from durable_rlm.settings import private_file
from durable_rlm.store.codec import data_converter
from durable_rlm.viewer.episode_plots import plots_section

if TYPE_CHECKING:
    import sqlalchemy as sa
    from temporalio.client import Client

    from durable_rlm.settings import Settings
    from durable_rlm.store.blobs import BlobStore
    from durable_rlm.workflows.models import EpisodeProgress

log = logging.getLogger(__name__)

PREFIX = "/episodes"
_CLOCK_ROW = re.compile(r'<tr class="budget" data-budget="time">.*?</tr>', re.S)
STATIC = ("page.js", "page.css")
SUMMARY_CHARS = 120  # of a folded text shown in its summary line
FOLD_CHARS = 1_500  # text longer than this is folded (<details>)
MARKDOWN_CHARS = 200_000  # a reply longer than this is not rendered as Markdown
LIST_LIMIT = 500  # audit rows searched by the list page
LIVE_QUERIES = 20  # running episodes the list asks whether they are paused or waiting
CALL_TIMEOUT_S = 60.0
PAGE_LEASE_S = 60.0  # an open page keeps the shared server this long after its last poll

SECURITY_HEADERS = {
    # Only our own script and style; no inline script, no frames, no other origin.
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",  # the capability is in the URL: never send it onward
    "Cache-Control": "no-store",
}


@dataclass
class PageResponse:
    status: int
    content_type: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


def _json(status: int, value: Any) -> PageResponse:
    return PageResponse(status, "application/json", json.dumps(value, default=str).encode())


def _html(status: int, text: str) -> PageResponse:
    return PageResponse(status, "text/html; charset=utf-8", text.encode("utf-8", errors="replace"))


def esc(value: Any) -> str:
    """Text for HTML, quotes included (safe in attributes too)."""
    return html.escape("" if value is None else str(value), quote=True)


# --- rendering ----------------------------------------------------------------------------


class Renderer:
    """Timeline -> HTML. Markdown for replies (no raw HTML, links or images: model text is
    hostile), pygments for code; both escape what they are given."""

    def __init__(self) -> None:
        self._lexer = PythonLexer()
        self._formatter = HtmlFormatter(cssclass="hl")
        self._inline = HtmlFormatter(nowrap=True)
        self._md = MarkdownIt("commonmark", {"html": False, "highlight": self._fence})
        self._md.disable(["link", "image", "autolink", "html_inline", "html_block"])

    def style(self) -> str:
        return str(self._formatter.get_style_defs(".hl"))

    def code(self, source: str) -> str:
        """A cell's code (all cells are Python), highlighted; pygments escapes it."""
        return str(highlight(source, self._lexer, self._formatter))

    def _fence(self, source: str, language: str, _attrs: Any) -> str:
        if language not in ("repl", "py", "python", "python3"):
            return ""  # markdown-it escapes it as a plain block
        # Starts with <pre, so markdown-it takes it as the whole block (pygments escapes).
        return f'<pre class="hl">{highlight(source, self._lexer, self._inline)}</pre>'

    def markdown(self, text: str) -> str:
        """A reply as Markdown; one too long to render is shown as sent (it is below too)."""
        if len(text) > MARKDOWN_CHARS:
            return f"<pre>{esc(text[:MARKDOWN_CHARS])}…</pre>"
        return str(self._md.render(text))


def _folded(label: str, text: str | None, css: str = "", key: str = "", always: bool = False) -> str:
    """Long text (or `always`) behind a summary that shows its head."""
    text = text or ""
    if not always and len(text) <= FOLD_CHARS:
        return f'<div class="{css}"><span class="label">{esc(label)}</span><pre>{esc(text)}</pre></div>'
    head = text.strip().splitlines()[0][:SUMMARY_CHARS] if text.strip() else ""
    return (
        f'<details class="{css}" data-key="{esc(key)}"><summary><span class="label">{esc(label)}</span> '
        f"{esc(head)}{'…' if len(text) > len(head) else ''} <span class=dim>({len(text):,} chars)</span>"
        f"</summary><pre>{esc(text)}</pre></details>"
    )


def _seconds(start: datetime | None, end: datetime | None) -> str:
    if start is None or end is None:
        return ""
    return f"{(end - start).total_seconds():.2f} s"


def _page_href(base: str, episode_id: str) -> str:
    return f"{base}{PREFIX}/{quote(episode_id, safe='')}"


class TimelineView:
    """One episode's page body, from its Timeline (and, while it runs, its progress)."""

    def __init__(self, renderer: Renderer, base: str) -> None:
        self.r = renderer
        self.base = base

    def body(self, timeline: Timeline, progress: EpisodeProgress | None = None) -> str:
        parts = [self._header(timeline, progress), self._budgets(timeline, progress), plots_section(timeline)]
        actions = sorted(timeline.actions, key=lambda a: a.at)
        for it in timeline.iterations:
            before = [a for a in actions if a.iteration < it.iteration]
            actions = [a for a in actions if a.iteration >= it.iteration]
            parts.append(self._iteration(timeline, it, before, progress))
        if actions:
            parts.append(
                '<section class="actions-tail">' + "".join(self._action(a) for a in actions) + "</section>"
            )
        parts.append(self._ending(timeline))
        return "\n".join(parts)

    def _header(self, t: Timeline, progress: EpisodeProgress | None) -> str:
        status = t.status
        flags = []
        if progress is not None and progress.held:
            flags.append(f'<span class="badge paused">paused: {esc(progress.held)}</span>')
        if progress is not None and progress.paused:
            flags.append(f'<span class="badge paused">waiting: {esc(progress.paused)}</span>')
        if progress is not None and progress.pending_cell is not None:
            flags.append(
                f'<span class="badge waiting">cell {progress.pending_cell.cell} waits for approval</span>'
            )
        lines = [
            f'<header><h1>Episode <span class="episode-id">{esc(t.episode_id)}</span> '
            f'<span class="badge status-{esc(status)}">{esc(status)}</span> {"".join(flags)}</h1>',
            _folded("Task", t.task, "task", "task"),
        ]
        request = t.request
        facts = [f"{t.runs} run(s)"]
        if request is not None:
            facts.append(f"model {esc(request.root_model.model)}")
            facts.append(f"depth {request.depth}")
            if request.parent is not None:
                href = esc(_page_href(self.base, request.parent.episode_id))
                facts.append(
                    f'child of <a href="{href}">{esc(request.parent.episode_id)}</a> '
                    f"(cell {request.parent.cell_index}, call {request.parent.call_index})"
                )
            if request.fork is not None:
                facts.append(esc(fork_line(request.fork)))
        if t.started_at is not None:
            facts.append(f"started {t.started_at:%Y-%m-%d %H:%M:%S} UTC")
        if t.ended_at is not None:
            facts.append(f"ended {t.ended_at:%Y-%m-%d %H:%M:%S} UTC")
        lines.append('<p class="facts">' + " · ".join(facts) + "</p></header>")
        return "\n".join(lines)

    def _budgets(self, t: Timeline, progress: EpisodeProgress | None) -> str:
        limits = (progress.limits if progress is not None else None) or (
            t.request.limits if t.request else None
        )
        r = t.result
        if r is not None:
            used = {
                "iterations": r.iterations,
                "model calls": r.model_calls,
                "REPL calls": r.sub_calls,
                "tokens": r.usage.total_tokens,
                "cost": r.usage.cost_usd,
            }
        elif progress is not None:
            used = {
                "iterations": progress.iteration,
                "model calls": progress.model_calls,
                "REPL calls": progress.sub_calls,
                "tokens": progress.tokens,
                "cost": progress.cost_usd,
            }
        else:
            used = {"iterations": len(t.iterations)}
        end = t.ended_at or datetime.now(UTC)
        if t.started_at is not None:
            used["time"] = (end - t.started_at).total_seconds()
        caps: dict[str, float | None] = {}
        if limits is not None:
            caps = {
                "iterations": limits.max_iterations,
                "model calls": limits.max_model_calls,
                "REPL calls": limits.max_llm_calls,
                "tokens": limits.max_tokens,
                "cost": limits.max_cost_usd,
                "time": limits.max_duration.total_seconds(),
            }
        rows = []
        for name, value in used.items():
            limit = caps.get(name)
            if name == "cost":
                shown = "unknown (a model has no price)" if value is None else f"${value:.4f}"
                total = f"${limit:.4f}" if limit is not None else ""
            elif name == "time":
                shown, total = f"{value:,.1f} s", f"{limit:,.0f} s" if limit is not None else ""
            else:
                shown, total = f"{value:,}", f"{limit:,.0f}" if limit is not None else ""
            if limit is None or value is None:
                meter = '<span class="dim">no limit</span>'
            else:
                meter = (
                    f'<meter min="0" max="{float(limit)}" low="{0.8 * float(limit)}" '
                    f'high="{0.95 * float(limit)}" optimum="0" '
                    f'value="{min(float(value), float(limit))}"></meter>'
                )
            rows.append(
                f'<tr class="budget" data-budget="{esc(name)}"><th>{esc(name)}</th><td>{meter}</td>'
                f"<td>{esc(shown)}{' of ' + esc(total) if total else ''}</td></tr>"
            )
        return '<section class="budgets"><h2>Budgets</h2><table>' + "".join(rows) + "</table></section>"

    def _action(self, a: ActionView) -> str:
        by = f" by {a.sender}" if a.sender else ""
        what = f"reset to workflow task {a.reset_to}" if a.kind == "reset" else a.kind
        return (
            f'<div class="action action-{esc(a.kind)}"><span class="label">{esc(what)}{esc(by)}</span> '
            f'<span class="dim">at {a.at:%Y-%m-%d %H:%M:%S}</span><pre>{esc(a.detail)}</pre></div>'
        )

    def _iteration(
        self,
        t: Timeline,
        it: IterationView,
        actions: Sequence[ActionView],
        progress: EpisodeProgress | None = None,
    ) -> str:
        fork = t.request.fork if t.request is not None else None
        meta = [esc(it.model)] if it.model else []
        if it.usage is not None:
            meta.append(f"{it.usage.prompt_tokens:,} + {it.usage.completion_tokens:,} tokens")
        if it.model_time_s:
            meta.append(f"model {it.model_time_s:.2f} s")
        span = _seconds(it.started_at, it.ended_at)
        if span:
            meta.append(f"step {span}")
        inherited = f" (inherited from {esc(it.inherited_from)})" if it.inherited_from else ""
        out = [
            f'<section class="iteration" id="iteration-{it.iteration}" data-iteration="{it.iteration}">',
            "".join(self._action(a) for a in actions),
            f"<h2>Iteration {it.iteration}{inherited} <span class=dim>{' · '.join(meta)}</span></h2>",
        ]
        if fork is not None and it.iteration == fork.iteration + 1 and not it.inherited_from:
            out.append(f'<p class="branch">{esc(t.episode_id)} branches here from {esc(fork.source_id)}</p>')
        for n, compaction in enumerate(it.compactions):
            out.append(_folded("compacted", compaction, "compaction", f"c{it.iteration}.{n}", always=True))
        if it.model_error:
            out.append(
                '<div class="error"><span class="label">model error</span>'
                f"<pre>{esc(it.model_error)}</pre></div>"
            )
        if it.response is not None:
            out.append(
                '<div class="reply"><span class="label">model reply</span>'
                f'<div class="markdown">{self.r.markdown(it.response)}</div>'
                f'<details class="raw" data-key="raw{it.iteration}"><summary>reply as sent</summary>'
                f"<pre>{esc(it.response)}</pre></details></div>"
            )
        elif not it.model_error:
            out.append('<div class="reply pending-step">the model is answering…</div>')
        out.extend(self._cell(c) for c in it.cells)
        pending = progress.pending_cell if progress is not None else None
        if pending is not None and pending.iteration == it.iteration:
            # Not in history yet (it has not run): the workflow's own state says it waits.
            reasons = "; ".join(pending.reasons)
            out.append(
                f'<div class="cell pending-cell" id="cell-{pending.cell}"><h3>cell {pending.cell} '
                f'<span class="badge waiting">waits for approval</span> <span class=dim>{esc(reasons)}'
                f'</span></h3><div class="code">{self.r.code(pending.code)}</div></div>'
            )
        out.append("</section>")
        return "\n".join(out)

    def _cell(self, cell: CellView) -> str:
        took = _seconds(cell.started_at, cell.ended_at)
        head = f"cell {cell.cell_index}" + (" (rebuilt)" if cell.rebuilt else "")
        out = [
            f'<div class="cell" id="cell-{cell.cell_index}" data-cell="{cell.cell_index}">',
            f"<h3>{esc(head)} <span class=dim>{esc(took if cell.ended_at is not None else 'running')}</span>"
            "</h3>",
            f'<div class="code">{self.r.code(cell.code)}</div>',
        ]
        for call in cell.sub_calls:
            answer = call.reply if call.error is None else f"ERROR {call.error}"
            usage = f", {call.usage.total_tokens:,} tokens" if call.usage is not None else ""
            out.append(
                f'<details class="subcall" data-key="s{cell.cell_index}.{call.call_index}"><summary>'
                f'<span class="label">sub-call {call.call_index}</span> '
                f"{esc(call.prompt.strip()[:SUMMARY_CHARS])} → {esc((answer or '…').strip()[:SUMMARY_CHARS])}"
                f' <span class="dim">({esc(call.model)}{usage}, {call.model_time_s:.2f} s)</span></summary>'
                f'<div class="label">prompt</div><pre>{esc(call.prompt)}</pre>'
                '<div class="label">answer</div>'
                f"<pre>{esc(answer if answer is not None else '(waiting)')}</pre>"
                "</details>"
            )
        out.extend(self._child(child) for child in cell.children)
        if cell.stdout:
            out.append(_folded("output", cell.stdout, "output", f"o{cell.cell_index}"))
        if cell.stderr:
            out.append(_folded("stderr", cell.stderr, "stderr", f"e{cell.cell_index}"))
        if cell.error:
            out.append(_folded("error", cell.error, "error", f"x{cell.cell_index}"))
        if not (cell.stdout or cell.stderr or cell.error) and cell.ended_at is not None:
            out.append('<div class="output dim">(no output)</div>')
        if cell.answer is not None:
            out.append(_folded("answer given", cell.answer, "cell-answer", f"a{cell.cell_index}"))
        if cell.rebuild is not None:
            source = (
                f"the snapshot after cell {cell.rebuild.from_snapshot}"
                if cell.rebuild.from_snapshot is not None
                else "the cell log alone"
            )
            notes = "".join(f"<li>{esc(n)}</li>" for n in cell.rebuild.notes)
            out.append(
                f'<div class="note">REPL rebuilt before it from {esc(source)}: {cell.rebuild.cells_rerun} '
                f"cell(s) re-run in {cell.rebuild.seconds:.2f} s<ul>{notes}</ul></div>"
            )
        if cell.snapshot is not None:
            out.append(f'<div class="note dim">snapshot after this cell: {cell.snapshot.size:,} bytes</div>')
        out.append("</div>")
        return "\n".join(out)

    def _child(self, child: ChildView, depth: int = 0) -> str:
        href = esc(_page_href(self.base, child.episode_id))
        t = child.timeline
        if t is None:
            state = "no history found"
        elif t.result is not None:
            r = t.result
            state = (
                f"ended by {r.ended_by}; answer: {r.answer}; {r.model_calls} model call(s), "
                f"{r.usage.total_tokens:,} tokens"
            )
        else:
            state = t.failure or t.status
        nested = ""
        if t is not None and depth < 8:
            grandchildren = [c for it in t.iterations for cell in it.cells for c in cell.children]
            nested = "".join(self._child(c, depth + 1) for c in grandchildren)
        return (
            f'<details class="child" open data-key="child-{esc(child.episode_id)}"><summary>'
            f'<span class="label">child</span> <a href="{href}">{esc(child.episode_id)}</a> '
            f'<span class="dim">(call {child.call_index}, model {esc(child.model)})</span> {esc(state)}'
            f"</summary>{nested}</details>"
        )

    def _ending(self, t: Timeline) -> str:
        if t.result is None and not t.failure:
            return '<section class="ending running"><h2>Not ended yet</h2></section>'
        out = ['<section class="ending"><h2>How it ended</h2>']
        r = t.result
        if r is not None:
            source = r.answer_source + (f" ({r.answer_policy})" if r.answer_policy else "")
            out.append(
                f'<div class="answer"><span class="label">Answer ({esc(source)})</span>'
                f"<pre>{esc(r.answer) if r.answer is not None else '(no answer)'}</pre></div>"
            )
            facts = [
                f"Ended by <b>{esc(r.ended_by)}</b> after {r.iterations} iteration(s), {r.model_calls} model "
                f"call(s) ({r.sub_calls} from the REPL), {r.usage.total_tokens:,} tokens, "
                f"{esc(cost_text(r.usage))}",
                f"Stop reason: {esc(r.stop_reason)}",
            ]
            if r.children:
                facts.append(f"Tree: {r.tree_episodes} episode(s), {len(r.children)} direct child(ren)")
            if r.termination is not None:
                tm = r.termination
                facts.append(
                    f"Termination: policy {esc(tm.policy)} at step {tm.step} ({esc(tm.action_type)}): "
                    f"{esc(tm.reason)}"
                )
            if r.execution is not None:
                facts.append(esc(describe_execution(r.execution)))
            if r.error:
                facts.append(f"Error: {esc(r.error)}")
            if r.lost_cells or r.compactions or r.replay_divergences:
                facts.append(
                    f"Lost cells: {r.lost_cells}; compactions: {r.compactions}; "
                    f"replay divergences: {r.replay_divergences}"
                )
            out.append("<ul>" + "".join(f"<li>{f}</li>" for f in facts) + "</ul>")
        if t.failure:
            out.append(
                f'<div class="error"><span class="label">Failed</span><pre>{esc(t.failure)}</pre></div>'
            )
        out.append("</section>")
        return "\n".join(out)


def episode_document(title: str, base: str, body: str, data: dict[str, Any]) -> str:
    """The page around a body: our stylesheet and script only; `data` for the script."""
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<title>{esc(title)}</title>"
        '<meta name="referrer" content="no-referrer">'
        f'<link rel="stylesheet" href="{esc(base)}{PREFIX}/static/page.css"></head><body>'
        f'<script type="application/json" id="page-data">{_script_json(data)}</script>'
        f"{body}"
        f'<script src="{esc(base)}{PREFIX}/static/page.js"></script></body></html>'
    )


def _script_json(data: dict[str, Any]) -> str:
    """JSON inside <script>: `<`, `>` and `&` escaped, so no text closes the element."""
    text = json.dumps(data, default=str)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


CONTROLS = """
<section id="controls" class="controls" hidden>
  <h2>Act on it</h2>
  <div id="pending" class="pending" hidden>
    <h3>Cell <span id="pending-cell"></span> waits for approval</h3>
    <p id="pending-reasons" class="dim"></p>
    <textarea id="pending-code" rows="8" spellcheck="false"></textarea>
    <div class="row">
      <button id="approve" data-act="approve">Approve</button>
      <button id="edit" data-act="edit">Run my edit</button>
      <input id="reject-reason" placeholder="why (for the model)">
      <button id="reject" data-act="reject">Reject</button>
    </div>
  </div>
  <div class="row"><input id="hint-text" placeholder="a hint for the model's next turn">
    <button data-act="hint">Send hint</button></div>
  <div class="row limits">
    <label>iterations <input id="limit-max_iterations" type="number" min="1"></label>
    <label>REPL calls <input id="limit-max_llm_calls" type="number" min="1"></label>
    <label>model calls <input id="limit-max_model_calls" type="number" min="1"></label>
    <label>tokens <input id="limit-max_tokens" type="number" min="1"></label>
    <label>cost $ <input id="limit-max_cost_usd" type="number" min="0" step="any"></label>
    <label>time s <input id="limit-max_duration" type="number" min="1"></label>
    <button data-act="limits">Set limits</button></div>
  <div class="row">
    <input id="reason" placeholder="reason (pause, finish, cancel)">
    <button data-act="pause">Pause</button><button data-act="resume">Resume</button>
    <button data-act="finish">Finish now</button><button data-act="cancel" class="danger">Cancel</button>
    <label>as <input id="sender" size="12"></label>
  </div>
  <p id="act-result" class="dim" role="status"></p>
</section>
"""


# --- the list -----------------------------------------------------------------------------


@dataclass
class ListQuery:
    text: str = ""
    status: str = ""
    model: str = ""
    since: str = ""
    min_cost: str = ""
    max_cost: str = ""

    @classmethod
    def of(cls, query: dict[str, list[str]]) -> ListQuery:
        def one(name: str) -> str:
            return (query.get(name) or [""])[0].strip()[:200]

        return cls(one("q"), one("status"), one("model"), one("since"), one("min_cost"), one("max_cost"))


def list_body(base: str, rows: Sequence[Any], q: ListQuery, live: dict[str, str], error: str = "") -> str:
    """The episode list: a search form, then one row per episode, paused and waiting ones marked."""
    statuses = ("", "running", "completed", "failed", "cancelled", "terminated", "timed_out")
    options = "".join(
        f'<option value="{esc(s)}"{" selected" if s == q.status else ""}>{esc(s or "any status")}</option>'
        for s in statuses
    )
    form = (
        f'<form class="search" method="get" action="{esc(base)}{PREFIX}">'
        f'<input name="q" placeholder="task text" value="{esc(q.text)}">'
        f'<select name="status">{options}</select>'
        f'<input name="model" placeholder="model" value="{esc(q.model)}">'
        f'<input name="since" placeholder="since (24h, 2026-11-01)" value="{esc(q.since)}">'
        f'<input name="min_cost" placeholder="min $" size="6" value="{esc(q.min_cost)}">'
        f'<input name="max_cost" placeholder="max $" size="6" value="{esc(q.max_cost)}">'
        "<button>Search</button></form>"
    )
    out = ["<header><h1>Episodes</h1></header>", form]
    if error:
        out.append(f'<p class="error">{esc(error)}</p>')
    out.append(
        '<table class="episodes"><thead><tr><th>episode</th><th>task</th><th>status</th><th>answer</th>'
        "<th>iterations</th><th>cost</th><th>started (UTC)</th></tr></thead><tbody>"
    )
    for row in rows:
        state = live.get(row.episode_id, "")
        css = " ".join(x for x in ("attention" if state else "", f"status-{row.status}") if x)
        cost = "—" if row.cost_usd is None else f"${row.cost_usd:.4f}"
        started = row.started_at.strftime("%Y-%m-%d %H:%M:%S") if row.started_at else "—"
        indent = "· " * (row.depth or 0)
        out.append(
            f'<tr class="{esc(css)}" data-episode="{esc(row.episode_id)}">'
            f'<td>{esc(indent)}<a href="{esc(_page_href(base, row.episode_id))}">'
            f"{esc(row.episode_id)}</a></td>"
            f'<td class="text">{esc((row.task or "")[:200])}</td>'
            f'<td><span class="badge status-{esc(row.status)}">{esc(row.status)}</span>'
            f"{f' <span class=badge-attention>{esc(state)}</span>' if state else ''}</td>"
            f'<td class="text">{esc((row.answer or "")[:200])}</td>'
            f"<td>{esc(row.iterations if row.iterations is not None else '—')}</td>"
            f"<td>{esc(cost)}</td><td>{esc(started)}</td></tr>"
        )
    out.append("</tbody></table>")
    if not rows:
        out.append('<p class="dim">no episodes match</p>')
    return "\n".join(out)


# --- the routes ---------------------------------------------------------------------------


class EpisodePages:
    """The page's routes under the codec server's capability. Runs its Temporal calls on
    one event loop in a thread of its own (the HTTP server's request threads wait on it)."""

    def __init__(
        self,
        settings: Settings,
        blobs: BlobStore,
        engine: sa.Engine | None,
        address: Callable[[], str | None] | None = None,
        sender: str | None = None,
    ) -> None:
        self.settings = settings
        self.blobs = blobs
        self.engine = engine
        self._address = address or self._address_from_state
        self.sender = sender or default_sender()
        self.renderer = Renderer()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: Client | None = None
        self._lock = threading.Lock()
        self._last_seen = 0.0
        self._lease: Path | None = None

    # -- plumbing

    def _address_from_state(self) -> str | None:
        state = ServerFiles.of(self.settings).read_state()
        return None if state is None else str(state["address"])

    def _temporal_ui(self) -> str | None:
        state = ServerFiles.of(self.settings).read_state() or {}
        return state.get("ui")

    def _run(self, make: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="episode-pages", daemon=True).start()
                self._loop = loop
        return asyncio.run_coroutine_threadsafe(make(), self._loop).result(CALL_TIMEOUT_S)

    async def client(self) -> Client:
        if self._client is None:
            address = self._address()
            if address is None:
                raise LookupError("the Temporal server is not up yet")
            converter = data_converter(
                self.blobs, self.settings.claim_check_threshold, self.settings.keyring()
            )
            # A worker's metrics port is not the supervisor's to take.
            settings = self.settings.model_copy(update={"metrics_address": None})
            self._client = await connect_client(address, settings, converter, [])
        return self._client

    def close(self) -> None:
        if self._lease is not None:
            self._lease.unlink(missing_ok=True)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)

    @staticmethod
    def owns(path: str) -> bool:
        return path == PREFIX or path.startswith(PREFIX + "/")

    def touched(self) -> None:
        """An open page holds a lease on the shared server (its script pings while it is
        open): the server outlives `drlm ui`, and idles out PAGE_LEASE_S after the last page
        went away. The lease is the supervisor's own (its pid), so it dies with it."""
        with self._lock:
            self._last_seen = time.monotonic()
            if self._lease is not None and self._lease.exists():
                return
            me = os.getpid()
            self._lease = ServerFiles.of(self.settings).leases / f"{me}-{start_time(me)}-episode-page"
            private_file(self._lease)
            threading.Thread(target=self._expire, name="episode-page-lease", daemon=True).start()

    def _expire(self) -> None:
        while True:
            time.sleep(min(PAGE_LEASE_S / 4, 5.0))
            with self._lock:
                if time.monotonic() - self._last_seen >= PAGE_LEASE_S and self._lease is not None:
                    self._lease.unlink(missing_ok=True)
                    self._lease = None
                    return

    # -- GET

    def get(self, path: str, query: dict[str, list[str]], base: str) -> PageResponse:
        self.touched()
        rest = path[len(PREFIX) :].lstrip("/")
        if not rest:
            return self._list(query, base)
        if rest == "lease":
            return _json(200, {"lease_s": PAGE_LEASE_S})
        if rest.startswith("static/") and rest.removeprefix("static/") in STATIC:
            return self._static(rest.removeprefix("static/"))
        segment, _, tail = rest.partition("/")
        episode_id = unquote(segment)
        if tail == "":
            return self._episode(episode_id, base)
        if tail == "state.json":
            return self._state(episode_id, base)
        return _json(404, {"error": f"no page {path}"})

    def _static(self, name: str) -> PageResponse:
        text = resources.files("durable_rlm").joinpath("static", name).read_text()
        if name == "page.css":
            return PageResponse(200, "text/css; charset=utf-8", (text + self.renderer.style()).encode())
        return PageResponse(200, "text/javascript; charset=utf-8", text.encode())

    async def _snapshot(self, episode_id: str, base: str) -> dict[str, Any]:
        client = await self.client()
        timeline = await episode_timeline(client, episode_id)
        progress = None
        if timeline.status == "running":
            try:
                progress = await progress_of(client, episode_id)
            except RPCError:
                progress = None  # no worker to answer the query: the history still shows
        body = TimelineView(self.renderer, base).body(timeline, progress)
        pending = progress.pending_cell if progress is not None else None
        return {
            "episode_id": episode_id,
            "status": timeline.status,
            "running": timeline.status == "running",
            # The clock's row alone changes every second: the script updates it in place.
            "version": hashlib.sha256(_CLOCK_ROW.sub("", body).encode()).hexdigest()[:16],
            "html": body,
            "pending": None if pending is None else pending.model_dump(mode="json"),
            "held": progress.held if progress is not None else None,
            "limits": progress.limits.model_dump(mode="json") if progress and progress.limits else None,
        }

    def _episode(self, episode_id: str, base: str) -> PageResponse:
        try:
            snapshot = self._run(lambda: self._snapshot(episode_id, base))
        except LookupError as exc:
            return _html(404, episode_document("not found", base, f"<p class=error>{esc(exc)}</p>", {}))
        temporal = self._temporal_ui()
        links = [f'<a href="{esc(base)}{PREFIX}">all episodes</a>']
        if temporal:
            ns = quote(self.settings.temporal_namespace, safe="")
            href = f"{temporal.rstrip('/')}/namespaces/{ns}/workflows/{quote(episode_id, safe='')}"
            links.append(f'<a href="{esc(href)}" rel="noreferrer">raw events in the Temporal UI</a>')
        nav = "<nav>" + " · ".join(links) + "</nav>"
        body = f'{nav}<main id="timeline">{snapshot.pop("html")}</main>{CONTROLS}'
        data = {**snapshot, "sender": self.sender, "base": base}
        return _html(200, episode_document(f"{episode_id} — drlm", base, body, data))

    def _state(self, episode_id: str, base: str) -> PageResponse:
        try:
            return _json(200, self._run(lambda: self._snapshot(episode_id, base)))
        except LookupError as exc:
            return _json(404, {"error": str(exc)})

    def _list(self, query: dict[str, list[str]], base: str) -> PageResponse:
        q = ListQuery.of(query)
        rows, error = [], ""
        try:
            rows = self._rows(q)
        except (ValueError, LookupError) as exc:
            error = str(exc)
        live: dict[str, str] = {}
        running = [r.episode_id for r in rows if r.status == "running"][:LIVE_QUERIES]
        if running:
            try:
                live = self._run(lambda: self._live_states(running))
            except Exception as exc:  # noqa: BLE001 - the list still shows without the live flags
                log.warning("episode list: live states unavailable: %s", exc)
        return _html(
            200,
            episode_document("episodes — drlm", base, list_body(base, rows, q, live, error), {"base": base}),
        )

    def _rows(self, q: ListQuery) -> list[Any]:
        if self.engine is None:
            return []
        where = readonly.EpisodeFilter(
            status=q.status or None,
            model=q.model or None,
            since=readonly.parse_moment(q.since) if q.since else None,
            min_cost=float(q.min_cost) if q.min_cost else None,
            max_cost=float(q.max_cost) if q.max_cost else None,
        )
        rows = list(readonly.episode_rows(self.engine, LIST_LIMIT, where))
        if q.text:
            needle = q.text.casefold()
            rows = [r for r in rows if needle in (r.task or "").casefold()]
        return rows

    async def _live_states(self, episode_ids: list[str]) -> dict[str, str]:
        """Which running episodes wait for a person: paused, or a cell awaiting approval."""
        client = await self.client()

        async def one(episode_id: str) -> tuple[str, str]:
            try:
                p = await asyncio.wait_for(progress_of(client, episode_id), 5)
            except Exception:  # noqa: BLE001 - no worker answers: nothing to flag
                return episode_id, ""
            if p.pending_cell is not None:
                return episode_id, f"cell {p.pending_cell.cell} waits for approval"
            if p.held:
                return episode_id, f"paused: {p.held}"
            if p.paused:
                return episode_id, "waiting: " + p.paused
            return episode_id, ""

        return dict(await asyncio.gather(*(one(i) for i in episode_ids)))

    # -- POST

    def post(self, path: str, body: bytes, headers: Any, port: int) -> PageResponse:
        refused = same_origin_refusal(headers, port)
        if refused:
            return _json(403, {"error": refused})
        rest = path[len(PREFIX) :].lstrip("/")
        segment, _, tail = rest.partition("/")
        if not segment or not tail.startswith("act/"):
            return _json(404, {"error": f"no action at {path}"})
        action = tail.removeprefix("act/")
        try:
            form = json.loads(body or b"{}")
            if not isinstance(form, dict):
                raise ValueError("the body is a JSON object")
            outcome = self._run(lambda: act(self, unquote(segment), action, form))
        except (ValueError, TypeError) as exc:
            return _json(400, {"error": str(exc).splitlines()[0][:300]})
        return _json(200, outcome)


def same_origin_refusal(headers: Any, port: int) -> str | None:
    """An action must come from this page: its Origin is ours (a browser sends it with every
    POST), and a JSON body (so another site's form cannot post one without a preflight)."""
    origin = headers.get("Origin")
    ours = (f"http://127.0.0.1:{port}", f"http://localhost:{port}")
    if origin not in ours:
        return f"actions are taken from the episode page itself (origin {origin or 'none'})"
    if headers.get("Sec-Fetch-Site") not in (None, "same-origin"):
        return "actions are taken from the episode page itself"
    if (headers.get("Content-Type") or "").split(";")[0].strip() != "application/json":
        return "an action's body is JSON"
    return None


LIMIT_FIELDS = (
    "max_iterations",
    "max_llm_calls",
    "max_model_calls",
    "max_tokens",
    "max_cost_usd",
    "max_duration",
)


async def act(pages: EpisodePages, episode_id: str, action: str, form: dict[str, Any]) -> dict[str, Any]:
    """One person's action, through the function the CLI uses; the sender is the page's
    user (the supervisor's OS user) unless the page names one."""
    client = await pages.client()
    sender = str(form.get("sender") or pages.sender)[:100]
    reason = str(form.get("reason") or "")[:500]
    if action in ("approve", "edit", "reject"):
        cell = form.get("cell")
        approval = f"{episode_id}#{int(cell)}" if cell is not None else episode_id
        code = str(form["code"]) if action == "edit" else None
        outcome: Any = await steering.decide_cell(
            client, approval, approve=action != "reject", sender=sender, code=code, reason=reason
        )
    elif action == "hint":
        text = str(form.get("text") or "").strip()
        if not text:
            raise ValueError("a hint needs text")
        outcome = await steering.send_hint(client, episode_id, text, sender)
    elif action == "limits":
        given: dict[str, Any] = {}
        for name in LIMIT_FIELDS:
            value = form.get(name)
            if value in (None, ""):
                continue
            given[name] = float(value) if name in ("max_cost_usd", "max_duration") else int(value)
        if not given:
            raise ValueError("no limit given")
        outcome = await steering.change_limits(client, episode_id, sender, **given)
    elif action == "pause":
        outcome = await steering.pause_episode(
            client, episode_id, sender, bool(form.get("hold_clock")), reason
        )
    elif action == "resume":
        outcome = await steering.resume_episode(client, episode_id, sender)
    elif action == "finish":
        outcome = await steering.finish_episode(client, episode_id, sender, reason)
    elif action == "cancel":
        # A cancel carries no sender field: the reason names who asked.
        why = f"cancelled by {sender} from the episode page" + (f": {reason}" if reason else "")
        outcome = await cancel_episode(
            client, episode_id, extract=bool(form.get("extract")), reason=why[:200]
        )
    else:
        raise ValueError(f"no action {action!r}")
    return {"accepted": outcome.accepted, "message": outcome.message}
