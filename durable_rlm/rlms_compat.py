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
exception types (defined here with rlms's names and attributes, each also a DurableRLMError).
With `persistent=True` successive `completion()` calls are turns of one durable session
(durable_rlm/client/sessions.py): one REPL, turn k's prompt as `context_k`, earlier turns'
messages as `history_j`; `close()` ends it, and `session_id` names it (`drlm show`).

What does not fit a durable, sandboxed runtime is refused with a ConfigurationError that says
what works, never ignored: environments other than "local" (ours is a sandboxed process),
rlms backends without an OpenAI-compatible endpoint (portkey), `user_prologue`,
`orchestrator=False`.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from durable_rlm.api import DurableRLM, Episode
from durable_rlm.errors import ConfigurationError, DurableRLMError, EpisodeFailed
from durable_rlm.workflows.models import EpisodeResult, TokenUsage
from durable_rlm.workflows.termination import (
    ActionResult,
    PolicyContext,
    PolicyDecision,
    PolicyRegistry,
    TerminationPolicy,
)

if TYPE_CHECKING:
    from durable_rlm.audit.timeline import Timeline
    from durable_rlm.client.sessions import Session as PersistentSession
    from durable_rlm.worker.runtime import Services

RLMS_VERSION = "0.1.3"
MAX_ERRORS_POLICY = "rlms_max_errors"
PROGRESS_POLL_S = 0.2
"""How often a run with callbacks or `verbose` asks the episode for its progress (a query:
nothing is added to history)."""


# --- rlms's exceptions (rlm/utils/exceptions.py), each also a DurableRLMError -----------------


class BudgetExceededError(DurableRLMError):
    """Raised when the episode's spend passed max_budget (USD)."""

    def __init__(self, spent: float, budget: float, message: str | None = None):
        self.spent = spent
        self.budget = budget
        super().__init__(message or f"Budget exceeded: spent ${spent:.6f} of ${budget:.6f} budget")


class TimeoutExceededError(DurableRLMError):
    """Raised when the episode ran out of max_timeout seconds."""

    def __init__(
        self, elapsed: float, timeout: float, partial_answer: str | None = None, message: str | None = None
    ):
        self.elapsed = elapsed
        self.timeout = timeout
        self.partial_answer = partial_answer
        super().__init__(message or f"Timeout exceeded: {elapsed:.1f}s of {timeout:.1f}s limit")


class TokenLimitExceededError(DurableRLMError):
    """Raised when the episode's tokens reached max_tokens."""

    def __init__(
        self,
        tokens_used: int,
        token_limit: int,
        partial_answer: str | None = None,
        message: str | None = None,
    ):
        self.tokens_used = tokens_used
        self.token_limit = token_limit
        self.partial_answer = partial_answer
        super().__init__(message or f"Token limit exceeded: {tokens_used:,} of {token_limit:,} tokens")


class ErrorThresholdExceededError(DurableRLMError):
    """Raised when max_errors iterations in a row had a cell that raised."""

    def __init__(
        self,
        error_count: int,
        threshold: int,
        last_error: str | None = None,
        partial_answer: str | None = None,
        message: str | None = None,
    ):
        self.error_count = error_count
        self.threshold = threshold
        self.last_error = last_error
        self.partial_answer = partial_answer
        super().__init__(
            message or f"Error threshold exceeded: {error_count} consecutive errors (limit: {threshold})"
        )


class CancellationError(DurableRLMError):
    """Raised when the episode was cancelled (Ctrl+C cancels it: it does not run on)."""

    def __init__(self, partial_answer: str | None = None, message: str | None = None):
        self.partial_answer = partial_answer
        super().__init__(message or "Execution cancelled by user")


# --- max_errors as a termination policy: decided in the workflow, so it replays -------------


@PolicyRegistry.register_termination(MAX_ERRORS_POLICY)
class MaxErrorsTerminationPolicy(TerminationPolicy):
    """rlms's max_errors: stop after `max_errors` iterations in a row whose cells raised."""

    name = MAX_ERRORS_POLICY
    description = "Stop after max_errors consecutive iterations with a failing cell (rlms)"

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        self._errors = 0

    @classmethod
    def get_default_config(cls) -> dict[str, Any]:
        return {"max_errors": 1}

    def should_terminate(self, result: ActionResult, context: PolicyContext) -> tuple[bool, str | None]:
        return self.decide(result, context).as_tuple()

    def decide(self, result: ActionResult, context: PolicyContext) -> PolicyDecision:
        self._errors = self._errors + 1 if result.action_type == "error" else 0
        limit = int(self.settings["max_errors"])
        if self._errors < limit:
            return PolicyDecision(False)
        return PolicyDecision(
            True, None, f"Error threshold exceeded: {self._errors} consecutive errors (limit: {limit})"
        )

    def reset(self) -> None:
        self._errors = 0


# --- rlms's result types (rlm/core/types.py) ------------------------------------------------


@dataclass
class ModelUsageSummary:
    total_calls: int
    total_input_tokens: int
    total_output_tokens: int
    total_cost: float | None = None

    def to_dict(self) -> dict[str, Any]:
        result: dict[str, Any] = {
            "total_calls": self.total_calls,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
        }
        if self.total_cost is not None:
            result["total_cost"] = self.total_cost
        return result


@dataclass
class UsageSummary:
    model_usage_summaries: dict[str, ModelUsageSummary]

    @property
    def total_cost(self) -> float | None:
        costs = [s.total_cost for s in self.model_usage_summaries.values() if s.total_cost is not None]
        return sum(costs) if costs else None

    @property
    def total_input_tokens(self) -> int:
        return sum(s.total_input_tokens for s in self.model_usage_summaries.values())

    @property
    def total_output_tokens(self) -> int:
        return sum(s.total_output_tokens for s in self.model_usage_summaries.values())

    def to_dict(self) -> dict[str, Any]:
        result: dict[str, Any] = {
            "model_usage_summaries": {m: s.to_dict() for m, s in self.model_usage_summaries.items()}
        }
        if self.total_cost is not None:
            result["total_cost"] = self.total_cost
        return result


@dataclass
class RLMChatCompletion:
    """rlms's result, and ours: `episode` is the EpisodeResult, whose fields (`answer`,
    `ended_by`, `episode_id`, `iterations`...) read through as attributes."""

    root_model: str
    prompt: Any
    response: str
    usage_summary: UsageSummary
    execution_time: float
    metadata: dict[str, Any] | None = None
    episode: EpisodeResult | None = None

    def __getattr__(self, name: str) -> Any:
        episode = self.__dict__.get("episode")
        if episode is not None and name in type(episode).model_fields:
            return getattr(episode, name)
        raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")

    def to_dict(self) -> dict[str, Any]:
        result = {
            "root_model": self.root_model,
            "prompt": self.prompt,
            "response": self.response,
            "usage_summary": self.usage_summary.to_dict(),
            "execution_time": self.execution_time,
        }
        if self.metadata is not None:
            result["metadata"] = self.metadata
        return result


# --- rlms's logger ---------------------------------------------------------------------------


class RLMLogger:
    """rlms's RLMLogger (rlm/logger/rlm_logger.py), same interface and the same JSONL lines:
    a metadata line, then one line per iteration; kept in memory for the result's
    `metadata`, and appended to `log_dir/<file_name>_<time>_<id>.jsonl` when log_dir is set.
    rlms's own RLMLogger works with RLM too."""

    def __init__(self, log_dir: str | None = None, file_name: str = "rlm") -> None:
        self.log_dir = log_dir
        self.log_file_path: str | None = None
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
            stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
            self.log_file_path = os.path.join(log_dir, f"{file_name}_{stamp}_{uuid.uuid4().hex[:8]}.jsonl")
        self._run_metadata: dict[str, Any] | None = None
        self._iterations: list[dict[str, Any]] = []
        self._iteration_count = 0

    def log_metadata(self, metadata: Any) -> None:
        if self._run_metadata is not None:
            return
        self._run_metadata = metadata.to_dict() if hasattr(metadata, "to_dict") else dict(metadata)
        self._append({"type": "metadata", "timestamp": datetime.now().isoformat(), **self._run_metadata})

    def log(self, iteration: Any) -> None:
        self._iteration_count += 1
        body = iteration.to_dict() if hasattr(iteration, "to_dict") else dict(iteration)
        entry = {
            "type": "iteration",
            "iteration": self._iteration_count,
            "timestamp": datetime.now().isoformat(),
            **body,
        }
        self._iterations.append(entry)
        self._append(entry)

    def clear_iterations(self) -> None:
        self._iterations = []
        self._iteration_count = 0

    def get_trajectory(self) -> dict[str, Any] | None:
        if self._run_metadata is None:
            return None
        return {"run_metadata": self._run_metadata, "iterations": list(self._iterations)}

    @property
    def iteration_count(self) -> int:
        return self._iteration_count

    def _append(self, entry: dict[str, Any]) -> None:
        if self.log_file_path:
            with open(self.log_file_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")


@dataclass
class _Logged:
    """What rlms's logger takes: an object with `to_dict()`."""

    body: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return self.body


# --- backends --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Backend:
    """How an rlms backend reaches a model here: provider, default endpoint, key variable."""

    provider: str
    base_url: str | None
    key_env: str
    needs_base_url: bool = False
    reports_cost: bool = False  # usage.cost in each reply: max_budget needs no price table


BACKENDS = {
    "openai": Backend("openai", None, "OPENAI_API_KEY"),
    "vllm": Backend("openai", None, "OPENAI_API_KEY", needs_base_url=True),
    "litellm": Backend("openai", None, "LITELLM_API_KEY", needs_base_url=True, reports_cost=True),
    "openrouter": Backend("openai", "https://openrouter.ai/api/v1", "OPENROUTER_API_KEY", reports_cost=True),
    "vercel": Backend("openai", "https://ai-gateway.vercel.sh/v1", "AI_GATEWAY_API_KEY"),
    "gemini": Backend("openai", "https://generativelanguage.googleapis.com/v1beta/openai/", "GEMINI_API_KEY"),
    # Azure's v1 API is OpenAI-compatible at <endpoint>/openai/v1/ (azure_endpoint below).
    "azure_openai": Backend("openai", None, "AZURE_OPENAI_API_KEY"),
    "anthropic": Backend("anthropic", None, "ANTHROPIC_API_KEY"),
}
ENVIRONMENTS = ("local",)


@dataclass(frozen=True)
class ModelChoice:
    name: str
    provider: str
    base_url: str | None
    key_env: str
    api_key: str | None
    sampling: dict[str, Any] = field(default_factory=dict)
    reports_cost: bool = False


def model_choice(backend: str, kwargs: dict[str, Any] | None, what: str = "backend") -> ModelChoice:
    """An rlms (backend, backend_kwargs) pair as a model here; what cannot work is a
    ConfigurationError naming what does."""
    spec = BACKENDS.get(backend)
    if spec is None:
        raise ConfigurationError(
            f"{what} {backend!r} is not available: durable-rlm speaks {', '.join(BACKENDS)} "
            "(any OpenAI-compatible server: backend='openai' with backend_kwargs base_url)"
        )
    data = dict(kwargs or {})
    name = data.pop("model_name", None) or data.pop("azure_deployment", None)
    if name is None and backend == "gemini":
        name = "gemini-2.5-flash"  # rlms's GeminiClient default
    if not name:
        raise ConfigurationError(f"{what} {backend!r}: backend_kwargs needs model_name")
    base_url = data.pop("base_url", None) or spec.base_url
    endpoint = data.pop("azure_endpoint", None) or os.environ.get("AZURE_OPENAI_ENDPOINT")
    data.pop("api_version", None)  # the v1 endpoint takes none
    if backend == "azure_openai" and base_url is None:
        if not endpoint:
            raise ConfigurationError(
                "backend 'azure_openai': backend_kwargs needs azure_endpoint (or AZURE_OPENAI_ENDPOINT); "
                "it is reached through Azure's OpenAI-compatible v1 endpoint"
            )
        base_url = endpoint.rstrip("/") + "/openai/v1/"
    if spec.needs_base_url and not base_url:
        raise ConfigurationError(f"{what} {backend!r}: backend_kwargs needs base_url (the server's address)")
    api_key = data.pop("api_key", None)
    sampling = dict(data.pop("sampling_args", None) or {})
    if "max_tokens" in data:  # rlms's AnthropicClient takes the reply's max_tokens here
        sampling.setdefault("max_tokens", data.pop("max_tokens"))
    data.pop("timeout", None)  # the request timeout is DurableRLM's request_timeout_s
    if data:
        raise ConfigurationError(
            f"{what} {backend!r}: backend_kwargs {', '.join(sorted(data))} are not used here "
            "(known: model_name, base_url, api_key, sampling_args; azure_endpoint for azure_openai)"
        )
    return ModelChoice(name, spec.provider, base_url, spec.key_env, api_key, sampling, spec.reports_cost)


# --- RLM -------------------------------------------------------------------------------------


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
        if environment not in ENVIRONMENTS:
            raise ConfigurationError(
                f"environment {environment!r} is not available: durable-rlm runs the REPL in its own "
                "sandboxed process (environment='local')"
            )
        if depth != 0:
            raise ConfigurationError("depth is rlms's own bookkeeping for child RLMs: leave it 0")
        if user_prologue is not None:
            raise ConfigurationError("user_prologue is not available: put it in root_prompt")
        if not orchestrator:
            raise ConfigurationError("orchestrator=False is not available: the REPL prompt is durable-rlm's")
        env_kwargs = dict(environment_kwargs or {})
        setup_code = env_kwargs.pop("setup_code", None)
        if env_kwargs:
            raise ConfigurationError(
                f"environment_kwargs {', '.join(sorted(env_kwargs))} are not used here (known: setup_code)"
            )
        if other_backends is not None and len(other_backends) != 1:
            # rlms's own rule: one other backend, the model of the sub-calls.
            raise ConfigurationError("other_backends takes one backend: the model for the sub-calls")
        root = model_choice(backend, backend_kwargs)
        sub = None
        if other_backends:
            kwargs = (other_backend_kwargs or [{}])[0]
            sub = model_choice(other_backends[0], kwargs, what="other backend")
        sampling = {**root.sampling, **(sampling_args or {})}
        sub_sampling = {**(sub.sampling if sub else {}), **(sub_sampling_args or {})} or None
        limits: dict[str, Any] = {
            "max_iterations": max_iterations,
            "max_parallel_subcalls": max_concurrent_subcalls,
        }
        if max_timeout is not None:
            limits["max_duration"] = timedelta(seconds=max_timeout)
        if max_tokens is not None:
            limits["max_tokens"] = max_tokens
        if max_budget is not None:
            limits["max_cost_usd"] = max_budget
        if compaction:
            limits["compact_at"] = compaction_threshold_pct
        policy, policy_config = "final_pattern", None
        if max_errors is not None:
            policy = "composite"
            policy_config = {
                "policies": [
                    "final_pattern",
                    {"name": MAX_ERRORS_POLICY, "config": {"max_errors": max_errors}},
                ]
            }
        super().__init__(
            _prefixed(root),
            base_url=root.base_url,
            sub_model=_prefixed(sub) if sub else None,
            sub_base_url=sub.base_url if sub else None,
            max_depth=max_depth,
            limits=limits,
            policy=policy,
            policy_config=policy_config,
            tools=custom_tools or [],
            sub_tools=custom_sub_tools,
            system_prompt=custom_system_prompt,
            setup_code=setup_code,
            sampling=sampling or None,
            sub_sampling=sub_sampling,
            api_key=root.api_key,
            reports_cost=root.reports_cost or None,
            settings=settings,
        )
        self._key_variables(root, sub)
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
        self._run_metadata = {
            "root_model": root.name,
            "max_depth": max_depth,
            "max_iterations": max_iterations,
            "backend": backend,
            "backend_kwargs": {k: v for k, v in (backend_kwargs or {}).items() if "key" not in k.lower()},
            "environment_type": environment,
            "environment_kwargs": {
                k: v for k, v in (environment_kwargs or {}).items() if "key" not in k.lower()
            },
            "other_backends": other_backends,
        }
        if logger is not None:
            logger.log_metadata(_Logged(self._run_metadata))
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

    def completion(self, prompt: Any, root_prompt: str | None = None) -> RLMChatCompletion:  # type: ignore[override]
        """Run an episode over `prompt` (the context) to its answer, as rlms's completion."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.acompletion(prompt, root_prompt))
        raise ConfigurationError("completion() blocks; inside an event loop, await acompletion()")

    async def acompletion(self, prompt: Any, root_prompt: str | None = None) -> RLMChatCompletion:  # type: ignore[override]
        started = time.perf_counter()
        self.request(None, root_prompt)
        self.check_credentials()
        if self.logger is not None:
            self.logger.clear_iterations()
        if self.persistent:
            result, timeline, services = await self._turn(prompt, root_prompt)
            return self._completed(prompt, result, timeline, services, started)
        async with self._session() as services:
            episode = await self._start(services, prompt, root_prompt, None)
            try:
                end = await self._follow(episode)
            except (KeyboardInterrupt, asyncio.CancelledError):
                await asyncio.shield(episode.cancel(reason="cancelled by the caller (Ctrl+C)"))
                raise CancellationError(message="Execution cancelled by user (Ctrl+C)") from None
            if end.result is None or end.status == "failed":
                raise EpisodeFailed(end)
            result = end.result
            timeline = await self._timeline(services, episode.id)
        return self._completed(prompt, result, timeline, services, started)

    @property
    def session_id(self) -> str | None:
        """persistent=True: the session's id (`drlm show`; `DurableRLM.session(session_id=...)`
        attaches to it from another process), once the first completion() started it."""
        return self._turns.id if self._turns is not None else None

    async def _turn(self, prompt: Any, root_prompt: str | None) -> tuple[EpisodeResult, Timeline, Services]:
        """persistent=True: one turn of the session; the first call starts it."""
        if self._turns is None:
            self._turns = self.session()
        async with self._turns.opened() as services:
            try:
                result = await self._turns.acompletion(prompt, root_prompt)
            except (KeyboardInterrupt, asyncio.CancelledError):
                # The turn runs on in the session (durably); the next call waits for it.
                raise CancellationError(message="Execution cancelled by user (Ctrl+C)") from None
            timeline = await self._timeline(services, result.episode_id)
        for number in range(1, result.iterations + 1):  # the turn's iterations, once it ended
            _quietly(self.on_iteration_start, 0, number)
            _quietly(self.on_iteration_complete, 0, number, 0.0)
            if self.verbose:
                print(f"[durable-rlm] iteration {number}")
        return result, timeline, services

    def _completed(
        self, prompt: Any, result: EpisodeResult, timeline: Timeline, services: Services, started: float
    ) -> RLMChatCompletion:
        elapsed = time.perf_counter() - started
        usage = usage_by_model(timeline, result, self.root_model_name)
        self._replay_to_logger(services, timeline)
        self._subcall_callbacks(services, timeline)
        self._raise_for_limit(result, elapsed)
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

    async def _follow(self, episode: Episode) -> Any:
        """The episode's end; with callbacks or `verbose`, its iterations as they happen (from
        the progress query)."""
        ending = asyncio.ensure_future(episode.end())
        if not (self.on_iteration_start or self.on_iteration_complete or self.verbose):
            return await ending
        seen, since = 0, time.perf_counter()
        while True:
            done, _ = await asyncio.wait({ending}, timeout=PROGRESS_POLL_S)
            try:
                progress = None if done else await episode.progress()
            except Exception:  # noqa: BLE001 - progress is best effort; the end is what counts
                progress = None
            now_at = progress.iteration if progress is not None else seen
            while seen < now_at:
                if seen:
                    _quietly(self.on_iteration_complete, 0, seen, time.perf_counter() - since)
                seen, since = seen + 1, time.perf_counter()
                _quietly(self.on_iteration_start, 0, seen)
                if self.verbose and progress is not None:
                    print(f"[durable-rlm] iteration {seen}: {progress.phase}")
            if done:
                end = ending.result()
                # Iterations too quick for a poll to see are reported when the end says so.
                last = max(seen, end.result.iterations if end.result is not None else 0)
                while seen <= last and seen:
                    _quietly(self.on_iteration_complete, 0, seen, time.perf_counter() - since)
                    if seen == last:
                        break
                    seen, since = seen + 1, time.perf_counter()
                    _quietly(self.on_iteration_start, 0, seen)
                if not seen and last:
                    for number in range(1, last + 1):
                        _quietly(self.on_iteration_start, 0, number)
                        _quietly(self.on_iteration_complete, 0, number, 0.0)
                return end

    async def _timeline(self, services: Services, episode_id: str) -> Timeline:
        from durable_rlm.audit.timeline import episode_timeline  # start-up: temporalio 0.3 s, not on import

        return await episode_timeline(services.client, episode_id)

    def _replay_to_logger(self, services: Services, timeline: Timeline) -> None:
        """The episode's iterations as rlms's logger lines (durable_rlm/viewer/export.py)."""
        if self.logger is None:
            return
        from durable_rlm.viewer.export import iteration_entries, resolve_prompts  # start-up: as _timeline's

        resolve_prompts(timeline, services.blobs)
        for entry in iteration_entries(timeline, services.blobs):
            body = {k: v for k, v in entry.items() if k not in ("type", "iteration", "timestamp")}
            self.logger.log(_Logged(body))

    def _subcall_callbacks(self, services: Services, timeline: Timeline) -> None:
        """rlms fires these around each child RLM; here each child episode is reported
        once its history is read, with the time it ran."""
        if not (self.on_subcall_start or self.on_subcall_complete):
            return
        for it in timeline.iterations:
            for cell in it.cells:
                for child in cell.children:
                    prompt = services.blobs.get_text(child.context.digest) if child.context else ""
                    _quietly(self.on_subcall_start, 1, child.model, prompt[:80])
                    t = child.timeline
                    took = (
                        (t.ended_at - t.started_at).total_seconds()
                        if t and t.ended_at and t.started_at
                        else 0.0
                    )
                    result = t.result if t is not None else None
                    error = None if result is not None and result.answer is not None else "no answer"
                    _quietly(self.on_subcall_complete, 1, child.model, took, error)

    def _raise_for_limit(self, result: EpisodeResult, elapsed: float) -> None:
        """rlms raises where its limits stop a run; max_iterations answers (rlms's default
        answer is our fallback extraction)."""
        partial = result.answer
        if result.ended_by == "max_duration" and self.max_timeout is not None:
            raise TimeoutExceededError(
                elapsed, self.max_timeout, partial, f"Timeout exceeded: {result.stop_reason}"
            )
        if result.ended_by == "max_tokens" and self.max_tokens is not None:
            raise TokenLimitExceededError(
                result.usage.total_tokens,
                self.max_tokens,
                partial,
                f"Token limit exceeded: {result.usage.total_tokens:,} of {self.max_tokens:,} tokens "
                f"({result.stop_reason})",
            )
        if result.ended_by == "max_cost_usd" and self.max_budget is not None:
            spent = (result.usage.cost_usd or 0.0) + result.unaccounted_cost_usd
            raise BudgetExceededError(spent, self.max_budget)
        decision = result.termination
        if (
            result.ended_by == "policy"
            and decision is not None
            and "Error threshold exceeded" in decision.reason
        ):
            raise ErrorThresholdExceededError(
                int(self.max_errors or 0),
                int(self.max_errors or 0),
                None,
                partial,
                decision.reason.split(": ", 1)[-1] if ": " in decision.reason else decision.reason,
            )
        if result.ended_by == "cancelled":
            raise CancellationError(partial, result.stop_reason or None)

    def close(self) -> None:  # type: ignore[override]
        """rlms's close(), which is not awaited: with persistent=True it ends the session;
        otherwise nothing is held between completion() calls (an open connection is closed by
        `async with rlm:` or `aclose()`). Inside an event loop, await `aclose()`."""
        if self._turns is not None:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                asyncio.run(self._end_turns())
                return
            raise ConfigurationError("close() blocks; inside an event loop, await aclose()")

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

    def __exit__(self, *exc: object) -> bool:
        self.close()  # rlms's: the persistent session ends with the block
        return False


def _prefixed(choice: ModelChoice) -> str:
    return f"anthropic:{choice.name}" if choice.provider == "anthropic" else choice.name


def _quietly(callback: Callable[..., Any] | None, *args: Any) -> None:
    """rlms's rule: a callback that raises does not break the run."""
    if callback is None:
        return
    try:
        callback(*args)
    except Exception as exc:  # noqa: BLE001
        print(
            f"[durable-rlm] callback {getattr(callback, '__name__', callback)!r} raised: {exc}",
            file=sys.stderr,
        )


