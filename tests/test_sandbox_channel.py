"""The channel between a sandbox and its worker, in process and on real pipes: the wire's
frames (activities/sandbox/framing.py, both ends), the worker's reader that holds a sandbox's
frames within a byte budget, and its decoder that checks every field before anything reads
it (activities/sandbox_protocol.py). The same code runs against hostile sandboxes end to end
in tests/test_host_protocol.py and tests/test_frame_bounds.py."""

from __future__ import annotations

import asyncio
import io
import json
import os
import threading
from collections.abc import AsyncIterator, Iterator

import pytest

from durable_rlm.activities.sandbox import framing
from durable_rlm.activities.sandbox.framing import (
    HEADER,
    MAX_FRAME_BYTES,
    decode_body,
    encode_frame,
    numbered,
    read_frame,
    write_frame,
)
from durable_rlm.activities.sandbox_protocol import (
    BROKEN,
    FRAME_OVERHEAD,
    READ_BUFFER,
    FrameInbox,
    broken,
    decode_frame,
    read_frames,
)
from durable_rlm.workflows import defaults


@pytest.fixture(autouse=True)
def _no_request_number() -> Iterator[None]:
    """The framing's request number is the process's: each test starts without one."""
    framing._SEQ[0] = None
    yield
    framing._SEQ[0] = None


# --- the wire's frames --------------------------------------------------------------------------


def test_a_frame_is_its_length_big_endian_then_its_json() -> None:
    frame = encode_frame({"op": "done", "stdout": "héllo"})
    body = '{"op": "done", "stdout": "héllo"}'.encode()  # UTF-8 as it is, not \\u escapes
    assert frame == len(body).to_bytes(4, "big") + body
    assert HEADER.size == 4 and HEADER.unpack(frame[:4]) == (len(body),)


def test_a_lone_surrogate_is_sent_as_a_question_mark_not_a_crash() -> None:
    frame = encode_frame({"op": "done", "stdout": "a\udcffb"})
    assert json.loads(frame[4:]) == {"op": "done", "stdout": "a?b"}


@pytest.mark.parametrize("body", [b"[1, 2]", b'"op"', b'{"kind": "call"}', b"7"])
def test_a_body_that_is_no_object_with_an_op_is_malformed(body: bytes) -> None:
    with pytest.raises(ValueError, match="^malformed sandbox frame$"):
        decode_body(body)


def test_a_body_is_utf8_json() -> None:
    assert decode_body('{"op": "ready", "x": "é"}'.encode()) == {"op": "ready", "x": "é"}
    with pytest.raises(UnicodeDecodeError):
        decode_body(b'{"op": "\xff"}')


def test_frames_carry_the_number_of_the_hosts_last_request_once_it_gave_one() -> None:
    message = {"op": "done"}
    assert numbered(message) == {"op": "done"}
    framing._SEQ[0] = 0  # a number, even 0, is carried
    assert numbered(message) == {"op": "done", "seq": 0}
    assert message == {"op": "done"}  # the message itself is left as it was


def pipe() -> tuple[io.BufferedReader, io.BufferedWriter]:
    read_end, write_end = os.pipe()
    return open(read_end, "rb"), open(write_end, "wb")  # noqa: SIM115 - the caller closes them


def test_a_frame_written_on_a_pipe_reads_back_and_its_number_answers_the_next() -> None:
    reader, writer = pipe()
    with reader, writer:
        write_frame(writer, {"op": "exec", "code": "x = 1", "seq": 7})  # unflushed, it would wait
        assert read_frame(reader) == {"op": "exec", "code": "x = 1", "seq": 7}
        assert framing._SEQ[0] == 7
        write_frame(writer, {"op": "done"})
        assert read_frame(reader) == {"op": "done", "seq": 7}  # the reply carries the request's number
        writer.write(encode_frame({"op": "exec"}))  # a request without a number: the replies carry none
        writer.flush()
        read_frame(reader)
        assert framing._SEQ[0] is None
        writer.close()
        assert read_frame(reader) is None  # the host is gone


@pytest.mark.parametrize(
    "data",
    [b"", b"\x00\x00", HEADER.pack(10) + b"short", HEADER.pack(MAX_FRAME_BYTES) + b"{}"],
    ids=["nothing", "half a header", "half a body", "the largest frame, cut short"],
)
def test_a_channel_that_ends_mid_frame_reads_as_the_host_gone(data: bytes) -> None:
    assert read_frame(io.BytesIO(data)) is None


