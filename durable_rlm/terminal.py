"""Text for a terminal: what a model, a cell or a tool wrote, made unable to drive it.

A reply, a cell's output, a sub-call's answer or FINAL can carry escape sequences: OSC 52
writes the clipboard, OSC 0 the window title, OSC 8 makes links, `ESC[2J` clears the
screen, `\\r` overwrites a line, and the bidirectional controls reorder what is shown
(Trojan Source). Every terminal renderer (`drlm show`, `list`, `run`, `watch`, `pending`)
passes such text through `safe` first: C0 controls but newline and tab, DEL, the C1
controls, the bidirectional and the zero-width controls are shown as their escapes
(`\\x1b`, `\\u202e`), so a reader of an audit sees that they were there. Linear in the
text (one `str.translate`).
"""

from __future__ import annotations

_KEPT = {"\n", "\t"}
_BIDI = [0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
_ZERO_WIDTH = [0x200B, 0x200C, 0x200D, 0x2060, 0xFEFF, 0x180E]
_SEPARATORS = [0x2028, 0x2029]  # line and paragraph separators: a line break a terminal hides


def _escape(code: int) -> str:
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


_TABLE: dict[int, str] = {
    code: _escape(code)
    for code in [*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0), *_BIDI, *_ZERO_WIDTH, *_SEPARATORS]
    if chr(code) not in _KEPT
}


def safe(text: str | None) -> str:
    """`text` with every control a terminal would act on shown as its escape instead."""
    return "" if text is None else text.translate(_TABLE)
