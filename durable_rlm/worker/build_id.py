"""The build id a worker reports to the server when no Worker Deployment names one.

The server stamps it on every workflow task a worker completes, so a history says which
code decided each step. Left unset, the SDK derives one by reading and hashing the
bytecode of every module the process has imported (`load_default_build_id`): about 0.4 s
of a one-off script's start measured on this machine (py-spy, BENCHMARKS.md start-up),
spent before the worker polls, for a hash that also moves with modules no workflow runs
(openai, SQLAlchemy, the caller's own). What decides an episode's steps is the workflow
code: ours (the `workflows` package), the termination-policy modules a worker loads into
its workflows, and the SDK that runs them. The id hashes exactly those sources, so it
changes when, and only when, one of them does.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import sys
from pathlib import Path

import temporalio

from durable_rlm import workflows


def code_build_id(policy_modules: tuple[str, ...] = ()) -> str:
    """`durable-rlm-<version>-<hash>`: the hash of the workflow package's sources, the
    policy modules' (already imported by the worker) and temporalio's version."""
    return _build_id(tuple(sorted(set(policy_modules))))


@functools.cache
def _build_id(policy_modules: tuple[str, ...]) -> str:
    digest = hashlib.sha256(f"temporalio {temporalio.__version__}".encode())
    root = Path(workflows.__file__).resolve().parent
    sources = [(path.relative_to(root).as_posix(), path) for path in sorted(root.rglob("*.py"))]
    for name in policy_modules:
        module = sys.modules.get(name)
        file = getattr(module, "__file__", None)
        if file is not None:
            sources.append((name, Path(file)))
    for label, path in sources:
        digest.update(label.encode())
        digest.update(path.read_bytes())
    return f"durable-rlm-{_version()}-{digest.hexdigest()[:16]}"


def _version() -> str:
    try:
        return importlib.metadata.version("durable-rlm")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "dev"
