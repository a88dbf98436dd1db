"""Retry policies of an episode's steps, and how a failed step is told to a person."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any, Literal, TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import (
    ActivityError,
    ApplicationError,
    CancelledError,
    FailureError,
    TerminatedError,
    TimeoutError,
    TimeoutType,
)

from durable_rlm.workflows import defaults, names
from durable_rlm.workflows.models import DurabilitySettings, FailureCause, ModelSettings

STEP_FAILURES = (ActivityError, ApplicationError, TimeoutError, CancelledError)
"""How a failed step reaches workflow code: an activity's failure wrapped in ActivityError; a
local activity's ordinary failure as the ApplicationError itself, its timeout or cancel
wrapped (live) or bare (on replay)."""


def model_retry_policy(max_attempts: int) -> RetryPolicy:
    return RetryPolicy(
        initial_interval=defaults.MODEL_RETRY_INITIAL,
        backoff_coefficient=defaults.MODEL_RETRY_BACKOFF,
        maximum_interval=defaults.MODEL_RETRY_MAX_INTERVAL,
        maximum_attempts=max_attempts,
        non_retryable_error_types=[names.MODEL_REQUEST_REJECTED, names.MODEL_CONTEXT_OVERFLOW],
    )


def model_step_options(model: ModelSettings, durability: DurabilitySettings) -> dict[str, Any]:
    """Timeouts and retries of every model-calling step (root, sub-call, compaction,
    extraction): the request's own timeout plus the blob-store work around it."""
    return {
        "start_to_close_timeout": timedelta(seconds=model.request_timeout_s + defaults.ACTIVITY_SLACK_S),
        "heartbeat_timeout": timedelta(seconds=durability.heartbeat_timeout_s),
        "retry_policy": model_retry_policy(model.max_attempts),
    }


R = TypeVar("R")


async def model_step(
    activity: str,
    arg: Any,
    *,
    result_type: type[R],
    summary: str,
    model: ModelSettings,
    durability: DurabilitySettings,
) -> R:
    """Run one model-calling step, as an activity or, with `durability.local_model_calls`, as
    a local activity of the worker that runs the episode's workflow task.

    A local step saves the activity's round trips through the server (its schedule, start
    and completion events, a poll and a workflow task) at the cost of its liveness: no
    heartbeat, so a lost worker is noticed by the workflow task's timeout. The call ledger
    keeps a retried local step from paying for a call its earlier attempt made (its
    activity id is the step's place in the episode). Its failure is handed to the caller
    as an activity's would be (an ActivityError with the cause inside), so every caller
    handles both kinds alike."""
    result: R
    if not durability.local_model_calls:
        result = await workflow.execute_activity(
            activity, arg, result_type=result_type, summary=summary, **model_step_options(model, durability)
        )
        return result
    try:
        result = await workflow.execute_local_activity(
            activity,
            arg,
            result_type=result_type,
            summary=summary,
            start_to_close_timeout=timedelta(seconds=model.request_timeout_s + defaults.ACTIVITY_SLACK_S),
            retry_policy=model_retry_policy(model.max_attempts),
            local_retry_threshold=timedelta(seconds=defaults.LOCAL_RETRY_THRESHOLD_S),
        )
    except ActivityError:
        raise
    except (ApplicationError, TimeoutError, CancelledError) as err:
        raise ActivityError(
            f"local activity {activity} failed",
            scheduled_event_id=0,
            started_event_id=0,
            identity="",
            activity_type=activity,
            activity_id="",
            retry_state=None,
        ) from err
    return result


def raise_if_cancelled(err: FailureError) -> None:
    """A step cancelled because the episode (or the loop, at the deadline) was cancelled
    arrives as an ActivityError; it must end the loop, not be handled as a failed step."""
    if isinstance(err, CancelledError) or isinstance(getattr(err, "cause", None), CancelledError):
        raise asyncio.CancelledError() from err


def is_timeout(err: ActivityError) -> bool:
    cause = err.cause
    return isinstance(cause, TimeoutError) and cause.type in (
        TimeoutType.SCHEDULE_TO_START,
        TimeoutType.HEARTBEAT,
        TimeoutType.START_TO_CLOSE,
    )


def error_type(err: BaseException) -> str | None:
    """The type of the first ApplicationError in a failure chain: the one the activity
    raised (deeper causes are the client exceptions it was raised from)."""
    current: BaseException | None = err
    while current is not None:
        if isinstance(current, ApplicationError):
            return current.type
        current = current.__cause__ or getattr(current, "cause", None)
    return None


