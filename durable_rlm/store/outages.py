"""Store failures told apart from everything else, so that an outage is waited out.

A step that cannot read or write the audit store or the blob store (a full disk, PostgreSQL
down or restarting, a network store timing out) did nothing wrong and neither did the
model: it leaves as one retryable ApplicationError of type `StoreUnavailable`, and the
workflow waits for the store (workflows/retries.py `waits_for_store`) instead of ending the
episode or blaming the model. A digest the store does not hold (BlobNotFound) or a blob
whose bytes do not match is not an outage: waiting would not bring it back.
"""

from __future__ import annotations

import errno
import sqlite3

import sqlalchemy as sa
from temporalio.exceptions import ApplicationError

from durable_rlm.workflows import names

# The errors an operating system gives when the disk, the file system or a network peer is
# the problem, not the request: waiting (or an operator) fixes them.
_OUTAGE_ERRNOS = frozenset(
    {
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EIO,
        errno.EROFS,
        errno.ENFILE,
        errno.EMFILE,
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.ETIMEDOUT,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.EPIPE,
        errno.ESTALE,
    }
)
# How SQLite and the PostgreSQL drivers word an outage when they give no errno.
_OUTAGE_WORDS = (
    "database or disk is full",
    "disk i/o error",
    "database is locked",
    "unable to open database",
    "readonly database",
    "server closed the connection",
    "connection refused",
    "could not connect",
    "connection timed out",
    "terminating connection",
    "the database system is starting up",
    "the database system is shutting down",
    "the database system is in recovery mode",
    "no space left on device",
    "connection is closed",
    "ssl connection has been closed",
    "timeout expired",
)
STORE_MESSAGE_CHARS = 500


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen and len(seen) < 16:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def store_problem(exc: BaseException) -> str | None:
    """What is wrong with the store, in one line, when `exc` is a store outage; else None."""
    for error in _chain(exc):
        text = str(error).splitlines()[0] if str(error) else type(error).__name__
        if isinstance(error, sa.exc.DBAPIError) and (
            error.connection_invalidated or isinstance(error, sa.exc.OperationalError | sa.exc.InterfaceError)
        ):
            return _short(f"{type(error.orig).__name__}: {error.orig}" if error.orig is not None else text)
        if isinstance(error, sa.exc.TimeoutError | sa.exc.DisconnectionError):
            return _short(text)  # the connection pool had no connection to give
        if isinstance(error, sqlite3.OperationalError) and _worded_as_outage(text):
            return _short(f"sqlite3: {text}")
        if isinstance(error, OSError) and error.errno in _OUTAGE_ERRNOS:
            return _short(f"{type(error).__name__}: {error}")
        if type(error).__module__.startswith(("psycopg", "asyncpg")) and _worded_as_outage(text):
            return _short(text)
    return None


def _worded_as_outage(text: str) -> bool:
    lowered = text.lower()
    return any(words in lowered for words in _OUTAGE_WORDS)


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= STORE_MESSAGE_CHARS else text[: STORE_MESSAGE_CHARS - 3] + "..."


def store_unavailable(problem: str) -> ApplicationError:
    """The failure a step leaves with when the store failed it: retryable, and typed so
    the workflow waits for the store instead of ending the episode."""
    return ApplicationError(f"the store is unavailable: {problem}", type=names.STORE_UNAVAILABLE)
