"""Admission by measured capacity (durable_rlm/worker/admission.py): a worker holds at most a
window of episodes that follows how busy it is and how late its event loop runs; past its
targets it takes no new one, and the episodes it already holds are served whatever the
window."""

from __future__ import annotations

import time
from dataclasses import dataclass

from durable_rlm.worker.admission import AdmittingActivitySlots, AdmittingWorkflowSlots, Capacity


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


def test_a_busy_worker_cuts_its_window_to_nine_tenths_of_what_it_holds() -> None:
    capacity = Capacity(window=60)
    capacity.adjust(busy=capacity.busy_high + 0.05, lag_s=0.0, held=40, wanted_more=True)
    assert capacity.window == 36 and capacity.overloaded


def test_a_late_loop_cuts_the_window_however_idle_the_process_looks() -> None:
    # Another process may take the core: the loop is late while this one's CPU is low.
    capacity = Capacity(window=30)
    capacity.adjust(busy=0.2, lag_s=capacity.lag_high_s * 2, held=90, wanted_more=False)
    assert capacity.window == 27 and capacity.overloaded  # nine tenths of the window, if less


def test_the_window_never_falls_below_its_floor() -> None:
    capacity = Capacity(window=3, floor=2)
    for _ in range(5):
        capacity.adjust(busy=2.0, lag_s=60, held=3, wanted_more=True)
    assert capacity.window == 2


def test_the_window_grows_only_when_more_waited_and_there_is_room() -> None:
    capacity = Capacity(window=20)
    capacity.adjust(busy=0.2, lag_s=0.01, held=20, wanted_more=False)
    assert capacity.window == 20
    capacity.adjust(busy=0.2, lag_s=0.01, held=20, wanted_more=True)
    assert capacity.window == 25 and not capacity.overloaded  # a quarter more at most
    near = (capacity.busy_low + capacity.busy_high) / 2  # between the marks: hold
    capacity.adjust(busy=near, lag_s=0.01, held=25, wanted_more=True)
    assert capacity.window == 25 and not capacity.overloaded


def test_the_window_grows_toward_what_the_target_allows_at_the_measured_cost() -> None:
    capacity = Capacity(window=100)
    # 100 held at 68% of a core: at 80%, ~117 would fit.
    capacity.adjust(busy=0.68, lag_s=0.0, held=100, wanted_more=True)
    assert capacity.window == int(100 * capacity.busy_target / 0.68)


def test_the_window_never_grows_past_its_ceiling() -> None:
    capacity = Capacity(window=99, ceiling=100)
    for _ in range(5):
        capacity.adjust(busy=0.0, lag_s=0.0, held=99, wanted_more=True)
    assert capacity.window == 100


def test_new_episodes_are_admitted_up_to_the_window_and_its_own_always() -> None:
    slots = AdmittingWorkflowSlots(ceiling=100, capacity=Capacity(window=2))
    held = [0]
    slots.live = lambda: held[0]
    assert [slots.try_reserve_slot(NEW) is not None for _ in range(3)] == [True, True, False]
    assert all(slots.try_reserve_slot(OWN) is not None for _ in range(10))
    held[0] = 2
    slots.tick(lag_s=0.0, busy=0.1)  # two held, one waited: the window grows by one
    assert slots.capacity.window == 3
    assert [slots.try_reserve_slot(NEW) is not None for _ in range(2)] == [True, False]
    held[0] = 0  # the episodes ended
    slots.tick(lag_s=0.0, busy=0.1)
    assert sum(slots.try_reserve_slot(NEW) is not None for _ in range(10)) == slots.capacity.window


def test_its_own_episodes_find_a_slot_up_to_the_cache_whatever_the_load() -> None:
    slots = AdmittingWorkflowSlots(ceiling=3, capacity=Capacity(window=1))
    slots.tick(lag_s=5.0, busy=1.5)
    permits = [slots.try_reserve_slot(OWN) for _ in range(4)]
    assert [p is not None for p in permits] == [True, True, True, False]
    slots.release_slot(Used(permits[0]))
    assert slots.try_reserve_slot(OWN) is not None


def test_an_overloaded_worker_takes_no_new_episode_but_serves_its_own() -> None:
    slots = AdmittingWorkflowSlots(ceiling=100, capacity=Capacity(window=10))
    slots.tick(lag_s=5.0, busy=0.5)  # the loop ran 5 s late
    assert slots.capacity.overloaded
    assert slots.try_reserve_slot(NEW) is None  # the shared queue waits
    assert slots.try_reserve_slot(OWN) is not None  # its own episodes go on
    slots.tick(lag_s=0.0, busy=0.5)
    assert slots.try_reserve_slot(NEW) is not None


def test_an_overloaded_worker_starts_no_remote_activity() -> None:
    overloaded = [False]
    slots = AdmittingActivitySlots(limit=2, overloaded=lambda: overloaded[0])
    first = slots.try_reserve_slot(NEW)
    assert first is not None
    overloaded[0] = True
    assert slots.try_reserve_slot(NEW) is None  # waits on the server, where no clock runs
    overloaded[0] = False
    assert slots.try_reserve_slot(NEW) is not None and slots.try_reserve_slot(NEW) is None  # its limit
    slots.release_slot(Used(first))
    assert slots.try_reserve_slot(NEW) is not None


def test_busy_is_the_process_cpu_over_the_wall_time_since_the_last_look() -> None:
    slots = AdmittingWorkflowSlots(ceiling=10)
    slots.busy()
    end = time.monotonic() + 0.2
    while time.monotonic() < end:
        pass  # a core's worth of CPU for 0.2 s
    assert slots.busy() > 0.5
