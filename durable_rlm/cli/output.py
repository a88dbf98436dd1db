"""What the commands print, and the exit code a script reads.

A command's own output goes to stdout (an answer, an id, JSON); progress and messages go
to stderr, one line each, so `drlm run ... > answer.txt` keeps only the answer.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

from durable_rlm.terminal import safe

if TYPE_CHECKING:
    from durable_rlm.client.episodes import EpisodeEnd

EXIT_OK = 0  # the model (or a policy that found one) answered
EXIT_FAILED = 1  # a model error, a failed or timed-out episode
EXIT_USAGE = 2  # bad command line, configuration or request: nothing was started
EXIT_NO_ANSWER = 3  # a limit or a policy stopped it, and there is no answer
EXIT_EXTRACTED = 4  # a limit stopped it and the answer was extracted (0 with --accept-extracted)
EXIT_CANCELLED = 5  # cancelled or terminated
EXIT_PAUSED = 6  # the episode waits for a fix (a model key): `drlm resume ID` once fixed
EXIT_INTERRUPTED = 130  # Ctrl-C: the episode itself goes on

# The episode this process started or follows: what Ctrl-C names.
FOLLOWING: list[str] = []
# What Ctrl-C says instead, when a command has more to say than "interrupted" (a cancel not
# yet confirmed): the last line set is printed.
ON_INTERRUPT: list[str] = []
# Ctrl-C came (its signal number): a cancelled call's error is the interruption.
INTERRUPTED: list[int] = []


def stderr(line: str) -> None:
    """A line for a person; what it quotes of a model, a cell or a tool cannot drive their
    terminal (durable_rlm/terminal.py)."""
    print(safe(line), file=sys.stderr, flush=True)


def exit_code(end: EpisodeEnd, accept_extracted: bool = False) -> int:
    """The exit code a script reads: answered, extracted, no answer, failed, cancelled."""
    if end.status in ("cancelled", "terminated"):
        return EXIT_CANCELLED
    if end.status == "paused":
        return EXIT_PAUSED
    result = end.result
    if result is not None and result.ended_by == "cancelled":
        return EXIT_CANCELLED
    if result is None or result.status == "failed":
        return EXIT_FAILED
    if result.answer is None:
        return EXIT_NO_ANSWER
    if result.answer_source == "extraction" and not accept_extracted:
        return EXIT_EXTRACTED
    return EXIT_OK


def print_end(end: EpisodeEnd, as_json: bool, accept_extracted: bool = False) -> int:
    """How an episode ended: its answer on stdout, the rest on stderr (or all as JSON)."""
    if as_json:
        print(json.dumps(end.report()))
        return exit_code(end, accept_extracted)
    result = end.result
    if result is None:
        how = "paused" if end.status == "paused" else f"ended: {end.status.replace('_', ' ')}"
        stderr(f"episode {end.episode_id} {how}: {end.error}")
        return exit_code(end, accept_extracted)
    from durable_rlm.audit.timeline import (  # start-up: the timeline (~0.4 s)
        describe_execution,
        ended_line,
        termination_text,
    )

    stderr(ended_line(result))
    stderr(f"stop reason: {result.stop_reason}")
    source = result.answer_source + (f" ({result.answer_policy})" if result.answer_policy else "")
    confidence = "" if result.confidence is None else f", confidence {result.confidence:.2f}"
    stderr(f"answer source: {source}{confidence}")
    if result.termination is not None:
        stderr(termination_text(result.termination))
    if result.execution is not None:
        stderr(describe_execution(result.execution, result.status))
    if result.lost_cells or result.compactions:
        stderr(f"lost cells: {result.lost_cells}; compactions: {result.compactions}")
    if result.error:
        stderr(f"error: {result.error}")
    if result.answer is not None:
        # As written for a file or a pipe (a script reads it whole); shown safe on a terminal.
        print(safe(result.answer) if sys.stdout.isatty() else result.answer)
    return exit_code(end, accept_extracted)
