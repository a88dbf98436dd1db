"""`drlm fork`, `drlm rerun`: forks of past episodes, and re-runs of recorded ones against
the current code (durable_rlm/timetravel/)."""

from __future__ import annotations

import argparse

from durable_rlm.cli.arguments import json_object
from durable_rlm.cli.handlers import Subparsers, bind, import_extensions
from durable_rlm.cli.output import EXIT_FAILED, EXIT_OK, FOLLOWING, print_end, stderr
from durable_rlm.settings import Settings


def _fork_parser(sub: Subparsers) -> None:
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
    fork.add_argument("--policy-config", type=json_object, help="its settings, a JSON object")
    fork.add_argument("--max-iterations", type=int, help="more than K")
    fork.add_argument("--max-duration", type=float, help="seconds, counting what the source spent up to K")
    fork.add_argument("--id", help="the fork's episode id (default: SOURCE-forkK-xxxx)")
    fork.add_argument("--no-wait", action="store_true", help="print the fork's id and return")
    fork.add_argument("--json", action="store_true", help="print the end as JSON")
    fork.add_argument("--accept-extracted", action="store_true", help="exit 0 for an extracted answer too")
    bind(fork, _fork)


def _rerun_parser(sub: Subparsers) -> None:
    rerun = sub.add_parser(
        "rerun",
        help="re-run recorded episodes with the current code, every model call answered from the "
        "recording (nothing is paid): which would now end differently? Exit 1 if any",
    )
    rerun.add_argument("episode_ids", nargs="+", metavar="ID", help="recorded episodes that ended")
    rerun.add_argument("--policy", help="the termination policy to try (default: each source's own)")
    rerun.add_argument("--policy-config", type=json_object, help="its settings, a JSON object")
    rerun.add_argument(
        "--policy-scans-output",
        action="store_true",
        default=None,
        help="hand the policy what cells printed (default: as each source did)",
    )
    rerun.add_argument("--json", action="store_true", help="one JSON report per line")
    bind(rerun, _rerun)


PARSERS = {"fork": _fork_parser, "rerun": _rerun_parser}


async def _fork(settings: Settings, args: argparse.Namespace) -> int:
    from durable_rlm.client.episodes import follow  # start-up: temporalio, the stores (~0.6 s)
    from durable_rlm.timetravel.fork import fork_command  # start-up: the worker's imports (~0.6 s)
    from durable_rlm.worker.runtime import session  # start-up: the worker's imports (~0.7 s)

    import_extensions(settings)
    async with session(settings, work=not args.no_wait) as services:
        handle = await fork_command(services, settings, args, None if args.json else stderr)
        if args.no_wait:
            print(handle.id)
            return EXIT_OK
        FOLLOWING.append(handle.id)
        end = await follow(handle, None if args.json else stderr)
    return print_end(end, args.json, args.accept_extracted)


async def _rerun(settings: Settings, args: argparse.Namespace) -> int:
    from durable_rlm.timetravel.rerun import (  # start-up: the worker's imports (~0.7 s)
        PolicyChange,
        RerunReport,
        report_table,
        rerun_episodes,
    )
    from durable_rlm.worker.runtime import session  # start-up: the worker's imports (~0.7 s)

    import_extensions(settings)
    change = PolicyChange(args.policy, args.policy_config, args.policy_scans_output)

    def show(report: RerunReport) -> None:
        if args.json:
            print(report.model_dump_json(), flush=True)
        else:
            stderr(f"{report.source_id}: {report.detail}")

    async with session(settings, work=False) as services:  # the re-runs get a worker of their own
        reports = await rerun_episodes(services, args.episode_ids, change, show)
    if not args.json:
        report_table(reports)
    return EXIT_OK if all(r.verdict == "same" for r in reports) else EXIT_FAILED
