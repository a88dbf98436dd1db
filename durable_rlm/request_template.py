"""How a DurableRLM's episodes run (`RunOptions`, the one list of its arguments), the request
template every episode of one DurableRLM starts from (its models priced, its tools offered,
its limits and policy checked), and the request for one episode (the template with its task
and context). Everything is checked here, before anything starts: what is wrong raises
ConfigurationError or InvalidRequestError.

The Python API (`DurableRLM(model, **options)`), rlms's `RLM` (which translates rlms's
arguments into these) and `drlm run` (its flags) all build a `RunOptions`: an argument is
named, given its default and described once, here."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from durable_rlm.endpoints import SAMPLING_KEYS, cost_reported_by, model_settings
from durable_rlm.errors import InvalidRequestError
from durable_rlm.prices import PriceTable
from durable_rlm.settings import ConfigurationError, Settings
from durable_rlm.tools import ToolsArgument, offered, tool_specs
from durable_rlm.workflows import defaults, prompts
from durable_rlm.workflows.models import (
    ApproveMode,
    ContextRef,
    EpisodeLimits,
    EpisodeRequest,
    ModelSettings,
    RewardSpec,
    TerminationSpec,
)
from durable_rlm.workflows.termination import PolicyError
from durable_rlm.workflows.typed_outputs import fields_from_json_schema

DEFAULT_ROOT_PROMPT = prompts.CHILD_TASK.replace(" (a parent episode handed it to you)", "")


class RunOptions(BaseModel):
    """How the episodes of one DurableRLM run: every argument but the model's key and the
    settings (DurableRLM's own). Unknown names are refused, naming the known ones."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    model: str = Field(description="the root model: NAME, or PROVIDER:NAME (anthropic:claude-sonnet-4-5)")
    provider: str | None = Field(
        default=None, description="the root model's API (default: its prefix, else openai)"
    )
    base_url: str | None = Field(
        default=None, description="the root model's endpoint (default: the provider's)"
    )
    sub_model: str | None = Field(
        default=None, description="the model of llm_query (default: the root model)"
    )
    sub_base_url: str | None = Field(
        default=None, description="the sub-model's endpoint, when it is elsewhere"
    )
    other_models: tuple[str, ...] = Field(default=(), description="models REPL code may name (same endpoint)")
    max_depth: int = Field(
        default=defaults.MAX_DEPTH, description="rlm_query starts child episodes while depth < N"
    )
    limits: dict[str, Any] = Field(
        default_factory=dict, description="EpisodeLimits' fields (max_iterations, max_tokens, ...)"
    )
    policy: str = Field(default="final_pattern", description="the termination policy")
    policy_config: dict[str, Any] | None = None
    policy_scans_output: bool = Field(default=False, description="the policy reads what cells print")
    reward_function: str = Field(default="none", description="per-action reward: none or outcome")
    output_schema: dict[str, Any] | None = Field(
        default=None, description="JSON Schema of typed outputs (SUBMIT)"
    )
    tools: Any = Field(
        default=None,
        description="functions, registered tool names, or rlms's dict of name -> function or data "
        "(None: every registered tool)",
    )
    sub_tools: Any = Field(default=None, description="what child episodes offer (None: `tools`)")
    system_prompt: str | None = Field(default=None, description="replaces the built-in system prompt")
    setup_code: str | None = Field(default=None, description="the REPL's first cell")
    sampling: dict[str, Any] | None = Field(default=None, description="the root model's per-call settings")
    sub_sampling: dict[str, Any] | None = Field(
        default=None, description="the sub-model's (default: sampling)"
    )
    request_timeout_s: float = Field(
        default=defaults.REQUEST_TIMEOUT_S, description="seconds per model request"
    )
    max_attempts: int = Field(default=defaults.MODEL_ATTEMPTS, description="attempts per model call")
    logprobs: bool = Field(default=False, description="ask the root model for logprobs")
    code_fences: tuple[str, ...] = Field(default=("repl",), description="code fence languages that run")
    fallback_extraction: bool = Field(default=True, description="a limit before an answer extracts one")
    approve: ApproveMode = Field(default="none", description="cells that wait for a person: none, risky, all")
    reports_cost: bool | None = Field(
        default=None, description="the provider reports each call's cost (None: known for OpenRouter)"
    )

    @classmethod
    def of(cls, model: str, values: dict[str, Any]) -> RunOptions:
        """DurableRLM's keyword arguments as options: a limit may be given by its own name
        (`max_iterations=10`, which wins over `limits={...}`); `limits` may be EpisodeLimits."""
        given = dict(values)
        limits = given.pop("limits", None)
        limits = limits.model_dump() if isinstance(limits, EpisodeLimits) else dict(limits or {})
        for name in [n for n in given if n in EpisodeLimits.model_fields]:
            limits[name] = given.pop(name)
        unknown = sorted(set(given) - set(cls.model_fields))
        if unknown:
            raise ConfigurationError(
                f"unknown argument(s) {', '.join(unknown)}; options: {', '.join(cls.model_fields)}; "
                f"limits: {', '.join(EpisodeLimits.model_fields)}"
            )
        try:
            return cls(model=model, limits=limits, **given)
        except ValidationError as exc:
            raise InvalidRequestError.of(exc) from exc


def episode_request(
    template: EpisodeRequest, context: ContextRef | None, root_prompt: str | None
) -> EpisodeRequest:
    """One episode's request: the template with its task (rlms's default when None) and context."""
    task = root_prompt if root_prompt is not None else DEFAULT_ROOT_PROMPT
    try:
        return EpisodeRequest.model_validate({**template.model_dump(), "task": task, "context": context})
    except ValidationError as exc:
        raise InvalidRequestError.of(exc) from exc


def request_template(options: RunOptions, settings: Settings) -> EpisodeRequest:
    """The options as the request their episodes start from (task "template")."""
    from durable_rlm.workflows.episode import episode_policy  # start-up: temporalio's workflow module

    o = options
    offer = _offered(o.tools)
    sub_offer = None if o.sub_tools is None else _offered(o.sub_tools)
    if sub_offer is not None and sub_offer.setup_code:
        # Children run the parent's setup cell; data of their own has no cell yet.
        raise ConfigurationError(
            "sub_tools (custom_sub_tools) take functions only here: give data values in "
            "tools (custom_tools), which child episodes receive too"
        )
    try:
        output_fields = fields_from_json_schema(o.output_schema) if o.output_schema is not None else None
    except ValueError as exc:
        raise ConfigurationError(f"invalid output schema: {exc}") from exc
    try:
        base = {
            "base_url": o.base_url,
            "request_timeout_s": o.request_timeout_s,
            "max_attempts": o.max_attempts,
            "logprobs": o.logprobs,
            "reports_cost": o.reports_cost if o.reports_cost is not None else cost_reported_by(o.base_url),
        }
        prices = PriceTable.load(settings)
        root = prices.priced(model_settings(o.model, base, o.sampling, o.provider))
        shared = root.model_dump(exclude={"model", "price"})
        sub = None
        if o.sub_model or o.sub_sampling is not None or o.sub_base_url is not None:
            # Given its own sampling, the sub-model does not inherit the root's.
            sub_data = shared if o.sub_sampling is None else _without(shared, SAMPLING_KEYS)
            if o.sub_base_url is not None:
                reported = o.reports_cost if o.reports_cost is not None else cost_reported_by(o.sub_base_url)
                sub_data = {**sub_data, "base_url": o.sub_base_url, "reports_cost": reported}
            sub = model_settings(o.sub_model or o.model, sub_data, o.sub_sampling)
            if o.sub_base_url is not None and sub.base_url != o.sub_base_url:
                sub = ModelSettings(**(sub.model_dump() | {"base_url": o.sub_base_url}))
            sub = prices.priced(sub)
        template = EpisodeRequest(
            task="template",
            root_model=root,
            sub_model=sub,
            other_models=[prices.priced(model_settings(name, shared)) for name in o.other_models],
            max_depth=o.max_depth,
            limits=_limits(o.limits, {}),
            code_fences=list(o.code_fences),
            termination=TerminationSpec(
                name=o.policy, config=o.policy_config or {}, scan_printed_output=o.policy_scans_output
            ),
            reward=RewardSpec(function=o.reward_function),
            output_fields=output_fields,
            fallback_extraction=o.fallback_extraction,
            tools=offer.specs,
            sub_tools=None if sub_offer is None else sub_offer.specs,
            system_prompt=o.system_prompt,
            setup_code=_joined(offer.setup_code, o.setup_code),
            repl_values=offer.values,
            approve=o.approve,
        )
    except ValidationError as exc:
        raise InvalidRequestError.of(exc) from exc
    try:
        episode_policy(template)
    except PolicyError as exc:
        raise ConfigurationError(f"invalid episode request: {exc}") from exc
    return template


def _without(data: dict[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if k not in keys}


@dataclasses.dataclass(frozen=True)
class _Offer:
    specs: list[Any]
    setup_code: str | None
    values: list[str]


def _offered(tools: ToolsArgument) -> _Offer:
    """Functions are registered on first use (this process's worker runs them); names
    must be registered already; data values are bound by the setup cell. None offers
    every registered tool."""
    offer = offered(tools)
    return _Offer(tool_specs(offer.names), offer.setup_code(), offer.value_lines())


def _joined(*cells: str | None) -> str | None:
    code = "\n".join(c for c in cells if c)
    return code or None


def _limits(limits: EpisodeLimits | dict[str, Any] | None, values: dict[str, Any]) -> EpisodeLimits:
    """`limits` with the keyword limits over it; an unknown keyword is named with the known."""
    unknown = sorted(set(values) - set(EpisodeLimits.model_fields))
    if unknown:
        known = ", ".join(EpisodeLimits.model_fields)
        raise ConfigurationError(f"unknown argument(s) {', '.join(unknown)}; limits: {known}")
    base = limits.model_dump() if isinstance(limits, EpisodeLimits) else dict(limits or {})
    return EpisodeLimits.model_validate({**base, **values})