def is_context_overflow(err: ActivityError) -> bool:
    return error_type(err) == names.MODEL_CONTEXT_OVERFLOW


def waits_for_credentials(err: BaseException) -> bool:
    """A model call the provider refused for its key: it waits for a fixed one instead of
    failing (a person can fix a key; the episode should not end over it)."""
    return error_type(err) == names.MODEL_AUTH_FAILED


def waits_for_store(err: BaseException) -> bool:
    """A step the audit or blob store failed (durable_rlm/store/outages.py): the episode waits
    for the store and asks again."""
    return error_type(err) == names.STORE_UNAVAILABLE


def model_step_outage(err: BaseException) -> str | None:
    """What to wait for when a model step failed on every attempt through no fault of the
    model or the request: the store (StoreUnavailable), or a worker (every attempt's worker
    stopped heartbeating, died (WorkerLost), or was paused past its attempt: StaleAttempt).
    None otherwise. An infrastructure failure is waited out, never an ending."""
    if waits_for_store(err):
        return f"waiting for the store: {describe_failure(err)}"
    cause = err.cause if isinstance(err, ActivityError) else err
    lost = isinstance(cause, TimeoutError) and cause.type == TimeoutType.HEARTBEAT
    if lost or error_type(err) in (names.STALE_ATTEMPT, names.WORKER_LOST):
        return f"waiting for a worker: {describe_failure(err)} (the step's worker was lost or paused)"
    return None


def store_pause(waits: int) -> timedelta:
    """The wait before asking a step again after the store failed it `waits` times before."""
    seconds = min(defaults.STORE_WAIT_MAX_S, defaults.STORE_WAIT_FIRST_S * 2 ** min(waits, 16))
    return timedelta(seconds=seconds)


_CAUSE_OF_TYPE: dict[str, FailureCause] = {
    names.MODEL_REQUEST_REJECTED: "request",
    names.MODEL_AUTH_FAILED: "request",
    names.MODEL_CONTEXT_OVERFLOW: "request",
    names.MODEL_UNAVAILABLE: "model",
    names.MODEL_BAD_REPLY: "model",
    names.STORE_UNAVAILABLE: "store",
    names.SANDBOX_FAILURE: "sandbox",
    names.SANDBOXES_BUSY: "sandbox",
    names.REPL_STEP_ABANDONED: "sandbox",
}


def failure_cause(err: BaseException) -> FailureCause:
    """What failed a model step, by its failure's type: the provider ("model"), the request
    it refused ("request"), the store, the sandbox, or the infrastructure (a worker that
    stopped heartbeating, our own code raising): an ending names the real cause."""
    kind = error_type(err)
    if kind is not None:
        return _CAUSE_OF_TYPE.get(kind, "infrastructure")
    cause = err.cause if isinstance(err, ActivityError) else err
    if isinstance(cause, TimeoutError) and cause.type == TimeoutType.START_TO_CLOSE:
        return "model"  # the request's own timeout is inside start-to-close: the model was slow
    return "infrastructure"


def describe_failure(err: BaseException) -> str:
    """The most specific message in a failure chain: what the user needs to read."""
    current: BaseException | None = err
    while current is not None:
        if isinstance(current, (ApplicationError, TimeoutError)) and current.message:
            return current.message
        current = current.__cause__ or getattr(current, "cause", None)
    return getattr(err, "message", "") or str(err)


def ending_of(cause: BaseException | None) -> Literal["cancelled", "terminated", "timed_out", "failed"]:
    """How a workflow that closed without a result ended, from its failure's cause."""
    if isinstance(cause, CancelledError):
        return "cancelled"
    if isinstance(cause, TerminatedError):
        return "terminated"
    if isinstance(cause, TimeoutError):
        return "timed_out"
    return "failed"


def describe_lost_step(err: FailureError) -> str:
    """Why a REPL step failed on every attempt, in the words the model and a person read."""
    cause = err.cause if isinstance(err, ActivityError) else err
    if error_type(err) == names.REPL_STEP_ABANDONED:
        return f"the worker running this cell was lost ({describe_failure(err)})"
    if isinstance(cause, TimeoutError):
        kinds: dict[TimeoutType | None, str] = {
            TimeoutType.HEARTBEAT: "stopped heartbeating",
            TimeoutType.SCHEDULE_TO_START: "never picked the step up",
            TimeoutType.START_TO_CLOSE: "did not finish in time",
        }
        kind = kinds.get(cause.type, "timed out")
        return f"the worker running this cell was lost (it {kind} on every attempt)"
    return f"the REPL step failed on every attempt: {describe_failure(err)}"
