"""Tracing: off by default; console spans for a look, OTLP for a collector."""

from __future__ import annotations

from temporalio.client import Interceptor


def client_interceptors(kind: str) -> list[Interceptor]:
    if kind == "off":
        return []
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    from temporalio.contrib.opentelemetry import TracingInterceptor

    provider = TracerProvider(resource=Resource.create({"service.name": "durable-rlm"}))
    if kind == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise RuntimeError("DRLM_TRACING=otlp needs opentelemetry-exporter-otlp installed") from exc
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    else:
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    trace.set_tracer_provider(provider)
    return [TracingInterceptor()]
