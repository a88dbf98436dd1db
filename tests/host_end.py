"""The host's end of a sandbox's channel, in process: the sandbox's HostCalls on real pipes,
and a thread that reads each frame it writes, decodes it as the worker does
(activities/sandbox_protocol.py) and answers. The calls a cell makes are then tested without
a sandbox process: the mutation run needs that (a sandbox child cannot load a mutated
module), and it costs milliseconds, not a sandbox's start."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from durable_rlm.activities.sandbox.framing import HEADER, encode_frame
from durable_rlm.activities.sandbox.host_calls import HostCalls
from durable_rlm.activities.sandbox_protocol import decode_frame

Reply = Callable[[dict[str, Any]], dict[str, Any]]


def upper(frame: dict[str, Any]) -> dict[str, Any]:
    """Every prompt answered, in upper case: what tests/conftest.py's Episode answers too."""
    return {"op": "answers", "answers": [{"ok": True, "text": p.upper()} for p in frame.get("prompts") or []]}


class HostEnd:
    """Answers every frame with `reply(frame)` after `delay_s`, so a call the cell should have
    refused comes back instead of raising. `frames` are the frames as the worker decoded
    them; `timers` the cell's interval timer as the host saw it while each call waited."""

    def __init__(self, reply: Reply = upper, delay_s: float = 0.0) -> None:
        to_sandbox, self._answers = os.pipe()
        self._calls, from_sandbox = os.pipe()
        self.calls = HostCalls(open(to_sandbox, "rb"), open(from_sandbox, "wb"))  # noqa: SIM115 - closed by close()
        self.frames: list[dict[str, Any]] = []
        self.timers: list[float] = []
        self._reply = reply
        self._delay_s = delay_s
        self._thread = threading.Thread(target=self._serve, name="host-end", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        with open(self._calls, "rb") as calls, open(self._answers, "wb") as answers:
            while len(header := calls.read(HEADER.size)) == HEADER.size:
                frame = decode_frame(calls.read(HEADER.unpack(header)[0]))
                self.frames.append(frame)
                self.timers.append(signal.getitimer(signal.ITIMER_REAL)[0])
                time.sleep(self._delay_s)
                answers.write(encode_frame(self._reply(frame)))
                answers.flush()

    def close(self) -> list[dict[str, Any]]:
        """End the channel; the frames the host read."""
        self.calls.channel_out.close()
        self._thread.join(10)
        self.calls.channel_in.close()
        return self.frames

    def __enter__(self) -> HostEnd:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
