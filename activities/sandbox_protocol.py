"""The host's side of the sandbox channel: frames read into a box bounded in bytes, and
each frame checked field by field before anything reads it.

The sandbox's own code may have been changed by a cell, so nothing it sends is trusted:
- a frame is taken whole only while the frames held (read, not yet taken) stay within
  SANDBOX_IN_FLIGHT_BYTES; past that the host stops reading and the sandbox blocks on its
  pipe (the box was bounded by count: ten 200 MB frames took the worker up 802 MB);
- every frame must be one of the ops the sandbox may send, with each field of its type
  and size (a `call` whose prompts were not strings failed the step with AttributeError):
  a frame that is not is a protocol error, which ends that sandbox's cell and nothing else.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from durable_rlm.activities.sandbox import values
from durable_rlm.activities.sandbox.framing import HEADER
from durable_rlm.workflows import defaults

BROKEN = "_broken"  # a frame the host makes up when the sandbox's output is not a frame

READ_BUFFER = 1024 * 1024
"""The pipe reader's buffer limit: past twice this, reading pauses until a frame is taken
(a frame larger than it is still read whole, into the bytes the box accounts for)."""

FRAME_OVERHEAD = 1024
"""What a frame costs the box beyond its bytes (its objects): a flood of empty frames is
bounded too."""


def broken(error: str) -> dict[str, Any]:
    return {"op": BROKEN, "error": error}


# --- the frames a sandbox may send -------------------------------------------------------


class _Frame(BaseModel):
    # strict: a number is not a string, a list is not a mapping. Unknown fields are ignored.
    model_config = ConfigDict(strict=True, extra="ignore")
    seq: int | None = None


_Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class Ready(_Frame):
    op: Literal["ready"]
    layers: dict[str, str] = {}


class Failed(_Frame):
    op: Literal["failed", "snapshot_failed", "restore_failed", "error"]
    error: str = ""


class Done(_Frame):
    op: Literal["done"]
    status: Literal["ok", "error", "timeout"]
    stdout: str = ""
    stderr: str = ""
    error: str | None = None
    answer: str | None = None
    answer_kind: Literal["final", "final_var", "answer_ready"] | None = None
    submitted: Any = None  # its shape and size are checked where it is read (clip_submitted)
    variables: dict[str, str] = {}
    elapsed: _Seconds = 0.0
    volatile: bool = False


class Call(_Frame):
    op: Literal["call"]
    kind: str = Field(min_length=1, max_length=200)
    prompts: list[str] = Field(min_length=1, max_length=defaults.MAX_PROMPTS_PER_CALL)
    model: str | None = Field(default=None, max_length=1_000)


class Snapshotted(_Frame):
    op: Literal["snapshotted"]
    unsaved: dict[str, tuple[int | None, str]] = {}  # name -> (the cell that bound it, why)


class Restored(_Frame):
    op: Literal["restored"]
    notes: dict[str, str] = {}


class ReplayedCell(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    status: Literal["ok", "error", "timeout"]
    asked: list[tuple[str, str]] = []  # (kind, prompt digest) of each call, in order
    elapsed: _Seconds = 0.0
    volatile: bool = False


class Replayed(_Frame):
    op: Literal["replayed"]
    cells: list[ReplayedCell]


class Variable(_Frame):
    op: Literal["var"]
    found: bool
    value: str | None = None


_FRAMES: TypeAdapter[Any] = TypeAdapter(
    Annotated[
        Ready | Failed | Done | Call | Snapshotted | Restored | Replayed | Variable,
        Field(discriminator="op"),
    ]
)


def decode_frame(body: bytes) -> dict[str, Any]:
    """A frame's body as the host reads it: its size as objects bounded before any is built
    (the wire's decoder counts its values and depth), every field checked, defaults filled;
    a call no larger than MAX_CALL_BYTES, whatever the sandbox's own check said; or a
    BROKEN frame saying what was wrong."""
    try:
        values.check(body, defaults.SANDBOX_FRAME_VALUES, defaults.SANDBOX_FRAME_DEPTH)
    except values.ValueRefused as exc:
        return broken(f"the sandbox sent a frame past the host's bounds: {exc}")
    try:
        frame = _FRAMES.validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_input=False)
        first = errors[0]  # a ValidationError holds one error at least
        where = ".".join(str(part) for part in first["loc"]) or "the frame"
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        return broken(f"the sandbox sent a malformed frame: {where}: {first['msg']}{more}")
    if isinstance(frame, Call) and len(body) > defaults.MAX_CALL_BYTES:
        return broken(
            f"the sandbox sent a call of {len(body):,} bytes, over the {defaults.MAX_CALL_BYTES:,}-byte "
            "limit of one call (MAX_CALL_BYTES)"
        )
    return frame.model_dump()


# --- the box of frames read, not yet taken -------------------------------------------------


class FrameInbox:
    """Frames from one sandbox, in order, held within `budget` bytes. The reader reserves a
    frame's bytes before it reads them; taking a frame frees them. One reader, one taker
    (an episode's steps run one at a time)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.held = 0
        self._items: collections.deque[tuple[bytes | dict[str, Any] | None, int]] = collections.deque()
        self._arrived = asyncio.Event()
        self._taken = asyncio.Event()

    def empty(self) -> bool:
        return not self._items

    async def reserve(self, size: int) -> None:
        """Wait until `size` more bytes fit (a frame alone always fits: the reader refused
        larger ones), then hold them."""
        while self.held and self.held + size > self.budget:
            self._taken.clear()
            await self._taken.wait()
        self.held += size

    def put(self, item: bytes | dict[str, Any] | None, size: int = 0) -> None:
        """Queue what was read (`size` reserved for it), a frame the host made up, or the end
        (None): the last two cost nothing, so the end is always told."""
        self._items.append((item, size))
        self._arrived.set()

    async def get(self) -> bytes | dict[str, Any] | None:
        while not self._items:
            self._arrived.clear()
            await self._arrived.wait()
        item, size = self._items.popleft()
        self.held -= size
        self._taken.set()
        return item


async def read_frames(stream: asyncio.StreamReader, inbox: FrameInbox, max_frame: int) -> None:
    """Frames from the sandbox's stdout into `inbox`, each read only once its bytes fit;
    a frame over `max_frame` is reported as what it is, and ends the reading."""
    try:
        while True:
            header = await stream.readexactly(HEADER.size)
            (length,) = HEADER.unpack(header)
            if length > max_frame:
                inbox.put(
                    broken(f"the sandbox sent a {length:,}-byte frame, over the {max_frame:,}-byte limit")
                )
                return
            await inbox.reserve(length + FRAME_OVERHEAD)
            inbox.put(await stream.readexactly(length), length + FRAME_OVERHEAD)
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        inbox.put(None)
