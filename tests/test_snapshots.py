"""REPL snapshots: a rebuild loads the latest snapshot and re-runs only the cells after it.

Driven at the activity level: a "crash" is a second worker (another ReplActivities, same
blob store and key) taking the episode over with no sandbox of its own.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from durable_rlm.activities.repl import ReplActivities
from durable_rlm.client.episodes import start_episode
from durable_rlm.scripted import root_and_sub
from durable_rlm.store import chains
from durable_rlm.store.blobs import BlobStore
from durable_rlm.store.snapshot_key import lineage_mac
from durable_rlm.workflows.models import EpisodeLimits, SnapshotPolicy
from tests.conftest import Episode, request_for, run_episode
from tests.test_recovery import FAST, sandbox_pids

KEY = b"k" * 32
EVERY_CELL = SnapshotPolicy(every_cells=1)
RARELY = SnapshotPolicy(every_cells=1000, after_s=1000, volatile=False)


@pytest.fixture
async def workers(
    blob_store: BlobStore, sandboxes: Path
) -> AsyncIterator[tuple[ReplActivities, ReplActivities]]:
    first = ReplActivities(blob_store, "queue-a", sandboxes / "a", memory_mb=1024, snapshot_key=KEY)
    second = ReplActivities(blob_store, "queue-b", sandboxes / "b", memory_mb=1024, snapshot_key=KEY)
    yield first, second
    await first.close_all()
    await second.close_all()


async def test_a_rebuild_loads_the_snapshot_and_reruns_only_later_cells(workers) -> None:
    first, second = workers
    episode = Episode(first, snapshots=SnapshotPolicy(every_cells=2, after_s=1000, volatile=False))
    await episode.run("runs = 0\ndef bump():\n    global runs\n    runs += 1\n    return runs")
    taken = await episode.run("bump()\nclass P:\n    def twice(self):\n        return 2 * runs\np = P()")
    assert taken.snapshot is not None and taken.snapshot.cell == 2
    await episode.run("bump()")  # after the snapshot: re-run by the rebuild
    episode.host = second
    outcome = await episode.run("print(runs, bump(), p.twice())")
    assert outcome.stdout == "2 3 6\n", outcome
    assert outcome.rebuild is not None
    assert (outcome.rebuild.from_snapshot, outcome.rebuild.cells_rerun) == (2, 1)
    assert outcome.rebuild.notes == []


async def test_a_restored_answer_keeps_its_items_and_is_not_an_answer_again(workers) -> None:
    """`answer` is saved as the cells left it (a turn of a session may read it), and what it
    holds after a restore is not taken for a new answer: only setting `ready` is."""
    first, second = workers
    episode = Episode(first, snapshots=EVERY_CELL)
    done = await episode.run("answer['content'] = 'first'\nanswer['ready'] = True\nkeep = answer")
    assert done.answer == "first" and done.snapshot is not None
    episode.host = second
    outcome = await episode.run("print(type(answer).__name__, answer, keep is answer)")
    assert outcome.rebuild is not None
    assert (outcome.rebuild.from_snapshot, outcome.rebuild.cells_rerun) == (1, 0)
    assert outcome.stdout == "AnswerDict {'content': 'first', 'ready': True} True\n"
    assert outcome.answer is None
    assert (await episode.run("answer['ready'] = 1")).answer == "first"


def test_the_answer_dict_pickles_by_reference_and_restores_without_answering() -> None:
    """A snapshot holds the dict's class by name and its items, nothing bound to a sandbox;
    loading it (or an older snapshot's plain dict) reports no answer."""
    import pickle

    from durable_rlm.activities.sandbox import answer

    made = answer.AnswerDict()
    made["content"] = "c"
    made["ready"] = True
    assert answer.end_cell({"answer": made}) == "c"
    data = pickle.dumps(made, protocol=5)
    assert b"AnswerDict" not in data and b"_rebuilt" in data  # a function of the module, by name
    answer.start_cell()
    loaded = pickle.loads(data)
    assert type(loaded) is answer.AnswerDict and loaded == {"content": "c", "ready": True}
    older = {"answer": {"content": "old", "ready": True}}
    answer.rewrap(older)
    assert type(older["answer"]) is answer.AnswerDict and older["answer"]["content"] == "old"
    assert answer.end_cell(older) is None and answer.end_cell({"answer": loaded}) is None


@pytest.mark.slow  # long end to end (issue 34: the default run near 13 min); CI runs it
async def test_a_crash_after_a_long_cell_does_not_run_it_again(workers) -> None:
    first, second = workers
    episode = Episode(first, cell_timeout_s=60, snapshots=SnapshotPolicy())
    slow = await episode.run("import time\ntime.sleep(20)\nfinished = 'yes'")
    assert slow.snapshot is not None  # the default policy: the cell ran past `after_s`
    episode.host = second
    began = time.monotonic()
    outcome = await episode.run("print(finished)")
    assert outcome.stdout == "yes\n"
    assert outcome.rebuild is not None
    assert (outcome.rebuild.from_snapshot, outcome.rebuild.cells_rerun) == (1, 0)
    assert time.monotonic() - began < 10  # the 20 s cell was not run again


async def test_clock_and_randomness_come_back_as_the_model_saw_them(workers) -> None:
    first, second = workers
    episode = Episode(first, snapshots=SnapshotPolicy())
    seen = await episode.run(
        "import time, random, uuid, datetime\n"
        "t = time.time(); r = random.random(); u = uuid.uuid4(); d = datetime.datetime.now()\n"
        "print(t, r, u, d)"
    )
    assert seen.snapshot is not None  # it read the clock: snapshotted right after
    later = await episode.run("b = random.random()\nprint(b)")
    assert later.snapshot is None  # quick and seeded: re-run by a rebuild, same draw
    episode.host = second
    outcome = await episode.run("print(t, r, u, d)\nprint(b)")
    assert outcome.stdout == seen.stdout + later.stdout
    assert outcome.rebuild is not None and outcome.rebuild.cells_rerun == 1


async def test_a_value_that_cannot_be_pickled_is_recreated_by_its_cell(workers) -> None:
    first, second = workers
    episode = Episode(first, snapshots=RARELY)
    await episode.run("count = 0")
    await episode.run(
        "count += 1\n"
        "numbers = (i * i for i in range(5))\n"
        "log = open('notes.txt', 'a')\n"
        "log.write('one\\n'); log.flush()\n"
        "def ask(q):\n    return llm_query(q)"
    )
    episode.snapshots = EVERY_CELL
    taken = await episode.run("count += 10")
    assert taken.snapshot is not None
    assert taken.snapshot.unsaved == ["log", "numbers"]
    episode.host = second
    outcome = await episode.run("print(count, next(numbers))\nlog.write('two\\n'); log.flush()")
    # `count` came from the snapshot (11): re-running cell 2 for the other names did not bump
    # it, and the file is as the snapshot had it before `log` appends to it.
    assert outcome.stdout == "11 0\n", outcome
    assert (await episode.run("print(open('notes.txt').read(), ask('hi'))")).stdout == "one\ntwo\n HI\n"
    assert outcome.rebuild is not None
    (note,) = outcome.rebuild.notes
    assert "`log` re-created by re-running cell 2" in note
    assert "`numbers` re-created by re-running cell 2" in note


async def test_files_the_cells_wrote_come_back_with_the_snapshot(workers) -> None:
    first, second = workers
    episode = Episode(first, snapshots=EVERY_CELL)
    await episode.run("open('data.csv', 'w').write('a,b\\n1,2\\n')")
    episode.host = second
    outcome = await episode.run("print(open('data.csv').read())")
    assert outcome.stdout == "a,b\n1,2\n\n"
    assert outcome.rebuild is not None and outcome.rebuild.cells_rerun == 0


async def test_a_snapshot_signed_with_another_key_is_refused_and_the_cells_rerun(
    blob_store: BlobStore, sandboxes: Path
) -> None:
    first = ReplActivities(blob_store, "queue-a", sandboxes / "a", snapshot_key=KEY)
    other = ReplActivities(blob_store, "queue-b", sandboxes / "b", snapshot_key=b"x" * 32)
    try:
        episode = Episode(first, snapshots=EVERY_CELL)
        await episode.run("import random\nr = random.random()")
        episode.host = other
        outcome = await episode.run("print(r)")
        assert outcome.error is None and outcome.rebuild is not None
        assert outcome.rebuild.from_snapshot is None and outcome.rebuild.cells_rerun == 1
        (note,) = outcome.rebuild.notes
        assert "integrity check failed" in note and "re-running every cell" in note
    finally:
        await first.close_all()
        await other.close_all()


async def test_a_tampered_snapshot_is_refused(workers, blob_store: BlobStore) -> None:
    first, second = workers
    episode = Episode(first, snapshots=EVERY_CELL)
    await episode.run("secret = 'mine'")
    mine = chains.read_cell_log(blob_store, episode.head).snapshot
    other = Episode(first, snapshots=EVERY_CELL)
    await other.run("secret = 'theirs'")
    theirs = chains.read_cell_log(blob_store, other.head).snapshot
    assert mine is not None and theirs is not None
    # Someone with write access to the store points this episode's log at another blob.
    forged = mine.model_copy(update={"ref": theirs.ref})
    episode.head = chains.append(blob_store, episode.head, forged)
    episode.host = second
    outcome = await episode.run("print(secret)")
    assert outcome.stdout == "mine\n"  # re-run from the cells, not the forged blob
    assert outcome.rebuild is not None and "integrity check failed" in outcome.rebuild.notes[0]


async def test_a_corrupted_snapshot_blob_is_refused(workers, blob_store: BlobStore) -> None:
    first, second = workers
    episode = Episode(first, snapshots=EVERY_CELL)
    await episode.run("value = 41 + 1")
    snapshot = chains.read_cell_log(blob_store, episode.head).snapshot
    assert snapshot is not None
    path = blob_store.backend._path(snapshot.ref)  # type: ignore[attr-defined]
    path.write_bytes(b"\x00" * 100)
    second.blobs = BlobStore(blob_store.backend)  # no cached copy
    episode.host = second
    outcome = await episode.run("print(value)")
    assert outcome.stdout == "42\n"
    assert outcome.rebuild is not None and "cannot be read" in outcome.rebuild.notes[0]


async def test_another_episodes_snapshot_is_refused_unless_it_is_an_ancestor(workers) -> None:
    first, second = workers
    parent = Episode(first, snapshots=EVERY_CELL)
    await parent.run("import time\nstamp = time.time()\nprint(stamp)")
    stamp = (await parent.run("print(stamp)")).stdout
    stranger = Episode(second, snapshots=EVERY_CELL)
    stranger.head, stranger.cells = parent.head, parent.cells
    refused = await stranger.run("print(stamp)")
    assert refused.rebuild is not None and "belongs to another episode" in refused.rebuild.notes[0]
    assert refused.stdout != stamp  # re-run: the clock was read again
    # A fork names its source in its lineage; the lineage counts only when `drlm fork`
    # signed it with the workers' key: a claimed one is refused like a stranger's.
    claimed = Episode(second, snapshots=EVERY_CELL)
    claimed.head, claimed.cells, claimed.lineage = parent.head, parent.cells, [parent.episode_id]
    claimed.lineage_mac = lineage_mac(b"another key" * 3, claimed.episode_id, claimed.lineage)
    refused = await claimed.run("print(stamp)")
    assert refused.rebuild is not None and "belongs to another episode" in refused.rebuild.notes[0]
    fork = Episode(second, snapshots=EVERY_CELL)
    fork.head, fork.cells, fork.lineage = parent.head, parent.cells, [parent.episode_id]
    fork.lineage_mac = lineage_mac(KEY, fork.episode_id, fork.lineage)
    forked = await fork.run("print(stamp)")
    assert forked.stdout == stamp and forked.rebuild is not None and forked.rebuild.notes == []


async def test_an_evicted_sandbox_comes_back_from_its_parked_snapshot(
    blob_store: BlobStore, sandboxes: Path
) -> None:
    host = ReplActivities(blob_store, "queue-a", sandboxes, snapshot_key=KEY)
    try:
        episode = Episode(host, snapshots=RARELY)
        await episode.run("import time\nstamp = time.time()\nprint(stamp)")
        before = await episode.run("print(stamp)")
        assert before.snapshot is None
        host.config.memory_budget_mb = 1  # now, so no step starts a pass of its own
        assert await host.enforce_memory_budget() == [episode.episode_id]
        assert host.live_episodes() == []
        outcome = await episode.run("print(stamp)")
        assert outcome.stdout == before.stdout  # restored, not re-run
        assert outcome.rebuild is not None and outcome.rebuild.cells_rerun == 0
    finally:
        await host.close_all()


async def test_a_value_that_refuses_to_pickle_costs_only_itself(workers) -> None:
    first, second = workers
    episode = Episode(first, snapshots=EVERY_CELL)
    taken = await episode.run(
        "class Sealed:\n    def __reduce__(self):\n        raise RuntimeError('sealed')\n"
        "sealed = Sealed()\nplain = [1, 2, 3]"
    )
    assert taken.error is None and taken.snapshot is not None
    assert taken.snapshot.unsaved == ["sealed"]
    episode.host = second
    outcome = await episode.run("print(type(sealed).__name__, plain)")
    assert outcome.stdout == "Sealed [1, 2, 3]\n"


async def test_a_snapshot_that_hangs_is_abandoned_and_the_cell_still_counts(
    workers, monkeypatch: pytest.MonkeyPatch
) -> None:
    from durable_rlm.workflows import defaults

    monkeypatch.setattr(defaults, "SNAPSHOT_TIMEOUT_S", 2.0)
    first, _ = workers
    episode = Episode(first, snapshots=EVERY_CELL)
    taken = await episode.run(
        "class Stuck:\n    def __reduce__(self):\n        while True: pass\nstuck = Stuck()\nn = 7"
    )
    assert taken.error is None and taken.snapshot is None
    assert first.live_episodes() == []  # discarded: its state after the snapshot attempt is unknown
    outcome = await episode.run("print(n)")
    assert outcome.stdout == "7\n" and outcome.rebuild is not None


@pytest.mark.chaos
@pytest.mark.slow  # 27 s; test_a_crash_after_a_long_cell_does_not_run_it_again keeps the kind by default
async def test_a_killed_worker_resumes_the_episode_without_rerunning_its_20_s_cell(
    client, scripted, worker_processes
) -> None:
    """End to end: the worker running the episode is killed after a 20 s cell; the next
    worker restores the REPL from the snapshot taken after it instead of re-running it."""
    turns = [
        "```repl\nimport time\nstarted = time.time()\ntime.sleep(20)\nslow = 'done'\n```",
        "```repl\nopen('cell2', 'w').close()\nimport time\ntime.sleep(3)\nprint(slow, started)\n```",
        "FINAL_VAR(started)",
    ]
    server = scripted(root_and_sub(turns))
    limits = EpisodeLimits(max_iterations=6, cell_timeout_s=40)
    first = worker_processes()
    handle = await start_episode(
        client,
        request_for(server, durability=FAST, limits=limits),
        worker_processes.queue,
        f"snap-{uuid.uuid4().hex[:6]}",
    )
    for _ in range(1200):  # cell 2 runs in the first worker's sandbox: cell 1 is over
        if any((Path(f"/proc/{pid}/cwd") / "cell2").exists() for pid in sandbox_pids(handle.id)):
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("cell 2 never started")
    first.kill()
    killed = time.monotonic()
    worker_processes()
    result = await asyncio.wait_for(handle.result(), 60)
    assert time.monotonic() - killed < 15  # re-running cell 1 alone would take 20 s
    assert result.lost_cells == 0
    observed = server.root_requests()[2].last_user
    assert f"done {result.answer}" in observed  # the clock value cell 1 read, not a new one
    assert "Cell 2" in observed


async def test_the_model_and_the_timeline_are_told_how_the_repl_came_back(client, worker, scripted) -> None:
    """A cell kills its sandbox; the next step restores the snapshot taken after cell 1 (it
    read the clock), re-creates the generator by re-running cell 1, and says so."""
    from durable_rlm.audit.timeline import episode_timeline, render

    turns = [
        "```repl\nimport time\nstamp = time.time()\nsquares = (i * i for i in range(3))\nprint(stamp)\n```",
        "```repl\nimport os\nos._exit(3)\n```",
        "```repl\nprint(stamp, next(squares))\n```",
        "FINAL_VAR(stamp)",
    ]
    server = scripted(root_and_sub(turns))
    result = await run_episode(client, request_for(server), worker.task_queue)
    observed = server.root_requests()[3].last_user
    assert f"{result.answer} 0" in observed  # the stamp cell 1 printed, and a fresh generator
    assert "`squares` re-created by re-running cell 1" in observed
    shown = render(await episode_timeline(client, result.episode_id))
    assert "snapshot after this cell" in shown and "re-created by re-running cells: squares" in shown
    assert "REPL rebuilt before it from the snapshot after cell 1: 1 cell(s) re-run" in shown


def test_a_costly_snapshot_is_retaken_only_when_the_cells_since_are_worth_it() -> None:
    from durable_rlm.activities.live_sandbox import LiveSandbox

    box = LiveSandbox("e", None, Path("."), None, None, policy=SnapshotPolicy())  # type: ignore[arg-type]
    assert not box.snapshot_due()  # no cell since
    box.since_cells, box.since_s = 1, 1.0
    assert box.snapshot_due()  # a second of cells: the default rule
    box.snapshot_cost_s = 3.0  # a big namespace: its last snapshot took 3 s
    box.since_cells, box.since_s = 20, 1.5
    assert not box.snapshot_due()  # 20 cells, but re-running them is cheaper than a snapshot
    box.since_s = 3.1
    assert box.snapshot_due()
    box.since_cells, box.since_s = 5, 5.0
    assert not box.snapshot_due()  # the time rule waits for twice the snapshot's cost
    box.since_s = 6.0
    assert box.snapshot_due()
    box.since_s, box.since_volatile = 0.0, True
    assert box.snapshot_due()  # a cell read the clock: regardless of cost
    box.since_volatile, box.policy = False, SnapshotPolicy(every_cells=1)
    assert box.snapshot_due()  # "every cell" is every cell
