"""`drlm verify`: every blob an episode needs is in the blob store, and is what its digest says.

Histories hold digests, not bytes (DESIGN invariant 5), so a blob store that lost a file or
a row breaks an episode silently until someone reads it. This reads each episode's current
run chain (durable_rlm/audit/history.py) and the timelines the audit store keeps, and follows
every reference to the blob store:

- a claim-checked payload (durable_rlm/store/codec.py) anywhere in an event;
- inside the payloads: a `ContextRef` (the episode's context, an rlm_query prompt), a root
  call's conversation head, a REPL cell-log head (`log_head`), a `SnapshotRef`;
- along the hash chains those heads name (durable_rlm/store/chains.py): each node, a message's
  content, a cell's output, a recorded call's reply, a snapshot.

Each blob is read once and checked against its digest (opened with the keyring when the
store seals blobs). A missing or corrupt blob is reported with the episodes it breaks, what
it was to them, and what still works (the answer in history, show, export).

Digests that name no blob are not followed: `prompt_digest` and the audit rows'
`response_digest` are hashes of text kept elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeGuard

import sqlalchemy as sa
from google.protobuf.descriptor import FieldDescriptor
from temporalio.api.common.v1 import Payload
from temporalio.api.enums.v1 import EventType

from durable_rlm.audit.history import episode_runs
from durable_rlm.server.connection import connect
from durable_rlm.store import schema
from durable_rlm.store.blobs import BlobNotFound, BlobStore, CorruptBlob, digest_of
from durable_rlm.store.codec import ENCODING as CLAIM_CHECK
from durable_rlm.store.codec import ENCRYPTED, EncryptionCodec
from durable_rlm.store.encryption import open_blob
from durable_rlm.workflows import names

if TYPE_CHECKING:
    from temporalio.client import Client

DIGEST = re.compile(r"^sha256m?:[0-9a-f]{64}$")  # a blob, or a manifest of chunks (store/chunks.py)
_UNSEEN = object()
_CHECKED = object()  # a large blob read and checked chunk by chunk, its bytes not kept
JSON_ENCODINGS = (b"json/plain", b"json/protobuf")

Kind = Literal[
    "payload", "context", "documents", "prompt", "conversation", "cell log", "snapshot", "output", "reply"
]

BREAKS: dict[str, str] = {
    "payload": "its history cannot be decoded whole: show, export, audit-rebuild and a replay fail on it",
    "context": "a REPL rebuild cannot load `context` (a resume on another worker, a fork, a rerun)",
    "documents": "a REPL rebuild cannot load `context` (a resume on another worker, a fork, a rerun)",
    "prompt": "export cannot write an rlm_query's prompt (a child's context)",
    "conversation": "export cannot write the prompts sent; a fork or rerun from there cannot go on",
    "cell log": "a REPL rebuild cannot replay its cells (a resume on another worker, a fork, a rerun)",
    "snapshot": "a REPL rebuild cannot load that snapshot (it replays the cells instead, if they are whole)",
    "output": "a REPL rebuild cannot replay the cells whose output is gone",
    "reply": "a REPL rebuild cannot answer a recorded call from the log",
}
"""What a missing blob of each kind breaks, as a person can act on it."""


@dataclass(frozen=True)
class Reference:
    episode_id: str
    kind: Kind
    what: str  # where it was found, e.g. "the episode's context", "iteration 2's conversation"


@dataclass
class BlobProblem:
    digest: str
    state: Literal["missing", "corrupt"]
    detail: str
    references: list[Reference] = field(default_factory=list)


@dataclass
class EpisodeCheck:
    episode_id: str
    status: str
    answer: str | None = None
    answer_readable: bool = False
    history: bool = True  # False: only the audit store's stored timeline was there to read
    blobs: int = 0  # distinct blobs it references


@dataclass
class VerifyReport:
    episodes: dict[str, EpisodeCheck] = field(default_factory=dict)
    problems: dict[str, BlobProblem] = field(default_factory=dict)
    checked: int = 0
    chunks: int = 0  # chunks of large blobs, each read and checked
    unreadable: list[str] = field(default_factory=list)  # e.g. sealed payloads without a key

    @property
    def ok(self) -> bool:
        return not self.problems

    def broken(self, episode_id: str) -> list[tuple[BlobProblem, Reference]]:
        return [
            (problem, ref)
            for problem in self.problems.values()
            for ref in problem.references
            if ref.episode_id == episode_id
        ]

    def lines(self) -> list[str]:
        missing = sum(p.state == "missing" for p in self.problems.values())
        corrupt = len(self.problems) - missing
        head = (
            f"{len(self.episodes)} episode(s), {self.checked} blob(s) checked"
            + (f" ({self.chunks} chunk(s) of large ones)" if self.chunks else "")
            + ": "
            f"{missing} missing, {corrupt} corrupt"
        )
        out = [head]
        for problem in self.problems.values():
            episodes = sorted({r.episode_id for r in problem.references})
            out.append(f"{problem.state.upper()} {problem.digest}: {problem.detail}")
            out.append(f"  breaks: {', '.join(episodes)}")
        for check in self.episodes.values():
            broken = self.broken(check.episode_id)
            if not broken:
                continue
            out.append(f"episode {check.episode_id} ({check.status}): {len(broken)} reference(s) broken")
            for what in sorted({f"{r.what} [{p.state}]" for p, r in broken}):
                out.append(f"  - {what}")
            for kind in sorted({r.kind for _, r in broken}):
                out.append(f"  breaks: {BREAKS[kind]}")
            out.append(f"  still works: {self.still_works(check, {r.kind for _, r in broken})}")
        out.extend(f"not checked: {note}" for note in self.unreadable)
        return out

    @staticmethod
    def still_works(check: EpisodeCheck, kinds: set[str]) -> str:
        works: list[str] = []
        if check.answer_readable and check.answer is not None:
            answer = check.answer if len(check.answer) <= 80 else check.answer[:80] + "..."
            works.append(f"the answer is in history ({answer!r})")
        elif check.answer_readable:
            works.append("the result is in history (no answer)")
        elif check.status == "completed":
            works.append("nothing of the result: it cannot be read")
        if "payload" not in kinds and check.history:
            works.append("drlm show")
        if not kinds & {"payload", "conversation", "prompt"} and check.history:
            works.append("drlm export")
        if not kinds & {"context", "cell log", "output", "reply", "payload"}:
            works.append("REPL rebuilds")
        return "; ".join(works) or "nothing that reads these blobs"

    def as_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "checked": self.checked,
            "chunks": self.chunks,
            "episodes": len(self.episodes),
            "problems": [
                {
                    "digest": p.digest,
                    "state": p.state,
                    "detail": p.detail,
                    "references": [r.__dict__ for r in p.references],
                }
                for p in self.problems.values()
            ],
            "broken_episodes": [
                {
                    "episode_id": c.episode_id,
                    "status": c.status,
                    "answer_in_history": c.answer if c.answer_readable else None,
                    "breaks": sorted({BREAKS[r.kind] for _, r in self.broken(c.episode_id)}),
                    "still_works": self.still_works(c, {r.kind for _, r in self.broken(c.episode_id)}),
                }
                for c in self.episodes.values()
                if self.broken(c.episode_id)
            ],
            "not_checked": self.unreadable,
        }


class Verifier:
    """Reads each blob once, whichever episodes share it; reports per episode."""

    def __init__(self, client: Client | None, blobs: BlobStore, engine: sa.Engine | None) -> None:
        self.client = client
        self.blobs = blobs
        self.engine = engine
        self.report = VerifyReport()
        self._read: dict[str, object] = {}  # bytes, _CHECKED, or None: missing or corrupt
        self._opener = EncryptionCodec(blobs.keyring)

    # -- blobs -------------------------------------------------------------------------

    def _load(self, digest: str, keep: bool = True) -> bytes | None:
        """The blob's bytes when `keep` (a payload, a chain node: parsed next), else only
        checked: a manifest's chunks are each read, checked and dropped, never held whole."""
        known = self._read.get(digest, _UNSEEN)
        if known is not _UNSEEN and (known is not _CHECKED or not keep):
            return known if isinstance(known, bytes) else None  # None: checked only, or broken
        data: bytes | None = None
        outcome: object = None
        try:
            manifest = self.blobs.manifest(digest)
            if manifest is None:
                stored = self.blobs.backend.read(digest)  # the store's bytes, never a cached copy
                if stored is None:
                    raise BlobNotFound(digest, self.blobs.where)
                data = open_blob(self.blobs.keyring, digest, stored)
                if digest_of(data) != digest:
                    raise CorruptBlob(f"its {len(data):,} bytes hash to {digest_of(data)}")
                outcome = data
            else:
                self.report.chunks += len(manifest.chunks)
                if keep:
                    data = b"".join(self.blobs.chunks(digest))
                    outcome = data
                else:
                    self.blobs.check(digest)
                    outcome = _CHECKED
        except BlobNotFound as exc:
            where = self.blobs.where or "the blob store"
            inner = f" ({exc.digest})" if exc.digest != digest else ""
            self._problem(digest, "missing", f"not in {where}{inner}")
        except CorruptBlob as exc:
            self._problem(digest, "corrupt", str(exc))
        except ValueError as exc:  # a malformed digest
            self._problem(digest, "corrupt", str(exc))
        except Exception as exc:  # noqa: BLE001 - a seal that does not open is corruption
            self._problem(digest, "corrupt", f"cannot be opened: {exc}")
        if known is _UNSEEN:
            self.report.checked += 1
        self._read[digest] = outcome  # None: missing or corrupt (see report)
        return data

    def _problem(self, digest: str, state: Literal["missing", "corrupt"], detail: str) -> None:
        self.report.problems.setdefault(digest, BlobProblem(digest, state, detail))

    def _need(self, digest: str, ref: Reference, seen: set[str], keep: bool = True) -> bytes | None:
        """The blob's bytes if whole (and `keep`); records who needed it when it is not."""
        seen.add(digest)
        data = self._load(digest, keep)
        problem = self.report.problems.get(digest)
        if problem is not None and ref not in problem.references:
            problem.references.append(ref)
        return data

    # -- what a value references ---------------------------------------------------------

    def _scan(self, episode_id: str, value: Any, where: str, seen: set[str]) -> None:
        for kind, digest, what in _references(value, where):
            if kind == "context" and not where.startswith(("the episode's request", "the audit store")):
                kind = "prompt"  # a context in a step or a child's request: an rlm_query prompt
            ref = Reference(episode_id, kind, what)
            if kind in ("conversation", "cell log"):
                self._walk(episode_id, digest, kind, what, seen)
            elif kind == "documents":
                self._documents(episode_id, digest, what, seen)
            elif _is_digest(digest):
                self._need(digest, ref, seen, keep=False)

    def _documents(self, episode_id: str, digest: str, what: str, seen: set[str]) -> None:
        """A documents context: its index, then each document it names."""
        if not _is_digest(digest):
            return
        data = self._need(digest, Reference(episode_id, "context", f"the documents index of {what}"), seen)
        if data is None:
            return
        try:
            documents = json.loads(data)["documents"]
        except (ValueError, KeyError, TypeError):
            self._problem(digest, "corrupt", "not a documents index")
            return
        for document in documents if isinstance(documents, list) else []:
            sub = document.get("digest") if isinstance(document, dict) else None
            if _is_digest(sub):
                name = document.get("name")
                self._need(
                    sub, Reference(episode_id, "context", f"document {name!r} of {what}"), seen, keep=False
                )

    def _walk(self, episode_id: str, head: str, kind: Kind, what: str, seen: set[str]) -> None:
        """A hash chain from its head back to its first node; shared prefixes are walked once
        per episode (heads of successive steps name the same older nodes)."""
        if head in seen:  # walked already: only who needs it is new
            self._need(head, Reference(episode_id, kind, what), seen)
            return
        digest: str | None = head
        while digest is not None and _is_digest(digest) and digest not in seen:
            data = self._need(digest, Reference(episode_id, kind, what), seen)
            if data is None:
                return
            try:
                node = json.loads(data)
            except ValueError:
                return  # not a chain node: nothing further to follow
            if not isinstance(node, dict):
                return
            for sub_kind, sub, sub_what in _node_references(node, what):
                if _is_digest(sub):
                    self._need(sub, Reference(episode_id, sub_kind, sub_what), seen)
            previous = node.get("prev")
            digest = previous if isinstance(previous, str) else None

    def _payload_value(self, episode_id: str, payload: Payload, where: str, seen: set[str]) -> Any:
        """A payload's JSON, through the claim check (and the seal); None if unreadable."""
        if payload.metadata.get("encoding") == ENCRYPTED:
            try:
                payload = self._opener.open_payload(payload)
            except Exception as exc:  # noqa: BLE001 - a payload this process cannot open
                note = f"{episode_id}: {where}: {exc}"
                if note not in self.report.unreadable:
                    self.report.unreadable.append(note)
                return None
        if payload.metadata.get("encoding") == CLAIM_CHECK:
            digest = payload.data.decode("utf-8", errors="replace")
            data = self._need(digest, Reference(episode_id, "payload", f"the payload of {where}"), seen)
            if data is None:
                return None
            payload = Payload.FromString(data)
        if payload.metadata.get("encoding") not in JSON_ENCODINGS:
            return None
        try:
            return json.loads(payload.data)
        except ValueError:
            return None

    # -- episodes --------------------------------------------------------------------------

    async def episode(self, episode_id: str) -> list[str]:
        """Check one episode; returns the child episodes its history started."""
        assert self.client is not None
        seen: set[str] = set()
        try:
            runs = await episode_runs(self.client, episode_id)
        except LookupError:
            runs = []
        current = runs[-1].status if runs else None
        check = EpisodeCheck(
            episode_id, current.name.lower() if current is not None else "unknown", history=bool(runs)
        )
        self.report.episodes[episode_id] = check
        children: list[str] = []
        for run in runs:
            activities: dict[int, str] = {}
            for event in run.history.events:
                where = _place(event, activities)
                for payload in _payloads(event):
                    value = await asyncio.to_thread(self._payload_value, episode_id, payload, where, seen)
                    if value is not None:
                        await asyncio.to_thread(self._scan, episode_id, value, where, seen)
                    if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED:
                        check.answer_readable = isinstance(value, dict)
                        check.answer = value.get("answer") if isinstance(value, dict) else None
                if event.event_type == EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED:
                    children.append(
                        event.start_child_workflow_execution_initiated_event_attributes.workflow_id
                    )
        stored = await asyncio.to_thread(self._stored_timeline, episode_id)
        if stored is not None:
            await asyncio.to_thread(self._scan, episode_id, stored, "the audit store's stored timeline", seen)
            if not runs and isinstance(stored.get("result"), dict):
                check.status = str(stored.get("status"))
                check.answer, check.answer_readable = stored["result"].get("answer"), True
        if not runs and stored is None:
            raise LookupError(f"no episode with id {episode_id!r}")
        check.blobs = len(seen)
        return list(dict.fromkeys(children))

    def _stored_timeline(self, episode_id: str) -> dict[str, Any] | None:
        if self.engine is None:
            return None
        table = schema.episode_timelines
        try:
            with self.engine.connect() as conn:
                text = conn.execute(
                    sa.select(table.c.timeline).where(
                        table.c.episode_id == episode_id, table.c.blobs_expired_at.is_(None)
                    )
                ).scalar_one_or_none()
        except sa.exc.DatabaseError:
            return None
        if text is None:
            return None
        value = json.loads(text)
        return value if isinstance(value, dict) else None

    async def tree(self, episode_id: str) -> None:
        """An episode and every child episode under it."""
        pending = [episode_id]
        while pending:
            current = pending.pop(0)
            if current in self.report.episodes:
                continue
            try:
                pending.extend(await self.episode(current))
            except LookupError:
                if current == episode_id:
                    raise

    async def everything(self) -> None:
        """Every episode Temporal still has, and every one the audit store keeps a timeline of."""
        assert self.client is not None
        ids: set[str] = set()
        async for execution in self.client.list_workflows(f'WorkflowType = "{names.WORKFLOW}"'):
            ids.add(execution.id)
        ids |= await asyncio.to_thread(self._stored_ids)
        for episode_id in sorted(ids):
            if episode_id not in self.report.episodes:
                await self.episode(episode_id)

    def _stored_ids(self) -> set[str]:
        if self.engine is None:
            return set()
        try:
            with self.engine.connect() as conn:
                table = schema.episode_timelines
                # An episode whose history passed retention: `drlm gc` removed its blobs.
                query = sa.select(table.c.episode_id).where(table.c.blobs_expired_at.is_(None))
                return set(conn.execute(query).scalars())
        except sa.exc.DatabaseError:
            return set()


