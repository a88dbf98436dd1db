"""`durable_rlm.dspy.RLM`: DSPy's RLM module, each call a durable episode.

    import dspy
    from durable_rlm.dspy import RLM  # was: RLM = dspy.RLM

    dspy.configure(lm=dspy.LM("openai/gpt-4o-mini"))
    rlm = RLM("context, query -> answer", max_iters=10, tools=[lookup])
    prediction = rlm(context=huge_text, query="Which service failed most?")

It is a `dspy.RLM` (a `dspy.Module`, with its `generate_action` and `extract` predictors, so
it composes in larger programs and optimizers compile it) whose `forward` / `aforward` run
one episode on the durable runtime: the model sees the prompts DSPy's own adapter renders
(the optimizer's demos included), the REPL is the episode's sandbox with the inputs bound as
variables, tools are durable activities, and the Prediction has the fields DSPy's RLM gives
(the outputs, `trajectory`, `final_reasoning`). The LM configured in DSPy (and `sub_lm`) is
called by the workers: its model string, `api_base` and `api_key` say where.

With no TEMPORAL_ADDRESS each call runs on an embedded server and worker in this process, as
`DurableRLM` does; with one, this process is a client and the workers do the work (their
environment holds the keys, and the tools must be importable there: DRLM_TOOL_MODULES).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import threading
import warnings
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import dspy
from dspy.primitives.python_interpreter import PythonInterpreter

from durable_rlm.api import DurableRLM, on_own_thread, run_blocking
from durable_rlm.dspy import lms, prediction, prompts
from durable_rlm.dspy.outputs import output_fields
from durable_rlm.errors import ConfigurationError
from durable_rlm.settings import Settings
from durable_rlm.store.chains import read_conversation
from durable_rlm.tools import registered_as
from durable_rlm.workflows import dspy_program
from durable_rlm.workflows.models import EpisodeResult, Message

T = TypeVar("T")
STEPS_LOG = logging.getLogger("dspy.predict.rlm")
"""`verbose`: each step, where DSPy's RLM logs its own (logged when the call returns)."""
DSPY_VERSION = "3.4.1"
SUB_KEY_ENV = "DSPY_SUB_LM_API_KEY"
"""The sub-model's key variable when its key is not the root model's (embedded worker only)."""


