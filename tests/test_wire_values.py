"""The wire's values (activities/sandbox/values.py): a closed set of Python types that travel
from a sandbox to its host, read back equal, and nothing else read at all; bounded in values
and depth before any object is built."""

from __future__ import annotations

import datetime as dt
import json
import math
import time
import tracemalloc
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from durable_rlm.activities.sandbox import values
from durable_rlm.activities.sandbox.values import ValueRefused, check, dumps, loads
from durable_rlm.activities.tools import run_tool
from durable_rlm.tools import tool
from durable_rlm.workflows.models import ToolCallInput

# --- every type of the set, read back equal --------------------------------------------------------

_KEYS = st.one_of(st.text(max_size=5), st.integers(), st.tuples(st.integers(), st.text(max_size=3)))
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(),
    st.binary(),
    st.dates(),
    st.datetimes(timezones=st.one_of(st.none(), st.just(dt.UTC))),
    st.times(),
    st.timedeltas(),
    st.decimals(allow_nan=False),
    st.uuids(),
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.frozensets(_KEYS, max_size=4),
        st.sets(_KEYS, max_size=4),
        st.dictionaries(st.text(max_size=5), inner, max_size=4),
        st.dictionaries(_KEYS, inner, max_size=4),
    ),
    max_leaves=20,
)


@given(_VALUES)
def test_every_value_of_the_set_reads_back_equal_and_of_its_type(value: object) -> None:
    back = loads(dumps(value))
    assert back == value
    assert type(back) is type(value)


def test_a_dict_with_the_tag_key_is_a_dict_not_a_tag() -> None:
    forged = {"$": "uuid", "v": str(uuid.UUID(int=1))}
    assert loads(dumps(forged)) == forged  # sent as pairs: a plain dict is never read as a tag
    assert loads(dumps({"$": 1})) == {"$": 1}


def test_floats_that_are_not_finite_travel_tagged() -> None:
    back = loads(dumps([math.nan, math.inf, -math.inf]))
    assert math.isnan(back[0]) and back[1:] == [math.inf, -math.inf]


@pytest.mark.parametrize(
    "value",
    [object(), open, len, type, Exception("x"), range(3), complex(1, 2), bytearray(b"x").__iter__()],
    ids=lambda v: type(v).__name__,
)
def test_a_type_outside_the_set_is_refused_where_it_is_sent(value: object) -> None:
    with pytest.raises(TypeError, match="the values that can: None, bool, int"):
        dumps({"arg": value})


def test_a_value_that_contains_itself_or_is_too_large_is_refused_by_its_sender() -> None:
    loop: list = []
    loop.append(loop)
    with pytest.raises(ValueError, match="contains itself"):
        dumps(loop)
    with pytest.raises(ValueError, match="more than 1,000 values"):
        dumps(list(range(2_000)), max_items=1_000)
    nested: list = []
    for _ in range(200):
        nested = [nested]
    with pytest.raises(ValueError, match="nested"):
        dumps(nested)
    with pytest.raises(ValueError, match="digits"):
        dumps(10**5000)


def test_what_the_sender_allows_the_host_reads() -> None:
    """The sender's check is the host's: at its bounds both agree, tags counted as they are sent."""
    value = [(i, {i}) for i in range(1_000)]
    text = dumps(value, max_items=20_000)
    assert loads(text, max_items=20_000) == value
    with pytest.raises(ValueError):
        dumps(value, max_items=5_000)
    with pytest.raises(ValueRefused):
        loads(text, max_items=5_000)


# --- what the host refuses ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "why"),
    [
        ('{"$": "pickle", "v": "gASVAAAA"}', "no type the wire carries"),
        ('{"$": "tuple", "v": [1], "extra": 2}', "no type the wire carries"),
        ('{"$": "set", "v": [[1]]}', "unhashable"),
        ('{"$": "dict", "v": [[[1], 2]]}', "unhashable"),
        ('{"$": "dict", "v": [[1, 2, 3]]}', "pairs"),
        ('{"$": "bytes", "v": "not base64!"}', "not a bytes"),
        ('{"$": "timedelta", "v": [1, 2]}', "timedelta"),
        ('{"$": "date", "v": 20240101}', "holds a str"),
        ('{"$": "float", "v": "1.5"}', "not JSON"),
        ("[NaN]", "NaN is not JSON"),
        ("[Infinity]", "Infinity is not JSON"),
        ("1" * 5_000, "digits"),
        ("[" * 101 + "]" * 101, "nested more than 100 deep"),
        ("[1, 2", "not a value of the wire"),
        (b"\xff\xfe", "not a value of the wire"),
    ],
)
def test_what_is_not_a_value_of_the_set_is_refused(data: str | bytes, why: str) -> None:
    with pytest.raises(ValueRefused, match=why):
        loads(data)


