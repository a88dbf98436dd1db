"""Cells that read the clock or OS randomness, found as they run (inside the sandbox).

A rebuild re-runs cells (docs/architecture/resuming.md), and such a cell would draw new
values: the host snapshots the namespace right after it, so a rebuild restores what the
model saw. Wrappers flag the reads they can see; what they cannot (datetime.now, secrets) is
found in the code's words. `random` needs neither: it is seeded, and its state travels in
the snapshot. Standard library only, like everything the sandbox loads.
"""

from __future__ import annotations

import ast
import importlib
import time
from typing import Any

FLAGGED = [False]
"""Set when the running cell reads the clock or OS randomness; the session clears it."""

WALL = time.perf_counter
"""The host's own timing, taken before any wrapper: never flagged."""

_CLOCK_READS = (
    ("time", ("time", "time_ns", "monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns")),
    ("time", ("localtime", "gmtime", "ctime", "asctime", "strftime")),  # flagged without a time argument
    ("os", ("urandom", "getrandom")),
)
_VOLATILE_WORDS = frozenset({"now", "today", "utcnow", "SystemRandom", "secrets", "token_hex", "token_bytes"})


def _flagging(module: Any, name: str, reads_clock_without_args: bool) -> Any:
    original = getattr(module, name)

    def call(*args: Any, **kwargs: Any) -> Any:
        # strftime(format) and asctime() read the clock; with a time tuple they do not.
        if not reads_clock_without_args or len(args) + len(kwargs) <= (1 if name == "strftime" else 0):
            FLAGGED[0] = True
        return original(*args, **kwargs)

    # Named as the original, so a pickled reference to it loads as the new sandbox's.
    call.__module__, call.__name__, call.__qualname__ = module.__name__, name, name
    call.__doc__ = original.__doc__
    return call


def watch_volatile_reads() -> None:
    """Wrap the clock and OS-randomness functions so a call flags the running cell."""
    for position, (module_name, functions) in enumerate(_CLOCK_READS):
        module = importlib.import_module(module_name)
        for name in functions:
            if hasattr(module, name):
                setattr(module, name, _flagging(module, name, reads_clock_without_args=position == 1))


def volatile_code(tree: ast.AST) -> bool:
    """The code names something no wrapper sees (datetime.now, secrets...)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in _VOLATILE_WORDS:
            return True
        if isinstance(node, ast.Name) and node.id in _VOLATILE_WORDS:
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            named = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            if any(part in _VOLATILE_WORDS for n in named for part in n.split(".")):
                return True
    return False


def volatile_source(code: str) -> bool:
    """`volatile_code` of a cell's source; code that does not parse reads nothing."""
    try:
        return volatile_code(ast.parse(code))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
