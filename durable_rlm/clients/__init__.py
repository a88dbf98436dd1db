"""rlms's `rlm.clients`, for programs whose imports changed from `rlm` to `durable_rlm`."""

from durable_rlm.rlms.clients import BaseLM, get_client

__all__ = ["BaseLM", "get_client"]
