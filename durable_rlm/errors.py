"""Errors a caller of the Python API can catch and fix, each with a message that says what."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import ValidationError

if TYPE_CHECKING:
    from durable_rlm.client.episodes import EpisodeEnd


class DurableRLMError(Exception):
    """Every error of durable-rlm's API."""


class ConfigurationError(DurableRLMError, ValueError):
    """Bad settings: reported before anything starts."""


class InvalidRequestError(DurableRLMError, ValueError):
    """An episode request that does not validate (a limit out of range, a bad fence...)."""

    @classmethod
    def of(cls, exc: ValidationError) -> InvalidRequestError:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'value'}: {err['msg']}" for err in exc.errors()
        )
        return cls(f"invalid episode request: {problems}")


class EpisodeFailed(DurableRLMError):
    """The episode ended without a result: failed, terminated, timed out or cancelled by
    Temporal (a `cancel()` on request ends with a result, `ended_by="cancelled"`); or a
    failure (the model down, say) ended it without an answer: status "failed", the result
    on `end.result`, what failed in its `failure_cause`."""

    def __init__(self, end: EpisodeEnd) -> None:
        why = end.error or (end.result.stop_reason if end.result is not None else None)
        super().__init__(f"episode {end.episode_id} {end.status.replace('_', ' ')}: {why}")
        self.end = end


class ServerUnavailable(DurableRLMError):
    """Temporal cannot be reached: the message names the address and the setting."""


class EpisodeIdInUse(DurableRLMError, ValueError):
    """An episode id names one episode for good: a second start with it is refused."""