def _is_digest(value: Any) -> TypeGuard[str]:
    return isinstance(value, str) and DIGEST.match(value) is not None


def _references(value: Any, where: str) -> Iterator[tuple[Kind, str, str]]:
    """The blob references inside a decoded payload (or a stored timeline), by shape: the
    models' field names (workflows/models.py) are what history keeps."""
    stack: list[tuple[Any, str]] = [(value, where)]
    while stack:
        item, context = stack.pop()
        if isinstance(item, list):
            stack.extend((x, context) for x in item)
            continue
        if not isinstance(item, dict):
            continue
        iteration = item.get("iteration")
        here = f"iteration {iteration}, {context}" if isinstance(iteration, int) else context
        keys = set(item)
        if {"digest", "kind", "size"} <= keys and item.get("kind") in ("text", "json"):
            yield "context", item["digest"], f"the context in {context}"
        elif {"digest", "kind", "size"} <= keys and item.get("kind") == "documents":
            yield "documents", item["digest"], f"the context in {context}"
        elif {"digest", "cell", "size", "log_head"} <= keys:
            yield "snapshot", item["digest"], f"the REPL snapshot after cell {item['cell']} ({context})"
        conversation = item.get("conversation")
        if _is_digest(conversation):
            yield "conversation", conversation, f"the conversation sent in {here}"
        head = item.get("log_head")
        if _is_digest(head):
            yield "cell log", head, f"the REPL cell log ({context})"
        for key, sub in item.items():
            if key not in ("conversation", "log_head") and isinstance(sub, dict | list):
                stack.append((sub, context))


