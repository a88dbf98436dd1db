"""Blob retention on a schedule: one workflow, one activity (durable_rlm/audit/gc.py does the
work). A Temporal Schedule (`drlm gc --schedule EVERY`) starts it; any worker runs it."""

from __future__ import annotations

from datetime import timedelta

from pydantic import BaseModel, Field
from temporalio import workflow
from temporalio.common import RetryPolicy

from durable_rlm.workflows import names


class GcRequest(BaseModel):
    grace_s: float = Field(default=86_400.0, ge=60.0, description="an unnamed blob younger than this stays")
    dry_run: bool = False


class GcSummary(BaseModel):
    """What one collection did, in numbers (the activity's result, kept in history)."""

    started_at: str
    histories: int
    referenced: int
    listed: int
    removed: int
    removed_bytes: int
    kept_young: int
    expired_timelines: int
    dry_run: bool


GC_TIMEOUT = timedelta(hours=6)
GC_HEARTBEAT = timedelta(minutes=2)


@workflow.defn(name=names.GC_WORKFLOW)
class BlobRetentionWorkflow:
    @workflow.run
    async def run(self, request: GcRequest) -> GcSummary:
        summary: GcSummary = await workflow.execute_activity(
            names.COLLECT_GARBAGE,
            request,
            result_type=GcSummary,
            start_to_close_timeout=GC_TIMEOUT,
            heartbeat_timeout=GC_HEARTBEAT,
            # A store or server away is waited out a while; the next scheduled run goes on.
            retry_policy=RetryPolicy(maximum_attempts=5, initial_interval=timedelta(seconds=30)),
        )
        return summary