class RLM(dspy.RLM):  # type: ignore[misc]  # dspy ships no type information
    """dspy.RLM's constructor and `forward(**inputs)` / `aforward`, durable underneath.

    `interpreter_factory` is taken and not used (the REPL is the episode's sandbox).
    Keyword-only extras: `settings` (DurableRLM's), `limits` (our limits besides DSPy's, e.g.
    `cell_timeout_s`, `max_duration`)."""

    def __init__(
        self,
        signature: Any,
        max_iters: int = 20,
        max_llm_calls: int = 50,
        max_output_chars: int = 10_000,
        verbose: bool = False,
        tools: list[Callable[..., Any]] | None = None,
        sub_lm: Any = None,
        interpreter_factory: Callable[[], Any] | None = PythonInterpreter,
        *,
        settings: Settings | None = None,
        limits: dict[str, Any] | None = None,
    ) -> None:
        _unused_interpreter(interpreter_factory)
        super().__init__(
            signature,
            max_iters=max_iters,
            max_llm_calls=max_llm_calls,
            max_output_chars=max_output_chars,
            verbose=verbose,
            tools=tools,
            sub_lm=sub_lm,
            interpreter_factory=prompts.Sandbox,
        )
        self.durable_settings = settings
        self.durable_limits = dict(limits or {})
        self.last_episode_id: str | None = None
        self._tool_functions()  # a tool that cannot be one is refused now, not at the first call

    # --- calls --------------------------------------------------------------------------------

    def forward(self, *, interpreter_factory: Callable[[], Any] | None = None, **input_args: Any) -> Any:
        """One episode over `input_args` (the signature's inputs), to its Prediction. It
        blocks, also where an event loop runs (the episode then runs on a thread of its own)."""
        _unused_interpreter(interpreter_factory)
        plan = self._plan(input_args)
        result, conversation = _blocking(lambda: self._episode(plan))
        return self._predicted(plan, result, conversation)

    async def aforward(
        self, *, interpreter_factory: Callable[[], Any] | None = None, **input_args: Any
    ) -> Any:
        _unused_interpreter(interpreter_factory)
        plan = self._plan(input_args)
        result, conversation = await self._episode(plan)
        return self._predicted(plan, result, conversation)

    # --- the episode ------------------------------------------------------------------------

    def _plan(self, input_args: dict[str, Any]) -> _Plan:
        """Everything the call needs from DSPy's settings, read here in the caller's context
        (dspy.context applies to this thread): the request, the key, the inputs."""
        self._validate_inputs(input_args)
        for name, value in input_args.items():
            try:
                json.dumps(value, allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise ValueError(
                    f"input {name!r} ({type(value).__name__}) is not a JSON value, and the REPL gets "
                    f"its inputs as JSON, as DSPy's LocalInterpreter does: {exc}"
                ) from None
        variables = self._build_variables(**input_args)
        variables_info = [variable.format() for variable in variables]
        action_signature = self._action_signature_for_current_factory(prompts.Sandbox, "")
        rendered = prompts.dspy_prompts(
            action_signature,
            list(self.generate_action.demos),
            self.extract.signature,
            list(self.extract.demos),
            variables_info,
            self.max_output_chars,
            list(input_args),
        )
        durable = self._durable_rlm()
        request_template = durable.template.model_copy(
            update={"dspy": rendered, "output_fields": output_fields(self.signature)}
        )
        durable.template = request_template
        return _Plan(durable, dict(input_args), variables, len(rendered.action), _task(self.signature))

    def _durable_rlm(self) -> DurableRLM:
        root_lm = self.generate_action.lm or dspy.settings.lm
        if root_lm is None:
            raise ConfigurationError("No LM configured. Use dspy.configure(lm=...) or pass sub_lm to RLM.")
        root = lms.endpoint_of(root_lm)
        sub = lms.endpoint_of(self.sub_lm, "sub_lm") if self.sub_lm is not None else None
        settings = self.durable_settings or Settings.from_env()
        limits: dict[str, Any] = {
            "max_iterations": self.max_iters,
            "max_llm_calls": self.max_llm_calls,
            # What the episode page shows of each output; the model reads DSPy's cut of it.
            "output_truncation": max(self.max_output_chars, 100),
            "max_cells_per_reply": 1,
            **self.durable_limits,
        }
        durable = DurableRLM(
            root.model,
            base_url=root.base_url,
            sub_model=sub.model if sub is not None else None,
            sub_base_url=sub.base_url if sub is not None else None,
            sampling=root.sampling or None,
            sub_sampling=sub.sampling if sub is not None else None,
            max_depth=1,
            limits=limits,
            tools=self._tool_functions(),
            reports_cost=root.road.reports_cost or None,
            settings=settings,
        )
        _key_variables(durable, root, sub, settings.embedded)
        return durable

    def _tool_functions(self) -> dict[str, Callable[..., Any]]:
        """The tools as the REPL offers them, each under its DSPy name: called as DSPy calls
        them (keyword arguments, through the dspy.Tool, which checks and converts them)."""
        return {name: _durable_tool(name, tool) for name, tool in self._user_tools.items()}

    async def _episode(self, plan: _Plan) -> tuple[EpisodeResult, list[Message]]:
        async with plan.durable:
            episode = await plan.durable.start(plan.inputs, plan.task)
            self.last_episode_id = episode.id
            try:
                result = await episode.result()
            except (KeyboardInterrupt, asyncio.CancelledError):
                # The caller gave up: the episode stops too, instead of running on unwatched.
                await asyncio.shield(episode.cancel(reason="cancelled by the caller"))
                raise
            conversation = await asyncio.to_thread(
                read_conversation, episode.services.blobs, result.conversation
            )
        return result, conversation

    def _predicted(self, plan: _Plan, result: EpisodeResult, conversation: list[Message]) -> Any:
        run = prediction.run_of(self.signature, result, conversation, plan.prefix)
        if self.verbose:
            steps = [*run.steps, *([run.final] if run.final is not None else [])]
            for number, step in enumerate(steps, start=1):
                STEPS_LOG.info(
                    f"RLM iteration {number}/{self.max_iters} (episode {result.episode_id})\n"
                    f"Reasoning: {step.reasoning}\nCode:\n{step.code}\n"
                    + dspy_program.format_output(step.output, self.max_output_chars)
                )
        prediction.record_traces(
            run,
            self.generate_action,
            self.extract,
            plan.variables,
            self.max_iters,
            self.max_output_chars,
        )
        return prediction.prediction_of(run)


class _Plan:
    def __init__(
        self, durable: DurableRLM, inputs: dict[str, Any], variables: list[Any], prefix: int, task: str
    ) -> None:
        self.durable, self.inputs, self.variables = durable, inputs, variables
        self.prefix, self.task = prefix, task


def _task(signature: Any) -> str:
    """The episode's task as lists and pages show it: the program's signature."""
    inputs, outputs = ", ".join(signature.input_fields), ", ".join(signature.output_fields)
    return f"DSPy RLM: {inputs} -> {outputs}"


def _unused_interpreter(factory: Any) -> None:
    """DSPy's interpreters run code in this process's children; the episode's REPL is its
    sandbox. DSPy's own are taken as the one-line switch leaves them; another says so."""
    if factory is None or factory is PythonInterpreter or factory is prompts.Sandbox:
        return
    if getattr(factory, "__module__", "").startswith("dspy."):
        return
    warnings.warn(
        f"durable_rlm.dspy.RLM runs its REPL in the episode's sandbox: interpreter_factory "
        f"{getattr(factory, '__name__', factory)!r} is not used",
        UserWarning,
        stacklevel=3,
    )


_WRAPPED: dict[tuple[str, Any], Callable[..., Any]] = {}
_WRAPPED_LOCK = threading.Lock()


def _durable_tool(name: str, tool: Any) -> Callable[..., Any]:
    """The function registered as the tool `name`: one per function for the process (a
    copy of the program, as an optimizer makes, offers the same tool). A function already
    registered as a durable tool is that tool."""
    func: Callable[..., Any] = tool.func
    if registered_as(func) == name:
        return func
    with _WRAPPED_LOCK:
        known = _WRAPPED.get((name, func))
        if known is not None:
            return known
        if inspect.iscoroutinefunction(func):

            async def invoke_async(**kwargs: Any) -> Any:
                return await tool.acall(**kwargs)

            wrapper: Callable[..., Any] = invoke_async
        else:

            def invoke(**kwargs: Any) -> Any:
                return tool(**kwargs)

            wrapper = invoke
        functools.update_wrapper(wrapper, func)
        wrapper.__signature__ = _by_name(inspect.signature(func))  # type: ignore[attr-defined]  # what the REPL's stub binds

        _WRAPPED[(name, func)] = wrapper
        return wrapper


def _by_name(signature: inspect.Signature) -> inspect.Signature:
    """The tool's parameters, each taken by name only, as DSPy's interpreters call tools
    (a positional argument is a TypeError in the cell, as under DSPy)."""
    kept = [
        p.replace(kind=inspect.Parameter.KEYWORD_ONLY) if p.kind != inspect.Parameter.VAR_KEYWORD else p
        for p in signature.parameters.values()
        if p.kind != inspect.Parameter.VAR_POSITIONAL
    ]
    return signature.replace(parameters=kept)


def _key_variables(durable: DurableRLM, root: lms.Endpoint, sub: lms.Endpoint | None, embedded: bool) -> None:
    """Each model reads its road's key variable; a key the LM holds goes to the embedded
    worker under it (a worker elsewhere has its own keys)."""
    t = durable.template
    root_model = t.root_model.model_copy(update={"api_key_env": root.road.key_env})
    credentials = {root.road.key_env: root.api_key} if embedded and root.api_key else {}
    sub_model = t.sub_model
    if sub is not None and sub_model is not None:
        key_env = sub.road.key_env
        if embedded and sub.api_key and credentials.get(key_env, sub.api_key) != sub.api_key:
            key_env = SUB_KEY_ENV  # another key under the same variable: a variable of its own
        sub_model = sub_model.model_copy(
            update={"api_key_env": key_env, "reports_cost": sub.road.reports_cost}
        )
        if embedded and sub.api_key:
            credentials[key_env] = sub.api_key
    durable.template = t.model_copy(update={"root_model": root_model, "sub_model": sub_model})
    durable.credentials = credentials


def _blocking(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine to its end, blocking: on this thread, or where an event loop already
    runs here (a notebook, an async app), on a thread with a loop of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return run_blocking(make())
    return on_own_thread(make, "durable-rlm dspy episode")
