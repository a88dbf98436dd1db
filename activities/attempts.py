"""Starts of a local REPL step, counted across workers.

A local activity's attempts are counted by the worker that runs it, and nothing reaches
history until its workflow task completes. When a cell kills its worker, the next worker
replays the episode and starts the step again as attempt 1: a cell that kills every worker
would loop forever. Each start is therefore recorded in the blob store (a content-addressed
marker: start k of step S of this run), and a step started too often gives up, so the
workflow records the cell as lost and the episode goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime

from temporalio import activity
from temporalio.exceptions import ApplicationError

from durable_rlm.store.blobs import BlobStore
from durable_rlm.store.outages import store_problem, store_unavailable
from durable_rlm.workflows import defaults, names
from durable_rlm.workflows.models import CellOutcome, StepEcho


def _marker(step: str, start: int) -> bytes:
    return f"drlm-local-step-start\n{step}\n{start}".encode()


def record_start(blobs: BlobStore, step: str, limit: int) -> int:
    """Record one more start of `step`; refuse the one after `limit`."""
    for start in range(1, limit + 1):
        if blobs.add(_marker(step, start)):
            return start
    raise ApplicationError(
        f"its step was started afresh {limit} times (a worker lost, or its task timed out, each time)",
        type=names.REPL_STEP_ABANDONED,
        non_retryable=True,
    )


async def count_local_start(blobs: BlobStore, limit: int = defaults.REPL_ATTEMPTS_LOCAL) -> None:
    """In a local activity: count this start of the step (its activity id is stable across
    replays of the run); remote activities are counted by the server."""
    if not activity.in_activity():
        return
    info = activity.info()
    # Retries on the same worker (attempt > 1) are bounded by the step's retry policy; a
    # start after a replay (a new worker, a lost task) is attempt 1 again: that is counted.
    if not info.is_local or info.attempt > 1:
        return
    step = f"{info.workflow_id}/{info.workflow_run_id}/{info.activity_id}"
    await asyncio.to_thread(record_start, blobs, step, limit)


@contextlib.asynccontextmanager
async def echoed(echo: StepEcho) -> AsyncIterator[Callable[[CellOutcome], CellOutcome]]:
    """A local step repeats its input in what it returns, and in the details of a failure
    (history holds a local activity's result, not its input). Every step also says when it
    ran, for the audit store's cell durations."""
    local = activity.in_activity() and activity.info().is_local
    started = datetime.now(UTC)

    def attach(outcome: CellOutcome) -> CellOutcome:
        update: dict[str, object] = {"started_at": started, "ended_at": datetime.now(UTC)}
        if local:
            update["step"] = echo
        return outcome.model_copy(update=update)

    try:
        yield attach
    except ApplicationError as exc:
        if not local or exc.details:
            raise
        raise ApplicationError(
            exc.message,
            echo,
            type=exc.type,
            non_retryable=exc.non_retryable,
            next_retry_delay=exc.next_retry_delay,
            category=exc.category,
        ) from exc
    except Exception as exc:  # a broken pipe, a locked database: retryable, and still echoed
        if not local:
            raise
        problem = store_problem(exc)
        if problem is not None:  # waited out by the workflow, like a remote step's
            failure = store_unavailable(problem)
            raise ApplicationError(failure.message, echo, type=failure.type) from None
        raise ApplicationError(str(exc) or type(exc).__name__, echo, type=type(exc).__name__) from exc


# --- a paused worker checks before it pays --------------------------------------------------


class AttemptClock:
    """How long this attempt of a remote activity has run, and since its last heartbeat, by
    this process's monotonic clock (which counts a SIGSTOP). Past its start-to-close or its
    heartbeat timeout the server has given the attempt up and scheduled another: a model
    request sent now would be paid twice (`ensure_current`)."""

    def __init__(self) -> None:
        self.started = self.last_beat = time.monotonic()
        self.beats = 0
        self.calls = 0  # model requests this attempt has made: each one's place in the call ledger
        PAUSES.watch()

    def in_doubt(self) -> str | None:
        """Why this attempt's result may be one the server no longer takes (a zombie's):
        stale, or the process stood still for PAUSE_FENCE_S or more while it ran (a SIGSTOP,
        a starved loop), long enough for a workflow task or heartbeat timeout to pass. Its
        audit rows are then not written: the episode's rows are settled from history."""
        why = self.stale()
        if why is not None:
            return why
        # A step that began just after a stall may serve a task that went stale during it
        # (handed to this worker's poll before the stall, delivered after): in doubt too.
        longest = PAUSES.longest_since(self.started - PAUSE_FENCE_WINDOW_S)
        if longest >= PAUSE_FENCE_S:
            return f"the process stood still for {longest:.1f} s while it ran, or just before"
        return None

    def next_call(self) -> int:
        """The place of this attempt's next model request among its requests (0, 1, ...): the
        same in every attempt and replay of the step, whose work is the same up to there."""
        self.calls += 1
        return self.calls - 1

    def beat(self) -> None:
        self.last_beat = time.monotonic()
        self.beats += 1
        if not activity.info().is_local:  # a local step's liveness is its workflow task's
            activity.heartbeat()

    def beat_if_due(self, every_s: float) -> None:
        """Beat at once when the server's heartbeat clock, running since it handed the task
        out, could run out before the regular beat `every_s` from now reaches it: a task handed
        to this worker's poll while it stood still, or one that waited in a saturated worker.
        A fresh attempt's first beat waits its turn, sparing the server a write per call."""
        if not activity.in_activity() or activity.info().is_local or self.beats:
            return
        info = activity.info()
        if info.heartbeat_timeout is None:
            return
        if handed_out_s(info) + every_s + SERVER_MARGIN_S >= info.heartbeat_timeout.total_seconds():
            self.beat()

    def stale(self) -> str | None:
        """Why the server no longer takes this attempt's result, or None."""
        if not activity.in_activity():
            return None
        info = activity.info()
        if info.is_local:
            return None  # a local step's result goes with its workflow task: checked there
        now = time.monotonic()
        limit = info.start_to_close_timeout.total_seconds() if info.start_to_close_timeout else None
        beat = info.heartbeat_timeout.total_seconds() if info.heartbeat_timeout else None
        # By the server's clock too: a task handed to this worker's poll while the worker
        # stood still (a SIGSTOP) began its clocks then, before this process saw it at all.
        # Counted with SERVER_MARGIN_S more: a doubt costs another attempt, a request sent
        # to a given-up attempt costs the call twice.
        waited = handed_out_s(info) + SERVER_MARGIN_S
        if limit and max(now - self.started, waited) > limit:
            return f"it ran past its start-to-close timeout ({limit:g} s)"
        silent = now - self.last_beat if self.beats else max(now - self.last_beat, waited)
        if beat and silent > beat:
            return f"it sent no heartbeat for {silent:.1f} s (its timeout: {beat:g} s)"
        if activity.is_cancelled():
            return "the server cancelled it"
        return None

    def ensure_current(self, what: str) -> None:
        """Raise instead of paying for `what` when this attempt is no longer current."""
        why = self.stale()
        if why is not None:
            raise ApplicationError(
                f"{what} not sent: this attempt is no longer current ({why}; the worker was "
                "paused or starved); another attempt makes the call",
                type=names.STALE_ATTEMPT,
            )


def beat_every_s() -> float:
    """How often this activity heartbeats: a quarter of its heartbeat timeout, never more often
    than once a second (defaults.BEATS_PER_HEARTBEAT_TIMEOUT). A beat each second against a
    10 s timeout would be a server write each second per call for nothing; one per timeout
    would leave no room for a late one. Outside an activity, or with no heartbeat timeout,
    the shortest period."""
    if not activity.in_activity():
        return defaults.HEARTBEAT_EVERY_S
    timeout = activity.info().heartbeat_timeout
    if timeout is None:
        return defaults.HEARTBEAT_EVERY_S
    return max(defaults.HEARTBEAT_EVERY_S, timeout.total_seconds() / defaults.BEATS_PER_HEARTBEAT_TIMEOUT)


def handed_out_s(info: activity.Info) -> float:
    """How long ago the server handed this attempt out (its start time, by the server's clock),
    by this machine's clock: its heartbeat and start-to-close timeouts have run since."""
    return (datetime.now(UTC) - info.started_time).total_seconds()


SERVER_MARGIN_S = 1.0
"""What an attempt must have left of its server-side timeouts to send a request: room for the
server's clock to be this far ahead of this machine's, and for the first heartbeat (sent at
once when due, `beat_if_due`) to reach the server before the heartbeat timeout. (The soak of
2026-11-27 caught an attempt handed to a stopped worker's poll, checked on waking with 1 s of
its 5 s left, whose first heartbeat was due a second later: the server gave it up mid-call.)"""

PAUSE_FENCE_S = 5.0
"""A stall of the worker's event loop this long during a step, or ending less than
PAUSE_FENCE_WINDOW_S before it began, puts its result in doubt for the audit store: half the
default workflow task timeout (10 s), so that a zombie of that timeout is always caught, and
a loaded machine's ordinary stalls (1-3 s seen under a load of 10 on 2 cores) fence nothing."""

PAUSE_FENCE_WINDOW_S = 5.0


class PauseWatch:
    """Notices when this process stood still: a task on the event loop ticks every TICK_S
    and records every gap far longer than that (a SIGSTOP, a loop blocked or starved),
    by the monotonic clock, which counts a stop. Bounded: the latest MAX_PAUSES."""

    TICK_S = 0.25
    MAX_PAUSES = 256

    def __init__(self) -> None:
        self.pauses: list[tuple[float, float]] = []  # (start, end) of each long gap
        self.last_tick = time.monotonic()
        self._task: asyncio.Task[None] | None = None

    def watch(self) -> None:
        """Start ticking on the running loop (once per loop; a no-op outside one)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._task is not None and not self._task.done() and self._task.get_loop() is loop:
            return
        self.last_tick = time.monotonic()
        self._task = loop.create_task(self._tick(), name="drlm-pause-watch")

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.TICK_S)
            now = time.monotonic()
            if now - self.last_tick >= 4 * self.TICK_S:
                self.pauses.append((self.last_tick, now))
                del self.pauses[: -self.MAX_PAUSES]
            self.last_tick = now

    def longest_since(self, moment: float) -> float:
        """The longest stall that ended after `moment` (or is still going on), whole: its
        length is what lets a timeout pass, wherever it began."""
        now = time.monotonic()
        # Just woken from a stall, this code may run before the tick that records it.
        ongoing = now - self.last_tick if now - self.last_tick >= 4 * self.TICK_S else 0.0
        longest = max((end - start for start, end in self.pauses if end > moment), default=0.0)
        return max(longest, ongoing, 0.0)


PAUSES = PauseWatch()


_CLOCK: contextvars.ContextVar[AttemptClock | None] = contextvars.ContextVar(
    "drlm_attempt_clock", default=None
)


def start_attempt_clock() -> AttemptClock:
    """At the top of a model activity: its clock starts now (each activity runs in a task of
    its own, so the context variable is the attempt's)."""
    clock = AttemptClock()
    _CLOCK.set(clock)
    return clock


def attempt_clock() -> AttemptClock:
    """This attempt's clock; one starting now if the activity did not start one."""
    clock = _CLOCK.get()
    return clock if clock is not None else start_attempt_clock()