def _node_references(node: dict[str, Any], what: str) -> Iterator[tuple[Kind, str, str]]:
    """The blobs a chain node names besides its predecessor (durable_rlm/store/chains.py)."""
    if "role" in node and "content" in node:
        yield "conversation", node["content"], f"a {node['role']} message of {what}"
    if node.get("t") == "end" and node.get("output") is not None:
        yield "output", node["output"], f"cell {node.get('cell')}'s output ({what})"
    if node.get("t") == "snapshot":
        yield "snapshot", node.get("ref", ""), f"the REPL snapshot after cell {node.get('cell')} ({what})"
    answers = list(node.get("answers") or [])
    for cell in node.get("recreate") or []:
        if isinstance(cell, dict):
            answers.extend(cell.get("answers") or [])
    for answer in answers:
        if isinstance(answer, dict) and answer.get("ok") is not None:
            yield "reply", answer.get("text", ""), f"the reply to call {answer.get('call')} ({what})"


def _place(event: Any, activities: dict[int, str]) -> str:
    """An event as a person finds it in the history: "the episode's request (event 1)",
    "the input of drlm.root_completion (event 16)"; `activities` learns scheduled steps."""
    kind = event.event_type
    if kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED:
        return f"the episode's request (event {event.event_id})"
    if kind == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
        name = activities[event.event_id] = event.activity_task_scheduled_event_attributes.activity_type.name
        return f"the input of {name} (event {event.event_id})"
    if kind == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
        name = activities.get(event.activity_task_completed_event_attributes.scheduled_event_id, "a step")
        return f"the result of {name} (event {event.event_id})"
    if kind == EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED:
        child = event.start_child_workflow_execution_initiated_event_attributes.workflow_id
        return f"the request of child {child} (event {event.event_id})"
    if kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED:
        return f"the episode's result (event {event.event_id})"
    name = EventType.Name(kind).removeprefix("EVENT_TYPE_").lower()
    return f"{name} (event {event.event_id})"


