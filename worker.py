"""`python worker.py`: run episode workflows and activities.

With TEMPORAL_ADDRESS it serves that cluster, waiting (with backoff) until the server
answers, so it can start before the server and outlive its restarts. Without it, it joins
the data directory's shared embedded server, the one `drlm run` uses, from any directory.
Settings come from the environment (README, `drlm info`). Model credentials live only here,
in the worker's environment; they never enter workflow history.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

from durable_rlm.errors import ServerUnavailable
from durable_rlm.runtime import connect, running_workers
from durable_rlm.settings import ConfigurationError, Settings

log = logging.getLogger("worker")

FIRST_WAIT_S = 0.5
LONGEST_WAIT_S = 10.0


async def wait_for_server(settings: Settings, stop: asyncio.Event) -> bool:
    """Until TEMPORAL_ADDRESS answers (False if asked to stop first), saying what it waits for."""
    from durable_rlm.server import answers

    delay, attempt = FIRST_WAIT_S, 0
    while not stop.is_set():
        attempt += 1
        if await answers(str(settings.temporal_address), settings.temporal_namespace):
            return True
        print(
            f"worker: waiting for Temporal at {settings.temporal_address} (TEMPORAL_ADDRESS; "
            f"attempt {attempt}, next in {delay:g} s)",
            file=sys.stderr,
            flush=True,
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
    async with connect(settings) as services, running_workers(services) as repl:
        where = settings.temporal_address or f"the embedded server of {settings.data_dir}"
        log.info("worker polling %s (REPL queue %s) on %s", settings.task_queue, repl.worker_queue, where)
        print(f"worker ready: {settings.task_queue} / {repl.worker_queue}", flush=True)
        await stop.wait()


def main() -> None:
    logging.basicConfig(level=os.environ.get("DRLM_LOG_LEVEL", "INFO"))
    logging.getLogger("alembic").setLevel(logging.WARNING)
    code = 0
    try:
        asyncio.run(serve(Settings.from_env()))
    except ConfigurationError as exc:
        print(f"worker: {exc}", file=sys.stderr)
        code = 2
    except ServerUnavailable as exc:
        print(f"worker: {exc}", file=sys.stderr)
        code = 1
    # temporalio can crash at interpreter exit after all work is done (sdk-python#300).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
