"""The one parser of model replies: FINAL / FINAL_VAR (docs/behaviour/answers.md) and code
blocks.

Everything here runs inside a workflow task on text a model wrote, so every function is
linear in its input on any text (Temporal's deadlock detector fails a task after ~2 s):
fenced blocks are found by one possessive regex, string literals by possessive regexes,
and balanced parentheses by `matching_paren`, which skips text at C speed.

The rules a user can rely on:
- FINAL(...) / FINAL_VAR(...) count only at the start of a line of the reply's prose, that
  is outside fenced code blocks. (Inside a ```repl block they are function calls that the
  REPL runs; a FINAL in a ```python example is an example.)
- The first FINAL_VAR line decides; if there is none, the first FINAL line decides (the
  answer format's precedence). A first candidate whose parentheses never close is no answer.
- FINAL's answer is its argument as written, trimmed (the answer format's table: FINAL("hello")
  answers "hello", quotes included). The argument is either one string literal, taken
  whole so a ')' inside it does not close the call, or prose, in which parentheses nest
  and quotes are plain text (FINAL(It's a dog) answers It's a dog).
- FINAL_VAR's argument is a variable name; quotes around it are stripped
  (FINAL_VAR('result') reads `result`, as rlms's `print(FINAL_VAR('result'))` does).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

# --- fenced code blocks -----------------------------------------------------------------------

# A fence line opens a block; the block ends at the next line made only of backticks (so a
# "```python" line inside a block is content). The inner lines are consumed possessively,
# so an opener without a closer costs one scan to the end, where the second alternative
# takes the rest of the text as an unclosed block. Linear on any text.
_FENCE_BLOCK = re.compile(
    r"^[ \t]*`{3,}(?P<info>[^`\n]*)"
    r"(?:\n(?P<body>(?:(?![ \t]*`{3,}[ \t]*$)[^\n]*\n)*+)[ \t]*`{3,}[ \t]*$"
    r"|(?P<rest>(?:\n[\s\S]*)?)\Z)",
    re.MULTILINE,
)


@dataclass(frozen=True)
class FencedBlock:
    language: str  # first word of the info string, "" for a bare fence
    code: str
    closed: bool


def _split_fences(text: str) -> list[Any]:
    """[prose, info, body, rest, prose, ...]: one regex pass; body is None when unclosed."""
    if "```" not in text:
        return [text]
    return _FENCE_BLOCK.split(text)


def _language(info: str) -> str:
    words = info.split(None, 1)
    return words[0] if words else ""


def iter_fenced_blocks(text: str | None) -> Iterator[FencedBlock]:
    """The fenced blocks of `text`, in order, found as they are asked for: a reader that
    needs only the first few pays for those (a reply may hold a million empty blocks)."""
    text = text or ""
    if "```" not in text:
        return
    for match in _FENCE_BLOCK.finditer(text):
        info, body, rest = match.group("info", "body", "rest")
        if body is not None:
            yield FencedBlock(_language(info), body[:-1], True)
        else:
            yield FencedBlock(_language(info), (rest or "")[1:], False)


def fenced_blocks(text: str | None) -> list[FencedBlock]:
    """Every fenced block of `text`, in order; the last may be unclosed."""
    return list(iter_fenced_blocks(text))


def strip_code_blocks(text: str | None) -> str:
    """The reply's prose: its text with every fenced block (closed or not) removed."""
    return "\n".join(_split_fences(text or "")[0::4])


def _code_of(parts: list[Any], fences: tuple[str, ...] | list[str], limit: int | None) -> list[str]:
    wanted = set(fences)
    found: list[str] = []
    for info, body in zip(parts[1::4], parts[2::4], strict=True):
        if body and _language(info) in wanted and body.strip():
            found.append(body[:-1])
            if limit is not None and len(found) >= limit:
                break
    return found


def find_code_blocks(
    text: str | None, fences: tuple[str, ...] | list[str] = ("repl",), limit: int | None = None
) -> list[str]:
    """Code of every closed, non-empty block whose language is one of `fences`, in order."""
    return _code_of(_split_fences(text or ""), fences, limit)


