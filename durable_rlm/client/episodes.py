"""Client side of episodes: store the context, start, follow progress, wait."""

from __future__ import annotations

import asyncio
import uuid
import weakref
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from temporalio.api.enums.v1 import EventType
from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
from temporalio.client import (
    Client,
    WorkflowExecutionDescription,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowUpdateFailedError,
)
from temporalio.common import WorkflowIDReusePolicy
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from durable_rlm.activities.context_cache import local_cache
from durable_rlm.errors import EpisodeIdInUse
from durable_rlm.store.blobs import BlobStore
from durable_rlm.store.codec import encrypts
from durable_rlm.store.contexts import TextMeasure, read_file_pieces, store_file, store_json_file, store_value
from durable_rlm.workflows import metadata, names
from durable_rlm.workflows.ending import CANCELLED, TIMED_OUT
from durable_rlm.workflows.episode import episode_policy
from durable_rlm.workflows.models import (
    CancelReceipt,
    CancelRequest,
    ContextRef,
    CredentialsReceipt,
    EpisodeProgress,
    EpisodeRequest,
    EpisodeResult,
    EpisodeStatus,
    RewardReceipt,
    RewardUpdate,
    ending_words,
)
from durable_rlm.workflows.retries import describe_failure, ending_of


def store_context(blobs: BlobStore, value: Any) -> ContextRef:
    """Put the context in the blob store once, as a stream; the episode carries its digest.
    When a worker of this process uses the same store (embedded mode), its cache copy is
    written on the way, so its sandbox maps it without reading the store back."""
    cache = local_cache(blobs)
    if cache is None:
        return store_value(blobs, value)
    copy = cache.teeing()
    try:
        ref = store_value(blobs, value, copy.pieces)
    except BaseException:
        copy.drop()
        raise
    copy.keep(ref)
    return ref


def read_context_text(path: Path) -> str:
    """A small context file's text, or a one-line error saying what is wrong with the file
    (for files read whole on purpose; contexts are streamed by `load_context_file`)."""
    return b"".join(read_file_pieces(path, TextMeasure())).decode("utf-8")


def load_context_file(blobs: BlobStore, path: Path) -> ContextRef:
    """A context file streamed into the store: a .json file as its value, any other as text."""
    return store_json_file(blobs, path) if path.suffix.lower() == ".json" else store_file(blobs, path)


# client -> whether its namespace has our attributes (asked once per client)
_REGISTERED: weakref.WeakKeyDictionary[Client, asyncio.Future[bool]] = weakref.WeakKeyDictionary()


async def has_search_attributes(client: Client) -> bool:
    """Whether the namespace registered the episode list's search attributes (the embedded
    server does; a cluster may not): an episode started with unknown ones is refused. Asked
    once per client: a session asks as it connects (`ask_search_attributes`), so that the
    first episode's start does not wait for the answer (~40-60 ms here)."""
    return await asyncio.shield(ask_search_attributes(client))


def ask_search_attributes(client: Client) -> asyncio.Future[bool]:
    """The question put to the server now, or the one already put: its answer, in time. An
    answer is kept; a question that failed or was cancelled, or is pending on another event
    loop (a client used from several), is put again."""
    asked = _REGISTERED.get(client)
    reusable = asked is not None and (
        (asked.done() and not asked.cancelled() and asked.exception() is None)
        or (not asked.done() and asked.get_loop() is asyncio.get_running_loop())
    )
    if asked is None or not reusable:
        asked = _REGISTERED[client] = asyncio.ensure_future(_registered(client))
        asked.add_done_callback(_retrieved)  # a failure is the awaiting start's, never logged
    return asked


def _retrieved(asked: asyncio.Future[bool]) -> None:
    if not asked.cancelled():
        asked.exception()


async def _registered(client: Client) -> bool:
    try:
        listed = await client.operator_service.list_search_attributes(
            ListSearchAttributesRequest(namespace=client.namespace)
        )
    except RPCError:
        return False  # not allowed to ask: start without them
    return all(name in listed.custom_attributes for name, _ in metadata.SEARCH_ATTRIBUTES)


def encrypting(client: Client) -> bool:
    """Whether this client seals payloads (DRLM_ENCRYPTION_KEYS)."""
    return encrypts(client.data_converter)


def new_episode_id() -> str:
    return f"ep-{uuid.uuid4().hex[:12]}"


