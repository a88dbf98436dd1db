"""An episode's context into the blob store, as a stream: a `str`, any JSON value rlms takes
(list, dict, of strings, dicts or messages), a file, or documents (files, each its own blob).

Nothing here holds the value a second time: text is encoded slice by slice, JSON is encoded
as the encoder walks it, a file is read chunk by chunk, and each piece goes straight into the
store's chunk writer (store/blobs.py `put_stream`). While streaming, each writer also learns
what the sandbox will need to hold the context as a `str`: its characters and their width
(1, 2 or 4 bytes each, as CPython stores a string), so a context too large for the sandbox is
refused before an episode starts.

Documents: a list of separately stored values, named by an index blob (`DOCUMENTS_INDEX`):
one JSON object with each document's name, digest, kind and sizes. A sandbox loads a
document when code touches it (activities/sandbox/documents.py).
"""

from __future__ import annotations

import codecs
import json
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from durable_rlm.errors import ConfigurationError
from durable_rlm.store.blobs import BlobStore
from durable_rlm.store.chunks import CHUNK_BYTES
from durable_rlm.workflows.models import ContextRef, DocumentRef

TEXT_SLICE = 4 * 1024 * 1024  # characters encoded at a time
JSON_BATCH = 1024 * 1024  # bytes of encoder output gathered before they go to the store
DOCUMENTS_INDEX = "drlm-documents/1"


@dataclass
class TextMeasure:
    """What a stream of UTF-8 says about the `str` it decodes to, learnt as it passes."""

    chars: int = 0
    encoded: int = 0  # UTF-8 bytes seen
    width: int = 1
    _decoder: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("strict"))
    _clean: bool = True  # no multi-byte sequence left open by the previous piece

    def feed(self, piece: bytes) -> None:
        self.encoded += len(piece)
        if self._clean and piece.isascii():
            self.chars += len(piece)  # the common case: no decoding, nothing allocated
            return
        text = self._decoder.decode(piece)  # raises UnicodeDecodeError on bad UTF-8
        self._clean = self._decoder.getstate()[0] == b""
        self.chars += len(text)
        if text and not text.isascii():
            self.width = max(self.width, str_width(text))

    def finish(self) -> None:
        self._decoder.decode(b"", final=True)

    @property
    def str_bytes(self) -> int:
        """Memory of the `str` the sandbox builds (CPython's compact strings)."""
        return self.chars * self.width


def str_width(text: str) -> int:
    """Bytes per character of `text` as CPython stores it: 1 (ASCII, Latin-1), 2 or 4."""
    if text.isascii():
        return 1
    top = ord(max(text))
    return 1 if top < 0x100 else 2 if top < 0x10000 else 4


def _encoded_text(text: str, measure: TextMeasure) -> Iterator[bytes]:
    for start in range(0, len(text), TEXT_SLICE):
        piece = text[start : start + TEXT_SLICE].encode("utf-8")
        measure.encoded += len(piece)
        yield piece
    measure.chars = len(text)
    measure.width = str_width(text) if text else 1


Through = Callable[[Iterator[bytes]], Iterator[bytes]]
"""A pass over the encoded pieces on their way to the store (a local worker's cache copy)."""


def _through(pieces: Iterator[bytes], through: Through | None) -> Iterator[bytes]:
    return pieces if through is None else through(pieces)


def store_text(blobs: BlobStore, text: str, through: Through | None = None) -> ContextRef:
    measure = TextMeasure()
    return _stored(blobs, _encoded_text(text, measure), measure, through, kind="text", type_name="str")


def _stored(
    blobs: BlobStore,
    pieces: Iterator[bytes],
    measure: TextMeasure,
    through: Through | None,
    kind: Literal["text", "json"],
    type_name: str,
) -> ContextRef:
    """The pieces streamed into the store; the reference says what they measured."""
    stored = blobs.put_stream(_through(pieces, through))
    return ContextRef(
        digest=stored.digest,
        kind=kind,
        size=measure.chars,
        type_name=type_name,
        stored_bytes=stored.size,
        char_width=measure.width,
    )


