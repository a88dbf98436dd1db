"""`drlm`: run, follow, show and list RLM episodes.

Without TEMPORAL_ADDRESS every command starts the embedded Temporal dev server on the data
directory's SQLite file (and, when an episode has to make progress, an in-process worker).
With it, the CLI is only a client and `python worker.py` does the work.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from pydantic import ValidationError
from temporalio.client import WorkflowUpdateFailedError
from temporalio.service import RPCError

from durable_rlm import demo, schema
from durable_rlm.api import DurableRLM
from durable_rlm.episodes import (
    CancelOutcome,
    EpisodeEnd,
    cancel_episode,
    follow,
    load_context_file,
    send_reward,
)
from durable_rlm.errors import DurableRLMError
from durable_rlm.projection import rebuild_audit
from durable_rlm.runtime import Services, connect, import_policy_modules, running_workers, session
from durable_rlm.scripted import ScriptedModelServer
from durable_rlm.settings import ConfigurationError, Settings
from durable_rlm.timeline import describe_execution, episode_timeline, render
from durable_rlm.tools import import_tool_modules
from workflows import defaults
from workflows.models import (
    EpisodeResult,
)
from workflows.termination import PolicyError

EXIT_OK = 0  # the model (or a policy that found one) answered
EXIT_FAILED = 1  # a model error, a failed or timed-out episode
EXIT_USAGE = 2  # bad command line, configuration or request: nothing was started
EXIT_NO_ANSWER = 3  # a limit or a policy stopped it, and there is no answer
EXIT_EXTRACTED = 4  # a limit stopped it and the answer was extracted (0 with --accept-extracted)
EXIT_CANCELLED = 5  # cancelled or terminated

CANCEL_HEAD_START_S = 0.5  # how long `drlm cancel` lets its request travel before its worker polls


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="drlm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run an episode and print its answer")
    run.add_argument("task")
    run.add_argument("--context", type=Path, help="file whose text (or JSON, for .json) is `context`")
    _model_args(run)
    _limit_args(run)
    run.add_argument("--fence", action="append", help="code fence language(s) to run (default: repl)")
    run.add_argument("--policy", default="final_pattern", help="termination policy (seed 003)")
    run.add_argument("--policy-config", type=_json_object, default={}, help="policy config as JSON")
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

    dem = sub.add_parser("demo", help="run the demo episode (scripted model unless OPENAI_API_KEY)")
    _model_args(dem)
    dem.add_argument("--json", action="store_true")

    show = sub.add_parser("show", help="an episode's timeline from its history")
    show.add_argument("episode_id")
    show.add_argument("--json", action="store_true")
    show.add_argument("--full", action="store_true", help="do not shorten long texts")

    resume = sub.add_parser("resume", help="wait for an episode, working on it if embedded")
    resume.add_argument("episode_id")
    resume.add_argument("--json", action="store_true")
    resume.add_argument("--accept-extracted", action="store_true")

    cancel = sub.add_parser("cancel", help="cancel a running episode and every child episode it started")
    cancel.add_argument("episode_id")
    cancel.add_argument(
        "--extract",
        action="store_true",
        help="first run fallback extraction, so the result holds what was found so far",
    )
    cancel.add_argument("--reason", default="cancelled by request", help="recorded in the result")

    sub.add_parser("doctor", help="check this machine: Temporal, stores, and the sandbox's isolation layers")

    reward = sub.add_parser("reward", help="send a reward to a running episode")
    reward.add_argument("episode_id")
    reward.add_argument("value", type=float)
    reward.add_argument("--note")

    sub.add_parser("audit-rebuild", help="rebuild the SQL audit projection from the histories")

    listing = sub.add_parser("list", help="episodes in the audit store")
    listing.add_argument("--limit", type=int, default=20)
    return parser


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=os.environ.get("DRLM_MODEL", "gpt-4o-mini"))
    parser.add_argument("--sub-model", help="model for llm_query (default: --model)")
    parser.add_argument(
        "--sampling",
        type=_json_object,
        default={},
        help='per-call settings of the root model as JSON: {"temperature": 0.2, "top_p": 0.9, '
        '"max_tokens": 2000, "stop": ["###"], "extra_body": {"top_k": 40}}; also the sub-model\'s '
        "unless --sub-sampling",
    )
    parser.add_argument("--sub-sampling", type=_json_object, help="per-call settings of the sub-model")
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
        default=_env_number("DRLM_REQUEST_TIMEOUT_S", defaults.REQUEST_TIMEOUT_S),
        help=f"seconds per model request (default {defaults.REQUEST_TIMEOUT_S:g}; DRLM_REQUEST_TIMEOUT_S)",
    )
    parser.add_argument(
        "--max-attempts",
        type=int,
        default=int(_env_number("DRLM_MODEL_ATTEMPTS", defaults.MODEL_ATTEMPTS)),
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
        "--max-children",
        type=int,
        default=defaults.MAX_CHILDREN_PER_BATCH,
        help=f"child episodes per rlm_query_batched call (default {defaults.MAX_CHILDREN_PER_BATCH})",
    )


def _env_number(name: str, default: float) -> float:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        return float(value)
    except ValueError as exc:
        raise ConfigurationError(f"{name} must be a number, got {value!r}") from exc


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _rlm(args: argparse.Namespace, settings: Settings) -> DurableRLM:
    """The command line as a DurableRLM: the CLI and the Python API are one code path."""
    limits = {
        "max_iterations": args.max_iterations,
        "max_llm_calls": args.max_llm_calls,
        "max_duration": timedelta(seconds=args.max_duration),
        "cell_timeout_s": args.cell_timeout,
        "output_truncation": args.output_truncation,
        "context_window_tokens": getattr(args, "context_window", None),
        "max_model_calls": getattr(args, "max_model_calls", None),
        "max_tokens": getattr(args, "max_tokens", None),
        "max_children_per_batch": getattr(args, "max_children", defaults.MAX_CHILDREN_PER_BATCH),
    }
    return DurableRLM(
        args.model,
        provider=getattr(args, "provider", None),
        base_url=args.base_url,
        sub_model=args.sub_model,
        sub_base_url=getattr(args, "sub_base_url", None),
        other_models=getattr(args, "other_model", []),
        max_depth=getattr(args, "max_depth", defaults.MAX_DEPTH),
        limits=limits,
        policy=getattr(args, "policy", "final_pattern"),
        policy_config=getattr(args, "policy_config", {}),
        policy_scans_output=getattr(args, "policy_scans_output", False),
        reward_function=getattr(args, "reward_function", "none"),
        output_schema=_output_schema(getattr(args, "output_schema", None)),
        tools=[] if getattr(args, "no_tools", False) else getattr(args, "tool", None),
        sampling=getattr(args, "sampling", None) or None,
        sub_sampling=getattr(args, "sub_sampling", None),
        request_timeout_s=args.request_timeout,
        max_attempts=args.max_attempts,
        logprobs=getattr(args, "logprobs", False),
        code_fences=args.fence or ["repl"],
        fallback_extraction=not getattr(args, "no_extraction", False),
        api_key=args.api_key,
        settings=settings,
    )


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


def exit_code(end: EpisodeEnd, accept_extracted: bool = False) -> int:
    """The exit code a script reads: answered, extracted, no answer, failed, cancelled."""
    if end.status in ("cancelled", "terminated"):
        return EXIT_CANCELLED
    result = end.result
    if result is not None and result.ended_by == "cancelled":
        return EXIT_CANCELLED
    if result is None or result.ended_by == "model_error":
        return EXIT_FAILED
    if result.answer is None:
        return EXIT_NO_ANSWER
    if result.answer_source == "extraction" and not accept_extracted:
        return EXIT_EXTRACTED
    return EXIT_OK


def _print_end(end: EpisodeEnd, as_json: bool, accept_extracted: bool = False) -> int:
    if as_json:
        print(json.dumps(end.report()))
        return exit_code(end, accept_extracted)
    result = end.result
    if result is None:
        _stderr(f"episode {end.episode_id} {end.status.replace('_', ' ')}: {end.error}")
        return exit_code(end, accept_extracted)
    _stderr(
        f"ended by {result.ended_by} after {result.iterations} iteration(s), "
        f"{result.model_calls} model call(s), {result.usage.total_tokens} tokens"
    )
    _stderr(f"stop reason: {result.stop_reason}")
    source = result.answer_source + (f" ({result.answer_policy})" if result.answer_policy else "")
    confidence = "" if result.confidence is None else f", confidence {result.confidence:.2f}"
    _stderr(f"answer source: {source}{confidence}")
    if result.execution is not None:
        _stderr(describe_execution(result.execution))
    if result.lost_cells or result.compactions:
        _stderr(f"lost cells: {result.lost_cells}; compactions: {result.compactions}")
    if result.error:
        _stderr(f"error: {result.error}")
    if result.answer is not None:
        print(result.answer)
    return exit_code(end, accept_extracted)


async def _run_episode(settings: Settings, args: argparse.Namespace, context_value: Any) -> int:
    rlm = _rlm(args, settings)
    services = await rlm.open(work=not args.no_wait)
    try:
        if context_value is None and getattr(args, "context", None):
            context = load_context_file(services.blobs, args.context)
        else:
            context = context_value
        episode = await rlm.start(context, args.task, getattr(args, "id", None))
        handle = episode.handle
        if args.no_wait:
            print(handle.id)
            return EXIT_OK
        if not args.json:
            _stderr(f"episode {handle.id} started on task queue {settings.task_queue}")
        end = await follow(handle, None if args.json else _stderr)
        return _print_end(end, args.json, args.accept_extracted)
    finally:
        await rlm.close()


async def _demo(settings: Settings, args: argparse.Namespace) -> int:
    args.task, args.no_wait, args.id, args.accept_extracted = demo.TASK, False, None, False
    args.max_iterations, args.max_llm_calls, args.max_duration = 10, 50, 600.0
    args.cell_timeout, args.output_truncation, args.fence = 60.0, 20_000, None
    args.context_window = None
    if os.environ.get("OPENAI_API_KEY") or os.environ.get("OPENAI_BASE_URL") or args.api_key or args.base_url:
        if not args.json:
            _stderr(f"demo: using the real model {args.model!r}")
        return await _run_episode(settings, args, demo.demo_log())
    with ScriptedModelServer(demo.demo_script()) as server:
        args.base_url, args.model, args.sub_model = server.base_url, "scripted-rlm", None
        if not args.json:
            _stderr(
                f"demo: using a SCRIPTED model server at {server.base_url} (it plays a fixed RLM "
                "transcript; set OPENAI_API_KEY to run the same demo against a real model)"
            )
        code = await _run_episode(settings, args, demo.demo_log())
        if not args.json:
            service, count = demo.expected_answer(demo.demo_log())
            _stderr(f"demo: ground truth is {service} with {count} ERROR lines")
        return code


async def _show(settings: Settings, args: argparse.Namespace) -> int:
    async with connect(settings) as services:
        timeline = await episode_timeline(services.client, args.episode_id)
    if args.json:
        print(timeline.model_dump_json())
    else:
        print(render(timeline, width=10**9 if args.full else 2_000))
    return EXIT_OK


async def _reward(settings: Settings, args: argparse.Namespace) -> int:
    async with connect(settings) as services:
        try:
            receipt = await send_reward(services.client, args.episode_id, args.value, args.note)
        except WorkflowUpdateFailedError as exc:
            raise ConfigurationError(f"reward refused: {exc.cause or exc}") from exc
    print(
        f"reward accepted ({receipt.accepted} so far; pending {receipt.pending:g}, "
        f"cumulative {receipt.cumulative:g})"
    )
    return EXIT_OK


async def _resume(settings: Settings, args: argparse.Namespace) -> int:
    async with session(settings) as services:
        handle = services.client.get_workflow_handle(args.episode_id, result_type=EpisodeResult)
        end = await follow(handle, None if args.json else _stderr)
        return _print_end(end, args.json, args.accept_extracted)


async def _cancel(settings: Settings, args: argparse.Namespace) -> int:
    # A worker must run the cancellation (it cancels the children, closes the sandbox and
    # the audit row, and extracts when asked).
    async with connect(settings) as services:
        # The request reaches the server before this process's worker polls: an episode no
        # worker has picked up yet then sees the cancel in its first task, before any call.
        request = asyncio.ensure_future(
            cancel_episode(services.client, args.episode_id, args.extract, args.reason)
        )
        await asyncio.wait({request}, timeout=CANCEL_HEAD_START_S)
        if request.done():  # refused (the episode ended) or accepted: no worker needed for that
            outcome = request.result()
            if not outcome.accepted:
                return await _cancelled(services, args, outcome)
        try:
            async with running_workers(services) if settings.embedded else contextlib.nullcontext():
                return await _cancelled(services, args, await request)
        finally:
            request.cancel()  # a no-op once done; a worker that failed to start leaves it pending


async def _cancelled(services: Services, args: argparse.Namespace, outcome: CancelOutcome) -> int:
    _stderr(outcome.message)
    if not outcome.accepted:
        return EXIT_OK
    handle = services.client.get_workflow_handle(args.episode_id, result_type=EpisodeResult)
    code = _print_end(await follow(handle, None), as_json=False)
    return EXIT_OK if code == EXIT_CANCELLED else code


async def _list(settings: Settings, args: argparse.Namespace) -> int:
    from durable_rlm.projection import reconcile_audit

    async with connect(settings) as services:
        engine = services.engine
        assert engine is not None
        await reconcile_audit(services.client, engine)
    table = schema.episodes
    with engine.connect() as conn:
        rows = conn.execute(sa.select(table).order_by(table.c.updated_at.desc()).limit(args.limit)).all()
    for row in rows:
        answer = (row.answer or "").replace("\n", " ")[:60]
        print(f"{row.episode_id}  {row.status:<9} {row.ended_by or '-':<14} {row.task[:40]!r}  {answer}")
    return EXIT_OK


async def _dispatch(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    # Custom policies must be known here too: `run` validates the request before starting.
    import_policy_modules(settings.policy_module_names)
    import_tool_modules(settings.tool_module_names)
    if args.command == "run":
        if args.context is not None and not args.context.is_file():
            raise ConfigurationError(f"context file not found: {args.context}")
        rlm = _rlm(args, settings)  # validate before starting anything
        rlm.request(None, args.task)
        rlm.check_credentials()
        return await _run_episode(settings, args, None)
    if args.command == "demo":
        return await _demo(settings, args)
    if args.command == "show":
        return await _show(settings, args)
    if args.command == "resume":
        return await _resume(settings, args)
    if args.command == "reward":
        return await _reward(settings, args)
    if args.command == "cancel":
        return await _cancel(settings, args)
    if args.command == "doctor":
        from durable_rlm.doctor import run_doctor

        return await run_doctor(settings)
    if args.command == "audit-rebuild":
        async with connect(settings) as services:
            count = await rebuild_audit(services.client, services.engine)
        print(f"audit store rebuilt from history: {count} episode(s)")
        return EXIT_OK
    return await _list(settings, args)


def main(argv: list[str] | None = None) -> None:
    # The SDK logs every failed activity attempt with a traceback; the CLI reports retries
    # and failures itself. DRLM_LOG_LEVEL brings the logs back.
    logging.basicConfig(level=os.environ.get("DRLM_LOG_LEVEL", "ERROR"))
    logging.getLogger("temporalio").setLevel(os.environ.get("DRLM_LOG_LEVEL", "CRITICAL"))
    try:
        args = build_parser().parse_args(argv)
        code = asyncio.run(_dispatch(args))
    except (DurableRLMError, ValidationError, PolicyError) as exc:
        _stderr(f"drlm: {_explain(exc)}")
        code = EXIT_USAGE
    except LookupError as exc:
        _stderr(f"drlm: {exc.args[0] if exc.args else exc}")
        code = EXIT_USAGE
    except RPCError as exc:
        _stderr(f"drlm: Temporal error: {exc}")
        code = EXIT_FAILED
    except KeyboardInterrupt:
        _stderr("drlm: interrupted; the episode goes on durably (`drlm resume ID` to follow it)")
        code = 130
    # temporalio can crash at interpreter exit after all work is done (sdk-python#300).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _explain(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'value'}: {err['msg']}" for err in exc.errors()
        )
        return f"invalid episode request: {problems}"
    return str(exc)


if __name__ == "__main__":
    main()
