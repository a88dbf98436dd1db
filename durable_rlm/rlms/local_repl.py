"""rlms's LocalREPL (rlm/environments/local_repl.py), for programs that drive a REPL
themselves (rlms's `lm_in_repl` example): `execute_code(code)` runs a cell and returns
rlms's REPLResult; its `llm_query` calls reach the LMHandler whose address it was given.

The code runs where an episode's does: in a sandboxed process of its own (no network, no
credentials, none of this process's files), with rlms's REPL semantics (`answer`,
`context_0`, "Error: ..." strings). Nothing is durable here, as nothing is in rlms's: the
REPL lives as long as this object. `locals` holds what the sandbox shows of its variables,
read back as values where the text is a Python literal (numbers, strings, lists...): the
values themselves stay in the sandbox, as no pickle from it is loaded here.
"""

from __future__ import annotations

import ast
import asyncio
import base64
import json
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, Literal, TypeVar

from durable_rlm.activities.repl import ReplActivities
from durable_rlm.client.episodes import store_context
from durable_rlm.client.sessions import value_literal
from durable_rlm.rlms.environments import BaseEnv, validate_custom_tools
from durable_rlm.rlms.lm_handler import LMHandler, handler_at
from durable_rlm.rlms.results import RLMChatCompletion, UsageSummary
from durable_rlm.rlms.types import REPLResult
from durable_rlm.store.blobs import BlobStore, DirectoryBackend
from durable_rlm.tools import OfferedTools, spec_of
from durable_rlm.workflows import defaults, names
from durable_rlm.workflows.models import (
    CallAnswer,
    CellOutcome,
    ContextRef,
    ExecuteCellInput,
    ResumeCellInput,
    SandboxRef,
    SubCallRequest,
    ToolSpec,
)

T = TypeVar("T")
NO_HANDLER = "No LM handler configured"  # rlms's words


