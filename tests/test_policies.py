"""Termination policies in real episodes: each built-in ends at the expected step with the
expected answer; reward updates arrive while the episode runs; decisions survive crashes,
continue-as-new and replay."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
from temporalio.client import Client, WorkflowFailureError

from durable_rlm.audit.timeline import episode_timeline
from durable_rlm.client.episodes import send_reward, start_episode
from durable_rlm.scripted import Reply, root_and_sub
from durable_rlm.store.codec import data_converter
from durable_rlm.worker.runtime import EmbeddedServer
from durable_rlm.workflows import names
from durable_rlm.workflows.models import (
    EpisodeLimits,
    EpisodeResult,
    ModelSettings,
    RewardSpec,
    TerminationSpec,
)
from durable_rlm.workflows.termination import PolicyError
from tests.conftest import request_for, run_episode, workers_for

WORKING = "```repl\nprint('working')\n```"


def with_policy(server, name: str, config: dict | None = None, reward: str = "none", **kw):
    return request_for(
        server,
        termination=TerminationSpec(name=name, config=config or {}),
        reward=RewardSpec(function=reward),
        **kw,
    )


async def test_final_pattern_ends_on_the_final_answer(client, worker, scripted) -> None:
    server = scripted(root_and_sub(["```repl\nx = 6 * 7\n```", "FINAL(42)"]))
    result = await run_episode(client, with_policy(server, "final_pattern"), worker.task_queue)
    assert (result.answer, result.ended_by) == ("42", "final")
    assert result.termination.model_dump() == {
        "policy": "final_pattern",
        "step": 1,
        "reason": "final action",
        "answer": "42",
        "action_type": "final",
    }


PRINTS_FINAL_VAR = "```repl\ntotal = sum(range(100))\nprint(\"FINAL_VAR('total')\")\n```"


async def test_printed_final_var_does_not_end_the_episode_by_default(client, worker, scripted) -> None:
    server = scripted(root_and_sub([PRINTS_FINAL_VAR, "FINAL(the model's own)"]))
    result = await run_episode(client, with_policy(server, "final_pattern"), worker.task_queue)
    assert (result.answer, result.ended_by, result.iterations) == ("the model's own", "final", 2)


async def test_final_pattern_scans_printed_output_when_asked(client, worker, scripted) -> None:
    server = scripted(root_and_sub([PRINTS_FINAL_VAR]))
    request = with_policy(server, "final_pattern")
    request.termination.scan_printed_output = True
    result = await run_episode(client, request, worker.task_queue)
    assert (result.answer, result.ended_by, result.termination.step) == ("4950", "policy", 0)
    assert (result.answer_source, result.answer_policy, result.confidence) == (
        "policy",
        "final_pattern",
        None,
    )
    assert result.execution.variant.kind == "stopped"


async def test_reward_threshold_is_driven_by_updates_sent_while_it_runs(client, worker, scripted) -> None:
    gates = [threading.Event() for _ in range(4)]

    def gated(request):
        if request.is_root:
            gates[min(request.turn, 3)].wait(30)  # the model answers once the test has sent its reward
        return WORKING

    server = scripted(gated)
    handle = await start_episode(
        client, with_policy(server, "reward_threshold"), worker.task_queue, f"reward-{uuid.uuid4().hex[:6]}"
    )
    for turn, value in [(0, 0.4), (1, 0.5)]:
        while not any(r.turn == turn for r in server.root_requests()):
            await asyncio.sleep(0.05)
        receipt = await send_reward(client, handle.id, value, note=f"grader, turn {turn}")
        assert receipt.pending == pytest.approx(value)
        gates[turn].set()
    result = await asyncio.wait_for(handle.result(), 60)
    assert result.ended_by == "policy"
    # The policy's status message is why it stopped, not an answer the model gave.
    assert result.answer is None and result.answer_source == "none" and result.confidence is None
    assert result.stop_reason == "reward_threshold: Reward threshold reached: 0.90"
    assert result.execution.variant.kind == "stopped" and result.execution.confidence() is None
    assert result.termination.step == 1 and result.iterations == 2
    assert result.cumulative_reward == pytest.approx(0.9)
    with pytest.raises(Exception, match="completed|ended"):
        await send_reward(client, handle.id, 1.0)


async def test_reward_threshold_with_a_per_action_reward_function(client, worker, scripted) -> None:
    server = scripted(root_and_sub(["```repl\n1/0\n```"]))
    result = await run_episode(
        client, with_policy(server, "reward_threshold", reward="outcome"), worker.task_queue
    )
    assert result.termination.step == 2  # three errors, -0.5 each: the negative streak
    assert result.answer is None
    assert "3 consecutive negative rewards" in result.stop_reason
    assert result.cumulative_reward == pytest.approx(-1.5)


async def test_confidence_policy_ends_when_the_model_is_sure_after_min_steps(
    client, worker, scripted
) -> None:
    server = scripted(
        root_and_sub(
            [
                "```repl\nprint(1)\n```\nCONFIDENCE: 0.95",
                "```repl\nprint(2)\n```\nCONFIDENCE: 0.5",
                "```repl\nprint(42)\n```\nCONFIDENCE: 0.9",
            ]
        )
    )
    result = await run_episode(client, with_policy(server, "confidence"), worker.task_queue)
    # Confident, but what the cell printed is data: no answer unless the output is scanned.
    assert (result.answer, result.termination.step, result.ended_by) == (None, 2, "policy")
    assert result.stop_reason == "confidence: confidence 0.90 >= 0.85"
    scanning = with_policy(server, "confidence")
    scanning.termination.scan_printed_output = True
    result = await run_episode(client, scanning, worker.task_queue)
    assert (result.answer, result.answer_source, result.answer_policy) == ("42", "policy", "confidence")
    assert "CONFIDENCE:" in server.root_requests()[0].messages[0]["content"]  # the prompt asks for it


async def test_confidence_from_token_logprobs(client, worker, scripted) -> None:
    server = scripted(
        root_and_sub(
            [
                Reply(text="```repl\nprint(7)\n```", logprobs=[-2.0, -1.0]),
                Reply(text="```repl\nprint(8)\n```", logprobs=[-0.01, -0.02]),
            ]
        )
    )
    request = with_policy(server, "confidence", {"min_steps_before_termination": 0})
    request.root_model.logprobs = True
    request.termination.scan_printed_output = True
    result = await run_episode(client, request, worker.task_queue)
    assert (result.answer, result.termination.step) == ("8", 1)
    assert server.root_requests()[0].body["logprobs"] is True


async def test_composite_or_stops_on_whichever_signal_comes_first(client, worker, scripted) -> None:
    server = scripted(root_and_sub([WORKING]))
    request = with_policy(
        server,
        "composite",
        {
            "policies": [
                "final_pattern",
                {"name": "reward_threshold", "config": {"min_reward_threshold": 0.25}},
            ]
        },
        reward="outcome",
    )
    result = await run_episode(client, request, worker.task_queue)
    assert (result.termination.step, result.answer) == (2, None)
    assert result.stop_reason == "composite: reward_threshold: Reward threshold reached: 0.30"


async def test_composite_and_needs_every_policy(client, worker, scripted) -> None:
    server = scripted(
        root_and_sub(
            [
                "FINAL(early)\nCONFIDENCE: 0.3",
                "FINAL(still unsure)\nCONFIDENCE: 0.5",
                "FINAL(sure)\nCONFIDENCE: 0.9",
            ]
        )
    )
    request = with_policy(
        server,
        "composite",
        {
            "policies": [
                {
                    "name": "confidence",
                    "config": {"min_steps_before_termination": 0, "fallback_to_final_pattern": False},
                },
                "final_pattern",
            ],
            "require_all": True,
        },
    )
    result = await run_episode(client, request, worker.task_queue)
    assert (result.answer, result.termination.step, result.ended_by) == ("sure", 2, "final")
    assert "has not ended the episode" in server.root_requests()[1].last_user


async def test_a_bad_policy_is_rejected_before_any_model_call(client, worker, scripted) -> None:
    server = scripted(root_and_sub(["FINAL(x)"]))
    with pytest.raises(PolicyError, match="unknown config key 'threshold'"):
        await start_episode(client, with_policy(server, "confidence", {"threshold": 1}), worker.task_queue)
    # A client that skips validation still cannot get past the workflow's own check.
    with pytest.raises(WorkflowFailureError) as info:
        await client.execute_workflow(
            names.WORKFLOW,
            with_policy(server, "no_such_policy"),
            id=f"bad-{uuid.uuid4().hex[:6]}",
            task_queue=worker.task_queue,
            result_type=EpisodeResult,
        )
    assert "unknown termination policy 'no_such_policy'" in str(info.value.cause)
    assert server.requests == []


@pytest.mark.slow
async def test_a_reward_decision_survives_a_worker_crash(client, scripted, worker_processes) -> None:
    turns = [WORKING, WORKING, Reply(text=WORKING, delay_s=3), WORKING, WORKING]
    server = scripted(root_and_sub(turns))
    request = with_policy(server, "reward_threshold", {"min_reward_threshold": 0.45}, reward="outcome")
    first = worker_processes()
    handle = await start_episode(
        client, request, worker_processes.queue, f"crash-policy-{uuid.uuid4().hex[:6]}"
    )
    while not any(r.turn == 2 for r in server.root_requests()):
        await asyncio.sleep(0.05)
    first.kill()
    worker_processes()
    result = await asyncio.wait_for(handle.result(), 90)
    assert (result.termination.step, result.stop_reason) == (
        4,
        "reward_threshold: Reward threshold reached: 0.50",
    )


async def test_policy_state_crosses_continue_as_new(session_dir: Path, store, blobs, scripted) -> None:
    server = scripted(root_and_sub([WORKING]))
    args = ("--dynamic-config-value", "limit.historyCount.suggestContinueAsNew=20")
    request = with_policy(
        server,
        "reward_threshold",
        {"min_reward_threshold": 0.55},
        reward="outcome",
        limits=EpisodeLimits(max_iterations=20, cell_timeout_s=10),
    )
    async with EmbeddedServer(session_dir / "can-policy.sqlite", extra_args=args) as address:
        can_client = await Client.connect(address, data_converter=data_converter(blobs))
        async with workers_for(can_client, store, session_dir, "can-policy"):
            episode_id = f"can-policy-{uuid.uuid4().hex[:6]}"
            result = await run_episode(can_client, request, "can-policy", episode_id)
            timeline = await episode_timeline(can_client, episode_id)
    assert timeline.runs > 1
    assert (result.termination.step, result.stop_reason) == (
        5,
        "reward_threshold: Reward threshold reached: 0.60",
    )


@pytest.mark.slow  # long end to end (the default run stays near 13 minutes); CI runs it
def test_drlm_reward_reaches_a_running_embedded_episode(tmp_path: Path, scripted) -> None:
    gate = threading.Event()

    def waits_for_reward(request):
        if request.is_root and request.turn >= 1:
            gate.wait(60)
        return WORKING

    server = scripted(waits_for_reward)
    drlm = str(Path(sys.executable).with_name("drlm"))
    env = {"DRLM_DATA_DIR": str(tmp_path), "PATH": str(Path(sys.executable).parent)}
    episode_id = f"cli-reward-{uuid.uuid4().hex[:6]}"
    run = subprocess.Popen(
        [
            drlm,
            "run",
            "keep going",
            "--base-url",
            server.base_url,
            "--model",
            "m",
            "--id",
            episode_id,
            "--policy",
            "reward_threshold",
            "--json",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = 60
        while not any(r.turn >= 1 for r in server.root_requests()) and deadline > 0:
            threading.Event().wait(0.1)
            deadline -= 0.1
        sent = subprocess.run(
            [drlm, "reward", episode_id, "0.9", "--note", "looks right"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert sent.returncode == 0, sent.stderr
        assert "reward accepted" in sent.stdout
        gate.set()
        out, err = run.communicate(timeout=60)
    finally:
        gate.set()
        run.kill()
    result = json.loads(out)
    assert (result["ended_by"], result["termination"]["step"]) == ("policy", 1), err
    assert result["answer"] is None and run.returncode == 3  # stopped by the policy, no answer
    assert result["stop_reason"] == "reward_threshold: Reward threshold reached: 0.90"


def test_model_settings_keep_logprobs_opt_in() -> None:
    assert ModelSettings(model="m").logprobs is False


@pytest.mark.slow  # long end to end (the default run stays near 13 minutes); CI runs it
async def test_rewards_sent_while_it_runs_cross_continue_as_new(
    session_dir: Path, store, blobs, scripted
) -> None:
    gates = [threading.Event() for _ in range(8)]

    def gated(request):
        if request.is_root:
            gates[min(request.turn, 7)].wait(30)
        return WORKING

    server = scripted(gated)
    args = ("--dynamic-config-value", "limit.historyCount.suggestContinueAsNew=16")
    request = with_policy(server, "reward_threshold", {"min_reward_threshold": 1.5})
    async with EmbeddedServer(session_dir / "can-reward.sqlite", extra_args=args) as address:
        can_client = await Client.connect(address, data_converter=data_converter(blobs))
        async with workers_for(can_client, store, session_dir, "can-reward"):
            episode_id = f"can-reward-{uuid.uuid4().hex[:6]}"
            handle = await start_episode(can_client, request, "can-reward", episode_id)
            for turn in range(4):
                while not any(r.turn == turn for r in server.root_requests()):
                    await asyncio.sleep(0.05)
                await send_reward(can_client, episode_id, 0.4, note=f"turn {turn}")
                gates[turn].set()
            result = await asyncio.wait_for(handle.result(), 60)
            timeline = await episode_timeline(can_client, episode_id)
    assert timeline.runs > 1  # the rewards of the earlier runs were carried over
    assert result.termination.step == 3 and result.cumulative_reward == pytest.approx(1.6)
    assert result.stop_reason == "reward_threshold: Reward threshold reached: 1.60"


async def test_a_policy_that_raises_fails_the_episode_with_its_error(client, worker, scripted) -> None:
    from tests.policy_plugins import Raises  # noqa: F401 - registers "plugin_raises"

    server = scripted(root_and_sub([WORKING]))
    with pytest.raises(WorkflowFailureError) as info:
        await run_episode(client, with_policy(server, "plugin_raises"), worker.task_queue)
    cause = info.value.cause
    assert cause.type == names.POLICY_FAILURE and cause.non_retryable
    assert cause.message == "termination policy 'plugin_raises' raised RuntimeError: the plugin has a bug"
    assert len(server.root_requests()) == 1  # not retried: the same input would raise again
