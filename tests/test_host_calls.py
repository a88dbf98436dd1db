"""The calls a cell makes out of its sandbox (activities/sandbox/host_calls.py), in process:
the sandbox's HostCalls on real pipes to a host thread that decodes every frame as the worker
does (tests/host_end.py). What a cell reads — an answer, the documented error, a tool's own
exception — and what the host receives are both checked; a real sandbox runs the same code
(tests/test_safety_mutants.py, tests/test_host_protocol.py drive it end to end)."""

from __future__ import annotations

import base64
import hashlib
import inspect
import json
import os
import pickle
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from durable_rlm.activities.sandbox import framing
from durable_rlm.activities.sandbox.framing import HEADER
from durable_rlm.activities.sandbox.host_calls import (
    NOT_LOADED,
    PICKLED,
    HostCalls,
    ToolError,
    check_prompts,
    loaded,
    prompt_list,
    text_or_error,
)
from durable_rlm.activities.tools import pickled
from durable_rlm.tools import spec_of
from durable_rlm.workflows import defaults, names
from tests.host_end import HostEnd, upper

CAP = defaults.MAX_PROMPTS_PER_CALL
LIMITS = {"max_prompts": CAP, "max_call_bytes": defaults.MAX_CALL_BYTES}


@pytest.fixture(autouse=True)
def _no_request_number() -> Iterator[None]:
    """The framing's request number is the process's: each test starts without one."""
    framing._SEQ[0] = None
    yield
    framing._SEQ[0] = None


EXIT = os._exit  # the real one: the forked sandbox of in_a_child leaves by it


class Exited(BaseException):
    """The sandbox's process would have ended here, with this status."""