def inline_code_blocks(
    text: str | None,
    fences: tuple[str, ...] | list[str] = ("repl",),
    limit: int | None = None,
    keep_empty: bool = False,
) -> list[str]:
    """Code blocks as rlms 0.1.3 finds them (its regex ```repl\\s*\\n(.*?)\\n```): "```repl",
    blanks through the last newline among them, the code up to the next newline followed by
    ```, anywhere in the text (an opening fence need not start its line: "Here: ```repl"),
    the code stripped; empty blocks are left out (`keep_empty`: kept, as rlms's own parser
    keeps them). Linear, where the regex is not: a search
    for the closing "\\n```" that fails ends the scan, since any later opener would search
    the same tail."""
    body = text or ""
    opener = _inline_opener(tuple(fences))
    found: list[str] = []
    position = 0
    while limit is None or len(found) < limit:
        start = opener.search(body, position)
        if start is None:
            break
        blanks = start.group("blanks")
        last = blanks.rfind("\n")
        if last < 0:
            position = start.end()
            continue
        code_start = start.start("blanks") + last + 1
        end = body.find("\n```", code_start)
        if end < 0:
            # The regex's last resort: an earlier newline of the blanks closes an empty block.
            earlier = blanks.rfind("\n", 0, last)
            if earlier >= 0 and body.startswith("```", code_start):
                if keep_empty:
                    found.append("")
                position = code_start + 3
                continue
            break
        code = body[code_start:end].strip()
        if code or keep_empty:
            found.append(code)
        position = end + 4
    return found


def _inline_opener(fences: tuple[str, ...]) -> re.Pattern[str]:
    """An opening fence whose blanks hold a newline (rlms's `\\s*\\n`): one without is never
    a block's start, so the regex passes over it in C instead of a Python step each (a
    reply of a million "```repl " took a second of a workflow task)."""
    names = "|".join(re.escape(f) for f in fences)
    return re.compile(r"```(?:" + names + r")(?P<blanks>[^\S\n]*\n\s*)")


# --- balanced parentheses ---------------------------------------------------------------------

_SHALLOW_DEPTH = 48  # measured: deeper costs more per group, shallower more steps


def _balanced_pattern(depth: int) -> str:
    """Possessive regex for text whose parentheses balance, nested at most `depth` deep."""
    pattern = r"[^()]*+"
    for _ in range(depth):
        pattern = r"(?:[^()]++|\(" + pattern + r"\))*+"
    return pattern


_SHALLOW = re.compile(_balanced_pattern(_SHALLOW_DEPTH))


_PAREN_RUN = re.compile(r"\(+|\)+")


def matching_paren(text: str, open_index: int) -> int | None:
    """Index of the ')' that closes text[open_index] == '(', or None. Quotes are text.

    Linear with few Python steps: shallow balanced stretches are skipped by one regex, a
    run of equal parentheses is one step, and while the depth D is large the next D-1
    characters cannot close the group, so they are skipped by counting.
    """
    if open_index >= len(text) or text[open_index] != "(":
        raise ValueError("open_index must point at '('")
    n = len(text)
    depth, pos = 1, open_index + 1
    while pos < n:
        if depth > _SHALLOW_DEPTH:
            end = min(n, pos + depth - 1)
            depth += text.count("(", pos, end) - text.count(")", pos, end)
            pos = end
            continue
        pos = _SHALLOW.match(text, pos).end()  # type: ignore[union-attr]  # matches ""
        if pos >= n:
            return None
        run = _PAREN_RUN.match(text, pos)
        assert run is not None
        length = run.end() - pos
        if text[pos] == ")":
            if length >= depth:
                return pos + depth - 1
            depth -= length
        else:
            depth += length
        pos = run.end()
    return None


# One Python string literal (triple or single quoted, escapes honoured), possessive.
_STRING_LITERAL = (
    r'"""(?:[^"\\]|\\[\s\S]|"(?!""))*+"""'
    r"|'''(?:[^'\\]|\\[\s\S]|'(?!''))*+'''"
    r'|"(?:[^"\\\n]|\\[\s\S])*+"'
    r"|'(?:[^'\\\n]|\\[\s\S])*+'"
)
_LITERAL_ARGUMENT = re.compile(r"[ \t]*(?:" + _STRING_LITERAL + r")\s*\)")
_WHOLE_LITERAL = re.compile(_STRING_LITERAL)


