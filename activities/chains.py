"""Hash chains in the blob store: the conversation and the REPL cell log.

History carries only a chain's head digest and the entries one step adds, so its bytes per
iteration stay bounded (DESIGN invariant 5). Entries name their predecessor, so a head
digest identifies the whole sequence: two workers agree on REPL state iff heads are equal.
"""

from __future__ import annotations

from typing import Any

from durable_rlm.blobs import BlobStore
from workflows.models import Message

MAX_CHAIN = 1_000_000


def append(blobs: BlobStore, head: str | None, entry: dict[str, Any]) -> str:
    return blobs.put_json({"prev": head, **entry})


def walk(blobs: BlobStore, head: str | None) -> list[dict[str, Any]]:
    """Entries from the first to `head`."""
    entries: list[dict[str, Any]] = []
    while head is not None:
        node = blobs.get_json(head)
        entries.append(node)
        head = node["prev"]
        if len(entries) > MAX_CHAIN:
            raise ValueError("chain too long or cyclic")
    entries.reverse()
    return entries


def append_message(blobs: BlobStore, head: str | None, message: Message) -> str:
    content = blobs.put_text(message.content)
    return append(blobs, head, {"role": message.role, "content": content})


def read_conversation(blobs: BlobStore, head: str | None) -> list[Message]:
    return [Message(role=node["role"], content=blobs.get_text(node["content"])) for node in walk(blobs, head)]