def _payloads(message: Any) -> Iterator[Payload]:
    """Every Payload inside a protobuf message (inputs, results, markers, failures' details,
    headers, memos): whatever an event holds, wherever the SDK put it."""
    if message.DESCRIPTOR.full_name == "temporal.api.common.v1.Payload":
        yield message
        return
    for descriptor, value in message.ListFields():
        if descriptor.type != FieldDescriptor.TYPE_MESSAGE:
            continue
        if descriptor.message_type.GetOptions().map_entry:
            entry_value = descriptor.message_type.fields_by_name["value"]
            if entry_value.type == FieldDescriptor.TYPE_MESSAGE:
                for item in value.values():
                    yield from _payloads(item)
        elif _repeated(descriptor):
            for item in value:
                yield from _payloads(item)
        else:
            yield from _payloads(value)


def _repeated(descriptor: Any) -> bool:
    """protobuf 6 says `is_repeated`; older ones only have `label`."""
    flag = getattr(descriptor, "is_repeated", None)
    return bool(flag) if flag is not None else descriptor.label == FieldDescriptor.LABEL_REPEATED


async def verify(
    client: Client, blobs: BlobStore, engine: sa.Engine | None, episode_id: str | None = None
) -> VerifyReport:
    """Check one episode (and its children), or every episode when `episode_id` is None."""
    verifier = Verifier(client, blobs, engine)
    if episode_id is None:
        await verifier.everything()
    else:
        await verifier.tree(episode_id)
    return verifier.report


async def verify_command(settings: Any, episode_id: str | None, as_json: bool) -> int:
    """`drlm verify [ID | --all]`: the report on stdout; exit 1 when a blob is missing or corrupt."""
    async with connect(settings) as services:
        report = await verify(services.client, services.blobs, services.engine, episode_id)
    if as_json:
        print(json.dumps(report.as_json()))
    else:
        print("\n".join(report.lines()))
    return 0 if report.ok else 1
