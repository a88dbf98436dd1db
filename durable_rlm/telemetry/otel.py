"""Telemetry: OpenTelemetry traces and metrics, exported nowhere unless asked.

Temporal's TracingInterceptor on the client is also the workers' (they inherit the client's
interceptors), so one setting traces starting, running, and every activity of an episode.
The worker interceptor (step_telemetry.py) adds what only the activity sees: a GenAI "chat"
span and metrics per model call, a span per REPL step, and an episode's outcome.

Where it goes: OTEL_TRACES_EXPORTER and OTEL_METRICS_EXPORTER (otlp, console, none) choose
per signal; unset, DRLM_TRACING (off, console, otlp) chooses for both. The OTLP exporters
read the standard OTEL_EXPORTER_OTLP_* variables (endpoint, headers, protocol). Console
output goes to stderr: stdout carries the answer (`drlm run --json`). With
DRLM_METRICS_ADDRESS, our metrics are also served for Prometheus (metrics_server.py).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
import weakref
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opentelemetry import metrics
from temporalio.client import Interceptor
from temporalio.worker import Interceptor as WorkerInterceptor

from durable_rlm.errors import ConfigurationError
from durable_rlm.telemetry.instrumentation import SCOPE
from durable_rlm.telemetry.metrics_server import publish, serve_metrics
from durable_rlm.telemetry.step_telemetry import StepTelemetry

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from prometheus_client import CollectorRegistry

    from durable_rlm.activities.sandbox_slots import SandboxSlots

KINDS = ("off", "console", "otlp")


@dataclass(frozen=True)
class Telemetry:
    """This process's providers; None: that signal is not exported and costs nothing.
    `prometheus`: where our metrics wait for a scrape of DRLM_METRICS_ADDRESS."""

    tracer_provider: TracerProvider | None = None
    meter_provider: MeterProvider | None = None
    prometheus: CollectorRegistry | None = None

    @property
    def enabled(self) -> bool:
        return self.tracer_provider is not None or self.meter_provider is not None

    def shutdown(self) -> None:
        """Flush and stop both providers. An interpreter's normal exit does this by itself;
        `os._exit` (every drlm command and the worker leave by it: sdk-python#300) does not,
        so they call `shutdown_current` first, or a short `drlm run` exports almost nothing."""
        for provider in (self.tracer_provider, self.meter_provider):
            if provider is not None:
                provider.shutdown()


_current: tuple[Hashable, Telemetry] = (("off", (), (), (), False), Telemetry())


def current() -> Telemetry:
    return _current[1]


EXIT_FLUSH_S = 5.0
"""How long a leaving process waits for its last spans and metrics to be exported: an
unreachable collector must not hold `drlm run`'s exit for the exporter's own 10-30 s."""


def shutdown_current(timeout_s: float = EXIT_FLUSH_S) -> None:
    """Before `os._exit`: export what this process's providers hold, then stop them, within
    `timeout_s` in all (a thread, so a hung exporter is left behind, not waited for)."""
    telemetry = _current[1]
    if not telemetry.enabled:
        return
    done = threading.Thread(target=_shutdown_quietly, args=(telemetry,), daemon=True)
    done.start()
    done.join(timeout_s)


def _shutdown_quietly(telemetry: Telemetry) -> None:
    try:
        telemetry.shutdown()
    except Exception:  # noqa: BLE001 - a failed export at exit is not the command's failure
        logging.getLogger(__name__).debug("telemetry shutdown failed", exc_info=True)


def configure(
    kind: str = "off",
    environ: Mapping[str, str] | None = None,
    *,
    span_exporter: SpanExporter | None = None,
    metric_reader: MetricReader | None = None,
    metrics_address: str | None = None,
) -> Telemetry:
    """Set up this process's telemetry, which worker_interceptors() then uses, and the
    Prometheus endpoint on `metrics_address` (DRLM_METRICS_ADDRESS) if given.

    `span_exporter` / `metric_reader` replace the configured exporters (tests). The same
    settings twice keep the same providers: reconnecting starts no second export thread.
    """
    global _current
    if kind not in KINDS:
        raise ConfigurationError(f"DRLM_TRACING must be one of {', '.join(KINDS)}, not {kind!r}")
    env = os.environ if environ is None else environ
    off = env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
    traces = () if off else _exporter_names(env, "OTEL_TRACES_EXPORTER", kind)
    meters = () if off else _exporter_names(env, "OTEL_METRICS_EXPORTER", kind)
    if metrics_address:
        serve_metrics(metrics_address)  # first: a bad address is reported before anything starts
    prometheus = bool(metrics_address) and not off
    injected = span_exporter is not None or metric_reader is not None
    key: Hashable = (
        object() if injected else (kind, traces, meters, _otlp_protocols(env, traces, meters), prometheus)
    )
    if key == _current[0]:
        return _current[1]
    readers = [metric_reader] if metric_reader is not None else [_periodic_reader(n, env) for n in meters]
    registry = None
    if prometheus:
        reader, registry = _prometheus_reader()
        readers.append(reader)
    telemetry = Telemetry(
        _tracer_provider(traces, span_exporter, env), _meter_provider(readers, env), registry
    )
    _current = (key, telemetry)
    publish(registry)
    return telemetry


def client_interceptors(
    kind: str,
    exporter: SpanExporter | None = None,
    *,
    metric_reader: MetricReader | None = None,
    environ: Mapping[str, str] | None = None,
    metrics_address: str | None = None,
) -> list[Interceptor]:
    """Interceptors for a client whose DRLM_TRACING is `kind` (workers inherit them); sets up
    the process's telemetry on the way (configure()). `exporter` overrides where spans go."""
    telemetry = configure(
        kind, environ, span_exporter=exporter, metric_reader=metric_reader, metrics_address=metrics_address
    )
    if telemetry.tracer_provider is None:
        return []
    from temporalio.contrib.opentelemetry import TracingInterceptor  # start-up: 0.04 s; tracing off skips

    return [TracingInterceptor(tracer=telemetry.tracer_provider.get_tracer(SCOPE))]


def worker_interceptors() -> list[WorkerInterceptor]:
    """Interceptors every worker runs: spans and metrics per model call and REPL step.
    None when nothing is exported, so telemetry that is off costs nothing."""
    telemetry = current()
    return [StepTelemetry(telemetry)] if telemetry.enabled else []


# Every worker's sandbox pool in this process (tests run several), read at each collection.
_POOLS: weakref.WeakKeyDictionary[SandboxSlots, str] = weakref.WeakKeyDictionary()
_pools_observed_by: list[MeterProvider] = []


def observe_sandboxes(slots: SandboxSlots, worker: str) -> None:
    """Gauges of a worker's sandboxes (live, limit, steps waiting for one) and counters of
    what the limit did (idle sandboxes evicted, steps that waited), labelled by `worker`
    (its own REPL queue). Registered once per meter provider; a closed worker drops out."""
    _POOLS[slots] = worker
    provider = current().meter_provider
    if provider is None or any(provider is seen for seen in _pools_observed_by):
        return
    _pools_observed_by[:] = [provider]
    meter = provider.get_meter(SCOPE)

    def reading(value: Any) -> Any:
        def callback(options: Any) -> Iterable[metrics.Observation]:
            return [
                metrics.Observation(value(pool), {"drlm.worker": name}) for pool, name in list(_POOLS.items())
            ]

        return callback

    meter.create_observable_gauge(
        "drlm.sandboxes.live", [reading(lambda p: p.held())], "{sandbox}", "sandboxes live or starting"
    )
    meter.create_observable_gauge(
        "drlm.sandboxes.limit", [reading(lambda p: p.limit)], "{sandbox}", "DRLM_MAX_SANDBOXES in effect"
    )
    meter.create_observable_gauge(
        "drlm.sandboxes.waiting",
        [reading(lambda p: p.waiting)],
        "{step}",
        "REPL steps waiting for a sandbox (the worker takes no new episodes meanwhile)",
    )
    meter.create_observable_counter(
        "drlm.sandboxes.evictions",
        [reading(lambda p: p.evictions)],
        "{sandbox}",
        "idle sandboxes closed to make room (rebuilt from the log when needed)",
    )
    meter.create_observable_counter(
        "drlm.sandboxes.waits", [reading(lambda p: p.waits)], "{step}", "REPL steps that waited for a sandbox"
    )


def forget_sandboxes(slots: SandboxSlots) -> None:
    """A worker stopped: its sandbox figures are no longer reported."""
    _POOLS.pop(slots, None)


# --- exporters ------------------------------------------------------------------------------


def _exporter_names(env: Mapping[str, str], variable: str, kind: str) -> tuple[str, ...]:
    raw = env.get(variable, "").strip()
    if not raw:
        return () if kind == "off" else (kind,)
    chosen = tuple(dict.fromkeys(name.strip().lower() for name in raw.split(",") if name.strip()))
    if unknown := [name for name in chosen if name not in ("otlp", "console", "none")]:
        raise ConfigurationError(f"{variable}={raw!r}: {unknown[0]!r} is not otlp, console or none")
    return tuple(name for name in chosen if name != "none")


def _otlp_protocols(
    env: Mapping[str, str], traces: tuple[str, ...], meters: tuple[str, ...]
) -> tuple[str, ...]:
    return tuple(
        _otlp_protocol(env, signal)
        for signal, chosen in (("TRACES", traces), ("METRICS", meters))
        if "otlp" in chosen
    )


def _otlp_protocol(env: Mapping[str, str], signal: str) -> str:
    # grpc is the Python SDK's default (the `otlp` entry point of opentelemetry-exporter-otlp).
    return (
        env.get(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    ).strip()


def _otlp_exporter(env: Mapping[str, str], signal: str, module: str, cls: str) -> Any:
    protocol = _otlp_protocol(env, signal)
    flavour = {"grpc": "grpc", "http/protobuf": "http"}.get(protocol)
    if flavour is None:
        raise ConfigurationError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: use grpc or http/protobuf")
    package = f"opentelemetry-exporter-otlp-proto-{flavour}"
    try:
        exporter = getattr(
            importlib.import_module(f"opentelemetry.exporter.otlp.proto.{flavour}.{module}"), cls
        )
    except ImportError as exc:
        raise RuntimeError(
            f"OTLP export over {protocol} needs the {package} package (pip install {package})"
        ) from exc
    return exporter()  # endpoint, headers, timeout: from the OTEL_EXPORTER_OTLP_* variables


def _resource(env: Mapping[str, str]) -> Resource:
    from opentelemetry.sdk.resources import Resource  # start-up: OTel SDK 0.04 s; telemetry off skips it

    named = env.get("OTEL_SERVICE_NAME") or "service.name=" in env.get("OTEL_RESOURCE_ATTRIBUTES", "")
    return Resource.create({} if named else {"service.name": SCOPE})


def _tracer_provider(
    chosen: tuple[str, ...], exporter: SpanExporter | None, env: Mapping[str, str]
) -> TracerProvider | None:
    from opentelemetry.sdk.trace import TracerProvider  # start-up: OTel SDK 0.04 s; tracing off skips it
    from opentelemetry.sdk.trace.export import (  # start-up: as TracerProvider
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SimpleSpanProcessor,
    )

    processors: list[SpanProcessor]
    if exporter is not None:
        processors = [SimpleSpanProcessor(exporter)]
    else:
        processors = [
            BatchSpanProcessor(
                ConsoleSpanExporter(out=sys.stderr)
                if name == "console"
                else _otlp_exporter(env, "TRACES", "trace_exporter", "OTLPSpanExporter")
            )
            for name in chosen
        ]
    if not processors:
        return None
    provider = TracerProvider(resource=_resource(env))
    for processor in processors:
        provider.add_span_processor(processor)
    return provider


def _periodic_reader(name: str, env: Mapping[str, str]) -> MetricReader:
    from opentelemetry.sdk.metrics.export import (  # start-up: OTel SDK 0.04 s; metrics off skip it
        ConsoleMetricExporter,
        PeriodicExportingMetricReader,
    )

    exporter: MetricExporter = (
        ConsoleMetricExporter(out=sys.stderr)
        if name == "console"
        else _otlp_exporter(env, "METRICS", "metric_exporter", "OTLPMetricExporter")
    )
    return PeriodicExportingMetricReader(exporter)


def _prometheus_reader() -> tuple[MetricReader, CollectorRegistry]:
    """A reader that renders on demand into a registry of its own: a later configure() gets
    a fresh one, and a scrape never shows a replaced provider's metrics twice."""
    package = "opentelemetry-exporter-prometheus"
    try:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader  # optional: the prometheus extra
        from prometheus_client import CollectorRegistry  # optional: the prometheus extra
    except ImportError as exc:
        raise RuntimeError(
            f"DRLM_METRICS_ADDRESS needs the {package} package (pip install {package})"
        ) from exc
    registry = CollectorRegistry()
    return PrometheusMetricReader(registry=registry), registry


def _meter_provider(readers: list[MetricReader], env: Mapping[str, str]) -> MeterProvider | None:
    from opentelemetry.sdk.metrics import MeterProvider  # start-up: OTel SDK 0.04 s; metrics off skip it

    return MeterProvider(metric_readers=readers, resource=_resource(env)) if readers else None