async def start_episode(
    client: Client, request: EpisodeRequest, task_queue: str, episode_id: str | None = None
) -> WorkflowHandle[Any, EpisodeResult]:
    """Start an episode; a bad policy or reward function is rejected here, before any call."""
    episode_policy(request)
    chosen = episode_id or new_episode_id()
    if encrypting(client) and not request.private_text:
        request = request.model_copy(update={"private_text": True})  # children inherit it
    shown = metadata.PRIVATE_TEXT if request.private_text else request.task
    attributes = (
        metadata.start_search_attributes(shown, request.root_model.model)
        if await has_search_attributes(client)
        else None
    )
    try:
        return await client.start_workflow(
            names.WORKFLOW,
            request,
            id=chosen,
            task_queue=task_queue,
            search_attributes=attributes,
            static_summary=metadata.shorten(request.task),
            result_type=EpisodeResult,
            task_timeout=timedelta(seconds=request.durability.task_timeout_s),
            request_eager_start=True,  # taken only when this client's process runs a worker
            # An id names one episode for good: its history, audit row and timeline.
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
        )
    except WorkflowAlreadyStartedError:
        raise EpisodeIdInUse(
            f"episode id {chosen!r} is already used: choose another id, or see it with `drlm show {chosen}`"
        ) from None


class EpisodeEnd(BaseModel):
    """How an episode ended, whatever way: a result, or the failure, cancellation,
    termination or timeout that ended it without one. Or, status "paused", how it stopped
    without ending: a model call waits for a fixed key (`error` says which and what to do;
    `retry_credentials` goes on once the worker has it)."""

    episode_id: str
    status: EpisodeStatus | Literal["paused"]
    result: EpisodeResult | None = None
    error: str | None = None

    def report(self) -> dict[str, Any]:
        """One flat JSON object for scripts: the result's fields plus the status."""
        if self.result is not None:
            return {"status": self.status, **self.result.model_dump(mode="json")}
        return {
            "episode_id": self.episode_id,
            "status": self.status,
            "answer": None,
            "answer_source": "none",
            "confidence": None,
            "stop_reason": self.error,
            "error": self.error,
            "iterations": None,
            "usage": None,
        }


_WITHOUT_RESULT: dict[WorkflowExecutionStatus, EpisodeStatus] = {
    WorkflowExecutionStatus.FAILED: "failed",
    WorkflowExecutionStatus.CANCELED: "cancelled",
    WorkflowExecutionStatus.TERMINATED: "terminated",
    WorkflowExecutionStatus.TIMED_OUT: "timed_out",
}


_GOING_ON = (WorkflowExecutionStatus.RUNNING, WorkflowExecutionStatus.CONTINUED_AS_NEW)


def execution_ending(status: WorkflowExecutionStatus | None, result: EpisodeResult | None) -> EpisodeStatus:
    """An episode's status in the vocabulary of endings (workflows/models.py `ENDINGS`), from
    its Temporal status and, when it returned one, its result: Temporal says "completed" of
    a cancelled episode, or of one that ended without an answer."""
    if result is not None:
        return result.status
    if status is None or status in _GOING_ON:
        return "running"
    return _WITHOUT_RESULT.get(status, "failed")


def failure_status(error: WorkflowFailureError) -> EpisodeStatus:
    return ending_of(error.cause)


async def closing_error(handle: WorkflowHandle, status: EpisodeStatus) -> str | None:
    """What ended an episode that has no result, as the audit store and the CLI say it."""
    if status == "cancelled":
        return CANCELLED
    if status == "timed_out":
        return TIMED_OUT
    if status not in ("failed", "terminated"):
        return None
    history = await handle.fetch_history()
    last = history.events[-1]
    if last.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_FAILED:
        return last.workflow_execution_failed_event_attributes.failure.message
    if last.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_TERMINATED:
        reason = last.workflow_execution_terminated_event_attributes.reason
        return f"terminated: {reason}" if reason else "terminated"
    return None


async def wait_end(
    handle: WorkflowHandle[Any, EpisodeResult], result: asyncio.Future | None = None
) -> EpisodeEnd:
    try:
        value = await (result if result is not None else handle.result())
    except WorkflowFailureError as exc:
        status = failure_status(exc)
        message = await closing_error(handle, status) or describe_failure(exc.cause or exc)
        return EpisodeEnd(episode_id=handle.id, status=status, error=message)
    return EpisodeEnd(episode_id=handle.id, status=value.status, result=value)


async def pending_step(handle: WorkflowHandle[Any, Any]) -> str | None:
    """The step the episode waits on, its attempt and last failure, as a line for a person."""
    try:
        description = await handle.describe()
    except RPCError:
        return None
    pending = list(description.raw_description.pending_activities)
    if not pending:
        # A local REPL step runs inside a workflow task: no pending activity shows it, but
        # a task retried after its worker was lost does.
        task = description.raw_description.pending_workflow_task
        if task.attempt > 1:
            return f"local step on a new worker after one was lost (workflow task attempt {task.attempt})"
        return None
    step = pending[-1]
    name = step.activity_type.name.removeprefix("drlm.").replace("_", " ")
    attempt = f"attempt {step.attempt}" + (f" of {step.maximum_attempts}" if step.maximum_attempts else "")
    failure = f"; last failure: {step.last_failure.message}" if step.last_failure.message else ""
    return f"{name}, {attempt}{failure}"


