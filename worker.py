"""`python worker.py`: run episode workflows and activities against TEMPORAL_ADDRESS.

Settings come from the environment (see README). Model credentials live only here, in the
worker's environment; they never enter workflow history.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

from durable_rlm.runtime import connect, running_workers
from durable_rlm.settings import ConfigurationError, Settings


async def serve(settings: Settings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    async with connect(settings) as services, running_workers(services) as repl:
        logging.info(
            "worker polling %s (REPL queue %s) on %s",
            settings.task_queue,
            repl.worker_queue,
            settings.temporal_address,
        )
        print(f"worker ready: {settings.task_queue} / {repl.worker_queue}", flush=True)
        await stop.wait()


def main() -> None:
    logging.basicConfig(level=os.environ.get("DRLM_LOG_LEVEL", "INFO"))
    code = 0
    try:
        settings = Settings.from_env()
        if settings.embedded:
            raise ConfigurationError(
                "worker.py needs TEMPORAL_ADDRESS; without it `drlm run` starts an embedded "
                "server with an in-process worker"
            )
        asyncio.run(serve(settings))
    except ConfigurationError as exc:
        print(f"worker: {exc}", file=sys.stderr)
        code = 2
    # temporalio can crash at interpreter exit after all work is done (sdk-python#300).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