@pytest.fixture(autouse=True)
def _no_exit_of_pytest(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call ends the sandbox's process when its host is gone. Made in pytest's own
    process, that would end the test run with status 0, read as a pass: here it raises."""

    def refused(status: int) -> None:
        raise Exited(status)

    monkeypatch.setattr(os, "_exit", refused)


def digest(prompt: str) -> str:
    return "sha256:" + hashlib.sha256(prompt.encode("utf-8")).hexdigest()


# --- the limits on one call ---------------------------------------------------------------------


def test_a_batch_of_exactly_the_cap_is_sent_and_one_more_is_refused_in_the_cell() -> None:
    """The cap on prompts per call is checked where the call is made: a batch of the cap goes
    to the host whole, one more raises the documented ValueError in the cell and sends
    nothing. Off by one, the host's schema would refuse it as a protocol error instead (the
    sandbox killed, the cell's error a malformed frame), or a full batch would be refused."""
    host = HostEnd()
    host.calls.limit(LIMITS)
    try:
        assert len(host.calls.call("llm_query_batched", ["p"] * CAP)) == CAP
        with pytest.raises(ValueError) as refused:
            host.calls.call("llm_query_batched", ["p"] * (CAP + 1))
    finally:
        frames = host.close()
    assert str(refused.value) == (
        f"llm_query_batched got {CAP + 1:,} prompts; at most {CAP:,} go in one call: split the list"
    )
    assert [(f["op"], len(f["prompts"])) for f in frames] == [("call", CAP)]  # the host's schema took it


def test_a_call_of_exactly_the_byte_limit_is_sent_and_one_byte_more_is_refused() -> None:
    """The byte limit counts the frame's body as the host will (its JSON, without the length
    header): a body of exactly the limit goes, one byte more raises in the cell."""
    with HostEnd() as host:
        frame = framing.encode_frame({"op": "call", "kind": "llm_query", "prompts": [""]})
        host.calls.limit({"max_call_bytes": len(frame) - HEADER.size + 10})
        assert host.calls.call("llm_query", ["x" * 10]) == [{"ok": True, "text": "X" * 10}]
        with pytest.raises(ValueError) as refused:
            host.calls.call("llm_query", ["x" * 11])
    limit = len(frame) - HEADER.size + 10
    assert str(refused.value) == (
        f"llm_query: the prompts of this call take {limit + 1:,} bytes; at most {limit:,} go in one "
        "call: send less, or split it"
    )
    assert [f["prompts"] for f in host.frames] == [["x" * 10]]


def test_the_limits_come_from_the_hosts_init_and_none_means_unlimited() -> None:
    calls = HostCalls(None, None)  # no call is made: the limits alone
    assert (calls.max_prompts, calls.max_call_bytes) == (None, None)
    calls.limit({"max_prompts": "3", "max_call_bytes": "1000", "other": 1})
    assert (calls.max_prompts, calls.max_call_bytes) == (3, 1000)
    calls.limit({"max_prompts": None})  # absent or null: kept as they were
    assert (calls.max_prompts, calls.max_call_bytes) == (3, 1000)
    fresh = HostCalls(None, None)
    fresh.limit({"max_call_bytes": 5})
    assert (fresh.max_prompts, fresh.max_call_bytes) == (None, 5)
    assert fresh.recorded is None and fresh.asked == [] and fresh.blocked_s == 0.0
    assert fresh.own_errors is False


def test_without_limits_any_batch_goes_to_the_host() -> None:
    every = {"op": "answers", "answers": [{"ok": True, "text": "A"}] * (CAP + 1)}
    with HostEnd(lambda frame: every) as host:
        answers = host.calls.call("llm_query_batched", ["a"] * (CAP + 1))
    assert len(answers) == CAP + 1  # the host's own schema refuses it: a protocol error
    assert host.frames[0]["op"] == "_broken" and "at most 1000 items" in host.frames[0]["error"]


# --- a live call --------------------------------------------------------------------------------


def test_a_call_goes_to_the_host_as_one_frame_and_its_answers_come_back_in_order() -> None:
    with HostEnd() as host:
        host.calls.limit(LIMITS)
        assert host.calls.call("llm_query_batched", ["one", "two"]) == [
            {"ok": True, "text": "ONE"},
            {"ok": True, "text": "TWO"},
        ]
        assert host.calls.call("llm_query", ["three"], "small-model") == [{"ok": True, "text": "THREE"}]
    first, second = host.frames
    assert first["op"] == "call" and first["kind"] == "llm_query_batched"
    assert first["prompts"] == ["one", "two"] and first["model"] is None and first["seq"] is None
    assert (second["kind"], second["prompts"], second["model"]) == ("llm_query", ["three"], "small-model")


def test_a_call_carries_the_number_of_the_hosts_request() -> None:
    """A frame answers the request the host sent last: a frame left over from an earlier one
    (a process the cell forked) is told apart by its number."""
    framing._SEQ[0] = 41
    with HostEnd() as host:
        host.calls.call("llm_query", ["x"])
    assert host.frames[0]["seq"] == 41


def test_the_cells_timer_stops_while_the_host_answers_and_runs_again_after() -> None:
    """Model and child time is not cell time: the cell's interval timer (its timeout) is
    stopped while the call waits, and set again to what was left after."""
    previous = signal.signal(signal.SIGALRM, lambda *_: None)
    kept = signal.setitimer(signal.ITIMER_REAL, 0)
    try:
        signal.setitimer(signal.ITIMER_REAL, 50.0)
        with HostEnd(delay_s=0.2) as host:
            host.calls.call("llm_query", ["x"])
            left = signal.getitimer(signal.ITIMER_REAL)[0]
            assert host.timers == [0.0]  # stopped while the host held the call
            assert 49.0 < left <= 50.0  # and running again, with what it had
            assert 0.2 <= host.calls.blocked_s < 5.0  # the wait is counted as the host's
            host.calls.call("llm_query", ["y"])
            assert 0.4 <= host.calls.blocked_s < 10.0  # added up over the cell's calls
        signal.setitimer(signal.ITIMER_REAL, 0.9)
        with HostEnd() as host:
            host.calls.call("llm_query", ["x"])
            assert 0.0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 0.9  # under a second left: still set
        signal.setitimer(signal.ITIMER_REAL, 0)
        with HostEnd() as host:
            host.calls.call("llm_query", ["x"])
            assert signal.getitimer(signal.ITIMER_REAL)[0] == 0.0  # no timer: none is started
    finally:
        signal.setitimer(signal.ITIMER_REAL, *kept)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize(
    "reply",
    [
        {"op": "answers", "answers": [{"ok": True, "text": "a"}, {"ok": True, "text": "b"}]},
        {"op": "answers", "answers": []},
        {"op": "answers"},
        {"op": "answer", "answers": [{"ok": True, "text": "a"}]},
    ],
    ids=["too many", "none", "no answers field", "another op"],
)
def test_an_answer_that_does_not_match_the_call_is_an_error_in_the_cell(reply: dict[str, Any]) -> None:
    with (
        HostEnd(lambda frame: reply) as host,
        pytest.raises(RuntimeError, match="^sandbox: malformed answer from host$"),
    ):
        host.calls.call("llm_query", ["x"])


def in_a_child(host_answers: bool) -> int:
    """A call made in a forked child (the sandbox's process), its host this process: the
    child's exit status, 7 when the call came back with the host's answer."""
    to_sandbox, answers = os.pipe()
    calls_read, from_sandbox = os.pipe()
    child = os.fork()
    if child == 0:  # the sandbox: whatever happens, it leaves by the real os._exit
        code: object = 3
        try:
            os.close(answers)
            os.close(calls_read)
            calls = HostCalls(open(to_sandbox, "rb"), open(from_sandbox, "wb"))  # noqa: SIM115 - the child exits
            code = 7 if calls.call("llm_query", ["x"]) == [{"ok": True, "text": "X"}] else 4
        except Exited as exited:
            code = exited.args[0]
        finally:
            EXIT(code if isinstance(code, int) else 5)
    os.close(to_sandbox)
    os.close(from_sandbox)
    with open(calls_read, "rb") as frames, open(answers, "wb") as replies:
        frame = framing.read_frame(frames)
        assert frame is not None and frame["prompts"] == ["x"]
        if host_answers:
            framing.write_frame(replies, upper(frame))
    return os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])