def usage_by_model(timeline: Timeline, result: EpisodeResult, root_model: str) -> UsageSummary:
    """rlms's usage_summary: calls and tokens per model, over the whole tree. Calls the
    history does not tie to a model (extraction, compaction) count for the root model, so
    the totals are the result's."""
    per: dict[str, list[Any]] = {}

    def add(model: str, calls: int, usage: TokenUsage | None) -> None:
        row = per.setdefault(model, [0, 0, 0, 0.0, True])
        row[0] += calls
        if usage is not None:
            row[1] += usage.prompt_tokens
            row[2] += usage.completion_tokens
            if usage.cost_usd is None:
                row[4] = False
            else:
                row[3] += usage.cost_usd

    def walk(t: Timeline) -> None:
        for it in t.iterations:
            if it.usage is not None and not it.inherited_from:
                add(it.model or root_model, 1, it.usage)
            for cell in it.cells:
                for call in cell.sub_calls:
                    add(call.model, 1, call.usage)
                for child in cell.children:
                    if child.timeline is not None:
                        walk(child.timeline)

    walk(timeline)
    counted_calls = sum(row[0] for row in per.values())
    counted = TokenUsage(
        prompt_tokens=sum(row[1] for row in per.values()),
        completion_tokens=sum(row[2] for row in per.values()),
    )
    rest_calls = result.model_calls - counted_calls
    rest_in = result.usage.prompt_tokens - counted.prompt_tokens
    rest_out = result.usage.completion_tokens - counted.completion_tokens
    total_cost = result.usage.cost_usd
    rest_cost = None if total_cost is None else max(total_cost - sum(row[3] for row in per.values()), 0.0)
    if rest_calls > 0 or rest_in > 0 or rest_out > 0:
        rest = TokenUsage(
            prompt_tokens=max(rest_in, 0), completion_tokens=max(rest_out, 0), cost_usd=rest_cost
        )
        add(root_model, max(rest_calls, 0), rest)
    summaries = {
        model: ModelUsageSummary(calls, tokens_in, tokens_out, round(cost, 10) if known and cost else None)
        for model, (calls, tokens_in, tokens_out, cost, known) in per.items()
    }
    return UsageSummary(summaries)
