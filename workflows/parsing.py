"""FINAL / FINAL_VAR answer extraction (seed 001) and code-block extraction.

Pure functions: the workflow calls `parse_final_signal` and resolves FINAL_VAR through a
REPL activity; `find_final_answer` is the same rule for any object that follows the rlms
environment protocol (`execute_code(code).stdout`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, Protocol

_FINAL_VAR_START = re.compile(r"^[ \t]*FINAL_VAR\(", re.MULTILINE)
_FINAL_START = re.compile(r"^[ \t]*FINAL\(", re.MULTILINE)
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Printed by the resolver code when the variable does not exist; cannot collide with str().
_MISSING_MARKER = "\x00drlm:FINAL_VAR:missing\x00"


@dataclass(frozen=True)
class FinalSignal:
    kind: Literal["final", "final_var"]
    value: str  # the answer for FINAL, the variable name for FINAL_VAR


class ExecutionOutput(Protocol):
    stdout: str


class CodeEnvironment(Protocol):
    def execute_code(self, code: str) -> Any: ...


def extract_balanced_paren_content(text: str, open_index: int) -> str | None:
    """Content between text[open_index] == '(' and its matching ')', or None if unbalanced.

    Parentheses inside string literals (single, double, triple quoted, with escapes) do not
    count, so `FINAL("a) b")` yields `"a) b"`.
    """
    if open_index >= len(text) or text[open_index] != "(":
        raise ValueError("open_index must point at '('")
    depth = 0
    i = open_index
    quote: str | None = None
    while i < len(text):
        ch = text[i]
        if quote is not None:
            if ch == "\\":
                i += 2
                continue
            if text.startswith(quote, i):
                i += len(quote)
                quote = None
                continue
            i += 1
            continue
        if ch in ("'", '"'):
            quote = ch * 3 if text.startswith(ch * 3, i) else ch
            i += len(quote)
            continue
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                return text[open_index + 1 : i]
        i += 1
    return None


def _first_balanced(pattern: re.Pattern[str], text: str) -> str | None:
    for match in pattern.finditer(text):
        content = extract_balanced_paren_content(text, match.end() - 1)
        if content is not None:
            return content.strip()
    return None


def parse_final_signal(text: str | None) -> FinalSignal | None:
    """The answer signal in a model response, FINAL_VAR first (seed 001 precedence)."""
    if not text:
        return None
    var_content = _first_balanced(_FINAL_VAR_START, text)
    if var_content is not None:
        return FinalSignal("final_var", _strip_quotes(var_content))
    if _FINAL_VAR_START.search(text):
        return None  # a FINAL_VAR that never closes: malformed, never fall back to FINAL
    content = _first_balanced(_FINAL_START, text)
    if content is not None:
        return FinalSignal("final", content)
    return None


def is_variable_name(name: str) -> bool:
    return bool(_IDENTIFIER.fullmatch(name))


def variable_reader_code(name: str) -> str:
    """Code that prints the variable's value, or a marker when it does not exist.

    Only ever built for identifiers, so model text cannot inject code here.
    """
    if not is_variable_name(name):
        raise ValueError(f"not a variable name: {name!r}")
    return (
        f"try:\n    print(str({name}), end='')\nexcept NameError:\n    print({_MISSING_MARKER!r}, end='')\n"
    )


def find_final_answer(text: str | None, environment: CodeEnvironment | None = None) -> str | None:
    """The final answer in `text`, or None when there is none yet (the loop goes on).

    FINAL_VAR(name) needs `environment` to read the variable; without one, or when the
    variable does not exist, the result is None — never a fallback to FINAL.
    """
    signal = parse_final_signal(text)
    if signal is None:
        return None
    if signal.kind == "final":
        return signal.value
    if environment is None or not is_variable_name(signal.value):
        return None
    stdout = getattr(environment.execute_code(variable_reader_code(signal.value)), "stdout", "")
    stdout = stdout or ""
    if _MISSING_MARKER in stdout:
        return None
    return stdout  # the reader prints with end='', so this is the value's text exactly


def _strip_quotes(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in ("'", '"'):
        return value[1:-1].strip()
    return value


def find_code_blocks(text: str | None, fences: tuple[str, ...] | list[str] = ("repl",)) -> list[str]:
    """Code of every fenced block whose language is one of `fences`, in order."""
    if not text:
        return []
    languages = "|".join(re.escape(f) for f in fences)
    pattern = re.compile(
        rf"^[ \t]*```(?:{languages})[ \t]*\n(.*?)(?:\n[ \t]*```|\n?```)",
        re.MULTILINE | re.DOTALL,
    )
    return [m.group(1) for m in pattern.finditer(text) if m.group(1).strip()]


def truncate_output(text: str, limit: int) -> str:
    """Keep the head of an observation; say how much was cut so the model knows."""
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n... [{len(text) - limit} more characters truncated]"
