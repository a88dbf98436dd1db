"""Custom termination policies a worker loads through DRLM_POLICY_MODULES (tests only)."""

from __future__ import annotations

from durable_rlm.workflows.termination import ActionResult, PolicyContext, PolicyRegistry, TerminationPolicy


@PolicyRegistry.register_termination("plugin_stops_at_step_one")
class StopsAtStepOne(TerminationPolicy):
    name = "plugin_stops_at_step_one"

    def should_terminate(self, result: ActionResult, context: PolicyContext) -> tuple[bool, str | None]:
        return context.step >= 1, "plugin says enough" if context.step >= 1 else None


@PolicyRegistry.register_termination("plugin_raises")
class Raises(TerminationPolicy):
    name = "plugin_raises"

    def should_terminate(self, result: ActionResult, context: PolicyContext) -> tuple[bool, str | None]:
        raise RuntimeError("the plugin has a bug")