WAITING_EVERY_S = 10.0
WAITING_AT_MOST_S = 600.0


def _raise_if_cancel_was_swallowed() -> None:
    """Python 3.11's `asyncio.wait_for` (inside the SDK's calls) returns a result that came
    with a cancellation and drops the cancellation; Ctrl-C (asyncio.run cancels the main
    task) would then be lost and `drlm run` follow the episode to its end. The task still
    counts the request: honour it."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def follow(
    handle: WorkflowHandle[Any, EpisodeResult],
    on_progress: Callable[[str], None] | None = None,
    poll_s: float = 0.3,
    waiting_every_s: float = WAITING_EVERY_S,
    on_state: Callable[[EpisodeProgress], None] | None = None,
) -> EpisodeEnd:
    """Wait for the end, reporting each new iteration and phase, and how long the current
    step has been waiting: after `waiting_every_s`, then at doubling intervals up to
    WAITING_AT_MOST_S (a hung model shows, it is not silence, nor a line every 10 s for
    ever). A step that waits for a person (a cell for approval, a pause) is said once, with
    what to do. Returns early, status "paused", when the episode waits for a fixed key: it
    would wait for nothing else, until its deadline."""
    result_task = asyncio.ensure_future(handle.result())
    seen: tuple[int, str] = (-1, "")
    last_waiting = 0.0
    every = waiting_every_s
    actions_seen = 0
    try:
        while not result_task.done():
            await asyncio.wait({result_task}, timeout=poll_s)
            if result_task.done():
                continue
            try:
                progress: EpisodeProgress = await handle.query("progress", result_type=EpisodeProgress)
            except RPCError:
                continue
            finally:
                _raise_if_cancel_was_swallowed()
            if on_state is not None:
                on_state(progress)  # every answer: the live view redraws its bars
            if progress.paused is not None and not progress.finished:
                return EpisodeEnd(episode_id=handle.id, status="paused", error=progress.paused)
            if on_progress is None:
                continue
            for action in progress.actions:
                if action.number > actions_seen:
                    on_progress(f"action {action.number}: {action.kind} by {action.sender}: {action.detail}")
            actions_seen = max(actions_seen, progress.actions_total)
            if (progress.iteration, progress.phase) != seen:
                seen = (progress.iteration, progress.phase)
                last_waiting, every = 0.0, waiting_every_s
                on_progress(
                    f"iteration {progress.iteration}: {progress.phase} "
                    f"({progress.model_calls} model calls, {progress.sub_calls} from the REPL)"
                )
                waiting = progress.pending_cell
                if waiting is not None:
                    on_progress(
                        f"  `drlm pending` shows it; `drlm approve {waiting.approval_id} [--edit FILE]` "
                        f"or `drlm reject {waiting.approval_id} --reason TEXT`"
                    )
                elif progress.held is not None:
                    on_progress(f"  held until `drlm resume {handle.id}`")
                continue
            if progress.phase_started is None or progress.finished:
                continue
            if progress.pending_cell is not None or progress.held is not None:
                continue  # a person's turn: said once, with what to do
            waited = (datetime.now(UTC) - progress.phase_started).total_seconds()
            if waited - last_waiting >= every:
                last_waiting, every = waited, min(every * 2, WAITING_AT_MOST_S)
                step = await pending_step(handle)
                on_progress(f"still {progress.phase}: {waited:.0f} s" + (f" ({step})" if step else ""))
        return await wait_end(handle, result_task)
    finally:
        if not result_task.done():
            result_task.cancel()


async def send_reward(
    client: Client, episode_id: str, value: float, note: str | None = None
) -> RewardReceipt:
    """Send a reward to a running episode (a Temporal update: it returns once applied)."""
    handle = client.get_workflow_handle(episode_id)
    return await handle.execute_update(
        "reward", RewardUpdate(value=value, note=note), result_type=RewardReceipt
    )


class CredentialsOutcome(BaseModel):
    """What `retry_credentials` did: how many paused model calls run again, or why none."""

    episode_id: str
    accepted: bool
    waiting_calls: int = 0
    message: str


async def retry_credentials(client: Client, episode_id: str) -> CredentialsOutcome:
    """Tell an episode that the worker's key was fixed: every model call paused on a
    refused key runs again (with the credentials of the worker that runs it). When nothing
    waits, nothing changes (not accepted, and no history is written), so `drlm resume` may
    always send it. A worker must be running: this is a Temporal update, answered once
    applied."""
    receipt, refused = await update_running(
        client, episode_id, names.RETRY_CREDENTIALS, None, CredentialsReceipt, "nothing to retry"
    )
    if refused is not None:
        return CredentialsOutcome(episode_id=episode_id, accepted=False, message=refused)
    waiting = receipt.waiting_calls
    return CredentialsOutcome(
        episode_id=episode_id,
        accepted=True,
        waiting_calls=waiting,
        message=f"episode {episode_id}: {waiting} paused model call(s) run again with the worker's key",
    )


def own_task_queue(shared: str) -> str:
    """A task queue of this process's own, beside the shared one: an embedded session (a
    `drlm run`, a script's `completion()`) starts its episodes there and its worker polls
    only there, so a short-lived process never takes up another person's episode and
    leaves it mid-call when it exits. Its episodes go on with `drlm resume ID`, which polls
    the episode's own queue (`episode_task_queue`)."""
    return f"{shared}.own-{uuid.uuid4().hex[:12]}"


