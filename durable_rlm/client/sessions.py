"""A persistent session from the client's side (workflows/session.py is the workflow).

    async with rlm.session() as chat:            # or rlm.session(session_id=...) to attach
        first = await chat.acompletion(log_text, root_prompt="Which service failed?")
        again = await chat.acompletion(more_logs, root_prompt="And now?")   # same REPL

Each `completion` is a `turn` update on the session workflow; its answer is the turn
episode's result. The client builds the turn's setup cell, because the values it binds are
the client's (context_k) or in the blob store (history_j, the messages of earlier turns,
read from their conversation chains), which workflow code cannot read. A client that dies
mid-turn loses nothing: the turn runs on, and a new client attaches by the session's id,
waits for the running turn, and goes on from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, Field
from temporalio.client import Client, WorkflowHandle, WorkflowUpdateFailedError, WorkflowUpdateStage
from temporalio.common import WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError

from durable_rlm.client.episodes import (
    EpisodeEnd,
    describe_episode,
    encrypting,
    follow,
    has_search_attributes,
    store_context,
)
from durable_rlm.errors import ConfigurationError, DurableRLMError, EpisodeFailed, EpisodeIdInUse
from durable_rlm.store.blobs import BlobStore
from durable_rlm.store.chains import read_conversation
from durable_rlm.workflows import metadata, names
from durable_rlm.workflows.models import ContextRef, EpisodeRequest, EpisodeResult
from durable_rlm.workflows.session_models import (
    CloseRequest,
    SessionEnd,
    SessionStart,
    SessionState,
    TurnRequest,
    TurnResult,
)

if TYPE_CHECKING:
    from durable_rlm.worker.runtime import Services

T = TypeVar("T")

TURN_WAIT_POLL_S = 0.5
WATCH_SETTLE_S = 15.0  # a turn's watcher, after the turn answered: past rlms/follow.py's settle


class SessionClosed(DurableRLMError):
    """The session ended (closed, or idle past its timeout): start a new one."""


class SessionBusy(DurableRLMError):
    """Another client's turn came first: the message says which turn is next."""


def new_session_id() -> str:
    return f"session-{uuid.uuid4().hex[:12]}"


# --- the workflow, through Temporal ---------------------------------------------------------


async def start_session(client: Client, start: SessionStart, task_queue: str, session_id: str) -> None:
    try:
        await client.start_workflow(
            names.SESSION_WORKFLOW,
            start,
            id=session_id,
            task_queue=task_queue,
            result_type=SessionEnd,
            static_summary=metadata.shorten(f"session of {start.template.root_model.model}"),
            memo={"kind": "session", "model": metadata.shorten(start.template.root_model.model)},
            task_timeout=timedelta(seconds=start.template.durability.task_timeout_s),
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
        )
    except WorkflowAlreadyStartedError:
        raise EpisodeIdInUse(f"session id {session_id!r} is in use: attach with session_id=...") from None


def session_handle(client: Client, session_id: str) -> WorkflowHandle[Any, SessionEnd]:
    return client.get_workflow_handle(session_id, result_type=SessionEnd)


async def session_state(client: Client, session_id: str) -> SessionState:
    state: SessionState = await session_handle(client, session_id).query(
        names.SESSION_STATE, result_type=SessionState
    )
    return state


async def run_turn(
    client: Client, session_id: str, ask: TurnRequest, accepted: Callable[[], object] | None = None
) -> TurnResult:
    """The turn to its end; a refused turn raises SessionClosed or SessionBusy. `accepted`
    is called once the session took the turn (before, it may still be another client's)."""
    try:
        update = await session_handle(client, session_id).start_update(
            names.SESSION_TURN, ask, wait_for_stage=WorkflowUpdateStage.ACCEPTED, result_type=TurnResult
        )
        if accepted is not None:
            accepted()
        result: TurnResult = await update.result()
        return result
    except WorkflowUpdateFailedError as err:
        why = str(err.cause.message if err.cause is not None and hasattr(err.cause, "message") else err)
        if "the session is" in why:
            raise SessionClosed(f"session {session_id}: {why}") from None
        raise SessionBusy(f"session {session_id}: {why}") from None


async def close_session(client: Client, session_id: str, reason: str) -> SessionState | None:
    """Close it (a running turn ends first); None if it had ended already."""
    try:
        state: SessionState = await session_handle(client, session_id).execute_update(
            names.SESSION_CLOSE, CloseRequest(reason=reason), result_type=SessionState
        )
        return state
    except Exception:  # noqa: BLE001 - an ended session (idle, or closed by another client) is closed
        return None


class SessionOverview(BaseModel):
    """A session as `drlm show` / `drlm list` need it, read without a worker: its status
    (the server's), its turns' episode ids (once it ended, from its result; before, from
    visibility: `<session>-turn<k>`, which may lag a second), and how it ended."""

    session_id: str
    status: str = Field(description="the workflow's: running, completed, terminated...")
    episodes: list[str]
    end: SessionEnd | None = None


