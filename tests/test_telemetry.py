"""Telemetry: spans of starting, running and each step of an episode, a GenAI span per model
call, a span per REPL step, metrics, exporters chosen by the standard variables, and
nothing emitted twice when a new worker replays an episode."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
import types
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from temporalio.client import Client
from temporalio.contrib.opentelemetry import TracingInterceptor
from temporalio.testing import ActivityEnvironment
from temporalio.worker import ActivityInboundInterceptor, ExecuteActivityInput

from durable_rlm.errors import ConfigurationError
from durable_rlm.scripted import root_and_sub
from durable_rlm.store.codec import data_converter
from durable_rlm.telemetry import otel as telemetry
from durable_rlm.telemetry.otel import (
    Telemetry,
    client_interceptors,
    configure,
    worker_interceptors,
)
from durable_rlm.telemetry.step_telemetry import StepTelemetry
from durable_rlm.workflows import names
from durable_rlm.workflows.models import (
    EpisodeResult,
    ModelSettings,
    SubQueryInput,
    SubQueryReply,
    TokenUsage,
)
from tests.conftest import request_for, run_episode, workers_for

pytestmark = pytest.mark.usefixtures("no_telemetry_left_behind")


@dataclasses.dataclass
class Traced:
    client: Client
    spans: InMemorySpanExporter
    metrics: InMemoryMetricReader

    async def episode(self, server: Any, store: Any, session_dir: Any) -> EpisodeResult:
        """One episode through this client, on workers of a queue of its own."""
        queue = f"traced-{uuid.uuid4().hex[:6]}"
        async with workers_for(self.client, store, session_dir, queue):
            return await run_episode(self.client, request_for(server), queue)

    def finished(self) -> list[ReadableSpan]:
        return list(self.spans.get_finished_spans())

    def chats(self) -> list[ReadableSpan]:
        return [s for s in self.finished() if s.name.startswith("chat ")]

    def points(self, name: str) -> list[Any]:
        data = self.metrics.get_metrics_data()
        return [
            point
            for resource in (data.resource_metrics if data else [])
            for scope in resource.scope_metrics
            for metric in scope.metrics
            if metric.name == name
            for point in metric.data.data_points
        ]


@pytest.fixture
async def traced(temporal_address: str, blobs) -> Traced:
    spans, reader = InMemorySpanExporter(), InMemoryMetricReader()
    client = await Client.connect(
        temporal_address,
        data_converter=data_converter(blobs),
        interceptors=client_interceptors("off", spans, metric_reader=reader, environ={}),
    )
    return Traced(client, spans, reader)


def ancestors(span: ReadableSpan, spans: list[ReadableSpan]) -> list[str]:
    by_id = {s.context.span_id: s for s in spans}
    chain = []
    while span.parent is not None and span.parent.span_id in by_id:
        span = by_id[span.parent.span_id]
        chain.append(span.name)
    return chain


def prompt_tokens(request) -> int:
    """What the scripted server reports as a request's prompt tokens."""
    return sum(len(str(m.get("content", ""))) for m in request.messages) // 4


# --- choosing exporters ---------------------------------------------------------------------


def test_tracing_is_off_by_default() -> None:
    assert client_interceptors("off", environ={}) == []
    assert worker_interceptors() == []
    assert not telemetry.current().enabled


def test_console_tracing_installs_the_temporal_interceptor() -> None:
    (interceptor,) = client_interceptors("console", environ={})
    assert isinstance(interceptor, TracingInterceptor)
    assert telemetry.current().meter_provider is not None  # DRLM_TRACING picks both signals
    assert [type(i) for i in worker_interceptors()] == [StepTelemetry]


def test_otlp_without_its_exporter_is_a_clear_error() -> None:
    try:
        import opentelemetry.exporter.otlp.proto.grpc  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="opentelemetry-exporter-otlp"):
            client_interceptors("otlp", environ={})
    else:
        assert client_interceptors("otlp", environ={})


