"""`drlm`: run, follow, show and list RLM episodes.

Without TEMPORAL_ADDRESS the commands share the data directory's embedded Temporal server
(durable_rlm/server/embedded.py: started on first use, stopped when idle) and `run`/`resume` work on
the episode in-process. With it, the CLI is only a client and `python worker.py` does the work.

A module per command group adds its commands' parsers, each bound to its handler
(durable_rlm/cli/handlers.py); this one lists them and calls the handler of the command
given. Building the parser imports only light modules: `drlm --help`, a usage error, `drlm
list` and `drlm show` answer without temporalio (issue 36), and each handler imports what
it needs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from typing import NoReturn

from pydantic import ValidationError

from durable_rlm.cli import follow, operations, reading, run, steering, timetravel
from durable_rlm.cli.output import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    FOLLOWING,
    INTERRUPTED,
    ON_INTERRUPT,
    stderr,
)
from durable_rlm.errors import DurableRLMError, ServerUnavailable

_GROUPS = (run, follow, reading, steering, timetravel, operations)
# The order `drlm --help` lists the commands in (and a usage error names them in).
_LISTED = (
    "run demo scripted-server show worker watch ui codec-server config info resume cancel doctor reward "
    "audit-rebuild verify gc hint limits pause finish pending approve reject deployment fork rerun export "
    "list"
).split()


class _Parser(argparse.ArgumentParser):
    """A bad flag is one line (with where to look) and exit 2, not a usage dump."""

    def error(self, message: str) -> NoReturn:
        stderr(f"{self.prog}: {message} (see `{self.prog} --help`)")
        _exit(EXIT_USAGE)
        raise SystemExit(EXIT_USAGE)  # not reached


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="drlm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    adders = {name: add for group in _GROUPS for name, add in group.PARSERS.items()}
    for name in _LISTED:
        adders.pop(name)(sub)
    if adders:
        raise RuntimeError(f"commands missing from drlm's list: {', '.join(adders)}")
    return parser


def main(argv: list[str] | None = None) -> None:
    # The SDK logs every failed activity attempt with a traceback; the CLI reports retries
    # and failures itself. DRLM_LOG_LEVEL brings the logs back.
    logging.basicConfig(level=os.environ.get("DRLM_LOG_LEVEL", "ERROR"))
    logging.getLogger("temporalio").setLevel(os.environ.get("DRLM_LOG_LEVEL", "CRITICAL"))
    try:
        args = build_parser().parse_args(argv)
        code = args.handler(args)
    except KeyboardInterrupt:
        code = _interrupted()
    except asyncio.CancelledError:  # SIGTERM cancelled the command (durable_rlm/cli/handlers.py)
        if not INTERRUPTED:
            raise
        code = _interrupted()
    except BrokenPipeError:
        code = EXIT_OK  # `drlm list | head`: the reader has what it wanted
    except Exception as exc:  # noqa: BLE001 - every error ends as one line and an exit code
        code = _interrupted() if _from_interrupt(exc) else _report(exc)
    _exit(code)


def _from_interrupt(exc: BaseException) -> bool:
    """An error that Ctrl-C caused: the SDK turns the cancellation of a call in flight into
    an error of its own (an update's `WorkflowUpdateRPCTimeoutOrCancelledError`), which must
    read as the interruption it is, not as a traceback."""
    if not INTERRUPTED:
        return False
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, asyncio.CancelledError | KeyboardInterrupt):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def _report(exc: Exception) -> int:
    """One line on stderr, and the exit code: 2 for what the user can fix in the command or
    the settings (nothing was started), 1 for a failure of the environment."""
    policy = sys.modules.get("durable_rlm.workflows.termination")
    rpc = sys.modules.get("temporalio.service")
    if isinstance(exc, ServerUnavailable):
        stderr(f"drlm: {exc}")
        return EXIT_FAILED
    from durable_rlm.store.outages import store_problem  # start-up: SQLAlchemy (~0.2 s)

    problem = store_problem(exc)
    if problem is not None:  # one line, not a traceback: wait for the store, or free it
        stderr(f"drlm: the store is unavailable: {problem}")
        return EXIT_FAILED
    if isinstance(exc, DurableRLMError | ValidationError) or (policy and isinstance(exc, policy.PolicyError)):
        stderr(f"drlm: {_explain(exc)}")
        return EXIT_USAGE
    if isinstance(exc, LookupError):
        stderr(f"drlm: {exc.args[0] if type(exc) is KeyError and exc.args else exc}")
        return EXIT_USAGE
    if rpc is not None and isinstance(exc, rpc.RPCError):
        stderr(f"drlm: Temporal error: {exc}")
        return EXIT_FAILED
    raise exc


def _interrupted() -> int:
    """What Ctrl-C (or SIGTERM) leaves: one line, or for a followed episode what to do next;
    the exit code is the shell's for that signal (130, 143)."""
    signum = INTERRUPTED[-1] if INTERRUPTED else signal.SIGINT
    code = EXIT_INTERRUPTED if signum == signal.SIGINT else 128 + signum
    if ON_INTERRUPT:
        stderr(ON_INTERRUPT[-1])
        return code
    how = "interrupted" if signum == signal.SIGINT else f"stopped ({signal.Signals(signum).name})"
    if not FOLLOWING:
        stderr(f"drlm: {how}")
        return code
    episode = FOLLOWING[-1]
    stderr(
        f"drlm: {how}; episode {episode} goes on (its history keeps every step).\n"
        f"  follow it:   drlm watch {episode}\n"
        f"  work on it:  drlm resume {episode}   (until then only a worker on its task queue does)\n"
        f"  stop it:     drlm cancel {episode}"
    )
    return code


def _exit(code: int) -> None:
    """Flush and leave: temporalio can crash at interpreter exit after all work is done
    (sdk-python#300); a closed stdout (`| head`) is not an error. Telemetry first: os._exit
    skips its providers' exit hook, and a short `drlm run` exported 4 of its ~52 spans."""
    if (telemetry := sys.modules.get("durable_rlm.telemetry.otel")) is not None:  # set up only if used
        telemetry.shutdown_current()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):
            with contextlib.suppress(OSError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
    os._exit(code)


def _explain(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'value'}: {err['msg']}" for err in exc.errors()
        )
        return f"invalid episode request: {problems}"
    return str(exc)
