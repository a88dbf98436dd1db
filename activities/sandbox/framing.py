"""The wire between a sandbox and its host: length-prefixed JSON frames on a pipe.

One module for both ends, so they cannot disagree on the format: the worker imports it as
`durable_rlm.activities.sandbox.framing` (sandbox_protocol.py reads frames with its HEADER, repl writes
them with `encode_frame`), the sandbox loads it with its siblings (child.py). Standard
library only, like everything the sandbox loads.
"""

from __future__ import annotations

import json
import struct
from typing import Any, BinaryIO

HEADER = struct.Struct(">I")
"""A frame's length, before its body: four bytes, big-endian."""

MAX_FRAME_BYTES = 256 * 1024 * 1024
"""Largest frame either end reads from the channel (a snapshot is the largest honest one);
a longer one is a protocol error: the worker kills that sandbox, a sandbox stops. The
worker's own bound on what it holds of one sandbox (defaults.SANDBOX_IN_FLIGHT_BYTES) may
be lower; this is the format's."""


def encode_frame(message: dict[str, Any]) -> bytes:
    # A lone surrogate (a cell printed "\udcff") has no UTF-8: it is sent as "?", not fatal.
    body = json.dumps(message, ensure_ascii=False).encode("utf-8", errors="replace")
    return HEADER.pack(len(body)) + body


def decode_body(body: bytes) -> dict[str, Any]:
    message = json.loads(body.decode("utf-8"))
    if not isinstance(message, dict) or "op" not in message:
        raise ValueError("malformed sandbox frame")
    return message


_SEQ: list[Any] = [None]
"""The sequence number of the host's last request: every frame sent carries it, so the host
knows a frame answers what it asked now, not an earlier request (a frame left in the pipe
by a process a cell forked, say)."""


def numbered(message: dict[str, Any]) -> dict[str, Any]:
    """`message` with the number of the host's last request (`_SEQ`), if it gave one."""
    return {**message, "seq": _SEQ[0]} if _SEQ[0] is not None else message


def read_frame(stream: BinaryIO) -> dict[str, Any] | None:
    """The host's next frame, its number kept for the replies (None: the host is gone)."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (length,) = HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"sandbox frame too large: {length} bytes")
    body = stream.read(length)
    if len(body) < length:
        return None
    message = decode_body(body)
    _SEQ[0] = message.get("seq")
    return message


def write_frame(stream: BinaryIO, message: dict[str, Any]) -> None:
    stream.write(encode_frame(numbered(message)))
    stream.flush()
