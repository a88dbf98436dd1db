"""Capture the audit screens of docs/guides/audit-and-cost.md from a real episode: `drlm watch` mid-episode,
`drlm show` after it, and a SQL query over the audit tables.

    python scripts/audit_screens.py > /tmp/screens.md

The demo episode (durable_rlm/demo.py) runs on the embedded server against the scripted
model, named gpt-4o-mini so the shipped price table prices it; a data directory of its own.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile

from rich.console import Console


async def main() -> None:
    os.environ["DRLM_DATA_DIR"] = tempfile.mkdtemp(prefix="drlm-screens-")
    os.environ["DRLM_SERVER_IDLE_S"] = "1"
    from durable_rlm.api import DurableRLM
    from durable_rlm.audit.timeline import episode_timeline, render
    from durable_rlm.demo import TASK, demo_log, demo_script
    from durable_rlm.scripted import Reply, ScriptedModelServer
    from durable_rlm.viewer.live import frame

    script = demo_script()

    def slower(request):  # noqa: ANN001, ANN202 - the root's second turn takes a moment
        reply = script(request)
        if request.is_root and request.turn == 2:
            return Reply(text=reply if isinstance(reply, str) else reply.text, delay_s=2)
        return reply

    server = ScriptedModelServer(slower).start()
    rlm = DurableRLM(
        "gpt-4o-mini",
        base_url=server.base_url,
        limits={"max_iterations": 10, "max_tokens": 60_000, "max_cost_usd": 0.05},
        api_key="unused",
    )
    async with rlm:
        episode = await rlm.start(demo_log(), root_prompt=TASK)
        while len([r for r in server.requests if r.is_root]) < 3:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        progress = await episode.progress()
        console = Console(record=True, width=100, force_terminal=False, file=open(os.devnull, "w"))
        console.print(frame(episode.id, progress))
        watch = console.export_text()
        await episode.result()
        services = await rlm.open()
        shown = render(await episode_timeline(services.client, episode.id), width=300)
        engine = services.engine
        assert engine is not None
        import sqlalchemy as sa

        query = (
            "SELECT call_id, role, model, prompt_tokens AS tokens_in, completion_tokens AS tokens_out,\n"
            "       printf('%.6f', cost_usd) AS cost_usd, printf('%.3f', latency_s) AS latency_s\n"
            "FROM audit_model_calls WHERE episode_id = :episode ORDER BY started_at"
        )
        with engine.connect() as conn:
            result = conn.execute(sa.text(query), {"episode": episode.id})
            header = list(result.keys())
            rows = [[str(v) for v in row] for row in result]
    server.stop()
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    table = [" | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    table.append("-+-".join("-" * w for w in widths))
    table += [" | ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in rows]
    out = sys.stdout
    out.write(f"### drlm watch {episode.id} (mid-episode)\n\n```\n{watch.rstrip()}\n```\n\n")
    out.write(f"### drlm show {episode.id}\n\n```\n{shown.rstrip()}\n```\n\n")
    out.write(f"### SQL\n\n```sql\n{query.replace(':episode', repr(episode.id))};\n```\n\n```\n")
    out.write("\n".join(table) + "\n```\n")
    out.flush()
    os._exit(0)  # sdk-python#300


if __name__ == "__main__":
    asyncio.run(main())
