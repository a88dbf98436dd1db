"""An episode request from DurableRLM's arguments: the template every episode of one DurableRLM
starts from (its models priced, its tools offered, its limits and policy checked), and the
request for one episode (the template with its task and context). Everything is checked
here, before anything starts: what is wrong raises ConfigurationError or InvalidRequestError."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from durable_rlm.endpoints import SAMPLING_KEYS, cost_reported_by, model_settings
from durable_rlm.errors import InvalidRequestError
from durable_rlm.prices import PriceTable
from durable_rlm.settings import ConfigurationError, Settings
from durable_rlm.tools import ToolsArgument, offered, tool_specs
from durable_rlm.workflows import prompts
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


def episode_request(
    template: EpisodeRequest, context: ContextRef | None, root_prompt: str | None
) -> EpisodeRequest:
    """One episode's request: the template with its task (rlms's default when None) and context."""
    task = root_prompt if root_prompt is not None else DEFAULT_ROOT_PROMPT
    try:
        return EpisodeRequest.model_validate({**template.model_dump(), "task": task, "context": context})
    except ValidationError as exc:
        raise InvalidRequestError.of(exc) from exc


def request_template(
    model: str,
    *,
    settings: Settings,
    provider: str | None,
    base_url: str | None,
    sub_model: str | None,
    sub_base_url: str | None,
    other_models: Sequence[str],
    max_depth: int,
    limits: EpisodeLimits | dict[str, Any] | None,
    limit_values: dict[str, Any],
    policy: str,
    policy_config: dict[str, Any] | None,
    policy_scans_output: bool,
    reward_function: str,
    output_schema: dict[str, Any] | None,
    tools: ToolsArgument,
    sub_tools: ToolsArgument,
    system_prompt: str | None,
    setup_code: str | None,
    sampling: dict[str, Any] | None,
    sub_sampling: dict[str, Any] | None,
    request_timeout_s: float,
    max_attempts: int,
    logprobs: bool,
    code_fences: Sequence[str],
    fallback_extraction: bool,
    approve: ApproveMode,
    reports_cost: bool | None,
) -> EpisodeRequest:
    """DurableRLM's arguments as the request its episodes start from (task "template")."""
    from durable_rlm.workflows.episode import episode_policy  # start-up: temporalio's workflow module

    offer = _offered(tools)
    sub_offer = None if sub_tools is None else _offered(sub_tools)
    if sub_offer is not None and sub_offer.setup_code:
        # Children run the parent's setup cell; data of their own has no cell yet.
        raise ConfigurationError(
            "sub_tools (custom_sub_tools) take functions only here: give data values in "
            "tools (custom_tools), which child episodes receive too"
        )
    try:
        output_fields = fields_from_json_schema(output_schema) if output_schema is not None else None
    except ValueError as exc:
        raise ConfigurationError(f"invalid output schema: {exc}") from exc
    try:
        base = {
            "base_url": base_url,
            "request_timeout_s": request_timeout_s,
            "max_attempts": max_attempts,
            "logprobs": logprobs,
            "reports_cost": reports_cost if reports_cost is not None else cost_reported_by(base_url),
        }
        prices = PriceTable.load(settings)
        root = prices.priced(model_settings(model, base, sampling, provider))
        shared = root.model_dump(exclude={"model", "price"})
        sub = None
        if sub_model or sub_sampling is not None or sub_base_url is not None:
            # Given its own sampling, the sub-model does not inherit the root's.
            sub_data = shared if sub_sampling is None else _without(shared, SAMPLING_KEYS)
            if sub_base_url is not None:
                reported = reports_cost if reports_cost is not None else cost_reported_by(sub_base_url)
                sub_data = {**sub_data, "base_url": sub_base_url, "reports_cost": reported}
            sub = model_settings(sub_model or model, sub_data, sub_sampling)
            if sub_base_url is not None and sub.base_url != sub_base_url:
                sub = ModelSettings(**(sub.model_dump() | {"base_url": sub_base_url}))
            sub = prices.priced(sub)
        template = EpisodeRequest(
            task="template",
            root_model=root,
            sub_model=sub,
            other_models=[prices.priced(model_settings(name, shared)) for name in other_models],
            max_depth=max_depth,
            limits=_limits(limits, limit_values),
            code_fences=list(code_fences),
            termination=TerminationSpec(
                name=policy, config=policy_config or {}, scan_printed_output=policy_scans_output
            ),
            reward=RewardSpec(function=reward_function),
            output_fields=output_fields,
            fallback_extraction=fallback_extraction,
            tools=offer.specs,
            sub_tools=None if sub_offer is None else sub_offer.specs,
            system_prompt=system_prompt,
            setup_code=_joined(offer.setup_code, setup_code),
            repl_values=offer.values,
            approve=approve,
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
