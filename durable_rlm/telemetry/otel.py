"""Telemetry: OpenTelemetry traces and metrics, exported nowhere unless asked.

Temporal's TracingInterceptor on the client is also the workers' (they inherit the client's
interceptors), so one setting traces starting, running, and every activity of an episode.
The worker interceptor here adds what only the activity sees: a GenAI "chat" span and
metrics per model call, a span per REPL step, and an episode's outcome. All of it is
emitted where an attempt executes, never in workflow code: a workflow replayed on another
worker does not execute its completed calls again, so it emits nothing twice.

Where it goes: OTEL_TRACES_EXPORTER and OTEL_METRICS_EXPORTER (otlp, console, none) choose
per signal; unset, DRLM_TRACING (off, console, otlp) chooses for both. The OTLP exporters
read the standard OTEL_EXPORTER_OTLP_* variables (endpoint, headers, protocol). Console
output goes to stderr: stdout carries the answer (`drlm run --json`).

Prometheus: with DRLM_METRICS_ADDRESS (host:port), whatever DRLM_TRACING says, GET /metrics
there serves the Temporal SDK's metrics followed by ours, so operators scrape one address.
The SDK's come from its Runtime's own Prometheus exporter, which listens on a private
loopback port and is read on each scrape; ours from an OpenTelemetry PrometheusMetricReader.
A process has one such Runtime per address (a port binds once): every client that connects
with it (connection.py) shares it, and workers inherit their client's.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import logging
import os
import queue
import re
import socket
import sys
import threading
import time
import urllib.request
import weakref
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from temporalio import activity
from temporalio.client import Interceptor
from temporalio.exceptions import ApplicationError
from temporalio.runtime import (
    LogForwardingConfig,
    LoggingConfig,
    PrometheusConfig,
    Runtime,
    TelemetryConfig,
    TelemetryFilter,
)
from temporalio.worker import ActivityInboundInterceptor, ExecuteActivityInput
from temporalio.worker import Interceptor as WorkerInterceptor

from durable_rlm.errors import ConfigurationError
from durable_rlm.ports import free_port
from durable_rlm.workflows import names

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from prometheus_client import CollectorRegistry

    from durable_rlm.activities.sandbox_slots import SandboxSlots

log = logging.getLogger(__name__)

SCOPE = "durable-rlm"
KINDS = ("off", "console", "otlp")
_ERROR_CHARS = 1000  # a cell's traceback can be long; a span attribute need not be

# Model-call activities and the role each plays in an episode (the drlm.role attribute).
MODEL_ROLES = {
    names.ROOT_COMPLETION: "root",
    names.SUB_QUERY: "sub",
    names.COMPACT_CONVERSATION: "compaction",
    names.EXTRACT_FALLBACK: "extraction",
}
CELL_STEPS = {names.REPL_EXECUTE: "execute", names.REPL_RESUME: "resume"}


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


# --- the Prometheus endpoint ----------------------------------------------------------------

_SDK_SCRAPE_TIMEOUT_S = 5.0
_TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"  # what both halves are written in
_RUNTIME_ATTEMPTS = 3
# The SDK's exporter is on loopback: an HTTP(S)_PROXY of the environment must not see it.
_LOOPBACK = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class MetricsEndpoint:
    """GET /metrics on DRLM_METRICS_ADDRESS, and the Temporal Runtime whose metrics it serves."""

    def __init__(self, address: str) -> None:
        self.requested = address
        self.server = _bind(address)
        try:
            self.runtime, self.server.sdk_url = _sdk_runtime()
        except BaseException:
            self.server.server_close()
            raise
        threading.Thread(target=self.server.serve_forever, name="drlm-metrics", daemon=True).start()

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        host = f"[{host}]" if ":" in str(host) else host
        return f"http://{host}:{port}/metrics"

    def close(self) -> None:
        """Stop serving (tests). The Runtime stays: the SDK has no way to stop one."""
        with _endpoints_lock:
            _endpoints.pop(self.requested, None)
        self.server.shutdown()
        self.server.server_close()


_endpoints: dict[str, MetricsEndpoint] = {}
_endpoints_lock = threading.Lock()


def serve_metrics(address: str) -> MetricsEndpoint:
    """This process's endpoint on `address`, started on first use."""
    with _endpoints_lock:
        if address not in _endpoints:
            _endpoints[address] = MetricsEndpoint(address)
        return _endpoints[address]