def test_a_call_whose_host_is_gone_ends_the_process_with_status_0() -> None:
    to_sandbox, answers = os.pipe()
    calls_read, from_sandbox = os.pipe()
    os.close(answers)  # the host went away before it answered
    calls = HostCalls(open(to_sandbox, "rb"), open(from_sandbox, "wb"))  # noqa: SIM115 - closed below
    try:
        with pytest.raises(Exited) as exited:
            calls.call("llm_query", ["x"])
        assert exited.value.args == (0,)
    finally:
        calls.channel_in.close()
        calls.channel_out.close()
        os.close(calls_read)


def test_a_sandbox_whose_host_is_gone_exits_quietly_and_one_answered_goes_on() -> None:
    """The call reads the host's answer and returns it; when the host closed the channel
    instead, the sandbox's process ends at once with status 0 (nobody is left to tell)."""
    assert in_a_child(host_answers=True) == 7
    assert in_a_child(host_answers=False) == 0


# --- a call while the REPL is rebuilt -------------------------------------------------------------


def test_while_rebuilding_calls_are_answered_from_the_log_in_order_and_nothing_is_sent() -> None:
    with HostEnd() as host:
        calls = host.calls
        calls.recorded = [{"ok": True, "text": "first"}, {"ok": False, "text": "second"}]
        assert calls.call("llm_query", ["p1"]) == [{"ok": True, "text": "first"}]
        assert calls.call("tool:t", ["p2", "p3"]) == [
            {"ok": False, "text": "second"},
            {"ok": False, "text": "replay diverged: no recorded result"},
        ]
        assert calls.asked == [
            ["llm_query", digest("p1")],
            ["tool:t", digest("p2")],
            ["tool:t", digest("p3")],
        ]
        assert calls.recorded == []
    assert host.frames == []  # the host was never asked


def test_while_rebuilding_a_call_past_the_limits_raises_as_it_did_live() -> None:
    with HostEnd() as host:
        host.calls.limit({"max_prompts": 2})
        host.calls.recorded = [{"ok": True, "text": "a"}] * 3
        with pytest.raises(ValueError, match="got 3 prompts; at most 2 go in one call"):
            host.calls.call("llm_query_batched", ["a", "b", "c"])
        assert host.calls.asked == [] and len(host.calls.recorded) == 3


# --- custom tools ---------------------------------------------------------------------------------


def weigh(item: str, /, count: int, *more: int, unit: str = "kg", **notes: str) -> dict:
    """Weigh things."""
    return {}


def tool_function(host: HostEnd, fn: Any = weigh, name: str = "weigh") -> Any:
    return host.calls.tool(spec_of(fn, name, 10.0, 1).model_dump(mode="json"))


def answering(text: str, ok: bool = True):
    return lambda frame: {"op": "answers", "answers": [{"ok": ok, "text": text}]}


def test_a_tool_in_the_repl_has_the_registered_name_signature_and_docstring() -> None:
    with HostEnd() as host:
        function = tool_function(host, name="scales")
    assert function.__name__ == function.__qualname__ == "scales"
    assert function.__doc__ == "Weigh things."
    assert str(inspect.signature(function)) == "(item, /, count, *more, unit='kg', **notes)"
    with HostEnd() as host:
        bare = host.calls.tool({"name": "bare", "params": []})
    assert bare.__doc__ is None and str(inspect.signature(bare)) == "()"
    with HostEnd() as host:
        unlisted = host.calls.tool({"name": "unlisted"})  # no params given: none taken
    assert str(inspect.signature(unlisted)) == "()"


def test_a_tools_arguments_travel_as_wire_values_and_its_json_result_comes_back() -> None:
    with HostEnd(answering('{"kg": [1, 2.5]}')) as host:
        function = tool_function(host)
        assert function("flour", 2, 3, 4, unit="g", note="dry") == {"kg": [1, 2.5]}
    (frame,) = host.frames
    assert frame["kind"] == "tool:weigh" and len(frame["prompts"]) == 1
    assert json.loads(frame["prompts"][0]) == {
        "args": ["flour", 2, 3, 4],
        "kwargs": {"unit": "g", "note": "dry"},
    }


