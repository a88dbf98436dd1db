"""`drlm run`, `drlm demo`, `drlm scripted-server`: start an episode and follow it to its answer.

The command line becomes a `DurableRLM` (durable_rlm/api.py): the CLI and the Python API
are one code path, and a request is validated before anything starts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from durable_rlm.cli.arguments import env_number, json_object
from durable_rlm.cli.handlers import Subparsers, bind, import_extensions
from durable_rlm.cli.operations import episode_page
from durable_rlm.cli.output import EXIT_OK, FOLLOWING, print_end, stderr
from durable_rlm.settings import ConfigurationError, Settings
from durable_rlm.workflows import defaults

if TYPE_CHECKING:
    from durable_rlm.api import DurableRLM
    from durable_rlm.request_template import RunOptions


def _run_parser(sub: Subparsers) -> None:
    run = sub.add_parser("run", help="run an episode and print its answer")
    run.add_argument("task")
    run.add_argument(
        "--context",
        type=Path,
        action="append",
        help="a file whose text (or JSON, for .json) is `context`; a directory, or --context given "
        "more than once, makes `context` a list of documents, one per file, each loaded when touched",
    )
    run.add_argument(
        "--context-view",
        choices=("str", "mapped"),
        default="str",
        help="mapped: one ASCII text too large for a str, as a read-only view of the worker's copy "
        "(slices, find, count, lines(); pages shared by every sandbox)",
    )
    _model_args(run)
    _limit_args(run)
    run.add_argument("--fence", action="append", help="code fence language(s) to run (default: repl)")
    run.add_argument("--policy", default="final_pattern", help="termination policy (seed 003)")
    run.add_argument("--policy-config", type=json_object, default={}, help="policy config as JSON")
    run.add_argument(
        "--policy-scans-output",
        action="store_true",
        help="let the policy see what cells print (by default only the model's own answer ends an episode)",
    )
    run.add_argument(
        "--accept-extracted",
        action="store_true",
        help="exit 0, not 4, when a limit was reached and the answer was extracted",
    )
    run.add_argument("--reward-function", default="none", help="per-action reward: none or outcome")
    run.add_argument("--logprobs", action="store_true", help="ask the root model for logprobs")
    run.add_argument("--output-schema", type=Path, help="JSON Schema of typed outputs (SUBMIT)")
    run.add_argument("--no-extraction", action="store_true", help="no fallback extraction at limits")
    run.add_argument(
        "--tool",
        action="append",
        metavar="NAME",
        help="offer only these custom tools (default: every tool DRLM_TOOL_MODULES registers)",
    )
    run.add_argument("--no-tools", action="store_true", help="offer no custom tools")
    run.add_argument("--id", help="episode id (default: a new one)")
    run.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: the result, or how the episode ended without one",
    )
    run.add_argument("--no-wait", action="store_true", help="start the episode and print its id")
    run.add_argument(
        "--approve",
        choices=("none", "risky", "all"),
        default="none",
        help="cells that wait for a person's approval (drlm pending / approve / reject): none (the "
        "default), those a risk assessment flags (writes, processes, network, ctypes, endless loops), all",
    )
    bind(run, _run)


def _demo_parser(sub: Subparsers) -> None:
    dem = sub.add_parser("demo", help="run the demo episode (scripted model unless OPENAI_API_KEY)")
    _model_args(dem)
    dem.add_argument("--json", action="store_true")
    bind(dem, _demo)


def _scripted_server_parser(sub: Subparsers) -> None:
    scripted = sub.add_parser(
        "scripted-server",
        help="serve the demo's scripted model (OpenAI's chat API on 127.0.0.1): try drlm run without a key",
    )
    scripted.add_argument("--port", type=int, default=0, help="the port (default: a free one)")
    scripted.add_argument(
        "--log", type=Path, help="also write the demo's log here, a context its transcript fits"
    )
    bind(scripted, _scripted_server, sdk_runtime=False)  # it never reaches Temporal


PARSERS = {"run": _run_parser, "demo": _demo_parser, "scripted-server": _scripted_server_parser}
SCRIPTED_MODEL = "scripted-rlm"  # the scripted server's model: any name does, this one says what it is


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=os.environ.get("DRLM_MODEL") or None,
        help="the root model, e.g. gpt-4o-mini or anthropic:claude-sonnet-4-5 (default: DRLM_MODEL; "
        "there is no built-in default: a run names the model it pays for)",
    )
    parser.add_argument("--sub-model", help="model for llm_query (default: --model)")
    parser.add_argument(
        "--sampling",
        type=json_object,
        default={},
        help='per-call settings of the root model as JSON: {"temperature": 0.2, "top_p": 0.9, '
        '"max_tokens": 2000, "stop": ["###"], "extra_body": {"top_k": 40}}; also the sub-model\'s '
        "unless --sub-sampling",
    )
    parser.add_argument("--sub-sampling", type=json_object, help="per-call settings of the sub-model")
    parser.add_argument(
        "--other-model",
        action="append",
        default=[],
        metavar="NAME",
        help="a model REPL code may name: llm_query(p, model=NAME), rlm_query(p, model=NAME) "
        "(same endpoint; repeatable)",
    )
    parser.add_argument("--base-url", help="OpenAI-compatible base URL (default: OPENAI_BASE_URL)")
    parser.add_argument(
        "--provider",
        choices=["openai", "anthropic"],
        help="the root model's API (default: from a prefix such as anthropic:NAME, else openai)",
    )
    parser.add_argument("--sub-base-url", help="base URL of the sub-model, when it is elsewhere")
    parser.add_argument("--api-key", help="API key (embedded mode only; never stored in history)")
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=env_number("DRLM_REQUEST_TIMEOUT_S", defaults.REQUEST_TIMEOUT_S),
        help=f"seconds per model request (default {defaults.REQUEST_TIMEOUT_S:g}; DRLM_REQUEST_TIMEOUT_S)",
    )
    parser.add_argument(
        "--max-attempts",
        type=int,
        default=int(env_number("DRLM_MODEL_ATTEMPTS", defaults.MODEL_ATTEMPTS)),
        help=f"attempts per model call (default {defaults.MODEL_ATTEMPTS}; DRLM_MODEL_ATTEMPTS)",
    )


def _limit_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-iterations", type=int, default=defaults.MAX_ITERATIONS)
    parser.add_argument(
        "--max-llm-calls", type=int, default=defaults.MAX_LLM_CALLS, help="sub-calls from the REPL"
    )
    parser.add_argument(
        "--max-duration",
        type=float,
        default=defaults.MAX_DURATION.total_seconds(),
        help="seconds, counted from submission (a durable timer)",
    )
    parser.add_argument(
        "--cell-timeout", type=float, default=defaults.CELL_TIMEOUT_S, help="seconds per REPL cell"
    )
    parser.add_argument(
        "--output-truncation", type=int, default=defaults.OUTPUT_TRUNCATION, help="chars of cell output shown"
    )
    parser.add_argument(
        "--context-window", type=int, help="the root model's context window in tokens (enables compaction)"
    )
    parser.add_argument(
        "--max-depth",
        type=int,
        default=defaults.MAX_DEPTH,
        help=f"rlm_query starts child episodes while depth < N (root is 0; default {defaults.MAX_DEPTH}: "
        f"no recursion; at most {defaults.MAX_DEPTH_CEILING})",
    )
    parser.add_argument(
        "--max-model-calls", type=int, help="every model call of the episode tree (root, sub, children)"
    )
    parser.add_argument("--max-tokens", type=int, help="tokens of the episode tree")
    parser.add_argument(
        "--max-cost-usd",
        type=float,
        help="USD of the episode tree, from the price table (DRLM_PRICES_FILE adds models)",
    )
    parser.add_argument(
        "--max-children",
        type=int,
        default=defaults.MAX_CHILDREN_PER_BATCH,
        help=f"child episodes per rlm_query_batched call (default {defaults.MAX_CHILDREN_PER_BATCH})",
    )


NO_MODEL = "name a model: --model NAME or DRLM_MODEL (e.g. --model gpt-4o-mini)"


def _require_model(args: argparse.Namespace) -> None:
    """No silent default: a model the user never chose must not be called, nor priced."""
    if not args.model:
        raise ConfigurationError(NO_MODEL)


async def _run(settings: Settings, args: argparse.Namespace) -> int:
    _require_model(args)
    import_extensions(settings)
    plan = _plan_context(args.context, settings, args.context_view)
    rlm = _rlm(_run_options(args), settings, args.api_key)  # validate before starting anything
    rlm.request(None, args.task)
    rlm.check_credentials()
    context = None if plan is None else await asyncio.to_thread(_store_context, settings, plan)
    following = Following(no_wait=args.no_wait, episode_id=args.id, json=args.json)
    return await _run_episode(settings, rlm, args.task, context, following, args.accept_extracted)


@dataclass(frozen=True)
class Following:
    """How `drlm run` (or the demo) follows the episode it starts."""

    no_wait: bool = False  # print the id and return
    episode_id: str | None = None  # the id asked for (default: a new one)
    json: bool = False  # one JSON object on stdout, no progress on stderr


def _rlm(options: RunOptions, settings: Settings, api_key: str | None) -> DurableRLM:
    """The command line as a DurableRLM: the CLI and the Python API are one code path."""
    from durable_rlm.api import DurableRLM  # start-up: the API and pydantic's models (~0.2 s)

    return DurableRLM(options.model, options=options, api_key=api_key, settings=settings)


def _model_options(args: argparse.Namespace) -> dict[str, Any]:
    """The model flags `drlm run` and `drlm demo` share, as RunOptions' fields."""
    return {
        "model": args.model,
        "provider": args.provider,
        "base_url": args.base_url,
        "sub_model": args.sub_model,
        "sub_base_url": args.sub_base_url,
        "other_models": tuple(args.other_model),
        "sampling": args.sampling or None,
        "sub_sampling": args.sub_sampling,
        "request_timeout_s": args.request_timeout,
        "max_attempts": args.max_attempts,
    }


