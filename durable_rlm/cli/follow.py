"""`drlm watch`, `drlm resume`, `drlm cancel`: an episode that already runs, followed to its end.

`watch` only follows (any number of watchers, from anywhere); `resume` and `cancel` also
work on it in this process when the server is the embedded one, since a worker must run
what they ask.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from durable_rlm.cli.arguments import add_sender
from durable_rlm.cli.handlers import Subparsers, bind, polling
from durable_rlm.cli.output import (
    EXIT_CANCELLED,
    EXIT_FAILED,
    EXIT_OK,
    FOLLOWING,
    ON_INTERRUPT,
    print_end,
    stderr,
)
from durable_rlm.settings import ConfigurationError, Settings

if TYPE_CHECKING:
    from durable_rlm.cli.attend import Attendant
    from durable_rlm.client.episodes import CancelOutcome


def _watch_parser(sub: Subparsers) -> None:
    watch = sub.add_parser("watch", help="follow a running episode's progress until it ends (no worker)")
    watch.add_argument("episode_id")
    watch.add_argument("--json", action="store_true")
    watch.add_argument("--accept-extracted", action="store_true")
    watch.add_argument(
        "--plain",
        action="store_true",
        help="progress as lines, not the live view (the default when stderr is not a terminal)",
    )
    bind(watch, _watch)


def _resume_parser(sub: Subparsers) -> None:
    resume = sub.add_parser(
        "resume",
        help="follow an episode, working on it if embedded: resumes it if a person paused it, and "
        "retries calls paused on a refused key",
    )
    resume.add_argument("episode_id")
    add_sender(resume)
    resume.add_argument("--api-key", help="the fixed key (embedded mode only; never stored in history)")
    resume.add_argument("--json", action="store_true")
    resume.add_argument("--accept-extracted", action="store_true")
    bind(resume, _resume)


def _cancel_parser(sub: Subparsers) -> None:
    cancel = sub.add_parser("cancel", help="cancel a running episode and every child episode it started")
    cancel.add_argument("episode_id")
    cancel.add_argument(
        "--extract",
        action="store_true",
        help="first run fallback extraction, so the result holds what was found so far",
    )
    cancel.add_argument("--reason", default="cancelled by request", help="recorded in the result")
    bind(cancel, _cancel)


PARSERS = {"watch": _watch_parser, "resume": _resume_parser, "cancel": _cancel_parser}


async def _watch(settings: Settings, args: argparse.Namespace) -> int:
    """Follow without working on it: any number of watchers, from anywhere. While no worker
    runs the episode, it says so (and again when that changes): a query would get no
    answer, and the watch would otherwise show nothing at all."""
    from temporalio.client import WorkflowExecutionStatus  # start-up: temporalio (~0.2 s)

    from durable_rlm.client.episodes import describe_episode, follow  # start-up: temporalio (~0.6 s)
    from durable_rlm.server.connection import connect  # start-up: temporalio, the stores (~0.4 s)
    from durable_rlm.workflows.models import EpisodeResult  # start-up: pydantic's models (~0.1 s)

    async with connect(settings) as services:
        handle = services.client.get_workflow_handle(args.episode_id, result_type=EpisodeResult)
        description = await describe_episode(handle)  # an unknown id is a usage error now, not a wait
        FOLLOWING.append(args.episode_id)
        live = not (args.json or args.plain or not sys.stderr.isatty())
        say: list[Callable[[str], None]] = [stderr]
        telling = None
        if description.status == WorkflowExecutionStatus.RUNNING:
            telling = asyncio.ensure_future(
                _tell_attendance(services.client, settings, args.episode_id, description.task_queue, say)
            )
        try:
            if not live:
                end = await follow(handle, None if args.json else stderr)
            else:
                end = await _follow_live(handle, say)
        finally:
            if telling is not None:
                telling.cancel()
                with contextlib.suppress(BaseException):
                    await telling
    return print_end(end, args.json, args.accept_extracted)


ATTENDANCE_EVERY_S = 3.0
"""How often `drlm watch` looks again at whether a worker runs the episode."""


async def _tell_attendance(
    client: Any, settings: Settings, episode_id: str, task_queue: str, say: list[Callable[[str], None]]
) -> None:
    """Say "no worker runs this episode" while none does, and when one takes it up again;
    a worker alive but busy (or shedding load) is never called absent
    (durable_rlm/client/attendance.py)."""
    from durable_rlm.audit.timeline import unattended_line  # start-up: the timeline's models (~0.1 s)
    from durable_rlm.client.attendance import attendance  # start-up: temporalio, loaded by now

    told: bool | None = None
    while True:
        seen = await attendance(client, task_queue, settings.data_dir)
        if seen.known and seen.unattended != told:
            if seen.unattended:
                say[-1](f"episode {episode_id}: " + unattended_line(episode_id))
            elif told:
                say[-1](f"episode {episode_id}: a worker runs it again")
            told = seen.unattended
        await asyncio.sleep(ATTENDANCE_EVERY_S)


async def _follow_live(handle: Any, say: list[Callable[[str], None]]) -> Any:
    """The rich live view on stderr until the episode ends; its last frame stays. A line
    said meanwhile is printed above it."""
    from rich.console import Console  # start-up: rich (~30 ms), only for the live view
    from rich.live import Live  # start-up: as the line above

    from durable_rlm.client.episodes import follow  # start-up: temporalio, the stores (~0.6 s)
    from durable_rlm.terminal import safe  # start-up: nothing (a table of controls)
    from durable_rlm.viewer.live import frame  # start-up: the timeline's models (~0.1 s)

    with Live(console=Console(stderr=True), refresh_per_second=4, transient=False) as live:
        say.append(lambda line: live.console.print(safe(line), markup=False, highlight=False))
        try:
            return await follow(handle, on_state=lambda progress: live.update(frame(handle.id, progress)))
        finally:
            say.pop()


async def _resume(settings: Settings, args: argparse.Namespace) -> int:
    """Work on an episode (embedded) and follow it; an episode paused on a refused key runs
    its paused calls again, with this worker's key (`--api-key`, or the environment)."""
    from durable_rlm.client.episodes import (  # start-up: temporalio, the stores (~0.6 s)
        describe_episode,
        follow,
        retry_credentials,
    )
    from durable_rlm.client.steering import resume_episode  # start-up: as the line above
    from durable_rlm.server.connection import connect  # start-up: temporalio, the stores (~0.4 s)
    from durable_rlm.worker.runtime import running_workers  # start-up: the worker's imports (~0.7 s)
    from durable_rlm.workflows.models import EpisodeResult  # start-up: pydantic's models (~0.1 s)

    if args.api_key and not settings.embedded:
        raise ConfigurationError(
            "--api-key only works with the embedded worker; with TEMPORAL_ADDRESS set, give the key "
            "to the workers (restart them), then run `drlm resume` again"
        )
    async with connect(settings) as services:
        handle = services.client.get_workflow_handle(args.episode_id, result_type=EpisodeResult)
        description = await describe_episode(handle)  # an unknown id is a usage error now, not a wait
        services = polling(services, description.task_queue)  # a session's own queue, or the shared one
        credentials = {}
        if args.api_key:
            from durable_rlm.audit.projection import first_request  # start-up: the audit writer (~0.6 s)

            request = await first_request(services.client, args.episode_id)
            credentials = {request.root_model.api_key_env: args.api_key}
        FOLLOWING.append(args.episode_id)
        async with running_workers(services, credentials) if settings.embedded else contextlib.nullcontext():
            held = await resume_episode(services.client, args.episode_id, args.sender)
            if held.accepted and not args.json:
                stderr(held.message)  # a person had paused it; otherwise nothing changed
            outcome = await retry_credentials(services.client, args.episode_id)
            if outcome.accepted and not args.json:
                stderr(outcome.message)
            end = await follow(handle, None if args.json else stderr)
            return print_end(end, args.json, args.accept_extracted)


