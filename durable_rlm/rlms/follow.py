"""rlms's callbacks while the episode runs: `on_iteration_start` / `on_iteration_complete` from
the episode's progress query, `on_subcall_start` / `on_subcall_complete` as its child episodes
(rlm_query) start and end, from the episode's history read as it grows (a long poll: the
server answers when an event is added). Reading the history from its first event means a
follower that starts late misses no child; each child is reported once, in the order the
history has them. Neither adds anything to the episode's history.

A callback that raises does not break the run (rlms's rule: `quietly`)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from durable_rlm.api import Episode
from durable_rlm.workflows.models import EpisodeRequest, EpisodeResult

if TYPE_CHECKING:
    from durable_rlm.audit.timeline import Timeline
    from durable_rlm.client.episodes import EpisodeEnd
    from durable_rlm.store.blobs import BlobStore
    from durable_rlm.worker.runtime import Services

PROGRESS_POLL_S = 0.2
START_POLL_S = 0.1  # a session's turn episode, asked for and not started yet
"""How often a run with iteration callbacks or `verbose` asks the episode for its progress (a
query: nothing is added to history)."""
CHILDREN_SETTLE_S = 10.0
"""After the episode's end, how long its history may take to be read to its last event (the
end is in it already, so this is a bound, not a wait)."""
SUBCALL_DEPTH = 1
"""The depth rlms reports for a child of the root RLM."""
PREVIEW_CHARS = 80


@dataclass(frozen=True)
class Callbacks:
    """rlms's four callbacks and `verbose`, as the RLM was given them."""

    on_subcall_start: Callable[[int, str, str], None] | None = None
    on_subcall_complete: Callable[[int, str, float, str | None], None] | None = None
    on_iteration_start: Callable[[int, int], None] | None = None
    on_iteration_complete: Callable[[int, int, float], None] | None = None
    verbose: bool = False

    @property
    def iterations(self) -> bool:
        return bool(self.on_iteration_start or self.on_iteration_complete or self.verbose)

    @property
    def subcalls(self) -> bool:
        return bool(self.on_subcall_start or self.on_subcall_complete)


def quietly(callback: Callable[..., Any] | None, *args: Any) -> None:
    """rlms's rule: a callback that raises does not break the run."""
    if callback is None:
        return
    try:
        callback(*args)
    except Exception as exc:  # noqa: BLE001
        print(
            f"[durable-rlm] callback {getattr(callback, '__name__', callback)!r} raised: {exc}",
            file=sys.stderr,
        )


async def started_episode(services: Services, episode_id: str) -> Episode:
    """The episode of that id once it exists: a session's turn starts a moment after the
    turn is asked for (as a child of the session's workflow)."""
    from temporalio.service import RPCError, RPCStatusCode  # start-up: temporalio, not on import

    handle = services.client.get_workflow_handle(episode_id, result_type=EpisodeResult)
    while True:
        try:
            await handle.describe()
            return Episode(services, handle)
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
        await asyncio.sleep(START_POLL_S)


async def follow(
    episode: Episode, callbacks: Callbacks, reported: set[str] | None = None
) -> tuple[EpisodeEnd, set[str]]:
    """The episode's end, the callbacks fired on the way; and the child episodes already
    reported (the rest, if reading the history failed, are the timeline's: `report_children`).
    `reported`, if given, is filled as children are told (a follower cut short still says)."""
    watcher = ChildWatcher(episode, callbacks, reported) if callbacks.subcalls else None
    watching = asyncio.ensure_future(watcher.run()) if watcher is not None else None
    try:
        if callbacks.iterations:
            end = await _iterations(episode, callbacks)
        else:
            end = await episode.end()
        if watcher is not None and watching is not None:
            # A paused episode's history stays open: its children are what was read by now.
            with contextlib.suppress(TimeoutError):
                settle = 0.0 if end.status == "paused" else CHILDREN_SETTLE_S
                await asyncio.wait_for(asyncio.shield(watching), settle)
            watcher.close()
        return end, watcher.reported if watcher is not None else set()
    finally:
        if watching is not None and not watching.done():
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watching


