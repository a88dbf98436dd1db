"""Compaction, rlms's and ours, on one script: rlms's context-window table and threshold,
and the `history` list the model reads the summarised steps from."""

from __future__ import annotations

from tests.rlms_compat.models import CompactingModel


def test_compaction_keeps_the_summarised_steps_in_history(differential) -> None:
    model = CompactingModel()
    run = differential("compaction", model)
    assert run.ours.printed == run.theirs.printed
    assert run.theirs.printed == [
        "Response: 905.6 summarised=True found_data_a=True",
        "Iterations logged: 5",
    ]
