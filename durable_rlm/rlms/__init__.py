"""rlms's API on the durable runtime (`from durable_rlm import RLM`), one concern a module:
compat.py the `RLM` class; options.py rlms's backends and constructor arguments in
DurableRLM's terms; limits.py rlms's exceptions and max_errors; results.py its result and
usage-summary types; logger.py its `RLMLogger`; follow.py its callbacks while an episode runs.

Nothing is imported here: `durable_rlm`'s names load their module on first use."""