def test_the_standard_variables_choose_per_signal_over_drlm_tracing() -> None:
    env = {"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "console"}
    assert client_interceptors("console", environ=env) == []
    assert telemetry.current().tracer_provider is None
    assert telemetry.current().meter_provider is not None


def test_otel_traces_exporter_alone_turns_tracing_on() -> None:
    (interceptor,) = client_interceptors("off", environ={"OTEL_TRACES_EXPORTER": "console"})
    assert isinstance(interceptor, TracingInterceptor)
    assert telemetry.current().meter_provider is None


def test_the_sdk_disabled_variable_turns_everything_off() -> None:
    assert client_interceptors("console", environ={"OTEL_SDK_DISABLED": "true"}) == []
    assert worker_interceptors() == []


@pytest.mark.parametrize(
    ("variable", "value"), [("OTEL_TRACES_EXPORTER", "jaeger"), ("OTEL_METRICS_EXPORTER", "prometheus")]
)
def test_an_unknown_exporter_is_a_configuration_error_naming_the_variable(variable: str, value: str) -> None:
    with pytest.raises(ConfigurationError, match=variable):
        configure("off", {variable: value})


def test_otlp_over_http_uses_the_http_exporters(monkeypatch: pytest.MonkeyPatch) -> None:
    for module, name, cls in (
        ("trace_exporter", "OTLPSpanExporter", InMemorySpanExporter),
        ("metric_exporter", "OTLPMetricExporter", ConsoleMetricExporter),
    ):
        fake = types.ModuleType(f"opentelemetry.exporter.otlp.proto.http.{module}")
        setattr(fake, name, type(name, (cls,), {}))
        monkeypatch.setitem(sys.modules, fake.__name__, fake)
    chosen = configure("otlp", {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    (processor,) = chosen.tracer_provider._active_span_processor._span_processors  # type: ignore[union-attr]
    assert type(processor.span_exporter).__name__ == "OTLPSpanExporter"
    assert chosen.meter_provider is not None


def test_an_unknown_otlp_protocol_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="http/json"):
        configure("otlp", {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


def test_the_same_settings_keep_the_same_providers() -> None:
    first = configure("console", {})
    assert configure("console", {}) is first


# --- best effort ----------------------------------------------------------------------------


class _Answers(ActivityInboundInterceptor):
    def __init__(self, result: Any) -> None:
        self.result = result

    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        return self.result


class _Broken:
    """A tracer or an instrument that fails whatever it is asked."""

    def __getattr__(self, name: str) -> Any:
        def fail(*args: object, **kwargs: object) -> None:
            raise RuntimeError("collector on fire")

        return fail


def sub_query_env() -> ActivityEnvironment:
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, activity_type=names.SUB_QUERY, workflow_id="ep-1")
    return env


SUB_QUERY = SubQueryInput(
    episode_id="ep-1", iteration=2, cell_index=1, call_index=0, model=ModelSettings(model="m"), prompt="p"
)


async def call_through(interceptor: StepTelemetry, result: Any) -> Any:
    inbound = interceptor.intercept_activity(_Answers(result))
    run = ExecuteActivityInput(fn=lambda: None, args=[SUB_QUERY], executor=None, headers={})
    return await sub_query_env().run(inbound.execute_activity, run)


@pytest.mark.parametrize("broken", ["tracer", "instruments"])
async def test_a_telemetry_failure_never_fails_the_activity(broken: str) -> None:
    interceptor = StepTelemetry(Telemetry())
    if broken == "tracer":
        interceptor.tracer = _Broken()  # type: ignore[assignment]
    else:
        interceptor.instruments.model_calls = _Broken()  # type: ignore[assignment]
    reply = SubQueryReply(text="ok", usage=TokenUsage(prompt_tokens=1, completion_tokens=1), model_time_s=0.1)
    assert await call_through(interceptor, reply) is reply


async def test_a_result_of_an_unexpected_shape_is_passed_on_untouched() -> None:
    interceptor = StepTelemetry(configure("off", {}, span_exporter=InMemorySpanExporter()))
    assert await call_through(interceptor, "not a reply at all") == "not a reply at all"


async def test_a_priced_call_records_its_cost() -> None:
    spans, reader = InMemorySpanExporter(), InMemoryMetricReader()
    interceptor = StepTelemetry(configure("off", {}, span_exporter=spans, metric_reader=reader))
    usage = TokenUsage(prompt_tokens=100, completion_tokens=20, cost_usd=0.0025)
    await call_through(interceptor, SubQueryReply(text="ok", usage=usage, model_time_s=0.1))
    (span,) = spans.get_finished_spans()
    assert (span.name, span.attributes["drlm.cost_usd"]) == ("chat m", 0.0025)
    (point,) = Traced(None, spans, reader).points("drlm.model.cost")  # type: ignore[arg-type]
    assert point.value == 0.0025


# --- episodes -------------------------------------------------------------------------------


async def test_an_episode_emits_spans_for_its_start_its_run_and_each_step(
    traced: Traced, store, session_dir, scripted
) -> None:
    server = scripted(root_and_sub(["```repl\nr = llm_query('x')\n```", "FINAL_VAR(r)"], str.upper))
    result = await traced.episode(server, store, session_dir)
    assert result.answer == "X"
    names_seen = [span.name for span in traced.finished()]
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
        assert expected in names_seen, names_seen
    assert names_seen.count("RunActivity:drlm.root_completion") == 2
    (started,) = [s for s in traced.finished() if s.name == "StartWorkflow:RlmEpisode"]
    assert started.attributes["temporalWorkflowID"] == result.episode_id


async def test_each_model_call_is_a_genai_chat_span_under_its_activity(
    traced: Traced, store, session_dir, scripted
) -> None:
    server = scripted(root_and_sub(["```repl\nr = llm_query('x')\n```", "FINAL_VAR(r)"], str.upper))
    result = await traced.episode(server, store, session_dir)
    spans, chats = traced.finished(), traced.chats()
    assert sorted(s.attributes["drlm.role"] for s in chats) == ["root", "root", "sub"]
    for chat in chats:
        assert chat.name == "chat scripted"
        assert chat.attributes["gen_ai.operation.name"] == "chat"
        assert chat.attributes["gen_ai.provider.name"] == "openai"
        assert chat.attributes["gen_ai.request.model"] == "scripted"
        # What the provider said of its reply (the scripted server answers as an OpenAI one).
        assert chat.attributes["gen_ai.response.model"] == "scripted"
        assert chat.attributes["gen_ai.response.id"].startswith("chatcmpl-scripted-")
        assert tuple(chat.attributes["gen_ai.response.finish_reasons"]) == ("stop",)
        assert chat.attributes["drlm.episode_id"] == result.episode_id
        activity = "drlm.root_completion" if chat.attributes["drlm.role"] == "root" else "drlm.sub_query"
        # Temporal's interceptor parents a workflow's activities on its start, as it does RunWorkflow.
        assert ancestors(chat, spans) == [
            f"RunActivity:{activity}",
            f"StartActivity:{activity}",
            "StartWorkflow:RlmEpisode",
        ]
    assert len({chat.context.trace_id for chat in chats}) == 1
    roots = sorted((s for s in chats if s.attributes["drlm.role"] == "root"), key=lambda s: s.start_time)
    assert [s.attributes["drlm.iteration"] for s in roots] == [1, 2]
    # Tokens are what the server reported, call by call and in sum.
    assert sorted(s.attributes["gen_ai.usage.input_tokens"] for s in chats) == sorted(
        prompt_tokens(r) for r in server.requests
    )
    assert sum(s.attributes["gen_ai.usage.input_tokens"] for s in chats) == result.usage.prompt_tokens
    assert sum(s.attributes["gen_ai.usage.output_tokens"] for s in chats) == result.usage.completion_tokens


async def test_each_repl_step_is_a_span_with_its_cell_status_and_error(
    traced: Traced, store, session_dir, scripted
) -> None:
    turns = ["```repl\nr = llm_query('x')\n```", "```repl\n1 / 0\n```", "FINAL_VAR(r)"]
    server = scripted(root_and_sub(turns, str.upper))
    result = await traced.episode(server, store, session_dir)
    assert result.answer == "X"
    spans = traced.finished()
    steps = sorted((s for s in spans if s.name.startswith("repl ")), key=lambda s: s.start_time)
    seen = [(s.name, s.attributes["drlm.cell_index"], s.attributes["drlm.cell.status"]) for s in steps]
    assert seen == [
        ("repl execute", 1, "suspended"),
        ("repl resume", 1, "completed"),
        ("repl execute", 2, "completed"),
    ]
    assert "drlm.cell.error" not in steps[0].attributes
    assert "ZeroDivisionError" in steps[2].attributes["drlm.cell.error"]
    assert steps[0].attributes["drlm.cell.sub_calls"] == 1
    assert all(s.attributes["drlm.episode_id"] == result.episode_id for s in steps)
    assert all(ancestors(s, spans)[0].startswith("RunActivity:drlm.repl_") for s in steps)


async def test_metrics_count_calls_tokens_and_the_episode_outcome(
    traced: Traced, store, session_dir, scripted
) -> None:
    server = scripted(root_and_sub(["```repl\nr = llm_query('x')\n```", "FINAL_VAR(r)"], str.upper))
    queue = f"metered-{uuid.uuid4().hex[:6]}"
    async with workers_for(traced.client, store, session_dir, queue):
        result = await run_episode(traced.client, request_for(server), queue)
    calls = {p.attributes["drlm.role"]: p.value for p in traced.points("drlm.model.calls")}
    assert calls == {"root": 2, "sub": 1}
    tokens = {}
    for point in traced.points("gen_ai.client.token.usage"):
        direction = point.attributes["gen_ai.token.type"]
        tokens[direction] = tokens.get(direction, 0) + point.sum
    assert tokens == {"input": result.usage.prompt_tokens, "output": result.usage.completion_tokens}
    assert not traced.points("drlm.model.cost")  # the scripted model has no price
    (ended,) = traced.points("drlm.episodes")
    assert (ended.value, dict(ended.attributes)) == (
        1,
        {"drlm.status": "answered", "drlm.ended_by": result.ended_by},
    )
    (iterations,) = traced.points("drlm.episode.iterations")
    assert (iterations.count, iterations.sum) == (1, result.iterations)
    cells = traced.points("drlm.cell.duration")
    assert sum(p.count for p in cells) == 2 and all(p.sum > 0 for p in cells)


async def wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


@pytest.mark.slow  # long end to end (issue 34: the default run near 13 min); CI runs it
async def test_a_new_worker_finishing_an_episode_emits_one_chat_span_per_model_call(
    traced: Traced, store, session_dir, scripted
) -> None:
    turns = [
        "```repl\nr = llm_query('x')\n```",
        "```repl\nimport time\ntime.sleep(3)\n```",
        "```repl\ns = r + '!'\n```",
        "FINAL_VAR(s)",
    ]
    server = scripted(root_and_sub(turns, str.upper))
    queue = f"replayed-{uuid.uuid4().hex[:6]}"
    handle = await traced.client.start_workflow(
        names.WORKFLOW,
        request_for(server),
        id=f"replayed-{uuid.uuid4().hex[:6]}",
        task_queue=queue,
        result_type=EpisodeResult,
        task_timeout=timedelta(seconds=2),  # a stopped worker's task is handed on quickly
    )
    async with workers_for(traced.client, store, session_dir, queue):
        await wait_until(lambda: len(server.root_requests()) == 2 and server.completed == 3)
        await asyncio.sleep(1)  # the first worker stops while cell 2 sleeps (it lets the cell end)
    assert len(server.root_requests()) == 2
    async with workers_for(traced.client, store, session_dir, queue):
        result = await asyncio.wait_for(handle.result(), 90)
    assert result.answer == "X!"
    (cell_three,) = [
        s for s in traced.finished() if s.name == "repl execute" and s.attributes["drlm.cell_index"] == 3
    ]
    assert cell_three.attributes["drlm.cell.rebuilt"], "the episode went on in a new worker's sandbox"
    # The new worker replayed the history up to there: no second span for the calls it holds.
    chats = traced.chats()
    assert len(chats) == len(server.requests) == 5
    calls = sorted((s.attributes["drlm.role"], s.attributes["drlm.iteration"]) for s in chats)
    assert calls == [("root", 1), ("root", 2), ("root", 3), ("root", 4), ("sub", 1)]
    assert all(s.status.status_code is not StatusCode.ERROR for s in chats)
    assert sum(s.attributes["gen_ai.usage.input_tokens"] for s in chats) == result.usage.prompt_tokens


def test_a_short_drlm_run_exports_its_spans_and_metrics_before_it_exits(tmp_path: Path, scripted) -> None:
    """`drlm run` leaves by os._exit (sdk-python#300), which skips the providers' exit hook:
    it used to export 4 of ~52 spans and no metric. Now every chat span and the episode's
    metrics reach the exporter (the console one, which a command points at stderr)."""
    from tests.test_cli import drlm

    server = scripted(root_and_sub(["```repl\nr = llm_query('x')\n```", "FINAL_VAR(r)"], str.upper))
    context = tmp_path / "context.txt"
    context.write_text("x\n")
    args = ("run", "answer", "--context", str(context), "--base-url", server.base_url, "--model", "scripted")
    done = drlm(tmp_path, *args, DRLM_TRACING="console")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "X\n"  # the answer alone: telemetry does not mix into it
    assert done.stderr.count('"name": "chat scripted"') == len(server.requests) == 3
    for metric in (
        "drlm.episodes",
        "gen_ai.client.token.usage",
        "drlm.model.calls",
        "drlm.episode.iterations",
    ):
        assert f'"name": "{metric}"' in done.stderr, metric
