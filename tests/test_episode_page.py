"""The episode page (durable_rlm/viewer/episode_page.py), served by the shared server's
supervisor beside its codec server, read and steered by a real browser (its screenshots go
to a temporary directory; scripts/screenshots.py makes the ones in docs/).

Episodes run for real (embedded server, in-process worker, the scripted OpenAI-compatible
server); the page is fetched over HTTP from the supervisor, and headless Chromium (Debian's
`chromium`; `.ci/run` installs it) is driven over the DevTools protocol on a pipe: it reads
the pages, clicks Approve on a pending cell and sees the cell run.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import re
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from durable_rlm.api import DurableRLM
from durable_rlm.audit.timeline import Timeline, describe_execution, episode_timeline, fork_line
from durable_rlm.ports import free_port, wait_listening
from durable_rlm.scripted import SCRIPTED_SUMMARY, ChatRequest, Reply
from durable_rlm.server.embedded import ServerFiles
from durable_rlm.settings import Settings
from tests.test_viewer import browser

ROOT = Path(__file__).resolve().parents[1]
HOSTILE = "<script>alert('pwned')</script><img src=x onerror=alert(1)>"
PRINT_BIG = "```repl\nchunk = 'x' * 6000\nprint(chunk)\n```"
ROOT_TURNS = [
    "Let me **look** at the task first.\n\n```repl\nr = llm_query('say hi')\nprint('sub said', r)\n```",
    *[PRINT_BIG] * 5,
    f"A child should do it. {HOSTILE}\n\n```repl\nc = rlm_query('count to three', model='child-m')\n"
    "print('child said', c)\n```",
    "FINAL(the child counted: one two three)",
]


def tree_script(turns: list[str] = ROOT_TURNS) -> Any:
    """Root turns by how many root calls came before (compaction rewrites the history)."""
    counter = itertools.count()

    def script(request: ChatRequest) -> Reply | str:
        if request.is_compaction:
            return SCRIPTED_SUMMARY
        if request.is_root and request.model == "child-m":
            return "FINAL(one two three)"
        if request.is_root:
            return turns[min(next(counter), len(turns) - 1)]
        return request.last_user.upper()

    return script


@contextlib.asynccontextmanager
async def session(tmp_path: Path, base_url: str, **options: Any) -> Any:
    settings = Settings(data_dir=tmp_path, ui_port=free_port(), server_idle_s=30)
    rlm = DurableRLM("root-m", base_url=base_url, other_models=["child-m"], settings=settings, **options)
    services = await rlm.open()
    try:
        yield rlm, services, settings
    finally:
        await rlm.close()


def page_base(settings: Settings) -> str:
    """The codec endpoint (with its capability) the supervisor wrote into state.json."""
    state = ServerFiles.of(settings).read_state()
    assert state is not None and state.get("codec"), state
    assert wait_listening(str(state["codec"]), 30), "the supervisor's pages never listened"
    return str(state["codec"])


def fetch(url: str, data: bytes | None = None, headers: dict[str, str] | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


class _Text(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []

    def handle_data(self, data: str) -> None:
        self.parts.append(data)


def text_of(page: str) -> str:
    parser = _Text()
    parser.feed(page)
    return "".join(parser.parts)


def show_items(timeline: Timeline) -> Iterator[str]:
    """Each thing `drlm show` prints about an episode, as text a reader must find on its page."""
    yield timeline.episode_id
    yield timeline.task
    if timeline.request is not None and timeline.request.fork is not None:
        yield fork_line(timeline.request.fork)
    if timeline.failure:
        yield timeline.failure
    for it in timeline.iterations:
        yield f"Iteration {it.iteration}"
        yield from it.compactions
        yield it.model_error or ""
        if it.response is not None:
            yield it.response
        for cell in it.cells:
            yield f"cell {cell.cell_index}"
            yield cell.code
            yield from (x for x in (cell.stdout, cell.stderr, cell.error) if x)
            for call in cell.sub_calls:
                yield call.prompt
                yield call.reply or ""
                yield call.error or ""
            if cell.rebuild is not None:
                yield from cell.rebuild.notes
                yield f"{cell.rebuild.cells_rerun} cell(s) re-run"
            if cell.snapshot is not None:
                yield f"snapshot after this cell: {cell.snapshot.size:,} bytes"
            for child in cell.children:
                yield child.episode_id
                if child.timeline is not None and child.timeline.result is not None:
                    yield f"answer: {child.timeline.result.answer}"
    for action in timeline.actions:
        yield action.kind
        yield action.detail
    r = timeline.result
    if r is not None:
        yield r.answer if r.answer is not None else "(no answer)"
        yield from (r.ended_by, r.stop_reason, f"{r.iterations} iteration(s)", r.error or "")
        if r.termination is not None:
            yield r.termination.reason
        if r.execution is not None:
            yield describe_execution(r.execution, r.status)
        yield f"{r.usage.total_tokens:,} tokens"


async def test_the_page_shows_everything_drlm_show_prints_and_only_to_its_owner(
    tmp_path: Path, scripted
) -> None:
    server = scripted(tree_script(), context_window_tokens=6_000)
    async with session(
        tmp_path, server.base_url, max_depth=2, sampling={"max_tokens": 500}, context_window_tokens=6_000
    ) as (rlm, services, settings):
        episode = await rlm.start("numbers", "Count to three, with help.", "paged-tree")
        result = await episode.result()
        assert result.answer == "the child counted: one two three"
        assert result.compactions >= 1 and len(result.children) == 1
        timeline = await episode_timeline(services.client, "paged-tree")
        base = page_base(settings)
        status, page = fetch(f"{base}/episodes/paged-tree")
        child_id = result.children[0].episode_id
        child_status, child_page = fetch(f"{base}/episodes/{urllib.parse.quote(child_id, safe='')}")
        list_status, listing = fetch(f"{base}/episodes?q=count+to+three")
        none_status, none = fetch(f"{base}/episodes?q=no+such+task")
        secretless = fetch(base.rsplit("/", 1)[0] + "/episodes/paged-tree")[0]
        # An action must come from the page itself (its origin, a JSON body).
        act = f"{base}/episodes/paged-tree/act/hint"
        body = json.dumps({"text": "hello"}).encode()
        no_origin = fetch(act, body, {"Content-Type": "application/json"})
        other_origin = fetch(act, body, {"Content-Type": "application/json", "Origin": "http://evil.example"})
        port = base.split(":")[2].split("/")[0]
        ours = {"Content-Type": "application/json", "Origin": f"http://127.0.0.1:{port}"}
        as_form = fetch(act, body, {**ours, "Content-Type": "text/plain"})
        ended = fetch(act, body, ours)
        # Every script and style the page links is served (a moved asset once left it inert).
        origin = base.split("/", 3)[:3]
        assets = re.findall(r'<(?:script src|link rel="stylesheet" href)="([^"]+)"', page)
        served = {asset: fetch("/".join(origin) + asset) for asset in assets}

    assert len(assets) == 2 and all(answer[0] == 200 and answer[1] for answer in served.values()), served
    assert "setTimeout(poll" in served[assets[-1]][1]
    assert status == 200 and child_status == 200 and list_status == 200 and none_status == 200
    text = text_of(page)
    missing = [item for item in show_items(timeline) if item.strip() not in text]
    assert not missing, missing
    assert "compacted" in text and SCRIPTED_SUMMARY in text
    # The reply is rendered Markdown, and the model's HTML stays text.
    assert "<strong>look</strong>" in page
    assert "<script>alert" not in page and "<img src=x" not in page
    assert "&lt;script&gt;alert(&#x27;pwned&#x27;)&lt;/script&gt;" in page
    # Code is highlighted; the child is a link to its own page; budgets are bars.
    assert '<div class="hl">' in page and "<meter" in page
    assert f'href="/{base.rsplit("/", 1)[1]}/episodes/{urllib.parse.quote(child_id, safe="")}"' in page
    assert "one two three" in text_of(child_page) and "child of" in text_of(child_page)
    assert 'data-episode="paged-tree"' in listing and "Count to three, with help." in listing
    assert 'data-episode="paged-tree"' not in none
    assert secretless == 404
    assert no_origin[0] == 403 and other_origin[0] == 403 and as_form[0] == 403
    assert ended[0] == 200 and json.loads(ended[1])["accepted"] is False  # it had ended: refused


# --- a real browser -------------------------------------------------------------------------


class Chromium:
    """Headless Chromium driven over the DevTools protocol on a pipe (fds 3 and 4)."""

    def __init__(self, width: int = 1200, height: int = 1400) -> None:
        to_chrome_r, self._out = os.pipe()
        self._in, from_chrome_w = os.pipe()

        def fds() -> None:
            os.dup2(to_chrome_r, 3)
            os.dup2(from_chrome_w, 4)

        self.process = subprocess.Popen(
            [
                browser(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--remote-debugging-pipe", f"--window-size={width},{height}", "about:blank",
            ],
            preexec_fn=fds, close_fds=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._ids = itertools.count(1)
        self._answers: dict[int, dict[str, Any]] = {}
        self._arrived = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Page.enable", session=True)

    def _read(self) -> None:
        buffer = b""
        while chunk := os.read(self._in, 1 << 16):
            buffer += chunk
            *messages, buffer = buffer.split(b"\0")
            for raw in messages:
                message = json.loads(raw)
                if "id" in message:
                    with self._arrived:
                        self._answers[message["id"]] = message
                        self._arrived.notify_all()

    def call(self, method: str, session: bool = False, **params: Any) -> dict[str, Any]:
        number = next(self._ids)
        message: dict[str, Any] = {"id": number, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self._out, json.dumps(message).encode() + b"\0")
        with self._arrived:
            assert self._arrived.wait_for(lambda: number in self._answers, 60), method
            answer = self._answers.pop(number)
        assert "error" not in answer, answer
        return answer["result"]

    def go(self, url: str) -> None:
        self.call("Page.navigate", session=True, url=url)
        self.wait_for("document.readyState === 'complete'")

    def js(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", session=True, expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")

    def wait_for(self, condition: str, within_s: float = 60) -> None:
        deadline = time.monotonic() + within_s
        # False while a navigation has no document yet.
        while not self.js(
            f"(() => {{ try {{ return Boolean({condition}); }} catch (e) {{ return false; }} }})()"
        ):
            if time.monotonic() >= deadline:
                # What a person would have seen, and what the page's own poll would have read.
                shown = self.js("document.body ? document.body.innerText : ''")
                polled = self.js(
                    "(() => { const x = new XMLHttpRequest();"
                    " x.open('GET', location.pathname + '/state.json', false); x.send();"
                    " return x.status + ' ' + x.responseText.slice(0, 300); })()"
                )
                seen = f"{shown[-2000:]}\n{polled}"
                raise AssertionError(f"the page never showed: {condition}; it showed:\n{seen}")
            time.sleep(0.25)

    def click(self, selector: str) -> None:
        """A mouse click where the element is, as a person makes it."""
        box = self.js(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)}); e.scrollIntoView();"
            " const r = e.getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        for kind in ("mousePressed", "mouseReleased"):
            self.call(
                "Input.dispatchMouseEvent", session=True, type=kind, x=box[0], y=box[1],
                button="left", clickCount=1,
            )  # fmt: skip

    def screenshot(self, path: Path) -> None:
        shot = self.call("Page.captureScreenshot", session=True, format="png", captureBeyondViewport=False)
        path.write_bytes(base64.b64decode(shot["data"]))

    def close(self) -> None:
        self.process.kill()
        self.process.wait(10)
        os.close(self._out)


APPROVED_CODE = "print('approved and ran:', 6 * 7)"
RISKY_CODE = "open('answer.txt', 'w').write('42')\n" + APPROVED_CODE  # a file write: it waits
RUNNING_TURNS = [
    "```repl\nc = rlm_query('count to three', model='child-m')\nprint('child said', c)\n```",
    *[PRINT_BIG] * 5,
    f"```repl\n{RISKY_CODE}\n```",
    "FINAL(approved from the page)",
]


async def test_a_browser_reads_a_finished_tree_and_approves_a_pending_cell(tmp_path: Path, scripted) -> None:
    browser()
    server = scripted(tree_script(), context_window_tokens=6_000)
    docs = tmp_path  # the suite writes nothing of the repository's: scripts/screenshots.py makes docs/*.png
    async with session(
        tmp_path, server.base_url, max_depth=2, sampling={"max_tokens": 500}, context_window_tokens=6_000
    ) as (rlm, services, settings):
        episode = await rlm.start("numbers", "Count to three, with help.", "browsed-tree")
        await episode.result()
        base = page_base(settings)

        def read_finished() -> dict[str, Any]:
            chromium = Chromium()
            try:
                chromium.go(f"{base}/episodes/browsed-tree")
                chromium.wait_for("document.querySelector('.ending .answer')")
                found = chromium.js(
                    "({text: document.body.innerText,"
                    " cells: document.querySelectorAll('.cell .code .hl').length,"
                    " subcalls: document.querySelectorAll('details.subcall').length,"
                    " children: [...document.querySelectorAll('details.child a')].map(a => a.href),"
                    " compactions: document.querySelectorAll('.compaction').length,"
                    " meters: document.querySelectorAll('.budgets meter').length,"
                    " lanes: [...document.querySelectorAll('svg.plot-steps rect.step')]"
                    ".map(r => r.dataset.lane),"
                    " usage: document.querySelectorAll('svg.plot-usage rect.usage[data-kind=prompt]').length,"
                    " strong: document.querySelector('.markdown strong')?.textContent,"
                    " scripts: document.scripts.length,"
                    " controls: document.getElementById('controls').hidden})"
                )
                chromium.screenshot(docs / "episode-page.png")
                chromium.js("document.querySelector('details.child').scrollIntoView()")
                chromium.screenshot(docs / "episode-page-tree.png")
                chromium.click("details.child a")
                chromium.wait_for("document.body.innerText.includes('child of')")
                found["child_page"] = chromium.js("document.body.innerText")
                return found
            finally:
                chromium.close()

        finished = await asyncio.to_thread(read_finished)

    # A running episode, with a child and compactions, whose risky cell waits for a person.
    server2 = scripted(tree_script(RUNNING_TURNS), context_window_tokens=6_000)
    async with session(
        tmp_path,
        server2.base_url,
        approve="risky",
        max_depth=2,
        sampling={"max_tokens": 500},
        context_window_tokens=6_000,
    ) as (rlm, services, settings):
        episode = await rlm.start("numbers", "Print the answer, once approved.", "waiting-one")
        base = page_base(settings)

        def approve_in_page() -> dict[str, Any]:
            chromium = Chromium()
            try:
                chromium.go(f"{base}/episodes/waiting-one")
                chromium.wait_for("!document.getElementById('pending').hidden")  # polled in, no reload
                seen: dict[str, Any] = chromium.js(
                    "({code: document.getElementById('pending-code').value,"
                    " badge: document.body.innerText.includes('waits for approval'),"
                    " in_timeline: document.querySelector('#timeline .pending-cell')?.innerText,"
                    " children: document.querySelectorAll('#timeline details.child a').length,"
                    " compactions: document.querySelectorAll('#timeline .compaction').length})"
                )
                chromium.js("document.querySelector('#timeline .pending-cell').scrollIntoView()")
                chromium.screenshot(docs / "episode-page-pending.png")
                # The list marks it: a cell waits for a person.
                chromium.go(f"{base}/episodes")
                seen["listed"] = chromium.js(
                    "document.querySelector('tr[data-episode=\"waiting-one\"]').className + ' ' +"
                    " document.querySelector('tr[data-episode=\"waiting-one\"]').innerText"
                )
                chromium.screenshot(docs / "episode-list.png")
                chromium.js("document.querySelector('input[name=q]').value = 'once approved'")
                chromium.click("form.search button")
                chromium.wait_for("location.search.includes('q=once+approved')")
                seen["found"] = chromium.js(
                    "[...document.querySelectorAll('tr[data-episode]')].map(r => r.dataset.episode)"
                )
                chromium.go(f"{base}/episodes/waiting-one")
                chromium.wait_for("!document.getElementById('pending').hidden")
                chromium.js("window.marker = 'same page'")  # gone if the page reloads
                chromium.click("#approve")
                chromium.wait_for("document.body.innerText.includes('approved and ran: 42')")
                chromium.wait_for("document.body.innerText.includes('approved from the page')")
                seen["same_page"] = chromium.js("window.marker")
                seen["text"] = chromium.js("document.body.innerText")
                return seen
            finally:
                chromium.close()

        approved = await asyncio.to_thread(approve_in_page)
        result = await episode.result()

    text = finished["text"]
    assert "Count to three, with help." in text and "the child counted: one two three" in text
    assert finished["cells"] >= 4 and finished["subcalls"] == 1 and finished["compactions"] >= 1
    assert finished["meters"] >= 3 and finished["strong"] == "look"
    # The plots: every lane drawn (a root call, cells, a cell's sub-call, the child), a stack per iteration.
    assert {"root model", "cells", "sub-calls", "children"} <= set(finished["lanes"]), finished["lanes"]
    assert finished["usage"] >= 2
    assert len(finished["children"]) == 1 and finished["controls"] is True
    assert "alert('pwned')" in text and finished["scripts"] == 2  # the model's <script> is text
    assert "one two three" in finished["child_page"]
    assert RISKY_CODE in approved["code"] and approved["badge"]
    assert approved["children"] == 1 and approved["compactions"] >= 1
    assert approved["same_page"] == "same page"
    assert approved["found"] == ["waiting-one"]  # searched by task text, in the browser
    assert RISKY_CODE in approved["in_timeline"] and "writes a file" in approved["in_timeline"]
    assert "attention" in approved["listed"] and "waits for approval" in approved["listed"]
    assert result.answer == "approved from the page"
    from durable_rlm.client.steering import default_sender

    assert f"approve by {default_sender()}".lower() in approved["text"].lower()


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """urllib must reach 127.0.0.1 directly."""
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")


@pytest.mark.slow  # long end to end (the default run stays near 13 minutes); CI runs it
async def test_an_open_page_keeps_the_shared_server_up(tmp_path: Path, scripted) -> None:
    """`drlm ui` prints the address and exits: the page's own requests hold the server."""
    server = scripted(lambda request: "FINAL(kept)")
    settings = Settings(data_dir=tmp_path, ui_port=free_port(), server_idle_s=1)
    rlm = DurableRLM("root-m", base_url=server.base_url, settings=settings)
    await rlm.open()
    try:
        await (await rlm.start("c", "Say kept.", "kept-up")).result()
        base = page_base(settings)
        assert fetch(f"{base}/episodes/kept-up")[0] == 200  # the page is opened
    finally:
        await rlm.close()  # the last client's lease goes
    await asyncio.sleep(4)  # four idle periods: without the page's lease the server stops in one
    status, page = fetch(f"{base}/episodes/kept-up")
    assert status == 200 and "kept" in text_of(page)
    # The lease is the supervisor's own: it counts only while the supervisor lives.
    supervisor = ServerFiles.of(settings).read_state()["pid"]
    leases = [p.name for p in ServerFiles.of(settings).live_leases()]
    assert [name.split("-")[0] for name in leases if name.endswith("-episode-page")] == [str(supervisor)]