def test_a_tool_called_against_its_signature_raises_typeerror_and_sends_nothing() -> None:
    with HostEnd() as host:
        function = tool_function(host)
        with pytest.raises(TypeError, match="missing a required argument: 'count'"):
            function("flour")
        with pytest.raises(TypeError, match=r"^weigh: a object cannot be sent"):
            function("flour", 1, unit=object())
    assert host.frames == []


def test_a_tool_that_failed_raises_toolerror_with_its_message_and_its_exception_as_cause() -> None:
    raised = KeyError("no such shelf")
    text = pickled(raised, "KeyError: 'no such shelf'", None)
    assert text is not None and text.startswith(names.TOOL_VALUE_PREFIX)
    with HostEnd(answering(text, ok=False)) as host:
        with pytest.raises(ToolError) as failure:
            tool_function(host)("flour", 1)
        assert str(failure.value) == "weigh failed: KeyError: 'no such shelf'"
        assert isinstance(failure.value.__cause__, KeyError)
        host.calls.own_errors = True  # rlms's semantics: the tool's own exception
        with pytest.raises(KeyError, match="no such shelf"):
            tool_function(host)("flour", 1)


def test_a_tool_failure_without_a_pickle_is_a_toolerror_without_a_cause() -> None:
    with HostEnd(answering("the tool is not on this worker", ok=False)) as host:
        host.calls.own_errors = True
        with pytest.raises(ToolError) as failure:
            tool_function(host)("flour", 1)
    assert str(failure.value) == "weigh failed: the tool is not on this worker"
    assert failure.value.__cause__ is None


def test_a_tool_result_that_is_no_json_value_arrives_pickled_and_loads_in_the_sandbox() -> None:
    value = {1, 2, frozenset({3})}
    text = pickled(value, repr(value), None)
    with HostEnd(answering(text)) as host:
        assert tool_function(host)("flour", 1) == value
    unloadable = PICKLED + base64.b64encode(b"not a pickle").decode() + "\n<Shelf>"
    with HostEnd(answering(unloadable)) as host, pytest.raises(ToolError) as failure:
        tool_function(host)("flour", 1)
    assert str(failure.value).startswith("weigh returned a value the REPL cannot load: <Shelf> (")


# --- the helpers' checks ------------------------------------------------------------------------


def test_a_pickled_text_loads_to_its_value_and_anything_else_is_not_loaded() -> None:
    data = base64.b64encode(pickle.dumps([1, "two"])).decode()
    assert loaded(f"{PICKLED}{data}\n[1, 'two']") == ([1, "two"], "[1, 'two']")
    assert loaded(f"{PICKLED}{data}") == ([1, "two"], "")
    assert loaded("plain text") == (NOT_LOADED, "plain text")
    missing = base64.b64encode(b"czz\nQ\n.").decode()  # the class Q of a module zz this sandbox lacks
    value, shown = loaded(f"{PICKLED}{missing}\nQ()")
    assert value is NOT_LOADED and shown == "Q() (ModuleNotFoundError: No module named 'zz')"


def test_prompts_must_be_text_and_the_model_a_name() -> None:
    check_prompts("llm_query", ["a", "b"], None)
    check_prompts("llm_query", ["a"], "m")
    with pytest.raises(TypeError) as wrong:
        check_prompts("llm_query", ["a", 3], None)
    assert str(wrong.value) == "llm_query expects str prompts, got int"
    with pytest.raises(TypeError) as model:
        check_prompts("rlm_query", ["a"], 7)
    assert str(model.value) == "rlm_query: model must be a model name (str) or None, got int"


def test_a_batch_is_any_iterable_of_text_but_never_a_lone_string() -> None:
    assert prompt_list("llm_query_batched", ("a", "b"), None) == ["a", "b"]
    assert prompt_list("llm_query_batched", (p for p in "ab"), None) == ["a", "b"]
    for lone in ("ab", b"ab", 5):
        with pytest.raises(TypeError) as refused:
            prompt_list("llm_query_batched", lone, None)
        assert (
            str(refused.value)
            == f"llm_query_batched expects a list of str prompts, got {type(lone).__name__}"
        )
    with pytest.raises(TypeError, match="^llm_query_batched expects str prompts, got int$"):
        prompt_list("llm_query_batched", ["a", 1], None)
    with pytest.raises(TypeError, match="model must be"):
        prompt_list("llm_query_batched", ["a"], 1)


def test_a_failed_answer_reads_as_an_error_string_as_in_rlms() -> None:
    assert text_or_error({"ok": True, "text": "fine"}) == "fine"
    assert text_or_error({"ok": False, "text": "timed out"}) == "Error: timed out"
