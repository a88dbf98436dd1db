"""`context` in the sandbox, from the worker's read-only cached copy (activities/context_cache.py).

The host names a file in its own cache; the sandbox opens it before any isolation layer is in
place (the only moment it can reach the worker's files, and before any code of the model
runs), then builds `context` from a read-only map of it:

- text: the map is decoded into one `str` (the only copy the sandbox makes), then unmapped;
  the file's pages stay in the page cache, shared by every sandbox of the worker;
- JSON: decoded the same way and parsed (rlms's list and dict contexts);
- documents: a pack of documents (a header naming each one's place, then their bytes), and
  `context` a read-only sequence over it that decodes a document when code touches it, so a
  corpus larger than the sandbox's memory can be worked through one document at a time.

Standard library only, like everything the sandbox loads.
"""

from __future__ import annotations

import codecs
import json
import mmap
import os
import struct
import sys
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

PACK_MAGIC = b"drlm-pack/1\n"
HEADER = struct.Struct("<Q")
MAX_HEADER = 256 * 1024 * 1024
KEPT_BYTES = 256 * 1024 * 1024
"""Decoded documents kept for the next touch (most recent first): code that walks a corpus
twice need not decode every document twice, and memory stays bounded."""


def open_context(message: dict[str, Any]) -> int | None:
    """Open the host's cached copy named in the init message (before the layers: after
    them, the worker's files are out of reach). Never follows a link."""
    spec = message.get("context")
    if not spec:
        return None
    return os.open(str(spec["path"]), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)


def load_context(fd: int | None, message: dict[str, Any]) -> Any:
    if fd is None:
        return None
    kind = str(message["context"]["kind"])
    if kind == "documents":
        return Documents(fd)
    if message["context"].get("view") == "mapped":
        return MappedText(fd)
    try:
        text = _decode(fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    return json.loads(text) if kind == "json" else text


def _decode(fd: int, offset: int, length: int) -> str:
    """UTF-8 bytes of the file as a `str`, decoded straight from a read-only map."""
    if length == 0:
        return ""
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    skip = offset - start
    with mmap.mmap(fd, length + skip, prot=mmap.PROT_READ, offset=start) as mapped:
        view = memoryview(mapped)
        try:
            return codecs.utf_8_decode(view[skip : skip + length], "strict", True)[0]
        finally:
            view.release()


class Documents(Sequence[Any]):
    """`context` as documents: `len(context)`, `context[i]`, slices, iteration, `in`;
    `context.names` are their file names. Each document is a `str` (or, for a .json file,
    its value), read from the worker's cached pack when touched."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        head = os.pread(fd, len(PACK_MAGIC) + HEADER.size, 0)
        if not head.startswith(PACK_MAGIC):
            raise ValueError("the context's pack is not a documents pack")
        (size,) = HEADER.unpack(head[len(PACK_MAGIC) :])
        if size > MAX_HEADER:
            raise ValueError("the context's pack header is too large")
        header = json.loads(_decode(fd, len(head), size))
        base = len(head) + size  # offsets count from the end of the header
        self._entries: list[tuple[str, int, int]] = [
            (str(d["kind"]), base + int(d["offset"]), int(d["length"])) for d in header["documents"]
        ]
        self.names: tuple[str, ...] = tuple(str(d["name"]) for d in header["documents"])
        self._kept: OrderedDict[int, tuple[Any, int]] = OrderedDict()  # value, its text's size
        self._kept_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        position = range(len(self))[index]  # negative indices, and IndexError past the end
        if position in self._kept:
            self._kept.move_to_end(position)
            return self._kept[position][0]
        kind, offset, length = self._entries[position]
        text = _decode(self._fd, offset, length)
        value = json.loads(text) if kind == "json" else text
        self._keep(position, value, sys.getsizeof(text))
        return value

    def _keep(self, position: int, value: Any, size: int) -> None:
        if size > KEPT_BYTES:
            return
        self._kept[position] = (value, size)
        self._kept_bytes += size
        while self._kept_bytes > KEPT_BYTES:
            _, (_, dropped) = self._kept.popitem(last=False)
            self._kept_bytes -= dropped

    def __repr__(self) -> str:
        shown = ", ".join(repr(n) for n in self.names[:3])
        more = f", ... {len(self) - 3} more" if len(self) > 3 else ""
        return f"<{len(self)} documents: {shown}{more}>"

    def __reduce__(self) -> Any:
        raise TypeError("the documents context is read from the worker's cache: it cannot be pickled")


WINDOW = 64 * 1024 * 1024


class MappedText:
    """`context` as a read-only view of the worker's copy of an ASCII text, for a text too
    large to hold as one `str` (opted into with `--context-view mapped`): its pages are the
    page cache's, shared by every sandbox over it, and a `str` is made only of what code
    takes. `len`, indexing and slices (each a `str`), `find`/`rfind`/`index`/`count`/`in`,
    `startswith`/`endswith`, `lines()` (one line at a time), and `context.bytes` (the map,
    for `re` with bytes patterns). `str(context)` makes the whole string."""

    def __init__(self, fd: int) -> None:
        size = os.fstat(fd).st_size
        self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else b""
        os.close(fd)
        self._size = size

    @property
    def bytes(self) -> Any:
        return memoryview(self._map) if self._size else b""

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, index: Any) -> str:
        if not self._size:
            return ""[index]
        if isinstance(index, slice):
            return self._map[index].decode("ascii")
        return chr(self._map[range(self._size)[index]])

    def __str__(self) -> str:
        return self[:]

    def __repr__(self) -> str:
        return f"<mapped text of {self._size:,} characters: {self[:60]!r}...>"

    def __contains__(self, sub: str) -> bool:
        return self.find(sub) != -1

    def find(self, sub: str, start: int = 0, end: int | None = None) -> int:
        if not self._size:
            return "".find(sub)
        return self._map.find(sub.encode("ascii"), start, self._size if end is None else end)

    def rfind(self, sub: str, start: int = 0, end: int | None = None) -> int:
        if not self._size:
            return "".rfind(sub)
        return self._map.rfind(sub.encode("ascii"), start, self._size if end is None else end)

    def index(self, sub: str, start: int = 0, end: int | None = None) -> int:
        found = self.find(sub, start, end)
        if found == -1:
            raise ValueError("substring not found")
        return found

    def count(self, sub: str, start: int = 0, end: int | None = None) -> int:
        """Non-overlapping matches, as `str.count`: a one-character `sub` (a line end) a
        window at a time; a longer one match by match, so no match is split or counted twice."""
        end = self._size if end is None else min(end, self._size)
        needle = sub.encode("ascii")
        if not needle:
            return max(end - start, 0) + 1
        total = 0
        if len(needle) == 1:
            for position in range(start, end, WINDOW):
                total += self._map[position : min(position + WINDOW, end)].count(needle)
            return total
        position = self._map.find(needle, start, end) if self._size else -1
        while position != -1:
            total += 1
            position = self._map.find(needle, position + len(needle), end)
        return total

    def startswith(self, prefix: str) -> bool:
        return self[: len(prefix)] == prefix

    def endswith(self, suffix: str) -> bool:
        return self[self._size - len(suffix) :] == suffix if suffix else True

    def lines(self) -> Any:
        """Each line (without its end), one at a time."""
        position = 0
        while position < self._size:
            stop = self._map.find(b"\n", position)
            if stop == -1:
                yield self._map[position:].decode("ascii")
                return
            yield self._map[position:stop].decode("ascii")
            position = stop + 1

    def __reduce__(self) -> Any:
        raise TypeError("the mapped context is the worker's read-only copy: it cannot be pickled")