def metrics_runtime(address: str | None) -> Runtime | None:
    """The Temporal Runtime a client connects with: None (the SDK's default) without
    DRLM_METRICS_ADDRESS, else the one whose metrics that address serves."""
    return serve_metrics(address).runtime if address else None


class _MetricsServer(ThreadingHTTPServer):
    daemon_threads = True
    sdk_url = ""


class _MetricsServer6(_MetricsServer):
    address_family = socket.AF_INET6


def _bind(address: str) -> _MetricsServer:
    problem = f"DRLM_METRICS_ADDRESS={address!r}"
    try:
        url = urlsplit(f"//{address.strip()}")
        port = url.port
    except ValueError:
        port = None
    if port is None or url.path or url.query or url.fragment or url.username is not None:
        raise ConfigurationError(f"{problem} is not host:port (e.g. 127.0.0.1:9464)")
    host = url.hostname or "0.0.0.0"  # ":9464": every interface, as Prometheus exporters read it
    try:
        return (_MetricsServer6 if ":" in host else _MetricsServer)((host, port), _Scrape)
    except OSError as exc:
        why = "the port is in use (by another worker?)" if exc.errno == errno.EADDRINUSE else exc.strerror
        raise ConfigurationError(f"{problem}: cannot serve metrics there: {why or exc}") from None


def _sdk_runtime() -> tuple[Runtime, str]:
    """A Runtime whose Prometheus exporter listens on a loopback port of its own."""
    attempts = _RUNTIME_ATTEMPTS
    while True:
        bind = f"127.0.0.1:{free_port()}"
        # Its core logs as the process's default Runtime does (install_log_path).
        config = TelemetryConfig(logging=_core_logging, metrics=PrometheusConfig(bind_address=bind))
        try:
            return Runtime(telemetry=config), f"http://{bind}/metrics"
        except Exception:
            attempts -= 1  # another process took the free port before the Runtime bound it
            if not attempts:
                raise


class _Scrape(BaseHTTPRequestHandler):
    server: _MetricsServer

    def do_GET(self) -> None:
        if urlsplit(self.path).path != "/metrics":
            self.send_error(404, "metrics are at /metrics")
            return
        body = _exposition(self.server.sdk_url)
        self.send_response(200)
        self.send_header("Content-Type", _TEXT_FORMAT)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Silent: Prometheus scrapes every few seconds."""


def _exposition(sdk_url: str) -> bytes:
    """The SDK's metrics, then ours: one failing leaves the other served."""
    parts: list[bytes] = []
    try:
        with _LOOPBACK.open(sdk_url, timeout=_SDK_SCRAPE_TIMEOUT_S) as response:
            parts.append(response.read())
    except Exception:  # noqa: BLE001 - telemetry is best effort
        _failed()
    if (registry := current().prometheus) is not None:
        try:
            from prometheus_client import generate_latest  # optional: the prometheus extra

            parts.append(generate_latest(registry))
        except Exception:  # noqa: BLE001
            _failed()
    return b"".join(part if part.endswith(b"\n") else part + b"\n" for part in parts if part)


# --- the worker interceptor -----------------------------------------------------------------


class _Instruments:
    """Every instrument once per interceptor; names follow OTel's GenAI conventions where
    one exists (gen_ai.client.operation.duration, gen_ai.client.token.usage), the rest are
    drlm.*."""

    def __init__(self, meter: metrics.Meter) -> None:
        self.model_calls = meter.create_counter(
            "drlm.model.calls", unit="{call}", description="model calls executed, each attempt once"
        )
        self.tokens = meter.create_histogram(
            "gen_ai.client.token.usage",
            unit="{token}",
            description="tokens of a model call, by gen_ai.token.type",
        )
        self.cost = meter.create_counter(
            "drlm.model.cost", unit="USD", description="cost of the model calls whose price is known"
        )
        self.call_duration = meter.create_histogram(
            "gen_ai.client.operation.duration", unit="s", description="wall time of a model-call attempt"
        )
        self.cell_duration = meter.create_histogram(
            "drlm.cell.duration", unit="s", description="wall time of a REPL step (execute or resume)"
        )
        self.episodes = meter.create_counter(
            "drlm.episodes", unit="{episode}", description="episodes ended, by drlm.status and drlm.ended_by"
        )
        self.iterations = meter.create_histogram(
            "drlm.episode.iterations", unit="{iteration}", description="iterations of an ended episode"
        )


