"""Hash chains in the blob store: the conversation and the REPL cell log.

History carries only a chain's head digest and the entries one step adds, so its bytes per
iteration stay bounded (DESIGN invariant 5). Entries name their predecessor, so a head
digest identifies the whole sequence: two workers agree on REPL state iff heads are equal.

The cell log is typed: `CellStarted`, `CallsAnswered`, `CellEnded` and (room for REPL
snapshots) `SnapshotTaken`, stored as `{"prev": ..., "t": ..., ...}` JSON nodes, the shape
logs had before these models, so old logs read the same. `read_cell_log` is the one reader.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from durable_rlm.store.blobs import BlobStore, TypedBlobs
from durable_rlm.workflows.models import Message

MAX_CHAIN = 1_000_000

CellStatus = Literal["ok", "error", "timeout", "killed", "lost"]
SKIPPED_ON_REBUILD: frozenset[str] = frozenset({"killed", "timeout", "lost"})
"""Cells whose effects did not survive: a rebuild does not run them again."""


class _Entry(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CellStarted(_Entry):
    t: Literal["cell"] = "cell"
    cell: int
    iteration: int = 0
    code: str


class LoggedAnswer(_Entry):
    """A call's recorded result: the prompt's digest (to detect divergence) and the
    reply's blob digest, so a rebuild answers the call without calling anything."""

    call: int
    prompt: str
    ok: bool
    text: str
    kind: str = "llm_query"


class CallsAnswered(_Entry):
    t: Literal["answers"] = "answers"
    cell: int
    answers: list[LoggedAnswer]


class CellEnded(_Entry):
    t: Literal["end"] = "end"
    cell: int | None
    status: CellStatus
    output: str | None = None  # blob digest of stdout + stderr + error


class RecreateCell(_Entry):
    """A cell a rebuild re-runs after loading a snapshot, for the names the snapshot could
    not hold (open files, generators...): its code and logged answers travel with it."""

    cell: int
    code: str
    answers: list[LoggedAnswer] = []
    names: dict[str, str]  # name -> why it could not be saved


class StoredSnapshot(_Entry):
    """An earlier snapshot of the episode that the store still holds: its blob and size."""

    ref: str
    size: int


class SnapshotTaken(_Entry):
    """A checkpoint of the namespace after `cell`. `mac` is a keyed hash (the workers' key)
    over the rest of the entry, so a snapshot is loaded only into the episode it was made
    for, and only as it was made. `kept`: the episode's earlier snapshots still stored when
    this one was taken, oldest first (activities/repl_snapshots.py deletes the oldest when
    the episode's snapshot quota needs the room); not signed: it decides deletions only."""

    t: Literal["snapshot"] = "snapshot"
    ref: str  # blob digest of the compressed pickle
    cell: int
    episode: str
    size: int
    recreate: list[RecreateCell] = []
    lost: dict[str, str] = {}  # names it could not hold and no logged cell re-creates
    mac: str = ""
    kept: list[StoredSnapshot] = []

    def signed_part(self) -> bytes:
        body = self.model_dump(mode="json", exclude={"mac", "kept"})
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")

    @property
    def unsaved(self) -> list[str]:
        return sorted([*(name for cell in self.recreate for name in cell.names), *self.lost])


LogEntry = Annotated[CellStarted | CallsAnswered | CellEnded | SnapshotTaken, Field(discriminator="t")]
_ENTRY = TypeAdapter(LogEntry)


@dataclass
class LoggedCell:
    """One cell as the log tells it: its code, the answers it got, how it ended."""

    index: int
    iteration: int
    code: str
    answers: list[LoggedAnswer] = field(default_factory=list)
    status: CellStatus | None = None  # None: the cell has not ended (it is mid-call)
    output: str | None = None


@dataclass
class CellLog:
    cells: list[LoggedCell]
    snapshot: SnapshotTaken | None = None  # the latest snapshot, if any
    snapshot_at: int = 0  # cells before it: `cells[snapshot_at:]` ran after it
    partial: bool = False  # read back only to the snapshot (cells before it are not listed)

    @property
    def open_cell(self) -> LoggedCell | None:
        """The last cell if it has not ended: a step of it is in flight."""
        return self.cells[-1] if self.cells and self.cells[-1].status is None else None


def append(blobs: TypedBlobs, head: str | None, entry: _Entry | dict[str, Any]) -> str:
    body = entry.model_dump(mode="json") if isinstance(entry, BaseModel) else entry
    return blobs.put_json({"prev": head, **body})


def walk(blobs: TypedBlobs, head: str | None, stop_at: str | None = None) -> list[dict[str, Any]]:
    """Nodes from the first to `head`; with `stop_at`, from the newest node of that type
    (a rebuild reads back only to the latest snapshot, so its cost does not grow with the
    episode's length)."""
    nodes: list[dict[str, Any]] = []
    while head is not None:
        node = blobs.get_json(head)
        nodes.append(node)
        if stop_at is not None and node.get("t") == stop_at:
            break
        head = node["prev"]
        if len(nodes) > MAX_CHAIN:
            raise ValueError("chain too long or cyclic")
    nodes.reverse()
    return nodes


def read_cell_log(blobs: TypedBlobs, head: str | None, since_snapshot: bool = False) -> CellLog:
    """The cell log up to `head`, as cells; `since_snapshot`: only the latest snapshot and
    the cells after it."""
    log = CellLog(cells=[])
    nodes = walk(blobs, head, stop_at="snapshot" if since_snapshot else None)
    log.partial = since_snapshot and bool(nodes) and nodes[0].get("t") == "snapshot"
    for node in nodes:
        entry = _ENTRY.validate_python({k: v for k, v in node.items() if k != "prev"})
        if isinstance(entry, CellStarted):
            log.cells.append(LoggedCell(entry.cell, entry.iteration, entry.code))
        elif isinstance(entry, SnapshotTaken):
            log.snapshot, log.snapshot_at = entry, len(log.cells)
        elif not log.cells:
            raise ValueError(f"cell log entry {entry.t!r} before any cell")
        elif isinstance(entry, CallsAnswered):
            log.cells[-1].answers.extend(entry.answers)
        else:
            log.cells[-1].status, log.cells[-1].output = entry.status, entry.output
    return log


def append_message(blobs: BlobStore, head: str | None, message: Message) -> str:
    content = blobs.put_text(message.content)
    return append(blobs, head, {"role": message.role, "content": content})


def read_conversation(blobs: BlobStore, head: str | None) -> list[Message]:
    return [Message(role=node["role"], content=blobs.get_text(node["content"])) for node in walk(blobs, head)]
