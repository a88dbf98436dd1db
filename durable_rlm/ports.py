"""A free TCP port on 127.0.0.1, for a process's own listener (the embedded server and its
UI, the SDK's metrics endpoint). The port can be taken by another process before the caller
binds it: callers that bind later retry."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

SERVE_POLL_S = 0.05
"""How often a listener's `serve_forever` looks for a stop: with socketserver's default
(0.5 s) every `shutdown()` waited up to half a second, in each process that stops a
listener and in each test's teardown."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_listening(url: str, timeout_s: float = 10.0) -> bool:
    """Whether the listener of an http://HOST:PORT/... URL accepts a connection within
    `timeout_s`: the supervisor's codec server and pages listen a moment after its Temporal
    server answers (durable_rlm/supervisor.py), so a client that calls them right after a
    cold start waits for them here."""
    parts = urlsplit(url)
    address = (parts.hostname or "127.0.0.1", parts.port or 80)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(address, timeout=1.0):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
