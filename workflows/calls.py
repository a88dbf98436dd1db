"""The calls a suspended cell makes, routed by kind through one table.

Every call from a cell names its kind (the REPL helper that made it). A kind maps to a
route: the step that answers it. `llm_query` and each element of `llm_query_batched` are
sub-model calls, one activity each. `rlm_query` and each element of `rlm_query_batched`
are child episodes: the same workflow, started as a Temporal child workflow with an id
derived from the parent's id, the cell and the call, so a replayed parent finds its
children in history instead of starting them again. Below max_depth's last level an
rlm_query is a plain sub-model call, as in rlms. Custom tools plug in here as new routes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import (
    ActivityError,
    ApplicationError,
    WorkflowAlreadyStartedError,
)
from temporalio.workflow import ParentClosePolicy

from durable_rlm.workflows import defaults, metadata, names, prompts
from durable_rlm.workflows.budget import ChildBudget
from durable_rlm.workflows.episode_context import EpisodeContext
from durable_rlm.workflows.models import (
    ChildEpisode,
    EpisodeRequest,
    EpisodeResult,
    ModelSettings,
    ParentLink,
    SubCallRequest,
    SubQueryInput,
    SubQueryReply,
    TerminationSpec,
    TokenUsage,
    ToolCallInput,
    ToolReply,
)
from durable_rlm.workflows.retries import (
    describe_failure,
    ending_of,
    is_timeout,
    model_step,
    model_step_outage,
    raise_if_cancelled,
    waits_for_credentials,
)


@dataclass(frozen=True)
class CallSite:
    """Where a call comes from: the episode (its context: the request, whether it is being
    cancelled, the waits for a fixed key or the store) and the cell that made it."""

    ctx: EpisodeContext
    iteration: int
    cell_index: int

    @property
    def request(self) -> EpisodeRequest:
        return self.ctx.request


@dataclass(frozen=True)
class CallResult:
    ok: bool
    text: str
    usage: TokenUsage = field(default_factory=TokenUsage)
    model_time_s: float = 0.0
    child: ChildEpisode | None = None  # set when a child episode ran (its spend is in it)
    unaccounted_tokens: int = 0  # tokens of descendants whose spend is unknown (their share)
    unaccounted_cost_usd: float = 0.0  # likewise, their cost share


Start = Callable[[CallSite, SubCallRequest, ModelSettings, ChildBudget | None], Awaitable[CallResult]]


@dataclass(frozen=True)
class Route:
    start: Start
    kind: Literal["model", "child", "tool"]  # a model call counts when started; a child when it ends


async def sub_model_call(
    site: CallSite, call: SubCallRequest, model: ModelSettings, budget: ChildBudget | None = None
) -> CallResult:
    """One sub-model call. A refused key does not answer the cell with an error (the model
    would spend iterations on it): the call waits, its cell suspended, for a fixed key. A
    store outage is waited out the same way."""
    outages = 0
    while True:
        try:
            reply = await model_step(
                names.SUB_QUERY,
                SubQueryInput(
                    episode_id=workflow.info().workflow_id,
                    iteration=site.iteration,
                    cell_index=site.cell_index,
                    call_index=call.call_index,
                    model=model,
                    prompt=call.prompt,
                    max_reply_chars=site.request.limits.max_reply_chars,
                ),
                result_type=SubQueryReply,
                summary=metadata.call_summary(
                    call.kind, site.cell_index, call.call_index, call.prompt, call.model
                ),
                model=model,
                durability=site.request.durability,
            )
        except ActivityError as err:
            raise_if_cancelled(err)
            waits = site.ctx.waits
            if waits_for_credentials(err):
                await waits.wait_for_credentials(describe_failure(err))
                continue
            outage = model_step_outage(err)
            if outage is not None:
                await waits.wait_for_store(outage, outages)
                outages += 1
                continue
            return CallResult(ok=False, text=describe_failure(err))
        return CallResult(ok=True, text=reply.text, usage=reply.usage, model_time_s=reply.model_time_s)


def child_id(parent_id: str, cell_index: int, call_index: int) -> str:
    """Deterministic: the same parent, cell and call always name the same child."""
    return f"{parent_id}/{cell_index}.{call_index}"


def child_request(
    site: CallSite, call: SubCallRequest, model: ModelSettings, budget: ChildBudget
) -> EpisodeRequest:
    """rlms semantics: the child reasons over the prompt as its `context`, with the parent's
    limits capped by its share of what the parent has left."""
    parent = site.request
    limits = parent.limits.model_copy(
        update={
            "max_llm_calls": min(parent.limits.max_llm_calls, budget.model_calls),
            "max_model_calls": budget.model_calls,
            "max_tokens": budget.tokens,
            "max_cost_usd": budget.cost_usd,
        }
    )
    return EpisodeRequest(
        task=prompts.CHILD_TASK if call.context is not None else call.prompt,
        context=call.context,
        root_model=model,
        sub_model=parent.sub_model,
        # Every model the parent could name, the child can name too.
        other_models=[parent.root_model, *parent.other_models],
        limits=limits,
        durability=parent.durability,
        code_fences=parent.code_fences,
        termination=TerminationSpec(scan_printed_output=parent.termination.scan_printed_output),
        tools=parent.tools if parent.sub_tools is None else parent.sub_tools,
        sub_tools=parent.sub_tools,
        system_prompt=parent.system_prompt,
        setup_code=parent.setup_code,
        repl_values=parent.repl_values,
        fallback_extraction=parent.fallback_extraction,
        max_depth=parent.max_depth,
        depth=parent.depth + 1,
        parent=ParentLink(
            episode_id=workflow.info().workflow_id, cell_index=site.cell_index, call_index=call.call_index
        ),
        deadline=budget.deadline,
        private_text=parent.private_text,
        approve=parent.approve,  # a child's cells wait for a person as the parent's do
        rlms=parent.rlms,
    )


async def child_episode(
    site: CallSite, call: SubCallRequest, model: ModelSettings, budget: ChildBudget | None = None
) -> CallResult:
    """Run a child episode to its end; its answer, or an `Error: ...` text, is the reply."""
    assert budget is not None
    request = child_request(site, call, model, budget)
    parent_id = workflow.info().workflow_id
    episode_id = child_id(parent_id, site.cell_index, call.call_index)
    # The child's task is the generic child wording: its prompt says what it is about.
    memo: dict[str, object] = {
        "parent": parent_id,
        "depth": request.depth,
        "prompt": metadata.shorten(call.prompt, metadata.TASK_CHARS),
    }
    search = None
    if metadata.uses_search_attributes(workflow.info().typed_search_attributes):
        shown = metadata.PRIVATE_TEXT if site.request.private_text else call.prompt
        search = metadata.start_search_attributes(shown, model.model)
    summary = ChildEpisode(
        episode_id=episode_id,
        depth=request.depth,
        cell_index=site.cell_index,
        call_index=call.call_index,
        model=model.model,
        ended_by="failed",
    )
    try:
        result: EpisodeResult = await workflow.execute_child_workflow(
            names.WORKFLOW,
            request,
            id=episode_id,
            result_type=EpisodeResult,
            parent_close_policy=ParentClosePolicy.REQUEST_CANCEL,
            task_timeout=timedelta(seconds=request.durability.task_timeout_s),
            memo=memo,
            search_attributes=search,
            static_summary=metadata.call_summary(call.kind, site.cell_index, call.call_index, call.prompt),
            static_details=metadata.child_details(
                request.depth, model.model, parent_id, site.cell_index, call.call_index, len(call.prompt)
            ),
        )
    except Exception as err:  # noqa: BLE001 - whatever stops a child is an Error: for the cell
        # Its spend is unknown: charge the whole share, so the tree still cannot pass its limits.
        if site.ctx.stop.stopping:
            ended, problem = "cancelled", "cancelled with its parent"
        else:
            ended, problem = _how_it_ended(err), describe_failure(err)
        charged = summary.model_copy(
            update={
                "ended_by": ended,
                "error": f"{problem} (its spend is unknown to the parent: its whole share is charged)",
                "model_calls": budget.model_calls,
            }
        )
        return CallResult(
            ok=False,
            text=f"child episode {episode_id} {ended}: {problem}",
            child=charged,
            unaccounted_tokens=budget.tokens or 0,
            unaccounted_cost_usd=budget.cost_usd or 0.0,
        )
    answered = result.answer is not None
    summary = summary.model_copy(
        update={
            "ended_by": result.ended_by,
            "answer": None if result.answer is None else result.answer[: defaults.CHILD_ANSWER_CHARS],
            "error": result.error,
            "model_calls": result.model_calls,
            "tokens": result.usage.total_tokens,
            "episodes": result.tree_episodes,
        }
    )
    unaccounted = result.unaccounted_tokens
    text = (
        result.answer
        if answered
        else (
            f"child episode {episode_id} ended by {result.ended_by} without an answer: {result.stop_reason}"
        )
    )
    return CallResult(
        ok=answered,
        text=text or "",
        usage=result.usage,
        model_time_s=result.model_time_s,
        child=summary,
        unaccounted_tokens=unaccounted,
        unaccounted_cost_usd=result.unaccounted_cost_usd,
    )


def _how_it_ended(err: BaseException) -> str:
    if isinstance(err, WorkflowAlreadyStartedError):
        return "could not start"
    return ending_of(getattr(err, "cause", None))


async def tool_call(
    site: CallSite, call: SubCallRequest, model: ModelSettings, budget: ChildBudget | None = None
) -> CallResult:
    """A custom tool, run as an activity with the timeout and retries it declared."""
    name = call.kind.removeprefix(names.TOOL_KIND_PREFIX)
    spec = site.request.tool_named(name)
    if spec is None:
        return CallResult(ok=False, text=f"no tool named {name!r} in this episode")
    try:
        reply = await workflow.execute_activity(
            names.RUN_TOOL,
            ToolCallInput(
                episode_id=workflow.info().workflow_id,
                iteration=site.iteration,
                cell_index=site.cell_index,
                call_index=call.call_index,
                tool=name,
                arguments=call.prompt,
            ),
            result_type=ToolReply,
            start_to_close_timeout=timedelta(seconds=spec.timeout_s),
            retry_policy=RetryPolicy(
                maximum_attempts=spec.max_attempts,
                non_retryable_error_types=[names.TOOL_BAD_CALL],
            ),
            summary=f"tool {name} {site.cell_index}.{call.call_index}",
        )
    except ActivityError as err:
        raise_if_cancelled(err)
        if is_timeout(err):
            return CallResult(ok=False, text=f"{name} timed out ({spec.timeout_s:g} s per attempt)")
        return CallResult(ok=False, text=_raised(err) or describe_failure(err))
    return CallResult(ok=True, text=reply.result)


def _raised(err: ActivityError) -> str | None:
    """The exception the tool raised, pickled by the worker, for the cell to raise as its
    own type; None when the failure carries none."""
    cause = err.cause
    if isinstance(cause, ApplicationError) and cause.type == names.TOOL_FAILED and cause.details:
        pickled = cause.details[0]
        if isinstance(pickled, str) and pickled.startswith(names.TOOL_VALUE_PREFIX):
            return pickled
    return None


TOOL = Route(tool_call, kind="tool")

ROUTES: dict[str, Route] = {
    "llm_query": Route(sub_model_call, kind="model"),
    "llm_query_batched": Route(sub_model_call, kind="model"),
    "rlm_query": Route(child_episode, kind="child"),
    "rlm_query_batched": Route(child_episode, kind="child"),
}

PLAIN = ROUTES["llm_query"]


def route_for(kind: str, request: EpisodeRequest) -> Route | None:
    """The route of a call; at the last level of max_depth an rlm_query is a plain call."""
    if kind.startswith(names.TOOL_KIND_PREFIX):
        return TOOL
    route = ROUTES.get(kind)
    if route is not None and route.kind == "child" and not request.spawns_children:
        return PLAIN
    return route
