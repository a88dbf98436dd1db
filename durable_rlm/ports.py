"""A free TCP port on 127.0.0.1, for a process's own listener (the embedded server and its
UI, the SDK's metrics endpoint). The port can be taken by another process before the caller
binds it: callers that bind later retry."""

from __future__ import annotations

import socket

SERVE_POLL_S = 0.05
"""How often a listener's `serve_forever` looks for a stop: with socketserver's default
(0.5 s) every `shutdown()` waited up to half a second, in each process that stops a
listener and in each test's teardown."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