def _encoded_json(value: Any, measure: TextMeasure) -> Iterator[bytes]:
    batch: list[str] = []
    held = 0
    for part in json.JSONEncoder(ensure_ascii=False).iterencode(value):
        batch.append(part)
        held += len(part)
        if held >= JSON_BATCH:
            data = "".join(batch).encode("utf-8")
            measure.feed(data)
            yield data
            batch, held = [], 0
    data = "".join(batch).encode("utf-8")
    measure.feed(data)
    yield data


def store_json(blobs: BlobStore, value: Any, through: Through | None = None) -> ContextRef:
    measure = TextMeasure()
    return _stored(
        blobs, _encoded_json(value, measure), measure, through, kind="json", type_name=type(value).__name__
    )


def store_value(blobs: BlobStore, value: Any, through: Through | None = None) -> ContextRef:
    """A context as rlms takes it: a `str` stays text; anything else is JSON."""
    if isinstance(value, str):
        return store_text(blobs, value, through)
    try:
        return store_json(blobs, value, through)
    except TypeError as exc:  # a value JSON cannot hold: said before anything starts
        raise ConfigurationError(f"the context cannot be stored: {exc}") from None


# --- files --------------------------------------------------------------------------------


class ContextFileError(ConfigurationError):
    """A context path that cannot be a context: one line saying why, nothing started."""


_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
)


def file_kind(mode: int) -> str | None:
    """What a non-regular file is, in words; None for a regular file."""
    for test, words in _KINDS:
        if test(mode):
            return words
    return None if stat.S_ISREG(mode) else "not a regular file"


def refuse_kind(path: Path, mode: int, directories: bool) -> None:
    kind = file_kind(mode)
    if kind is None:
        return
    if stat.S_ISDIR(mode):
        if directories:
            return
        raise ContextFileError(
            f"context {path} is a directory: pass it as `--context DIR` to `drlm run` (each file "
            "one document), or name a file"
        )
    raise ContextFileError(
        f"context {path} is {kind}: a context is read from a regular file (or a directory of "
        "them), never from a stream without an end"
    )


def _same_file(before: os.stat_result, after: os.stat_result) -> bool:
    return (before.st_ino, before.st_dev, before.st_size, before.st_mtime_ns) == (
        after.st_ino,
        after.st_dev,
        after.st_size,
        after.st_mtime_ns,
    )


def read_file_pieces(path: Path, measure: TextMeasure | None = None) -> Iterator[bytes]:
    """A regular file, chunk by chunk, refusing one that changes while it is read (its size,
    time or identity differ at the end, or it yields more or fewer bytes than it said)."""
    try:
        before = os.stat(path)
    except FileNotFoundError:
        raise ContextFileError(f"context file not found: {path}") from None
    except OSError as exc:
        raise ContextFileError(f"cannot read context file {path}: {exc.strerror or exc}") from None
    refuse_kind(path, before.st_mode, directories=False)
    try:
        # O_NONBLOCK: a path swapped for a FIFO after the look above does not hang the open.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ContextFileError(f"cannot read context file {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb", buffering=0) as handle:
        opened = os.fstat(fd)
        refuse_kind(path, opened.st_mode, directories=False)
        if (opened.st_ino, opened.st_dev) != (before.st_ino, before.st_dev):
            raise ContextFileError(f"context file {path} was replaced while it was opened")
        os.set_blocking(fd, True)
        total = 0
        while True:
            piece = handle.read(CHUNK_BYTES)
            if not piece:
                break
            total += len(piece)
            if total > opened.st_size:
                break
            if measure is not None:
                try:
                    measure.feed(piece)
                except UnicodeDecodeError as exc:
                    at = measure.encoded - len(piece) + exc.start
                    raise ContextFileError(
                        f"context file is not UTF-8 text: {path} ({exc.reason} at byte {at})"
                    ) from None
            yield piece
        after = os.fstat(fd)
        if total != opened.st_size or not _same_file(opened, after):
            raise ContextFileError(
                f"context file {path} changed while it was read ({opened.st_size:,} bytes when "
                f"opened, {total:,} read): copy it, or wait until it is written, and run again"
            )
    if measure is not None:
        try:
            measure.finish()
        except UnicodeDecodeError:
            raise ContextFileError(
                f"context file is not UTF-8 text: {path} (it ends mid-character)"
            ) from None