class StepTelemetry(WorkerInterceptor):
    """Spans and metrics of model calls, REPL steps and episode endings, per executed
    attempt. Best effort: a telemetry failure is logged, never the activity's failure."""

    def __init__(self, telemetry: Telemetry) -> None:
        tracers = telemetry.tracer_provider or trace.NoOpTracerProvider()
        meters = telemetry.meter_provider or metrics.NoOpMeterProvider()
        self.tracer = tracers.get_tracer(SCOPE)
        self.instruments = _Instruments(meters.get_meter(SCOPE))

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _StepInbound(next, self)


class _StepInbound(ActivityInboundInterceptor):
    def __init__(self, next: ActivityInboundInterceptor, root: StepTelemetry) -> None:
        super().__init__(next)
        self.root = root

    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        observed = _observe(self.root, input)
        if observed is None:
            return await super().execute_activity(input)
        try:
            result = await super().execute_activity(input)
        except BaseException as exc:  # cancellation too: the attempt's span still ends
            observed.end(None, exc)
            raise
        observed.end(result, None)
        return result


def _observe(root: StepTelemetry, input: ExecuteActivityInput) -> _Observed | None:
    try:
        info = activity.info()
        request = input.args[0] if input.args else None
        if info.activity_type in MODEL_ROLES:
            return _ModelCall(root, info, request)
        if info.activity_type in CELL_STEPS:
            return _CellStep(root, info, request)
        if info.activity_type == names.AUDIT_EPISODE:
            _count_episode(root, info, request)
    except Exception:  # noqa: BLE001 - telemetry is best effort
        _failed()
    return None


class _Observed:
    """One attempt's span, made current while it runs (a client library's own spans, if
    instrumented, nest under it); `end` records its result and never raises."""

    def __init__(self, root: StepTelemetry, name: str, kind: SpanKind, attributes: dict[str, Any]) -> None:
        self.root = root
        self.started = time.perf_counter()
        self.span = root.tracer.start_span(name, kind=kind, attributes=attributes)
        recording = self.span.is_recording()  # else keep the current span current
        self.token = otel_context.attach(trace.set_span_in_context(self.span)) if recording else None

    def end(self, result: Any, error: BaseException | None) -> None:
        try:
            if error is not None:
                self.span.set_status(Status(StatusCode.ERROR, _clip(str(error))))
                self.span.set_attribute("error.type", _error_type(error))
            self.record(result, error, time.perf_counter() - self.started)
        except Exception:  # noqa: BLE001 - telemetry is best effort
            _failed()
        finally:
            try:
                if self.token is not None:
                    otel_context.detach(self.token)
                self.span.end()
            except Exception:  # noqa: BLE001
                _failed()

    def record(self, result: Any, error: BaseException | None, elapsed_s: float) -> None:
        raise NotImplementedError


