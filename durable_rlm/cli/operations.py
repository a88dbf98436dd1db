"""`drlm worker`, `info`, `config`, `doctor`, `ui`, `codec-server`, `deployment`,
`audit-rebuild`: running and looking after the machinery rather than one episode."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import webbrowser
from datetime import timedelta
from urllib.parse import quote

from durable_rlm.cli.handlers import Subparsers, bind
from durable_rlm.cli.output import EXIT_FAILED, EXIT_OK, stderr
from durable_rlm.ports import wait_listening
from durable_rlm.settings import ConfigurationError, Settings


def _worker_parser(sub: Subparsers) -> None:
    worker = sub.add_parser(
        "worker", help="run a worker: `python worker.py` (settings from the environment, see drlm info)"
    )
    worker.add_argument(
        "--processes",
        default=os.environ.get("DRLM_WORKER_PROCESSES", "1"),
        help="worker processes under one supervisor sharing the sandbox budget: a number, or auto "
        "(one per core); default DRLM_WORKER_PROCESSES or 1",
    )
    worker.set_defaults(handler=_worker)  # not bound to a coroutine: the worker runs its own loop


def _ui_parser(sub: Subparsers) -> None:
    ui = sub.add_parser(
        "ui",
        help="the page of one episode, or the list of episodes (--temporal: the Temporal UI's page "
        "or list instead)",
    )
    ui.add_argument("episode_id", nargs="?")
    ui.add_argument(
        "--temporal", action="store_true", help="the Temporal UI's page (raw events) or list instead"
    )
    ui.add_argument(
        "--open",
        action="store_true",
        help="open it in the browser too (by a one-shot link: the page's capability is never on "
        "the browser's command line)",
    )
    ui.add_argument(
        "--keep", action="store_true", help="keep the embedded server (and its UI) up until Ctrl-C"
    )
    bind(ui, _ui)


def _codec_server_parser(sub: Subparsers) -> None:
    codec = sub.add_parser(
        "codec-server",
        help="serve Temporal's remote codec protocol for a Web UI (claim-checked payloads as their content)",
    )
    codec.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    codec.add_argument("--port", type=int, default=8234)
    codec.add_argument(
        "--origin",
        action="append",
        help="a Web UI origin allowed to call it (repeatable; default DRLM_UI_ADDRESS, or the embedded UI's)",
    )
    codec.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a host name requests may use besides 127.0.0.1, localhost and the bound address "
        "(repeatable); any other Host header gets 421, as a DNS-rebinding page's would",
    )
    bind(codec, _codec_server)


def _config_parser(sub: Subparsers) -> None:
    config = sub.add_parser(
        "config", help="every effective setting, its variable and who chose it (secrets masked)"
    )
    config.add_argument("--json", action="store_true")
    bind(config, _config, sdk_runtime=False)  # it never reaches Temporal


def _info_parser(sub: Subparsers) -> None:
    info = sub.add_parser("info", help="where data lives, which setting chose it, and the server")
    info.add_argument("--json", action="store_true")
    bind(info, _info, sdk_runtime=False)  # it never reaches Temporal


def _doctor_parser(sub: Subparsers) -> None:
    doctor = sub.add_parser(
        "doctor", help="check this machine: Temporal, stores, and the sandbox's isolation layers"
    )
    bind(doctor, _doctor)


def _audit_rebuild_parser(sub: Subparsers) -> None:
    rebuild = sub.add_parser("audit-rebuild", help="rebuild the SQL audit projection from the histories")
    bind(rebuild, _audit_rebuild)


def _gc_parser(sub: Subparsers) -> None:
    gc = sub.add_parser(
        "gc", help="remove blobs only histories past the namespace's retention named (--schedule: on a timer)"
    )
    gc.add_argument(
        "--grace", type=_duration, default="24h", help="keep unnamed blobs younger than this (default 24h)"
    )
    gc.add_argument("--dry-run", action="store_true", help="count what would go; remove nothing")
    gc.add_argument(
        "--schedule", type=_duration, metavar="EVERY", help="create or update a Temporal Schedule (e.g. 6h)"
    )
    gc.add_argument("--json", action="store_true")
    bind(gc, _gc)


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _duration(text: str) -> timedelta:
    """`90s`, `30m`, `6h`, `7d` (a bare number is seconds)."""
    text = text.strip().lower()
    unit = _UNITS.get(text[-1:], None)
    try:
        value = float(text[:-1] if unit else text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 90s, 30m, 6h or 7d") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a duration must be positive")
    return timedelta(seconds=value * (unit or 1))


async def _gc(settings: Settings, args: argparse.Namespace) -> int:
    from durable_rlm.audit.gc import gc_command  # start-up: temporalio, the stores (~0.5 s)

    return await gc_command(settings, args.grace, args.dry_run, args.json, args.schedule)


def _deployment_parser(sub: Subparsers) -> None:
    deployment = sub.add_parser(
        "deployment", help="the Worker Deployment's builds; make one current or ramp it (rolling upgrades)"
    )
    deployment.add_argument("action", nargs="?", choices=("show", "set-current", "ramp"), default="show")
    deployment.add_argument("build_id", nargs="?", help="the build (set-current, ramp)")
    deployment.add_argument("percent", nargs="?", type=float, help="of new episodes (ramp)")
    deployment.add_argument("--name", help="the deployment (default: DRLM_DEPLOYMENT_NAME)")
    bind(deployment, _deployment)


PARSERS = {
    "worker": _worker_parser,
    "ui": _ui_parser,
    "codec-server": _codec_server_parser,
    "config": _config_parser,
    "info": _info_parser,
    "doctor": _doctor_parser,
    "audit-rebuild": _audit_rebuild_parser,
    "gc": _gc_parser,
    "deployment": _deployment_parser,
}


def _worker(args: argparse.Namespace) -> int:
    """The worker's own main, as `python worker.py` runs it; it leaves the process itself."""
    from durable_rlm.worker.main import main as worker_main  # start-up: the SDK and the sandboxes (~0.8 s)

    worker_main(["--processes", args.processes], "drlm worker")  # leaves by os._exit
    return EXIT_OK  # not reached