def _run_options(args: argparse.Namespace) -> RunOptions:
    """`drlm run`'s flags as the options of its episode."""
    limits = {
        "max_iterations": args.max_iterations,
        "max_llm_calls": args.max_llm_calls,
        "max_duration": timedelta(seconds=args.max_duration),
        "cell_timeout_s": args.cell_timeout,
        "output_truncation": args.output_truncation,
        "context_window_tokens": args.context_window,
        "max_model_calls": args.max_model_calls,
        "max_tokens": args.max_tokens,
        "max_cost_usd": args.max_cost_usd,
        "max_children_per_batch": args.max_children,
    }
    return _options(
        _model_options(args),
        max_depth=args.max_depth,
        limits=limits,
        policy=args.policy,
        policy_config=args.policy_config,
        policy_scans_output=args.policy_scans_output,
        reward_function=args.reward_function,
        output_schema=_output_schema(args.output_schema),
        tools=[] if args.no_tools else args.tool,
        logprobs=args.logprobs,
        code_fences=tuple(args.fence or ["repl"]),
        fallback_extraction=not args.no_extraction,
        approve=args.approve,
    )


def _options(fields: dict[str, Any], **more: Any) -> RunOptions:
    from durable_rlm.request_template import RunOptions  # start-up: the API's models (~0.2 s)

    return RunOptions.of(fields.pop("model"), {**fields, **more})


