"""rlms's `rlm.core`, for programs whose imports changed from `rlm` to `durable_rlm`."""