async def _ui(settings: Settings, args: argparse.Namespace) -> int:
    """Our episode page (or the list of episodes); the Temporal UI's with --temporal, or
    where the embedded server's supervisor serves no page (a cluster)."""
    from durable_rlm.client.episodes import describe_episode  # start-up: temporalio, the stores (~0.6 s)
    from durable_rlm.server.connection import connect  # start-up: temporalio, the stores (~0.4 s)

    async with connect(settings) as services:
        if args.episode_id:  # an unknown id is a usage error before any page is opened
            handle = services.client.get_workflow_handle(args.episode_id)
            run_id = (await describe_episode(handle)).run_id
        page = None if args.temporal else episode_page(settings, args.episode_id)
        if page is None:
            if services.ui is None:
                raise ConfigurationError(
                    "no Web UI here: DRLM_UI is off"
                    if settings.embedded
                    else "no Web UI address for this cluster: set DRLM_UI_ADDRESS (the compose stack's "
                    "is http://localhost:8080)"
                )
            if args.episode_id:
                url = services.episode_url(args.episode_id, run_id)
                assert url is not None  # a page of the UI, which is there (checked above)
            else:
                url = f"{services.ui.rstrip('/')}/namespaces/{settings.temporal_namespace}/workflows"
        else:
            url = page
        print(url, flush=True)
        if args.open:
            opened = url if page is None else await asyncio.to_thread(_one_shot, page)
            webbrowser.open(opened)
        if args.keep and settings.embedded:
            stderr("keeping the embedded server and its UI up; Ctrl-C to let it go")
            await asyncio.Event().wait()
    return EXIT_OK


def episode_page(settings: Settings, episode_id: str | None) -> str | None:
    """Our page of an episode (or, without one, the list), which the shared server's
    supervisor serves (durable_rlm/viewer/episode_page.py), with its capability; None where
    none is served (a cluster's server, or the Web UI off)."""
    from durable_rlm.server.embedded import running_state  # start-up: the server's supervisor (~40 ms)

    codec = (running_state(settings) or {}).get("codec") if settings.embedded else None
    if not codec:
        return None
    return f"{codec}/episodes" + (f"/{quote(episode_id, safe='')}" if episode_id else "")


LOGIN_TIMEOUT_S = 10.0


