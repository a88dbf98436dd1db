"""Rolling out a new worker build while episodes are in flight (Worker Deployments).

Two builds of the worker poll one queue of one deployment; the old one is current when an
episode starts, the new one becomes current while that episode waits on its model. A
pinned episode ends on the build that started it; an auto-upgrading one (what the
`workflow.patched` rule makes safe) moves to the new build, whose worker rebuilds its REPL
from the log. Episodes started after the switch run on the new build only.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError

from durable_rlm.scripted import Reply, root_and_sub
from durable_rlm.server.connection import Services
from durable_rlm.server.deployment import Deployment, describe_deployment, set_current
from durable_rlm.settings import ConfigurationError, Settings
from durable_rlm.store.blobs import BlobStore
from durable_rlm.worker.runtime import running_workers
from durable_rlm.workflows import names
from durable_rlm.workflows.models import EpisodeResult
from tests.conftest import request_for

DRLM = str(Path(sys.executable).with_name("drlm"))


def turns(slow_s: float) -> list[Reply]:
    return [
        Reply(text="```repl\nv = llm_query('ping')\n```"),
        Reply(text="```repl\nw = v + '!'\n```", delay_s=slow_s),  # the switch happens here
        Reply(text="FINAL_VAR(w)"),
    ]


@contextlib.asynccontextmanager
async def build(
    client: Client,
    store: tuple[BlobStore, sa.Engine],
    data_dir: Path,
    queue: str,
    name: str,
    build_id: str,
    versioning: str,
) -> AsyncIterator[None]:
    settings = Settings(
        task_queue=queue, data_dir=data_dir, deployment_name=name, build_id=build_id, versioning=versioning
    )
    blobs, engine = store
    async with running_workers(Services(settings, blobs, engine, client)):
        # The deployment's first build makes itself current; a later one does not (its
        # worker polled, yet the old build stays current) until the operator says so.
        deployment = await registered(client, name, build_id)
        if build_id == "v1":
            for _ in range(50):
                if deployment.current == "v1":
                    break
                await asyncio.sleep(0.3)
                deployment = await registered(client, name, build_id)
            assert deployment.current == "v1"
        else:
            await asyncio.sleep(1.0)  # time enough for a wrong self-adoption
            assert (await registered(client, name, build_id)).current == "v1"
            await set_current(client, name, build_id)
        yield


async def registered(client: Client, name: str, build_id: str) -> Deployment:
    """The deployment once `build_id`'s worker has polled (the server's rate limit of
    deployment requests is waited out)."""
    for _ in range(100):
        try:
            deployment = await describe_deployment(client, name)
            if build_id in {b.build_id for b in deployment.builds}:
                return deployment
        except (ConfigurationError, RPCError):
            pass
        await asyncio.sleep(0.3)
    raise AssertionError(f"build {build_id} never polled")


async def builds_of(handle: WorkflowHandle) -> list[str]:
    """The build that completed each workflow task of the episode, in order."""
    history = await handle.fetch_history()
    return [
        e.workflow_task_completed_event_attributes.deployment_version.build_id
        for e in history.events
        if e.HasField("workflow_task_completed_event_attributes")
    ]


@pytest.mark.parametrize("versioning", ["pinned", "auto-upgrade"])
async def test_a_new_build_rolls_out_while_an_episode_is_in_flight(
    client: Client, store: tuple[BlobStore, sa.Engine], session_dir: Path, scripted, versioning: str
) -> None:
    name = f"drlm-{uuid.uuid4().hex[:8]}"
    queue = f"deploy-{uuid.uuid4().hex[:8]}"
    early, late = scripted(root_and_sub(turns(3.0), str.upper)), scripted(root_and_sub(turns(0), str.upper))

    def start(server, episode_id: str) -> asyncio.Future[WorkflowHandle]:
        return asyncio.ensure_future(
            client.start_workflow(
                names.WORKFLOW,
                request_for(server),
                id=episode_id,
                task_queue=queue,
                result_type=EpisodeResult,
            )
        )

    async with build(client, store, session_dir, queue, name, "v1", versioning):
        in_flight = await start(early, f"{name}-early")
        while len(early.root_requests()) < 2:  # it waits on its second model reply
            await asyncio.sleep(0.05)
        async with build(client, store, session_dir, queue, name, "v2", versioning):
            after = await start(late, f"{name}-late")
            first, second = await asyncio.wait_for(asyncio.gather(in_flight.result(), after.result()), 60)
            assert (first.answer, second.answer) == ("PING!", "PING!")
            deployment = await describe_deployment(client, name)

    early_builds, late_builds = await builds_of(in_flight), await builds_of(after)
    assert set(late_builds) == {"v2"}
    if versioning == "pinned":
        assert set(early_builds) == {"v1"}
    else:
        assert early_builds[0] == "v1" and early_builds[-1] == "v2"
    assert deployment.current == "v2"
    statuses = {b.build_id: b.status for b in deployment.builds}
    assert statuses["v2"] == "current" and statuses["v1"] in ("draining", "drained")
    assert "current build v2" in deployment.describe()


async def test_an_unknown_deployment_is_a_clear_error(client: Client) -> None:
    with pytest.raises(ConfigurationError, match="no worker with DRLM_DEPLOYMENT_NAME=nobody-here"):
        await describe_deployment(client, "nobody-here")


@pytest.mark.parametrize(
    ("env", "problem"),
    [
        ({"DRLM_DEPLOYMENT_NAME": "drlm"}, "go together"),
        ({"DRLM_BUILD_ID": "v1"}, "go together"),
        ({"DRLM_DEPLOYMENT_NAME": "drlm.prod", "DRLM_BUILD_ID": "v1"}, "has a dot"),
        (
            {"DRLM_DEPLOYMENT_NAME": "drlm", "DRLM_BUILD_ID": "v1", "DRLM_VERSIONING": "sometimes"},
            "DRLM_VERSIONING",
        ),
    ],
)
def test_bad_versioning_settings_name_the_setting(env: dict[str, str], problem: str) -> None:
    with pytest.raises(ConfigurationError, match=problem):
        Settings.from_env(env)


@pytest.mark.slow  # long end to end (the default run stays near 13 minutes); CI runs it
async def test_drlm_deployment_shows_the_builds_and_switches_them(
    client: Client,
    store: tuple[BlobStore, sa.Engine],
    session_dir: Path,
    temporal_address: str,
    tmp_path: Path,
) -> None:
    name = f"drlm-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DRLM_", "TEMPORAL_"))}
    env.update(TEMPORAL_ADDRESS=temporal_address, DRLM_DATA_DIR=str(tmp_path))

    def drlm(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [DRLM, "deployment", *args], env=env, capture_output=True, text=True, timeout=60
        )

    async with build(client, store, session_dir, f"deploy-{name}", name, "v1", "auto-upgrade"):
        shown = await asyncio.to_thread(drlm, "--name", name)
        assert shown.returncode == 0, shown.stderr
        assert f"deployment {name}: current build v1" in shown.stdout and "v1: current" in shown.stdout
        unknown = await asyncio.to_thread(drlm, "set-current", "v9", "--name", name)
        assert unknown.returncode == 2
        assert f"start a worker with DRLM_DEPLOYMENT_NAME={name} DRLM_BUILD_ID=v9 first" in unknown.stderr
        ramp = await asyncio.to_thread(drlm, "ramp", "v1", "--name", name)
        assert ramp.returncode == 2 and "needs a BUILD_ID and a PERCENT" in ramp.stderr
    nameless = await asyncio.to_thread(drlm)
    assert nameless.returncode == 2 and "give --name or set DRLM_DEPLOYMENT_NAME" in nameless.stderr
