"""`drlm`: run, follow, show and list RLM episodes.

Without TEMPORAL_ADDRESS the commands share the data directory's embedded Temporal server
(durable_rlm/server/embedded.py: started on first use, stopped when idle) and `run`/`resume` work on
the episode in-process. With it, the CLI is only a client and `python worker.py` does the work.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Awaitable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from pydantic import ValidationError

from durable_rlm.errors import DurableRLMError, ServerUnavailable
from durable_rlm.settings import ConfigurationError, Settings
from durable_rlm.workflows import defaults

# Commands import what they use: `drlm show` of an ended episode and `drlm list` read the
# SQL store and answer in a fraction of a second, without temporalio or model clients.
if TYPE_CHECKING:
    from durable_rlm.api import DurableRLM
    from durable_rlm.client.episodes import CancelOutcome, EpisodeEnd
    from durable_rlm.server.connection import Services

T = TypeVar("T")

EXIT_OK = 0  # the model (or a policy that found one) answered
EXIT_FAILED = 1  # a model error, a failed or timed-out episode
EXIT_USAGE = 2  # bad command line, configuration or request: nothing was started
EXIT_NO_ANSWER = 3  # a limit or a policy stopped it, and there is no answer
EXIT_EXTRACTED = 4  # a limit stopped it and the answer was extracted (0 with --accept-extracted)
EXIT_CANCELLED = 5  # cancelled or terminated
EXIT_PAUSED = 6  # the episode waits for a fix (a model key): `drlm resume ID` once fixed
EXIT_INTERRUPTED = 130  # Ctrl-C: the episode itself goes on

CANCEL_HEAD_START_S = 0.5  # how long `drlm cancel` lets its request travel before its worker polls


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class _Parser(argparse.ArgumentParser):
    """A bad flag is one line (with where to look) and exit 2, not a usage dump."""

    def error(self, message: str) -> NoReturn:
        _stderr(f"{self.prog}: {message} (see `{self.prog} --help`)")
        _exit(EXIT_USAGE)
        raise SystemExit(EXIT_USAGE)  # not reached


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="drlm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

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
    run.add_argument(
        "--approve",
        choices=("none", "risky", "all"),
        default="none",
        help="cells that wait for a person's approval (drlm pending / approve / reject): none (the "
        "default), those a risk assessment flags (writes, processes, network, ctypes, endless loops), all",
    )

    dem = sub.add_parser("demo", help="run the demo episode (scripted model unless OPENAI_API_KEY)")
    _model_args(dem)
    dem.add_argument("--json", action="store_true")

    scripted = sub.add_parser(
        "scripted-server",
        help="serve the demo's scripted model (OpenAI's chat API on 127.0.0.1): try drlm run without a key",
    )
    scripted.add_argument("--port", type=int, default=0, help="the port (default: a free one)")
    scripted.add_argument(
        "--log", type=Path, help="also write the demo's log here, a context its transcript fits"
    )

    show = sub.add_parser("show", help="an episode's timeline from its history")
    show.add_argument("episode_id")
    show.add_argument("--json", action="store_true")
    show.add_argument("--full", action="store_true", help="do not shorten long texts")
    show.add_argument(
        "--refresh", action="store_true", help="read the history even if the timeline is stored"
    )

    worker = sub.add_parser(
        "worker", help="run a worker: `python worker.py` (settings from the environment, see drlm info)"
    )
    worker.add_argument(
        "--processes",
        default=os.environ.get("DRLM_WORKER_PROCESSES", "1"),
        help="worker processes under one supervisor sharing the sandbox budget: a number, or auto "
        "(one per core); default DRLM_WORKER_PROCESSES or 1",
    )

    watch = sub.add_parser("watch", help="follow a running episode's progress until it ends (no worker)")
    watch.add_argument("episode_id")
    watch.add_argument("--json", action="store_true")
    watch.add_argument("--accept-extracted", action="store_true")
    watch.add_argument(
        "--plain",
        action="store_true",
        help="progress as lines, not the live view (the default when stderr is not a terminal)",
    )

    ui = sub.add_parser(
        "ui", help="the episode page of one episode (--temporal: its Temporal UI page), or the UI's list"
    )
    ui.add_argument("episode_id", nargs="?")
    ui.add_argument(
        "--temporal", action="store_true", help="the episode's Temporal UI page (its raw events) instead"
    )
    ui.add_argument("--open", action="store_true", help="open it in the browser too")
    ui.add_argument(
        "--keep", action="store_true", help="keep the embedded server (and its UI) up until Ctrl-C"
    )

    codec = sub.add_parser(
        "codec-server",
        help="serve Temporal's remote codec protocol for a Web UI (claim-checked payloads as their content)",
    )
    codec.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    codec.add_argument("--port", type=int, default=8234)
    codec.add_argument(
        "--origin",
        action="append",
        help="a Web UI origin allowed to call it (repeatable; default DRLM_UI_ADDRESS, or the embedded UI's)",
    )

    config = sub.add_parser(
        "config", help="every effective setting, its variable and who chose it (secrets masked)"
    )
    config.add_argument("--json", action="store_true")
    info = sub.add_parser("info", help="where data lives, which setting chose it, and the server")
    info.add_argument("--json", action="store_true")

    resume = sub.add_parser(
        "resume",
        help="follow an episode, working on it if embedded: resumes it if a person paused it, and "
        "retries calls paused on a refused key",
    )
    resume.add_argument("episode_id")
    _sender_arg(resume)
    resume.add_argument("--api-key", help="the fixed key (embedded mode only; never stored in history)")
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

    verify = sub.add_parser(
        "verify", help="check that every blob the histories and the audit store reference is whole"
    )
    verify.add_argument("episode_id", nargs="?", help="one episode and its children")
    verify.add_argument("--all", action="store_true", help="every episode")
    verify.add_argument("--json", action="store_true")

    _steering_parsers(sub)

    deployment = sub.add_parser(
        "deployment", help="the Worker Deployment's builds; make one current or ramp it (rolling upgrades)"
    )
    deployment.add_argument("action", nargs="?", choices=("show", "set-current", "ramp"), default="show")
    deployment.add_argument("build_id", nargs="?", help="the build (set-current, ramp)")
    deployment.add_argument("percent", nargs="?", type=float, help="of new episodes (ramp)")
    deployment.add_argument("--name", help="the deployment (default: DRLM_DEPLOYMENT_NAME)")

    _time_travel_parsers(sub)

    export = sub.add_parser("export", help="write an episode as an rlms trajectory log or as JSON")
    export.add_argument("episode_id")
    export.add_argument("--format", choices=("rlms", "json"), default="rlms")
    export.add_argument("-o", "--output", help="write to this file (default: standard output)")

    listing = sub.add_parser("list", help="episodes in the audit store, newest first")
    listing.add_argument("--limit", type=int, default=20)
    listing.add_argument(
        "--status", choices=("running", "completed", "failed", "cancelled", "terminated", "timed_out")
    )
    listing.add_argument("--model", help="episodes whose root or sub-model is this one")
    listing.add_argument(
        "--since", type=_moment, help="started at or after: 2026-11-24, 2026-11-24T10:00, 24h, 7d"
    )
    listing.add_argument("--until", type=_moment, help="started before (same forms)")
    listing.add_argument("--min-cost", type=float, help="USD; episodes of unknown cost are left out")
    listing.add_argument("--max-cost", type=float, help="USD")
    listing.add_argument("--roots", action="store_true", help="leave child episodes out")
    listing.add_argument("--json", action="store_true", help="one JSON object per line")
    listing.add_argument(
        "--refresh",
        action="store_true",
        help="first migrate the store and settle rows of episodes that ended without writing theirs",
    )
    return parser


def _moment(text: str) -> Any:
    from durable_rlm.audit.readonly import parse_moment

    try:
        return parse_moment(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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


def _steering_parsers(sub: Any) -> None:
    """A person's actions on a running episode: each a Temporal update with its sender."""
    hint = sub.add_parser("hint", help="a message the episode's root model reads on its next turn")
    hint.add_argument("episode_id")
    hint.add_argument("text")
    _sender_arg(hint)

    limits = sub.add_parser(
        "limits",
        help="raise or lower a running episode's limits (below what is spent: it ends by extraction)",
    )
    limits.add_argument("episode_id")
    limits.add_argument("--max-iterations", type=int)
    limits.add_argument("--max-llm-calls", type=int, help="sub-calls from the REPL")
    limits.add_argument("--max-duration", type=float, help="seconds, counted from submission")
    limits.add_argument("--max-model-calls", type=int)
    limits.add_argument("--max-tokens", type=int)
    limits.add_argument("--max-cost-usd", type=float)
    _sender_arg(limits)

    pause = sub.add_parser(
        "pause", help="hold an episode at its next step boundary, without a sandbox, until `drlm resume`"
    )
    pause.add_argument("episode_id")
    pause.add_argument(
        "--hold-clock", action="store_true", help="max-duration does not count the pause (by default it does)"
    )
    pause.add_argument("--reason", default="")
    _sender_arg(pause)

    finish = sub.add_parser(
        "finish", help="make an episode answer now: it stops at the next step boundary and extracts"
    )
    finish.add_argument("episode_id")
    finish.add_argument("--reason", default="")
    _sender_arg(finish)

    pending = sub.add_parser("pending", help="cells waiting for approval, across the running episodes")
    pending.add_argument("--json", action="store_true", help="one JSON object per line")

    approve = sub.add_parser(
        "approve", help="run a cell that waits for approval (ID as `drlm pending` lists it)"
    )
    approve.add_argument("approval_id", metavar="ID", help="EPISODE#CELL, or an episode id: its waiting cell")
    approve.add_argument(
        "--edit", type=Path, metavar="FILE", help="run this file's code instead of the cell's"
    )
    _sender_arg(approve)

    reject = sub.add_parser("reject", help="do not run a cell that waits for approval; the model reads why")
    reject.add_argument("approval_id", metavar="ID", help="EPISODE#CELL, or an episode id: its waiting cell")
    reject.add_argument("--reason", required=True, help="what the model reads")
    _sender_arg(reject)


