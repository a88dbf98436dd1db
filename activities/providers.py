"""The model providers' client libraries, imported when a provider is first used.

Together they cost more than the rest of a process's start (measured on this machine:
`import anthropic` 2.0 s idle, 3.2 s under load; `import openai` 0.9-1.9 s; see
docs/architecture/decisions.md#start-up-pays-only-for-what-it-uses), and a process uses one
or none: a worker calls OpenAI-compatible models without a library at all
(activities/openai_chat.py), so `anthropic` is imported by a worker that serves Anthropic
models, and `openai` only by rlms's client classes (durable_rlm.clients). An exception can
only come from a library that was imported, so error checks look at the imported ones alone
(`error_types`).
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

PROVIDER_LIBRARIES = ("openai", "anthropic")


def client_library(name: str) -> ModuleType:
    """`openai` or `anthropic`, imported now if this process has not yet (see the module's
    docstring for the measured cost that makes this import lazy)."""
    if name not in PROVIDER_LIBRARIES:
        raise ValueError(f"not a provider library: {name!r}")
    return importlib.import_module(name)


def error_types(*attributes: str) -> tuple[type[BaseException], ...]:
    """The exception classes of these names (e.g. "APIStatusError") that the provider
    libraries already imported define: an exception of one not imported cannot have been
    raised."""
    found = (
        getattr(sys.modules[library], attribute, None)
        for library in PROVIDER_LIBRARIES
        if library in sys.modules
        for attribute in attributes
    )
    return tuple(kind for kind in found if isinstance(kind, type))
