"""The SDK's own failure reports, kept out of a Python API user's terminal.

A failed step is normal in a durable runtime (a provider that is down is retried, then the
episode says so in its result), but Temporal's SDK logs every failed attempt at WARNING
with its whole traceback, and with no logging configured Python prints those on stderr:
a model that is down gave 192 lines for one episode. In a process that runs episodes
through the Python API, those records are logged at DEBUG instead: a user who wants them
turns the `temporalio` loggers (or the root logger) up to DEBUG and gets every one.
"""

from __future__ import annotations

import logging

# The SDK modules that report a failed activity attempt or workflow task.
SDK_LOGGERS = (
    "temporalio.activity",
    "temporalio.workflow",
    "temporalio.worker._activity",
    "temporalio.worker._workflow",
    "temporalio.worker._workflow_instance",
    "temporalio.core",  # the SDK core's own records (durable_rlm.telemetry.log_path.forward_core_logs)
)


class FailuresAtDebug(logging.Filter):
    """Lower an SDK record below ERROR to DEBUG (a filter may change the record it passes)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            # Passed on only where the user asked for DEBUG (the logger's effective level).
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


_FILTER = FailuresAtDebug()


def quiet_sdk_failures() -> None:
    """Install the filter on the SDK's loggers (idempotent)."""
    for name in SDK_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