class LocalREPL(BaseEnv):
    """rlms's LocalREPL: a persistent namespace with the context, `llm_query` and friends."""

    def __init__(
        self,
        lm_handler_address: tuple[str, int] | None = None,
        context_payload: dict[str, Any] | list[Any] | str | None = None,
        setup_code: str | None = None,
        persistent: bool = False,
        depth: int = 1,
        subcall_fn: Callable[[str, str | None], RLMChatCompletion] | None = None,
        custom_tools: dict[str, Any] | None = None,
        custom_sub_tools: dict[str, Any] | None = None,
        compaction: bool = False,
        max_concurrent_subcalls: int = 4,
        **kwargs: Any,
    ) -> None:
        super().__init__(persistent, depth, max_concurrent_subcalls, **kwargs)
        validate_custom_tools(custom_tools)
        self.lm_handler_address = lm_handler_address
        self.subcall_fn = subcall_fn
        self.custom_tools = custom_tools or {}
        self.custom_sub_tools = custom_sub_tools if custom_sub_tools is not None else self.custom_tools
        self.compaction = compaction
        self._context_count = self._history_count = 0
        self._functions: dict[str, Callable[..., Any]] = {}
        self._specs: list[ToolSpec] = []
        data: dict[str, Any] = {}
        for name, entry in self.custom_tools.items():
            value = entry["tool"] if isinstance(entry, dict) and "tool" in entry else entry
            if callable(value):
                self._functions[name] = value
                self._specs.append(spec_of(value, name, defaults.TOOL_TIMEOUT_S, 1))
            else:
                data[name] = value
        self._dir = Path(tempfile.mkdtemp(prefix="drlm-local-repl-"))
        self.temp_dir = str(self._dir)  # rlms's: the REPL's own files, removed by cleanup()
        self._blobs = BlobStore(DirectoryBackend(self._dir / "blobs"))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="durable-rlm LocalREPL", daemon=True
        )
        self._thread.start()
        self._host = self._run(self._open())
        self._episode = f"local-repl-{uuid.uuid4().hex[:12]}"
        self._head: str | None = None
        self._cells = 0
        self._context: ContextRef | None = None
        self.locals: dict[str, Any] = {}
        if context_payload is not None:
            self.load_context(context_payload)
        if compaction:
            self.execute_code("history = []")
        if data:
            self.execute_code(OfferedTools(None, data).setup_code() or "")
        if setup_code:
            self.execute_code(setup_code)
        if not self._cells:
            self.locals = self._run(self._locals())  # the REPL starts now, as rlms's does

    # --- rlms's REPL ---------------------------------------------------------------------------

    def setup(self) -> None:
        """rlms's: make the namespace. Here the sandbox makes it when it starts."""

    def execute_code(self, code: str) -> REPLResult:
        """Run `code` as a cell; a call to llm_query waits for the handler's answer."""
        started = time.perf_counter()
        calls: list[RLMChatCompletion] = []
        outcome = self._run(self._cell(code, calls))
        stderr = outcome.stderr + (f"\n{outcome.error}" if outcome.error else "")
        self.locals = self._run(self._locals())
        return REPLResult(
            stdout=outcome.stdout,
            stderr=stderr,
            locals=dict(self.locals),
            execution_time=time.perf_counter() - started,
            rlm_calls=calls,
            final_answer=outcome.answer,
        )

    def load_context(self, context_payload: dict[str, Any] | list[Any] | str) -> None:
        self.add_context(context_payload, 0)

    def add_context(
        self, context_payload: dict[str, Any] | list[Any] | str, context_index: int | None = None
    ) -> int:
        """Bind `context_<index>` (the next index when None); index 0 is also `context`."""
        index = self._context_count if context_index is None else context_index
        if index == 0 and self._cells == 0:
            # The first context is the REPL's own, read from a file when the sandbox starts.
            self._context = store_context(self._blobs, context_payload)
        else:
            self.execute_code(f"context_{index} = {value_literal(context_payload, 'a context')}")
            if index == 0:
                self.execute_code("context = context_0")
        self._context_count = max(self._context_count, index + 1)
        return index

    def add_history(self, message_history: list[dict[str, Any]], history_index: int | None = None) -> int:
        """Bind `history_<index>` (the next index when None); index 0 is also `history`."""
        index = self._history_count if history_index is None else history_index
        self.execute_code(f"history_{index} = {value_literal(message_history, 'a history')}")
        if index == 0:
            self.execute_code("history = history_0")
        self._history_count = max(self._history_count, index + 1)
        return index

    def get_context_count(self) -> int:
        return self._context_count

    def get_history_count(self) -> int:
        return self._history_count

    def update_handler_address(self, address: tuple[str, int]) -> None:
        self.lm_handler_address = address

    def cleanup(self) -> None:
        """End the sandbox and remove the REPL's files (rlms's cleanup)."""
        if self._thread.is_alive():
            try:
                self._run(self._host.close_all())
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=30)
        shutil.rmtree(self._dir, ignore_errors=True)
        self.locals = {}

    def __enter__(self) -> LocalREPL:
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        self.cleanup()
        return False

    # --- the sandbox -----------------------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _open(self) -> ReplActivities:
        return ReplActivities(self._blobs, "local-repl", Path(tempfile.gettempdir()) / "drlm-sandboxes")

    def _ref(self) -> SandboxRef:
        return SandboxRef(
            episode_id=self._episode,
            context=self._context if self._context_count else None,
            seed=0,
            log_head=self._head,
            cell_timeout_s=defaults.CELL_TIMEOUT_S,
            output_truncation=defaults.OUTPUT_TRUNCATION,
            tools=self._specs,
            rlms=True,
        )

    async def _cell(self, code: str, calls: list[RLMChatCompletion]) -> CellOutcome:
        self._cells += 1
        outcome = await self._host.execute_cell(
            ExecuteCellInput(sandbox=self._ref(), iteration=1, cell_index=self._cells, code=code)
        )
        self._head = outcome.log_head
        while outcome.status == "suspended":
            # A batch's calls run side by side, at most max_concurrent_subcalls at once, and are
            # recorded in the order asked (rlms's).
            room = asyncio.Semaphore(max(1, self.max_concurrent_subcalls))
            done = await asyncio.gather(*(self._answered(room, request) for request in outcome.requests))
            answers = [answer for answer, _ in done]
            calls.extend(made for _, each in done for made in each)
            outcome = await self._host.resume_cell(
                ResumeCellInput(sandbox=self._ref(), cell_index=self._cells, answers=answers)
            )
            self._head = outcome.log_head
        return outcome

    async def _locals(self) -> dict[str, Any]:
        """The namespace as rlms's `locals` holds it (names of the REPL's own left out): each
        value read back from its repr where that is a literal, else the repr itself."""
        own = sorted({*names.REPL_RESERVED, *self._functions} - {"context", "answer", "history"})
        code = LOCALS_CELL.format(own=own, chars=LOCAL_CHARS)
        outcome = await self._cell(code, [])
        try:
            shown = json.loads(outcome.stdout)
        except ValueError:  # too much to show: the bounded summary instead
            return {name: text for name, text in outcome.variables.items()}
        return {name: _value(kind, text) for name, (kind, text) in shown.items()}

    async def _answered(
        self, room: asyncio.Semaphore, request: SubCallRequest
    ) -> tuple[CallAnswer, list[RLMChatCompletion]]:
        calls: list[RLMChatCompletion] = []
        async with room:
            ok, text = await asyncio.to_thread(self._call, request, calls)
        answer = CallAnswer(
            call_index=request.call_index, prompt_digest=request.prompt_digest, ok=ok, text=text
        )
        return answer, calls

    def _call(self, request: SubCallRequest, calls: list[RLMChatCompletion]) -> tuple[bool, str]:
        """One call of the cell, answered here: a tool, a child (subcall_fn) or a model."""
        kind = request.kind
        if kind.startswith(names.TOOL_KIND_PREFIX):
            return self._tool(kind.removeprefix(names.TOOL_KIND_PREFIX), request.prompt)
        if kind.startswith("rlm_query") and self.subcall_fn is not None:
            try:
                completion = self.subcall_fn(request.prompt, request.model)
            except Exception as exc:  # noqa: BLE001 - rlms's: the cell reads an error string
                return False, f"RLM query failed - {exc}"
            calls.append(completion)
            return True, completion.response
        handler = handler_at(self.lm_handler_address)
        if handler is None:
            return False, NO_HANDLER
        return self._model(handler, request, calls)

    def _model(
        self, handler: LMHandler, request: SubCallRequest, calls: list[RLMChatCompletion]
    ) -> tuple[bool, str]:
        client = handler.get_client(request.model, self.depth)
        started = time.perf_counter()
        try:
            text = client.completion(request.prompt)
        except Exception as exc:  # noqa: BLE001 - rlms's: the cell reads an error string
            return False, f"LM query failed - {exc}"
        model = request.model or client.model_name or ""
        usage = UsageSummary({model: client.get_last_usage()})
        calls.append(RLMChatCompletion(model, request.prompt, text, usage, time.perf_counter() - started))
        return True, text

    def _tool(self, name: str, arguments: str) -> tuple[bool, str]:
        """A custom tool, called in this process as rlms calls it; a value that is no JSON
        value goes back pickled (loaded only in the sandbox)."""
        function = self._functions.get(name)
        if function is None:
            return False, f"no tool named {name!r}"
        call = json.loads(arguments)
        try:
            value = function(*call["args"], **call["kwargs"])
        except Exception as exc:  # noqa: BLE001 - the cell raises it as its own type
            return False, _pickled(exc, f"{type(exc).__name__}: {exc}")
        try:
            return True, json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            return True, _pickled(value, repr(value))


def _pickled(value: Any, shown: str) -> str:
    import cloudpickle  # start-up: only for a tool's result that JSON cannot hold

    return (
        f"{names.TOOL_VALUE_PREFIX}{base64.b64encode(cloudpickle.dumps(value, protocol=5)).decode()}\n{shown}"
    )


LOCALS_CELL = (
    "print(__import__('json').dumps({{k: [type(v).__name__, repr(v)[:{chars}]] "
    "for k, v in list(globals().items()) if not k.startswith('_') and k not in {own!r}}}))"
)
LOCAL_CHARS = 10_000
LITERALS = {"str", "int", "float", "bool", "NoneType", "list", "tuple", "dict", "set", "AnswerDict"}


def _value(kind: str, text: str) -> Any:
    """A variable as the sandbox shows it (its type's name, its repr): the value where the
    repr is a literal, else the repr."""
    if kind not in LITERALS or len(text) >= LOCAL_CHARS:
        return text
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text
