"""Admission by measured capacity (durable_rlm/worker/admission.py): a worker holds at most a window
of episodes that follows its measured event-loop lag and task times; past its targets it
takes no new one, and the episodes it already holds are served whatever the window."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from temporalio.testing import ActivityEnvironment
from temporalio.worker import ActivityInboundInterceptor, ExecuteActivityInput

from durable_rlm.worker.admission import (
    AdmittingActivitySlots,
    AdmittingWorkflowSlots,
    Capacity,
    HandoffWatch,
)


@dataclass
class Reserve:
    is_sticky: bool
    slot_type: str = "workflow"
    task_queue: str = "q"
    worker_identity: str = "w"
    worker_build_id: str = ""
    worker_deployment_version: None = None


@dataclass
class Used:
    permit: object
    slot_info: object = None


NEW = Reserve(is_sticky=False)  # a task from the shared queue: a new episode
OWN = Reserve(is_sticky=True)  # a task of an episode this worker holds


def test_the_window_becomes_two_thirds_of_what_is_held_when_the_loop_runs_late() -> None:
    capacity = Capacity(window=60)
    capacity.adjust(task_s=0.1, lag_s=capacity.lag_target_s * 2, live=30, wanted_more=True)
    assert capacity.window == 20 and capacity.overloaded


def test_the_window_is_cut_when_tasks_stay_too_long() -> None:
    capacity = Capacity(window=30)
    capacity.adjust(task_s=capacity.task_target_s + 1, lag_s=0.0, live=90, wanted_more=False)
    assert capacity.window == 20 and capacity.overloaded  # two thirds of the window, if less


def test_the_window_never_falls_below_its_floor() -> None:
    capacity = Capacity(window=3, floor=2)
    for _ in range(5):
        capacity.adjust(task_s=60, lag_s=60, live=3, wanted_more=True)
    assert capacity.window == 2


def test_the_window_grows_only_when_more_waited_and_there_is_room() -> None:
    capacity = Capacity(window=20)
    capacity.adjust(task_s=0.1, lag_s=0.01, live=20, wanted_more=False)
    assert capacity.window == 20
    capacity.adjust(task_s=0.1, lag_s=0.01, live=20, wanted_more=True)
    assert capacity.window == 22 and not capacity.overloaded
    near = capacity.task_target_s * 0.75  # below the target, above half of it: hold
    capacity.adjust(task_s=near, lag_s=0.01, live=22, wanted_more=True)
    assert capacity.window == 22 and not capacity.overloaded


def test_the_window_never_grows_past_its_ceiling() -> None:
    capacity = Capacity(window=99, ceiling=100)
    for _ in range(5):
        capacity.adjust(task_s=0.0, lag_s=0.0, live=99, wanted_more=True)
    assert capacity.window == 100


def test_new_episodes_are_admitted_up_to_the_window_and_its_own_always() -> None:
    slots = AdmittingWorkflowSlots(ceiling=100, capacity=Capacity(window=2, limit=100))
    held = [0]
    slots.live = lambda: held[0]
    assert [slots.try_reserve_slot(NEW) is not None for _ in range(3)] == [True, True, False]
    assert all(slots.try_reserve_slot(OWN) is not None for _ in range(10))
    held[0] = 2
    slots.tick(lag_s=0.0)  # two held, one waited: the window grows by one
    assert slots.capacity.window == 3
    assert [slots.try_reserve_slot(NEW) is not None for _ in range(2)] == [True, False]
    held[0] = 0  # the episodes ended
    slots.tick(lag_s=0.0)
    assert sum(slots.try_reserve_slot(NEW) is not None for _ in range(10)) == slots.capacity.window


def test_no_slot_past_the_limit_even_for_its_own_episodes() -> None:
    slots = AdmittingWorkflowSlots(ceiling=100, capacity=Capacity(window=10, limit=2))
    permits = [slots.try_reserve_slot(OWN) for _ in range(3)]
    assert permits[2] is None
    slots.release_slot(Used(permits[0]))
    assert slots.try_reserve_slot(OWN) is not None


def test_an_overloaded_worker_takes_no_new_episode_but_serves_its_own() -> None:
    slots = AdmittingWorkflowSlots(ceiling=100, capacity=Capacity(window=10, limit=100))
    slots.tick(lag_s=5.0)  # the loop ran 5 s late
    assert slots.capacity.overloaded
    assert slots.try_reserve_slot(NEW) is None  # the shared queue waits
    assert slots.try_reserve_slot(OWN) is not None  # its own episodes go on
    slots.tick(lag_s=0.0)
    assert slots.try_reserve_slot(NEW) is not None  # room in the window: taken


def test_task_times_are_measured_from_taken_to_released() -> None:
    slots = AdmittingWorkflowSlots(ceiling=100, capacity=Capacity(window=8, limit=100))
    slots.live = lambda: 6
    permit = slots.try_reserve_slot(OWN)
    slots.mark_slot_used(Used(permit))
    permit.taken_at -= 30  # type: ignore[union-attr] - as if it was taken 30 s ago
    slots.release_slot(Used(permit))
    slots.tick(lag_s=0.0)
    assert slots.capacity.task_s >= 30 and slots.capacity.overloaded and slots.capacity.window == 4


def test_tasks_at_once_follow_the_same_measurements() -> None:
    capacity = Capacity(window=10, limit=30, limit_floor=4)
    capacity.adjust(task_s=0.0, lag_s=2.0, live=10, wanted_more=False, wanted_slots=True)
    assert capacity.limit == 20
    capacity.adjust(task_s=0.0, lag_s=0.0, live=10, wanted_more=False, wanted_slots=False)
    assert capacity.limit == 20  # nobody waited for a slot: no growth
    capacity.adjust(task_s=0.0, lag_s=0.0, live=10, wanted_more=False, wanted_slots=True)
    assert capacity.limit == 22
    for _ in range(10):
        capacity.adjust(task_s=9.0, lag_s=0.0, live=10, wanted_more=False)
    assert capacity.limit == 4


def test_an_overloaded_worker_starts_no_activity() -> None:
    overloaded = [False]
    slots = AdmittingActivitySlots(limit=2, overloaded=lambda: overloaded[0])
    first = slots.try_reserve_slot(NEW)
    assert first is not None
    overloaded[0] = True
    assert slots.try_reserve_slot(NEW) is None  # waits on the server, where no clock runs
    overloaded[0] = False
    assert slots.try_reserve_slot(NEW) is not None and slots.try_reserve_slot(NEW) is None  # its limit
    slots.release_slot(Used(first))
    assert slots.try_reserve_slot(NEW) is not None  # room in the window: taken


def test_the_wait_since_an_activity_task_s_hand_out_is_reported_each_tick_not_a_limit() -> None:
    """The wait between the server handing an activity task out and this worker's code getting
    it runs the task's heartbeat clock: at N=200 it reached 7.5 s while the loop ran on time.
    Shedding on it made N=200 slower without bringing it down: it is reported only."""
    slots = AdmittingWorkflowSlots(ceiling=100, capacity=Capacity(window=30, limit=30))
    slots.live = lambda: 10
    for waited in [0.1] * 8 + [9.0] * 2:  # the 90th percentile
        slots.saw_handoff(waited)
    slots.tick(lag_s=0.0)
    assert slots.capacity.handoff_s == 9.0 and not slots.capacity.overloaded
    assert "activity hand-off 9.00 s" in slots.capacity.describe()
    assert slots.try_reserve_slot(NEW) is not None  # room in the window: taken
    slots.tick(lag_s=0.0)  # measured afresh each tick
    assert slots.capacity.handoff_s == 0.0


async def test_the_watch_reports_each_remote_activity_s_wait_and_not_a_local_one_s() -> None:
    """Through the SDK's activity context (ActivityEnvironment runs no interceptors, so the
    watch's inbound interceptor is called as the worker would, around a real next step)."""

    class Step(ActivityInboundInterceptor):
        def __init__(self) -> None:  # the innermost step: no next one
            pass

        async def execute_activity(self, input: ExecuteActivityInput) -> str:
            return "done"

    slots = AdmittingWorkflowSlots(ceiling=100)
    inbound = HandoffWatch(slots).intercept_activity(Step())
    handed_out = datetime.now(UTC) - timedelta(seconds=4)
    for is_local in (False, True):
        env = ActivityEnvironment()
        env.info = dataclasses.replace(env.info, started_time=handed_out, is_local=is_local)
        assert await env.run(inbound.execute_activity, None) == "done"
    assert len(slots._handoffs) == 1 and 4.0 <= slots._handoffs[0] < 5.0  # noqa: SLF001
