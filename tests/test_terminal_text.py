"""Model text full of control sequences never drives the terminal of the person reading it:
`drlm run`, `show`, `list` and `watch` on a TTY (a real pseudo-terminal, `script`) show
what a model, a cell or a sub-call wrote with its controls escaped."""

from __future__ import annotations

import shlex
import subprocess
import uuid
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from durable_rlm.scripted import ChatRequest, Reply
from durable_rlm.terminal import safe
from tests.test_unattended import DRLM, environ

CLIPBOARD = "\x1b]52;c;cm0gLXJmIH4=\x07"  # OSC 52: writes the clipboard
TITLE = "\x1b]0;pwned\x07"  # OSC 0: the window title
LINK = "\x1b]8;;http://evil.example\x1b\\click\x1b]8;;\x1b\\"  # OSC 8: a hidden link
CLEAR = "\x1b[2J\x1b[H"  # clears the screen
HOSTILE = f"{CLIPBOARD}{TITLE}{LINK}{CLEAR}over\rwrite \u202egnp.exe\u202c zero\u200bwidth c1\x9b31m"
NEVER = ("\x1b]", "\x1b[2J", "\x07", "\u202e", "\u200b", "\x9b", "\rwrite")
"""What must not reach the terminal (rich's own colour codes, `ESC[...m`, may)."""


def hostile_script(request: ChatRequest) -> Reply | str:
    if not request.is_root:
        return f"sub said {HOSTILE}"
    if request.turn == 0:
        return f"Thinking {HOSTILE}\n```repl\nprint({HOSTILE!r})\nx = llm_query('go')\nprint(x)\n```"
    return f"FINAL(the answer {HOSTILE})"


def on_a_tty(data_dir: Path, *args: str) -> str:
    """What a terminal receives from `drlm ARGS` (stdout and stderr both on the pty)."""
    command = shlex.join([DRLM, *args])
    out = subprocess.run(
        ["script", "-qec", command, "/dev/null"],
        capture_output=True,
        timeout=120,
        env=environ(data_dir, COLUMNS="250", LINES="50"),
    )
    return out.stdout.decode("utf-8", errors="replace")


def assert_terminal_safe(screen: str) -> None:
    for sequence in NEVER:
        assert sequence not in screen, (sequence, screen[:3000])
    assert "\\x1b]52;c;" in screen  # shown, escaped: an auditor sees what the model tried


@pytest.mark.parametrize("text", [HOSTILE, "\x00\x01\x1f\x7f\x80\x9f\u061c\u200e\u2066\u2069\ufeff\u2028"])
def test_controls_are_shown_as_escapes_and_newlines_and_tabs_stay(text: str) -> None:
    shown = safe(f"line one\tcol\n{text}\nline three")
    assert shown.startswith("line one\tcol\n") and shown.endswith("\nline three")
    assert all(ch.isprintable() or ch in "\n\t" for ch in shown)


@given(st.text())
def test_whatever_a_model_writes_comes_out_printable(text: str) -> None:
    shown = safe(text)
    bad = [c for c in shown if not (c.isprintable() or c in "\n\t")]
    # What is left unprintable is neither a control nor a format character a terminal acts on.
    assert all(not (ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0) for c in bad)
    assert "\u202e" not in shown and "\u200b" not in shown


def test_run_show_and_list_on_a_terminal_escape_what_the_model_wrote(tmp_path: Path, scripted) -> None:
    server = scripted(hostile_script)
    episode_id = f"hostile-{uuid.uuid4().hex[:6]}"
    args = ("--base-url", server.base_url, "--model", "m", "--id", episode_id)
    screen = on_a_tty(tmp_path, "run", "t", *args)
    assert "the answer" in screen and "ended: answered (final)" in screen, screen[:3000]
    assert_terminal_safe(screen)
    shown = on_a_tty(tmp_path, "show", episode_id)
    assert "sub said" in shown and "Thinking" in shown
    assert_terminal_safe(shown)
    listed = on_a_tty(tmp_path, "list")
    assert episode_id in listed
    for sequence in NEVER:
        assert sequence not in listed, sequence
    # To a file or a pipe the answer is the model's own, byte for byte (a script reads it).
    piped = subprocess.run(
        [DRLM, "run", "t", *args[:-2], "--id", f"{episode_id}-piped"],
        capture_output=True,
        env=environ(tmp_path),
    )
    assert piped.stdout.decode() == f"the answer {HOSTILE}\n"


def test_the_live_view_of_drlm_watch_escapes_what_it_quotes() -> None:
    import io
    from datetime import UTC, datetime

    from rich.console import Console

    from durable_rlm.viewer.live import frame
    from durable_rlm.workflows.models import EpisodeLimits, EpisodeProgress, PendingCell

    progress = EpisodeProgress(
        iteration=2,
        phase=f"running cell 3 {HOSTILE}",
        model_calls=2,
        sub_calls=1,
        last_response=f"reply {HOSTILE}",
        last_output=f"output {HOSTILE}",
        root_model=f"[link=http://evil.example]m[/link]{TITLE}",
        limits=EpisodeLimits(),
        started_at=datetime.now(UTC),
        pending_cell=PendingCell(
            episode_id="e", cell=3, iteration=2, code=f"print({HOSTILE!r})", reasons=[HOSTILE],
            mode="all", since=datetime.now(UTC),
        ),
    )  # fmt: skip
    screen = io.StringIO()
    Console(file=screen, force_terminal=True, width=200).print(frame("e", progress))
    drawn = screen.getvalue()
    for sequence in NEVER:
        assert sequence not in drawn, sequence
    assert "[link=http://evil.example]" in drawn  # shown as the text it is, not made a link
