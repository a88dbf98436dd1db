"""The worker interceptor: what only an activity sees, as spans and metrics.

A GenAI "chat" span and metrics per model call, a span per REPL step, and an episode's
outcome, per executed attempt. All of it is emitted where an attempt executes, never in
workflow code: a workflow replayed on another worker does not execute its completed calls
again, so it emits nothing twice. `otel.worker_interceptors` installs it when the process
exports something.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from temporalio import activity
from temporalio.exceptions import ApplicationError
from temporalio.worker import ActivityInboundInterceptor, ExecuteActivityInput
from temporalio.worker import Interceptor as WorkerInterceptor

from durable_rlm.telemetry.instrumentation import SCOPE, failed
from durable_rlm.workflows import names

if TYPE_CHECKING:
    from durable_rlm.telemetry.otel import Telemetry

_ERROR_CHARS = 1000  # a cell's traceback can be long; a span attribute need not be

# Model-call activities and the role each plays in an episode (the drlm.role attribute).
MODEL_ROLES = {
    names.ROOT_COMPLETION: "root",
    names.SUB_QUERY: "sub",
    names.COMPACT_CONVERSATION: "compaction",
    names.EXTRACT_FALLBACK: "extraction",
}
CELL_STEPS = {names.REPL_EXECUTE: "execute", names.REPL_RESUME: "resume"}


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
        failed()
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
            failed()
        finally:
            try:
                if self.token is not None:
                    otel_context.detach(self.token)
                self.span.end()
            except Exception:  # noqa: BLE001
                failed()

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
