"""A model's reply is read up to max_reply_chars and cut there, saying so: replies of tens of
megabytes through the real clients and real episodes, and every scan of model text in
workflow code on the worst replies we could think of.

The reports this answers: a reply of 15 Mi fence lines failed every workflow task of its
episode ("[TMPRL1101] Potential deadlock detected") for ever; a FINAL of 100 MB crashed the
worker or took it to 3 GB. Each attack here runs through a real episode on a worker, followed
by an honest episode on that worker at its usual speed and within 100 MB of its memory.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from durable_rlm.activities.llm import ModelActivities
from durable_rlm.activities.reply_limits import CUT_NOTE, body_cap, cut_reply, text_of_cut_body
from durable_rlm.scripted import ChatRequest, Reply
from durable_rlm.store.blobs import BlobStore, DirectoryBackend
from durable_rlm.workflows import defaults, metadata, risk
from durable_rlm.workflows.fallback import parse_extraction_response
from durable_rlm.workflows.models import EpisodeLimits, Message, ModelSettings
from durable_rlm.workflows.parsing import parse_final_signal, parse_reply, unquote_argument
from durable_rlm.workflows.signals import build_action, stated_confidence
from durable_rlm.workflows.termination import ActionResult, PolicyContext, PolicyRegistry
from durable_rlm.workflows.typed_outputs import FieldSpec
from tests.big_replies import MB
from tests.conftest import ROOT, request_for, run_episode
from tests.worker_health import RssPeak, WorkerHealth

LIMIT = defaults.MAX_REPLY_CHARS
NOTE_CHARS = len(CUT_NOTE.format(kept=LIMIT, limit=LIMIT))

# --- the cut ------------------------------------------------------------------------------------


def test_a_reply_within_the_limit_is_kept_as_it_is() -> None:
    assert cut_reply("x" * 1_000, 1_000) == ("x" * 1_000, None)


def test_a_longer_reply_is_cut_and_ends_with_a_note_the_model_reads() -> None:
    text, kept = cut_reply("FINAL(" + "A" * 5_000 + ")", 1_000)
    assert kept == 1_000 and text.startswith("FINAL(AAA")
    assert text.endswith("characters of a reply; the rest was not read]")
    assert "max_reply_chars = 1,000" in text
    # The note closes nothing: a cut FINAL( is no answer, a cut block is not run.
    assert parse_final_signal(text) is None
    assert parse_reply("```repl\n" + "x = 1\n" * 500, ["repl"], 16).code_blocks == []
    cut_block, _ = cut_reply("```repl\n" + "x = 1\n" * 500 + "```", 1_000)
    assert parse_reply(cut_block, ["repl"], 16).code_blocks == []


def test_a_text_that_is_not_whole_is_cut_even_under_the_limit() -> None:
    text, kept = cut_reply("partial", 1_000, whole=False)
    assert kept == len("partial") and text.startswith("partial\n\n[drlm: this reply was cut here")


def test_the_body_cap_holds_the_limit_in_the_costliest_encoding() -> None:
    escaped = json.dumps({"choices": [{"message": {"content": "\U0001f600" * 1_000}}]}).encode()
    assert len(escaped) <= body_cap(1_000)
    assert body_cap(LIMIT) < 13 * MB  # what the worker may hold of one reply's body


@pytest.mark.parametrize(
    ("head", "api", "expected"),
    [
        (b'{"choices":[{"index":0,"message":{"role":"assistant","content":"abc', "openai", ("abc", False)),
        (
            b'{"choices":[{"message":{"content":"done"},"logprobs":{"content":[{"token":"a","lo',
            "openai",
            ("done", True),
        ),
        (b'{"id":"chatcmpl-1","choices":[{"index":0,"mess', "openai", ("", False)),
        (b'{"content":[{"type":"text","text":"hel', "anthropic", ("hel", False)),
        (b'{"content":[{"type":"text","text":"a"},{"type":"text","text":"b', "anthropic", ("ab", False)),
        (b"<html>" + b"x" * 100, "openai", ("", False)),
        (b"[" * 100_000, "openai", ("", False)),  # nested past the parser's depth
        (b'{"choices":[{"message":{"content":"\\ud83d', "openai", ("", False)),  # half a character
    ],
)
def test_the_text_of_a_cut_body(head: bytes, api: str, expected: tuple[str, bool]) -> None:
    assert text_of_cut_body(head, api) == expected


def test_max_reply_chars_is_an_episode_limit_with_a_ceiling() -> None:
    assert EpisodeLimits().max_reply_chars == LIMIT
    assert EpisodeLimits(max_reply_chars=50_000).max_reply_chars == 50_000
    with pytest.raises(ValidationError, match="max_reply_chars"):
        EpisodeLimits(max_reply_chars=defaults.MAX_REPLY_CHARS_CEILING + 1)


# --- the real clients, a server in a process of its own -----------------------------------------


@pytest.fixture
def models(tmp_path: Path) -> ModelActivities:
    return ModelActivities(BlobStore(DirectoryBackend(tmp_path / "blobs")))


def served_apart(name: str) -> tuple[subprocess.Popen[str], str]:
    """A scripted server for BIG_REPLIES[name] in its own process: what it holds to send a
    reply is not in this process, whose memory is the worker's."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.big_replies", name], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    return process, process.stdout.readline().strip()