def test_bytes_past_their_bound_are_refused_unread() -> None:
    with pytest.raises(ValueRefused, match="over the 10 allowed"):
        loads('"' + "x" * 100 + '"', max_bytes=10)


@pytest.mark.parametrize(
    "body",
    [
        b"[" + b"{}," * 20_000_000 + b"{}]",  # the report's 60 MB of small objects
        b"[" + b"[]," * 20_000_000 + b"[]]",
        b'{"a":' * 30_000_000 + b"1",
        b"[" * 60_000_000,
    ],
    ids=["60 MB of empty objects", "60 MB of empty lists", "keys nested 30M deep", "60 MB of brackets"],
)
def test_sixty_megabytes_of_small_objects_are_refused_before_any_is_built(body: bytes) -> None:
    began = time.thread_time()
    with pytest.raises(ValueRefused):
        loads(body)
    assert time.thread_time() - began < 1.0  # ~0.25 s here (this thread's CPU time)
    tracemalloc.start()
    try:
        with pytest.raises(ValueRefused):
            loads(body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < len(body) + 2**20  # at most one copy of the bytes, never their objects


def test_strings_are_skipped_when_counting_so_text_full_of_commas_is_one_value() -> None:
    text = json.dumps("a, b: [c], {d}" * 1_000_000).encode()
    check(text, max_items=10)
    assert loads(text) == "a, b: [c], {d}" * 1_000_000
    with pytest.raises(ValueRefused):
        check(json.dumps(["a, b"] * 20).encode(), max_items=10)


def test_escaped_quotes_do_not_end_a_string_when_counting() -> None:
    tricky = json.dumps(['\\", [[[[', 'x\\\\"']).encode()
    check(tricky, max_items=5, max_depth=1)


def test_the_frame_bound_admits_the_largest_submit_the_sandbox_sends() -> None:
    """SUBMIT outputs up to SANDBOX_FIELD_CHARS, as the sandbox writes them, fit a frame."""
    from durable_rlm.activities.sandbox_protocol import decode_frame
    from durable_rlm.workflows import defaults

    numbers = [7] * (defaults.SANDBOX_FIELD_CHARS // 3 - 10)  # "7, " each
    assert len(json.dumps({"answer": numbers})) <= defaults.SANDBOX_FIELD_CHARS
    frame = json.dumps({"op": "done", "status": "ok", "seq": 1, "submitted": {"answer": numbers}})
    assert decode_frame(frame.encode())["submitted"] == {"answer": numbers}


# --- a tool's arguments, as the host reads them ------------------------------------------------


@tool(name="wire_values_echo")
def _echo(items: list) -> int:
    return len(items)


async def test_a_tool_call_of_small_objects_is_refused_before_they_are_built() -> None:
    from temporalio.exceptions import ApplicationError

    arguments = '{"args": [[' + "{}," * 10_000_000 + '{}]], "kwargs": {}}'  # 30 MB
    tracemalloc.start()
    try:
        with pytest.raises(ApplicationError, match="more than 250,000 values"):
            await run_tool(
                ToolCallInput(
                    episode_id="e",
                    iteration=1,
                    cell_index=1,
                    call_index=0,
                    tool="wire_values_echo",
                    arguments=arguments,
                )
            )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * len(arguments)  # its bytes, encoded once and emptied of strings once
    ok = await run_tool(
        ToolCallInput(
            episode_id="e",
            iteration=1,
            cell_index=1,
            call_index=0,
            tool="wire_values_echo",
            arguments='{"args": [[1, 2]], "kwargs": {}}',
        )
    )
    assert ok.result == "2"


def test_the_module_is_the_one_the_sandbox_loads() -> None:
    """Standard library only: the sandbox imports it as a sibling of its own modules."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(values.__file__).read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    imported |= {
        node.module.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
    }
    assert imported <= {
        "__future__",
        "base64",
        "datetime",
        "decimal",
        "json",
        "math",
        "re",
        "uuid",
        "typing",
    }, imported
