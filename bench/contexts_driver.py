"""One side of bench/contexts.py, in a process of its own (so its peak memory is its own):
a warm-up episode over a small context, then the measured episode over the context file,
through the library's Python API. Runs in rlms's benchmark virtualenv (`--impl rlms`) or in
this project's (`--impl durable`, `durable_rlm.RLM`, the embedded default unless the
environment names other stores). Prints one JSON line per episode.

    python bench/contexts_driver.py --impl rlms|durable --base-url URL --context-file FILE
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT_PROMPT = "How many lines does the context have?"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=("rlms", "durable"), required=True)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--context-file", required=True)
    args = parser.parse_args()
    if args.impl == "rlms":
        from rlm import RLM
    else:
        from durable_rlm import RLM

    def episode(context: str) -> tuple[float, str]:
        rlm = RLM(
            backend="openai",
            backend_kwargs={"model_name": "scripted", "base_url": args.base_url, "api_key": "EMPTY"},
            max_depth=1,
            max_iterations=6,
        )
        started = time.perf_counter()
        result = rlm.completion(context, root_prompt=ROOT_PROMPT)
        wall = time.perf_counter() - started
        rlm.close()
        return wall, str(result.response)

    warm_wall, warm_answer = episode("one\ntwo\nthree\n")
    print(json.dumps({"warmup": True, "wall_s": warm_wall, "answer": warm_answer}), flush=True)
    print(json.dumps({"phase": "reading"}), flush=True)
    with open(args.context_file, encoding="utf-8") as handle:
        context = handle.read()
    print(json.dumps({"phase": "measured", "chars": len(context)}), flush=True)
    wall, answer = episode(context)
    print(json.dumps({"warmup": False, "wall_s": wall, "answer": answer}), flush=True)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # temporalio can crash at interpreter exit after the work (sdk-python#300)
