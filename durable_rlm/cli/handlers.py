"""How a parsed command runs: each command's parser is bound to its handler, which
`drlm` calls (durable_rlm/cli/__init__.py) without knowing the command.

A handler is a coroutine of the environment's settings and the parsed arguments, run in
an event loop of its own; `drlm worker` alone binds a plain function (the worker runs its
own loop and leaves the process itself).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import TYPE_CHECKING, TypeAlias

from durable_rlm.cli.output import INTERRUPTED
from durable_rlm.settings import Settings

if TYPE_CHECKING:
    from durable_rlm.server.connection import Services

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
Command: TypeAlias = Callable[[Settings, argparse.Namespace], Awaitable[int]]


def bind(parser: argparse.ArgumentParser, command: Command, *, sdk_runtime: bool = True) -> None:
    """`parser`'s command runs `command`. `sdk_runtime=False` for a command that never
    reaches Temporal, or reaches it only on some paths and sets the SDK's Runtime up there
    (start-up: temporalio costs 0.15 s of a 0.35 s target for `drlm list` and `show`; see
    docs/architecture/decisions.md#start-up-pays-only-for-what-it-uses)."""
    parser.set_defaults(handler=lambda args: asyncio.run(_run(command, args, sdk_runtime)))


async def _run(command: Command, args: argparse.Namespace, sdk_runtime: bool) -> int:
    _note_interrupts()
    # The metrics endpoint is a worker's (python worker.py): CLI processes, many at once,
    # would contend for its port.
    settings = Settings.from_env().model_copy(update={"metrics_address": None})
    if sdk_runtime:
        from durable_rlm.telemetry.log_path import forward_core_logs  # start-up: temporalio (~0.3 s)

        forward_core_logs()  # stdout is the command's own (`--json`): the core's logs are records
    return await command(settings, args)


def import_extensions(settings: Settings) -> None:
    """Custom policies and tools must be known here too: `run` validates the request
    before starting anything, and a fork or re-run names a source's."""
    from durable_rlm.plugins import (  # start-up: the workflow models (~0.1 s)
        import_policy_modules,
        import_tool_modules,
    )

    import_policy_modules(settings.policy_module_names)
    import_tool_modules(settings.tool_module_names)


def polling(services: Services, task_queue: str) -> Services:
    """The same services, for a worker that polls `task_queue` (an episode's own queue)."""
    if task_queue == services.settings.task_queue:
        return services
    return dataclasses.replace(
        services, settings=services.settings.model_copy(update={"task_queue": task_queue})
    )


def _note_interrupts() -> None:
    """Remember a Ctrl-C (durable_rlm/cli/output.py `INTERRUPTED`) before asyncio's own
    handler cancels the command: what the cancellation then raises (the SDK wraps it in
    errors of its own) reads as the interruption it is. SIGTERM (a service manager, `kill`)
    cancels the command the same way, instead of killing it without a word: `drlm run`
    says how its episode goes on, and its worker stops as on Ctrl-C."""
    command = asyncio.current_task()

    def on_sigterm() -> None:
        INTERRUPTED.append(signal.SIGTERM)
        if command is not None:
            command.cancel()

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, on_sigterm)
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):
        return  # SIGINT ignored (a background job of a shell): nothing will interrupt

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        INTERRUPTED.append(signum)
        previous(signum, frame)

    signal.signal(signal.SIGINT, on_sigint)