class _ModelCall(_Observed):
    """A span per the GenAI semantic conventions: "chat {model}", kind CLIENT, gen_ai.*."""

    def __init__(self, root: StepTelemetry, info: activity.Info, request: Any) -> None:
        settings = getattr(request, "model", None)
        model = str(getattr(settings, "model", "unknown"))
        self.labels: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": str(getattr(settings, "provider", "openai")),
            "gen_ai.request.model": model,
            "drlm.role": MODEL_ROLES[info.activity_type],
        }
        attributes = {**self.labels, "drlm.attempt": info.attempt}
        _put(attributes, "drlm.episode_id", getattr(request, "episode_id", None) or info.workflow_id)
        _put(attributes, "drlm.iteration", getattr(request, "iteration", None))
        _put(attributes, "drlm.cell_index", getattr(request, "cell_index", None))
        _put(attributes, "drlm.call_index", getattr(request, "call_index", None))
        for key in ("temperature", "max_tokens", "top_p"):
            _put(attributes, f"gen_ai.request.{key}", getattr(settings, key, None))
        if base_url := getattr(settings, "base_url", None):
            url = urlsplit(base_url)
            _put(attributes, "server.address", url.hostname)
            _put(attributes, "server.port", url.port)
        super().__init__(root, f"chat {model}", SpanKind.CLIENT, attributes)

    def record(self, result: Any, error: BaseException | None, elapsed_s: float) -> None:
        meter = self.root.instruments
        labels = dict(self.labels)
        if error is not None:
            labels["error.type"] = _error_type(error)
        meter.model_calls.add(1, labels)
        meter.call_duration.record(elapsed_s, labels)
        usage = getattr(result, "usage", None)
        if usage is None:
            return
        _put_on(self.span, "gen_ai.response.model", getattr(result, "response_model", None))
        _put_on(self.span, "gen_ai.response.id", getattr(result, "response_id", None))
        if reasons := getattr(result, "finish_reasons", None):
            self.span.set_attribute("gen_ai.response.finish_reasons", list(reasons))
        if answered_by := getattr(result, "response_model", None):
            labels["gen_ai.response.model"] = answered_by
        tokens = {"input": usage.prompt_tokens, "output": usage.completion_tokens}
        self.span.set_attribute("gen_ai.usage.input_tokens", tokens["input"])
        self.span.set_attribute("gen_ai.usage.output_tokens", tokens["output"])
        for direction, count in tokens.items():
            meter.tokens.record(count, {**labels, "gen_ai.token.type": direction})
        if (model_time_s := getattr(result, "model_time_s", None)) is not None:
            self.span.set_attribute("drlm.model_time_s", model_time_s)
        if (cost := getattr(usage, "cost_usd", None)) is not None:
            self.span.set_attribute("drlm.cost_usd", cost)
            meter.cost.add(cost, labels)


class _CellStep(_Observed):
    """A REPL step: running a cell, or resuming it with its model calls' answers."""

    def __init__(self, root: StepTelemetry, info: activity.Info, request: Any) -> None:
        self.step = CELL_STEPS[info.activity_type]
        self.local = info.is_local
        sandbox = getattr(request, "sandbox", None)
        attributes: dict[str, Any] = {"drlm.cell.step": self.step, "drlm.cell.local": self.local}
        _put(attributes, "drlm.episode_id", getattr(sandbox, "episode_id", None) or info.workflow_id)
        _put(attributes, "drlm.iteration", getattr(request, "iteration", None))
        _put(attributes, "drlm.cell_index", getattr(request, "cell_index", None))
        attributes["drlm.attempt"] = info.attempt
        super().__init__(root, f"repl {self.step}", SpanKind.INTERNAL, attributes)

    def record(self, result: Any, error: BaseException | None, elapsed_s: float) -> None:
        status = "failed" if error is not None else str(getattr(result, "status", "unknown"))
        self.span.set_attribute("drlm.cell.status", status)
        if result is not None:
            _put_on(self.span, "drlm.cell.error", _clip(getattr(result, "error", None)))
            _put_on(self.span, "drlm.cell.sub_calls", len(getattr(result, "requests", None) or ()))
            _put_on(self.span, "drlm.cell.rebuilt", getattr(result, "rebuilt", None))
        self.root.instruments.cell_duration.record(
            elapsed_s,
            {"drlm.cell.step": self.step, "drlm.cell.status": status, "drlm.cell.local": self.local},
        )


def _count_episode(root: StepTelemetry, info: activity.Info, record: Any) -> None:
    """Counted when the first attempt of its final audit write starts: a failing write's
    retries never count an episode twice."""
    status = getattr(record, "status", None)
    if status in (None, "running") or info.attempt != 1:
        return
    result = getattr(record, "result", None)
    labels = {"drlm.status": str(status)}
    _put(labels, "drlm.ended_by", getattr(result, "ended_by", None))
    root.instruments.episodes.add(1, labels)
    if (iterations := getattr(result, "iterations", None)) is not None:
        root.instruments.iterations.record(iterations, labels)


