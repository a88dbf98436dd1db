"""The Prometheus endpoint: GET /metrics on DRLM_METRICS_ADDRESS (host:port), whatever
DRLM_TRACING says, serves the Temporal SDK's metrics followed by ours, so operators scrape
one address.

The SDK's come from its Runtime's own Prometheus exporter, which listens on a private
loopback port and is read on each scrape; ours from the OpenTelemetry PrometheusMetricReader
that `otel.configure` sets up and publishes here. A process has one such Runtime per address
(a port binds once): every client that connects with it (connection.py) shares it, and
workers inherit their client's.
"""

from __future__ import annotations

import errno
import socket
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig

from durable_rlm.errors import ConfigurationError
from durable_rlm.ports import SERVE_POLL_S, free_port
from durable_rlm.telemetry.instrumentation import failed
from durable_rlm.telemetry.log_path import core_logging

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

_SDK_SCRAPE_TIMEOUT_S = 5.0
_TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"  # what both halves are written in
_RUNTIME_ATTEMPTS = 3
# The SDK's exporter is on loopback: an HTTP(S)_PROXY of the environment must not see it.
_LOOPBACK = urllib.request.build_opener(urllib.request.ProxyHandler({}))
# Where our metrics wait for a scrape: the current telemetry's registry (otel.configure).
_registry: CollectorRegistry | None = None


def publish(registry: CollectorRegistry | None) -> None:
    """Serve `registry` after the SDK's metrics from now on; None: the SDK's alone."""
    global _registry
    _registry = registry


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
        threading.Thread(
            target=self.server.serve_forever,
            kwargs={"poll_interval": SERVE_POLL_S},
            name="drlm-metrics",
            daemon=True,
        ).start()

    @property
    def url(self) -> str:
        host, port = self.server.socket.getsockname()[:2]  # as bound: a str host
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
        config = TelemetryConfig(logging=core_logging(), metrics=PrometheusConfig(bind_address=bind))
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
        failed()
    if (registry := _registry) is not None:
        try:
            from prometheus_client import generate_latest  # optional: the prometheus extra

            parts.append(generate_latest(registry))
        except Exception:  # noqa: BLE001
            failed()
    return b"".join(part if part.endswith(b"\n") else part + b"\n" for part in parts if part)