def test_a_frame_longer_than_the_format_allows_is_refused_unread() -> None:
    with pytest.raises(ValueError) as refused:
        read_frame(io.BytesIO(HEADER.pack(MAX_FRAME_BYTES + 1) + b"{}"))
    assert str(refused.value) == f"sandbox frame too large: {MAX_FRAME_BYTES + 1} bytes"


# --- the worker's decoder ------------------------------------------------------------------------


def test_a_frame_the_host_made_up_says_what_was_wrong() -> None:
    assert broken("why") == {"op": BROKEN, "error": "why"}


def test_a_frame_is_read_with_its_defaults_filled() -> None:
    assert decode_frame(b'{"op": "done", "status": "ok", "seq": 3, "extra": 1}') == {
        "seq": 3,
        "op": "done",
        "status": "ok",
        "stdout": "",
        "stderr": "",
        "error": None,
        "answer": None,
        "answer_kind": None,
        "submitted": None,
        "variables": {},
        "elapsed": 0.0,
        "volatile": False,
    }
    assert decode_frame(b'{"op": "call", "kind": "llm_query", "prompts": ["a"]}') == {
        "seq": None,
        "op": "call",
        "kind": "llm_query",
        "prompts": ["a"],
        "model": None,
    }


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (
            b'{"op": "call", "kind": "llm_query", "prompts": "ab"}',
            "call.prompts: Input should be a valid array",
        ),
        (
            b'{"op": "call", "kind": "llm_query", "prompts": [1, 2]}',
            "call.prompts.0: Input should be a valid string (and 1 more)",
        ),
        (
            b'{"op": "shell"}',
            "the frame: Input tag 'shell' found using 'op' does not match any of the expected",
        ),
        (b"[1]", "the frame: Input should be an object"),
        (b"{", "the frame: Invalid JSON: EOF while parsing an object at line 1 column 1"),
    ],
)
def test_a_malformed_frame_is_broken_and_names_its_first_problem(body: bytes, error: str) -> None:
    frame = decode_frame(body)
    assert frame["op"] == BROKEN
    assert frame["error"].startswith(f"the sandbox sent a malformed frame: {error}"), frame["error"]


def test_a_frame_with_one_problem_names_it_alone() -> None:
    assert decode_frame(b'{"op": "call", "kind": "llm_query", "prompts": "ab"}') == broken(
        "the sandbox sent a malformed frame: call.prompts: Input should be a valid array"
    )


def test_a_frame_past_the_hosts_bounds_is_refused_before_it_is_parsed() -> None:
    values = decode_frame(
        b'{"op": "done", "status": "ok", "submitted": [' + b"0," * defaults.SANDBOX_FRAME_VALUES + b"0]}"
    )
    assert values == broken(
        "the sandbox sent a frame past the host's bounds: "
        f"more than {defaults.SANDBOX_FRAME_VALUES:,} values in one document"
    )
    deep = defaults.SANDBOX_FRAME_DEPTH  # the frame's own object is one level
    within = b'{"op": "done", "status": "ok", "submitted": ' + b"[" * (deep - 1) + b"]" * (deep - 1) + b"}"
    assert decode_frame(within)["op"] == "done"
    past = b'{"op": "done", "status": "ok", "submitted": ' + b"[" * deep + b"]" * deep + b"}"
    assert decode_frame(past) == broken(
        f"the sandbox sent a frame past the host's bounds: nested more than {deep} deep"
    )


def test_a_frames_depth_bound_is_the_sandboxs_setting_not_the_wires_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The host reads its own setting each time, whatever the wire module's default is."""
    monkeypatch.setattr(defaults, "SANDBOX_FRAME_DEPTH", 10)
    within = b'{"op": "done", "status": "ok", "submitted": ' + b"[" * 9 + b"]" * 9 + b"}"
    assert decode_frame(within)["op"] == "done"
    past = b'{"op": "done", "status": "ok", "submitted": ' + b"[" * 10 + b"]" * 10 + b"}"
    assert decode_frame(past) == broken(
        "the sandbox sent a frame past the host's bounds: nested more than 10 deep"
    )


