"""`--context`: the paths a person names, checked before anything starts, then streamed into
the blob store, then checked against what a sandbox can hold.

One file is `context` (its text, or for a .json file its value). A directory, or `--context`
given more than once, is a list of documents: every regular file (hidden ones skipped), each
its own blob, loaded in the sandbox only when code touches it. Every problem is one line and
exit 2, and no episode is started: a FIFO, a device, a socket, a directory given where a file
is meant, a file that changes while it is read, text that is not UTF-8, or a context larger
than a sandbox can hold as one string.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from durable_rlm.activities.context_room import Room
from durable_rlm.store.blobs import BlobStore
from durable_rlm.store.contexts import (
    ContextFileError,
    context_files,
    refuse_kind,
    store_documents,
    store_file,
    store_json_file,
)
from durable_rlm.workflows.models import ContextRef


@dataclass(frozen=True)
class ContextPlan:
    """What `--context` names, checked, not yet read: one file, or documents."""

    files: tuple[tuple[str, Path], ...]
    documents: bool
    mapped: bool = False  # one ASCII text, `context` a read-only view of the worker's copy

    def describe(self) -> str:
        if not self.documents:
            return str(self.files[0][1])
        return f"{len(self.files)} documents"


def plan_context(paths: list[Path] | None, room: Room | None = None, view: str = "str") -> ContextPlan | None:
    """The paths checked for what they are (and, against `room`, for their size: a file's
    string is at least half its bytes), reading no content."""
    if not paths:
        return None
    if len(paths) == 1:
        try:
            mode = os.stat(paths[0]).st_mode
        except OSError:
            mode = None  # said by context_files, in its words
        if mode is not None:
            refuse_kind(paths[0], mode, directories=True)
    files = context_files(paths)
    documents = len(paths) > 1 or Path(paths[0]).is_dir()
    mapped = view == "mapped"
    if mapped and (documents or files[0][1].suffix.lower() == ".json"):
        raise ContextFileError("--context-view mapped is for one text file (documents are read when touched)")
    plan = ContextPlan(tuple(files), documents, mapped)
    if room is not None and not mapped:
        for name, path in plan.files:
            size = path.stat().st_size
            # The least a string of `size` UTF-8 bytes takes (two-byte Latin-1 text: half).
            refusal = room.refusal(
                f"context {'document ' + name if documents else path} ({size:,} bytes)",
                size // 2,
                size,
                documents=documents,
            )
            if refusal is not None:
                raise ContextFileError(refusal)
    return plan


def store_plan(blobs: BlobStore, plan: ContextPlan, room: Room | None = None) -> ContextRef:
    """Stream the plan's files into the store, then check the strings they make against
    `room` (now known exactly: characters and their width)."""
    if not plan.documents:
        _, path = plan.files[0]
        ref = store_json_file(blobs, path) if path.suffix.lower() == ".json" else store_file(blobs, path)
        if plan.mapped:
            if ref.size != ref.stored_bytes:
                raise ContextFileError(
                    f"context {path} is not ASCII text: the mapped view indexes characters as bytes "
                    "(pass it as `str`, the default, or split it into documents)"
                )
            return ref.model_copy(update={"view": "mapped"})
        if room is not None:
            refusal = room.refusal(f"context {path}", ref.size * ref.char_width, ref.stored_bytes)
            if refusal is not None:
                raise ContextFileError(refusal)
        return ref
    ref, documents = store_documents(blobs, list(plan.files))
    if room is not None:
        for document in documents:
            str_bytes = document.size * document.char_width
            refusal = room.refusal(
                f"context document {document.name}", str_bytes, document.stored_bytes, documents=True
            )
            if refusal is not None:
                raise ContextFileError(refusal)
    return ref
