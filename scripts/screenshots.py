"""Screenshots for the docs, as headless Chromium renders them: our episode page and list
(docs/episode-page.png, episode-page-tree.png, episode-page-pending.png, episode-list.png),
and the embedded server's Temporal Web UI (docs/ui-episode.png, ui-timeline.png, ui-list.png).

    .venv/bin/python scripts/screenshots.py

The test suite writes none of them (its browser tests shoot into temporary directories).
The episodes run against scripted models (the README's demo, and a small tree with a child
episode and a cell waiting for approval), so the pictures are the same on every machine.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from durable_rlm import demo  # noqa: E402
from durable_rlm.api import DurableRLM  # noqa: E402
from durable_rlm.ports import free_port  # noqa: E402
from durable_rlm.scripted import ChatRequest, ScriptedModelServer  # noqa: E402
from durable_rlm.server.embedded import ServerFiles  # noqa: E402
from durable_rlm.settings import Settings  # noqa: E402

DOCS = ROOT / "docs"


def shoot(url: str, out: Path, size: str = "1400,1000") -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("chromium is not installed (apt-get install chromium)")
    subprocess.run(
        [
            chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            f"--window-size={size}", "--virtual-time-budget=15000", f"--screenshot={out}", url,
        ],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    print(f"wrote {out.relative_to(ROOT)}")


async def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="drlm-shots-"))
    settings = Settings(data_dir=work, ui_port=free_port(), server_idle_s=5)
    with ScriptedModelServer(demo.demo_script()) as server:
        rlm = DurableRLM("scripted-rlm", base_url=server.base_url, settings=settings)
        services = await rlm.open()
        try:
            episode = await rlm.start(demo.demo_log(), demo.TASK, "demo-episode")
            await episode.result()
            url = services.episode_url("demo-episode", episode.handle.first_execution_run_id)
            assert url is not None and services.ui is not None
            DOCS.mkdir(exist_ok=True)
            shoot(url, DOCS / "ui-episode.png")
            shoot(url.removesuffix("/history") + "/timeline", DOCS / "ui-timeline.png")
            shoot(f"{services.ui}/namespaces/default/workflows", DOCS / "ui-list.png", "1400,500")
            await our_pages(rlm, settings, server.base_url)
        finally:
            await rlm.close()
    shutil.rmtree(work, ignore_errors=True)


def shoot_live(url: str, element: str, out: Path) -> None:
    """A running episode's page (it polls for ever, so Chromium's --screenshot never sees it
    idle), through the DevTools protocol as the browser tests drive it: `element` in view."""
    from tests.test_episode_page import Chromium  # start-up: the tests' browser driver, this path only

    chromium = Chromium(width=1400, height=1000)
    try:
        chromium.go(url)
        chromium.wait_for(f"document.querySelector({json.dumps(element)})")
        chromium.js(f"document.querySelector({json.dumps(element)}).scrollIntoView()")
        time.sleep(1.0)  # the page's first poll has redrawn it
        chromium.screenshot(out)
    finally:
        chromium.close()
    print(f"wrote {out.relative_to(ROOT)}")


TREE_TURNS = {
    "scripted-rlm": [
        "Let me look first.\n```repl\nlines = context.splitlines()\nprint(len(lines), 'lines')\n```",
        "A child counts the errors.\n```repl\nn = rlm_query('count the ERROR lines', model='child-m')\n"
        "print('child said', n)\n```",
        "```repl\nopen('note.txt', 'w').write(n)\n```",  # writes a file: it waits for approval
        "FINAL(the child counted the errors)",
    ],
    "child-m": ["```repl\nprint(42)\n```", "FINAL(42)"],
}


async def our_pages(rlm: DurableRLM, settings: Settings, demo_url: str) -> None:
    """Our page of the demo episode, a tree with a child whose risky cell waits, and the list."""

    def tree(request: ChatRequest) -> str:
        turns = TREE_TURNS.get(request.model, TREE_TURNS["scripted-rlm"])
        return turns[min(request.turn, len(turns) - 1)] if request.is_root else request.last_user.upper()

    base = str((ServerFiles.of(settings).read_state() or {})["codec"])
    shoot(f"{base}/episodes/demo-episode", DOCS / "episode-page.png", "1400,1400")
    with ScriptedModelServer(tree) as server:
        steered = DurableRLM(
            "scripted-rlm", base_url=server.base_url, other_models=["child-m"], max_depth=2,
            approve="risky", settings=settings,
        )  # fmt: skip
        await steered.open()
        try:
            task = "Count the ERROR lines, with a child's help."
            await steered.start(demo.demo_log(), task, "tree-episode")
            await asyncio.sleep(8)  # the child answers; the risky cell waits for a person
            page = f"{base}/episodes/tree-episode"
            for url, element, name in (
                (page, "#iteration-2 details.child", "episode-page-tree.png"),
                (page, "#timeline .pending-cell", "episode-page-pending.png"),
                (f"{base}/episodes", "table.episodes", "episode-list.png"),
            ):
                await asyncio.to_thread(shoot_live, url, element, DOCS / name)
        finally:
            await steered.close()


if __name__ == "__main__":
    asyncio.run(main())
    sys.stdout.flush()
    os._exit(0)  # temporalio can crash at interpreter exit (sdk-python#300)
