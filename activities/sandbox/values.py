"""Python values across the sandbox's wire: a closed set of types, bounded before they are built.

What a sandbox sends is chosen by code a model wrote, which may also have rewritten the
sandbox's own modules; so the host decodes it by this module and nothing else, and never
unpickles it (a pickle runs code of its sender's choosing). The set of types:

    None, bool, int, float (nan and infinities too), str, list, dict (any hashable keys),
    tuple, set, frozenset, bytes, date, datetime, time, timedelta, Decimal, UUID

`dumps(value)` writes one as JSON text (the sandbox's side: a type outside the set raises
TypeError there, in the cell, with the set named); `loads(data)` reads it back (the host's
side) and refuses, with `ValueRefused`, whatever is not one, or is larger than its bounds.
The bounds are checked on the bytes before any object is made: JSON objects are small to
write and large to build (a 60 MB frame of `[{},{},...]` once took a worker to 3.2 GB), so
the number of items and the nesting depth are counted first, strings skipped at C speed, and
only a document within both is parsed. `check(data)` is that count alone, for a caller that
parses the JSON itself (the frame schema does: activities/sandbox_protocol.py).

JSON values stand for themselves; the other types are tagged objects `{"$": TYPE, "v": ...}`,
and a dict whose keys are not all strings, or that has a key "$", is a tagged "dict" of
pairs, so no plain dict is ever read as a tag. Standard library only: the sandbox loads it.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import json
import math
import re
import uuid
from typing import Any

MAX_ITEMS = 250_000
"""Values in one document (containers, keys and scalars), by default: ~20 MB of Python
objects at most, whatever they are (each caller may pass its own bound)."""

MAX_DEPTH = 100
"""Nesting of containers in one document."""

MAX_DIGITS = 4_300
"""Digits of one integer: Python's own limit for int() from text (its cost is quadratic)."""

_PAST_DIGITS = 10**MAX_DIGITS
"""The smallest integer of more than MAX_DIGITS digits: counted by comparison, since str() of
one past Python's limit raises its own error instead of ours."""

TAG = "$"

SUPPORTED = (
    "None, bool, int, float, str, list, dict, tuple, set, frozenset, bytes, date, datetime, "
    "time, timedelta, Decimal, UUID"
)


class ValueRefused(ValueError):
    """Data that is not a value of the closed set, or is past the bounds: it is refused whole."""


# --- the sandbox's side ---------------------------------------------------------------------------


def dumps(value: Any, max_items: int = MAX_ITEMS, max_depth: int = MAX_DEPTH) -> str:
    """`value` as JSON text `loads` reads back equal. A type outside the closed set raises
    TypeError; a value past the bounds (or one that contains itself) raises ValueError: the
    sender learns it before anything is sent."""
    text = json.dumps(_encode(value, [0], max_items, max_depth, set()), ensure_ascii=False, allow_nan=False)
    try:
        check(text.encode("utf-8", "surrogatepass"), max_items, max_depth)  # exactly as the host will
    except ValueRefused as exc:
        raise ValueError(str(exc)) from None
    return text


def _encode(value: Any, count: list[int], max_items: int, depth: int, path: set[int]) -> Any:
    count[0] += 1
    if count[0] > max_items:
        raise ValueError(f"more than {max_items:,} values in one document")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        if value.bit_length() > 4 * MAX_DIGITS or abs(int(value)) >= _PAST_DIGITS:
            raise ValueError(f"an integer of more than {MAX_DIGITS:,} digits")
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else {TAG: "float", "v": repr(float(value))}
    if isinstance(value, (bytes, bytearray)):
        return {TAG: "bytes", "v": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, dt.datetime):  # before date: a datetime is a date
        return {TAG: "datetime", "v": value.isoformat()}
    if isinstance(value, dt.date):
        return {TAG: "date", "v": value.isoformat()}
    if isinstance(value, dt.time):
        return {TAG: "time", "v": value.isoformat()}
    if isinstance(value, dt.timedelta):
        return {TAG: "timedelta", "v": [value.days, value.seconds, value.microseconds]}
    if isinstance(value, decimal.Decimal):
        return {TAG: "decimal", "v": str(value)}
    if isinstance(value, uuid.UUID):
        return {TAG: "uuid", "v": str(value)}
    if not isinstance(value, (list, tuple, dict, set, frozenset)):
        raise TypeError(f"a {type(value).__name__} cannot be sent; the values that can: {SUPPORTED}")
    if depth <= 0:
        raise ValueError("nested deeper than the wire allows")
    if id(value) in path:
        raise ValueError("a value that contains itself cannot be sent")
    path.add(id(value))
    try:
        return _container(value, count, max_items, depth - 1, path)
    finally:
        path.discard(id(value))


def _container(value: Any, count: list[int], max_items: int, depth: int, path: set[int]) -> Any:
    def each(items: Any) -> list[Any]:
        return [_encode(item, count, max_items, depth, path) for item in items]

    if isinstance(value, list):
        return each(value)
    if isinstance(value, tuple):
        return {TAG: "tuple", "v": each(value)}
    if isinstance(value, (set, frozenset)):
        kind = "frozenset" if isinstance(value, frozenset) else "set"
        try:
            ordered = sorted(value)  # the same set, the same text (digests of prompts depend on it)
        except TypeError:
            ordered = list(value)
        return {TAG: kind, "v": each(ordered)}
    if all(type(key) is str for key in value) and TAG not in value:
        count[0] += len(value)  # the keys
        return {key: _encode(item, count, max_items, depth, path) for key, item in value.items()}
    return {TAG: "dict", "v": [each(pair) for pair in value.items()]}


