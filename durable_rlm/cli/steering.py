"""`drlm hint`, `limits`, `pause`, `finish`, `pending`, `approve`, `reject`, `reward`: a
person's actions on a running episode, each a Temporal update with its sender.

A worker must answer an update: the one that runs the episode, or, embedded, when no live
worker does, this process's own worker, on the episode's task queue, for as long as the
update takes (durable_rlm/cli/attend.py); each command is back within seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from durable_rlm.cli.arguments import add_sender
from durable_rlm.cli.handlers import Subparsers, bind
from durable_rlm.cli.output import EXIT_FAILED, EXIT_OK, EXIT_USAGE, ON_INTERRUPT, stderr
from durable_rlm.settings import ConfigurationError, Settings

if TYPE_CHECKING:
    from temporalio.client import Client

    from durable_rlm.client.steering import SteeringOutcome
    from durable_rlm.server.connection import Services

T = TypeVar("T")
# An action: its update of the episode, from the arguments.
Update = Callable[["Client", argparse.Namespace], Awaitable["SteeringOutcome"]]

# The limits `drlm limits` changes, as its flags name them.
_LIMITS = ("max_iterations", "max_llm_calls", "max_duration", "max_model_calls", "max_tokens", "max_cost_usd")
PENDING_SILENT_SHOWN = 20  # episodes that did not answer `drlm pending`, each named with why


def _hint_parser(sub: Subparsers) -> None:
    hint = sub.add_parser("hint", help="a message the episode's root model reads on its next turn")
    hint.add_argument("episode_id")
    hint.add_argument("text")
    add_sender(hint)
    _bind_update(hint, _hint)


def _limits_parser(sub: Subparsers) -> None:
    limits = sub.add_parser(
        "limits",
        help="raise or lower a running episode's limits (below what is spent: it ends by extraction)",
    )
    limits.add_argument("episode_id")
    limits.add_argument("--max-iterations", type=int)
    limits.add_argument("--max-llm-calls", type=int, help="sub-calls from the REPL")
    limits.add_argument("--max-duration", type=float, help="seconds, counted from submission")
    limits.add_argument("--max-model-calls", type=int)
    limits.add_argument("--max-tokens", type=int)
    limits.add_argument("--max-cost-usd", type=float)
    add_sender(limits)
    _bind_update(limits, _limits)


def _pause_parser(sub: Subparsers) -> None:
    pause = sub.add_parser(
        "pause", help="hold an episode at its next step boundary, without a sandbox, until `drlm resume`"
    )
    pause.add_argument("episode_id")
    pause.add_argument(
        "--hold-clock", action="store_true", help="max-duration does not count the pause (by default it does)"
    )
    pause.add_argument("--reason", default="")
    add_sender(pause)
    _bind_update(pause, _pause)


def _finish_parser(sub: Subparsers) -> None:
    finish = sub.add_parser(
        "finish", help="make an episode answer now: it stops at the next step boundary and extracts"
    )
    finish.add_argument("episode_id")
    finish.add_argument("--reason", default="")
    add_sender(finish)
    _bind_update(finish, _finish)


def _pending_parser(sub: Subparsers) -> None:
    pending = sub.add_parser("pending", help="cells waiting for approval, across the running episodes")
    pending.add_argument("--json", action="store_true", help="one JSON object per line")
    bind(pending, _pending)


def _approve_parser(sub: Subparsers) -> None:
    approve = sub.add_parser(
        "approve", help="run a cell that waits for approval (ID as `drlm pending` lists it)"
    )
    approve.add_argument("approval_id", metavar="ID", help="EPISODE#CELL, or an episode id: its waiting cell")
    approve.add_argument(
        "--edit", type=Path, metavar="FILE", help="run this file's code instead of the cell's"
    )
    add_sender(approve)
    _bind_update(approve, _approve)


def _reject_parser(sub: Subparsers) -> None:
    reject = sub.add_parser("reject", help="do not run a cell that waits for approval; the model reads why")
    reject.add_argument("approval_id", metavar="ID", help="EPISODE#CELL, or an episode id: its waiting cell")
    reject.add_argument("--reason", required=True, help="what the model reads")
    add_sender(reject)
    _bind_update(reject, _reject)


def _reward_parser(sub: Subparsers) -> None:
    reward = sub.add_parser("reward", help="send a reward to a running episode")
    reward.add_argument("episode_id")
    reward.add_argument("value", type=float)
    reward.add_argument("--note")
    bind(reward, _reward)


PARSERS = {
    "reward": _reward_parser,
    "hint": _hint_parser,
    "limits": _limits_parser,
    "pause": _pause_parser,
    "finish": _finish_parser,
    "pending": _pending_parser,
    "approve": _approve_parser,
    "reject": _reject_parser,
}


def _hint(client: Client, args: argparse.Namespace) -> Awaitable[SteeringOutcome]:
    from durable_rlm.client import steering  # start-up: temporalio (~0.6 s), loaded with the connection

    return steering.send_hint(client, args.episode_id, args.text, args.sender)


def _limits(client: Client, args: argparse.Namespace) -> Awaitable[SteeringOutcome]:
    from durable_rlm.client import steering  # start-up: temporalio (~0.6 s), loaded with the connection

    given = {name: getattr(args, name) for name in _LIMITS}
    if all(value is None for value in given.values()):
        raise ConfigurationError("drlm limits needs at least one limit, e.g. --max-iterations 40")
    return steering.change_limits(client, args.episode_id, args.sender, **given)


def _pause(client: Client, args: argparse.Namespace) -> Awaitable[SteeringOutcome]:
    from durable_rlm.client import steering  # start-up: temporalio (~0.6 s), loaded with the connection

    return steering.pause_episode(client, args.episode_id, args.sender, args.hold_clock, args.reason)


def _finish(client: Client, args: argparse.Namespace) -> Awaitable[SteeringOutcome]:
    from durable_rlm.client import steering  # start-up: temporalio (~0.6 s), loaded with the connection

    return steering.finish_episode(client, args.episode_id, args.sender, args.reason)


def _approve(client: Client, args: argparse.Namespace) -> Awaitable[SteeringOutcome]:
    from durable_rlm.client import steering  # start-up: temporalio (~0.6 s), loaded with the connection

    code = _read_edit(args.edit) if args.edit else None
    return steering.decide_cell(client, args.approval_id, True, args.sender, code)


def _reject(client: Client, args: argparse.Namespace) -> Awaitable[SteeringOutcome]:
    from durable_rlm.client import steering  # start-up: temporalio (~0.6 s), loaded with the connection

    return steering.decide_cell(client, args.approval_id, False, args.sender, reason=args.reason)


def _read_edit(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigurationError(f"cannot read the edited cell {path}: {exc}") from exc


def _bind_update(parser: argparse.ArgumentParser, update: Update) -> None:
    async def steer(settings: Settings, args: argparse.Namespace) -> int:
        return await _steer(settings, args, update)

    bind(parser, steer)


async def _steer(settings: Settings, args: argparse.Namespace, update: Update) -> int:
    """One update, with its sender; which episode it goes to: the one named, or the one
    whose cell an approval id names."""
    from durable_rlm.server.connection import connect  # start-up: temporalio, the stores (~0.4 s)

    target = args.episode_id if "episode_id" in args else args.approval_id.rsplit("#", 1)[0]
    async with connect(settings) as services:
        work = lambda: update(services.client, args)  # noqa: E731 - sent once the episode is attended
        sent = await _attended(settings, services, target, args.command, work)
    if isinstance(sent, int):
        return sent
    outcome, here = sent
    if not outcome.accepted:
        stderr(f"drlm: {outcome.message}")
        return EXIT_USAGE
    stderr(outcome.message)
    if here:
        stderr(_applied_here(outcome.episode_id))
    return EXIT_OK


def _applied_here(episode_id: str) -> str:
    return (
        f"no worker runs episode {episode_id}: this command applied it; the episode goes on "
        f"when a worker runs it: `drlm resume {episode_id}`"
    )


async def _attended(
    settings: Settings, services: Services, episode_id: str, command: str, work: Callable[[], Awaitable[T]]
) -> tuple[T, bool] | int:
    """Run an update (or query) a worker must answer: (its value, whether this process's
    own worker answered it, no other worker running the episode), or the exit code of a
    command that could not be answered (messages printed). Back within seconds whoever
    runs the episode (durable_rlm/cli/attend.py)."""
    from temporalio.client import WorkflowExecutionStatus  # start-up: temporalio (~0.2 s)

    from durable_rlm.audit.timeline import unanswered_line  # start-up: the timeline's models (~0.1 s)
    from durable_rlm.cli.attend import Attendant, let_go  # start-up: temporalio (~0.2 s)
    from durable_rlm.client.episodes import describe_episode, ended_refusal  # start-up: temporalio (~0.6 s)

    description = await describe_episode(services.client.get_workflow_handle(episode_id))
    if description.status != WorkflowExecutionStatus.RUNNING:
        # Said without a worker: an update or a query to an ended episode would wait for one.
        stderr(
            f"drlm: {await ended_refusal(services.client, episode_id) or f'episode {episode_id} has ended'}"
        )
        return EXIT_USAGE
    ON_INTERRUPT.append(
        f"drlm: interrupted before episode {episode_id} answered: `drlm show {episode_id}` tells "
        f"whether the {command} took effect"
    )
    queue = description.task_queue
    async with Attendant(settings, services, queue) as attendant:
        await attendant.look()
        if attendant.nobody:  # a cluster's server: this process runs no worker for it
            stderr(
                f"drlm: no worker runs episode {episode_id} (none polls its task queue "
                f"{description.task_queue}): nothing was sent; start one (`python worker.py`), then "
                f"send the {command} again"
            )
            return EXIT_FAILED
        task = asyncio.ensure_future(work())
        try:
            if not await attendant.wait(task, settings.steer_wait_s):
                unanswered = unanswered_line(episode_id, command, settings.steer_wait_s, attendant.who())
                stderr(f"drlm: {unanswered}")
                return EXIT_FAILED
        finally:
            let_go(task)  # a no-op once done
        return task.result(), attendant.here


async def _pending(settings: Settings, args: argparse.Namespace) -> int:
    from durable_rlm.client.steering import pending_cells  # start-up: temporalio, the stores (~0.6 s)
    from durable_rlm.server.connection import connect  # start-up: temporalio, the stores (~0.4 s)

    unanswered: list[str] = []
    async with connect(settings) as services:
        cells = await pending_cells(services.client, unanswered)
        silent = await _unattended_of(settings, services, unanswered)
    from durable_rlm.audit.timeline import unattended_line  # start-up: the timeline's models (~0.1 s)

    for episode_id, nobody in silent.items():
        stderr(
            f"episode {episode_id} did not answer: "
            + (unattended_line(episode_id) if nobody else "its worker is busy; ask again in a moment")
        )
    if args.json:
        for cell in cells:
            print(json.dumps({"id": cell.approval_id, **cell.model_dump(mode="json")}))
        return EXIT_OK
    if not cells:
        stderr("no cell waits for approval" + (" in the episodes that answered" if silent else ""))
        return EXIT_OK
    from durable_rlm.terminal import safe  # start-up: nothing (a table of controls)

    now = datetime.now(UTC)
    for cell in cells:  # the code is a model's: shown, never acted on by the terminal
        waited = max((now - cell.since).total_seconds(), 0)
        where = f"iteration {cell.iteration}, --approve {cell.mode}"
        print(safe(f"{cell.approval_id}  waiting {_duration(waited)} ({where})"))
        for reason in cell.reasons or ["(every cell waits)"]:
            print(safe(f"  risk: {reason}"))
        for line in cell.code.splitlines() or [""]:
            print(safe(f"  | {line}"))
    stderr(f"{len(cells)} cell(s): `drlm approve ID [--edit FILE]` or `drlm reject ID --reason TEXT`")
    return EXIT_OK


async def _unattended_of(settings: Settings, services: Services, episode_ids: list[str]) -> dict[str, bool]:
    """For each episode that did not answer: whether no worker runs it (else it is busy)."""
    from durable_rlm.client.attendance import attendance  # start-up: temporalio (~0.2 s)
    from durable_rlm.client.episodes import episode_task_queue  # start-up: temporalio, the stores (~0.6 s)

    found: dict[str, bool] = {}
    for episode_id in episode_ids[:PENDING_SILENT_SHOWN]:
        try:
            queue = await episode_task_queue(services.client, episode_id)
        except LookupError:
            continue
        found[episode_id] = (await attendance(services.client, queue, settings.data_dir)).unattended
    return found


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7_200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3_600:.1f} h"


async def _reward(settings: Settings, args: argparse.Namespace) -> int:
    from temporalio.client import WorkflowUpdateFailedError  # start-up: temporalio (~0.2 s)

    from durable_rlm.client.episodes import send_reward  # start-up: temporalio, the stores (~0.6 s)
    from durable_rlm.server.connection import connect  # start-up: temporalio, the stores (~0.4 s)

    async with connect(settings) as services:
        try:
            sent = await _attended(
                settings,
                services,
                args.episode_id,
                "reward",
                lambda: send_reward(services.client, args.episode_id, args.value, args.note),
            )
        except WorkflowUpdateFailedError as exc:
            raise ConfigurationError(f"reward refused: {exc.cause or exc}") from exc
    if isinstance(sent, int):
        return sent
    receipt, here = sent
    print(
        f"reward accepted ({receipt.accepted} so far; pending {receipt.pending:g}, "
        f"cumulative {receipt.cumulative:g})"
    )
    if here:
        stderr(_applied_here(args.episode_id))
    return EXIT_OK