async def episode_task_queue(client: Client, episode_id: str) -> str:
    """The task queue an episode's workflow tasks go to (shared, or a session's own)."""
    return (await describe_episode(client.get_workflow_handle(episode_id))).task_queue


async def describe_episode(handle: WorkflowHandle[Any, Any]) -> WorkflowExecutionDescription:
    """The episode's description; an id the server does not know is a LookupError."""
    try:
        return await handle.describe()
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            raise LookupError(f"no episode with id {handle.id!r}") from None
        raise


async def ended_refusal(
    client: Client, episode_id: str, unchanged: str = "nothing was changed"
) -> str | None:
    """Why an action on an ended episode changes nothing, in the words of its ending; None
    while it runs. Needs no worker (a query or an update to an ended episode would)."""
    handle = client.get_workflow_handle(episode_id, result_type=EpisodeResult)
    status = (await describe_episode(handle)).status
    if status is None or status == WorkflowExecutionStatus.RUNNING:
        return None
    result = await handle.result() if status == WorkflowExecutionStatus.COMPLETED else None
    ending = ending_words(execution_ending(status, result))
    return f"episode {episode_id} has already ended ({ending}); {unchanged}"


async def update_running(
    client: Client, episode_id: str, update: str, arg: Any, result_type: type, unchanged: str
) -> tuple[Any, str | None]:
    """Send an update to a running episode: (its receipt, None), or (None, why not: it has
    ended, or the workflow refused the update)."""
    handle = client.get_workflow_handle(episode_id, result_type=EpisodeResult)
    ended = await ended_refusal(client, episode_id, unchanged)
    if ended is not None:
        return None, ended
    try:
        args = [] if arg is None else [arg]
        return await handle.execute_update(update, args=args, result_type=result_type), None
    except WorkflowUpdateFailedError as exc:
        cause = exc.cause.message if isinstance(exc.cause, ApplicationError) else str(exc.cause or exc)
        return None, f"episode {episode_id}: {cause}"
    except RPCError as exc:
        # It ended between the look and the update (a worker finished it meanwhile).
        if exc.status == RPCStatusCode.NOT_FOUND or "already completed" in str(exc):
            return None, f"episode {episode_id} has already ended; {unchanged}"
        raise


class CancelOutcome(BaseModel):
    """What `cancel_episode` did: accepted, or why nothing was changed."""

    episode_id: str
    accepted: bool
    message: str
    receipt: CancelReceipt | None = None


async def cancel_episode(
    client: Client, episode_id: str, extract: bool = False, reason: str = "cancelled by request"
) -> CancelOutcome:
    """Cancel an episode and every descendant. With `extract`, it first runs fallback
    extraction, so the result holds what was found so far. An episode that already ended
    is left as it is, and the outcome says so."""
    receipt, refused = await update_running(
        client, episode_id, "cancel", CancelRequest(extract=extract, reason=reason), CancelReceipt,
        "nothing was changed",
    )  # fmt: skip
    if refused is not None:
        return CancelOutcome(episode_id=episode_id, accepted=False, message=refused)
    what = "extracting what was found, then ending" if extract else "ending"
    where = f"at iteration {receipt.iteration}" if receipt.iteration else "before its first iteration"
    return CancelOutcome(
        episode_id=episode_id,
        accepted=True,
        message=f"episode {episode_id}: cancel accepted {where}; {what}",
        receipt=receipt,
    )
