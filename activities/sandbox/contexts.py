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


class Documents(Sequence):  # type: ignore[type-arg]
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
