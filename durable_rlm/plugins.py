"""The user's modules that settings name, imported before a request is checked: those that
register termination policies (DRLM_POLICY_MODULES) and tools (DRLM_TOOL_MODULES).

Apart from the worker's runtime so that the Python API checks a request without importing
the worker side (temporalio's worker, the stores: ~1 s of a one-off script's start-up, which
the first episode pays while the shared server starts beside it; durable_rlm/api.py)."""

from __future__ import annotations

import importlib

from durable_rlm.errors import ConfigurationError
from durable_rlm.tools import ToolRegistrationError


def import_policy_modules(modules: tuple[str, ...]) -> None:
    """Import the modules that register custom termination policies (deterministic code)."""
    _import_all(modules, "DRLM_POLICY_MODULES")


def import_tool_modules(modules: tuple[str, ...]) -> None:
    """Import the modules that register tools (durable_rlm/tools.py)."""
    _import_all(modules, "DRLM_TOOL_MODULES", refused=(ToolRegistrationError,))


def _import_all(modules: tuple[str, ...], setting: str, refused: tuple[type[Exception], ...] = ()) -> None:
    """Each module imported in turn; the first that cannot be (or that a registration in it
    refuses) is a ConfigurationError naming the setting and the module."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigurationError(f"{setting}: cannot import {module!r}: {exc}") from exc
        except refused as exc:
            raise ConfigurationError(f"{setting}: {module!r}: {exc}") from exc
