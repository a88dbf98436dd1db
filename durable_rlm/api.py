"""The Python API: one object, one call, as with rlms, and durability for free.

    from durable_rlm import DurableRLM

    rlm = DurableRLM(model="gpt-4o-mini", max_depth=2)
    result = rlm.completion(context=huge_text, root_prompt="Which service failed most?")
    print(result.answer, result.ended_by, result.model_calls)

With no TEMPORAL_ADDRESS it starts the same embedded server and in-process worker as the
CLI (which is built on this class); with one it is a client only and `python worker.py`
does the work. `completion` blocks, `acompletion` awaits, and `start` (inside `async with
rlm:`) returns an `Episode` handle: `id`, `result()`, `progress()`, `cancel()`, `reward()`,
`retry_credentials()` (a refused key pauses an episode: `result()` raises EpisodeFailed
with status "paused" and what to fix), and a person's steering: `hint()`, `set_limits()`,
`pause()`, `resume()`, `finish_now()`, `pending_cell()`, `approve()`, `reject()` (each a
validated Temporal update recorded with its sender; docs/guides/supervising.md).
`session()` returns a persistent session (rlms's `persistent=True`): successive completions
are turns over one REPL, in one durable workflow (durable_rlm/client/sessions.py).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from durable_rlm.endpoints import missing_key
from durable_rlm.errors import EpisodeFailed
from durable_rlm.plugins import import_policy_modules, import_tool_modules
from durable_rlm.request_template import RunOptions, episode_request, request_template
from durable_rlm.server.embedded import abandon_early, acquire_early
from durable_rlm.settings import ConfigurationError, Settings
from durable_rlm.telemetry.sdk_logs import quiet_sdk_failures
from durable_rlm.workflows.models import (
    ContextRef,
    EpisodeProgress,
    EpisodeRequest,
    EpisodeResult,
    ModelSettings,
    PendingCell,
    RewardReceipt,
)

# Start-up (docs/architecture/decisions.md#start-up-pays-only-for-what-it-uses): importing
# this module is what `from durable_rlm import DurableRLM`
# costs, so what only a running episode needs (temporalio, the stores and SQLAlchemy) is
# imported inside the methods that run one, each import with its reason.
if TYPE_CHECKING:
    from durable_rlm.client.episodes import CancelOutcome, CredentialsOutcome, EpisodeEnd
    from durable_rlm.client.sessions import Session as PersistentSession
    from durable_rlm.client.steering import SteeringOutcome
    from durable_rlm.timetravel.rerun import RerunReport
    from durable_rlm.worker.runtime import Services


class DurableRLM:
    def __init__(
        self,
        model: str,
        *,
        api_key: str | None = None,
        settings: Settings | None = None,
        options: RunOptions | None = None,
        **values: Any,
    ) -> None:
        """How its episodes run is `RunOptions` (durable_rlm/request_template.py), given as
        keywords (`max_depth=2`, `tools=[...]`, a limit by its name: `max_iterations=10`) or
        whole as `options`. Everything is checked here, before anything starts: an unknown
        name, a bad limit, policy, tool, sampling key or output schema raises
        ConfigurationError or InvalidRequestError. `api_key` is the model's key for the
        embedded worker (never stored in history); `settings` default to the environment's."""
        _freeze_at_exit()
        self.settings = settings or Settings.from_env()
        import_policy_modules(self.settings.policy_module_names)
        import_tool_modules(self.settings.tool_module_names)
        if api_key and not self.settings.embedded:
            raise ConfigurationError(
                "api_key only works with the embedded worker; with TEMPORAL_ADDRESS set, give "
                "the key to the worker process (in its environment)"
            )
        if options is not None and values:
            raise ConfigurationError("give the options either whole (options=...) or as keywords, not both")
        if options is not None:
            self.options = options if options.model == model else options.model_copy(update={"model": model})
        else:
            self.options = RunOptions.of(model, values)
        self.template = request_template(self.options, self.settings)
        self.credentials = {self.template.root_model.api_key_env: api_key} if api_key else {}
        self._services: Services | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._locks: dict[int, asyncio.Lock] = {}

    # --- requests -----------------------------------------------------------------------

    def request(self, context: ContextRef | None, root_prompt: str | None = None) -> EpisodeRequest:
        """One episode's request: the template with its task and context."""
        return episode_request(self.template, context, root_prompt)

    def check_credentials(self) -> None:
        """In embedded mode this process is the worker, so a missing key is known before the
        episode starts; with a Temporal address the workers' environment decides."""
        if not self.settings.embedded:
            return
        for model in self.models:
            problem = missing_key(model, self.credentials)
            if problem is not None:
                raise ConfigurationError(problem)

    @property
    def models(self) -> list[ModelSettings]:
        t = self.template
        return [t.root_model, *([t.sub_model] if t.sub_model else []), *t.other_models]

    # --- sessions -----------------------------------------------------------------------

    async def __aenter__(self) -> DurableRLM:
        await self.open(work=True)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def open(self, work: bool = True) -> Services:
        """Connect (starting the embedded server if there is no TEMPORAL_ADDRESS) and, with
        `work` in embedded mode, run the in-process worker until `close()`."""
        async with self._lock():
            if self._services is not None:
                return self._services
            stack = contextlib.AsyncExitStack()
            try:
                services = await self._enter(stack, work)
            except BaseException:
                await stack.aclose()  # nothing left running when opening fails half-way
                raise
            self._stack, self._services = stack, services
            return services

    def _lock(self) -> asyncio.Lock:
        loop = id(asyncio.get_running_loop())
        return self._locks.setdefault(loop, asyncio.Lock())

    async def _enter(
        self, stack: contextlib.AsyncExitStack, work: bool, task_queue: str | None = None
    ) -> Services:
        if self.settings.embedded:
            # The shared server starts (if down) in processes of its own while the worker
            # side is imported just below: durable_rlm/server/embedded.py `acquire_early`.
            acquire_early(self.settings)
        try:
            with _collector_paused():
                from durable_rlm.client.episodes import own_task_queue  # start-up: temporalio, the stores
                from durable_rlm.telemetry.log_path import forward_core_logs  # start-up: the SDK's Runtime
                from durable_rlm.worker.runtime import session  # start-up: the worker side, needed only here

            quiet_sdk_failures()  # a failed attempt is in the result, not 30 lines of traceback
            forward_core_logs()  # the script's stdout is its own
            settings = self.settings
            if task_queue is not None:  # a persistent session's own queue, whichever call serves it
                settings = settings.model_copy(update={"task_queue": task_queue})
            elif work and settings.embedded:
                # This session's episodes, and only they, are its worker's work (own_task_queue).
                settings = settings.model_copy(update={"task_queue": own_task_queue(settings.task_queue)})
            return await stack.enter_async_context(session(settings, self.credentials, work))
        except BaseException:
            abandon_early(self.settings)  # failed before its session took the lease: let it go
            raise

    async def close(self) -> None:
        stack, self._stack, self._services = self._stack, None, None
        if stack is not None:
            await stack.aclose()

    @contextlib.asynccontextmanager
    async def _session(self) -> AsyncIterator[Services]:
        """The open session, or one of this call's own: concurrent calls never close a
        session under each other (the embedded server itself is shared and counted)."""
        if self._services is not None:
            yield self._services
            return
        async with contextlib.AsyncExitStack() as stack:
            yield await self._enter(stack, work=True)

    @contextlib.asynccontextmanager
    async def _queue_session(self, task_queue: str | None, work: bool) -> AsyncIterator[Services]:
        """Services whose embedded worker polls `task_queue` (a persistent session's)."""
        async with contextlib.AsyncExitStack() as stack:
            yield await self._enter(stack, work, task_queue)

    def session(
        self,
        session_id: str | None = None,
        *,
        idle_timeout: timedelta | float | None = None,
        turns_per_run: int | None = None,
    ) -> PersistentSession:
        """A persistent session (rlms's `persistent=True`): each `completion()` / `acompletion()`
        is a turn over one REPL, where turn k's context is `context_k` and earlier turns'
        messages `history_j`; `close()` / `aclose()` (or `async with`) ends it, as does
        `idle_timeout` (default 1 hour) without a turn. `session_id` attaches to a session
        another client started. `turns_per_run`: continue-as-new after that many turns
        (default: when Temporal suggests it)."""
        from durable_rlm.client.sessions import Session  # start-up: temporalio, the stores (0.3 s)

        return Session(
            self.template,
            self.request,
            self.check_credentials,
            self._queue_session,
            embedded=self.settings.embedded,
            shared_queue=self.settings.task_queue,
            session_id=session_id,
            idle_timeout=idle_timeout,
            turns_per_run=turns_per_run,
        )

    # --- episodes -----------------------------------------------------------------------

    async def start(
        self, context: Any = None, root_prompt: str | None = None, episode_id: str | None = None
    ) -> Episode:
        """Start an episode and return its handle (inside `async with rlm:`, so that an
        embedded worker runs it)."""
        self.request(None, root_prompt)  # a bad task is reported before anything else
        self.check_credentials()
        if self._services is None:
            raise ConfigurationError("start() needs an open session: use `async with rlm:` around it")
        return await self._start(self._services, context, root_prompt, episode_id)

    async def _start(
        self, services: Services, context: Any, root_prompt: str | None, episode_id: str | None
    ) -> Episode:
        from durable_rlm.client.episodes import start_episode, store_context  # start-up: as in _enter

        ref = context if isinstance(context, ContextRef) or context is None else None
        if ref is None:
            ref = await asyncio.to_thread(store_context, services.blobs, context)
        handle = await start_episode(
            services.client, self.request(ref, root_prompt), services.settings.task_queue, episode_id
        )
        return Episode(services, handle)

    async def fork(self, source_id: str, at: int, **changes: Any) -> Episode:
        """A new episode from `source_id`'s state after iteration `at` (`drlm fork`): the
        first `at` iterations are inherited, not paid again; the source is not touched.
        `changes` are the fork settings (durable_rlm/timetravel/fork.py `ForkChanges`:
        episode_id, model, base_url, sub_model, sub_base_url, policy, policy_config,
        max_iterations, max_duration); those left out are the source's, not this DurableRLM's."""
        if self._services is None:
            raise ConfigurationError("fork() needs an open session: use `async with rlm:` around it")
        from durable_rlm.timetravel.fork import fork_episode  # start-up: the replayer and the workflow code

        handle, _ = await fork_episode(
            self._services.client,
            self._services.settings.task_queue,
            source_id,
            at,
            settings=self.settings,
            blobs=self._services.blobs,
            **changes,
        )
        return Episode(self._services, handle)

    async def rerun(
        self,
        source_ids: Sequence[str],
        *,
        policy: str | None = None,
        policy_config: dict[str, Any] | None = None,
        scan_printed_output: bool | None = None,
    ) -> list[RerunReport]:
        """Re-run recorded episodes with the current code, every model call answered from
        the recording (`drlm rerun`): a report per episode, same / different / diverged.
        Settings left None are each source's own."""
        from durable_rlm.timetravel.rerun import PolicyChange, rerun_episodes  # start-up: the replayer

        change = PolicyChange(policy, policy_config, scan_printed_output)
        async with self._session() as services:
            return await rerun_episodes(services, source_ids, change)

    async def acompletion(self, context: Any = None, root_prompt: str | None = None) -> EpisodeResult:
        """Run an episode to its end. Raises EpisodeFailed when it ends without a result."""
        self.request(None, root_prompt)
        self.check_credentials()
        async with self._session() as services:
            episode = await self._start(services, context, root_prompt, None)
            return await episode.result()

    def completion(self, context: Any = None, root_prompt: str | None = None) -> EpisodeResult:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return run_blocking(self.acompletion(context, root_prompt))
        raise ConfigurationError("completion() blocks; inside an event loop, await acompletion()")


