"""The episode page's HTML: an episode's timeline, the page around it, and the episode list.

Rendered from `episode_timeline` (durable_rlm/audit/timeline.py), the model `drlm show`
prints, so the two agree by construction; episode_page.py serves it. Model text is hostile:
every string is escaped here, Markdown is rendered without raw HTML, links or images, and
the page loads only its own script and style (episode_page.py's Content-Security-Policy),
which read the data it needs from a JSON element, never from inline script.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from markdown_it import MarkdownIt
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import PythonLexer

from durable_rlm.audit.readonly import ENDED
from durable_rlm.audit.timeline import (
    ActionView,
    CellView,
    ChildView,
    IterationView,
    Timeline,
    describe_execution,
    ended_line,
    ending_text,
    fork_line,
    termination_text,
    unattended_line,
)
from durable_rlm.viewer.episode_plots import plots_section
from durable_rlm.workflows.models import ending_words

if TYPE_CHECKING:
    from durable_rlm.workflows.models import EpisodeProgress

PREFIX = "/episodes"
SUMMARY_CHARS = 120  # of a folded text shown in its summary line
FOLD_CHARS = 1_500  # text longer than this is folded (<details>)
MARKDOWN_CHARS = 200_000  # a reply longer than this is not rendered as Markdown
CODE_FENCES = ("repl", "py", "python", "python3")  # fences highlighted as Python


def esc(value: Any) -> str:
    """Text for HTML, quotes included (safe in attributes too)."""
    return html.escape("" if value is None else str(value), quote=True)


# --- rendering ----------------------------------------------------------------------------


class Renderer:
    """Timeline -> HTML. Markdown for replies (no raw HTML, links or images: model text is
    hostile), pygments for code; both escape what they are given.

    A reply's line breaks are kept (`breaks`): a `FINAL_VAR(result)` on a line of its own
    stays there, not merged into the sentence before it. A reply whose cells ran shows each
    of their fences as a pointer to the cell below, where its code is shown once."""

    def __init__(self) -> None:
        self._lexer = PythonLexer()
        self._formatter = HtmlFormatter(cssclass="hl")
        self._inline = HtmlFormatter(nowrap=True)
        self._md = self._markdown_it(self._fence)
        self._md_ran = self._markdown_it(self._fence_ran)

    @staticmethod
    def _markdown_it(fence: Any) -> MarkdownIt:
        md = MarkdownIt("commonmark", {"html": False, "breaks": True, "highlight": fence})
        md.disable(["link", "image", "autolink", "html_inline", "html_block"])
        return md

    def style(self) -> str:
        return str(self._formatter.get_style_defs(".hl"))

    def code(self, source: str) -> str:
        """A cell's code (all cells are Python), highlighted; pygments escapes it."""
        return str(highlight(source, self._lexer, self._formatter))

    def _fence(self, source: str, language: str, _attrs: Any) -> str:
        if language not in CODE_FENCES:
            return ""  # markdown-it escapes it as a plain block
        # Starts with <pre, so markdown-it takes it as the whole block (pygments escapes).
        return f'<pre class="hl">{highlight(source, self._lexer, self._inline)}</pre>'

    def _fence_ran(self, source: str, language: str, attrs: Any) -> str:
        if language not in CODE_FENCES:
            return self._fence(source, language, attrs)
        return '<pre class="ran">(this code is shown once, in its cell below)</pre>'

    def markdown(self, text: str, cells_below: bool = False) -> str:
        """A reply as Markdown; one too long to render is shown as sent (it is below too).
        With `cells_below`, its code fences point to the cells that show their code."""
        if len(text) > MARKDOWN_CHARS:
            return f"<pre>{esc(text[:MARKDOWN_CHARS])}…</pre>"
        return str((self._md_ran if cells_below else self._md).render(text))


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
        """How it ended (its answer first) at the top, then budgets, plots and the steps."""
        parts = [self._header(timeline, progress)]
        if timeline.result is not None or timeline.failure:
            parts.append(self._ending(timeline))
        parts.extend([self._budgets(timeline, progress), plots_section(timeline)])
        actions = sorted(timeline.actions, key=lambda a: a.at)
        for it in timeline.iterations:
            before = [a for a in actions if a.iteration < it.iteration]
            actions = [a for a in actions if a.iteration >= it.iteration]
            parts.append(self._iteration(timeline, it, before, progress))
        if actions:
            parts.append(
                '<section class="actions-tail">' + "".join(self._action(a) for a in actions) + "</section>"
            )
        if timeline.result is None and not timeline.failure:
            parts.append('<section class="ending running"><h2>Not ended yet</h2></section>')
        return "\n".join(parts)

    def _header(self, t: Timeline, progress: EpisodeProgress | None) -> str:
        status = t.status
        shown = ending_text(t.result) if t.result is not None else ending_words(status)
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
            f'<span class="badge status-{esc(status)}">{esc(shown)}</span> {"".join(flags)}</h1>',
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
        lines.append('<p class="facts">' + " · ".join(facts) + "</p>")
        if t.unattended:
            lines.append(f'<p class="unattended">{esc(unattended_line(t.episode_id))}</p>')
        lines.append("</header>")
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
        pending = progress.pending_cell if progress is not None else None
        waiting_here = pending is not None and pending.iteration == it.iteration
        if it.response is not None:
            cells_below = bool(it.cells) or waiting_here
            out.append(
                '<div class="reply"><span class="label">model reply</span>'
                f'<div class="markdown">{self.r.markdown(it.response, cells_below=cells_below)}</div>'
                f'<details class="raw" data-key="raw{it.iteration}"><summary>reply as sent</summary>'
                f"<pre>{esc(it.response)}</pre></details></div>"
            )
        elif not it.model_error:
            out.append('<div class="reply pending-step">the model is answering…</div>')
        out.extend(self._cell(c) for c in it.cells)
        if pending is not None and waiting_here:
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
                f"{ending_text(r)}; answer: {r.answer}; {r.model_calls} model call(s), "
                f"{r.usage.total_tokens:,} tokens"
            )
        else:
            state = t.failure or ending_words(t.status)
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
        out = ['<section class="ending"><h2>How it ended</h2>']
        r = t.result
        if r is not None:
            source = r.answer_source + (f" ({r.answer_policy})" if r.answer_policy else "")
            out.append(
                f'<div class="answer"><span class="label">Answer ({esc(source)})</span>'
                f"<pre>{esc(r.answer) if r.answer is not None else '(no answer)'}</pre></div>"
            )
            facts = [
                esc(ended_line(r).replace("ended:", "Ended:", 1)),
                f"Stop reason: {esc(r.stop_reason)}",
            ]
            if r.children:
                facts.append(f"Tree: {r.tree_episodes} episode(s), {len(r.children)} direct child(ren)")
            if r.termination is not None:
                facts.append(esc(termination_text(r.termination)))
            if r.execution is not None:
                facts.append(esc(describe_execution(r.execution, r.status)))
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
    statuses = ("", "running", *ENDED)
    options = "".join(
        f'<option value="{esc(s)}"{" selected" if s == q.status else ""}>'
        f"{esc(ending_words(s) or 'any status')}</option>"
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
            f'<td><span class="badge status-{esc(row.status)}">{esc(ending_words(row.status))}</span>'
            f"{f' <span class=badge-attention>{esc(state)}</span>' if state else ''}</td>"
            f'<td class="text">{esc((row.answer or "")[:200])}</td>'
            f"<td>{esc(row.iterations if row.iterations is not None else '—')}</td>"
            f"<td>{esc(cost)}</td><td>{esc(started)}</td></tr>"
        )
    out.append("</tbody></table>")
    if not rows:
        out.append('<p class="dim">no episodes match</p>')
    return "\n".join(out)
