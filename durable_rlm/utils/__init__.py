"""rlms's `rlm.utils`, for programs whose imports changed from `rlm` to `durable_rlm`."""
