"""Time travel (2): `drlm rerun` re-executes recorded episodes with the current code,
every model call answered from the recording, on the real dev server. Nothing is paid
(the scripted servers that made the recordings see no call) and the sources are
untouched; a stricter policy shows which episodes would now end differently."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from durable_rlm.client.episodes import start_episode, store_context
from durable_rlm.scripted import Reply, root_and_sub
from durable_rlm.settings import Settings
from durable_rlm.timetravel.rerun import PolicyChange, RerunError, rerun_episodes
from durable_rlm.worker.runtime import Services
from tests.conftest import request_for, run_episode
from tests.test_recursion import SUM_CHILD, by_model, tree_request
from tests.test_steering import Cli

EPISODES = {
    "one-step": ["```repl\nx = 20 + 1\n```\nFINAL_VAR(x)"],
    "two-steps": ["```repl\nwords = context.split()\nprint(len(words))\n```", "FINAL(3 words)"],
    "four-steps": [
        "```repl\na = 6\n```",
        "```repl\nb = llm_query('double 6')\nprint(b)\n```",
        "```repl\nc = int(b) + a\nprint(c)\n```",
        "FINAL_VAR(c)",
    ],
}
STRICTER = PolicyChange("confidence", {"min_steps_before_termination": 3})


async def _recorded(client, scripted, worker, blobs) -> tuple[list[str], list[Any]]:
    ids, servers = [], []
    for name, turns in EPISODES.items():
        server = scripted(root_and_sub(turns, lambda prompt: "12"))
        episode_id = f"rec-{name}-{uuid.uuid4().hex[:6]}"
        context = store_context(blobs, "three little words")
        await run_episode(client, request_for(server, context=context), worker.task_queue, episode_id)
        ids.append(episode_id)
        servers.append(server)
    return ids, servers


@pytest.fixture
def services(client, store, session_dir: Path) -> Services:
    """What a re-run needs: it runs its own worker, on a task queue of its own."""
    return Services(Settings(task_queue="unused", data_dir=session_dir), store[0], store[1], client)


async def _events(client, episode_id: str) -> int:
    return len((await client.get_workflow_handle(episode_id).fetch_history()).events)


@pytest.mark.slow  # long end to end (the default run stays near 13 minutes); CI runs it
async def test_rerun_with_the_same_policy_and_with_a_stricter_one(
    client, scripted, worker, blobs, services
) -> None:
    ids, servers = await _recorded(client, scripted, worker, blobs)
    calls = [len(s.requests) for s in servers]
    events = [await _events(client, i) for i in ids]

    same = await rerun_episodes(services, ids)
    assert [r.verdict for r in same] == ["same"] * 3
    assert [r.answer for r in same] == ["21", "3 words", "18"]
    assert [r.calls_answered for r in same] == [1, 2, 5]  # the four-step one made a sub-call
    assert all(r.prompt_changed_at is None for r in same)  # every prompt matched its digest

    stricter = await rerun_episodes(services, ids, STRICTER)
    assert [(r.verdict, r.diverged_at) for r in stricter] == [
        ("diverged", 2),
        ("diverged", 3),
        ("same", None),
    ]
    assert stricter[0].detail.startswith(
        f"diverged at iteration 2: the new code asked for root call 2 of {ids[0]}, "
        "which the recording does not have"
    )
    # The confidence policy asks the model for a confidence: the prompts changed, and say so.
    assert all(r.prompt_changed_at == 1 for r in stricter)

    # Nothing was paid and nothing was written to the sources.
    assert [len(s.requests) for s in servers] == calls
    assert [await _events(client, i) for i in ids] == events


async def test_a_policy_that_reads_printed_output_changes_an_answer(
    client, scripted, worker, blobs, services
) -> None:
    server = scripted(root_and_sub(["```repl\nprint('FINAL(early)')\n```", "FINAL(late)"]))
    source_id = f"rec-printed-{uuid.uuid4().hex[:6]}"
    await run_episode(client, request_for(server), worker.task_queue, source_id)
    (report,) = await rerun_episodes(services, [source_id], PolicyChange(scan_printed_output=True))
    assert report.verdict == "different" and (report.source_answer, report.answer) == ("late", "early")
    assert report.detail.startswith("different answer: 'early'")


async def test_a_tree_of_episodes_reruns_from_its_children_s_recordings(
    client, scripted, worker, blobs, services
) -> None:
    server = scripted(
        by_model(
            {
                "root-m": [
                    "```repl\nparts = ['1,2', '3,4,5']\nanswers = rlm_query_batched(parts, model='child-m')\n"
                    "grand = sum(int(a) for a in answers)\n```",
                    "FINAL_VAR(grand)",
                ],
                "child-m": SUM_CHILD,
            }
        )
    )
    source_id = f"rec-tree-{uuid.uuid4().hex[:6]}"
    await run_episode(
        client, tree_request(server, "add", ["child-m"], max_depth=2), worker.task_queue, source_id
    )
    calls = len(server.requests)
    (report,) = await rerun_episodes(services, [source_id])
    assert report.verdict == "same" and report.answer == "15", report.detail
    assert report.calls_answered == 6 and len(server.requests) == calls
    # A child re-runs alone: no parent, and its own max_duration, not its parent's old deadline.
    (child,) = await rerun_episodes(services, [f"{source_id}/1.1"])
    assert child.verdict == "same" and child.prompt_changed_at is None, child.detail
    assert child.answer == child.source_answer and child.answer in ("3", "12")


async def test_a_rerun_draws_the_random_numbers_the_source_drew(client, scripted, worker, services) -> None:
    rolls = "```repl\nimport random\nroll = random.randint(1, 10**9)\nprint(roll)\n```"
    server = scripted(root_and_sub([rolls, "FINAL_VAR(roll)"]))
    source_id = f"rec-random-{uuid.uuid4().hex[:6]}"
    source = await run_episode(client, request_for(server), worker.task_queue, source_id)  # a drawn seed
    (report,) = await rerun_episodes(services, [source_id])
    # The printed roll is in the second prompt: its digest matches only with the same seed.
    assert (report.verdict, report.answer, report.prompt_changed_at) == ("same", source.answer, None)


async def test_what_cannot_be_rerun_is_refused_before_anything_runs(
    client, scripted, worker, blobs, services
) -> None:
    ids, _ = await _recorded(client, scripted, worker, blobs)
    slow = scripted(root_and_sub([Reply(text="thinking", delay_s=30)]))
    running = f"rec-running-{uuid.uuid4().hex[:6]}"
    await start_episode(client, request_for(slow), worker.task_queue, running)
    cases = [
        ([ids[0], "no-such-episode"], None, "cannot rerun 'no-such-episode': no episode with that id"),
        ([running], None, f"cannot rerun {running!r}: it is still running"),
        ([ids[0]], PolicyChange("no_such_policy"), f"invalid rerun of {ids[0]!r}: "),
        ([], None, "rerun needs at least one episode id"),
    ]
    for sources, change, message in cases:
        with pytest.raises(RerunError) as caught:
            await rerun_episodes(services, sources, change)
        assert message in str(caught.value)
    started = [e async for e in client.list_workflows(f'WorkflowId STARTS_WITH "rerun-{ids[0]}"')]
    assert started == []
    await client.get_workflow_handle(running).terminate("test over")


@pytest.mark.slow  # long end to end (the default run stays near 13 minutes); CI runs it
async def test_the_command_line_reruns_and_exits_1_when_an_ending_changes(
    client, scripted, worker, blobs, tmp_path: Path, temporal_address: str, session_dir: Path
) -> None:
    ids, servers = await _recorded(client, scripted, worker, blobs)
    drlm = Cli(tmp_path, temporal_address, session_dir)
    drlm.env["DRLM_TASK_QUEUE"] = worker.task_queue
    code, out, err = await drlm("rerun", *ids)
    assert code == 0, err
    assert "3 of 3 end as recorded" in out and out.count("same") >= 3
    code, out, err = await drlm(
        "rerun",
        *ids,
        "--policy",
        "confidence",
        "--policy-config",
        '{"min_steps_before_termination": 3}',
        "--json",
    )
    assert code == 1, err
    reports = [json.loads(line) for line in out.splitlines()]
    assert [(r["verdict"], r["diverged_at"]) for r in reports] == [
        ("diverged", 2),
        ("diverged", 3),
        ("same", None),
    ]
    code, out, err = await drlm("rerun", "no-such-episode")
    assert code == 2 and "cannot rerun 'no-such-episode': no episode with that id" in err
