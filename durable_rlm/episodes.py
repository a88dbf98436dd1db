"""Client side of episodes: store the context, start, follow progress, wait."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError

from durable_rlm.blobs import BlobStore
from durable_rlm.settings import ConfigurationError
from workflows import names
from workflows.episode import episode_policy
from workflows.models import (
    ContextRef,
    EpisodeProgress,
    EpisodeRequest,
    EpisodeResult,
    RewardReceipt,
    RewardUpdate,
)


def store_context(blobs: BlobStore, value: Any) -> ContextRef:
    """Put the context in the blob store once; the episode carries only its digest."""
    if isinstance(value, str):
        return ContextRef(digest=blobs.put_text(value), kind="text", size=len(value), type_name="str")
    text = json.dumps(value, ensure_ascii=False)
    return ContextRef(
        digest=blobs.put_text(text), kind="json", size=len(text), type_name=type(value).__name__
    )


def load_context_file(blobs: BlobStore, path: Path) -> ContextRef:
    if not path.is_file():
        raise ConfigurationError(f"context file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigurationError(f"context file is not UTF-8 text: {path} ({exc})") from exc
    if path.suffix.lower() == ".json":
        try:
            return store_context(blobs, json.loads(text))
        except json.JSONDecodeError as exc:
            raise ConfigurationError(f"context file {path} is not valid JSON: {exc}") from exc
    return store_context(blobs, text)


def new_episode_id() -> str:
    return f"ep-{uuid.uuid4().hex[:12]}"


async def start_episode(
    client: Client, request: EpisodeRequest, task_queue: str, episode_id: str | None = None
) -> WorkflowHandle[Any, EpisodeResult]:
    """Start an episode; a bad policy or reward function is rejected here, before any call."""
    episode_policy(request)
    return await client.start_workflow(
        names.WORKFLOW,
        request,
        id=episode_id or new_episode_id(),
        task_queue=task_queue,
        result_type=EpisodeResult,
    )


async def pending_retry(handle: WorkflowHandle[Any, Any]) -> str | None:
    """A model or REPL call that is failing and being retried, as a line for a person."""
    try:
        description = await handle.describe()
    except RPCError:
        return None
    for pending in description.raw_description.pending_activities:
        if pending.attempt > 1 and pending.last_failure.message:
            return (
                f"{pending.activity_type.name} attempt {pending.attempt} "
                f"(last failure: {pending.last_failure.message})"
            )
    return None


async def follow(
    handle: WorkflowHandle[Any, EpisodeResult],
    on_progress: Callable[[str], None] | None = None,
    poll_s: float = 0.3,
) -> EpisodeResult:
    """Wait for the result, reporting each new iteration, phase and retry on the way."""
    result_task = asyncio.ensure_future(handle.result())
    seen: tuple[int, str] = (-1, "")
    last_retry: str | None = None
    try:
        while not result_task.done():
            await asyncio.wait({result_task}, timeout=poll_s)
            if result_task.done() or on_progress is None:
                continue
            try:
                progress: EpisodeProgress = await handle.query("progress", result_type=EpisodeProgress)
            except RPCError:
                continue
            if (progress.iteration, progress.phase) != seen:
                seen = (progress.iteration, progress.phase)
                on_progress(
                    f"iteration {progress.iteration}: {progress.phase} "
                    f"({progress.model_calls} model calls, {progress.sub_calls} from the REPL)"
                )
            retry = await pending_retry(handle)
            if retry and retry != last_retry:
                on_progress(f"retrying {retry}")
            last_retry = retry
        return result_task.result()
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