async def session_overview(client: Client, session_id: str) -> SessionOverview:
    """Raises LookupError for an id the server does not know."""
    handle = session_handle(client, session_id)
    described = await describe_episode(handle)
    if described.workflow_type != names.SESSION_WORKFLOW:
        raise LookupError(f"{session_id!r} is not a session (it is a {described.workflow_type})")
    status = described.status.name.lower() if described.status is not None else "unknown"
    end = await handle.result() if status == "completed" else None
    if end is not None:
        return SessionOverview(session_id=session_id, status=status, episodes=end.episodes, end=end)
    prefix = names.turn_episode_id(session_id, 0)[:-1]
    found = [w.id async for w in client.list_workflows(f'WorkflowId STARTS_WITH "{prefix}"')]
    turns = sorted((int(i[len(prefix) :]), i) for i in found if i[len(prefix) :].isdigit())
    return SessionOverview(session_id=session_id, status=status, episodes=[i for _, i in turns], end=end)


# --- the turn's setup cell ----------------------------------------------------------------


def value_literal(value: Any, what: str) -> str:
    """Python source that evaluates to `value` in the REPL: a string as written, other values
    through JSON (as rlms's add_context loads them)."""
    if isinstance(value, str):
        return repr(value)
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(f"{what} must be a str or a JSON value (as rlms's): {exc}") from None
    return f"__import__('json').loads({text!r})"


def turn_history(blobs: BlobStore, conversation: str | None) -> list[dict[str, str]]:
    """A turn's message history, as rlms's history_k holds it: role and content dicts."""
    return [{"role": m.role, "content": m.content} for m in read_conversation(blobs, conversation)]


def setup_cell(
    index: int | None, context: Any, from_repl: bool, histories: dict[int, list[dict[str, str]]]
) -> str | None:
    """Binds context_<index> (`from_repl`: the REPL's `context`, loaded from the blob store
    when the sandbox starts) and the histories the REPL lacks (history_0 is also `history`),
    as rlms's add_context / add_history do."""
    lines = []
    if index is not None:
        value = "context" if from_repl else value_literal(context, "a turn's context")
        lines.append(f"context_{index} = {value}")
    for number, messages in sorted(histories.items()):
        lines.append(f"history_{number} = {value_literal(messages, 'a history')}")
        if number == 0:
            lines.append("history = history_0")
    return "\n".join(lines) or None


# --- Session ------------------------------------------------------------------------------


