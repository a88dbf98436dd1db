"""Tracing: spans for starting and running an episode reach the exporter."""

from __future__ import annotations

import pytest
from temporalio.contrib.opentelemetry import TracingInterceptor

from durable_rlm.telemetry import client_interceptors


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