async def test_each_action_of_the_page_reaches_the_episode_with_its_sender(tmp_path: Path, scripted) -> None:
    """Hint, limits, pause, resume, reject and cancel, POSTed as the page does: each is the
    CLI's update, recorded in history with the name the page gave."""
    server = scripted(lambda request: f"```repl\n{APPROVED_CODE}\n```")
    async with session(tmp_path, server.base_url, approve="all") as (rlm, services, settings):
        episode = await rlm.start("c", "Wait for a person.", "steered")
        base = page_base(settings)
        port = base.split(":")[2].split("/")[0]
        headers = {"Content-Type": "application/json", "Origin": f"http://127.0.0.1:{port}"}

        def post(action: str, **form: Any) -> dict[str, Any]:
            status, body = fetch(
                f"{base}/episodes/steered/act/{action}",
                json.dumps({"sender": "ada", **form}).encode(),
                headers,
            )
            assert status == 200, body
            return json.loads(body)

        async def waiting() -> None:
            while (await services.client.get_workflow_handle("steered").query("progress")).get(
                "pending_cell"
            ) is None:
                await asyncio.sleep(0.2)

        await asyncio.wait_for(waiting(), 60)
        outcomes = {
            "hint": await asyncio.to_thread(post, "hint", text="look at the tail"),
            "limits": await asyncio.to_thread(post, "limits", max_iterations="7", max_cost_usd=""),
            "pause": await asyncio.to_thread(post, "pause", reason="lunch"),
            "resume": await asyncio.to_thread(post, "resume"),
            "reject": await asyncio.to_thread(post, "reject", cell=1, reason="not that"),
        }
        outcomes["cancel"] = await asyncio.to_thread(post, "cancel", reason="enough")
        result = await asyncio.wait_for(episode.result(), 120)
        timeline = await episode_timeline(services.client, "steered")

    assert {k: v["accepted"] for k, v in outcomes.items()} == dict.fromkeys(outcomes, True), outcomes
    assert result.ended_by == "cancelled"
    seen = [(a.kind, a.sender) for a in timeline.actions]
    for kind in ("hint", "limits", "pause", "resume", "reject"):
        assert (kind, "ada") in seen, seen
    assert any(
        a.kind == "cancel" and "cancelled by ada from the episode page: enough" in a.detail
        for a in timeline.actions
    )
    assert any(a.kind == "limits" and "max_iterations=7" in a.detail for a in timeline.actions)