# --- the host's side ------------------------------------------------------------------------------

_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"', re.DOTALL)
_LONG_NUMBER = re.compile(rb"[0-9]{%d}" % (MAX_DIGITS + 1))
_DIGITS = [bytes([digit]) for digit in b"0123456789"]


def _long_number_in(data: bytes | bytearray) -> bool:
    """Whether `data` holds an integer of more than MAX_DIGITS digits. The regex takes a step
    per byte (~1 s for a 60 MB frame on a slow machine, on the worker's loop); most documents
    have too few digits in all to hold one, which ten counts at memory speed tell first."""
    return sum(data.count(digit) for digit in _DIGITS) > MAX_DIGITS and bool(_LONG_NUMBER.search(data))


_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))


def check(data: bytes, max_items: int = MAX_ITEMS, max_depth: int = MAX_DEPTH) -> None:
    """Raise ValueRefused unless the JSON document `data` holds at most `max_items` values
    nested at most `max_depth` deep, and no integer past MAX_DIGITS. Linear, at C speed but
    for one step per string and per bracket, each at most `max_items` (every string is a
    value); what it builds is one copy of the bytes at most, never an object per value."""
    if (
        _counted(data, max_items)
        and data.count(b"[") + data.count(b"{") <= max_depth
        and not _long_number_in(data)
    ):
        return  # counting strings' characters too, still within: no need to skip them
    bare = bytearray()  # the document with each string emptied: its structure alone
    view, position = memoryview(data), 0
    for strings, string in enumerate(_STRING.finditer(data)):
        if strings >= max_items:
            raise ValueRefused(f"more than {max_items:,} values in one document")
        bare += view[position : string.start()]
        bare += b'""'
        position = string.end()
    bare += view[position:]
    if not _counted(bare, max_items):
        raise ValueRefused(f"more than {max_items:,} values in one document")
    if _long_number_in(bare):
        raise ValueRefused(f"an integer of more than {MAX_DIGITS:,} digits")
    depth = 0
    for bracket in bare.translate(None, _NOT_BRACKETS):
        depth += 1 if bracket in b"[{" else -1
        if depth > max_depth:
            raise ValueRefused(f"nested more than {max_depth} deep")


def _counted(data: bytes | bytearray, max_items: int) -> bool:
    # A value is a container, or follows a comma or a colon, or is the document itself.
    values = data.count(b"[") + data.count(b"{") + data.count(b",") + data.count(b":") + 1
    return values <= max_items


def loads(
    data: str | bytes | bytearray,
    max_items: int = MAX_ITEMS,
    max_depth: int = MAX_DEPTH,
    max_bytes: int | None = None,
) -> Any:
    """The value `dumps` wrote; ValueRefused for anything else: text that is not JSON, a tag
    of no type in the set, a value past the bounds (checked before any of it is built)."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if max_bytes is not None and len(raw) > max_bytes:
        raise ValueRefused(f"{len(raw):,} bytes, over the {max_bytes:,} allowed")
    check(raw, max_items, max_depth)
    try:
        return json.loads(raw, object_hook=_untag, parse_constant=_no_constant)  # its integers: checked
    except ValueRefused:
        raise
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise ValueRefused(f"not a value of the wire: {exc}") from None


def _no_constant(name: str) -> Any:
    raise ValueRefused(f"{name} is not JSON (a float that is not finite is sent tagged)")


def _hashable(items: list[Any]) -> list[Any]:
    for item in items:
        hash(item)  # TypeError for a list or a dict: not a member of a set, not a key
    return items


def _pairs(pairs: Any) -> dict[Any, Any]:
    if not all(isinstance(p, list) and len(p) == 2 for p in pairs):
        raise ValueRefused("a tagged dict holds [key, value] pairs")
    _hashable([key for key, _ in pairs])
    return dict(pairs)


def _timedelta(parts: Any) -> dt.timedelta:
    if not (isinstance(parts, list) and len(parts) == 3 and all(type(p) is int for p in parts)):
        raise ValueRefused("a timedelta is [days, seconds, microseconds]")
    return dt.timedelta(days=parts[0], seconds=parts[1], microseconds=parts[2])


_TAGGED: dict[str, tuple[type, Any]] = {
    "tuple": (list, tuple),
    "set": (list, lambda items: set(_hashable(items))),
    "frozenset": (list, lambda items: frozenset(_hashable(items))),
    "dict": (list, _pairs),
    "bytes": (str, lambda text: base64.b64decode(text.encode("ascii"), validate=True)),
    "date": (str, dt.date.fromisoformat),
    "datetime": (str, dt.datetime.fromisoformat),
    "time": (str, dt.time.fromisoformat),
    "timedelta": (list, _timedelta),
    "decimal": (str, decimal.Decimal),
    "uuid": (str, uuid.UUID),
    "float": (str, lambda text: float(text) if text in ("nan", "inf", "-inf") else _no_constant(text)),
}


def _untag(obj: dict[str, Any]) -> Any:
    if TAG not in obj:
        return obj
    kind = obj[TAG]
    if len(obj) != 2 or "v" not in obj or not isinstance(kind, str) or kind not in _TAGGED:
        raise ValueRefused(f"a tagged value of no type the wire carries ({SUPPORTED})")
    shape, build = _TAGGED[kind]
    inner = obj["v"]
    if not isinstance(inner, shape):
        raise ValueRefused(f"a tagged {kind} holds a {shape.__name__}")
    try:
        return build(inner)
    except (ValueError, TypeError, ArithmeticError, decimal.InvalidOperation) as exc:
        raise ValueRefused(f"not a {kind}: {exc}") from None