@pytest.mark.parametrize(
    ("name", "provider", "cut"),
    [
        ("fence lines", "openai", True),
        ("open FINAL", "openai", True),
        ("open FINAL", "anthropic", True),
        ("astral characters", "openai", True),
        ("gzip bomb", "openai", True),
        ("logprob flood", "openai", False),
    ],
)
async def test_a_reply_of_tens_of_megabytes_is_read_only_up_to_its_cap(
    models: ModelActivities, name: str, provider: str, cut: bool
) -> None:
    process, base_url = served_apart(name)
    try:
        if provider == "anthropic":
            settings = ModelSettings(model="anthropic:scripted", base_url=base_url.removesuffix("/v1"))
        else:
            settings = ModelSettings(model="scripted", base_url=base_url, logprobs=True)
        await models.complete(settings, [Message(role="user", content="warm up the client")], 1_000)
        async with RssPeak() as memory:
            began = time.monotonic()
            done = await models.complete(settings, [Message(role="user", content="hi")])
            took = time.monotonic() - began
    finally:
        process.kill()
        process.wait()
    print(f"{name} ({provider}): {took:.2f} s, worker peak +{memory.growth:.0f} MB")
    assert memory.growth < 100, memory.growth  # one reply's body is at most ~12 MB
    if cut:
        assert done.facts.reply_cut_at == LIMIT
        assert len(done.text) == LIMIT + NOTE_CHARS and done.text.endswith("the rest was not read]")
    else:
        assert done.facts.reply_cut_at is None and done.text == "FINAL(short)"


async def test_an_error_reply_is_read_only_for_its_head(models: ModelActivities, scripted) -> None:
    server = scripted(lambda _r: Reply(status=500, error="overloaded " + "x" * (30 * MB)))
    settings = ModelSettings(model="scripted", base_url=server.base_url)
    with pytest.raises(Exception, match="500") as caught:
        await models.complete(settings, [Message(role="user", content="hi")])
    assert len(str(caught.value)) < 5_000


async def test_a_compressed_reply_within_the_limit_reads_as_any_other(
    models: ModelActivities, scripted
) -> None:
    server = scripted(lambda _r: Reply("FINAL(zipped)", gzip=True))
    done = await models.complete(
        ModelSettings(model="scripted", base_url=server.base_url), [Message(role="user", content="hi")]
    )
    assert done.text == "FINAL(zipped)" and done.facts.reply_cut_at is None


# --- real episodes --------------------------------------------------------------------------------

CELL = "```repl\nprint('hi')\n```"


def attack_script(attack: Callable[[], str], sub: Callable[[], str] | None = None):
    """A cell, then the attack, then FINAL(done); the big text is built only when it is sent."""

    def script(request: ChatRequest) -> Reply | str:
        if not request.is_root:
            return sub() if sub is not None else request.last_user.upper()
        if request.turn == 0:
            return CELL
        return attack() if request.turn == 1 else "FINAL(done)"

    return script


