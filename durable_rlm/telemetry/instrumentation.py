"""What every durable-rlm signal shares: the instrumentation scope its spans and metrics are
emitted under, and how a failure of telemetry itself is reported.

Telemetry is best effort: a failure is logged, never the failure of what was observed (a
model call, a REPL step, a scrape's other half), and only the first is a warning, so a
collector that is down does not fill the worker's log with one traceback per call.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

SCOPE = "durable-rlm"

_warned = False


def failed() -> None:
    """Log a telemetry failure: the first with a warning, the rest quietly."""
    global _warned
    log.log(logging.DEBUG if _warned else logging.WARNING, "telemetry failed (ignored)", exc_info=True)
    _warned = True
