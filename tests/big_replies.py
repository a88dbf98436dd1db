"""Model replies of tens of megabytes, for tests: each is built when it is sent (a script that
kept one alive would hold it in the test's process for good), and any of them can be served by
a scripted server in a process of its own (`python -m tests.big_replies NAME`), so that what
the worker holds while it reads one is measured apart from what the server held to send it."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from durable_rlm.scripted import Reply, ScriptedModelServer

MB = 2**20

BIG_REPLIES: dict[str, Callable[[], Reply]] = {
    # The reports' two: a reply of 15 Mi fence lines, and a FINAL of 100 MB that never closes.
    "fence lines": lambda: Reply("```\n" * (15 * MB)),
    "open FINAL": lambda: Reply("FINAL(" + "A" * (100 * 10**6) + ")"),
    # Twelve bytes of JSON a character: the most a body can spend on its text.
    "astral characters": lambda: Reply("\U0001f600" * (8 * 10**6)),
    # 200 MB of text in ~200 KB on the wire.
    "gzip bomb": lambda: Reply("A" * (200 * 10**6), gzip=True),
    # A short text, then a million logprobs after it (~70 MB): the body is cut, the text is whole.
    "logprob flood": lambda: Reply("FINAL(short)", logprobs=[-0.1] * 1_000_000),
}


def serve(name: str) -> None:
    """Serve BIG_REPLIES[name] to every request, print the base URL, run until killed."""
    server = ScriptedModelServer(lambda _request: BIG_REPLIES[name]()).start()
    print(server.base_url, flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    serve(sys.argv[1])