EPISODE_ATTACKS: dict[str, dict[str, Callable[[], str]]] = {
    "fence lines": {"attack": lambda: "```\n" * (15 * MB)},
    "open FINAL": {"attack": lambda: "FINAL(" + "A" * (100 * 10**6) + ")"},
    "sub-call reply": {
        "attack": lambda: "```repl\nr = llm_query('big')\nprint(len(r), r[-40:])\n```",
        "sub": lambda: "x" * (60 * 10**6),
    },
}


async def workflow_tasks(client, episode_id: str) -> tuple[int, float]:
    """(workflow tasks that failed, the longest one in seconds) of an episode's history."""
    history = await client.get_workflow_handle(episode_id).fetch_history()
    failed, longest, started = 0, 0.0, None
    for event in history.events:
        at = event.event_time.ToDatetime()
        if event.HasField("workflow_task_started_event_attributes"):
            started = at
        elif event.HasField("workflow_task_failed_event_attributes"):
            failed += 1
        if started is not None and event.HasField("workflow_task_completed_event_attributes"):
            longest = max(longest, (at - started).total_seconds())
    return failed, longest


@pytest.fixture(params=[True, False], ids=["hook-on", "hook-off"])
async def health(request: pytest.FixtureRequest, client, worker, scripted) -> WorkerHealth:
    """The worker, warmed up, with the sandbox's audit hook on and off: a reply never reaches
    a sandbox, so the bound is the worker's own either way."""
    worker.config.audit_hook = request.param
    return await WorkerHealth.measure(client, worker, scripted)


@pytest.mark.parametrize("name", EPISODE_ATTACKS)
async def test_a_reply_of_tens_of_megabytes_is_cut_and_the_episode_goes_on(
    client, worker, scripted, health: WorkerHealth, name: str
) -> None:
    server = scripted(attack_script(**EPISODE_ATTACKS[name]))
    episode_id = f"big-reply-{uuid.uuid4().hex[:8]}"
    result = await run_episode(
        client, request_for(server, limits=EpisodeLimits(max_iterations=5)), worker.task_queue, episode_id
    )
    assert result.answer == "done", result
    failed, longest = await workflow_tasks(client, episode_id)
    print(f"{name}: longest workflow task {longest:.2f} s")
    assert failed == 0  # no task ran into the deadlock detector
    after = [r for r in server.root_requests() if r.turn == 2][0]
    told = after.messages[-2]["content"] if name != "sub-call reply" else after.last_user
    if name == "sub-call reply":
        assert f"{LIMIT + NOTE_CHARS} " in told and "the rest was not read]" in told  # what the cell printed
    else:
        assert told.endswith("characters of a reply; the rest was not read]")  # its own reply, cut
    await health.check(client, worker, scripted)


