"""The episode page: read, follow and steer an RLM episode in a browser.

Served by the shared server's supervisor beside its codec server (durable_rlm/viewer/codec_server.py
routes `/<secret>/episodes...` here), so it has the codec server's capability: the owner's
uid and the secret path prefix; nobody else reads it. What it shows is rendered by
page_html.py from `episode_timeline` (durable_rlm/audit/timeline.py). Every action calls the
function the CLI calls (durable_rlm/client/steering.py, `cancel_episode`), with the page's
user as the sender.

Model text is hostile: page_html.py escapes every string, and the page's
Content-Security-Policy (SECURITY_HEADERS) lets only its own script and style run. Nothing
is loaded from elsewhere (the page works offline).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote

from temporalio.client import WorkflowUpdateRPCTimeoutOrCancelledError
from temporalio.service import RPCError

from durable_rlm.audit import readonly
from durable_rlm.audit.timeline import episode_timeline, unanswered_line, unattended_line
from durable_rlm.client import steering
from durable_rlm.client.attendance import unattended_episodes
from durable_rlm.client.episodes import cancel_episode
from durable_rlm.client.steering import default_sender, progress_of
from durable_rlm.host.processes import start_time
from durable_rlm.server.connection import connect_client
from durable_rlm.server.embedded import ServerFiles
from durable_rlm.settings import private_file
from durable_rlm.store.codec import data_converter
from durable_rlm.viewer.page_html import (
    CONTROLS,
    PREFIX,
    ListQuery,
    Renderer,
    TimelineView,
    episode_document,
    esc,
    list_body,
)

if TYPE_CHECKING:
    import sqlalchemy as sa
    from temporalio.client import Client

    from durable_rlm.settings import Settings
    from durable_rlm.store.blobs import BlobStore

log = logging.getLogger(__name__)

_CLOCK_ROW = re.compile(r'<tr class="budget" data-budget="time">.*?</tr>', re.S)
STATIC = ("page.js", "page.css")
LIST_LIMIT = 500  # audit rows searched by the list page
LIVE_QUERIES = 20  # running episodes the list asks whether they are paused or waiting
CALL_TIMEOUT_S = 60.0
ACTION_WAIT_S = 40.0
"""The longest an action waits for a live worker's answer (DRLM_STEER_WAIT_S, at most this):
under CALL_TIMEOUT_S with the look at who runs the episode before it."""
QUERY_TIMEOUT_S = 5.0  # a busy worker's answer to the progress query: the page shows without it
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


# --- the routes ---------------------------------------------------------------------------


def static_asset(name: str) -> str:
    """One of STATIC, read from beside this module wherever the package is installed."""
    return resources.files(__package__).joinpath("static", name).read_text()


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
        self.cancels_running: set[asyncio.Future[Any]] = set()  # `drlm cancel`s still at work

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
        text = static_asset(name)
        if name == "page.css":
            return PageResponse(200, "text/css; charset=utf-8", (text + self.renderer.style()).encode())
        return PageResponse(200, "text/javascript; charset=utf-8", text.encode())

    async def _snapshot(self, episode_id: str, base: str) -> dict[str, Any]:
        client = await self.client()
        timeline = await episode_timeline(client, episode_id)
        progress = None
        if timeline.status == "running":
            unattended = await unattended_episodes(client, [episode_id], self.settings.data_dir)
            timeline.unattended = episode_id in unattended
        if timeline.status == "running" and not timeline.unattended:
            try:
                progress = await asyncio.wait_for(progress_of(client, episode_id), QUERY_TIMEOUT_S)
            except (RPCError, TimeoutError):
                progress = None  # its worker is busy: the history still shows
        body = TimelineView(self.renderer, base).body(timeline, progress)
        pending = progress.pending_cell if progress is not None else None
        return {
            "episode_id": episode_id,
            "status": timeline.status,
            "running": timeline.status == "running",
            "unattended": timeline.unattended,
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
        """Which running episodes wait for a person (paused, or a cell awaiting approval) or
        for a worker (none runs them)."""
        client = await self.client()
        unattended = await unattended_episodes(client, episode_ids, self.settings.data_dir)

        async def one(episode_id: str) -> tuple[str, str]:
            if episode_id in unattended:
                return episode_id, unattended_line(episode_id)
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
    if episode_id in await unattended_episodes(client, [episode_id], pages.settings.data_dir):
        return await _act_unattended(pages, episode_id, action, sender, reason, form)
    wait_s = min(pages.settings.steer_wait_s, ACTION_WAIT_S)
    sent = asyncio.ensure_future(_steer(client, episode_id, action, sender, reason, form))
    await asyncio.wait({sent}, timeout=wait_s)
    if not sent.done() or _unanswered(sent):
        # A live worker that does not answer (stopped, or its loop held up): said as `drlm`
        # says it, before the page's own call gives up (CALL_TIMEOUT_S). The SDK ends a
        # cancelled update wait with an error of its own, taken here.
        sent.cancel()
        sent.add_done_callback(lambda done: done.cancelled() or done.exception())
        return {"accepted": False, "message": unanswered_line(episode_id, action, wait_s)}
    outcome = sent.result()
    return {"accepted": outcome.accepted, "message": outcome.message}


def _unanswered(sent: asyncio.Future[Any]) -> bool:
    """Whether a finished send ended because the server stopped waiting for the worker."""
    return not sent.cancelled() and isinstance(sent.exception(), WorkflowUpdateRPCTimeoutOrCancelledError)


async def _steer(
    client: Client, episode_id: str, action: str, sender: str, reason: str, form: dict[str, Any]
) -> Any:
    """The action sent to the worker that runs the episode: its outcome (`accepted`,
    `message`)."""
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
    return outcome


UNATTENDED_CANCEL_S = 45.0
"""How long the page waits for `drlm cancel` of an episode no worker runs (seconds): under
the page's own CALL_TIMEOUT_S. The command may take longer (it runs the episode until the
cancel has ended it, each of its waits bounded): it goes on, and the page says so."""


async def _act_unattended(
    pages: EpisodePages, episode_id: str, action: str, sender: str, reason: str, form: dict[str, Any]
) -> dict[str, Any]:
    """No worker runs the episode, and the page's process runs none: a cancel is handed to
    `drlm cancel`, which runs the episode until it has ended cancelled (an update sent here
    would wait for a worker, and the page with it); any other action waits for a worker,
    and the page says how to give it one."""
    if action != "cancel":
        return {"accepted": False, "message": f"{unattended_line(episode_id)}, then act on it"}
    if form.get("extract"):
        return {"accepted": False, "message": f"{unattended_line(episode_id)}: an extraction needs it"}
    why = f"cancelled by {sender} from the episode page" + (f": {reason}" if reason else "")
    env = {**os.environ, "DRLM_DATA_DIR": str(pages.settings.data_dir)}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "durable_rlm.cli", "cancel", episode_id, "--reason", why[:200],
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    finishing = asyncio.ensure_future(process.communicate())
    await asyncio.wait({finishing}, timeout=UNATTENDED_CANCEL_S)
    if not finishing.done():
        # Killed now, it would leave the episode unattended again, its cancel perhaps taken:
        # it goes on, read to its end (a pipe nobody reads would stop it).
        pages.cancels_running.add(finishing)
        finishing.add_done_callback(pages.cancels_running.discard)
        return {
            "accepted": False,
            "message": f"drlm cancel {episode_id} (process {process.pid}) is still running the episode "
            f"to its end: `drlm watch {episode_id}` shows whether it ends",
        }
    _, said = finishing.result()
    lines = said.decode(errors="replace").strip().splitlines()
    return {"accepted": process.returncode == 0, "message": " ".join(lines[:3])[:500]}