def test_a_call_frame_is_at_most_max_call_bytes_whatever_the_sandbox_checked() -> None:
    def call(size: int) -> bytes:
        head = b'{"op": "call", "kind": "llm_query", "prompts": ["'
        return head + b"x" * (size - len(head) - 3) + b'"]}'

    limit = defaults.MAX_CALL_BYTES
    assert decode_frame(call(limit))["op"] == "call"
    assert decode_frame(call(limit + 1)) == broken(
        f"the sandbox sent a call of {limit + 1:,} bytes, over the {limit:,}-byte limit of one call "
        "(MAX_CALL_BYTES)"
    )
    other = b'{"op": "done", "status": "ok", "stdout": "' + b"x" * limit + b'"}'
    assert decode_frame(other)["op"] == "done"  # the limit is a call's: other frames have their own


# --- the worker's box of frames --------------------------------------------------------------------


async def test_frames_come_out_of_the_box_in_order_and_free_their_bytes() -> None:
    inbox = FrameInbox(budget=100)
    assert inbox.empty() and inbox.held == 0 and inbox.budget == 100
    await inbox.reserve(30)
    inbox.put(b"one", 30)
    inbox.put({"op": BROKEN, "error": "made up"})  # costs nothing
    assert not inbox.empty() and inbox.held == 30
    assert await inbox.get() == b"one" and inbox.held == 0
    assert await inbox.get() == {"op": BROKEN, "error": "made up"}
    assert inbox.empty()
    waiting = asyncio.create_task(inbox.get())
    await asyncio.sleep(0)
    assert not waiting.done()  # nothing yet: the taker waits for the reader
    inbox.put(None)
    assert await asyncio.wait_for(waiting, 1) is None


async def test_the_box_takes_up_to_its_budget_exactly_then_waits_for_a_taker() -> None:
    inbox = FrameInbox(budget=100)
    await asyncio.wait_for(inbox.reserve(60), 1)
    inbox.put(b"a", 60)
    await asyncio.wait_for(inbox.reserve(40), 1)  # 100 of 100: fits
    inbox.put(b"b", 40)
    third = asyncio.create_task(inbox.reserve(1))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not third.done() and inbox.held == 100
    assert await inbox.get() == b"a"
    await asyncio.wait_for(third, 1)
    assert inbox.held == 41


async def test_the_frame_queue_reads_no_further_than_its_budget() -> None:
    """A sandbox that writes frames faster than its host takes them: the reader stops at the
    budget (the bytes wait in the pipe, in the sandbox's memory), and goes on as frames are
    taken. With the bound removed, all of them would sit in the worker's memory."""
    frame = b"x" * 4_000
    size = len(frame) + FRAME_OVERHEAD
    stream = asyncio.StreamReader()
    for _ in range(10):
        stream.feed_data(HEADER.pack(len(frame)) + frame)
    stream.feed_eof()
    inbox = FrameInbox(budget=3 * size)
    reader = asyncio.create_task(read_frames(stream, inbox, max_frame=1 << 20))
    for _ in range(20):
        await asyncio.sleep(0)
    assert inbox.held == 3 * size and not reader.done()  # three frames in, seven wait
    taken = [await inbox.get() for _ in range(10)]
    assert taken == [frame] * 10 and inbox.held <= 3 * size
    assert await inbox.get() is None  # and the end is told
    await reader


async def test_one_frame_larger_than_the_budget_still_passes_alone() -> None:
    """The budget never deadlocks a frame within the frame limit: alone, it always fits."""
    inbox = FrameInbox(budget=10)
    await asyncio.wait_for(inbox.reserve(1_000), 1)
    inbox.put(b"big", 1_000)
    second = asyncio.create_task(inbox.reserve(5))
    await asyncio.sleep(0)
    assert not second.done()  # waits while the big one is held
    assert await inbox.get() == b"big"
    await asyncio.wait_for(second, 1)


# --- the worker's reader, on a real pipe ------------------------------------------------------------


class Sandbox:
    """The sandbox's end of its stdout, on a real pipe: a thread writes what the test gives."""

    def __init__(self) -> None:
        self.read_end, self._write_end = os.pipe()
        self._writer = open(self._write_end, "wb")  # noqa: SIM115 - closed by close()

    def send(self, data: bytes) -> threading.Thread:
        def write() -> None:
            try:
                self._writer.write(data)
                self._writer.flush()
            except (BrokenPipeError, ValueError):
                pass  # the reader went away, or the test closed the pipe

        thread = threading.Thread(target=write, daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        try:
            self._writer.close()
        except BrokenPipeError:
            pass


@pytest.fixture
async def sandbox() -> AsyncIterator[tuple[Sandbox, asyncio.StreamReader]]:
    """A sandbox's pipe, read by the worker's stream reader (READ_BUFFER, as a sandbox's)."""
    end = Sandbox()
    stream = asyncio.StreamReader(limit=READ_BUFFER)
    transport, _ = await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(stream), open(end.read_end, "rb")
    )
    yield end, stream
    end.close()
    transport.close()


