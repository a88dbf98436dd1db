"""How long a person waits for `drlm show` and `drlm list`, against a server start.

    python bench/cli_latency.py [--repeats N]

One episode (the scripted demo) is run in a fresh data directory; then each command runs N
times as a subprocess, timed from exec to exit:

- baseline: `drlm show ID --refresh` with no server up: the history is read through a
  freshly started embedded server (what every `show` and `list` cost before the shared
  server and the stored timelines);
- `drlm show ID --refresh` while another client keeps the shared server up;
- `drlm show ID`: the stored timeline, no server;
- `drlm list`: the audit store, no server.

Prints the median, min and max of each and its ratio to the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

DRLM = str(Path(sys.executable).with_name("drlm"))


def env_for(data_dir: Path, idle_s: float) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "TEMPORAL_", "DRLM_"))}
    env.update(DRLM_DATA_DIR=str(data_dir), DRLM_SERVER_IDLE_S=str(idle_s))
    return env


def timed(args: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    out = subprocess.run([DRLM, *args], env=env, capture_output=True, text=True, timeout=300)
    elapsed = time.perf_counter() - started
    if out.returncode != 0:
        raise RuntimeError(f"drlm {' '.join(args)} failed: {out.stderr}")
    return elapsed


def server_down(data_dir: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while (data_dir / "server" / "state.json").exists():
        if time.monotonic() > deadline:
            raise RuntimeError("the shared server did not stop")
        time.sleep(0.1)
    time.sleep(0.5)  # its supervisor exits right after removing the state file


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    data_dir = Path(tempfile.mkdtemp(prefix="drlm-bench-cli-"))
    quick_stop = env_for(data_dir, 0)
    demo = subprocess.run(
        [DRLM, "demo", "--json"], env=quick_stop, capture_output=True, text=True, timeout=300
    )
    episode = json.loads(demo.stdout)["episode_id"]
    server_down(data_dir)  # the server stored the timeline before it stopped

    figures: dict[str, list[float]] = {"baseline": [], "shared": [], "show": [], "list": []}
    for _ in range(args.repeats):
        server_down(data_dir)
        figures["baseline"].append(timed(["show", episode, "--refresh"], quick_stop))
    server_down(data_dir)
    holder = subprocess.Popen(
        [DRLM, "watch", "no-such-episode-keeps-nothing"], env=env_for(data_dir, 60), stderr=subprocess.DEVNULL
    )
    holder.wait()  # an unknown id: it leaves at once, the server stays for its idle time
    for _ in range(args.repeats):
        figures["shared"].append(timed(["show", episode, "--refresh"], env_for(data_dir, 60)))
    for _ in range(args.repeats):
        figures["show"].append(timed(["show", episode], env_for(data_dir, 60)))
        figures["list"].append(timed(["list"], env_for(data_dir, 60)))

    labels = {
        "baseline": "show --refresh, server started for it (baseline)",
        "shared": "show --refresh, shared server already up",
        "show": "show, stored timeline, no server",
        "list": "list, audit store, no server",
    }
    base = statistics.median(figures["baseline"])
    table = Table(title=f"drlm command latency ({args.repeats} runs each)", title_justify="left")
    for column in ("command", "median", "min", "max", "x baseline"):
        table.add_column(column)
    for key, values in figures.items():
        median = statistics.median(values)
        table.add_row(
            labels[key],
            f"{median:.3f} s",
            f"{min(values):.3f} s",
            f"{max(values):.3f} s",
            f"{median / base:.2f}",
        )
    Console().print(table)
    sys.stdout.flush()
    os._exit(0)  # temporalio can crash at interpreter exit (sdk-python#300)


if __name__ == "__main__":
    main()
