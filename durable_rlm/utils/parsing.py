"""rlms's `rlm.utils.parsing`, for programs whose imports changed from `rlm` to `durable_rlm`."""

from durable_rlm.rlms.parsing import (
    convert_context_for_repl,
    find_code_blocks,
    format_execution_result,
    format_iteration,
)

__all__ = ["convert_context_for_repl", "find_code_blocks", "format_execution_result", "format_iteration"]
