"""A suspended cell's calls, answered by the workflow: each call by its kind's route (a model
call, a tool, a child episode: workflows/calls.py), model calls in parallel waves, the children
of one batch all at once with their shares of the budget, and what each spent charged to the
episode. Deterministic workflow code: the commands it emits are the REPL steps' own, moved
here from workflows/repl_steps.py unchanged."""

from __future__ import annotations

import asyncio

from temporalio import workflow

from durable_rlm.workflows.budget import ChildBudget, child_budgets, sub_call_refusal
from durable_rlm.workflows.calls import CallResult, CallSite, Route, route_for
from durable_rlm.workflows.episode_context import EpisodeContext
from durable_rlm.workflows.models import COST_DIGITS, CallAnswer, SubCallRequest


class CallAnswerer:
    """The calls of one suspended cell: started, awaited, charged."""

    def __init__(self, ctx: EpisodeContext) -> None:
        self.ctx = ctx
        self.request = ctx.request
        self.state = ctx.state

    async def answer(
        self, iteration: int, cell_index: int, requests: list[SubCallRequest]
    ) -> list[CallAnswer]:
        """Answer a suspended cell's calls by their kind's route: model calls in parallel
        waves, the children of one batch all at once, each with its share of the budget."""
        request = self.request
        site = CallSite(self.ctx, iteration, cell_index)
        routes = [route_for(call.kind, request) for call in requests]
        children = [route for route in routes if route is not None and route.kind == "child"]
        cap = request.limits.max_children_per_batch
        width = len(requests) if children else request.limits.max_parallel_subcalls
        answers: list[CallAnswer] = []
        for start in range(0, len(requests), width):
            wave = list(zip(requests[start : start + width], routes[start : start + width], strict=True))
            budget = None
            if children:
                share = child_budgets(request, self.state, len(children), workflow.now())
                if len(children) > cap:
                    share = (
                        f"{len(children)} child episodes in one batch; at most {cap} "
                        "(limits.max_children_per_batch)"
                    )
                budget = share
            pending = [self._start(site, call, route, budget) for call, route in wave]
            results = await self._gather(pending)
            for (call, _), done in zip(wave, results, strict=True):
                self._charge(done)
                answers.append(
                    CallAnswer(
                        call_index=call.call_index,
                        prompt_digest=call.prompt_digest,
                        ok=done.ok,
                        text=done.text,
                    )
                )
        return answers

    async def _gather(self, pending: list[asyncio.Future[CallResult] | CallResult]) -> list[CallResult]:
        """The wave's results in order. If the episode is cancelled meanwhile, the rest of the
        wave is cancelled too (children included), and waited for until it has closed; the
        children are listed in the result, then the cancellation goes on up."""
        results: list[CallResult] = []
        interrupted = False
        try:
            for item in pending:
                results.append(item if isinstance(item, CallResult) else await item)
                # A cancel the awaited call absorbed (a child cancelled before it started)
                # still stops the episode: the flag says so, not the task's state.
                if self.ctx.stop.stopping:
                    interrupted = True
                    break
        except asyncio.CancelledError:
            interrupted = True
        if not interrupted:
            return results
        started = [item for item in pending if isinstance(item, asyncio.Future)]
        for item in started:
            item.cancel()
        ended = await asyncio.gather(*started, return_exceptions=True)
        for done in ended:
            if isinstance(done, CallResult):
                # Children cancelled with this episode are charged their whole share (their
                # spend is in their own histories); the rest charge what they spent.
                self._charge(done)
        raise asyncio.CancelledError()

    def _start(
        self, site: CallSite, call: SubCallRequest, route: Route | None, budget: ChildBudget | str | None
    ) -> asyncio.Future[CallResult] | CallResult:
        """Start one call, or say why it is not made (its answer is then an error text)."""
        state = self.state
        if route is None:
            return CallResult(ok=False, text=f"unknown call kind {call.kind!r}")
        if route.kind == "tool":
            limit = self.request.limits.max_tool_calls
            if state.tool_calls >= limit:
                return CallResult(ok=False, text=f"max_tool_calls ({limit}) reached: the tool was not called")
            state.tool_calls += 1
            return asyncio.ensure_future(route.start(site, call, self.request.root_model, None))
        model = self.request.model_named(call.model)
        if model is None:
            known = ", ".join(self.request.known_models)
            return CallResult(ok=False, text=f"unknown model {call.model!r} (known: {known})")
        if route.kind == "model":
            refusal = sub_call_refusal(self.request, state)
            if refusal is not None:
                return CallResult(ok=False, text=refusal)
            state.sub_calls += 1
            state.model_calls += 1
            return asyncio.ensure_future(route.start(site, call, model, None))
        if not isinstance(budget, ChildBudget):
            return CallResult(ok=False, text=str(budget))
        return asyncio.ensure_future(route.start(site, call, model, budget))

    def _charge(self, done: CallResult) -> None:
        state = self.state
        if done.child is not None:
            state.charge_child(done.child, done.usage, done.model_time_s)
            state.unaccounted_tokens += done.unaccounted_tokens
            state.unaccounted_cost_usd = round(
                state.unaccounted_cost_usd + done.unaccounted_cost_usd, COST_DIGITS
            )
        else:
            state.charge(done.usage, done.model_time_s, calls=0)  # counted when started
