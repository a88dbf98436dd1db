"""A REPL cell as a resumable coroutine, on the worker's side: run it until it completes or
stops at calls, and take what its sandbox reports.

A cell that calls `llm_query` (a batch, a tool, a child episode) stops at the call: the
step returns `suspended` with the requests, each naming its kind, and `repl_resume` hands
the answers back. A cell that completes is logged with its output. What a sandbox sends
is bounded again here (`clip_*`): the sandbox bounds its own fields, but its code may have
been changed by the cell (DESIGN invariant 7: the host trusts no size the sandbox chose).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from durable_rlm.activities.live_sandbox import LiveSandbox
from durable_rlm.activities.repl_writes import StepWrites
from durable_rlm.activities.sandbox_pool import SandboxPool
from durable_rlm.store import chains
from durable_rlm.store.chains import CellEnded
from durable_rlm.workflows import defaults, names
from durable_rlm.workflows.models import CellOutcome, ContextRef, SandboxRef, SubCallRequest

FIELD_SLACK = 1_000
"""Beyond a field's limit, room for the note the sandbox adds when it cut the field itself."""


def clip_field(value: Any, limit: int = defaults.SANDBOX_FIELD_CHARS + FIELD_SLACK) -> str | None:
    """A text field of a sandbox's frame as the host keeps it: text (whatever was sent), at
    most `limit` characters, and says what it cut. The sandbox bounds its own fields; this
    holds when it did not (its code was changed by the cell)."""
    if value is None:
        return None
    text = value if isinstance(value, str) else repr(value)[: limit + 1]
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n... [cut by the worker at {limit:,} characters]"


def clip_variables(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        return {}
    shown = list(value.items())[: defaults.VARIABLES_SHOWN]
    width = defaults.VARIABLE_CHARS
    return {str(k)[:width]: clip_field(v, width) or "" for k, v in shown}


def clip_submitted(value: Any) -> tuple[dict[str, Any] | None, str | None]:
    """SUBMIT's outputs, whole or not at all (a typed output cut in the middle would be a
    different value), and why they were refused: the model reads that as the cell's error."""
    if value is None:
        return None, None
    if not isinstance(value, dict):
        return None, f"SUBMIT outputs must be a mapping, not {type(value).__name__}"
    size = len(json.dumps(value, default=str))
    if size > defaults.SANDBOX_FIELD_CHARS:
        return (
            None,
            f"SUBMIT outputs of {size:,} characters refused (at most {defaults.SANDBOX_FIELD_CHARS:,})",
        )
    return value, None


class CellDriver:
    """Drives the pool's sandboxes through cells, and logs how each ended."""

    def __init__(self, writes: StepWrites, pool: SandboxPool, worker_queue: str) -> None:
        self.writes = writes
        self.pool = pool
        self.worker_queue = worker_queue

    def _with_contexts(self, requests: list[SubCallRequest]) -> list[SubCallRequest]:
        """rlm_query prompts become child contexts: stored once, named by their digest."""
        out = []
        for request in requests:
            if request.kind in names.CHILD_KINDS:
                digest = self.writes.store.put_text(request.prompt)
                size = len(request.prompt)
                request = request.model_copy(update={"context": ContextRef(digest=digest, size=size)})
            out.append(request)
        return out

    async def drive(self, box: LiveSandbox, ref: SandboxRef) -> CellOutcome:
        """Run the current cell until it completes or stops at calls."""
        box.last_used = time.monotonic()
        frame = await box.receive(ref.cell_timeout_s + defaults.HARD_KILL_GRACE_S)
        if frame is None or frame.get("op") not in ("call", "done"):
            return await self._killed(box, ref, frame)
        if frame["op"] == "call":
            box.pending = await asyncio.to_thread(self._with_contexts, box.requests(frame))
            return CellOutcome(
                status="suspended",
                log_head=box.log_head or "",
                worker_queue=self.worker_queue,
                requests=box.pending,
            )
        return await self.finish(box, frame, False, [])

    async def finish(
        self, box: LiveSandbox, frame: dict[str, Any], rebuilt: bool, divergences: list[str]
    ) -> CellOutcome:
        status = frame.get("status", "error")
        # The output is logged so fallback extraction can rebuild the REPL history.
        parts = (frame.get("stdout"), frame.get("stderr"), frame.get("error"))
        limit = max(defaults.SANDBOX_FIELD_CHARS, box.output_limit) + FIELD_SLACK
        output = "\n".join(clip_field(x, limit) or "" for x in parts if x)
        output_ref = await asyncio.to_thread(self.writes.store.put_text, output)
        box.log_head = await self.writes.log(
            box.log_head, CellEnded(cell=box.cell_index, status=status, output=output_ref)
        )
        cell = box.cells.get(box.cell_index) if box.cell_index is not None else None
        if cell is not None:
            cell.status = status
            if status in chains.SKIPPED_ON_REBUILD:
                del box.cells[cell.index]
            else:
                box.ran(cell, float(frame.get("elapsed") or 0.0), bool(frame.get("volatile")))
        box.cell_index, box.pending, box.early_done = None, [], None
        submitted, refused = clip_submitted(frame.get("submitted"))
        error = clip_field(frame.get("error"))
        if refused is not None:
            error = f"{error}\n{refused}" if error else refused
        printed = max(defaults.SANDBOX_FIELD_CHARS, box.output_limit) + FIELD_SLACK
        return CellOutcome(
            status="completed",
            log_head=box.log_head,
            worker_queue=self.worker_queue,
            stdout=clip_field(frame.get("stdout", ""), printed) or "",
            stderr=clip_field(frame.get("stderr", ""), printed) or "",
            error=error,
            answer=clip_field(frame.get("answer")),
            answer_kind=frame.get("answer_kind"),
            cell_status=status,
            rebuilt=rebuilt,
            divergences=divergences,
            variables=clip_variables(frame.get("variables")),
            submitted=submitted,
        )

    async def _killed(self, box: LiveSandbox, ref: SandboxRef, frame: dict[str, Any] | None) -> CellOutcome:
        """The cell ignored its interrupt, the process died, or it broke the channel: the
        namespace is gone; the cell is logged as killed so a rebuild skips it."""
        problem = await box.silence(frame, ref.cell_timeout_s)
        timed_out = frame is None and box.process.returncode is None
        await self.pool.discard(box)
        if timed_out:
            reason = (
                f"cell exceeded its {ref.cell_timeout_s:g} s time limit and did not stop; "
                "the REPL was restarted with the variables of earlier cells"
            )
        else:
            reason = (
                f"{problem} during this cell; variables from earlier cells are restored, "
                "this cell's effects are lost"
            )
        output_ref = await asyncio.to_thread(self.writes.store.put_text, reason)
        head = await self.writes.log(
            box.log_head, CellEnded(cell=box.cell_index, status="killed", output=output_ref)
        )
        return CellOutcome(
            status="completed",
            log_head=head,
            worker_queue=self.worker_queue,
            error=reason,
            cell_status="killed",
        )
