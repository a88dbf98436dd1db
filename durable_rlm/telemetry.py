"""Tracing: off by default; console spans for a look, OTLP for a collector.

Temporal's TracingInterceptor on the client is also the workers' (they inherit the client's
interceptors), so one setting traces starting, running, and every activity of an episode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from temporalio.client import Interceptor
from temporalio.worker import Interceptor as WorkerInterceptor

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter


def client_interceptors(kind: str, exporter: SpanExporter | None = None) -> list[Interceptor]:
    """Interceptors for DRLM_TRACING=kind; `exporter` overrides where spans go (tests)."""
    if kind == "off" and exporter is None:
        return []
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor
    from temporalio.contrib.opentelemetry import TracingInterceptor

    provider = TracerProvider(resource=Resource.create({"service.name": "durable-rlm"}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif kind == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise RuntimeError("DRLM_TRACING=otlp needs opentelemetry-exporter-otlp installed") from exc
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    else:
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    return [TracingInterceptor(tracer=provider.get_tracer("durable-rlm"))]


def worker_interceptors() -> list[WorkerInterceptor]:
    """Interceptors every worker runs: spans and metrics per model call and REPL cell.
    NOT FINISHED: being built (issue 9, OpenTelemetry)."""
    return []