HISTORIES = sorted(p for p in (ROOT / "tests" / "histories").glob("*.json"))


@pytest.mark.parametrize("path", HISTORIES, ids=[p.stem for p in HISTORIES])
async def test_the_page_and_drlm_show_agree_on_every_stored_history(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The recorded histories of tests/histories/ (the replay tests' own) cannot be loaded
    into a Temporal server, so their runs are handed to `episode_timeline` as the server
    would return them; everything else (decoding, the timeline, the page) is the real code."""
    from temporalio.api.enums.v1 import EventType
    from temporalio.client import WorkflowExecutionStatus, WorkflowHistory
    from temporalio.contrib.pydantic import pydantic_data_converter

    from durable_rlm.audit import history, timeline
    from durable_rlm.viewer.page_html import Renderer, TimelineView

    recorded = WorkflowHistory.from_json(path.stem, json.loads(path.read_text()))
    endings = {
        EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED: WorkflowExecutionStatus.COMPLETED,
        EventType.EVENT_TYPE_WORKFLOW_EXECUTION_FAILED: WorkflowExecutionStatus.FAILED,
        EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CANCELED: WorkflowExecutionStatus.CANCELED,
        EventType.EVENT_TYPE_WORKFLOW_EXECUTION_TERMINATED: WorkflowExecutionStatus.TERMINATED,
        EventType.EVENT_TYPE_WORKFLOW_EXECUTION_TIMED_OUT: WorkflowExecutionStatus.TIMED_OUT,
    }
    last = recorded.events[-1]

    async def runs(client: Any, episode_id: str) -> list[history.EpisodeRun]:
        if episode_id != recorded.workflow_id:
            raise LookupError(episode_id)  # a child or a fork's source: recorded apart
        return [
            history.EpisodeRun(
                run_id="recorded",
                status=endings.get(last.event_type, WorkflowExecutionStatus.RUNNING),
                start_time=recorded.events[0].event_time.ToDatetime(),
                close_time=last.event_time.ToDatetime() if last.event_type in endings else None,
                history=recorded,
            )
        ]

    monkeypatch.setattr(timeline, "episode_runs", runs)
    client = type("RecordedClient", (), {"data_converter": pydantic_data_converter})()
    shown = await timeline.episode_timeline(client, recorded.workflow_id)  # type: ignore[arg-type]
    assert timeline.render(shown)  # what `drlm show` prints, from the same model
    page = TimelineView(Renderer(), "/secret").body(shown)
    text = text_of(page)
    missing = [item for item in show_items(shown) if item.strip() not in text]
    assert not missing, missing
    assert "<script" not in page


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, list[tuple[str, str | None]]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, attrs))


PAGE_TAGS = {
    "a", "b", "blockquote", "br", "code", "details", "div", "em", "h1", "h2", "h3", "h4", "h5", "h6",
    "header", "hr", "li", "meter", "ol", "p", "pre", "section", "span", "strong", "summary", "table",
    "td", "th", "tr", "ul",
}  # fmt: skip


def test_hostile_model_text_stays_text_everywhere_on_the_page() -> None:
    """Markup, links, images and script in every string a model or a sandbox writes."""
    from durable_rlm.audit.timeline import CellView, ChildView, IterationView, SubCall
    from durable_rlm.viewer.page_html import Renderer, TimelineView, episode_document

    evil = (
        "<script>alert(1)</script><img src=x onerror=alert(2)> [click](javascript:alert(3)) "
        "![i](http://evil.example/t.png) <http://evil.example> </pre></details><iframe src=//e>"
        ' "><svg onload=alert(4)>'
    )
    cell = CellView(
        cell_index=1, code=evil, stdout=evil, stderr=evil, error=evil, answer=evil,
        sub_calls=[SubCall(call_index=0, prompt=evil, reply=evil, model=evil)],
        children=[ChildView(episode_id=evil, call_index=0, model=evil)],
    )  # fmt: skip
    shown = Timeline(
        episode_id=evil,
        status="running",
        task=evil,
        iterations=[
            IterationView(iteration=1, response=f"# {evil}\n\n```repl\n{evil}\n```\n{evil}", cells=[cell])
        ],
    )
    body = TimelineView(Renderer(), "/secret").body(shown)
    page = episode_document(evil, "/secret", body, {"episode_id": evil, "html": body})
    parser = _Tags()
    parser.feed(page)
    tags = [tag for tag, _ in parser.tags]
    assert set(tags) - PAGE_TAGS == {"html", "head", "meta", "title", "link", "body", "script"}
    assert tags.count("script") == 2  # the page's data (JSON) and its own script file
    for tag, attrs in parser.tags:
        for name, value in attrs:
            assert not name.startswith("on"), (tag, name)
            assert not (value or "").lstrip().lower().startswith(("javascript:", "http:", "//")), (tag, value)
    assert "javascript:alert(3)" in text_of(body) and "alert(1)" in text_of(body)  # shown, as text
    data = page.split('id="page-data">', 1)[1].split("</script>", 1)[0]
    assert json.loads(data)["episode_id"] == evil  # the JSON holds it whole and closes no element