async def take(inbox: FrameInbox) -> list[object]:
    taken = []
    while (item := await asyncio.wait_for(inbox.get(), 10)) is not None:
        taken.append(item)
    return taken


async def test_the_reader_takes_each_frame_whole_and_tells_the_end(sandbox) -> None:
    end, stream = sandbox
    inbox = FrameInbox(defaults.SANDBOX_IN_FLIGHT_BYTES)
    reader = asyncio.create_task(read_frames(stream, inbox, max_frame=1 << 20))
    frames = [encode_frame({"op": "ready"}), encode_frame({"op": "done", "stdout": "x" * 100_000})]
    await asyncio.to_thread(end.send(b"".join(frames)).join, 10)  # the loop reads as it writes
    end.close()
    assert await take(inbox) == [f[4:] for f in frames]
    await asyncio.wait_for(reader, 10)
    assert inbox.held == 0


async def test_a_frame_cut_short_by_the_sandboxs_end_is_dropped_and_the_end_told(sandbox) -> None:
    end, stream = sandbox
    inbox = FrameInbox(defaults.SANDBOX_IN_FLIGHT_BYTES)
    reader = asyncio.create_task(read_frames(stream, inbox, max_frame=1 << 20))
    await asyncio.to_thread(end.send(encode_frame({"op": "ready"}) + HEADER.pack(100) + b"cut").join, 10)
    end.close()
    assert await take(inbox) == [b'{"op": "ready"}']
    await asyncio.wait_for(reader, 10)


async def test_a_frame_over_the_limit_is_reported_from_its_header_and_ends_the_reading(sandbox) -> None:
    end, stream = sandbox
    inbox = FrameInbox(defaults.SANDBOX_IN_FLIGHT_BYTES)
    reader = asyncio.create_task(read_frames(stream, inbox, max_frame=1_000))
    at_limit = b"{" + b" " * 998 + b"}"
    writer = end.send(HEADER.pack(1_000) + at_limit + HEADER.pack(1_001) + b"x" * 1_001 + encode_frame({}))
    taken = await take(inbox)
    assert taken == [
        at_limit,  # exactly the limit is a frame
        broken("the sandbox sent a 1,001-byte frame, over the 1,000-byte limit"),
    ]  # and nothing after it is read
    await asyncio.wait_for(reader, 10)
    assert inbox.held == 0
    end.close()
    await asyncio.to_thread(writer.join, 10)


async def test_a_frame_is_held_as_its_bytes_and_the_overhead_of_one_frame(sandbox) -> None:
    end, stream = sandbox
    inbox = FrameInbox(budget=2 * (FRAME_OVERHEAD + 100))
    reader = asyncio.create_task(read_frames(stream, inbox, max_frame=1 << 20))
    body = b"[" + b" " * 98 + b"]"
    end.send(HEADER.pack(100) + body + HEADER.pack(100) + body + HEADER.pack(100) + body)
    for _ in range(200):
        if inbox.held == 2 * (FRAME_OVERHEAD + 100):
            break
        await asyncio.sleep(0.005)
    assert inbox.held == 2 * (FRAME_OVERHEAD + 100)  # two frames in, the third waits in the pipe
    await asyncio.sleep(0.05)
    assert inbox.held == 2 * (FRAME_OVERHEAD + 100) and not reader.done()
    assert await inbox.get() == body
    for _ in range(200):
        if inbox.held == 2 * (FRAME_OVERHEAD + 100):
            break
        await asyncio.sleep(0.005)
    assert inbox.held == 2 * (FRAME_OVERHEAD + 100)  # the third came in as the first went
    end.close()
    assert await take(inbox) == [body, body]
    await asyncio.wait_for(reader, 10)


async def test_a_reset_channel_ends_the_reading_as_the_end_does() -> None:
    stream = asyncio.StreamReader()
    inbox = FrameInbox(1_000)
    stream.feed_data(encode_frame({"op": "ready"}))
    stream.set_exception(ConnectionResetError())
    await asyncio.wait_for(read_frames(stream, inbox, max_frame=1_000), 5)
    assert await take(inbox) == []  # the frame before the reset is lost with the channel
