"""Rolling out a new worker build with Temporal Worker Deployments.

Workers started with DRLM_DEPLOYMENT_NAME and DRLM_BUILD_ID register their build with the
server; the server sends new episodes to the deployment's current build and, by the
episodes' versioning behavior, moves those in flight to it (auto-upgrade) or keeps them on
the build that started them (pinned) until they end. `drlm deployment` shows the builds
and makes one current (or ramps it); this module is its client side.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from temporalio.api.enums.v1 import VersionDrainageStatus, WorkerDeploymentVersionStatus
from temporalio.api.workflowservice.v1 import (
    DescribeWorkerDeploymentRequest,
    SetWorkerDeploymentCurrentVersionRequest,
    SetWorkerDeploymentRampingVersionRequest,
)
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from durable_rlm.settings import ConfigurationError

IDENTITY = "drlm deployment"


@dataclass(frozen=True)
class Build:
    build_id: str
    status: str  # current, ramping, draining, drained, inactive
    drainage: str | None  # of a build no longer current: draining (episodes pinned to it) or drained


class DeploymentRefused(ConfigurationError):
    """The server refused a deployment request; `status` says why (NOT_FOUND: no worker of
    that deployment or build has polled yet)."""

    def __init__(self, message: str, status: RPCStatusCode | None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Deployment:
    name: str
    current: str | None
    ramping: str | None
    ramping_percent: float
    builds: tuple[Build, ...]
    conflict_token: bytes = b""  # what the server last said; a change made on it fails if stale

    def describe(self) -> str:
        lines = [f"deployment {self.name}: current build {self.current or '(none: unversioned workers)'}"]
        if self.ramping:
            lines.append(f"  ramping {self.ramping} to {self.ramping_percent:g}% of new episodes")
        for build in self.builds:
            drained = f", {build.drainage}" if build.drainage else ""
            lines.append(f"  {build.build_id}: {build.status}{drained}")
        return "\n".join(lines)


def _status(value: WorkerDeploymentVersionStatus.ValueType) -> str:
    return WorkerDeploymentVersionStatus.Name(value).removeprefix("WORKER_DEPLOYMENT_VERSION_STATUS_").lower()


def _drainage(value: VersionDrainageStatus.ValueType) -> str | None:
    name = VersionDrainageStatus.Name(value).removeprefix("VERSION_DRAINAGE_STATUS_").lower()
    return None if name == "unspecified" else name


async def describe_deployment(client: Client, name: str) -> Deployment:
    try:
        response = await client.workflow_service.describe_worker_deployment(
            DescribeWorkerDeploymentRequest(namespace=client.namespace, deployment_name=name)
        )
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            raise DeploymentRefused(
                f"no Worker Deployment {name!r} on the server: no worker with DRLM_DEPLOYMENT_NAME={name} "
                "has polled yet",
                exc.status,
            ) from None
        raise DeploymentRefused(f"deployment {name}: {exc.message}", exc.status) from None
    info = response.worker_deployment_info
    routing = info.routing_config
    builds = tuple(
        Build(
            build_id=summary.deployment_version.build_id,
            status=_status(summary.status),
            drainage=_drainage(summary.drainage_info.status or summary.drainage_status),
        )
        for summary in sorted(info.version_summaries, key=lambda s: s.create_time.ToDatetime())
    )
    return Deployment(
        name=name,
        current=routing.current_deployment_version.build_id or None,
        ramping=routing.ramping_deployment_version.build_id or None,
        ramping_percent=routing.ramping_version_percentage,
        builds=builds,
        conflict_token=response.conflict_token,
    )


async def set_current(client: Client, name: str, build_id: str, conflict_token: bytes = b"") -> str | None:
    """Make `build_id` the deployment's current build; returns the one it replaces. With a
    `conflict_token` (from `describe_deployment`), refused if anything changed since."""
    try:
        response = await client.workflow_service.set_worker_deployment_current_version(
            SetWorkerDeploymentCurrentVersionRequest(
                namespace=client.namespace,
                deployment_name=name,
                build_id=build_id,
                identity=IDENTITY,
                conflict_token=conflict_token,
            )
        )
    except RPCError as exc:
        raise _refused(name, build_id, exc) from None
    return response.previous_deployment_version.build_id or None


async def set_ramping(client: Client, name: str, build_id: str, percent: float) -> None:
    """Send `percent` of new episodes (and auto-upgrading ones) to `build_id`."""
    if not 0 <= percent <= 100:
        raise ConfigurationError(f"a ramp is a percentage from 0 to 100, not {percent:g}")
    try:
        await client.workflow_service.set_worker_deployment_ramping_version(
            SetWorkerDeploymentRampingVersionRequest(
                namespace=client.namespace,
                deployment_name=name,
                build_id=build_id,
                percentage=percent,
                identity=IDENTITY,
            )
        )
    except RPCError as exc:
        raise _refused(name, build_id, exc) from None


def _refused(name: str, build_id: str, exc: RPCError) -> DeploymentRefused:
    hint = ""
    if exc.status in (RPCStatusCode.NOT_FOUND, RPCStatusCode.FAILED_PRECONDITION):
        hint = f" (start a worker with DRLM_DEPLOYMENT_NAME={name} DRLM_BUILD_ID={build_id} first)"
    return DeploymentRefused(f"deployment {name}: build {build_id} refused: {exc.message}{hint}", exc.status)


# Worth asking again: not registered yet (the worker's first poll does it), the server's rate
# limit of deployment requests ("too many requests"), or another change came first.
_TRANSIENT = (
    RPCStatusCode.NOT_FOUND,
    RPCStatusCode.FAILED_PRECONDITION,
    RPCStatusCode.RESOURCE_EXHAUSTED,
    RPCStatusCode.ABORTED,
    RPCStatusCode.UNAVAILABLE,
)


async def adopt_if_unset(client: Client, name: str, build_id: str, wait_s: float = 30.0) -> bool:
    """A deployment's first build makes itself current: until some build is, the server routes
    no episode to any versioned worker. Only the first: not when a build is current or
    ramping, nor when other builds are registered (an operator is rolling out; a restart of
    this worker must not undo that). Later builds become current only when told (`drlm
    deployment set-current`). True if this build was made current."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    pause = 0.25
    while True:
        try:
            deployment = await describe_deployment(client, name)
            others = [b for b in deployment.builds if b.build_id != build_id]
            if deployment.current is not None or deployment.ramping is not None or others:
                return False
            if build_id not in {b.build_id for b in deployment.builds}:
                raise DeploymentRefused(f"build {build_id} not registered yet", RPCStatusCode.NOT_FOUND)
            # Refused if anything changed since the description (another first build won).
            await set_current(client, name, build_id, deployment.conflict_token)
            return True
        except DeploymentRefused as exc:
            if exc.status not in _TRANSIENT or loop.time() > deadline:
                raise
            await asyncio.sleep(pause)
            pause = min(2 * pause, 2.0)