def _output_schema(path: Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ConfigurationError(f"output schema not found: {path}") from exc
    except json.JSONDecodeError as exc:
        raise ConfigurationError(f"invalid output schema {path}: {exc}") from exc
    if not isinstance(schema, dict):
        raise ConfigurationError(f"invalid output schema {path}: a JSON Schema object is needed")
    return schema


async def _run_episode(
    settings: Settings,
    rlm: DurableRLM,
    task: str,
    context: Any,
    following: Following,
    accept_extracted: bool = False,
) -> int:
    from durable_rlm.client.episodes import follow  # start-up: temporalio, the stores (~0.6 s)

    services = await rlm.open(work=not following.no_wait)
    try:
        episode = await rlm.start(context, task, following.episode_id)
        handle = episode.handle
        if following.no_wait:
            print(handle.id)
            return EXIT_OK
        FOLLOWING.append(handle.id)
        if not following.json:
            stderr(f"episode {handle.id} started on task queue {services.settings.task_queue}")
            page = episode_page(settings, handle.id)
            if page:
                stderr(f"its page: {page}")
            elif url := services.episode_url(handle.id, handle.first_execution_run_id):
                stderr(f"its events in the Temporal UI: {url}")
        end = await follow(handle, None if following.json else stderr)
        return print_end(end, following.json, accept_extracted)
    finally:
        await rlm.close()


def _room(settings: Settings) -> Any:
    """What one sandbox can hold: as this host's worker sets it when the session's workers
    are embedded (or local), as a worker at best would otherwise."""
    from durable_rlm.activities.context_room import sandbox_room  # start-up: the sandbox's limits (~20 ms)

    return sandbox_room(settings.sandbox_memory_mb, local=settings.embedded)


def _store_context(settings: Settings, plan: Any) -> Any:
    """Stream the planned files into the blob store, then measure them against what a
    sandbox holds: a context that cannot load is refused before the server or an episode
    starts (its blobs, named by nothing, go at the next `drlm gc`)."""
    from durable_rlm.client.context_input import store_plan  # start-up: the stores (~0.3 s)
    from durable_rlm.server.connection import open_stores  # start-up: as the line above

    blobs, engine = open_stores(settings)
    try:
        return store_plan(blobs, plan, _room(settings))
    finally:
        engine.dispose()


def _plan_context(paths: list[Path] | None, settings: Settings, view: str = "str") -> Any:
    """The --context paths checked before anything starts (what they are, their size against
    what a sandbox holds), none of them read yet: every problem is a one-line error."""
    if not paths:
        return None
    from durable_rlm.client.context_input import plan_context  # start-up: the stores (~0.3 s)

    return plan_context(paths, _room(settings), view)


async def _demo(settings: Settings, args: argparse.Namespace) -> int:
    """The demo episode, against a real model when a key or endpoint is given, else against
    the scripted one; the same path as `drlm run` with the demo's task, log and limits."""
    from durable_rlm import demo  # start-up: the demo's script and scripted server (~0.1 s)
    from durable_rlm.scripted import ScriptedModelServer  # start-up: as the line above

    import_extensions(settings)
    following = Following(json=args.json)
    real = (
        os.environ.get("OPENAI_API_KEY") or os.environ.get("OPENAI_BASE_URL") or args.api_key or args.base_url
    )
    if real:
        _require_model(args)
        if not args.json:
            stderr(f"demo: using the real model {args.model!r}")
        rlm = _rlm(_options(_model_options(args), limits=demo.LIMITS), settings, args.api_key)
        return await _run_episode(settings, rlm, demo.TASK, demo.demo_log(), following)
    with ScriptedModelServer(demo.demo_script()) as server:
        scripted = {
            **_model_options(args),
            "model": SCRIPTED_MODEL,
            "sub_model": None,
            "base_url": server.base_url,
        }
        if not args.json:
            stderr(
                f"demo: using a SCRIPTED model server at {server.base_url} (it plays a fixed RLM "
                "transcript; set OPENAI_API_KEY to run the same demo against a real model)"
            )
        rlm = _rlm(_options(scripted, limits=demo.LIMITS), settings, args.api_key)
        code = await _run_episode(settings, rlm, demo.TASK, demo.demo_log(), following)
        if not args.json:
            service, count = demo.expected_answer(demo.demo_log())
            stderr(f"demo: ground truth is {service} with {count} ERROR lines")
        return code


async def _scripted_server(settings: Settings, args: argparse.Namespace) -> int:
    """The demo's scripted model as a server of its own, until Ctrl-C or SIGTERM: its base
    URL alone on stdout's first line (for scripts), how to use it on stderr."""
    from durable_rlm import demo  # start-up: the demo's script and scripted server (~0.1 s)
    from durable_rlm.scripted import ScriptedModelServer  # start-up: as the line above

    if args.log is not None:
        args.log.write_text(demo.demo_log() + "\n", encoding="utf-8")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    with ScriptedModelServer(demo.demo_script(), port=args.port) as server:
        print(server.base_url, flush=True)
        context = str(args.log) if args.log is not None else "demo.log  (write it with --log demo.log)"
        stderr(
            "a SCRIPTED model (it plays the demo's RLM transcript, and really counts the ERROR lines "
            "its sub-calls are given); any key is accepted. Try:\n"
            f'  drlm run "{demo.TASK}" --base-url {server.base_url} --model {SCRIPTED_MODEL} '
            f"--context {context}\n(Ctrl-C stops it)"
        )
        await stop.wait()
    return EXIT_OK
