"""REPL cell execution: one sandbox process per episode, cells as resumable coroutines.

A cell that calls `llm_query` stops at the call; the activity returns `suspended` with the
requests, the workflow runs them as activities, and `repl_resume` hands the answers back.
Every step is appended to the cell log (a hash chain in the blob store). A step names the
log head it expects; a worker whose live sandbox is at another head (or has none) rebuilds
one by re-running the logged cells and answering their model calls from the log, without
calling any model (DESIGN invariant 3).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities import chains
from activities.sandbox import CHILD_PATH
from activities.sandbox.child import HEADER, MAX_FRAME, NOBODY, decode_body, encode_frame
from durable_rlm.blobs import BlobStore, text_digest
from workflows import names
from workflows.models import (
    CellOutcome,
    CloseSandboxInput,
    ExecuteCellInput,
    ReadVariableInput,
    ResumeCellInput,
    SandboxRef,
    SubCallRequest,
    VariableValue,
)

HARD_KILL_GRACE_S = 5.0
STARTUP_TIMEOUT_S = 30.0
SKIPPED_ON_REBUILD = {"killed", "timeout"}


def prepare_sandbox_root(root: Path) -> Path:
    """Create the root; when sandboxes drop to `nobody`, every parent must let it through."""
    root = root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        os.chmod(root, 0o711)
        for parent in [root, *root.parents]:
            if not os.stat(parent).st_mode & 0o001:
                raise ValueError(
                    f"sandbox directory {root} is unreachable for the unprivileged sandbox user: "
                    f"{parent} is not traversable by others (chmod o+x, or choose another root)"
                )
    return root


def _beat() -> None:
    if activity.in_activity():
        activity.heartbeat()


@dataclass
class LiveSandbox:
    episode_id: str
    process: asyncio.subprocess.Process
    directory: Path
    frames: asyncio.Queue[dict[str, Any] | None]
    reader: asyncio.Task[None]
    log_head: str | None = None
    cell_index: int | None = None
    next_call: int = 0
    pending: list[SubCallRequest] = field(default_factory=list)
    early_done: dict[str, Any] | None = None
    last_used: float = field(default_factory=time.monotonic)
    network: str = ""

    async def send(self, message: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(encode_frame(message))
        await self.process.stdin.drain()

    async def receive(self, timeout: float) -> dict[str, Any] | None:
        """The next frame; None when the process died or stayed silent past `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                return await asyncio.wait_for(self.frames.get(), min(1.0, remaining))
            except TimeoutError:
                _beat()

    async def kill(self) -> None:
        self.reader.cancel()
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.process.wait(), 5)
        shutil.rmtree(self.directory, ignore_errors=True)


async def _read_frames(process: asyncio.subprocess.Process, queue: asyncio.Queue) -> None:
    assert process.stdout is not None
    try:
        while True:
            header = await process.stdout.readexactly(HEADER.size)
            (length,) = HEADER.unpack(header)
            if length > MAX_FRAME:
                break
            await queue.put(decode_body(await process.stdout.readexactly(length)))
    except (asyncio.IncompleteReadError, ValueError, ConnectionError):
        pass
    finally:
        await queue.put(None)


class ReplActivities:
    """The sandboxes this worker process holds, and the REPL activities that drive them.

    `worker_queue` is a task queue only this process polls; outcomes name it so the workflow
    routes the episode's next REPL step back here, where its sandbox lives.
    """

    def __init__(
        self,
        blobs: BlobStore,
        worker_queue: str,
        sandbox_root: Path,
        memory_mb: int = 4096,
        idle_s: float = 1800.0,
    ) -> None:
        self.blobs = blobs
        self.worker_queue = worker_queue
        self.sandbox_root = prepare_sandbox_root(Path(sandbox_root))
        self.memory_mb = memory_mb
        self.idle_s = idle_s
        self._live: dict[str, LiveSandbox] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    # --- activities -----------------------------------------------------------------------

    @activity.defn(name=names.REPL_EXECUTE)
    async def execute_cell(self, request: ExecuteCellInput) -> CellOutcome:
        async with self._lock(request.sandbox.episode_id):
            box, rebuilt, divergences = await self._ensure(request.sandbox)
            if box.cell_index is not None:
                raise ApplicationError(
                    "sandbox is mid-cell; cannot start another", type=names.SANDBOX_FAILURE
                )
            head = await self._log(
                box.log_head,
                {
                    "t": "cell",
                    "cell": request.cell_index,
                    "iteration": request.iteration,
                    "code": request.code,
                },
            )
            box.log_head, box.cell_index, box.next_call = head, request.cell_index, 0
            await box.send(self._exec_message(request.sandbox, request.cell_index, request.code))
            outcome = await self._drive(box, request.sandbox)
            return outcome.model_copy(update={"rebuilt": rebuilt, "divergences": divergences})

    @activity.defn(name=names.REPL_RESUME)
    async def resume_cell(self, request: ResumeCellInput) -> CellOutcome:
        async with self._lock(request.sandbox.episode_id):
            box, rebuilt, divergences = await self._ensure(request.sandbox)
            if box.early_done is not None:
                # Rebuilt code finished without asking for these calls: it diverged.
                return await self._finish(box, box.early_done, rebuilt, divergences)
            expected = [r.call_index for r in box.pending]
            given = [a.call_index for a in request.answers]
            if box.cell_index != request.cell_index or expected != given:
                raise ApplicationError(
                    f"answers for calls {given} of cell {request.cell_index} do not match the "
                    f"pending calls {expected} of cell {box.cell_index}",
                    type=names.SANDBOX_FAILURE,
                    non_retryable=True,
                )
            answer_refs = [
                {
                    "call": a.call_index,
                    "prompt": a.prompt_digest,
                    "ok": a.ok,
                    "text": await asyncio.to_thread(self.blobs.put_text, a.text),
                }
                for a in request.answers
            ]
            box.log_head = await self._log(
                box.log_head, {"t": "answers", "cell": request.cell_index, "answers": answer_refs}
            )
            box.pending = []
            await box.send(
                {"op": "answers", "answers": [{"ok": a.ok, "text": a.text} for a in request.answers]}
            )
            outcome = await self._drive(box, request.sandbox)
            return outcome.model_copy(update={"rebuilt": rebuilt, "divergences": divergences})

    @activity.defn(name=names.REPL_READ_VARIABLE)
    async def read_variable(self, request: ReadVariableInput) -> VariableValue:
        async with self._lock(request.sandbox.episode_id):
            box, _, _ = await self._ensure(request.sandbox)
            await box.send({"op": "read_var", "name": request.name})
            reply = await box.receive(request.sandbox.cell_timeout_s + HARD_KILL_GRACE_S)
            if reply is None or reply.get("op") != "var":
                await self._discard(box)
                raise ApplicationError(
                    f"sandbox did not answer a read of {request.name!r}", type=names.SANDBOX_FAILURE
                )
            return VariableValue(
                found=bool(reply["found"]),
                value=reply.get("value"),
                log_head=box.log_head or "",
                worker_queue=self.worker_queue,
            )

    @activity.defn(name=names.REPL_CLOSE)
    async def close_sandbox(self, request: CloseSandboxInput) -> bool:
        async with self._lock(request.episode_id):
            box = self._live.pop(request.episode_id, None)
            if box is not None:
                await box.kill()
            self._locks.pop(request.episode_id, None)
            return box is not None

    # --- lifecycle ------------------------------------------------------------------------

    async def reap_idle(self) -> int:
        """Kill sandboxes unused for `idle_s`; a later step rebuilds them from the log."""
        now = time.monotonic()
        stale = [
            e for e, b in self._live.items() if now - b.last_used > self.idle_s and not self._lock(e).locked()
        ]
        for episode_id in stale:
            await self._discard(self._live[episode_id])
        return len(stale)

    async def close_all(self) -> None:
        for box in list(self._live.values()):
            await self._discard(box)

    # --- internals ------------------------------------------------------------------------

    def _lock(self, episode_id: str) -> asyncio.Lock:
        return self._locks.setdefault(episode_id, asyncio.Lock())

    async def _log(self, head: str | None, entry: dict[str, Any]) -> str:
        return await asyncio.to_thread(chains.append, self.blobs, head, entry)

    def _exec_message(self, ref: SandboxRef, cell_index: int, code: str) -> dict[str, Any]:
        return {
            "op": "exec",
            "code": code,
            "cell_name": f"<cell {cell_index}>",
            "timeout": ref.cell_timeout_s,
            "limit": ref.output_truncation,
        }

    async def _discard(self, box: LiveSandbox) -> None:
        if self._live.get(box.episode_id) is box:
            del self._live[box.episode_id]
        await box.kill()

    async def _drive(self, box: LiveSandbox, ref: SandboxRef) -> CellOutcome:
        """Run the current cell until it completes or stops at model calls."""
        box.last_used = time.monotonic()
        frame = await box.receive(ref.cell_timeout_s + HARD_KILL_GRACE_S)
        if frame is None:
            return await self._killed(box, ref)
        if frame["op"] == "call":
            box.pending = [
                SubCallRequest(call_index=box.next_call + i, prompt=p, prompt_digest=text_digest(p))
                for i, p in enumerate(frame["prompts"])
            ]
            box.next_call += len(box.pending)
            return CellOutcome(
                status="suspended",
                log_head=box.log_head or "",
                worker_queue=self.worker_queue,
                requests=box.pending,
            )
        return await self._finish(box, frame, False, [])

    async def _finish(
        self, box: LiveSandbox, frame: dict[str, Any], rebuilt: bool, divergences: list[str]
    ) -> CellOutcome:
        status = frame.get("status", "error")
        # The output is logged so fallback extraction can rebuild the REPL history.
        output = "\n".join(x for x in (frame.get("stdout"), frame.get("stderr"), frame.get("error")) if x)
        output_ref = await asyncio.to_thread(self.blobs.put_text, output)
        box.log_head = await self._log(
            box.log_head, {"t": "end", "cell": box.cell_index, "status": status, "output": output_ref}
        )
        box.cell_index, box.pending, box.early_done = None, [], None
        return CellOutcome(
            status="completed",
            log_head=box.log_head,
            worker_queue=self.worker_queue,
            stdout=frame.get("stdout", ""),
            stderr=frame.get("stderr", ""),
            error=frame.get("error"),
            answer=frame.get("answer"),
            rebuilt=rebuilt,
            divergences=divergences,
            variables=frame.get("variables") or {},
            submitted=frame.get("submitted"),
        )

    async def _killed(self, box: LiveSandbox, ref: SandboxRef) -> CellOutcome:
        """The cell ignored its interrupt or the process died: the namespace is gone."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(box.process.wait(), 1.0)  # reap it if it exited
        code = box.process.returncode
        await self._discard(box)
        reason = (
            f"the REPL process exited (code {code}) during this cell; variables from earlier "
            "cells are restored, this cell's effects are lost"
            if code is not None
            else f"cell exceeded its {ref.cell_timeout_s:g} s time limit and did not stop; "
            "the REPL was restarted with the variables of earlier cells"
        )
        output_ref = await asyncio.to_thread(self.blobs.put_text, reason)
        head = await self._log(
            box.log_head, {"t": "end", "cell": box.cell_index, "status": "killed", "output": output_ref}
        )
        return CellOutcome(status="completed", log_head=head, worker_queue=self.worker_queue, error=reason)

    async def _ensure(self, ref: SandboxRef) -> tuple[LiveSandbox, bool, list[str]]:
        box = self._live.get(ref.episode_id)
        if box is not None and box.log_head == ref.log_head and box.process.returncode is None:
            box.last_used = time.monotonic()
            return box, False, []
        if box is not None:
            await self._discard(box)
        box = await self._spawn(ref)
        divergences = await self._replay(box, ref)
        box.log_head = ref.log_head
        self._live[ref.episode_id] = box
        return box, ref.log_head is not None, divergences

    async def _spawn(self, ref: SandboxRef) -> LiveSandbox:
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in ref.episode_id)[:80]
        directory = self.sandbox_root / f"{safe}-{uuid.uuid4().hex[:8]}"
        directory.mkdir(parents=True)
        init: dict[str, Any] = {"op": "init", "seed": ref.seed, "memory_mb": self.memory_mb}
        if ref.context is not None:
            data = await asyncio.to_thread(self.blobs.get, ref.context.digest)
            path = directory / ("context.json" if ref.context.kind == "json" else "context.txt")
            path.write_bytes(data)
            init.update(context_path=str(path), context_kind=ref.context.kind)
        if os.geteuid() == 0:
            for p in [directory, *directory.iterdir()]:
                os.chown(p, NOBODY, NOBODY)
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": str(directory),
            "LANG": "C.UTF-8",
            "PYTHONHASHSEED": str(ref.seed % 4294967295),
        }
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",
            str(CHILD_PATH),
            str(os.getpid()),
            str(directory),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=open(directory / "sandbox.err", "wb"),  # noqa: SIM115 - child owns it
            env=env,
            cwd=directory,
            start_new_session=True,
            limit=MAX_FRAME,
        )
        frames: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        box = LiveSandbox(
            episode_id=ref.episode_id,
            process=process,
            directory=directory,
            frames=frames,
            reader=asyncio.create_task(_read_frames(process, frames)),
        )
        await box.send(init)
        ready = await box.receive(STARTUP_TIMEOUT_S)
        if ready is None or ready.get("op") != "ready":
            err = (directory / "sandbox.err").read_text(errors="replace")[-2_000:]
            await box.kill()
            raise ApplicationError(
                f"the REPL sandbox failed to start: {err or 'no output'}", type=names.SANDBOX_FAILURE
            )
        box.network = ready.get("network", "")
        return box

    async def _replay(self, box: LiveSandbox, ref: SandboxRef) -> list[str]:
        """Re-run the logged cells, answering their model calls from the log."""
        entries = await asyncio.to_thread(chains.walk, self.blobs, ref.log_head)
        cells: list[dict[str, Any]] = []
        for entry in entries:
            if entry["t"] == "cell":
                cells.append({"index": entry["cell"], "code": entry["code"], "answers": [], "status": None})
            elif entry["t"] == "answers":
                cells[-1]["answers"].extend(entry["answers"])
            elif entry["t"] == "end":
                cells[-1]["status"] = entry["status"]
        divergences: list[str] = []
        for cell in cells:
            if cell["status"] in SKIPPED_ON_REBUILD:
                continue
            box.cell_index, box.next_call = cell["index"], 0
            await box.send(self._exec_message(ref, cell["index"], cell["code"]))
            recorded = list(cell["answers"])
            while True:
                frame = await box.receive(ref.cell_timeout_s + HARD_KILL_GRACE_S)
                if frame is None:
                    await box.kill()
                    raise ApplicationError(
                        f"rebuilding the REPL failed: cell {cell['index']} did not finish",
                        type=names.SANDBOX_FAILURE,
                    )
                if frame["op"] == "done":
                    if cell["status"] is None:
                        divergences.append(
                            f"cell {cell['index']}: finished during rebuild before its pending calls"
                        )
                        box.early_done = frame
                    else:
                        box.cell_index = None
                    break
                prompts: list[str] = frame["prompts"]
                if cell["status"] is None and not recorded:
                    # The in-progress cell reached the calls the workflow is answering now.
                    box.pending = [
                        SubCallRequest(call_index=box.next_call + i, prompt=p, prompt_digest=text_digest(p))
                        for i, p in enumerate(prompts)
                    ]
                    box.next_call += len(prompts)
                    break
                replies = []
                for prompt in prompts:
                    call = box.next_call
                    box.next_call += 1
                    if not recorded:
                        divergences.append(f"cell {cell['index']} call {call}: no recorded result")
                        replies.append({"ok": False, "text": "replay diverged: no recorded result"})
                        continue
                    answer = recorded.pop(0)
                    if answer["prompt"] != text_digest(prompt):
                        divergences.append(
                            f"cell {cell['index']} call {call}: prompt differs from the recorded one"
                        )
                    text = await asyncio.to_thread(self.blobs.get_text, answer["text"])
                    replies.append({"ok": answer["ok"], "text": text})
                await box.send({"op": "answers", "answers": replies})
        return divergences
