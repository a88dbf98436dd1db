"""Runs inside the rlms benchmark virtualenv (not this project's): one RLM episode per run
against the scripted server, printing one JSON line per run. Standard library + rlms only.

    <rlms venv>/bin/python bench/rlms_driver.py --base-url URL --iterations N --runs R \
        --context-file FILE --root-prompt TEXT

The first `--warmup` runs (default 1) are warm-ups (imports, connections), reported with
"warmup": true. Each line also has "cpu_s": the CPU time (user + system, all threads, and any
child process it waited for) this process spent on that run, from building the `RLM` to
closing it.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", default="scripted")
    parser.add_argument("--iterations", type=int, required=True)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs first")
    parser.add_argument("--context-file", required=True)
    parser.add_argument("--root-prompt", required=True)
    args = parser.parse_args()

    from rlm import RLM

    context = open(args.context_file, encoding="utf-8").read()
    for run in range(args.warmup + args.runs):
        cpu_before = cpu_seconds()
        rlm = RLM(
            backend="openai",
            backend_kwargs={"model_name": args.model, "base_url": args.base_url, "api_key": "EMPTY"},
            max_depth=1,
            max_iterations=args.iterations + 2,
        )
        started = time.perf_counter()
        result = rlm.completion(context, root_prompt=args.root_prompt)
        wall = time.perf_counter() - started
        rlm.close()
        cpu = cpu_seconds() - cpu_before
        print(
            json.dumps(
                {"warmup": run < args.warmup, "wall_s": wall, "cpu_s": cpu, "answer": str(result.response)}
            ),
            flush=True,
        )


def cpu_seconds() -> float:
    """User + system time of this process (all its threads) and of its waited-for children."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


if __name__ == "__main__":
    main()
    sys.stdout.flush()