def _time_travel_parsers(sub: Any) -> None:
    """Forks of past episodes, and re-runs of recorded ones against the current code."""
    fork = sub.add_parser(
        "fork",
        help="a new episode from another's state after iteration K (the first K are not paid again)",
    )
    fork.add_argument("episode_id", help="the source episode")
    fork.add_argument("--at", type=int, required=True, metavar="K", help="the last iteration it inherits")
    fork.add_argument("--model", help="the root model from K+1 on (default: the source's)")
    fork.add_argument("--base-url", help="the root model's endpoint (default: the source's)")
    fork.add_argument("--sub-model", help="the sub-model from K+1 on")
    fork.add_argument("--sub-base-url", help="the sub-model's endpoint")
    fork.add_argument("--policy", help="the termination policy from K+1 on")
    fork.add_argument("--policy-config", type=_json_object, help="its settings, a JSON object")
    fork.add_argument("--max-iterations", type=int, help="more than K")
    fork.add_argument("--max-duration", type=float, help="seconds, counting what the source spent up to K")
    fork.add_argument("--id", help="the fork's episode id (default: SOURCE-forkK-xxxx)")
    fork.add_argument("--no-wait", action="store_true", help="print the fork's id and return")
    fork.add_argument("--json", action="store_true", help="print the end as JSON")
    fork.add_argument("--accept-extracted", action="store_true", help="exit 0 for an extracted answer too")

    rerun = sub.add_parser(
        "rerun",
        help="re-run recorded episodes with the current code, every model call answered from the "
        "recording (nothing is paid): which would now end differently? Exit 1 if any",
    )
    rerun.add_argument("episode_ids", nargs="+", metavar="ID", help="recorded episodes that ended")
    rerun.add_argument("--policy", help="the termination policy to try (default: each source's own)")
    rerun.add_argument("--policy-config", type=_json_object, help="its settings, a JSON object")
    rerun.add_argument(
        "--policy-scans-output",
        action="store_true",
        default=None,
        help="hand the policy what cells printed (default: as each source did)",
    )
    rerun.add_argument("--json", action="store_true", help="one JSON report per line")