def _one_shot(page: str) -> str:
    """A link that opens `page` once, without its capability: the browser's command line is
    readable by every local user (`ps`). The supervisor mints it for this process, which
    holds the capability, and the browser exchanges it for a session cookie."""
    import urllib.request  # start-up: http.client and email (~20 ms), only for --open

    base, _, rest = page.partition("/episodes")
    wait_listening(base, LOGIN_TIMEOUT_S)  # just after a cold start, the page comes up a moment later
    request = urllib.request.Request(
        f"{base}/login-token",
        data=json.dumps({"next": "/episodes" + rest}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy
    with opener.open(request, timeout=LOGIN_TIMEOUT_S) as answer:
        return str(json.loads(answer.read())["url"])


async def _codec_server(settings: Settings, args: argparse.Namespace) -> int:
    """For a cluster's UI (or any other): decode with this machine's stores; a bearer token
    (DRLM_CODEC_TOKEN) is required when set. It serves until Ctrl-C, in the command's loop."""
    from durable_rlm.server.connection import open_stores  # start-up: temporalio, the stores (~0.4 s)
    from durable_rlm.viewer.codec_server import CodecServer, ui_origins  # start-up: as the line above

    origins = args.origin or (
        [settings.ui_address] if settings.ui_address else list(ui_origins(settings.ui_port))
    )
    if args.host not in ("127.0.0.1", "localhost", "::1") and not settings.codec_token:
        raise ConfigurationError(
            f"the codec server would listen on {args.host} without a token: set DRLM_CODEC_TOKEN"
        )
    blobs, _ = open_stores(settings)
    server = CodecServer(
        blobs,
        host=args.host,
        port=args.port,
        origins=origins,
        token=settings.codec_token,
        threshold=settings.claim_check_threshold,
        allowed_hosts=args.allow_host,
    )
    stderr(f"codec server on {server.url} for {', '.join(origins)}; point the UI's codec endpoint at it")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return EXIT_OK


async def _config(settings: Settings, args: argparse.Namespace) -> int:
    rows = settings.effective()
    if args.json:
        print(json.dumps({name: {"value": v, "variable": var, "chosen_by": o} for name, v, var, o in rows}))
        return EXIT_OK
    from rich.console import Console  # start-up: rich (~25 ms), only for the table
    from rich.table import Table  # start-up: as the line above

    table = Table(title="drlm config")
    for column in ("setting", "variable", "value", "chosen by"):
        table.add_column(column, overflow="fold")
    for name, value, variable, origin in rows:
        table.add_row(name, variable, "-" if value is None else str(value), origin)
    Console().print(table)
    return EXIT_OK


async def _info(settings: Settings, args: argparse.Namespace) -> int:
    from durable_rlm.server.embedded import running_state  # start-up: the server's supervisor (~40 ms)

    stores = settings.describe_stores()
    if settings.embedded:
        state = running_state(settings)
        server = (
            f"{state['address']} (shared by every client of the data directory)"
            if state
            else "not running (starts on first use)"
        )
        idle = f"stops {settings.server_idle_s:g} s after its last client (DRLM_SERVER_IDLE_S)"
        stores["server"] = (server, idle)
        if not settings.ui:
            stores["web UI"] = ("off", "DRLM_UI")
        else:
            where = (state or {}).get("ui") or f"port {settings.ui_port} (or a free one) once the server runs"
            stores["web UI"] = (where, settings.origin("ui_port"))
    elif settings.ui_address:
        stores["web UI"] = (settings.ui_address, "DRLM_UI_ADDRESS")
    stores["task queue"] = (settings.task_queue, settings.origin("task_queue"))
    if args.json:
        print(json.dumps({name: {"value": value, "chosen_by": why} for name, (value, why) in stores.items()}))
        return EXIT_OK
    from rich.console import Console  # start-up: rich (~25 ms), only for the table
    from rich.table import Table  # start-up: as the line above

    table = Table(title="drlm info")
    for column in ("what", "where", "chosen by"):
        table.add_column(column, overflow="fold")
    for name, (value, why) in stores.items():
        table.add_row(name, value, why)
    Console().print(table)
    return EXIT_OK


async def _doctor(settings: Settings, args: argparse.Namespace) -> int:
    from durable_rlm.cli.doctor import run_doctor  # start-up: the sandbox, the stores, rich (~0.7 s)

    return await run_doctor(settings)


async def _audit_rebuild(settings: Settings, args: argparse.Namespace) -> int:
    from durable_rlm.audit.projection import rebuild_audit  # start-up: the audit writer (~0.6 s)
    from durable_rlm.audit.verify import verify  # start-up: temporalio, the stores (~0.5 s)
    from durable_rlm.server.connection import connect  # start-up: temporalio, the stores (~0.4 s)

    unreadable: list[str] = []
    async with connect(settings) as services:
        assert services.engine is not None  # connect() opens the SQL store
        count = await rebuild_audit(services.client, services.engine, unreadable=unreadable)
        report = await verify(services.client, services.blobs, services.engine)
    print(f"audit store rebuilt from history: {count} episode(s)")
    # The rebuild reads only what its rows need: a missing blob is reported, not passed over.
    for episode_id in unreadable:
        stderr(f"drlm: {episode_id}: its history could not be read whole; its rows are missing")
    if not report.ok:
        stderr("drlm: blobs the histories reference are missing or corrupt (drlm verify --all):")
        for line in report.lines():
            stderr(f"  {line}")
    return EXIT_OK if report.ok and not unreadable else EXIT_FAILED


async def _deployment(settings: Settings, args: argparse.Namespace) -> int:
    from durable_rlm.server.connection import connect  # start-up: temporalio, the stores (~0.4 s)
    from durable_rlm.server.deployment import (  # start-up: temporalio (~0.3 s)
        describe_deployment,
        set_current,
        set_ramping,
    )

    name = args.name or settings.deployment_name
    if name is None:
        raise ConfigurationError("which deployment? give --name or set DRLM_DEPLOYMENT_NAME")
    if settings.embedded:
        raise ConfigurationError(
            "Worker Deployments are for a cluster: set TEMPORAL_ADDRESS (the embedded server's "
            "workers are unversioned)"
        )
    if args.action != "show" and not args.build_id:
        raise ConfigurationError(f"drlm deployment {args.action} needs a BUILD_ID")
    if args.action == "ramp" and args.percent is None:
        raise ConfigurationError("drlm deployment ramp needs a BUILD_ID and a PERCENT")
    async with connect(settings) as services:
        client = services.client
        if args.action == "set-current":
            previous = await set_current(client, name, args.build_id)
            print(f"deployment {name}: {args.build_id} is current (was {previous or 'none'})")
        elif args.action == "ramp":
            await set_ramping(client, name, args.build_id, args.percent)
            print(f"deployment {name}: {args.build_id} ramped to {args.percent:g}% of new episodes")
        print((await describe_deployment(client, name)).describe())
    return EXIT_OK