async def _iterations(episode: Episode, callbacks: Callbacks) -> EpisodeEnd:
    """The episode's end; its iterations reported as the progress query shows them."""
    ending = asyncio.ensure_future(episode.end())
    try:
        return await _reported_until(ending, episode, callbacks)
    finally:
        ending.cancel()  # a follower cancelled (a session's turn cut short) leaves no poller


async def _reported_until(
    ending: asyncio.Future[EpisodeEnd], episode: Episode, callbacks: Callbacks
) -> EpisodeEnd:
    start, complete = callbacks.on_iteration_start, callbacks.on_iteration_complete
    seen, since = 0, time.perf_counter()
    while True:
        done, _ = await asyncio.wait({ending}, timeout=PROGRESS_POLL_S)
        try:
            progress = None if done else await episode.progress()
        except Exception:  # noqa: BLE001 - progress is best effort; the end is what counts
            progress = None
        now_at = progress.iteration if progress is not None else seen
        while seen < now_at:
            if seen:
                quietly(complete, 0, seen, time.perf_counter() - since)
            seen, since = seen + 1, time.perf_counter()
            quietly(start, 0, seen)
            if callbacks.verbose and progress is not None:
                print(f"[durable-rlm] iteration {seen}: {progress.phase}")
        if done:
            end = ending.result()
            # Iterations too quick for a poll to see are reported when the end says so.
            last = max(seen, end.result.iterations if end.result is not None else 0)
            while seen <= last and seen:
                quietly(complete, 0, seen, time.perf_counter() - since)
                if seen == last:
                    break
                seen, since = seen + 1, time.perf_counter()
                quietly(start, 0, seen)
            if not seen and last:
                for number in range(1, last + 1):
                    quietly(start, 0, number)
                    quietly(complete, 0, number, 0.0)
            return end


