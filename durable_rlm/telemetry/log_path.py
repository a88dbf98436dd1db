"""The log path of a worker process: every record, Python's and the SDK core's, to one stream,
without ever blocking the thread that logs it.

A worker's output is a pipe its supervisor may never read (a bench, systemd, a container
runtime that stalls). A pipe holds 64 KB: a thread that writes to a full one blocks. When
that thread was the event loop (a logging.StreamHandler) or the SDK core's own (its console
logger), the worker stopped polling, and its episodes waited until someone read the pipe
(bench/concurrency.py at N=200 stopped for 7 minutes on 246 KB of core WARN lines; see
docs/architecture/decisions.md, "Scale").
So every record, Python's and the core's, takes one path that never blocks its caller: a
bounded queue that drops (and counts) when full, a thread of its own that writes, and limits
on what it writes, so a saturated worker's repeated warnings cost lines, not megabytes.

A process that is not a worker (`drlm run`, a user's script) only has the core forward its
logs to Python logging (`forward_core_logs`), so that they stay off its stdout.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import re
import sys
import threading
import time
from typing import Any

from temporalio.runtime import LogForwardingConfig, LoggingConfig, Runtime, TelemetryConfig, TelemetryFilter

from durable_rlm.errors import ConfigurationError

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


def core_logging() -> LoggingConfig:
    """How the SDK core of a Runtime made now should log: as the process's default Runtime
    does once `install_log_path` or `forward_core_logs` set it (the metrics Runtime, too)."""
    return _core_logging


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
