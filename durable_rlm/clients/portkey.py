"""rlms's `rlm.clients.portkey`, for programs whose imports changed from `rlm` to `durable_rlm`."""

from durable_rlm.rlms.clients import PortkeyClient

__all__ = ["PortkeyClient"]
