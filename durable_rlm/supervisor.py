"""The embedded server's supervisor: `python -m durable_rlm.supervisor`.

Started detached by the first client of a data directory (durable_rlm/server/embedded.py
`acquire`), it owns the shared dev server: it starts it with the episode search attributes,
serves the Web UI's codec endpoint and the episode pages beside it, and stops it
`server_idle_s` after the last client's lease ended, first keeping the timelines `drlm
show` needs without a server. It sits above the viewer and the audit rooms because it hosts
them; the server room below it knows only how to run and share the server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from typing import Any

from durable_rlm.host.processes import start_time
from durable_rlm.server.embedded import EmbeddedServer, ServerFiles, try_lock, ui_port
from durable_rlm.settings import ConfigurationError, Settings
from durable_rlm.workflows.names import SEARCH_ATTRIBUTES  # without temporalio: see there

log = logging.getLogger(__name__)

AFTER_START_NICENESS = 10


async def supervise(settings: Settings, poll_s: float = 0.5) -> int:
    files = ServerFiles.of(settings)
    ui = ui_port(settings.ui_port) if settings.ui else None
    registered = tuple(
        a for name, kind in SEARCH_ATTRIBUTES for a in ("--search-attribute", f"{name}={kind}")
    )
    # The codec server comes up after the Temporal server answers and the clients were told
    # its address: its modules and the stores take ~0.6 s, which no client waits for. Its
    # port is held from now (bound, not listening), so the URL the UI is given stays ours.
    held = _held_port() if ui is not None else None
    secret = files.read_codec_secret() if ui is not None else None
    server = EmbeddedServer(
        settings.temporal_db_file,
        settings.temporal_namespace,
        extra_args=registered,  # the UI's episode list filters on them
        die_with_parent=True,
        ui_port=ui,
        codec_endpoint=f"http://127.0.0.1:{held.getsockname()[1]}/{secret}" if held is not None else None,
        private=True,
    )
    codec = None
    try:
        address = await server.start()
        _publish(settings, files, server, address)
        # From here the supervisor serves the UI's codec endpoint and watches leases: nothing
        # a client waits for. Its niceness lets the clients and the server (started above at
        # the normal priority) go first on a busy machine; the codec server's own start
        # (~0.6 s of CPU) otherwise competed with the very client that started the server.
        os.nice(AFTER_START_NICENESS)
        if ui is not None and held is not None:
            codec = _codec_server(settings, ui, secret, held)
        return await _serve(settings, files, server, address, poll_s)
    finally:
        if held is not None:
            held.close()
        if codec is not None:
            codec.stop()


def _held_port() -> socket.socket:
    """A port of 127.0.0.1 held for the codec server: bound with SO_REUSEADDR and never
    listening, so no other process binds it (nor gets it as a free port) while the codec
    server, which binds it the same way, is made."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def _codec_server(settings: Settings, ui: int, secret: str | None, held: socket.socket) -> Any:
    """The UI's codec endpoint: claim-checked payloads and contexts shown as their content,
    to the owner's uid with the capability only (it opens DRLM_ENCRYPTION_KEYS' payloads).
    Made once the server's clients run (see `supervise`); until then the UI shows payloads
    as stored. A codec server that cannot start leaves the Temporal server serving."""
    from durable_rlm.server.connection import open_stores  # start-up: after the clients were told
    from durable_rlm.viewer.codec_server import CodecServer, ui_origins  # start-up: as above
    from durable_rlm.viewer.episode_page import EpisodePages  # start-up: as above

    try:
        blobs, engine = open_stores(settings)
        codec = CodecServer(
            blobs,
            port=held.getsockname()[1],
            origins=ui_origins(ui),
            threshold=settings.claim_check_threshold,
            path_secret=secret,
            owner_uid=os.getuid(),
            pages=EpisodePages(settings, blobs, engine),  # the episode pages, behind the same capability
        ).start()
    except Exception:  # noqa: BLE001 - the UI's endpoint, not the server its clients need
        log.exception("the codec server did not start: the Web UI shows payloads as stored")
        return None
    held.close()
    return codec


def _publish(settings: Settings, files: ServerFiles, server: EmbeddedServer, address: str) -> None:
    """The state file clients wait for (durable_rlm/server/embedded.py `acquire`)."""
    assert server.process is not None
    me = os.getpid()
    files.write_state(
        {
            "address": address,
            "pid": me,
            "started": start_time(me),
            "server_pid": server.process.pid,
            "server_started": start_time(server.process.pid),
            "db_file": str(settings.temporal_db_file),
            "ui": server.ui_url,
            "codec": server.codec_endpoint,
            "private": server.private,
        }
    )


async def _serve(
    settings: Settings, files: ServerFiles, server: EmbeddedServer, address: str, poll_s: float
) -> int:
    assert server.process is not None
    me = os.getpid()
    log.info("serving %s for %s", address, settings.data_dir)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    busy_at = time.monotonic()
    code = 0
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), poll_s)
        if server.process.returncode is not None:
            log.error("the Temporal server exited (code %s)", server.process.returncode)
            code = 1
            break
        if files.live_leases():
            busy_at = time.monotonic()
            continue
        if time.monotonic() - busy_at < settings.server_idle_s:
            continue
        await _before_stop(settings, address)
        with try_lock(files.lock) as locked:
            # Under the lock no client can add a lease: stop only if there is still none.
            if locked and not files.live_leases():
                files.state.unlink(missing_ok=True)
                await server.stop()
                log.info("idle for %.0f s: stopped", settings.server_idle_s)
                return 0
    if (files.read_state() or {}).get("pid") == me:
        files.state.unlink(missing_ok=True)
    await server.stop()
    return code


async def _before_stop(settings: Settings, address: str) -> None:
    """Keep what `drlm show` needs to answer without a server: the timelines of episodes
    that ended (best effort; history stays the record)."""
    from durable_rlm.audit.projection import cache_closed_timelines  # start-up: needed only at the end

    try:
        # Also settles audit rows of episodes that ended without writing theirs.
        await asyncio.wait_for(cache_closed_timelines(settings, address), 60)
    except Exception:  # noqa: BLE001
        log.warning("timelines not cached before stopping", exc_info=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m durable_rlm.supervisor", description=__doc__.splitlines()[0]
    )
    parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    try:
        code = asyncio.run(supervise(Settings.from_env()))
    except ConfigurationError as exc:
        log.error("%s", exc)
        code = 2
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # temporalio can crash at interpreter exit (sdk-python#300)


if __name__ == "__main__":
    main()