class Episode:
    """A running or ended episode."""

    def __init__(self, services: Services, handle: Any) -> None:
        self.services = services
        self.handle = handle

    @property
    def id(self) -> str:
        return str(self.handle.id)

    async def end(self) -> EpisodeEnd:
        """How it ended, whatever way (a result, or the failure without one), or status
        "paused" when a model call waits for a fixed key (then `retry_credentials()`)."""
        from durable_rlm.client import episodes  # start-up: temporalio, loaded with the session

        return await episodes.follow(self.handle)

    async def result(self) -> EpisodeResult:
        """The result of an episode that did its work. Raises EpisodeFailed when it ended
        without one, or when a failure ended it without an answer (its result is on the
        exception's `end`)."""
        end = await self.end()
        if end.result is None or end.status == "failed":
            raise EpisodeFailed(end)
        return end.result

    async def progress(self) -> EpisodeProgress:
        progress: EpisodeProgress = await self.handle.query("progress", result_type=EpisodeProgress)
        return progress

    async def cancel(self, extract: bool = False, reason: str = "cancelled by request") -> CancelOutcome:
        from durable_rlm.client import episodes  # start-up: temporalio, loaded with the session

        return await episodes.cancel_episode(self.services.client, self.id, extract, reason)

    async def reward(self, value: float, note: str | None = None) -> RewardReceipt:
        from durable_rlm.client import episodes  # start-up: temporalio, loaded with the session

        return await episodes.send_reward(self.services.client, self.id, value, note)

    # --- steering: a person's actions (each recorded in history with its sender) ------------

    async def hint(self, text: str, sender: str | None = None) -> SteeringOutcome:
        """The root model reads `text` as a user message on its next turn."""
        from durable_rlm.client import steering  # start-up: temporalio, loaded with the session

        return await steering.send_hint(self.services.client, self.id, text, sender)

    async def set_limits(self, sender: str | None = None, **limits: Any) -> SteeringOutcome:
        """Raise or lower max_iterations, max_llm_calls, max_duration (a timedelta or
        seconds), max_model_calls, max_tokens, max_cost_usd. Lowering one below what is
        spent ends the episode by the normal limit path (fallback extraction)."""
        from durable_rlm.client import steering  # start-up: temporalio, loaded with the session

        return await steering.change_limits(self.services.client, self.id, sender, **limits)

    async def pause(
        self, hold_clock: bool = False, reason: str = "", sender: str | None = None
    ) -> SteeringOutcome:
        """Hold at the next step boundary, without a sandbox, until `resume()`; with
        `hold_clock`, max_duration does not count the pause."""
        from durable_rlm.client import steering  # start-up: temporalio, loaded with the session

        return await steering.pause_episode(self.services.client, self.id, sender, hold_clock, reason)

    async def resume(self, sender: str | None = None) -> SteeringOutcome:
        from durable_rlm.client import steering  # start-up: temporalio, loaded with the session

        return await steering.resume_episode(self.services.client, self.id, sender)

    async def finish_now(self, reason: str = "", sender: str | None = None) -> SteeringOutcome:
        """Answer now: stop at the next step boundary and extract the answer from the
        history so far (the result's ended_by is finish_requested)."""
        from durable_rlm.client import steering  # start-up: temporalio, loaded with the session

        return await steering.finish_episode(self.services.client, self.id, sender, reason)

    async def pending_cell(self) -> PendingCell | None:
        """The cell waiting for approval, if one does."""
        from durable_rlm.client import steering  # start-up: temporalio, loaded with the session

        return await steering.waiting_cell(self.services.client, self.id)

    async def approve(
        self, cell: int | None = None, code: str | None = None, sender: str | None = None
    ) -> SteeringOutcome:
        """Run the waiting cell (`cell` guards against approving a later one), or `code`
        in its place."""
        from durable_rlm.client import steering  # start-up: temporalio, loaded with the session

        return await steering.decide_cell(self.services.client, self._cell_id(cell), True, sender, code)

    async def reject(
        self, reason: str, cell: int | None = None, sender: str | None = None
    ) -> SteeringOutcome:
        """Do not run the waiting cell; the model reads `reason`."""
        from durable_rlm.client import steering  # start-up: temporalio, loaded with the session

        return await steering.decide_cell(
            self.services.client, self._cell_id(cell), False, sender, reason=reason
        )

    def _cell_id(self, cell: int | None) -> str:
        return self.id if cell is None else f"{self.id}#{cell}"

    async def retry_credentials(self) -> CredentialsOutcome:
        """After a pause on a refused key: the calls that waited run again, with the key
        the worker has now (an embedded worker reads this process's environment when no
        `api_key` was given)."""
        from durable_rlm.client import episodes  # start-up: temporalio, loaded with the session

        return await episodes.retry_credentials(self.services.client, self.id)


