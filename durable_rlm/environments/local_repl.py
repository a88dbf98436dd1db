"""rlms's `rlm.environments.local_repl`, for programs whose imports changed from `rlm` to `durable_rlm`."""

from durable_rlm.rlms.local_repl import LocalREPL

__all__ = ["LocalREPL"]