# --- small helpers --------------------------------------------------------------------------


def _put(attributes: dict[str, Any], key: str, value: Any) -> None:
    if value is not None:
        attributes[key] = value


def _put_on(span: trace.Span, key: str, value: Any) -> None:
    if value is not None:
        span.set_attribute(key, value)


def _clip(text: str | None) -> str | None:
    return None if text is None else text[:_ERROR_CHARS]


def _error_type(error: BaseException) -> str:
    if isinstance(error, ApplicationError) and error.type:
        return error.type  # the names the retry policies key on (workflows/names.py)
    return type(error).__qualname__


_warned = False


def _failed() -> None:
    """Log a telemetry failure: the first with a warning, the rest quietly."""
    global _warned
    log.log(logging.DEBUG if _warned else logging.WARNING, "telemetry failed (ignored)", exc_info=True)
    _warned = True


# --- the log path of a worker process ---------------------------------------------------------
#
# A worker's output is a pipe its supervisor may never read (a bench, systemd, a container
# runtime that stalls). A pipe holds 64 KB: a thread that writes to a full one blocks. When
# that thread was the event loop (a logging.StreamHandler) or the SDK core's own (its console
# logger), the worker stopped polling, and its episodes waited until someone read the pipe
# (issue 38: bench/concurrency.py at N=200 stopped for 7 minutes on 246 KB of core WARN lines).
# So every record, Python's and the core's, takes one path that never blocks its caller: a
# bounded queue that drops (and counts) when full, a thread of its own that writes, and limits
# on what it writes, so a saturated worker's repeated warnings cost lines, not megabytes.

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
CORE_LOGGER = "temporalio.core"
"""The Python logger the SDK core's (Rust) logs are forwarded to."""
LOG_QUEUE_RECORDS = 2000
LOG_BURST = 5
"""Records of one kind (logger, level, message shape, exception type) written per window;
the rest are counted and summarised at the window's end."""
LOG_WINDOW_S = 60.0
LOG_BUDGET_BYTES = 16 * 1024
"""Bytes of records written per window, whatever their kinds; the summaries come on top."""
LOG_RECORD_CHARS = 3000
LOG_KINDS = 200
"""Kinds tracked per window; records of further kinds share one count."""
LOG_SUMMARY_KINDS = 10
"""Kinds named in a window's summary, the most suppressed first; the rest are one line."""
# Libraries that log every request at INFO: a worker makes thousands of requests a minute.
_CHATTY = ("httpx", "httpx2", "httpcore", "httpcore2", "openai")
_VARYING = re.compile(r"[0-9a-f]{8,}|\d+")
_STOP = object()

_core_logging = LoggingConfig.default
_log_path: LogPath | None = None


