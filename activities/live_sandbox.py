"""One live sandbox as the worker holds it: its process, its channel, and its step's state.

The pool keeps these (sandbox_pool.py), the steps drive them (repl_cells.py), and a rebuild
makes them (repl_rebuild.py); each speaks to its process through `send` and `receive` here,
which number every request and refuse a frame that answers another, so a frame a stray
process left in the pipe is never taken for the answer to this step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from durable_rlm.activities.sandbox.framing import encode_frame
from durable_rlm.activities.sandbox.kernel import OWN_TMPFS
from durable_rlm.activities.sandbox_processes import SandboxProcess, SandboxUids, kill_uid
from durable_rlm.activities.sandbox_protocol import BROKEN, FrameInbox, decode_frame
from durable_rlm.host.files import remove_sandbox_tree
from durable_rlm.store.blobs import text_digest
from durable_rlm.store.chains import LoggedCell, SnapshotTaken
from durable_rlm.workflows import defaults
from durable_rlm.workflows.models import SandboxRef, SnapshotPolicy, SubCallRequest

log = logging.getLogger(__name__)


UNREADABLE_VIEW = (
    "unreadable: the worker cannot read its sandboxes' files through /proc/PID/root (a root "
    "worker needs CAP_SYS_PTRACE, e.g. docker's cap_add: [SYS_PTRACE]): no REPL snapshots"
)


@dataclass
class LiveSandbox:
    """An episode's sandbox process and what the worker knows of it: the cell-log head it
    is at, the cell it runs and the calls that cell waits on, and what the snapshot policy
    counts since the last snapshot."""

    episode_id: str
    process: SandboxProcess
    directory: Path
    frames: FrameInbox
    reader: asyncio.Task[None]
    log_head: str | None = None
    cell_index: int | None = None
    next_call: int = 0
    pending: list[SubCallRequest] = field(default_factory=list)
    early_done: dict[str, Any] | None = None
    last_used: float = field(default_factory=time.monotonic)
    layers: dict[str, str] = field(default_factory=dict)
    # REPL snapshots: the policy of the last step, the latest snapshot, what ran since it,
    # and the cells a snapshot may need to re-run (by index).
    policy: SnapshotPolicy | None = None
    snapshot: SnapshotTaken | None = None
    snapshot_head: str | None = None  # the log node recording `snapshot`
    since_s: float = 0.0
    since_cells: int = 0
    since_volatile: bool = False
    last_cell: int | None = None
    cells: dict[int, LoggedCell] = field(default_factory=dict)
    snapshot_cost_s: float = 0.0  # what the last snapshot took, sandbox and store
    snapshot_note: str | None = None  # why the last snapshot due was not taken
    uid: int | None = None  # its own uid (root workers), released when it is gone
    seq: int = 0  # the number of the last request sent to it
    output_limit: int = defaults.STORED_OUTPUT_CHARS  # the stdout it may send for the cell
    uids: SandboxUids | None = None

    @property
    def view(self) -> Path:
        """Its directory as the host reads what the sandbox wrote there: through the
        sandbox's own view (/proc/PID/root) when that directory is a tmpfs of its mount
        namespace, which the host's path does not show."""
        if OWN_TMPFS in self.layers.get("filesystem", ""):
            return Path(f"/proc/{self.process.pid}/root{self.directory}")
        return self.directory

    def view_readable(self) -> bool:
        """Can this worker read its view? /proc/PID/root of a process of another uid wants
        CAP_SYS_PTRACE (a root worker in a container has it only if given)."""
        try:
            os.stat(self.view)
        except PermissionError:
            return False
        except OSError:
            return True  # gone, or another error: said by the read that follows
        return True

    def ran(self, cell: LoggedCell, elapsed: float, volatile: bool) -> None:
        """A cell finished (live or re-run): the snapshot policy counts it."""
        self.cells[cell.index] = cell
        self.since_s += elapsed
        self.since_cells += 1
        self.since_volatile |= volatile
        self.last_cell = cell.index

    def snapshot_due(self) -> bool:
        """The policy's rules, with one bound: a snapshot is not retaken before the cells
        since the last would cost as much to re-run as it cost to take (twice as much, for
        the time rule). A big namespace is snapshotted less often, never more than ~half
        of the cells' own time. A cell that read the clock is snapshotted regardless."""
        policy = self.policy
        if policy is None or self.since_cells == 0:
            return False
        if (policy.volatile and self.since_volatile) or policy.every_cells == 1:
            return True  # every_cells=1 asks for every cell, whatever it costs
        rerun = self.since_s + self.since_cells * defaults.REPLAY_CELL_COST_S
        cost = self.snapshot_cost_s
        return rerun >= max(policy.after_s, 2 * cost) or (
            self.since_cells >= policy.every_cells and rerun >= cost
        )

    async def send(self, message: dict[str, Any]) -> None:
        """Write a frame, numbered: the sandbox's frames must carry the number of the last
        request (`receive`). A sandbox that stops reading (its pipe full) for
        SEND_TIMEOUT_S is broken, not waited for: the step fails and the sandbox is
        discarded."""
        self.seq += 1
        if message.get("op") == "exec":
            self.output_limit = int(message["limit"])
        self.process.stdin.write(encode_frame({**message, "seq": self.seq}))
        try:
            async with asyncio.timeout(defaults.SANDBOX_SEND_TIMEOUT_S):
                await self.process.stdin.drain()
        except TimeoutError:
            raise ConnectionError(
                f"the sandbox read none of a {message.get('op')!r} frame for "
                f"{defaults.SANDBOX_SEND_TIMEOUT_S:g} s"
            ) from None

    async def receive(self, timeout: float) -> dict[str, Any] | None:
        """The next frame; None when the process died or stayed silent past `timeout`."""
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancel that
            # arrives as the frame does, and a cancelled step would go on running.
            async with asyncio.timeout(timeout):
                item = await self.frames.get()
        except TimeoutError:
            return None
        frame: dict[str, Any] | None  # None: the process died
        if isinstance(item, bytes):
            # Checked field by field; a large frame off the event loop (a bounded task).
            big = len(item) > DECODE_INLINE_BYTES
            frame = await asyncio.to_thread(decode_frame, item) if big else decode_frame(item)
        else:
            frame = item
        if frame is not None and frame.get("op") != BROKEN and frame.get("seq") != self.seq:
            return {
                "op": BROKEN,
                "error": f"the sandbox sent a frame out of turn (numbered {frame.get('seq')!r}, "
                f"the request was {self.seq})",
            }
        return frame

    async def kill(self) -> None:
        self.reader.cancel()
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.process.wait(), 5)
        self.process.close()
        if self.uid is not None:
            # What the sandbox started and left (a grandchild in its own session included)
            # runs as its uid, and nothing else does: all of it goes before the uid is reused.
            uid, self.uid = self.uid, None
            await asyncio.to_thread(kill_uid, uid)
            if self.uids is not None:
                self.uids.release(uid)
        # Whatever the sandbox left in its directory (a tree of any depth, links, FIFOs) is
        # removed on threads of its own, never followed; a long removal is not waited for.
        removal = asyncio.get_running_loop().run_in_executor(REMOVER, remove_sandbox_tree, self.directory)
        try:
            async with asyncio.timeout(REMOVE_WAIT_S):
                await asyncio.shield(removal)
        except TimeoutError:
            log.warning("removing sandbox directory %s goes on in the background", self.directory)

    async def exit_code(self) -> int | None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.process.wait(), 1.0)
        return self.process.returncode

    async def silence(self, frame: dict[str, Any] | None, timeout: float) -> str:
        """Why the sandbox did not answer as expected, in words."""
        if frame is not None and frame.get("op") == BROKEN:
            return str(frame["error"])
        if frame is not None:
            return f"the sandbox answered out of turn ({frame.get('op')!r})"
        code = await self.exit_code()
        if code is not None:
            return f"the REPL process exited (code {code})"
        return f"the sandbox did not answer within {timeout + defaults.HARD_KILL_GRACE_S:g} s"

    def requests(self, frame: dict[str, Any]) -> list[SubCallRequest]:
        """The calls a `call` frame asks for, numbered on from the cell's last."""
        kind = str(frame.get("kind") or "llm_query")
        model = frame.get("model")
        requests = [
            SubCallRequest(
                call_index=self.next_call + i,
                prompt=p,
                prompt_digest=text_digest(p),
                kind=kind,
                model=model if isinstance(model, str) else None,
            )
            for i, p in enumerate(frame["prompts"])
        ]
        self.next_call += len(requests)
        return requests


DECODE_INLINE_BYTES = 1024 * 1024
"""A frame larger than this is checked on a thread: the event loop serves every episode."""

REMOVER = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="drlm-sandbox-rm")
"""Threads that remove sandbox directories: a sandbox that left a million files there takes
these, not the threads every step's store reads and writes run on."""

REMOVE_WAIT_S = 5.0
"""How long discarding a sandbox waits for its directory to go; the rest goes on behind."""


def exec_message(ref: SandboxRef, cell_index: int, code: str, summary: bool = True) -> dict[str, Any]:
    """The `exec` frame of a cell, live or re-run (a re-run one needs no variables summary)."""
    return {
        "op": "exec",
        "code": code,
        "cell": cell_index,
        "cell_name": f"<cell {cell_index}>",
        "timeout": ref.cell_timeout_s,
        "limit": max(ref.stored_output_chars, ref.output_truncation),
        "summary": summary,
    }
