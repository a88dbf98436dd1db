"""rlms's API on the durable runtime (`from durable_rlm import RLM`), one concern a module:
compat.py the `RLM` class; options.py rlms's backends and constructor arguments in
DurableRLM's terms; limits.py rlms's exceptions, raised from how an episode ended;
prompts.py a custom system prompt as rlms composes it; windows.py rlms's context windows;
results.py its result and usage-summary types; types.py its trajectory types; logger.py its
`RLMLogger`; follow.py its callbacks while an episode runs; clients.py its model clients;
lm_handler.py, local_repl.py and environments.py its LMHandler, LocalREPL and environment
interfaces; parsing.py its parsing helpers.

rlms's own module paths (`durable_rlm.logger`, `.clients`, `.core`, `.environments`,
`.utils`) re-export these. Nothing is imported here: `durable_rlm`'s names load their module
on first use."""