def _sender_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--as",
        dest="sender",
        metavar="NAME",
        help="who sends it, as history records it (default: the OS user)",
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
    from durable_rlm.api import DurableRLM

    limits = {
        "max_iterations": args.max_iterations,
        "max_llm_calls": args.max_llm_calls,
        "max_duration": timedelta(seconds=args.max_duration),
        "cell_timeout_s": args.cell_timeout,
        "output_truncation": args.output_truncation,
        "context_window_tokens": getattr(args, "context_window", None),
        "max_model_calls": getattr(args, "max_model_calls", None),
        "max_tokens": getattr(args, "max_tokens", None),
        "max_cost_usd": getattr(args, "max_cost_usd", None),
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
        approve=getattr(args, "approve", "none"),
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
    if end.status == "paused":
        return EXIT_PAUSED
    result = end.result
    if result is not None and result.ended_by == "cancelled":
        return EXIT_CANCELLED
    if result is None or result.status == "failed":
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
    from durable_rlm.audit.timeline import cost_text, describe_execution

    _stderr(
        f"ended by {result.ended_by} after {result.iterations} iteration(s), "
        f"{result.model_calls} model call(s), {result.usage.total_tokens} tokens, {cost_text(result.usage)}"
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


# The episode this process started or follows: what Ctrl-C names.
_FOLLOWING: list[str] = []


async def _run_episode(settings: Settings, args: argparse.Namespace, context: Any) -> int:
    from durable_rlm.client.episodes import follow

    rlm = _rlm(args, settings)
    services = await rlm.open(work=not args.no_wait)
    try:
        episode = await rlm.start(context, args.task, getattr(args, "id", None))
        handle = episode.handle
        if args.no_wait:
            print(handle.id)
            return EXIT_OK
        _FOLLOWING.append(handle.id)
        if not args.json:
            _stderr(f"episode {handle.id} started on task queue {services.settings.task_queue}")
            url = services.episode_url(handle.id, handle.first_execution_run_id)
            if url:
                _stderr(f"watch it in the Temporal UI: {url}")
        end = await follow(handle, None if args.json else _stderr)
        return _print_end(end, args.json, args.accept_extracted)
    finally:
        await rlm.close()


def _read_context(path: Path | None) -> Any:
    """The --context file's value, read before anything starts: its text, or for .json its
    JSON value. Every problem with the file is a one-line error."""
    if path is None:
        return None
    from durable_rlm.client.episodes import read_context_text

    text = read_context_text(path)
    if path.suffix.lower() != ".json":
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigurationError(f"context file {path} is not valid JSON: {exc}") from None


async def _demo(settings: Settings, args: argparse.Namespace) -> int:
    from durable_rlm import demo
    from durable_rlm.scripted import ScriptedModelServer

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


async def _scripted_server(args: argparse.Namespace) -> int:
    """The demo's scripted model as a server of its own, until Ctrl-C or SIGTERM: its base
    URL alone on stdout's first line (for scripts), how to use it on stderr."""
    import signal

    from durable_rlm import demo
    from durable_rlm.scripted import ScriptedModelServer

    if args.log is not None:
        args.log.write_text(demo.demo_log() + "\n", encoding="utf-8")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    with ScriptedModelServer(demo.demo_script(), port=args.port) as server:
        print(server.base_url, flush=True)
        context = str(args.log) if args.log is not None else "demo.log  (write it with --log demo.log)"
        _stderr(
            "a SCRIPTED model (it plays the demo's RLM transcript, and really counts the ERROR lines "
            "its sub-calls are given); any key is accepted. Try:\n"
            f'  drlm run "{demo.TASK}" --base-url {server.base_url} '
            f"--context {context}\n(Ctrl-C stops it)"
        )
        await stop.wait()
    return EXIT_OK


async def _show(settings: Settings, args: argparse.Namespace) -> int:
    from durable_rlm.audit import readonly
    from durable_rlm.audit.timeline import render

    engine = readonly.open_existing(settings)
    timeline = None
    if engine is not None and not args.refresh:
        timeline = readonly.cached_timeline(engine, args.episode_id)
    if timeline is None:
        timeline = await _timeline_from_history(settings, args.episode_id)
    if args.json:
        print(timeline.model_dump_json())
    else:
        print(render(timeline, width=10**9 if args.full else 2_000))
    return EXIT_OK


async def _timeline_from_history(settings: Settings, episode_id: str) -> Any:
    """Read the history (through the server), and keep the timeline if the episode ended."""
    from durable_rlm.audit import readonly
    from durable_rlm.audit.timeline import episode_timeline
    from durable_rlm.server.connection import connect
    from durable_rlm.telemetry.otel import forward_core_logs  # start-up: see _STORE_FIRST_COMMANDS

    forward_core_logs()  # before the first client: stdout is the command's own (--json)
    async with connect(settings) as services:
        timeline = await episode_timeline(services.client, episode_id)
        # Not kept when payloads are encrypted: a stored timeline is clear text at rest.
        if services.engine is not None and timeline.status in readonly.ENDED and not settings.encryption_keys:
            description = await services.client.get_workflow_handle(episode_id).describe()
            await asyncio.to_thread(readonly.store_timeline, services.engine, timeline, description.run_id)
    return timeline


async def _watch(settings: Settings, args: argparse.Namespace) -> int:
    """Follow without working on it: any number of watchers, from anywhere."""
    from temporalio.client import WorkflowExecutionStatus

    from durable_rlm.client.episodes import describe_episode, follow, workers_polling
    from durable_rlm.server.connection import connect
    from durable_rlm.workflows.models import EpisodeResult

    async with connect(settings) as services:
        handle = services.client.get_workflow_handle(args.episode_id, result_type=EpisodeResult)
        description = await describe_episode(handle)  # an unknown id is a usage error now, not a wait
        _FOLLOWING.append(args.episode_id)
        running = description.status == WorkflowExecutionStatus.RUNNING
        if running and not await workers_polling(services.client, description.task_queue):
            _stderr(
                f"no worker runs episode {args.episode_id} (none polls its task queue "
                f"{description.task_queue}): `drlm resume {args.episode_id}` works on it"
            )
        if args.json or args.plain or not sys.stderr.isatty():
            end = await follow(handle, None if args.json else _stderr)
        else:
            end = await _follow_live(handle)
    return _print_end(end, args.json, args.accept_extracted)


async def _follow_live(handle: Any) -> Any:
    """The rich live view on stderr until the episode ends; its last frame stays."""
    from rich.console import Console
    from rich.live import Live

    from durable_rlm.client.episodes import follow
    from durable_rlm.viewer.live import frame

    with Live(console=Console(stderr=True), refresh_per_second=4, transient=False) as live:
        return await follow(handle, on_state=lambda progress: live.update(frame(handle.id, progress)))


async def _ui(settings: Settings, args: argparse.Namespace) -> int:
    from durable_rlm.client.episodes import describe_episode
    from durable_rlm.server.connection import connect

    async with connect(settings) as services:
        if services.ui is None:
            raise ConfigurationError(
                "no Web UI here: DRLM_UI is off"
                if settings.embedded
                else "no Web UI address for this cluster: set DRLM_UI_ADDRESS (the compose stack's is "
                "http://localhost:8080)"
            )
        if args.episode_id:
            handle = services.client.get_workflow_handle(args.episode_id)
            url = services.episode_url(args.episode_id, (await describe_episode(handle)).run_id)
            if not args.temporal:
                url = _episode_page(settings, args.episode_id)
        else:
            url = f"{services.ui.rstrip('/')}/namespaces/{settings.temporal_namespace}/workflows"
        print(url, flush=True)
        if args.open:
            import webbrowser

            webbrowser.open(url)
        if args.keep and settings.embedded:
            _stderr("keeping the embedded server and its UI up; Ctrl-C to let it go")
            await asyncio.Event().wait()
    return EXIT_OK


def _episode_page(settings: Settings, episode_id: str) -> str:
    """The episode page the shared server's supervisor serves (durable_rlm/viewer/episode_page.py)."""
    from urllib.parse import quote

    from durable_rlm.server.embedded import running_state

    codec = (running_state(settings) or {}).get("codec") if settings.embedded else None
    if not codec:
        raise ConfigurationError(
            "no episode page here: the embedded server's supervisor serves it (use --temporal for "
            "the Temporal UI page)"
        )
    return f"{codec}/episodes/{quote(episode_id, safe='')}"


def _codec_server(settings: Settings, args: argparse.Namespace) -> int:
    """For a cluster's UI (or any other): decode with this machine's stores; a bearer token
    (DRLM_CODEC_TOKEN) is required when set."""
    from durable_rlm.server.connection import open_stores
    from durable_rlm.viewer.codec_server import CodecServer, ui_origins

    origins = args.origin or (
        [settings.ui_address] if settings.ui_address else list(ui_origins(settings.ui_port))
    )
    if args.host not in ("127.0.0.1", "localhost", "::1") and not settings.codec_token:
        raise ConfigurationError(
            f"the codec server would listen on {args.host} without a token: set DRLM_CODEC_TOKEN"
        )
    blobs, _ = open_stores(settings)
    server = CodecServer(
        blobs,
        host=args.host,
        port=args.port,
        origins=origins,
        token=settings.codec_token,
        threshold=settings.claim_check_threshold,
    )
    _stderr(f"codec server on {server.url} for {', '.join(origins)}; point the UI's codec endpoint at it")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return EXIT_OK


def _config(settings: Settings, args: argparse.Namespace) -> int:
    rows = settings.effective()
    if args.json:
        print(json.dumps({name: {"value": v, "variable": var, "chosen_by": o} for name, v, var, o in rows}))
        return EXIT_OK
    from rich.console import Console
    from rich.table import Table

    table = Table(title="drlm config")
    for column in ("setting", "variable", "value", "chosen by"):
        table.add_column(column, overflow="fold")
    for name, value, variable, origin in rows:
        table.add_row(name, variable, "-" if value is None else str(value), origin)
    Console().print(table)
    return EXIT_OK


def _info(settings: Settings, args: argparse.Namespace) -> int:
    from durable_rlm.server.embedded import running_state

    stores = settings.describe_stores()
    if settings.embedded:
        state = running_state(settings)
        server = (
            f"{state['address']} (shared by every client of the data directory)"
            if state
            else "not running (starts on first use)"
        )
        idle = f"stops {settings.server_idle_s:g} s after its last client (DRLM_SERVER_IDLE_S)"
        stores["server"] = (server, idle)
        if not settings.ui:
            stores["web UI"] = ("off", "DRLM_UI")
        else:
            where = (state or {}).get("ui") or f"port {settings.ui_port} (or a free one) once the server runs"
            stores["web UI"] = (where, settings.origin("ui_port"))
    elif settings.ui_address:
        stores["web UI"] = (settings.ui_address, "DRLM_UI_ADDRESS")
    stores["task queue"] = (settings.task_queue, settings.origin("task_queue"))
    if args.json:
        print(json.dumps({name: {"value": value, "chosen_by": why} for name, (value, why) in stores.items()}))
        return EXIT_OK
    from rich.console import Console
    from rich.table import Table

    table = Table(title="drlm info")
    for column in ("what", "where", "chosen by"):
        table.add_column(column, overflow="fold")
    for name, (value, why) in stores.items():
        table.add_row(name, value, why)
    Console().print(table)
    return EXIT_OK


async def _deployment(settings: Settings, args: argparse.Namespace) -> int:
    from durable_rlm.server.connection import connect
    from durable_rlm.server.deployment import describe_deployment, set_current, set_ramping

    name = args.name or settings.deployment_name
    if name is None:
        raise ConfigurationError("which deployment? give --name or set DRLM_DEPLOYMENT_NAME")
    if settings.embedded:
        raise ConfigurationError(
            "Worker Deployments are for a cluster: set TEMPORAL_ADDRESS (the embedded server's "
            "workers are unversioned)"
        )
    if args.action != "show" and not args.build_id:
        raise ConfigurationError(f"drlm deployment {args.action} needs a BUILD_ID")
    if args.action == "ramp" and args.percent is None:
        raise ConfigurationError("drlm deployment ramp needs a BUILD_ID and a PERCENT")
    async with connect(settings) as services:
        client = services.client
        if args.action == "set-current":
            previous = await set_current(client, name, args.build_id)
            print(f"deployment {name}: {args.build_id} is current (was {previous or 'none'})")
        elif args.action == "ramp":
            await set_ramping(client, name, args.build_id, args.percent)
            print(f"deployment {name}: {args.build_id} ramped to {args.percent:g}% of new episodes")
        print((await describe_deployment(client, name)).describe())
    return EXIT_OK


async def _reward(settings: Settings, args: argparse.Namespace) -> int:
    from temporalio.client import WorkflowUpdateFailedError

    from durable_rlm.client.episodes import send_reward
    from durable_rlm.server.connection import connect

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
    """Work on an episode (embedded) and follow it; an episode paused on a refused key runs
    its paused calls again, with this worker's key (`--api-key`, or the environment)."""
    from durable_rlm.client.episodes import describe_episode, follow, retry_credentials
    from durable_rlm.client.steering import resume_episode
    from durable_rlm.server.connection import connect
    from durable_rlm.worker.runtime import running_workers
    from durable_rlm.workflows.models import EpisodeResult

    if args.api_key and not settings.embedded:
        raise ConfigurationError(
            "--api-key only works with the embedded worker; with TEMPORAL_ADDRESS set, give the key "
            "to the workers (restart them), then run `drlm resume` again"
        )
    async with connect(settings) as services:
        handle = services.client.get_workflow_handle(args.episode_id, result_type=EpisodeResult)
        description = await describe_episode(handle)  # an unknown id is a usage error now, not a wait
        services = _polling(services, description.task_queue)  # a session's own queue, or the shared one
        credentials = {}
        if args.api_key:
            from durable_rlm.audit.projection import first_request

            request = await first_request(services.client, args.episode_id)
            credentials = {request.root_model.api_key_env: args.api_key}
        _FOLLOWING.append(args.episode_id)
        async with running_workers(services, credentials) if settings.embedded else contextlib.nullcontext():
            held = await resume_episode(services.client, args.episode_id, args.sender)
            if held.accepted and not args.json:
                _stderr(held.message)  # a person had paused it; otherwise nothing changed
            outcome = await retry_credentials(services.client, args.episode_id)
            if outcome.accepted and not args.json:
                _stderr(outcome.message)
            end = await follow(handle, None if args.json else _stderr)
            return _print_end(end, args.json, args.accept_extracted)


STEER_HEAD_START_S = 1.0  # how long an action waits for a worker already running the episode


def _polling(services: Services, task_queue: str) -> Services:
    """The same services, for a worker that polls `task_queue` (an episode's own queue)."""
    if task_queue == services.settings.task_queue:
        return services
    return dataclasses.replace(
        services, settings=services.settings.model_copy(update={"task_queue": task_queue})
    )


async def _attended(
    settings: Settings, services: Services, work: Awaitable[T], episode_id: str | None = None
) -> tuple[T, bool]:
    """Run an update or query that a worker must answer: (its value, whether a worker of
    another process answered). Embedded, when none answers within a head start, this
    process's worker does, on the episode's own task queue (and stops with the command:
    the episode then waits for one)."""
    from durable_rlm.client.episodes import episode_task_queue
    from durable_rlm.worker.runtime import running_workers

    task = asyncio.ensure_future(work)
    if not settings.embedded:
        return await task, True
    await asyncio.wait({task}, timeout=STEER_HEAD_START_S)
    if task.done():
        return task.result(), True
    if episode_id is not None:
        with contextlib.suppress(LookupError):
            services = _polling(services, await episode_task_queue(services.client, episode_id))
    try:
        async with running_workers(services):
            return await task, False
    finally:
        task.cancel()  # a no-op once done; a worker that failed to start leaves it pending


async def _steer(settings: Settings, args: argparse.Namespace) -> int:
    """hint, limits, pause, finish, approve, reject: one update each, with its sender."""
    from durable_rlm.client import steering
    from durable_rlm.server.connection import connect

    async with connect(settings) as services:
        client = services.client
        command = args.command
        if command == "hint":
            work = steering.send_hint(client, args.episode_id, args.text, args.sender)
        elif command == "limits":
            given = {
                name: getattr(args, name)
                for name in (
                    "max_iterations",
                    "max_llm_calls",
                    "max_duration",
                    "max_model_calls",
                    "max_tokens",
                    "max_cost_usd",
                )
            }
            if all(value is None for value in given.values()):
                raise ConfigurationError("drlm limits needs at least one limit, e.g. --max-iterations 40")
            work = steering.change_limits(client, args.episode_id, args.sender, **given)
        elif command == "pause":
            work = steering.pause_episode(client, args.episode_id, args.sender, args.hold_clock, args.reason)
        elif command == "finish":
            work = steering.finish_episode(client, args.episode_id, args.sender, args.reason)
        elif command == "approve":
            code = _read_edit(args.edit) if args.edit else None
            work = steering.decide_cell(client, args.approval_id, True, args.sender, code)
        else:
            work = steering.decide_cell(client, args.approval_id, False, args.sender, reason=args.reason)
        target = args.approval_id.rsplit("#", 1)[0] if command in ("approve", "reject") else args.episode_id
        outcome, attended = await _attended(settings, services, work, target)
    if not outcome.accepted:
        _stderr(f"drlm: {outcome.message}")
        return EXIT_USAGE
    _stderr(outcome.message)
    if not attended:
        _stderr(
            f"no other process works on episode {outcome.episode_id} now: `drlm resume "
            f"{outcome.episode_id}` runs it here (or start `python worker.py`)"
        )
    return EXIT_OK


def _read_edit(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigurationError(f"cannot read the edited cell {path}: {exc}") from exc


async def _pending(settings: Settings, args: argparse.Namespace) -> int:
    from durable_rlm.client.steering import pending_cells
    from durable_rlm.server.connection import connect

    async with connect(settings) as services:
        cells, _ = await _attended(settings, services, pending_cells(services.client))
    if args.json:
        for cell in cells:
            print(json.dumps({"id": cell.approval_id, **cell.model_dump(mode="json")}))
        return EXIT_OK
    if not cells:
        _stderr("no cell waits for approval")
        return EXIT_OK
    now = datetime.now(UTC)
    for cell in cells:
        waited = max((now - cell.since).total_seconds(), 0)
        where = f"iteration {cell.iteration}, --approve {cell.mode}"
        print(f"{cell.approval_id}  waiting {_duration(waited)} ({where})")
        for reason in cell.reasons or ["(every cell waits)"]:
            print(f"  risk: {reason}")
        for line in cell.code.splitlines() or [""]:
            print(f"  | {line}")
    _stderr(f"{len(cells)} cell(s): `drlm approve ID [--edit FILE]` or `drlm reject ID --reason TEXT`")
    return EXIT_OK


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7_200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3_600:.1f} h"


async def _cancel(settings: Settings, args: argparse.Namespace) -> int:
    from durable_rlm.client.episodes import cancel_episode
    from durable_rlm.worker.runtime import connect, running_workers

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
    from durable_rlm.client.episodes import follow
    from durable_rlm.workflows.models import EpisodeResult

    _stderr(outcome.message)
    if not outcome.accepted:
        return EXIT_OK
    handle = services.client.get_workflow_handle(args.episode_id, result_type=EpisodeResult)
    code = _print_end(await follow(handle, None), as_json=False)
    return EXIT_OK if code == EXIT_CANCELLED else code


async def _fork(settings: Settings, args: argparse.Namespace) -> int:
    from durable_rlm.client.episodes import follow
    from durable_rlm.timetravel.fork import fork_command
    from durable_rlm.worker.runtime import session

    async with session(settings, work=not args.no_wait) as services:
        handle = await fork_command(services, settings, args, None if args.json else _stderr)
        if args.no_wait:
            print(handle.id)
            return EXIT_OK
        _FOLLOWING.append(handle.id)
        end = await follow(handle, None if args.json else _stderr)
    return _print_end(end, args.json, args.accept_extracted)


async def _rerun(settings: Settings, args: argparse.Namespace) -> int:
    from durable_rlm.timetravel.rerun import PolicyChange, RerunReport, report_table, rerun_episodes
    from durable_rlm.worker.runtime import session

    change = PolicyChange(args.policy, args.policy_config, args.policy_scans_output)

    def show(report: RerunReport) -> None:
        if args.json:
            print(report.model_dump_json(), flush=True)
        else:
            _stderr(f"{report.source_id}: {report.detail}")

    async with session(settings, work=False) as services:  # the re-runs get a worker of their own
        reports = await rerun_episodes(services, args.episode_ids, change, show)
    if not args.json:
        report_table(reports)
    return EXIT_OK if all(r.verdict == "same" for r in reports) else EXIT_FAILED


async def _export(settings: Settings, args: argparse.Namespace) -> int:
    from durable_rlm.viewer.export import export_command

    return await export_command(settings, args.episode_id, args.format, args.output)


async def _list(settings: Settings, args: argparse.Namespace) -> int:
    """From the audit store alone (no server). Rows of episodes that ended without writing
    theirs (terminated, timed out) are settled by every worker each minute, by the shared
    server before it stops, and here with --refresh."""
    from durable_rlm.audit import readonly

    if args.refresh:
        from durable_rlm.audit.projection import reconcile_audit
        from durable_rlm.server.connection import connect
        from durable_rlm.telemetry.otel import forward_core_logs  # start-up: see _STORE_FIRST_COMMANDS

        forward_core_logs()  # before the first client: stdout is the command's own (--json)
        async with connect(settings) as services:
            assert services.engine is not None
            try:
                await reconcile_audit(services.client, services.engine)
            except Exception as exc:  # noqa: BLE001 - a store that cannot be written: list what it holds
                _stderr(f"drlm: rows not settled (the store refused the write): {type(exc).__name__}")
    engine = readonly.open_existing(settings)
    where = readonly.EpisodeFilter(
        status=args.status,
        model=args.model,
        since=args.since,
        until=args.until,
        min_cost=args.min_cost,
        max_cost=args.max_cost,
        roots_only=args.roots,
    )
    rows = [] if engine is None else readonly.episode_rows(engine, args.limit, where)
    if args.refresh and rows:
        rows = await _with_live_status(settings, rows)
    if args.json:
        for row in rows:
            print(json.dumps(dict(row._mapping), default=str))
        return EXIT_OK
    if not rows:
        _stderr("no episodes" + (" match these filters" if where.active else " in the audit store yet"))
        return EXIT_OK
    from durable_rlm.viewer.listing import episode_table, print_table

    print_table(episode_table(rows))
    return EXIT_OK


async def _with_live_status(settings: Settings, rows: list[Any]) -> list[Any]:
    """With --refresh, a running episode's status as it says it itself (the `DrlmStatus`
    search attribute: waiting for the store, paused, awaiting approval), which its audit row
    cannot say while the store it waits for is down."""
    from types import SimpleNamespace

    from durable_rlm.server.connection import connect
    from durable_rlm.workflows import metadata

    running = [row.episode_id for row in rows if row.status == "running"]
    if not running:
        return rows
    live: dict[str, str] = {}
    async with connect(settings) as services:
        quoted = ", ".join(json.dumps(episode_id) for episode_id in running[:200])
        with contextlib.suppress(Exception):  # a server without the attribute: rows as stored
            async for execution in services.client.list_workflows(f"WorkflowId IN ({quoted})"):
                status = execution.typed_search_attributes.get(metadata.STATUS)
                if status and status != "running":
                    live[execution.id] = status
    updated = []
    for row in rows:
        if row.episode_id not in live:
            updated.append(row)
            continue
        mapping = {**row._mapping, "status": live[row.episode_id]}
        shown = SimpleNamespace(**mapping)
        shown._mapping = mapping  # as a Row has: --json prints it
        updated.append(shown)
    return updated


# Commands that never reach Temporal: they need no Runtime of the SDK's.
_OFFLINE_COMMANDS = frozenset({"info", "config", "scripted-server"})
# Commands that read the audit store first: they set the Runtime up only on the path that
# reaches Temporal (start-up: temporalio costs 0.15 s of a 0.35 s target, issue 36).
_STORE_FIRST_COMMANDS = frozenset({"list", "show"})


async def _dispatch(args: argparse.Namespace) -> int:
    # The metrics endpoint is a worker's (python worker.py): CLI processes, many at once,
    # would contend for its port.
    settings = Settings.from_env().model_copy(update={"metrics_address": None})
    if args.command not in _OFFLINE_COMMANDS | _STORE_FIRST_COMMANDS:
        from durable_rlm.telemetry.otel import forward_core_logs  # the SDK's Runtime: not for --help

        forward_core_logs()  # stdout is the command's own (`--json`): the core's logs are records
    if args.command in ("run", "demo", "fork", "rerun"):
        from durable_rlm.tools import import_tool_modules
        from durable_rlm.worker.runtime import import_policy_modules

        # Custom policies and tools must be known here too: `run` validates the request
        # before starting anything.
        import_policy_modules(settings.policy_module_names)
        import_tool_modules(settings.tool_module_names)
    if args.command == "run":
        context = _read_context(args.context)
        rlm = _rlm(args, settings)  # validate before starting anything
        rlm.request(None, args.task)
        rlm.check_credentials()
        return await _run_episode(settings, args, context)
    if args.command == "demo":
        return await _demo(settings, args)
    if args.command == "scripted-server":
        return await _scripted_server(args)
    if args.command == "info":
        return _info(settings, args)
    if args.command == "config":
        return _config(settings, args)
    if args.command == "codec-server":
        return _codec_server(settings, args)
    if args.command == "doctor":
        from durable_rlm.cli.doctor import run_doctor

        return await run_doctor(settings)
    if args.command == "audit-rebuild":
        from durable_rlm.audit.projection import rebuild_audit
        from durable_rlm.audit.verify import verify
        from durable_rlm.server.connection import connect

        unreadable: list[str] = []
        async with connect(settings) as services:
            count = await rebuild_audit(services.client, services.engine, unreadable=unreadable)
            report = await verify(services.client, services.blobs, services.engine)
        print(f"audit store rebuilt from history: {count} episode(s)")
        # The rebuild reads only what its rows need: a missing blob is reported, not passed over.
        for episode_id in unreadable:
            _stderr(f"drlm: {episode_id}: its history could not be read whole; its rows are missing")
        if not report.ok:
            _stderr("drlm: blobs the histories reference are missing or corrupt (drlm verify --all):")
            for line in report.lines():
                _stderr(f"  {line}")
        return EXIT_OK if report.ok and not unreadable else EXIT_FAILED
    if args.command == "verify":
        from durable_rlm.audit.verify import verify_command

        if (args.episode_id is None) == (not args.all):
            raise ConfigurationError("give an episode id or --all")
        return await verify_command(settings, args.episode_id, args.json)
    commands = {
        "ui": _ui,
        "show": _show,
        "watch": _watch,
        "resume": _resume,
        "reward": _reward,
        "cancel": _cancel,
        "list": _list,
        "export": _export,
        "fork": _fork,
        "rerun": _rerun,
        "deployment": _deployment,
        "hint": _steer,
        "limits": _steer,
        "pause": _steer,
        "finish": _steer,
        "approve": _steer,
        "reject": _steer,
        "pending": _pending,
    }
    return await commands[args.command](settings, args)


def main(argv: list[str] | None = None) -> None:
    # The SDK logs every failed activity attempt with a traceback; the CLI reports retries
    # and failures itself. DRLM_LOG_LEVEL brings the logs back.
    logging.basicConfig(level=os.environ.get("DRLM_LOG_LEVEL", "ERROR"))
    logging.getLogger("temporalio").setLevel(os.environ.get("DRLM_LOG_LEVEL", "CRITICAL"))
    try:
        args = build_parser().parse_args(argv)
        if args.command == "worker":
            # start-up: the worker's imports (SDK, sandboxes) only for this command
            from durable_rlm.worker.main import main as worker_main

            worker_main(["--processes", args.processes], "drlm worker")  # leaves by os._exit
        code = asyncio.run(_dispatch(args))
    except KeyboardInterrupt:
        code = _interrupted()
    except BrokenPipeError:
        code = EXIT_OK  # `drlm list | head`: the reader has what it wanted
    except Exception as exc:  # noqa: BLE001 - every error ends as one line and an exit code
        code = _report(exc)
    _exit(code)


def _report(exc: Exception) -> int:
    """One line on stderr, and the exit code: 2 for what the user can fix in the command or
    the settings (nothing was started), 1 for a failure of the environment."""
    policy = sys.modules.get("durable_rlm.workflows.termination")
    rpc = sys.modules.get("temporalio.service")
    if isinstance(exc, ServerUnavailable):
        _stderr(f"drlm: {exc}")
        return EXIT_FAILED
    from durable_rlm.activities.store_errors import store_problem  # only on this error path

    problem = store_problem(exc)
    if problem is not None:  # one line, not a traceback: wait for the store, or free it
        _stderr(f"drlm: the store is unavailable: {problem}")
        return EXIT_FAILED
    if isinstance(exc, DurableRLMError | ValidationError) or (policy and isinstance(exc, policy.PolicyError)):
        _stderr(f"drlm: {_explain(exc)}")
        return EXIT_USAGE
    if isinstance(exc, LookupError):
        _stderr(f"drlm: {exc.args[0] if type(exc) is KeyError and exc.args else exc}")
        return EXIT_USAGE
    if rpc is not None and isinstance(exc, rpc.RPCError):
        _stderr(f"drlm: Temporal error: {exc}")
        return EXIT_FAILED
    raise exc


def _interrupted() -> int:
    if not _FOLLOWING:
        _stderr("drlm: interrupted")
        return EXIT_INTERRUPTED
    episode = _FOLLOWING[-1]
    _stderr(
        f"drlm: interrupted; episode {episode} goes on (its history keeps every step).\n"
        f"  follow it:   drlm watch {episode}\n"
        f"  work on it:  drlm resume {episode}   (until then only a worker on its task queue does)\n"
        f"  stop it:     drlm cancel {episode}"
    )
    return EXIT_INTERRUPTED


def _exit(code: int) -> None:
    """Flush and leave: temporalio can crash at interpreter exit after all work is done
    (sdk-python#300); a closed stdout (`| head`) is not an error. Telemetry first: os._exit
    skips its providers' exit hook, and a short `drlm run` exported 4 of its ~52 spans."""
    if (telemetry := sys.modules.get("durable_rlm.telemetry.otel")) is not None:  # set up only if used
        telemetry.shutdown_current()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):
            with contextlib.suppress(OSError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
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
