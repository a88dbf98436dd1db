"""Where a store URL points: one reading of `sqlite:///path` for every part that opens it."""

from __future__ import annotations

import urllib.parse
from pathlib import Path

SQLITE_PREFIX = "sqlite:///"


def sqlite_file(url: str) -> Path | None:
    """The file of a plain `sqlite:///path` URL (None for any other store or URL form)."""
    if not url.startswith(SQLITE_PREFIX) or "?" in url:
        return None
    rest = urllib.parse.unquote(url.removeprefix(SQLITE_PREFIX))  # as SQLAlchemy reads the path
    return Path(rest) if rest else None  # ":memory:" is no file: nothing to read
