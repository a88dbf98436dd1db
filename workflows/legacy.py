"""The reply rules of histories recorded before the `honest-endings` patch.

Old episodes replay with the rules they ran under: FINAL lines counted inside code blocks
too, a string-literal-aware paren scan tried every FINAL line in turn, a code block could
close at a ``` anywhere, and termination policies saw what cells printed. New episodes
never use this module (see `durable_rlm.workflows.parsing`). Kept verbatim; delete it once no
execution recorded before the patch can still be replayed.
"""

from __future__ import annotations

import re

from durable_rlm.workflows.parsing import FinalSignal

_FINAL_VAR_START = re.compile(r"^[ \t]*FINAL_VAR\(", re.MULTILINE)
_FINAL_START = re.compile(r"^[ \t]*FINAL\(", re.MULTILINE)


def _balanced(text: str, open_index: int) -> str | None:
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
        content = _balanced(text, match.end() - 1)
        if content is not None:
            return content.strip()
    return None


def _strip_quotes(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in ("'", '"'):
        return value[1:-1].strip()
    return value


def parse_final_signal(text: str | None) -> FinalSignal | None:
    if not text:
        return None
    var_content = _first_balanced(_FINAL_VAR_START, text)
    if var_content is not None:
        return FinalSignal("final_var", _strip_quotes(var_content), var_content)
    if _FINAL_VAR_START.search(text):
        return None
    content = _first_balanced(_FINAL_START, text)
    if content is not None:
        return FinalSignal("final", content, content)
    return None


def find_code_blocks(text: str | None, fences: tuple[str, ...] | list[str] = ("repl",)) -> list[str]:
    if not text:
        return []
    languages = "|".join(re.escape(f) for f in fences)
    pattern = re.compile(
        rf"^[ \t]*```(?:{languages})[ \t]*\n(.*?)(?:\n[ \t]*```|\n?```)",
        re.MULTILINE | re.DOTALL,
    )
    return [m.group(1) for m in pattern.finditer(text) if m.group(1).strip()]