class ChildWatcher:
    """Reports the episode's child episodes from its history, read from the first event and
    then as events are added: a child's start when the workflow asks for it (the request is
    in that event: model, context), its completion when its result (or failure) is recorded.
    Runs of a continue-as-new chain are followed in order."""

    def __init__(self, episode: Episode, callbacks: Callbacks, reported: set[str] | None = None) -> None:
        self._episode = episode
        self._callbacks = callbacks
        self._open: dict[str, tuple[str, datetime]] = {}  # child id -> (model, when it started)
        self.reported: set[str] = set() if reported is None else reported  # filled as they are told

    async def run(self) -> None:
        """Until the episode's last run ends; a failure to read is reported, not raised (the
        children not reported then are reported from the timeline after the end)."""
        try:
            await self._read()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the callbacks are best effort; the run is what counts
            print(f"[durable-rlm] following the episode's children failed: {exc}", file=sys.stderr)

    async def _read(self) -> None:
        handle = self._episode.handle
        client = self._episode.services.client
        run_id: str | None = getattr(handle, "first_execution_run_id", None) or handle.run_id
        while True:
            run = client.get_workflow_handle(handle.id, run_id=run_id)
            run_id = None
            async for event in run.fetch_history_events(wait_new_event=True):
                run_id = await self._take(event) or run_id
            if run_id is None:
                return

    async def _take(self, event: Any) -> str | None:
        """One history event; the next run's id when this run continued as new."""
        from temporalio.api.enums.v1 import EventType  # start-up: loaded with the session already

        kind = event.event_type
        when = event.event_time.ToDatetime(tzinfo=UTC)
        if kind == EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED:
            await self._started(event.start_child_workflow_execution_initiated_event_attributes, when)
        elif kind == EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_STARTED:
            child = event.child_workflow_execution_started_event_attributes.workflow_execution.workflow_id
            if child in self._open:  # the child's time runs from its start, as its timeline's
                self._open[child] = (self._open[child][0], when)
        elif kind == EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_COMPLETED:
            await self._completed(event.child_workflow_execution_completed_event_attributes, when)
        elif kind == EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_FAILED:
            self._ended(event.start_child_workflow_execution_failed_event_attributes.workflow_id, when)
        elif (field := _child_ends().get(kind)) is not None:
            attrs = getattr(event, field)
            self._ended(attrs.workflow_execution.workflow_id, when)
        elif kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW:
            return str(event.workflow_execution_continued_as_new_event_attributes.new_execution_run_id)
        return None

    async def _started(self, attrs: Any, when: datetime) -> None:
        from durable_rlm.audit.history import decode  # start-up: as _take's

        child = attrs.workflow_id
        if child in self.reported:
            return
        request = await decode(self._episode.services.client, attrs.input, EpisodeRequest)
        if request is None or request.parent is None:  # not an rlm_query child
            return
        preview = ""
        if request.context is not None:
            text = await asyncio.to_thread(self._episode.services.blobs.get_text, request.context.digest)
            preview = text[:PREVIEW_CHARS]
        model = request.root_model.model
        self.reported.add(child)
        self._open[child] = (model, when)
        quietly(self._callbacks.on_subcall_start, SUBCALL_DEPTH, model, preview)

    async def _completed(self, attrs: Any, when: datetime) -> None:
        from durable_rlm.audit.history import decode  # start-up: as _take's

        child = attrs.workflow_execution.workflow_id
        if child not in self._open:
            return
        try:
            result = await decode(self._episode.services.client, attrs.result, EpisodeResult)
        except Exception:  # noqa: BLE001 - an unreadable result is reported as no answer
            result = None
        self._ended(child, when, answered=result is not None and result.answer is not None)

    def _ended(self, child: str, when: datetime, answered: bool = False) -> None:
        opened = self._open.pop(child, None)
        if opened is None:
            return
        model, started = opened
        took = max((when - started).total_seconds(), 0.0)
        error = None if answered else "no answer"
        quietly(self._callbacks.on_subcall_complete, SUBCALL_DEPTH, model, took, error)

    def close(self) -> None:
        """After the episode's end: a child it did not wait for is reported as ended now."""
        now = datetime.now(UTC)
        for child in list(self._open):
            self._ended(child, now)


@functools.cache
def _child_ends() -> dict[int, str]:
    """The events that end a child without a result, and their attributes' field."""
    from temporalio.api.enums.v1 import EventType  # start-up: as _take's

    ends = {
        EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_FAILED: "failed",
        EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_CANCELED: "canceled",
        EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_TIMED_OUT: "timed_out",
        EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_TERMINATED: "terminated",
    }
    return {kind: f"child_workflow_execution_{how}_event_attributes" for kind, how in ends.items()}


def report_children(timeline: Timeline, blobs: BlobStore, callbacks: Callbacks, reported: set[str]) -> None:
    """Children not reported while the episode ran (a persistent session's turn, or a history
    that could not be read), each reported once from the ended episode's timeline."""
    if not callbacks.subcalls:
        return
    for it in timeline.iterations:
        for cell in it.cells:
            for child in cell.children:
                if child.episode_id in reported:
                    continue
                reported.add(child.episode_id)
                prompt = blobs.get_text(child.context.digest) if child.context else ""
                quietly(callbacks.on_subcall_start, SUBCALL_DEPTH, child.model, prompt[:PREVIEW_CHARS])
                t = child.timeline
                took = 0.0
                if t is not None and t.ended_at and t.started_at:
                    took = (t.ended_at - t.started_at).total_seconds()
                result = t.result if t is not None else None
                error = None if result is not None and result.answer is not None else "no answer"
                quietly(callbacks.on_subcall_complete, SUBCALL_DEPTH, child.model, took, error)
