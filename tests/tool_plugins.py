"""Custom tools for the tests (DRLM_TOOL_MODULES=tests.tool_plugins in worker processes).

Each call is appended to the file named by DRLM_TEST_TOOL_LOG when set, so a test can count
a tool's calls across worker processes."""

from __future__ import annotations

import asyncio
import json
import os

from durable_rlm.tools import tool

PRICES = {"widget": 12.5, "gadget": 40.0}
RATES = {"USD": 1.1, "GBP": 0.85}


def _log(*call: object) -> None:
    path = os.environ.get("DRLM_TEST_TOOL_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(call) + "\n")


@tool
def lookup_price(item: str) -> float:
    """The list price of an item, in EUR."""
    _log("lookup_price", item)
    return PRICES[item]


@tool(timeout_s=5)
async def convert(amount: float, currency: str = "USD") -> float:
    """Convert an amount in EUR to another currency."""
    await asyncio.sleep(0)
    _log("convert", amount, currency)
    return round(amount * RATES[currency], 2)


@tool(max_attempts=2)
def broken(x: int) -> int:
    """Always fails."""
    _log("broken", x)
    raise ValueError(f"no luck with {x}")


@tool(timeout_s=1, max_attempts=1)
async def hangs() -> None:
    """Never returns in time."""
    await asyncio.sleep(5)


@tool
def not_json() -> object:
    """Returns something that is not a JSON value."""
    return {1, 2}
