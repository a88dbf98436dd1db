"""`drlm hint`, `limits`, `pause`, `finish`, `pending`, `approve`, `reject`, `reward`: a
person's actions on a running episode, each a Temporal update with its sender.

A worker must answer an update: embedded, when no other process's worker does within a
head start, this process's own worker does, on the episode's task queue.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from durable_rlm.cli.arguments import add_sender
from durable_rlm.cli.handlers import Subparsers, bind, polling
from durable_rlm.cli.output import EXIT_OK, EXIT_USAGE, stderr
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
STEER_HEAD_START_S = 1.0  # how long an action waits for a worker already running the episode


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

    async with connect(settings) as services:
        work = update(services.client, args)
        target = args.episode_id if "episode_id" in args else args.approval_id.rsplit("#", 1)[0]
        outcome, attended = await _attended(settings, services, work, target)
    if not outcome.accepted:
        stderr(f"drlm: {outcome.message}")
        return EXIT_USAGE
    stderr(outcome.message)
    if not attended:
        stderr(
            f"no other process works on episode {outcome.episode_id} now: `drlm resume "
            f"{outcome.episode_id}` runs it here (or start `python worker.py`)"
        )
    return EXIT_OK


async def _attended(
    settings: Settings, services: Services, work: Awaitable[T], episode_id: str | None = None
) -> tuple[T, bool]:
    """Run an update or query that a worker must answer: (its value, whether a worker of
    another process answered). Embedded, when none answers within a head start, this
    process's worker does, on the episode's own task queue (and stops with the command:
    the episode then waits for one)."""
    from durable_rlm.client.episodes import episode_task_queue  # start-up: temporalio, the stores (~0.6 s)
    from durable_rlm.worker.runtime import running_workers  # start-up: the worker's imports (~0.7 s)

    task = asyncio.ensure_future(work)
    if not settings.embedded:
        return await task, True
    await asyncio.wait({task}, timeout=STEER_HEAD_START_S)
    if task.done():
        return task.result(), True
    if episode_id is not None:
        with contextlib.suppress(LookupError):
            services = polling(services, await episode_task_queue(services.client, episode_id))
    try:
        async with running_workers(services):
            return await task, False
    finally:
        task.cancel()  # a no-op once done; a worker that failed to start leaves it pending


async def _pending(settings: Settings, args: argparse.Namespace) -> int:
    from durable_rlm.client.steering import pending_cells  # start-up: temporalio, the stores (~0.6 s)
    from durable_rlm.server.connection import connect  # start-up: temporalio, the stores (~0.4 s)

    async with connect(settings) as services:
        cells, _ = await _attended(settings, services, pending_cells(services.client))
    if args.json:
        for cell in cells:
            print(json.dumps({"id": cell.approval_id, **cell.model_dump(mode="json")}))
        return EXIT_OK
    if not cells:
        stderr("no cell waits for approval")
        return EXIT_OK
    now = datetime.now(UTC)
    for cell in cells:
        waited = max((now - cell.since).total_seconds(), 0)
        where = f"iteration {cell.iteration}, --approve {cell.mode}"
        print(f"{cell.approval_id}  waiting {_duration(waited)} ({where})")
        for reason in cell.reasons or ["(every cell waits)"]:
            print(f"  risk: {reason}")
        for line in cell.code.splitlines() or [""]:
            print(f"  | {line}")
    stderr(f"{len(cells)} cell(s): `drlm approve ID [--edit FILE]` or `drlm reject ID --reason TEXT`")
    return EXIT_OK


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
            receipt = await send_reward(services.client, args.episode_id, args.value, args.note)
        except WorkflowUpdateFailedError as exc:
            raise ConfigurationError(f"reward refused: {exc.cause or exc}") from exc
    print(
        f"reward accepted ({receipt.accepted} so far; pending {receipt.pending:g}, "
        f"cumulative {receipt.cumulative:g})"
    )
    return EXIT_OK