_freezing = False


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """No cyclic collection while the worker side is imported: its ~100,000 new objects
    (temporalio's, pydantic's, SQLAlchemy's) set off ~250 collections that walk them, ~8% of
    the import's 0.7-1.3 s, and none of them is garbage yet. Collection resumes after (and
    stays off where the caller had turned it off)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _freeze_at_exit() -> None:
    """Once per process: at the interpreter's exit, take every object out of the cyclic
    collector (gc.freeze) before its last collection walks the runtime's ~180,000 objects
    (temporalio's, pydantic's, SQLAlchemy's): a new process's exit after a one-iteration
    completion() took 0.40 s of it
    (docs/architecture/decisions.md#start-up-pays-only-for-what-it-uses). At exit only:
    freezing earlier would also exempt the user's objects alive then from collection for
    good, a leak in a long-running agent (an earlier version froze when the first object was
    made)."""
    global _freezing
    if not _freezing:
        _freezing = True
        atexit.register(gc.freeze)


T = TypeVar("T")


def run_blocking(work: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(work)`, its result handed back outside the loop. Python 3.11's runner, as
    it puts SIGINT's handler back, formats the main task (reprlib, over its result): with a
    result that holds the context (rlms's `RLMChatCompletion.prompt`) that cost 4.8 s per
    100 MB of context. The main task here ends with None."""
    out: list[T] = []

    async def main() -> None:
        out.append(await work)

    asyncio.run(main())
    return out[0]


def on_own_thread(make: Callable[[], Coroutine[Any, Any, T]], name: str = "durable-rlm episode") -> T:
    """Run a coroutine to its end on a new thread with an event loop of its own, blocking
    the caller: a synchronous call (rlms's `completion()`, DSPy's `forward()`) made where an
    event loop already runs (a notebook, an async app), which `asyncio.run` refuses."""
    done: dict[str, Any] = {}

    def run() -> None:
        try:
            done["value"] = run_blocking(make())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller as it is
            done["error"] = exc

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if "error" in done:
        raise done["error"]
    value: T = done["value"]
    return value