async def _cancel(settings: Settings, args: argparse.Namespace) -> int:
    """Cancel an episode, whoever runs it: its worker, or, when none does (a `drlm run`
    stopped by Ctrl-C), this process, until the episode has ended cancelled with its
    children. Back within seconds either way (durable_rlm/cli/attend.py)."""
    from temporalio.client import WorkflowExecutionStatus  # start-up: temporalio (~0.2 s)

    from durable_rlm.audit.timeline import unanswered_line  # start-up: the timeline's models (~0.1 s)
    from durable_rlm.cli.attend import Attendant, let_go  # start-up: temporalio (~0.2 s)
    from durable_rlm.client.cancelling import CLOSING_STEPS, calls_settled  # start-up: temporalio (~0.2 s)
    from durable_rlm.client.episodes import cancel_episode, describe_episode  # start-up: temporalio (~0.6 s)
    from durable_rlm.server.connection import connect  # start-up: temporalio, the stores (~0.4 s)
    from durable_rlm.workflows import names  # start-up: as the line above
    from durable_rlm.workflows.models import EpisodeResult  # start-up: pydantic's models (~0.1 s)

    episode_id = args.episode_id
    async with connect(settings) as services:
        handle = services.client.get_workflow_handle(episode_id, result_type=EpisodeResult)
        description = await describe_episode(handle)  # an unknown id is a usage error now
        if description.status != WorkflowExecutionStatus.RUNNING:
            stderr((await cancel_episode(services.client, episode_id, args.extract, args.reason)).message)
            return EXIT_OK
        ON_INTERRUPT.append(
            f"drlm: interrupted before episode {episode_id} confirmed the cancel: `drlm show {episode_id}` "
            f"tells whether it ended; `drlm cancel {episode_id}` again if not"
        )
        taking_over = functools.partial(
            stderr, f"no worker runs episode {episode_id}: this command runs it until the cancel ends it"
        )
        queue = description.task_queue
        allowed = CLOSING_STEPS | ({names.EXTRACT_FALLBACK} if args.extract else set())
        settled = functools.partial(calls_settled, services.client, episode_id, allowed)
        async with Attendant(
            settings, services, queue, calls_allowed=settled, on_taking_over=taking_over
        ) as attendant:
            await attendant.look()
            if attendant.nobody:  # a cluster's server, and no worker polls the episode's queue
                return await _cancel_on_server(handle, args, queue)
            request = asyncio.ensure_future(
                cancel_episode(services.client, episode_id, args.extract, args.reason)
            )
            try:
                if not await attendant.wait(request, settings.steer_wait_s):
                    wait_s, who = settings.steer_wait_s, attendant.who()
                    stderr(f"drlm: {unanswered_line(episode_id, 'cancel', wait_s, who, ends=True)}")
                    return EXIT_FAILED
            finally:
                let_go(request)  # a no-op once done
            return await _cancelled(attendant, handle, args, request.result())


