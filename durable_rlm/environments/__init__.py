"""rlms's `rlm.environments`, for programs whose imports changed from `rlm` to `durable_rlm`:
the local REPL, sandboxed (the other environments need Docker or a cloud service)."""

from typing import Any

from durable_rlm.environments.base_env import *  # noqa: F403 - rlms's names, one list (base_env)
from durable_rlm.environments.base_env import __all__ as _base_names
from durable_rlm.errors import ConfigurationError
from durable_rlm.rlms.local_repl import LocalREPL

__all__ = [*_base_names, "LocalREPL", "get_environment"]  # noqa: PLE0604 - names, as rlms exports


def get_environment(environment: str, environment_kwargs: dict[str, Any]) -> LocalREPL:
    """rlms's factory; "local" is the environment durable-rlm has."""
    if environment != "local":
        raise ConfigurationError(
            f"environment {environment!r} is not available: durable-rlm runs the REPL in its own "
            "sandboxed process (environment='local')"
        )
    return LocalREPL(**environment_kwargs)
