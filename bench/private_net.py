"""What the owner-only gate costs a client of the shared server (docs/security.md, "Other
users of the machine").

    python bench/private_net.py [--calls N] [--repeats R]

The shared server runs in a network namespace of its own behind durable_rlm/server/private_net.py,
which forwards each of the owner's connections byte for byte. This times the same gRPC
round trip (`GetSystemInfo`, the smallest call) against a dev server on the host's loopback
(`open`) and one behind the gate (`gated`), alternating, and prints median and p95 per call
and the server's start time.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from temporalio.api.workflowservice.v1 import GetSystemInfoRequest  # noqa: E402
from temporalio.client import Client  # noqa: E402

from durable_rlm.server.embedded import EmbeddedServer  # noqa: E402


async def round_trips(private: bool, calls: int) -> tuple[float, list[float]]:
    """(seconds to start the server, seconds per call)."""
    with tempfile.TemporaryDirectory(prefix="drlm-bench-gate-") as work:
        server = EmbeddedServer(Path(work) / "temporal.sqlite", private=private)
        started = time.perf_counter()
        async with server as address:
            start_s = time.perf_counter() - started
            if private and not server.private:
                raise SystemExit("no private network namespace on this machine: nothing to compare")
            client = await Client.connect(address)
            request = GetSystemInfoRequest()
            for _ in range(50):  # warm the connection
                await client.workflow_service.get_system_info(request)
            times = []
            for _ in range(calls):
                began = time.perf_counter()
                await client.workflow_service.get_system_info(request)
                times.append(time.perf_counter() - began)
            return start_s, times


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    results: dict[str, tuple[list[float], list[float]]] = {"open": ([], []), "gated": ([], [])}
    for _ in range(args.repeats):
        for name, private in (("open", False), ("gated", True)):
            start_s, times = await round_trips(private, args.calls)
            results[name][0].append(start_s)
            results[name][1].extend(times)
    print(f"GetSystemInfo round trips, {args.calls} x {args.repeats} per server")
    print("| server | median ms | p95 ms | start s |")
    print("| --- | --- | --- | --- |")
    for name, (starts, times) in results.items():
        median_ms, p95_ms = statistics.median(times) * 1e3, statistics.quantiles(times, n=20)[-1] * 1e3
        print(f"| {name} | {median_ms:.3f} | {p95_ms:.3f} | {statistics.median(starts):.2f} |")


if __name__ == "__main__":
    asyncio.run(main())