class Session:
    """A persistent session: successive completions share one REPL (rlms's `persistent=True`).
    Made by `DurableRLM.session()`; `id` names it for `drlm show` and for attaching."""

    def __init__(
        self,
        template: EpisodeRequest,
        request: Callable[[ContextRef | None, str | None], EpisodeRequest],
        check_credentials: Callable[[], None],
        services: Callable[[str | None, bool], contextlib.AbstractAsyncContextManager[Services]],
        embedded: bool,
        shared_queue: str,
        session_id: str | None = None,
        idle_timeout: timedelta | float | None = None,
        turns_per_run: int | None = None,
    ) -> None:
        self._template = template
        self._request = request
        self._check_credentials = check_credentials
        self._open_services = services
        self._embedded = embedded
        self._shared_queue = shared_queue
        self._attaching = session_id is not None
        self.id = session_id or new_session_id()
        if isinstance(idle_timeout, int | float):
            idle_timeout = timedelta(seconds=idle_timeout)
        timeout: dict[str, Any] = {"idle_timeout": idle_timeout} if idle_timeout is not None else {}
        self._start = SessionStart(template=template, turns_per_run=turns_per_run, **timeout)
        self._queue: str | None = None
        self._started = False
        self._held: Services | None = None
        self._stack: contextlib.AsyncExitStack | None = None

    # --- opening --------------------------------------------------------------------------

    def __enter__(self) -> Session:
        """`with rlm.session() as s:` in synchronous code: each `completion()` connects for
        its turn; leaving the block closes the session."""
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Session:
        stack = contextlib.AsyncExitStack()
        try:
            await stack.enter_async_context(self.opened())
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @contextlib.asynccontextmanager
    async def opened(self) -> AsyncIterator[Services]:
        """Hold one connection (and, embedded, one worker) for the calls inside the block."""
        if self._held is not None:
            yield self._held
            return
        async with self._services() as services:
            self._held = services
            try:
                yield services
            finally:
                self._held = None

    @contextlib.asynccontextmanager
    async def _services(self) -> AsyncIterator[Services]:
        """Held services, or this call's own, whose embedded worker polls the session's queue
        (the session's workflow tasks and its turns' go there, whichever process runs it)."""
        if self._held is not None:
            yield self._held
            return
        if self._queue is None:
            if not self._embedded:
                self._queue = self._shared_queue
            elif self._attaching:
                async with self._open_services(None, False) as services:
                    described = await session_handle(services.client, self.id).describe()
                    self._queue = described.task_queue
            else:
                self._queue = f"{self._shared_queue}.session-{uuid.uuid4().hex[:12]}"
        async with self._open_services(self._queue, True) as services:
            yield services

    async def _ensure_started(self, services: Services) -> None:
        if self._started or self._attaching:
            return
        start = self._start
        if encrypting(services.client) and not start.template.private_text:
            # As start_episode: encrypted payloads keep the task out of the search attributes.
            template = start.template.model_copy(update={"private_text": True})
            start = start.model_copy(update={"template": template})
        if await has_search_attributes(services.client):
            start = start.model_copy(update={"search_attributes": True})
        await start_session(services.client, start, services.settings.task_queue, self.id)
        self._started = True

    # --- turns ------------------------------------------------------------------------------

    async def state(self) -> SessionState:
        async with self._services() as services:
            return await session_state(services.client, self.id)

    async def turn(
        self,
        context: Any = None,
        root_prompt: str | None = None,
        watch: Callable[[str], Awaitable[object]] | None = None,
    ) -> TurnResult:
        """Run one turn to its end: the raw result (the turn's EpisodeResult, or its error).
        `watch(episode_id)` runs beside it from the moment the turn's episode id is known
        (the episode may not have started yet): rlms's live callbacks follow the turn so."""
        self._request(None, root_prompt)  # a bad task is reported before anything else
        self._check_credentials()
        async with self._services() as services:
            await self._ensure_started(services)
            state = await self._after_running_turn(services)
            if not state.open:
                raise SessionClosed(f"session {self.id} has ended ({state.ended_by or state.closing})")
            k = len(state.turns)
            records = {t.turn: t for t in state.turns}
            histories = {}
            for number, turn in enumerate(state.unbound, start=state.histories):
                conversation = records[turn].conversation
                histories[number] = await asyncio.to_thread(turn_history, services.blobs, conversation)
            # The first context is the REPL's `context` (as one-shot episodes have it); later
            # ones are bound by the turn's setup cell.
            from_repl = state.repl.log_head is None and context is not None
            ref = await asyncio.to_thread(store_context, services.blobs, context) if from_repl else None
            index = state.contexts if context is not None else None
            ask = TurnRequest(
                turn=k,
                task=self._request(ref, root_prompt).task,
                context=ref,
                setup_code=setup_cell(index, context, from_repl, histories),
                context_index=index,
                history_turns=list(state.unbound),
            )
            if watch is None:
                return await run_turn(services.client, self.id, ask)
            episode_id = names.turn_episode_id(self.id, k)
            watching: list[asyncio.Future[object]] = []

            def accepted() -> None:
                watching.append(asyncio.ensure_future(watch(episode_id)))

            try:
                done = await run_turn(services.client, self.id, ask, accepted)
                if watching and done.result is not None:
                    # The watcher sees the turn's end on its own: a moment for its last callbacks.
                    await asyncio.wait(watching, timeout=WATCH_SETTLE_S)
                return done
            finally:
                for task in watching:
                    if not task.done():
                        task.cancel()
                if watching:  # its end, without taking a cancellation meant for the caller
                    await asyncio.wait(watching)
                    if not watching[0].cancelled():
                        watching[0].exception()  # retrieved: best effort, the turn's answer counts

    async def _after_running_turn(self, services: Services) -> SessionState:
        """The session's state once no turn runs (another client's may still)."""
        while True:
            state = await session_state(services.client, self.id)
            if state.running is None:
                return state
            await asyncio.sleep(TURN_WAIT_POLL_S)

    async def acompletion(
        self,
        context: Any = None,
        root_prompt: str | None = None,
        watch: Callable[[str], Awaitable[object]] | None = None,
    ) -> EpisodeResult:
        """A turn's result; raises EpisodeFailed when the turn ended without one."""
        done = await self.turn(context, root_prompt, watch)
        if done.result is not None:
            if done.result.status == "failed":
                end = EpisodeEnd(episode_id=done.episode_id, status="failed", result=done.result)
                raise EpisodeFailed(end)
            return done.result
        async with self._services() as services:
            handle = services.client.get_workflow_handle(done.episode_id, result_type=EpisodeResult)
            end = await follow(handle)
        if end.result is None or end.status == "failed":
            raise EpisodeFailed(end if end.error else end.model_copy(update={"error": done.error}))
        return end.result

    def completion(self, context: Any = None, root_prompt: str | None = None) -> EpisodeResult:
        return _blocking(self.acompletion(context, root_prompt))

    # --- the end ------------------------------------------------------------------------------

    async def aclose(self, reason: str = "closed by the client") -> SessionState | None:
        """End the session (a running turn ends first) and release this client's worker."""
        try:
            if self._started or self._attaching:
                async with self._services() as services:
                    return await close_session(services.client, self.id, reason)
            return None
        finally:
            stack, self._stack = self._stack, None
            if stack is not None:
                await stack.aclose()

    def close(self, reason: str = "closed by the client") -> SessionState | None:
        return _blocking(self.aclose(reason))


def _blocking(coro: Coroutine[Any, Any, T]) -> T:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise ConfigurationError("this call blocks; inside an event loop, await its async form")
