"""The cancel update's rules (workflows/stopping.py) and the retry_credentials update's
(workflows/outages.py), on their objects alone: refused once the episode is over, a second
cancel refused, a retry refused unless a call waits for a key. On running episodes:
tests/test_endings.py and tests/test_model_failures.py."""

from __future__ import annotations

import asyncio

import pytest

from durable_rlm.workflows.display import EpisodeDisplay
from durable_rlm.workflows.models import CancelRequest
from durable_rlm.workflows.outages import OutageWaits
from durable_rlm.workflows.stopping import Stopping


def test_a_cancel_is_taken_once_and_its_receipt_says_where() -> None:
    stop = Stopping()
    stop.refuse_cancel()
    receipt = stop.request_cancel(CancelRequest(reason="wrong task", extract=True), "ep", 4)
    assert (receipt.episode_id, receipt.iteration, receipt.extract) == ("ep", 4, True)
    assert stop.cancel is not None and stop.cancel.reason == "wrong task"
    with pytest.raises(ValueError, match="already being cancelled"):
        stop.refuse_cancel()


@pytest.mark.parametrize("phase", ["closing", "finished"])
def test_a_cancel_is_refused_once_the_episode_closes(phase: str) -> None:
    stop = Stopping()
    setattr(stop, phase, True)
    assert stop.over()
    with pytest.raises(ValueError, match="already ended or is closing; nothing was changed"):
        stop.refuse_cancel()


def test_the_loop_halts_while_it_is_being_stopped_and_not_after() -> None:
    stop = Stopping()
    stop.halt_if_stopping()  # running: nothing to halt
    stop.halting = True  # what `stop_loop` sets until the loop has ended
    with pytest.raises(asyncio.CancelledError):
        stop.halt_if_stopping()
    stop.halting = False  # the loop ended: extraction and closing run on
    stop.halt_if_stopping()


def test_a_retry_is_refused_unless_a_call_waits_for_a_key() -> None:
    stop = Stopping()
    waits = OutageWaits(EpisodeDisplay(lambda: None), stop)
    with pytest.raises(ValueError, match="not waiting for credentials"):
        waits.refuse_retry()
    waits.paused_calls, waits.paused = 2, "the key was refused"
    waits.refuse_retry()
    receipt = waits.retry("ep")
    assert (receipt.episode_id, receipt.waiting_calls) == ("ep", 2)
    assert waits.credentials_epoch == 1 and waits.paused is None  # progress sees it resumed
    stop.closing = True
    with pytest.raises(ValueError, match="already ended or is closing; nothing to retry"):
        waits.refuse_retry()