def extract_balanced_paren_content(text: str, open_index: int) -> str | None:
    """The argument between text[open_index] == '(' and its closing ')', or None.

    One string literal followed by ')' is taken whole, so `FINAL("a) b")` gives `"a) b"`;
    otherwise the argument is prose: parentheses nest and quotes are ordinary text.
    """
    if open_index >= len(text) or text[open_index] != "(":
        raise ValueError("open_index must point at '('")
    start = open_index + 1
    literal = _LITERAL_ARGUMENT.match(text, start)
    if literal is not None:
        return text[start : literal.end() - 1]
    close = matching_paren(text, open_index)
    return None if close is None else text[start:close]


def _is_apostrophe(text: str, index: int) -> bool:
    return 0 < index < len(text) - 1 and text[index - 1].isalnum() and text[index + 1].isalnum()


def unquote_argument(raw: str) -> str:
    """A quoted name as the name it stands for: quotes around the whole argument stripped.

    Used for FINAL_VAR's variable name, and for the FINAL answers of episodes recorded
    before the `final-as-written` patch (they stripped them). `"hello"` -> hello,
    `'It's a dog'` -> It's a dog (inner apostrophes are text), but `"a", "b"` stays as
    written: its quotes do not enclose the whole argument.
    """
    value = raw.strip()
    if len(value) < 2 or value[0] != value[-1] or value[0] not in "'\"":
        return value
    if _WHOLE_LITERAL.fullmatch(value):
        try:
            parsed = ast.literal_eval(value)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            parsed = None
        if isinstance(parsed, str):
            return parsed
    quote = value[0]
    inner = value[1:-1]
    position = inner.find(quote)
    while position != -1:
        if not _is_apostrophe(inner, position):
            return value
        position = inner.find(quote, position + 1)
    return inner


# --- FINAL / FINAL_VAR ----------------------------------------------------------------------

_FINAL_VAR_START = re.compile(r"^[ \t]*FINAL_VAR\(", re.MULTILINE)
_FINAL_START = re.compile(r"^[ \t]*FINAL\(", re.MULTILINE)
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Printed by the resolver code when the variable does not exist; cannot collide with str().
_MISSING_MARKER = "\x00drlm:FINAL_VAR:missing\x00"


@dataclass(frozen=True)
class FinalSignal:
    kind: Literal["final", "final_var"]
    value: str  # the answer for FINAL (as written), the variable name for FINAL_VAR
    raw: str = ""  # the argument as written


class CodeEnvironment(Protocol):
    def execute_code(self, code: str) -> Any: ...


def _signal_in(prose: str) -> FinalSignal | None:
    if "FINAL" not in prose:
        return None
    start = _FINAL_VAR_START.search(prose)
    if start is not None:
        raw = extract_balanced_paren_content(prose, start.end() - 1)
        if raw is None:
            return None  # a FINAL_VAR that never closes: malformed, never fall back to FINAL
        return FinalSignal("final_var", unquote_argument(raw), raw.strip())
    start = _FINAL_START.search(prose)
    if start is not None:
        raw = extract_balanced_paren_content(prose, start.end() - 1)
        if raw is not None:
            return FinalSignal("final", raw.strip(), raw.strip())
    return None


def parse_final_signal(text: str | None) -> FinalSignal | None:
    """The answer signal in a reply's prose, FINAL_VAR first (the answer format's precedence)."""
    return _signal_in(strip_code_blocks(text))


@dataclass(frozen=True)
class ParsedReply:
    """What a reply asks for: the code to run, and the answer signal of its prose."""

    code_blocks: list[str]
    signal: FinalSignal | None
    more_blocks: bool  # blocks beyond the limit were not taken


def parse_reply(
    text: str | None, fences: tuple[str, ...] | list[str], limit: int, inline: bool = False
) -> ParsedReply:
    """One pass over the fences serves both the code and the FINAL search. `inline`: the
    code blocks are found as rlms finds them (inline_code_blocks)."""
    parts = _split_fences(text or "")
    code = inline_code_blocks(text, fences, limit + 1) if inline else _code_of(parts, fences, limit + 1)
    return ParsedReply(code[:limit], _signal_in("\n".join(parts[0::4])), len(code) > limit)


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


def truncate_output(text: str, limit: int) -> str:
    """Keep the head of an observation; say how much was cut so the model knows."""
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n... [{len(text) - limit} more characters truncated]"


def shorten_middle(text: str, limit: int) -> str:
    """Keep the head and the tail of a long text; say how much of the middle was cut."""
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    tail = limit - head
    cut = len(text) - head - tail
    return f"{text[:head]}\n... [{cut} characters not repeated here] ...\n{text[len(text) - tail :]}"
