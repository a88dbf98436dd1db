"""Tracing: the spans of starting, running and each step of an episode reach the exporter."""

from __future__ import annotations

import uuid

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from temporalio.client import Client
from temporalio.contrib.opentelemetry import TracingInterceptor

from durable_rlm.codec import data_converter
from durable_rlm.scripted import root_and_sub
from durable_rlm.telemetry import client_interceptors
from tests.conftest import request_for, run_episode, workers_for


def test_tracing_is_off_by_default() -> None:
    assert client_interceptors("off") == []


def test_console_tracing_installs_the_temporal_interceptor() -> None:
    (interceptor,) = client_interceptors("console")
    assert isinstance(interceptor, TracingInterceptor)


def test_otlp_without_its_exporter_is_a_clear_error() -> None:
    try:
        import opentelemetry.exporter.otlp  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="opentelemetry-exporter-otlp"):
            client_interceptors("otlp")
    else:
        assert client_interceptors("otlp")


async def test_an_episode_emits_spans_for_its_start_its_run_and_each_step(
    temporal_address: str, blobs, store, session_dir, scripted
) -> None:
    exporter = InMemorySpanExporter()
    traced = await Client.connect(
        temporal_address,
        data_converter=data_converter(blobs),
        interceptors=client_interceptors("off", exporter),
    )
    server = scripted(root_and_sub(["```repl\nr = llm_query('x')\n```", "FINAL_VAR(r)"], str.upper))
    queue = f"traced-{uuid.uuid4().hex[:6]}"
    async with workers_for(traced, store, session_dir, queue):
        result = await run_episode(traced, request_for(server), queue)
    assert result.answer == "X"
    names = [span.name for span in exporter.get_finished_spans()]
    for expected in (
        "StartWorkflow:RlmEpisode",
        "RunWorkflow:RlmEpisode",
        "StartActivity:drlm.root_completion",
        "RunActivity:drlm.root_completion",
        "RunActivity:drlm.repl_execute",
        "RunActivity:drlm.sub_query",
        "RunActivity:drlm.repl_resume",
        "RunActivity:drlm.repl_read_variable",
        "CompleteWorkflow:RlmEpisode",
    ):
        assert expected in names, names
    assert names.count("RunActivity:drlm.root_completion") == 2
    (started,) = [s for s in exporter.get_finished_spans() if s.name == "StartWorkflow:RlmEpisode"]
    assert started.attributes["temporalWorkflowID"] == result.episode_id
