"""`python worker.py` (or `drlm worker`, `python -m durable_rlm.worker.main`): run episode
workflows and activities.

With TEMPORAL_ADDRESS it serves that cluster, waiting (with backoff) until the server
answers, so it can start before the server and outlive its restarts. Without it, it joins
the data directory's shared embedded server, the one `drlm run` uses, from any directory.
Settings come from the environment (README, `drlm info`). Model credentials live only here,
in the worker's environment; they never enter workflow history.

Its output never stops it: stdout carries only "worker ready" and the drain's report; every
log record, its own, the SDK's and the SDK core's (forwarded from Rust), goes through one
bounded path to stderr (durable_rlm/telemetry/log_path.py `LogPath`), which drops and counts rather
than wait, and writes repeated warnings a few times a minute with a count. DRLM_LOG_LEVEL
(default INFO) sets its level; at DEBUG the core's debug logs come too.

SIGTERM (or SIGINT) drains it: it stops polling, lets the calls and REPL steps in flight
finish for up to `defaults.DRAIN_GRACE_S`, closes its sandboxes, prints what it drained and
exits 0; its episodes go on on other workers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys

from durable_rlm.activities.repl import ReplActivities
from durable_rlm.activities.sandbox_slots import default_max_sandboxes
from durable_rlm.errors import ServerUnavailable
from durable_rlm.host.owned_dirs import UnsafeDirectory
from durable_rlm.server.embedded import answers
from durable_rlm.settings import ConfigurationError, Settings
from durable_rlm.telemetry.log_path import close_log_path, install_log_path
from durable_rlm.telemetry.otel import shutdown_current
from durable_rlm.worker.pool import process_count, supervise
from durable_rlm.worker.runtime import DrainReport, connect, running_workers
from durable_rlm.workflows import defaults

log = logging.getLogger("worker")

FIRST_WAIT_S = 0.5
LONGEST_WAIT_S = 10.0
LEAVE_AFTER_GRACE_S = 3.0
"""After the drain's grace: time for the calls the SDK cancels to report it (a cancelled
HTTP request ends at once) and for the sandboxes to close."""


async def wait_for_server(settings: Settings, stop: asyncio.Event) -> bool:
    """Until TEMPORAL_ADDRESS answers (False if asked to stop first), saying what it waits for."""
    delay, attempt = FIRST_WAIT_S, 0
    while not stop.is_set():
        attempt += 1
        if await answers(str(settings.temporal_address), settings.temporal_namespace):
            return True
        log.warning(
            "waiting for Temporal at %s (TEMPORAL_ADDRESS; attempt %d, next in %g s)",
            settings.temporal_address,
            attempt,
            delay,
        )
        try:
            await asyncio.wait_for(stop.wait(), delay)
        except TimeoutError:
            delay = min(delay * 2, LONGEST_WAIT_S)
    return False


async def serve(settings: Settings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    if settings.temporal_address and not await wait_for_server(settings, stop):
        return
    grace = defaults.DRAIN_GRACE_S
    drained: list[DrainReport] = []
    async with (
        connect(settings) as services,
        running_workers(services, drain_grace_s=grace, on_drained=drained.append) as repl,
    ):
        where = settings.temporal_address or f"the embedded server of {settings.data_dir}"
        log.info("worker polling %s (REPL queue %s) on %s", settings.task_queue, repl.worker_queue, where)
        print(f"worker ready: {settings.task_queue} / {repl.worker_queue}", flush=True)
        layers = asyncio.create_task(report_layers(repl))
        await stop.wait()
        layers.cancel()  # and waited for: its sandbox must be gone before the drain closes the rest
        with contextlib.suppress(BaseException):
            await layers
        log.warning("draining (grace %g s; signal again to leave now)", grace)
        leave_by(loop, grace + LEAVE_AFTER_GRACE_S)
    print(f"worker {drained[0].describe()}" if drained else "worker stopped", flush=True)


async def report_layers(repl: ReplActivities) -> None:
    """Say at start which sandbox layers this worker's privileges allow (`drlm doctor` says
    it at length): a worker without a layer runs, and says so."""
    try:
        layers = await repl.probe()
    except Exception as exc:  # noqa: BLE001 - told; the first step will fail the same way
        log.error("a sandbox could not start: %s", exc)
        return
    shown = ", ".join(f"{name}: {value}" for name, value in layers.items())
    weak = layers.get("network") == "none" or not layers.get("filesystem", "").startswith("private root")
    if weak:
        log.warning("sandbox layers (WEAKER: see drlm doctor): %s", shown)
    else:
        log.info("sandbox layers: %s", shown)


def leave_by(loop: asyncio.AbstractEventLoop, seconds: float) -> None:
    """Exit at once when the drain outlasts `seconds` (a local REPL step still running: the
    SDK never cancels one) or on a second signal, as after a crash: the episode's workflow
    task times out and another worker re-runs the step, rebuilding the REPL from the log. No
    sandbox is closed first, and the loop gets no further turn: a step that saw its sandbox
    closed would log its cell as killed. The sandboxes die with this process (their
    parent-death signal), and a live worker reaps their directory."""

    def leave(why: str) -> None:
        log.warning("%s; leaving the work in flight to other workers", why)
        shutdown_current(1.0)  # the spans of the steps that did finish
        close_log_path(0.5)
        sys.stdout.flush()
        os._exit(1)

    loop.call_later(seconds, leave, f"drain not done after {seconds:g} s")
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, leave, f"signal {signal.Signals(signum).name} while draining")


def main(argv: list[str] | None = None, prog: str = "worker.py") -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--processes",
        default=os.environ.get("DRLM_WORKER_PROCESSES", "1"),
        help="worker processes under one supervisor: a number, or auto (one per core); "
        "default DRLM_WORKER_PROCESSES or 1 (durable_rlm/worker/pool.py)",
    )
    args = parser.parse_args(argv)
    try:
        processes = process_count(args.processes)
    except ValueError as exc:
        parser.error(str(exc))
    if processes > 1:
        _exit(supervised(processes))
    code = 0
    try:
        # Before any Temporal client: the SDK core's logs are forwarded into this path too.
        install_log_path(os.environ.get("DRLM_LOG_LEVEL", "INFO"))
        logging.getLogger("alembic").setLevel(logging.WARNING)
        asyncio.run(serve(Settings.from_env()))
    except (ConfigurationError, UnsafeDirectory) as exc:
        print(f"worker: {exc}", file=sys.stderr)
        code = 2
    except ServerUnavailable as exc:
        log.error("%s", exc)
        code = 1
    shutdown_current()  # os._exit skips the providers' own exit hook
    close_log_path()
    _exit(code)


def supervised(processes: int) -> int:
    """N workers under one supervisor, sharing this machine's sandbox budget."""
    try:
        settings = Settings.from_env()
    except ConfigurationError as exc:
        print(f"worker: {exc}", file=sys.stderr)
        return 2
    total = settings.max_sandboxes or default_max_sandboxes()
    child = [sys.executable, "-m", "durable_rlm.worker.main", "--processes", "1"]
    return supervise(processes, os.environ, total, settings.sandbox_budget_mb, child)


def _exit(code: int) -> None:
    # temporalio can crash at interpreter exit after all work is done (sdk-python#300).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