class LogPath:
    """One bounded, non-blocking path from every logger of a process to one stream.

    `handler` goes on the root logger. Emitting costs a dict lookup and a `put_nowait` on
    the caller's thread (the event loop, or the SDK core's forwarding thread); formatting and
    writing happen on the writer thread, which alone may block on the stream. What is not
    written is counted: records beyond `burst` of one kind per window (suppressed), beyond
    `budget_bytes` per window, or arriving while the queue is full (dropped); each window ends
    with one line per count, and `close` writes the last ones."""

    def __init__(
        self,
        stream: Any,
        *,
        capacity: int = LOG_QUEUE_RECORDS,
        burst: int = LOG_BURST,
        window_s: float = LOG_WINDOW_S,
        budget_bytes: int = LOG_BUDGET_BYTES,
        record_chars: int = LOG_RECORD_CHARS,
    ) -> None:
        self.stream = stream
        self.burst = burst
        self.window_s = window_s
        self.budget_bytes = budget_bytes
        self.record_chars = record_chars
        self.formatter = logging.Formatter(LOG_FORMAT)
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=capacity)
        self.handler = _Enqueue(self)
        self.dropped = 0  # totals, for the process's life
        self.suppressed = 0
        self.over_budget = 0
        self._lock = threading.Lock()
        self._kinds: dict[tuple[Any, ...], list[int]] = {}  # kind -> [shown, suppressed]
        self._window_dropped = 0
        self._window_over = 0
        self._written = 0
        self._window_began = time.monotonic()
        self._writer = threading.Thread(target=self._write_forever, name="drlm-log-writer", daemon=True)
        self._writer.start()

    def admit(self, record: logging.LogRecord) -> bool:
        """Whether `record` may be queued: the first `burst` of its kind in this window."""
        kind = _kind(record)
        with self._lock:
            counts = self._kinds.get(kind)
            if counts is None:
                if len(self._kinds) >= LOG_KINDS:
                    kind = ("", record.levelno, "records of other kinds", "")
                    counts = self._kinds.setdefault(kind, [0, 0])
                else:
                    counts = self._kinds[kind] = [0, 0]
            if counts[0] < self.burst:
                counts[0] += 1
                return True
            counts[1] += 1
            self.suppressed += 1
            return False

    def count_dropped(self) -> None:
        with self._lock:
            self.dropped += 1
            self._window_dropped += 1

    def close(self, timeout_s: float = 2.0) -> None:
        """Write what is queued and the last counts, for up to `timeout_s` (a stream nobody
        reads may never take them: the process must still be able to exit)."""
        with contextlib.suppress(queue.Full):
            self.queue.put(_STOP, timeout=timeout_s)
        self._writer.join(timeout_s)

    def _write_forever(self) -> None:
        while True:
            left = self._window_began + self.window_s - time.monotonic()
            try:
                record = self.queue.get(timeout=max(left, 0.0))
            except queue.Empty:
                record = None
            if record is _STOP:
                self._end_window()
                return
            if record is not None:
                self._write_record(record)
            if time.monotonic() >= self._window_began + self.window_s:
                self._end_window()

    def _write_record(self, record: logging.LogRecord) -> None:
        try:
            text = self.formatter.format(record)
        except Exception:  # noqa: BLE001 - a record that cannot be formatted is not worth a crash
            text = f"{record.levelname} {record.name}: (unformattable record: {record.msg!r:.200})"
        if len(text) > self.record_chars:  # a traceback's end says most: keep the head and the end
            cut = len(text) - self.record_chars
            head = self.record_chars // 3
            text = f"{text[:head]}\n... ({cut} characters cut) ...\n{text[head + cut :]}"
        if self._written + len(text) > self.budget_bytes:
            with self._lock:
                self.over_budget += 1
                self._window_over += 1
            return
        self._written += len(text) + 1
        self._put(text)

    def _end_window(self) -> None:
        """One line per count of the window that ends, then a fresh window."""
        with self._lock:
            kinds, self._kinds = self._kinds, {}
            dropped, over = self._window_dropped, self._window_over
            self._window_dropped = self._window_over = 0
        began, self._window_began = self._window_began, time.monotonic()
        self._written = 0
        seconds = time.monotonic() - began
        repeated = sorted(((c[1], c[0], k) for k, c in kinds.items() if c[1]), key=lambda r: -r[0])
        lines = [
            f"{n} more like it suppressed in {seconds:.0f} s ({shown} shown): "
            f"{logging.getLevelName(level)} {name}: {shape[:120]}{f' ({exc})' if exc else ''}"
            for n, shown, (name, level, shape, exc) in repeated[:LOG_SUMMARY_KINDS]
        ]
        if len(repeated) > LOG_SUMMARY_KINDS:
            rest = repeated[LOG_SUMMARY_KINDS:]
            lines.append(
                f"{sum(n for n, _, _ in rest)} more records of {len(rest)} other kinds suppressed "
                f"in {seconds:.0f} s"
            )
        if over:
            lines.append(f"{over} records not written in {seconds:.0f} s: over {self.budget_bytes} bytes")
        if dropped:
            lines.append(f"{dropped} records dropped in {seconds:.0f} s: the log queue was full")
        for line in lines:
            self._put(f"{time.strftime('%Y-%m-%d %H:%M:%S')} WARNING drlm.logs: {line}")

    def _put(self, text: str) -> None:
        try:
            self.stream.write(text + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # closed or broken: the records are lost, the worker goes on
            with self._lock:
                self.dropped += 1


class _Enqueue(logging.Handler):
    """The root logger's only handler: admit, then queue without waiting."""

    def __init__(self, path: LogPath) -> None:
        super().__init__()
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        if not self.path.admit(record):
            return
        try:
            self.path.queue.put_nowait(record)
        except queue.Full:
            self.path.count_dropped()

    def handleError(self, record: logging.LogRecord) -> None:
        # logging's default prints a traceback to stderr: the very write this path avoids.
        self.path.count_dropped()


def _kind(record: logging.LogRecord) -> tuple[Any, ...]:
    """What makes two records 'the same warning again': logger, level, the message's shape
    (numbers and ids masked; the SDK's loggers append a per-call `({...})` context, cut),
    and the exception's type. A forwarded core record has its message without its fields."""
    core = getattr(record, "temporal_log", None)
    if core is not None:
        text = f"[{core.target}] {core.message}"
    else:
        text = record.msg if isinstance(record.msg, str) else type(record.msg).__name__
    shape = _VARYING.sub("#", text.split(" ({", 1)[0])[:160]
    exc = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else ""
    return (record.name, record.levelno, shape, exc)


def install_log_path(level: str | int = logging.INFO, stream: Any = None) -> LogPath:
    """Route this process's logs, Python's and the SDK core's, through one `LogPath` to
    `stream` (stderr). Call it first thing in a worker process, before any Temporal client
    exists: the SDK's default Runtime, created on first use, is replaced by one whose core
    forwards its logs here instead of writing them to stdout itself."""
    global _core_logging, _log_path
    numeric = logging.getLevelName(level) if isinstance(level, str) else level
    if not isinstance(numeric, int):
        raise ConfigurationError(f"DRLM_LOG_LEVEL={level!r} is not a level (DEBUG, INFO, WARNING, ERROR)")
    path = LogPath(stream if stream is not None else sys.stderr)
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(path.handler)
    root.setLevel(numeric)
    for name in _CHATTY:  # their requests are shown at DEBUG only
        logging.getLogger(name).setLevel(numeric if numeric <= logging.DEBUG else logging.WARNING)
    logging.captureWarnings(True)  # warnings.warn writes to stderr itself otherwise
    # The core's DEBUG is a flood (every poll and activation); below DEBUG is never asked for.
    core_level = "DEBUG" if numeric <= logging.DEBUG else "WARN"
    _core_logging = LoggingConfig(
        filter=TelemetryFilter(core_level=core_level, other_level="ERROR"),
        forwarding=LogForwardingConfig(logger=logging.getLogger(CORE_LOGGER), append_target_to_name=False),
    )
    Runtime.set_default(Runtime(telemetry=TelemetryConfig(logging=_core_logging)), error_if_already_set=False)
    if _log_path is not None:
        _log_path.close(0.5)
    _log_path = path
    return path


def forward_core_logs() -> bool:
    """Have the SDK core hand its logs to Python logging (`temporalio.core`) instead of
    writing them to stdout itself: a `drlm run --json` or a user's script keeps its stdout
    for its own output, and a level the user sets decides what shows. Only before the
    process's first Temporal client (the default Runtime is made then): False when too late."""
    global _core_logging
    if _core_logging is LoggingConfig.default:
        _core_logging = LoggingConfig(
            filter=TelemetryFilter(core_level="WARN", other_level="ERROR"),
            forwarding=LogForwardingConfig(
                logger=logging.getLogger(CORE_LOGGER), append_target_to_name=False
            ),
        )
    try:
        Runtime.set_default(
            Runtime(telemetry=TelemetryConfig(logging=_core_logging)), error_if_already_set=True
        )
    except RuntimeError:
        return False  # a client exists already: its Runtime stays
    return True


def close_log_path(timeout_s: float = 2.0) -> None:
    """Write what the log path holds, for up to `timeout_s` (before the process exits)."""
    if _log_path is not None:
        _log_path.close(timeout_s)
