"""`drlm show`, `drlm list`, `drlm export`, `drlm verify`: what episodes did, read back.

`show` of an ended episode and `list` read the SQL audit store and answer in a fraction of
a second, without temporalio: they reach the server (and set the SDK's Runtime up) only
on the path that needs it, a timeline not stored yet, a persistent session, or `list --refresh`.

A persistent session (workflows/session.py) is one workflow whose turns are episodes
`<session>-turn<k>`: `show <session>` prints it turn by turn, and `list` gives it one line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from types import SimpleNamespace
from typing import Any

from durable_rlm.cli.arguments import moment
from durable_rlm.cli.handlers import Subparsers, bind
from durable_rlm.cli.output import EXIT_OK, stderr
from durable_rlm.settings import ConfigurationError, Settings

ENDINGS = ("answered", "extracted", "no_answer", "failed", "cancelled", "terminated", "timed_out")
"""workflows/models.py's ENDINGS for `list --status` (a test holds them equal): the parser is
built for every command, and importing the models would cost each 0.2 s."""


def _show_parser(sub: Subparsers) -> None:
    show = sub.add_parser(
        "show", help="an episode's timeline from its history, or a persistent session's turns"
    )
    show.add_argument("episode_id", help="an episode's id, or a session's (its turns: <session>-turn<k>)")
    show.add_argument("--json", action="store_true")
    show.add_argument("--full", action="store_true", help="do not shorten long texts")
    show.add_argument(
        "--refresh", action="store_true", help="read the history even if the timeline is stored"
    )
    bind(show, _show, sdk_runtime=False)  # the store first: _timeline_from_history sets it up


def _verify_parser(sub: Subparsers) -> None:
    verify = sub.add_parser(
        "verify", help="check that every blob the histories and the audit store reference is whole"
    )
    verify.add_argument("episode_id", nargs="?", help="one episode and its children")
    verify.add_argument("--all", action="store_true", help="every episode")
    verify.add_argument("--json", action="store_true")
    bind(verify, _verify)


def _export_parser(sub: Subparsers) -> None:
    export = sub.add_parser("export", help="write an episode as an rlms trajectory log or as JSON")
    export.add_argument("episode_id")
    export.add_argument("--format", choices=("rlms", "json"), default="rlms")
    export.add_argument("-o", "--output", help="write to this file (default: standard output)")
    bind(export, _export)


def _list_parser(sub: Subparsers) -> None:
    listing = sub.add_parser(
        "list",
        help="episodes in the audit store, newest first; a persistent session is one line for all its "
        "turns (its status with --refresh; a session is listed once its first turn's row is written)",
    )
    listing.add_argument("--limit", type=int, default=20)
    listing.add_argument(
        "--status",
        choices=("running", *ENDINGS),
        help="running, or how it ended: " + ", ".join(ENDINGS),
    )
    listing.add_argument("--model", help="episodes whose root or sub-model is this one")
    listing.add_argument(
        "--since", type=moment, help="started at or after: 2026-11-24, 2026-11-24T10:00, 24h, 7d"
    )
    listing.add_argument("--until", type=moment, help="started before (same forms)")
    listing.add_argument("--min-cost", type=float, help="USD; episodes of unknown cost are left out")
    listing.add_argument("--max-cost", type=float, help="USD")
    listing.add_argument("--roots", action="store_true", help="leave child episodes out")
    listing.add_argument("--json", action="store_true", help="one JSON object per line")
    listing.add_argument(
        "--refresh",
        action="store_true",
        help="first migrate the store and settle rows of episodes that ended without writing theirs",
    )
    listing.epilog = (
        "A persistent session shows as one line: its turns' episodes (<session>-turn<k>) summed, "
        "its last turn's status and answer; the session's own status needs the server (--refresh). "
        "A session whose turns' rows are not written yet is missing until --refresh settles them."
    )
    bind(listing, _list, sdk_runtime=False)  # the store first: --refresh sets it up


PARSERS = {"show": _show_parser, "verify": _verify_parser, "export": _export_parser, "list": _list_parser}


async def _show(settings: Settings, args: argparse.Namespace) -> int:
    from durable_rlm.audit import readonly  # start-up: the store's reader (~10 ms), not for --help
    from durable_rlm.audit.timeline import render  # start-up: the timeline's models (~0.05 s)

    timeline = None
    if not args.refresh:
        reader = readonly.open_existing(settings)
        if reader is not None:
            with contextlib.closing(reader):
                timeline = readonly.cached_timeline(reader, args.episode_id)
    if timeline is None:
        timeline = await _timeline_from_history(settings, args.episode_id)
    if isinstance(timeline, dict):  # a persistent session
        from durable_rlm.viewer.listing import session_text  # start-up: rich (~20 ms), sessions only

        print(json.dumps(timeline, default=str) if args.json else session_text(timeline, _width(args)))
        return EXIT_OK
    if args.json:  # ASCII: a control or bidirectional character is escaped, not sent
        print(json.dumps(timeline.model_dump(mode="json")))
    else:
        print(render(timeline, width=_width(args)))
    return EXIT_OK


def _width(args: argparse.Namespace) -> int:
    return 10**9 if args.full else 2_000


async def _timeline_from_history(settings: Settings, episode_id: str) -> Any:
    """Read the history (through the server), and keep the timeline if the episode ended;
    a persistent session's id gives the session's view (a dict) instead."""
    from durable_rlm.audit import readonly  # start-up: the store's reader (~10 ms), not for --help
    from durable_rlm.audit.timeline import episode_timeline  # start-up: the timeline's models (~0.05 s)
    from durable_rlm.audit.timeline_store import store_timeline  # start-up: SQLAlchemy, this path
    from durable_rlm.client.attendance import unattended_episodes  # start-up: temporalio, this path
    from durable_rlm.client.sessions import session_overview  # start-up: temporalio, this path
    from durable_rlm.server.connection import connect  # start-up: temporalio, the stores (~0.4 s)
    from durable_rlm.telemetry.log_path import forward_core_logs  # start-up: temporalio, this path

    forward_core_logs()  # before the first client: stdout is the command's own (--json)
    async with connect(settings) as services:
        try:
            overview = await session_overview(services.client, episode_id)
        except LookupError:  # an episode (or an unknown id: episode_timeline says so)
            pass
        else:
            return await _session_view(services, overview)
        timeline = await episode_timeline(services.client, episode_id)
        if timeline.status == "running":
            unattended = await unattended_episodes(services.client, [episode_id], settings.data_dir)
            timeline.unattended = episode_id in unattended
        # Not kept when payloads are encrypted: a stored timeline is clear text at rest.
        if services.engine is not None and timeline.status in readonly.ENDED and not settings.encryption_keys:
            description = await services.client.get_workflow_handle(episode_id).describe()
            await asyncio.to_thread(store_timeline, services.engine, timeline, description.run_id)
    return timeline


async def _session_view(services: Any, overview: Any) -> dict[str, Any]:
    """A session and its turns: each turn from its audit row, or (no row yet) its timeline."""
    from durable_rlm.audit import readonly  # start-up: the store's reader (~10 ms), not for --help
    from durable_rlm.audit.timeline import episode_timeline  # start-up: the timeline's models (~0.05 s)

    session_id = overview.session_id
    description = await services.client.get_workflow_handle(session_id).describe()
    model = await description.memo_value("model", default=None)
    engine = services.engine
    rows = {} if engine is None else {r.episode_id: r for r in readonly.turn_rows(engine, session_id)}
    # Visibility may lag a turn's start by a moment, the store its row: the union of both.
    numbered = {readonly.turn_of(i): i for i in [*overview.episodes, *rows]}
    turns = []
    for (_, k), episode_id in sorted((key, i) for key, i in numbered.items() if key is not None):
        row = rows.get(episode_id)
        if row is not None:
            turns.append(_turn_from_row(k, row))
            continue
        timeline = None if engine is None else readonly.cached_timeline(engine, episode_id)
        if timeline is None:
            timeline = await episode_timeline(services.client, episode_id)
        turns.append(_turn_from_timeline(k, timeline))
    costs = [t["cost_usd"] for t in turns]
    end = overview.end
    return {
        "kind": "session",
        "session_id": session_id,
        "status": overview.status,
        "model": model,
        "ended_by": end.ended_by if end is not None else None,
        "reason": end.reason if end is not None else None,
        "tokens": sum(t["tokens"] or 0 for t in turns),
        "cost_usd": None if any(c is None for c in costs) else sum(costs),
        "turns": turns,
    }


def _turn_from_row(k: int, row: Any) -> dict[str, Any]:
    tokens = None if row.prompt_tokens is None else row.prompt_tokens + (row.completion_tokens or 0)
    return {
        "turn": k,
        "episode_id": row.episode_id,
        "status": row.status,
        "task": row.task,
        "answer": row.answer,
        "ended_by": row.ended_by,
        "error": row.error,
        "iterations": row.iterations,
        "model_calls": row.model_calls,
        "prompt_tokens": row.prompt_tokens,
        "completion_tokens": row.completion_tokens,
        "tokens": tokens,
        "cost_usd": row.cost_usd,
        "started_at": row.started_at,
        "ended_at": row.ended_at,
    }


def _turn_from_timeline(k: int, timeline: Any) -> dict[str, Any]:
    result = timeline.result
    usage = result.usage if result is not None else None
    return {
        "turn": k,
        "episode_id": timeline.episode_id,
        "status": timeline.status,
        "task": timeline.task,
        "answer": result.answer if result is not None else None,
        "ended_by": result.ended_by if result is not None else None,
        "error": (result.error if result is not None else None) or timeline.failure,
        "iterations": result.iterations if result is not None else len(timeline.iterations),
        "model_calls": result.model_calls if result is not None else None,
        "prompt_tokens": usage.prompt_tokens if usage is not None else None,
        "completion_tokens": usage.completion_tokens if usage is not None else None,
        "tokens": usage.total_tokens if usage is not None else None,
        "cost_usd": usage.cost_usd if usage is not None else None,
        "started_at": timeline.started_at,
        "ended_at": timeline.ended_at,
    }


async def _verify(settings: Settings, args: argparse.Namespace) -> int:
    from durable_rlm.audit.verify import verify_command  # start-up: temporalio, the stores (~0.5 s)

    if (args.episode_id is None) == (not args.all):
        raise ConfigurationError("give an episode id or --all")
    return await verify_command(settings, args.episode_id, args.json)


async def _export(settings: Settings, args: argparse.Namespace) -> int:
    from durable_rlm.viewer.export import export_command  # start-up: temporalio, the stores (~0.4 s)

    return await export_command(settings, args.episode_id, args.format, args.output)


async def _list(settings: Settings, args: argparse.Namespace) -> int:
    """From the audit store alone (no server). Rows of episodes that ended without writing
    theirs (terminated, timed out) are settled by every worker each minute, by the shared
    server before it stops, and here with --refresh."""
    from durable_rlm.audit import readonly  # start-up: the store's reader (~10 ms), not for --help

    if args.refresh:
        from durable_rlm.audit.projection import reconcile_audit  # start-up: the audit writer (~0.6 s)
        from durable_rlm.server.connection import connect  # start-up: temporalio, the stores (~0.4 s)
        from durable_rlm.telemetry.log_path import forward_core_logs  # start-up: temporalio, --refresh only

        forward_core_logs()  # before the first client: stdout is the command's own (--json)
        async with connect(settings) as services:
            assert services.engine is not None
            try:
                await reconcile_audit(services.client, services.engine)
            except Exception as exc:  # noqa: BLE001 - a store that cannot be written: list what it holds
                stderr(f"drlm: rows not settled (the store refused the write): {type(exc).__name__}")
    reader = readonly.open_existing(settings)
    where = readonly.EpisodeFilter(
        status=args.status,
        model=args.model,
        since=args.since,
        until=args.until,
        min_cost=args.min_cost,
        max_cost=args.max_cost,
        roots_only=args.roots,
    )
    rows: list[Any] = []
    if reader is not None:
        with contextlib.closing(reader):
            rows = readonly.grouped_rows(reader, args.limit, where)
    if args.refresh and rows:
        rows = await _with_live_status(settings, rows)
    unattended = await _unattended_rows(settings, rows)
    if args.json:
        for row in rows:
            line = row.summary() if isinstance(row, readonly.SessionRows) else dict(row._mapping)
            if line.get("episode_id") in unattended:
                line["worker"] = "none"
            print(json.dumps(line, default=str))
        return EXIT_OK
    if not rows:
        stderr("no episodes" + (" match these filters" if where.active else " in the audit store yet"))
        return EXIT_OK
    from durable_rlm.audit.timeline import unattended_line  # start-up: the timeline's models (~0.05 s)
    from durable_rlm.viewer.listing import episode_table, print_table  # start-up: rich (~20 ms), rows only

    print_table(episode_table(rows, unattended))
    named = [row.episode_id for row in rows if getattr(row, "episode_id", None) in unattended]
    for episode_id in named[:UNATTENDED_NAMED]:
        stderr(f"{episode_id}: {unattended_line(episode_id)}")
    if len(named) > UNATTENDED_NAMED:
        stderr(f"... and {len(named) - UNATTENDED_NAMED} more episodes no worker runs")
    return EXIT_OK


UNATTENDED_ASKED = 50  # running rows `drlm list` asks the server about (the newest)
UNATTENDED_NAMED = 10  # of them, named one per line under the table


async def _unattended_rows(settings: Settings, rows: list[Any]) -> set[str]:
    """The running episodes of `rows` that no worker runs. With the embedded server down,
    every one (no worker runs without it), and nothing is started to find that out."""
    running = [row.episode_id for row in rows if not hasattr(row, "summary") and row.status == "running"][
        :UNATTENDED_ASKED
    ]
    if not running:
        return set()
    if settings.embedded:
        from durable_rlm.server.embedded import running_state  # start-up: the supervisor's files (~40 ms)

        if running_state(settings) is None:
            return set(running)
    from durable_rlm.client.attendance import unattended_episodes  # start-up: temporalio, running rows only
    from durable_rlm.server.connection import connect  # start-up: temporalio, the stores (~0.4 s)
    from durable_rlm.telemetry.log_path import forward_core_logs  # start-up: temporalio, this path

    forward_core_logs()  # before the first client: stdout is the command's own (--json)
    try:
        async with connect(settings) as services:
            return await unattended_episodes(services.client, running, settings.data_dir)
    except Exception:  # noqa: BLE001 - a server that does not answer: the rows as stored, nothing claimed
        return set()


async def _with_live_status(settings: Settings, rows: list[Any]) -> list[Any]:
    """With --refresh, a running episode's status as it says it itself (the `DrlmStatus`
    search attribute: waiting for the store, paused, awaiting approval), which its audit row
    cannot say while the store it waits for is down."""
    from durable_rlm.server.connection import connect  # start-up: temporalio, the stores (~0.4 s)
    from durable_rlm.workflows import metadata  # start-up: temporalio's search attributes (~0.1 s)

    sessions = {row.session_id: row for row in rows if hasattr(row, "summary")}
    running = [row.episode_id for row in rows if not hasattr(row, "summary") and row.status == "running"]
    if not running and not sessions:
        return rows
    live: dict[str, str] = {}
    async with connect(settings) as services:
        if running:
            quoted = ", ".join(json.dumps(episode_id) for episode_id in running[:200])
            with contextlib.suppress(Exception):  # a server without the attribute: rows as stored
                async for execution in services.client.list_workflows(f"WorkflowId IN ({quoted})"):
                    status = execution.typed_search_attributes.get(metadata.STATUS)
                    if status and status != "running":
                        live[execution.id] = status
        if sessions:
            await _session_statuses(services.client, sessions)
    updated = []
    for row in rows:
        if hasattr(row, "summary") or row.episode_id not in live:
            updated.append(row)
            continue
        mapping = {**row._mapping, "status": live[row.episode_id]}
        shown = SimpleNamespace(**mapping)
        shown._mapping = mapping  # as a Row has: --json prints it
        updated.append(shown)
    return updated


async def _session_statuses(client: Any, sessions: dict[str, Any]) -> None:
    """A session's own status (running: open for turns), which only the server knows; of its
    runs (continue-as-new makes several), the last one's."""
    quoted = ", ".join(json.dumps(session_id) for session_id in list(sessions)[:200])
    with contextlib.suppress(Exception):  # the server did not answer: the sessions' lines without it
        async for execution in client.list_workflows(f"WorkflowId IN ({quoted})"):
            status = execution.status.name.lower() if execution.status is not None else None
            if execution.id in sessions and status not in (None, "continued_as_new"):
                sessions[execution.id].status = status
