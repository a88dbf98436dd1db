"""A cell's calls out of the sandbox: model calls, child episodes and custom tools.

Each suspends the running cell: the call goes to the host as a frame, the workflow runs it
as an activity (or a child workflow), and the cell goes on with the answer (DESIGN, "REPL
cells as resumable coroutines"). While the REPL is rebuilt the same calls are answered
from the log instead, by position, and what each asked is noted so the host can tell where
re-run code diverged. Standard library only, like everything the sandbox loads.
"""

from __future__ import annotations

import base64
import hashlib
import inspect
import json
import os
import pickle
import signal
from typing import Any, BinaryIO

from . import values
from .framing import HEADER, encode_frame, numbered, read_frame
from .volatile import WALL


class ToolError(RuntimeError):
    """A custom tool failed (it raised, timed out, or is not on the worker)."""


class HostCalls:
    """The channel a cell's calls take, and the log's answers while the REPL is rebuilt."""

    def __init__(self, channel_in: BinaryIO, channel_out: BinaryIO) -> None:
        self.channel_in = channel_in
        self.channel_out = channel_out
        self.recorded: list[dict[str, Any]] | None = None  # answers served while rebuilding
        self.asked: list[list[str]] = []  # [kind, prompt digest] of each call while rebuilding
        self.blocked_s = 0.0  # time the running cell spent waiting on the host
        # The host's limits on one call (workflows/defaults.py, sent with init): a call past
        # them is refused here, in the cell; the host refuses a frame past them regardless.
        self.max_prompts: int | None = None
        self.max_call_bytes: int | None = None
        self.own_errors = False  # a tool's exception reaches the cell as its own type (rlms's)

    def limit(self, message: dict[str, Any]) -> None:
        """Take the host's limits on one call from its init message."""
        if message.get("max_prompts") is not None:
            self.max_prompts = int(message["max_prompts"])
        if message.get("max_call_bytes") is not None:
            self.max_call_bytes = int(message["max_call_bytes"])

    def call(self, kind: str, prompts: list[str], model: str | None = None) -> list[dict[str, Any]]:
        """Suspend the cell at calls of one kind; the workflow routes them by kind. While the
        REPL is rebuilt, the calls are answered from the log instead, by position. A call
        past the host's limits raises in the cell, live or rebuilt alike."""
        if self.max_prompts is not None and len(prompts) > self.max_prompts:
            raise ValueError(
                f"{kind} got {len(prompts):,} prompts; at most {self.max_prompts:,} go in one call: "
                "split the list"
            )
        frame: dict[str, Any] = {"op": "call", "kind": kind, "prompts": prompts}
        if model is not None:
            frame["model"] = model
        data = encode_frame(numbered(frame))
        if self.max_call_bytes is not None and len(data) - HEADER.size > self.max_call_bytes:
            raise ValueError(
                f"{kind}: the prompts of this call take {len(data) - HEADER.size:,} bytes; at most "
                f"{self.max_call_bytes:,} go in one call: send less, or split it"
            )
        if self.recorded is not None:
            answers = []
            for prompt in prompts:
                self.asked.append([kind, "sha256:" + hashlib.sha256(prompt.encode("utf-8")).hexdigest()])
                missing = {"ok": False, "text": "replay diverged: no recorded result"}
                answers.append(self.recorded.pop(0) if self.recorded else missing)
            return answers
        remaining, _ = signal.setitimer(signal.ITIMER_REAL, 0)  # model and child time is not cell time
        waited = WALL()
        self.channel_out.write(data)
        self.channel_out.flush()
        reply = read_frame(self.channel_in)
        self.blocked_s += WALL() - waited
        if reply is None:
            os._exit(0)
        if remaining > 0:
            signal.setitimer(signal.ITIMER_REAL, remaining)
        answers = reply.get("answers", [])
        if reply.get("op") != "answers" or len(answers) != len(prompts):
            raise RuntimeError("sandbox: malformed answer from host")
        return answers

    def tool(self, spec: dict[str, Any]) -> Any:
        """A REPL function with the tool's name, parameters and docstring. Its call suspends
        the cell like llm_query; the workflow runs the tool as an activity."""
        params = [
            inspect.Parameter(
                p["name"],
                getattr(inspect.Parameter, p["kind"].upper()),
                default=p.get("default") if p.get("has_default") else inspect.Parameter.empty,
            )
            for p in spec.get("params", [])
        ]
        signature = inspect.Signature(params)
        name = spec["name"]

        def call(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)  # TypeError, as a real call would raise
            try:
                # What the worker decodes without unpickling: JSON values, and the other types
                # rlms's in-process tools take (tuple, set, bytes, date, Decimal, ...).
                payload = values.dumps({"args": list(bound.args), "kwargs": bound.kwargs})
            except (TypeError, ValueError) as exc:
                raise TypeError(f"{name}: {exc}") from None
            answer = self.call(f"tool:{name}", [payload])[0]
            text = str(answer["text"])
            if not answer["ok"]:
                raised, shown = loaded(text)
                if isinstance(raised, BaseException) and self.own_errors:
                    raise raised
                cause = raised if isinstance(raised, BaseException) else None
                raise ToolError(f"{name} failed: {shown}") from cause
            if text.startswith(PICKLED):
                value, shown = loaded(text)
                if value is NOT_LOADED:
                    raise ToolError(f"{name} returned a value the REPL cannot load: {shown}")
                return value
            return json.loads(text)

        call.__name__ = call.__qualname__ = name
        call.__doc__ = spec.get("doc") or None
        call.__signature__ = signature  # type: ignore[attr-defined]  # what inspect.signature and help() read
        return call


PICKLED = "pickle:"  # the worker's names.TOOL_VALUE_PREFIX
NOT_LOADED = object()


def loaded(text: str) -> tuple[Any, str]:
    """A tool's pickled result or exception (`pickle:<base64>\\n<what it shows>`), loaded
    here in the sandbox, and what it shows; NOT_LOADED when it is no pickle or does not load
    (its class is in a module this sandbox lacks)."""
    if not text.startswith(PICKLED):
        return NOT_LOADED, text
    data, _, shown = text[len(PICKLED) :].partition("\n")
    try:
        return pickle.loads(base64.b64decode(data)), shown
    except Exception as exc:  # noqa: BLE001 - a missing module, a broken pickle
        return NOT_LOADED, f"{shown} ({type(exc).__name__}: {exc})"


def check_prompts(helper: str, prompts: list[Any], model: Any) -> None:
    """A helper's prompts are text and its model a name: said in the cell, as Python would."""
    for prompt in prompts:
        if not isinstance(prompt, str):
            raise TypeError(f"{helper} expects str prompts, got {type(prompt).__name__}")
    if model is not None and not isinstance(model, str):
        raise TypeError(f"{helper}: model must be a model name (str) or None, got {type(model).__name__}")


def prompt_list(helper: str, prompts: Any, model: Any) -> list[str]:
    """A batched helper's prompts, as a list (a lone string is refused, not iterated)."""
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__iter__"):
        raise TypeError(f"{helper} expects a list of str prompts, got {type(prompts).__name__}")
    items = list(prompts)
    check_prompts(helper, items, model)
    return items


def text_or_error(answer: dict[str, Any]) -> str:
    """An answer as batched helpers and rlm_query return it: a failure is "Error: ...", as in
    rlms, so the calling code goes on."""
    return answer["text"] if answer["ok"] else f"Error: {answer['text']}"