def store_file(blobs: BlobStore, path: Path) -> ContextRef:
    """A text file's contents as a `str` context, streamed (not parsed, whatever its name)."""
    measure = TextMeasure()
    stored = blobs.put_stream(read_file_pieces(path, measure))
    return ContextRef(
        digest=stored.digest,
        kind="text",
        size=measure.chars,
        type_name="str",
        stored_bytes=stored.size,
        char_width=measure.width,
    )


_JSON_TYPES = {ord("["): "list", ord("{"): "dict", ord('"'): "str"}


def store_json_file(blobs: BlobStore, path: Path) -> ContextRef:
    """A .json file as the JSON value it holds, stored as read (streamed). A file up to
    JSON_CHECK_BYTES is parsed once here, so a syntax error is a one-line refusal before
    anything starts; a larger one is parsed only by the sandbox (which says so if it fails)."""
    measure = TextMeasure()
    first: list[int] = []

    def pieces() -> Iterator[bytes]:
        for piece in read_file_pieces(path, measure):
            if not first and piece.strip():
                first.append(piece.lstrip()[0])
            yield piece

    stored = blobs.put_stream(pieces())
    type_name = _JSON_TYPES.get(first[0], "json value") if first else "json value"
    if stored.size <= JSON_CHECK_BYTES:
        try:
            value = json.loads(path.read_bytes())
        except ValueError as exc:
            raise ContextFileError(f"context file {path} is not valid JSON: {exc}") from None
        type_name = type(value).__name__
        del value
    return ContextRef(
        digest=stored.digest,
        kind="json",
        size=measure.chars,
        type_name=type_name,
        stored_bytes=stored.size,
        char_width=measure.width,
    )


JSON_CHECK_BYTES = 64 * 1024 * 1024
"""A .json context up to this size is parsed once before the episode starts."""


# --- documents ----------------------------------------------------------------------------


def context_files(paths: Iterable[Path]) -> list[tuple[str, Path]]:
    """The files that `--context` names, in order, each with its document name: a directory
    gives every regular file under it (sorted, names relative to it, hidden ones skipped);
    anything but regular files and directories is refused."""
    out: list[tuple[str, Path]] = []
    for path in paths:
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            raise ContextFileError(f"context file not found: {path}") from None
        except OSError as exc:
            raise ContextFileError(f"cannot read context {path}: {exc.strerror or exc}") from None
        refuse_kind(path, mode, directories=True)
        if not stat.S_ISDIR(mode):
            out.append((path.name, path))
            continue
        found = []
        for root, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in sorted(files):
                if name.startswith("."):
                    continue
                full = Path(root) / name
                refuse_kind(full, os.stat(full).st_mode, directories=False)
                found.append((str(full.relative_to(path)), full))
        if not found:
            raise ContextFileError(f"context directory {path} holds no file")
        out.extend(found)
    return out


def store_documents(blobs: BlobStore, files: list[tuple[str, Path]]) -> tuple[ContextRef, list[DocumentRef]]:
    """Each file its own blob (a .json file as its value, any other as text), then the
    index naming them in order; the context is the index."""
    documents: list[DocumentRef] = []
    for name, path in files:
        ref = store_json_file(blobs, path) if path.suffix.lower() == ".json" else store_file(blobs, path)
        documents.append(
            DocumentRef(
                name=name,
                digest=ref.digest,
                kind="json" if ref.kind == "json" else "text",
                size=ref.size,
                stored_bytes=ref.stored_bytes,
                char_width=ref.char_width,
            )
        )
    index = {"format": DOCUMENTS_INDEX, "documents": [d.model_dump(mode="json") for d in documents]}
    digest = blobs.put_json(index)
    total = sum(d.size for d in documents)
    ref = ContextRef(
        digest=digest,
        kind="documents",
        size=total,
        type_name="list",
        documents=len(documents),
        stored_bytes=sum(d.stored_bytes for d in documents),
        char_width=max((d.char_width for d in documents), default=1),
    )
    return ref, documents


def read_documents_index(blobs: BlobStore, digest: str) -> list[DocumentRef]:
    value = blobs.get_json(digest)
    if not isinstance(value, dict) or value.get("format") != DOCUMENTS_INDEX:
        raise ValueError(f"blob {digest} is not a documents index")
    return [DocumentRef.model_validate(d) for d in value["documents"]]
