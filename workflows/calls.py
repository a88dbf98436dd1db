"""The calls a suspended cell makes, routed by kind through one table.

Every call from a cell names its kind (the REPL helper that made it). A kind maps to a
route: the step that answers it. `llm_query` and each element of `llm_query_batched` are
sub-model calls, one activity each; `rlm_query` (child workflows) and custom tools plug in
here as new routes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from temporalio import workflow
from temporalio.exceptions import ActivityError

from workflows import names
from workflows.models import EpisodeRequest, SubCallRequest, SubQueryInput, SubQueryReply, TokenUsage
from workflows.retries import describe_failure, model_step_options, raise_if_cancelled


@dataclass(frozen=True)
class CallSite:
    request: EpisodeRequest
    iteration: int
    cell_index: int
    stop_on_cancel: bool = True  # False only when replaying histories from before that fix


@dataclass(frozen=True)
class CallResult:
    ok: bool
    text: str
    usage: TokenUsage = field(default_factory=TokenUsage)
    model_time_s: float = 0.0


@dataclass(frozen=True)
class Route:
    start: Callable[[CallSite, SubCallRequest], Awaitable[CallResult]]
    model_call: bool  # counts against max_llm_calls and model_calls


async def sub_model_call(site: CallSite, call: SubCallRequest) -> CallResult:
    model = site.request.effective_sub_model
    try:
        reply = await workflow.execute_activity(
            names.SUB_QUERY,
            SubQueryInput(
                episode_id=workflow.info().workflow_id,
                iteration=site.iteration,
                cell_index=site.cell_index,
                call_index=call.call_index,
                model=model,
                prompt=call.prompt,
            ),
            result_type=SubQueryReply,
            summary=f"{call.kind} {site.cell_index}.{call.call_index}",
            **model_step_options(model, site.request.durability),
        )
    except ActivityError as err:
        if site.stop_on_cancel:
            raise_if_cancelled(err)
        return CallResult(ok=False, text=describe_failure(err))
    return CallResult(ok=True, text=reply.text, usage=reply.usage, model_time_s=reply.model_time_s)


ROUTES: dict[str, Route] = {
    "llm_query": Route(sub_model_call, model_call=True),
    "llm_query_batched": Route(sub_model_call, model_call=True),
}