async def test_a_reply_at_the_ceiling_is_read_in_well_under_the_deadlock_detectors_time(
    client, worker, scripted, health: WorkerHealth
) -> None:
    ceiling = defaults.MAX_REPLY_CHARS_CEILING
    server = scripted(attack_script(lambda: "```\n" * (ceiling // 4) + "FINAL(" + "(" * ceiling))
    episode_id = f"ceiling-{uuid.uuid4().hex[:8]}"
    limits = EpisodeLimits(max_iterations=5, max_reply_chars=ceiling)
    result = await run_episode(client, request_for(server, limits=limits), worker.task_queue, episode_id)
    assert result.answer == "done", result
    failed, longest = await workflow_tasks(client, episode_id)
    print(f"a reply of {ceiling:,} characters: longest workflow task {longest:.2f} s")
    assert failed == 0
    await health.check(client, worker, scripted)


# --- workflow code on the worst replies -------------------------------------------------------------

SIZE = 10_500_000


def repeated(unit: str) -> Callable[[], str]:
    return lambda: unit * (SIZE // len(unit))


WORST_TEXTS: dict[str, Callable[[], str]] = {
    "fence lines": repeated("```\n"),
    "repl blocks": repeated("```repl\nx\n```\n"),
    "inline openers": repeated("x ```repl "),
    "inline openers and blanks": repeated("```repl \n \n"),
    "json blocks": repeated("```json\n[]\n```\n"),
    "info lines": repeated("```python ```\n"),
    "an open fence": lambda: "```repl\n" + "x\n" * (SIZE // 2),
    "backticks": repeated("`"),
    "an open FINAL": lambda: "FINAL(" + "A" * SIZE,
    "FINAL and opening parentheses": lambda: "FINAL(" + "(" * SIZE,
    "nested parentheses": lambda: "FINAL(" + "(" * (SIZE // 2) + ")" * (SIZE // 2 - 1),
    "FINAL lines": repeated("FINAL(\n"),
    "FINAL_VAR and quotes": lambda: "FINAL_VAR(" + "'" * SIZE,
    "an open string": lambda: 'FINAL("' + "\\" * (SIZE // 2),
    "triple quotes": lambda: "FINAL(" + '"""' * (SIZE // 3),
    "CONFIDENCE lines": repeated("CONFIDENCE: 0.5\n"),
    "newlines": repeated("\n"),
    "nested JSON": repeated("["),
    "a JSON object of many keys": lambda: "{" + '"a":1,' * (SIZE // 6) + "}",
}

_FIELDS = [FieldSpec(name="answer", type="string")]
_POLICY = PolicyRegistry.get_termination("final_pattern")
_CONTEXT = PolicyContext(task="t", step=0, variables={}, metrics={})

WORKFLOW_SCANS: dict[str, Callable[[str], object]] = {
    "parse_reply": lambda text: parse_reply(text, ["repl"], defaults.MAX_CELLS_PER_REPLY),
    "parse_reply, fences as rlms finds them": lambda text: parse_reply(
        text, ["repl"], defaults.MAX_CELLS_PER_REPLY, inline=True
    ),
    "parse_final_signal": parse_final_signal,
    "unquote_argument": unquote_argument,
    "stated_confidence": stated_confidence,
    "build_action": lambda text: build_action(
        None, [(text, text, text)], text, None, show_printed=True, limit=defaults.POLICY_TEXT_CHARS
    ),
    "parse_extraction_response": lambda text: parse_extraction_response(text, _FIELDS),
    "cell_summary": lambda text: metadata.cell_summary(1, text),
    "risk": risk.assess,
    "final_pattern policy": lambda text: _POLICY.decide(
        ActionResult("code", True, text[: defaults.POLICY_TEXT_CHARS], {}), _CONTEXT
    ),
}


@pytest.mark.parametrize("shape", WORST_TEXTS)
def test_no_scan_of_model_text_in_workflow_code_takes_a_second_on_ten_megabytes(shape: str) -> None:
    """Workflow tasks read replies (here 10 MB, past the largest max_reply_chars), printed
    output and extraction replies; each scan is measured in this thread's CPU time, so other
    work on the machine does not count, and must raise nothing (a raise fails the task, which
    Temporal retries for ever)."""
    text = WORST_TEXTS[shape]()
    slow = {}
    for name, scan in WORKFLOW_SCANS.items():
        began = time.thread_time()
        scan(text)
        spent = time.thread_time() - began
        if spent >= 1.0:
            slow[name] = round(spent, 2)
    assert not slow, slow


_CONFIDENCE_LINE = re.compile(r"^[ \t]*CONFIDENCE[ \t]*[:=][ \t]*([0-9]*\.?[0-9]+)[ \t]*(%?)", re.M | re.I)


def reference_confidence(text: str) -> float | None:
    """The rule as first written: every CONFIDENCE line found, the last one counts."""
    found = _CONFIDENCE_LINE.findall(text)
    if not found:
        return None
    number, percent = found[-1]
    value = float(number) / (100 if percent or float(number) > 1 else 1)
    return value if 0.0 <= value <= 1.0 else None


@given(
    st.lists(st.sampled_from(["CONFIDENCE: 0.4", "confidence = 85%", " \t", "\n", "x", "0.7", ":", "%"])).map(
        "".join
    )
)
def test_the_last_stated_confidence_is_found_from_the_end(text: str) -> None:
    assert stated_confidence(text) == reference_confidence(text)
