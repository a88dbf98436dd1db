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
        ('{"$": "tuple", "w": [1]}', "no type the wire carries"),  # a tag without its "v"
        ('{"$": [1], "v": [1]}', "no type the wire carries"),  # a tag that is no string
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


# Async: run on the event loop, not in the tool threads. mutmut runs each mutant's tests in a
# child forked from a process that already ran them, where the pool made at import has no
# threads left and a sync tool's call would wait for ever (a harness hang, not a kill).
@tool(name="wire_values_echo")
async def _echo(items: list) -> int:
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


# --- the sender's own bounds, at their edges ---------------------------------------------------


def nest(depth: int, inner: object = 0, kind: type = list) -> object:
    for _ in range(depth):
        inner = kind([inner])
    return inner


def test_the_sender_counts_values_as_the_host_does_exactly_up_to_the_limit() -> None:
    assert loads(dumps([0] * 999, max_items=1_000)) == [0] * 999  # the list and its 999 items
    with pytest.raises(ValueError) as refused:
        dumps([0] * 1_000, max_items=1_000)
    assert str(refused.value) == "more than 1,000 values in one document"
    assert loads(dumps({"a": 0}, max_items=3)) == {"a": 0}  # the dict, its key, its value
    with pytest.raises(ValueError, match="^more than 4 values in one document$"):
        dumps({"a": 0, "b": 1}, max_items=4)


def test_a_value_past_the_count_is_refused_before_its_text_is_built() -> None:
    """The sender stops counting at the limit: a value of a million items costs it no text of
    a million items (the host's own check, run after, would refuse it too, but only then)."""
    listed = [{"a": [0] * 500} for _ in range(2_000)]  # a million values, 1,000 per dict
    keyed = {str(i): 0 for i in range(300_000)}  # its keys alone are past the limit
    for value in (listed, keyed):
        tracemalloc.start()
        try:
            with pytest.raises(ValueError, match="^more than 10,000 values in one document$"):
                dumps(value, max_items=10_000)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1_000_000, peak


def test_the_sender_refuses_nesting_past_its_depth_in_its_own_words() -> None:
    assert loads(dumps(nest(99))) == nest(99)  # 99 lists, and the innermost holds 0
    assert loads(dumps(nest(100))) == nest(100)  # exactly the depth
    with pytest.raises(ValueError) as refused:
        dumps(nest(101))
    assert str(refused.value) == "nested deeper than the wire allows"
    loop: list = []
    loop.append(loop)
    with pytest.raises(ValueError) as looped:
        dumps(loop)
    assert str(looped.value) == "a value that contains itself cannot be sent"


def test_a_tagged_value_is_two_levels_deep_on_the_wire_and_the_host_counts_them() -> None:
    """A tuple is {"$": "tuple", "v": [...]}: within the sender's depth of containers, it can
    be past the host's depth of brackets; the sender checks its text with the host's bounds."""
    assert loads(dumps(nest(5, kind=tuple), max_depth=10)) == nest(5, kind=tuple)
    with pytest.raises(ValueError) as refused:
        dumps(nest(6, kind=tuple), max_depth=10)
    assert str(refused.value) == "nested more than 10 deep"


def test_an_integer_of_more_than_max_digits_is_refused_in_the_senders_words() -> None:
    largest = 10**values.MAX_DIGITS - 1
    assert loads(dumps([largest, -largest])) == [largest, -largest]
    for past in (largest + 1, -(largest + 1), 2**17_199, 2**17_201, 2**100_000):
        with pytest.raises(ValueError) as refused:
            dumps(past)
        assert str(refused.value) == "an integer of more than 4,300 digits", past.bit_length()


def test_the_text_is_utf8_as_written_and_a_lone_surrogate_passes() -> None:
    assert dumps(["é", "\u2603"]) == '["é", "☃"]'  # no \\u escapes: the text is the bytes sent
    assert loads(dumps("a\udcffb")) == "a\udcffb"  # str.encode(surrogatepass), as the host reads it


def test_sets_are_written_sorted_and_keep_their_kind() -> None:
    assert list({33, 1}) == [33, 1]  # this set's own order is not sorted
    assert dumps({33, 1}) == '{"$": "set", "v": [1, 33]}'
    assert dumps(frozenset({33, 1})) == '{"$": "frozenset", "v": [1, 33]}'
    assert type(loads(dumps(frozenset({1})))) is frozenset
    assert type(loads(dumps({1}))) is set


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('{"$": "dict", "v": [[1, 2, 3]]}', "not a dict: a tagged dict holds [key, value] pairs"),
        ('{"$": "timedelta", "v": [1, 2]}', "not a timedelta: a timedelta is [days, seconds, microseconds]"),
        (
            '{"$": "timedelta", "v": [1, 2, 3.5]}',
            "not a timedelta: a timedelta is [days, seconds, microseconds]",
        ),
    ],
)
def test_a_malformed_tagged_value_says_what_it_should_be(text: str, error: str) -> None:
    with pytest.raises(ValueRefused) as refused:
        loads(text)
    assert str(refused.value) == error


# --- the bounds at their edges ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("document", "count"),
    [(b"0", 1), (b"{}", 2), (b"[1, 2]", 3), (b'{"a": 1}', 3), (b"[[], {}]", 5)],
)
def test_the_host_counts_a_documents_values_exactly(document: bytes, count: int) -> None:
    """One for each opening bracket, comma and colon, and one more: a bound on the values."""
    check(document, max_items=count)
    with pytest.raises(ValueRefused, match=f"more than {count - 1:,} values in one document"):
        check(document, max_items=count - 1)


def test_past_the_count_in_strings_alone_is_refused_in_the_same_words() -> None:
    with pytest.raises(ValueRefused, match="^more than 10 values in one document$"):
        check(json.dumps(["a, b"] * 20).encode(), max_items=10)


def test_depth_is_counted_down_one_level_per_closing_bracket() -> None:
    check(b"[[], [[]]]", max_depth=3)
    with pytest.raises(ValueRefused, match="nested more than 2 deep"):
        check(b"[[], [[]]]", max_depth=2)
    assert loads("[[]]", max_depth=2) == [[]]
    with pytest.raises(ValueRefused, match="nested more than 2 deep"):
        loads("[[[]]]", max_depth=2)


def test_a_long_integer_is_refused_by_the_count_itself_however_small_the_document() -> None:
    """`check` alone bounds integers (the frame schema parses after it): also in a document
    small enough that strings need not be skipped; digits inside a string are text."""
    for document in (b"1" * 5_000, b"[-" + b"1" * (values.MAX_DIGITS + 1) + b"]"):
        with pytest.raises(ValueRefused, match="^an integer of more than 4,300 digits$"):
            check(document)
    check(b"[" + b"9" * values.MAX_DIGITS + b"]")
    check(json.dumps("1" * 5_000).encode())
    assert loads(b"-" + b"9" * values.MAX_DIGITS) == -int("9" * values.MAX_DIGITS)


def test_many_short_integers_are_not_one_long_one() -> None:
    """More digits in all than one integer may have, none of them long: read, not refused
    (the digits are counted before the long-number search, which runs only past the count)."""
    many = json.dumps([10**9] * 1_000).encode()  # 10,000 digits in 1,000 integers
    check(many)
    assert loads(many) == [10**9] * 1_000


def test_a_document_of_exactly_its_byte_bound_is_read() -> None:
    assert loads('"' + "x" * 8 + '"', max_bytes=10) == "x" * 8
    with pytest.raises(ValueRefused, match="11 bytes, over the 10 allowed"):
        loads('"' + "x" * 9 + '"', max_bytes=10)