async def _cancelled(
    attendant: Attendant, handle: Any, args: argparse.Namespace, outcome: CancelOutcome
) -> int:
    """The cancel was answered: wait (bounded, unless this process must run an extraction)
    for the episode's end, and print it."""
    from durable_rlm.cli.attend import let_go  # start-up: loaded with the attendant
    from durable_rlm.client.episodes import wait_end  # start-up: temporalio, the stores (~0.6 s)

    stderr(outcome.message)
    if not outcome.accepted:
        return EXIT_OK
    episode_id = handle.id
    ON_INTERRUPT.append(
        f"drlm: interrupted; episode {episode_id} accepted the cancel and ends when a worker runs it "
        f"(`drlm resume {episode_id}`)"
    )
    if args.extract and attendant.here:
        stderr("extracting what was found (a model call) before it ends; Ctrl-C leaves that to `drlm resume`")
    end = asyncio.ensure_future(wait_end(handle))
    try:
        bound = None if args.extract and attendant.here else attendant.settings.steer_wait_s
        if not await attendant.wait(end, bound):
            stderr(
                f"episode {episode_id} is ending on its worker ({attendant.who()}): "
                f"`drlm watch {episode_id}` shows its end"
            )
            return EXIT_OK
    finally:
        let_go(end)
    code = print_end(end.result(), as_json=False)
    return EXIT_OK if code == EXIT_CANCELLED else code


async def _cancel_on_server(handle: Any, args: argparse.Namespace, task_queue: str) -> int:
    """No worker runs the episode, and this process cannot (a cluster's server): Temporal's
    own cancellation is recorded in the episode's history at once, and a worker that runs
    the episode next ends it cancelled, with its children. A reason or an extraction needs
    the episode's own cancel, which only a running worker can take."""
    episode_id = handle.id
    start = f"start one on its task queue ({task_queue}): `python worker.py`"
    if args.extract:
        stderr(
            f"drlm: no worker runs episode {episode_id}; --extract needs one to extract: {start}, "
            "or cancel without --extract"
        )
        return EXIT_FAILED
    await handle.cancel()
    stderr(
        f"no worker runs episode {episode_id}: its cancel is recorded on the server, and it ends "
        f"cancelled, with its children, as soon as a worker runs it ({start})"
    )
    return EXIT_OK
