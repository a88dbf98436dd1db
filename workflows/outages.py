"""Waiting out the infrastructure: a model key the provider refuses, a store that fails.

A model call whose key the provider refuses (401/403) pauses instead of ending the episode:
progress says so, and a `retry_credentials` update (sent once the worker has a fixed key)
runs the same call again. A step the store (or a worker) failed waits on a durable timer
and is asked again. Neither is ever an ending: only the deadline or a person ends a waiting
episode (they cancel the loop, and the wait with it: `Stopping`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from durable_rlm.workflows import metadata
    from durable_rlm.workflows.display import EpisodeDisplay
    from durable_rlm.workflows.models import CredentialsReceipt
    from durable_rlm.workflows.retries import (
        describe_failure,
        model_step_outage,
        store_pause,
        waits_for_credentials,
    )
    from durable_rlm.workflows.stopping import Stopping

T = TypeVar("T")


class OutageWaits:
    """The steps that wait for a fixed key or for the store, and what progress says of them."""

    def __init__(self, display: EpisodeDisplay, stop: Stopping) -> None:
        self.display = display
        self.stop = stop
        # Model calls paused on a refused key: each waits for a retry_credentials update
        # sent after it paused (the count of updates so far is the epoch).
        self.credentials_epoch = 0
        self.paused_calls = 0
        self.paused: str | None = None  # what to fix, for progress
        self.phase_before_pause = ""
        # Steps the store failed, each waiting on a timer before it is asked again.
        self.store_waits = 0
        self.phase_before_store = ""

    # --- the retry_credentials update -----------------------------------------------------

    def retry(self, episode_id: str) -> CredentialsReceipt:
        """The worker's key was fixed: every model call paused on a refused key runs again."""
        waiting = self.paused_calls
        self.credentials_epoch += 1
        self.paused = None  # a progress query right after this update sees it resumed
        return CredentialsReceipt(episode_id=episode_id, waiting_calls=waiting)

    def refuse_retry(self) -> None:
        """Refused (and so not written to history) unless a call waits for a key."""
        if self.stop.over():
            raise ValueError("the episode has already ended or is closing; nothing to retry")
        if self.paused_calls == 0:
            raise ValueError("it is not waiting for credentials; nothing to retry")

    # --- the waits ------------------------------------------------------------------------

    async def with_credentials(self, call: Callable[[], Awaitable[T]]) -> T:
        """Run a model step; if the provider refuses the key, wait for a fixed one and run
        the same step again (its input is unchanged: nothing was charged or appended). A
        store outage is waited out the same way, by a timer (`wait_for_store`)."""
        outages = 0
        while True:
            self.stop.halt_if_stopping()  # a cancel a wait's last step absorbed
            try:
                return await call()
            except ActivityError as err:
                outage = model_step_outage(err)
                if outage is not None:
                    await self.wait_for_store(outage, outages)
                    outages += 1
                    continue
                if not waits_for_credentials(err):
                    raise
                await self.wait_for_credentials(describe_failure(err))

    async def through_store_outages(self, call: Callable[[], Awaitable[T]]) -> T:
        """Run a step; while the store fails it, wait (a durable timer) and run it again."""
        outages = 0
        while True:
            self.stop.halt_if_stopping()  # a cancel a wait's last step absorbed
            try:
                return await call()
            except ActivityError as err:
                outage = model_step_outage(err)
                if outage is None:
                    raise
                await self.wait_for_store(outage, outages)
                outages += 1

    async def wait_for_store(self, problem: str, outages: int) -> None:
        """The store (or a worker) failed a step: say so (progress, `drlm watch`, the status
        attribute) and wait before the step is asked again. `problem` is the phase's text
        ("waiting for the store: ...")."""
        display = self.display
        if self.store_waits == 0:
            self.phase_before_store = display.phase
            display.show(metadata.WAITING)
        self.store_waits += 1
        display.set_phase(problem)
        try:
            await workflow.sleep(store_pause(outages), summary=f"wait, then ask again: {problem}"[:200])
        finally:  # plain state only: on eviction this runs outside the workflow's event loop
            self.store_waits -= 1
        if self.store_waits == 0:
            display.set_phase(self.phase_before_store)
            display.show(metadata.RUNNING)

    async def wait_for_credentials(self, problem: str) -> None:
        """Pause until a retry_credentials update arrives: no model call, no iteration, no
        budget is spent meanwhile."""
        display = self.display
        epoch = self.credentials_epoch
        self.paused = f"{problem}. Fix it, then run `drlm resume {workflow.info().workflow_id}`"
        if self.paused_calls == 0:
            self.phase_before_pause = display.phase
            display.show(metadata.PAUSED)
            # The pause is a command of its own (the memo says why it waits). Without one, the
            # workflow task that paused would end with no command, and a worker that takes
            # the episode over would get the failed call and a later `retry_credentials` in
            # one activation, where Temporal runs the update's validator first: it would
            # find no call waiting and refuse the retry.
            workflow.upsert_memo({metadata.PAUSED_MEMO: metadata.shorten(self.paused, metadata.TASK_CHARS)})
        self.paused_calls += 1
        display.set_phase(f"paused: {self.paused}")
        try:
            await self.stop.until(lambda: self.credentials_epoch > epoch)
        finally:  # plain state only: on eviction this runs outside the workflow's event loop
            self.paused_calls -= 1
            if self.paused_calls == 0:
                self.paused = None
        if self.paused_calls == 0:
            display.set_phase(self.phase_before_pause)
            display.show(metadata.RUNNING)
            workflow.upsert_memo({metadata.PAUSED_MEMO: None})
