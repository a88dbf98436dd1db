"""rlms's API on the durable runtime: `from rlm import RLM` becomes `from durable_rlm import RLM`.

    from durable_rlm import RLM

    rlm = RLM(backend="openai", backend_kwargs={"model_name": "gpt-4o-mini"}, max_iterations=10)
    print(rlm.completion(context, root_prompt="Which service failed most?").response)

`RLM` is a thin adapter over `DurableRLM` (one class family, one code path): it takes rlms
0.1.3's constructor (rlm/core/rlm.py, same names and defaults) and turns it into the
episode request `DurableRLM` builds, and its result carries rlms's `RLMChatCompletion`
fields (`response`, `usage_summary` per model, `execution_time`, `metadata`) besides ours
(`answer`, `ended_by`, `episode_id`... through `.episode`). Limits end the episode as rlms's
do: `max_iterations` answers from the history (rlms's default answer; here fallback
extraction), while `max_timeout`, `max_tokens`, `max_budget` and `max_errors` raise rlms's
exception types (durable_rlm/rlms/limits.py, with rlms's names and attributes, each also a DurableRLMError).
With `persistent=True` successive `completion()` calls are turns of one durable session
(durable_rlm/client/sessions.py): one REPL, turn k's prompt as `context_k`, earlier turns'
messages as `history_j`; `close()` ends it, and `session_id` names it (`drlm show`).

What does not fit a durable, sandboxed runtime is refused with a ConfigurationError that says
what works, never ignored: environments other than "local" (ours is a sandboxed process),
`user_prologue`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from durable_rlm.api import DurableRLM, on_own_thread, run_blocking
from durable_rlm.errors import ConfigurationError, EpisodeFailed
from durable_rlm.rlms.follow import Callbacks, follow, quietly, report_children, started_episode
from durable_rlm.rlms.limits import CancellationError, raise_for_limit, trail_of
from durable_rlm.rlms.logger import Logged, replay_to_logger
from durable_rlm.rlms.options import (
    ModelChoice,
    refuse_what_does_not_fit,
    run_metadata,
    translate,
)
from durable_rlm.rlms.results import RLMChatCompletion, usage_by_model
from durable_rlm.workflows.models import EpisodeResult

if TYPE_CHECKING:
    from durable_rlm.audit.timeline import Timeline
    from durable_rlm.client.sessions import Session as PersistentSession
    from durable_rlm.worker.runtime import Services

RLMS_VERSION = "0.1.3"
T = TypeVar("T")


class RLM(DurableRLM):
    """rlms 0.1.3's RLM: the same constructor and `completion(prompt, root_prompt=None)`,
    durable underneath. `settings` (keyword only) is DurableRLM's."""

    def __init__(
        self,
        backend: str = "openai",
        backend_kwargs: dict[str, Any] | None = None,
        environment: str = "local",
        environment_kwargs: dict[str, Any] | None = None,
        depth: int = 0,
        max_depth: int = 1,
        max_iterations: int = 30,
        max_budget: float | None = None,
        max_timeout: float | None = None,
        max_tokens: int | None = None,
        max_errors: int | None = None,
        custom_system_prompt: str | None = None,
        other_backends: list[str] | None = None,
        other_backend_kwargs: list[dict[str, Any]] | None = None,
        logger: Any = None,
        verbose: bool = False,
        persistent: bool = False,
        custom_tools: dict[str, Any] | None = None,
        custom_sub_tools: dict[str, Any] | None = None,
        compaction: bool = False,
        compaction_threshold_pct: float = 0.85,
        max_concurrent_subcalls: int = 4,
        on_subcall_start: Callable[[int, str, str], None] | None = None,
        on_subcall_complete: Callable[[int, str, float, str | None], None] | None = None,
        on_iteration_start: Callable[[int, int], None] | None = None,
        on_iteration_complete: Callable[[int, int, float], None] | None = None,
        sampling_args: dict[str, Any] | None = None,
        sub_sampling_args: dict[str, Any] | None = None,
        orchestrator: bool = True,
        user_prologue: str | None = None,
        *,
        settings: Any = None,
    ) -> None:
        refuse_what_does_not_fit(environment, depth, user_prologue)
        translated = translate(
            backend=backend,
            backend_kwargs=backend_kwargs,
            environment_kwargs=environment_kwargs,
            max_depth=max_depth,
            max_iterations=max_iterations,
            max_budget=max_budget,
            max_timeout=max_timeout,
            max_tokens=max_tokens,
            max_errors=max_errors,
            custom_system_prompt=custom_system_prompt,
            other_backends=other_backends,
            other_backend_kwargs=other_backend_kwargs,
            custom_tools=custom_tools,
            custom_sub_tools=custom_sub_tools,
            compaction=compaction,
            compaction_threshold_pct=compaction_threshold_pct,
            max_concurrent_subcalls=max_concurrent_subcalls,
            sampling_args=sampling_args,
            sub_sampling_args=sub_sampling_args,
            orchestrator=orchestrator,
        )
        root, sub = translated.root, translated.sub
        options = translated.options
        super().__init__(options.model, options=options, api_key=translated.api_key, settings=settings)
        self._key_variables(root, sub)
        self.template = self.template.model_copy(update={"rlms": True})  # rlms's REPL and prompt
        self.backend, self.backend_kwargs = backend, backend_kwargs
        self.environment_type, self.environment_kwargs = environment, environment_kwargs or {}
        self.max_depth, self.max_iterations = max_depth, max_iterations
        self.max_budget, self.max_timeout, self.max_tokens, self.max_errors = (
            max_budget,
            max_timeout,
            max_tokens,
            max_errors,
        )
        self.other_backends, self.other_backend_kwargs = other_backends, other_backend_kwargs
        self.custom_tools = custom_tools
        self.custom_sub_tools = custom_sub_tools if custom_sub_tools is not None else custom_tools
        self.persistent, self.depth = persistent, depth
        self._turns: PersistentSession | None = None  # persistent=True: the session, from the first call
        self.logger, self.verbose = logger, verbose
        self.on_subcall_start, self.on_subcall_complete = on_subcall_start, on_subcall_complete
        self.on_iteration_start, self.on_iteration_complete = on_iteration_start, on_iteration_complete
        self.root_model_name = root.name
        self._run_metadata = run_metadata(
            root,
            backend,
            backend_kwargs,
            environment,
            environment_kwargs,
            max_depth,
            max_iterations,
            other_backends,
        )
        if logger is not None:
            logger.log_metadata(Logged(self._run_metadata))
        if verbose:
            print(
                f"[durable-rlm] RLM {backend}:{root.name} max_depth={max_depth} "
                f"max_iterations={max_iterations}"
            )

    def _key_variables(self, root: ModelChoice, sub: ModelChoice | None) -> None:
        """Each model reads its backend's key variable; a key given in backend_kwargs goes
        to the embedded worker under that variable (DurableRLM's api_key rule)."""
        t = self.template
        root_model = t.root_model.model_copy(update={"api_key_env": root.key_env})
        sub_model = t.sub_model
        if sub is not None and sub_model is not None:
            sub_model = sub_model.model_copy(update={"api_key_env": sub.key_env})
            if sub.api_key:
                if not self.settings.embedded:
                    raise ConfigurationError(
                        "api_key only works with the embedded worker; with TEMPORAL_ADDRESS set, give "
                        "the key to the worker process (in its environment)"
                    )
                self.credentials[sub.key_env] = sub.api_key
        self.credentials = {
            root.key_env if k == t.root_model.api_key_env else k: v for k, v in self.credentials.items()
        }
        self.template = t.model_copy(update={"root_model": root_model, "sub_model": sub_model})

    # --- completion ---------------------------------------------------------------------------

    def completion(self, prompt: Any, root_prompt: str | None = None) -> RLMChatCompletion:  # type: ignore[override]  # rlms's
        """Run an episode over `prompt` (the context) to its answer, as rlms's completion. It
        blocks, as rlms's does, also when called inside a running event loop (a notebook, an
        async app): the episode then runs on a thread of its own."""
        return self._blocking(lambda: self.acompletion(prompt, root_prompt), "completion()")

    def _blocking(self, make: Callable[[], Coroutine[Any, Any, T]], what: str) -> T:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return run_blocking(make())
        if self._services is not None:
            # Opened with `async with rlm:`: its connection belongs to the running loop.
            raise ConfigurationError(f"{what} blocks; inside `async with rlm:`, await its async form")
        return on_own_thread(make, "durable-rlm completion")

    async def acompletion(self, prompt: Any, root_prompt: str | None = None) -> RLMChatCompletion:  # type: ignore[override]  # rlms's
        started = time.perf_counter()
        self.request(None, root_prompt)
        self.check_credentials()
        if self.logger is not None:
            self.logger.clear_iterations()
        if self.persistent:
            result, timeline, services, reported = await self._turn(prompt, root_prompt)
            return self._completed(prompt, result, timeline, services, started, reported)
        async with self._session() as services:
            episode = await self._start(services, prompt, root_prompt, None)
            try:
                end, reported = await follow(episode, self.callbacks)
            except (KeyboardInterrupt, asyncio.CancelledError):
                await asyncio.shield(episode.cancel(reason="cancelled by the caller (Ctrl+C)"))
                raise CancellationError(message="Execution cancelled by user (Ctrl+C)") from None
            if end.result is None or end.status == "failed":
                raise EpisodeFailed(end)
            result = end.result
            timeline = await self._timeline(services, episode.id)
        return self._completed(prompt, result, timeline, services, started, reported)

    @property
    def callbacks(self) -> Callbacks:
        """The callbacks and `verbose` as they are now (rlms's are attributes one may set)."""
        return Callbacks(
            self.on_subcall_start,
            self.on_subcall_complete,
            self.on_iteration_start,
            self.on_iteration_complete,
            self.verbose,
        )

    @property
    def session_id(self) -> str | None:
        """persistent=True: the session's id (`drlm show`; `DurableRLM.session(session_id=...)`
        attaches to it from another process), once the first completion() started it."""
        return self._turns.id if self._turns is not None else None

    async def _turn(
        self, prompt: Any, root_prompt: str | None
    ) -> tuple[EpisodeResult, Timeline, Services, set[str]]:
        """persistent=True: one turn of the session; the first call starts it. The turn's
        episode is followed while it runs, so the callbacks fire live, as for one episode;
        the child episodes already reported come back with it."""
        if self._turns is None:
            self._turns = self.session()
        told = self.callbacks
        reported: set[str] = set()
        completed = [0]  # the turn's iterations reported complete, live

        def complete(depth: int, number: int, took: float) -> None:
            completed[0] = max(completed[0], number)
            quietly(told.on_iteration_complete, depth, number, took)

        callbacks = dataclasses.replace(told, on_iteration_complete=complete) if told.iterations else told

        async def watch(episode_id: str) -> None:
            await follow(await started_episode(services, episode_id), callbacks, reported)

        async with self._turns.opened() as services:
            try:
                result = await self._turns.acompletion(
                    prompt, root_prompt, watch if told.iterations or told.subcalls else None
                )
            except (KeyboardInterrupt, asyncio.CancelledError):
                # The turn runs on in the session (durably); the next call waits for it.
                raise CancellationError(message="Execution cancelled by user (Ctrl+C)") from None
            timeline = await self._timeline(services, result.episode_id)
        # What the watcher could not tell (cut short, or the turn paused on a key): told now.
        for number in range(completed[0] + 1, result.iterations + 1):
            quietly(told.on_iteration_start, 0, number)
            quietly(told.on_iteration_complete, 0, number, 0.0)
            if self.verbose:
                print(f"[durable-rlm] iteration {number}")
        return result, timeline, services, reported

    def _completed(
        self,
        prompt: Any,
        result: EpisodeResult,
        timeline: Timeline,
        services: Services,
        started: float,
        reported: set[str],
    ) -> RLMChatCompletion:
        """rlms's result; `reported`: the child episodes whose callbacks fired while it ran."""
        elapsed = time.perf_counter() - started
        usage = usage_by_model(timeline, result, self.root_model_name)
        if self.logger is not None:
            replay_to_logger(self.logger, timeline, services.blobs, self._run_metadata)
        report_children(timeline, services.blobs, self.callbacks, reported)
        raise_for_limit(
            result,
            elapsed,
            trail_of(timeline),
            max_timeout=self.max_timeout,
            max_tokens=self.max_tokens,
            max_budget=self.max_budget,
            max_errors=self.max_errors,
        )
        response = result.answer if result.answer is not None else ""
        if self.verbose:
            print(f"[durable-rlm] final answer ({result.ended_by}): {response}")
        return RLMChatCompletion(
            root_model=self.root_model_name,
            prompt=prompt,
            response=response,
            usage_summary=usage,
            execution_time=elapsed,
            metadata=self.logger.get_trajectory() if self.logger is not None else None,
            episode=result,
        )

    async def _timeline(self, services: Services, episode_id: str) -> Timeline:
        from durable_rlm.audit.timeline import episode_timeline  # start-up: temporalio 0.3 s, not on import

        return await episode_timeline(services.client, episode_id)

    def close(self) -> None:  # type: ignore[override]  # rlms's close() is not awaited
        """rlms's close(), which is not awaited: with persistent=True it ends the session;
        otherwise nothing is held between completion() calls (an open connection is closed by
        `async with rlm:` or `aclose()`)."""
        if self._turns is not None:
            self._blocking(self._end_turns, "close()")

    async def _end_turns(self) -> None:
        turns, self._turns = self._turns, None
        if turns is not None:
            await turns.aclose(reason="closed by the client (rlms close())")

    async def aclose(self) -> None:
        await self._end_turns()
        await DurableRLM.close(self)

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __enter__(self) -> RLM:
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        self.close()  # rlms's: the persistent session ends with the block
        return False
