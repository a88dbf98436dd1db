"""Screenshots of the episode viewer for the README: an episode's page and the episode list,
as headless Chromium renders them from the embedded server's Temporal Web UI.

    .venv/bin/python scripts/screenshots.py        # docs/ui-episode.png, ui-timeline.png, ui-list.png

The episode runs against the scripted model (the README's demo), so the pictures are the
same on every machine.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from durable_rlm import demo  # noqa: E402
from durable_rlm.api import DurableRLM  # noqa: E402
from durable_rlm.ports import free_port  # noqa: E402
from durable_rlm.scripted import ScriptedModelServer  # noqa: E402
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
        finally:
            await rlm.close()
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
    sys.stdout.flush()
    os._exit(0)  # temporalio can crash at interpreter exit (sdk-python#300)
