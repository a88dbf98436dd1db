"""rlms's result types (rlm/core/types.py), and its usage summary read from an episode's
timeline: the run's own calls and tokens per model, as rlms counts them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from durable_rlm.workflows.models import EpisodeResult, TokenUsage

if TYPE_CHECKING:
    from durable_rlm.audit.timeline import Timeline


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

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelUsageSummary:
        return cls(
            total_calls=data.get("total_calls"),  # type: ignore[arg-type]  # None if missing, as rlms reads it
            total_input_tokens=data.get("total_input_tokens"),  # type: ignore[arg-type]  # None if missing, as rlms reads it
            total_output_tokens=data.get("total_output_tokens"),  # type: ignore[arg-type]  # None if missing, as rlms reads it
            total_cost=data.get("total_cost"),
        )


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

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> UsageSummary:
        return cls(
            {
                model: ModelUsageSummary.from_dict(summary)
                for model, summary in (data.get("model_usage_summaries") or {}).items()
            }
        )


@dataclass
class RLMChatCompletion:
    """rlms's result, and ours: `episode` is the EpisodeResult, whose fields (`answer`,
    `ended_by`, `episode_id`, `iterations`...) read through as attributes. It is left out
    of the repr, the equality and `to_dict`, which stay rlms's."""

    root_model: str
    prompt: Any
    response: str
    usage_summary: UsageSummary
    execution_time: float
    metadata: dict[str, Any] | None = None
    error: str | None = None  # rlms: set when this one call failed (in a batch)
    episode: EpisodeResult | None = field(default=None, repr=False, compare=False)

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
        if self.error is not None:
            result["error"] = self.error
        return result

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RLMChatCompletion:
        return cls(
            root_model=data.get("root_model"),  # type: ignore[arg-type]  # None if missing, as rlms reads it
            prompt=data.get("prompt"),
            response=data.get("response"),  # type: ignore[arg-type]  # None if missing, as rlms reads it
            usage_summary=UsageSummary.from_dict(data.get("usage_summary") or {}),
            execution_time=data.get("execution_time"),  # type: ignore[arg-type]  # None if missing, as rlms reads it
            metadata=data.get("metadata"),
            error=data.get("error"),
        )


def usage_by_model(timeline: Timeline, result: EpisodeResult, root_model: str) -> UsageSummary:
    """rlms's usage_summary: the calls the run made itself, per model: its root calls, the
    sub-calls its cells made that answered, compaction and the closing extraction (rlms's
    default answer).
    A child episode's calls (rlm_query) are the child's own, as a child RLM's are in rlms;
    the whole tree stays in the result's `episode.usage`. Calls the history does not tie to
    a model count for the root model, so the totals are the run's own."""
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

    children = TokenUsage()
    children_calls = failed = 0
    for it in timeline.iterations:
        if it.usage is not None and not it.inherited_from:
            add(it.model or root_model, 1, it.usage)
        for cell in it.cells:
            for call in cell.sub_calls:
                if call.error is not None:
                    failed += 1  # rlms counts the calls that answered
                    continue
                add(call.model, 1, call.usage)
    for child in result.children:
        ended = _child_result(timeline, child.episode_id)
        children_calls += ended.model_calls if ended is not None else child.model_calls
        spent = ended.usage if ended is not None else TokenUsage(prompt_tokens=child.tokens, cost_usd=None)
        children = children.add(spent)
    rest_calls = result.model_calls - children_calls - failed - sum(row[0] for row in per.values())
    rest_in = result.usage.prompt_tokens - children.prompt_tokens - sum(row[1] for row in per.values())
    rest_out = (
        result.usage.completion_tokens - children.completion_tokens - sum(row[2] for row in per.values())
    )
    if rest_calls > 0 or rest_in > 0 or rest_out > 0:
        own_cost = None
        if result.usage.cost_usd is not None and children.cost_usd is not None:
            own_cost = result.usage.cost_usd - children.cost_usd
        rest_cost = None if own_cost is None else max(own_cost - sum(row[3] for row in per.values()), 0.0)
        rest = TokenUsage(
            prompt_tokens=max(rest_in, 0), completion_tokens=max(rest_out, 0), cost_usd=rest_cost
        )
        add(root_model, max(rest_calls, 0), rest)
    summaries = {
        model: ModelUsageSummary(calls, tokens_in, tokens_out, round(cost, 10) if known and cost else None)
        for model, (calls, tokens_in, tokens_out, cost, known) in per.items()
    }
    return UsageSummary(summaries)


def _child_result(timeline: Timeline, episode_id: str) -> EpisodeResult | None:
    for it in timeline.iterations:
        for cell in it.cells:
            for child in cell.children:
                if child.episode_id == episode_id and child.timeline is not None:
                    return child.timeline.result
    return None
