"""Prometheus: DRLM_METRICS_ADDRESS serves the Temporal SDK's metrics and ours on one
endpoint, whatever DRLM_TRACING says; an address that cannot be served fails at start."""

from __future__ import annotations

import asyncio
import re
import socket
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from durable_rlm.errors import ConfigurationError
from durable_rlm.ports import free_port
from durable_rlm.scripted import root_and_sub
from durable_rlm.server.connection import connect
from durable_rlm.settings import Settings
from durable_rlm.telemetry.metrics_server import MetricsEndpoint, serve_metrics
from durable_rlm.telemetry.otel import configure
from durable_rlm.worker.runtime import running_workers
from tests.conftest import request_for, run_episode

SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<labels>\{.*\})?\s+(?P<value>\S+)")


pytestmark = pytest.mark.usefixtures("no_telemetry_left_behind")


@pytest.fixture
def endpoint() -> Iterator[MetricsEndpoint]:
    served = serve_metrics(f"127.0.0.1:{free_port()}")
    yield served
    served.close()


@dataclass(frozen=True)
class Sample:
    name: str
    labels: str
    value: float


def scrape(url: str) -> list[Sample]:
    # No proxy of the environment between a test and 127.0.0.1.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=5) as response:
        text = response.read().decode()
    return [
        Sample(m["name"], m["labels"] or "", float(m["value"]))
        for line in text.splitlines()
        if not line.startswith("#") and (m := SAMPLE.match(line))
    ]


def total(samples: list[Sample], name: str, *labels: str) -> float:
    return sum(s.value for s in samples if s.name == name and all(label in s.labels for label in labels))


async def scrape_until(url: str, ready, timeout_s: float = 5.0) -> list[Sample]:
    """The SDK records some metrics just after the client has its result."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = await asyncio.to_thread(scrape, url)
        if ready(samples) or time.monotonic() > deadline:
            return samples
        await asyncio.sleep(0.1)


async def test_one_endpoint_serves_the_sdk_metrics_and_ours_with_tracing_off(
    endpoint: MetricsEndpoint, temporal_address: str, session_dir: Path, scripted
) -> None:
    server = scripted(root_and_sub(["```repl\nr = llm_query('x')\n```", "FINAL_VAR(r)"], str.upper))
    # A second episode at once, on a worker with one sandbox: they take turns in it.
    other = scripted(root_and_sub(["```repl\nr = llm_query('y')\n```", "FINAL_VAR(r)"], str.upper))
    queue = f"metrics-{uuid.uuid4().hex[:6]}"
    settings = Settings(
        temporal_address=temporal_address,
        metrics_address=endpoint.requested,
        tracing="off",
        task_queue=queue,
        data_dir=session_dir,
        max_sandboxes=1,
    )
    async with connect(settings) as services, running_workers(services) as repl:
        result, _ = await asyncio.gather(
            run_episode(services.client, request_for(server), queue),
            run_episode(services.client, request_for(other), queue),
        )
        # The worker's sandboxes, as its sandbox pool counts them.
        worker = f'drlm_worker="{repl.worker_queue}"'
        sandboxes = await asyncio.to_thread(scrape, endpoint.url)
        slots = repl.slots
        expected = {
            "drlm_sandboxes_limit": 1,
            "drlm_sandboxes_live": slots.held(),
            "drlm_sandboxes_waiting": 0,
            "drlm_sandboxes_evictions_total": slots.evictions,
            "drlm_sandboxes_waits_total": slots.waits,
        }
        shown = {
            name: [s.value for s in sandboxes if s.name == name and worker in s.labels] for name in expected
        }
        assert shown == {name: [value] for name, value in expected.items()}
        assert slots.evictions >= 1  # the episodes took turns in the one sandbox
    on_queue = f'task_queue="{queue}"'

    samples = await scrape_until(
        endpoint.url, lambda s: total(s, "temporal_workflow_completed", on_queue) >= 2
    )

    calls = len(server.requests) + len(other.requests)
    assert total(samples, "temporal_workflow_completed", on_queue) == 2
    assert total(samples, "temporal_activity_execution_latency_count", on_queue) >= calls
    assert total(samples, "drlm_model_calls_total") == calls == 6
    assert total(samples, "drlm_model_calls_total", 'drlm_role="sub"') == 2
    assert total(samples, "drlm_episodes_total", 'drlm_status="answered"') == 2


@pytest.mark.parametrize(
    "address", ["localhost", "127.0.0.1:99999", "127.0.0.1:metrics", "http://127.0.0.1:9464", "a:1/metrics"]
)
def test_an_address_that_is_not_host_and_port_is_a_clear_error(address: str) -> None:
    with pytest.raises(ConfigurationError, match=r"DRLM_METRICS_ADDRESS=.* is not host:port"):
        configure("off", {}, metrics_address=address)


def test_an_address_in_use_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(ConfigurationError, match=r"DRLM_METRICS_ADDRESS=.*: .*in use"):
            configure("off", {}, metrics_address=address)


async def test_a_bad_address_fails_connecting_before_anything_starts(session_dir: Path) -> None:
    settings = Settings(temporal_address="127.0.0.1:1", metrics_address="nowhere", data_dir=session_dir)
    with pytest.raises(ConfigurationError, match="DRLM_METRICS_ADDRESS"):
        async with connect(settings):
            pass
