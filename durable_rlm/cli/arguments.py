"""Argument types and flags that several commands share.

Parsing runs for `drlm --help` and every usage error too: what it imports is what they
cost, so a type that needs a heavy module imports it when a value is given.
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import datetime
from typing import Any

from durable_rlm.settings import ConfigurationError


def json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def moment(text: str) -> datetime:
    from durable_rlm.audit.readonly import parse_moment  # start-up: the store reader, only with a date

    try:
        return parse_moment(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def env_number(name: str, default: float) -> float:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        return float(value)
    except ValueError as exc:
        raise ConfigurationError(f"{name} must be a number, got {value!r}") from exc


def add_sender(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--as",
        dest="sender",
        metavar="NAME",
        help="who sends it, as history records it (default: the OS user)",
    )
