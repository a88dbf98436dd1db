"""A DSPy program's REPL in the sandbox, driven directly (no Temporal): its inputs are
variables of their own names, bound again before each cell as DSPy's interpreter binds them,
and SUBMIT is DSPy's (its fields by position or by name, exactly the signature's; it ends
the cell). A worker that lacks the sandbox rebuilds it with the same inputs."""

from __future__ import annotations

from pathlib import Path

from durable_rlm.activities.repl import ReplActivities
from durable_rlm.store.blobs import BlobStore
from durable_rlm.workflows.models import SandboxRef
from tests.conftest import Episode


class DspyEpisode(Episode):
    def __init__(self, host: ReplActivities, inputs: dict[str, object], outputs: list[str]) -> None:
        super().__init__(host, context=inputs)
        self.outputs = outputs

    def ref(self) -> SandboxRef:
        return super().ref().model_copy(update={"dspy_outputs": self.outputs})


async def test_inputs_are_variables_and_context_is_one_only_when_an_input_is_named_so(
    host: ReplActivities,
) -> None:
    episode = DspyEpisode(host, {"doc": "hello", "n": 3}, ["answer"])
    assert (await episode.run("print(doc * n)")).stdout == "hellohellohello\n"
    assert "NameError" in ((await episode.run("print(context)")).error or "")

    named = DspyEpisode(host, {"context": "the text", "query": "q"}, ["answer"])
    assert (await named.run("print(context, query)")).stdout == "the text q\n"


async def test_each_cell_starts_with_the_inputs_as_given(host: ReplActivities) -> None:
    episode = DspyEpisode(host, {"doc": "hello"}, ["answer"])
    await episode.run("doc = doc.upper()\nkept = doc")
    outcome = await episode.run("print(doc, kept)")
    assert outcome.stdout == "hello HELLO\n"  # the model's own variable stays; the input is put back


async def test_submit_takes_the_fields_by_position_or_by_name_and_ends_the_cell(host: ReplActivities) -> None:
    episode = DspyEpisode(host, {"q": "x"}, ["answer", "count"])
    by_position = await episode.run("SUBMIT('forty-two', 42)\nprint('after')")
    assert (by_position.submitted, by_position.error, by_position.stdout) == (
        {"answer": "forty-two", "count": 42},
        None,
        "",
    )
    by_name = await episode.run("SUBMIT(count=1, answer='one')")
    assert by_name.submitted == {"answer": "one", "count": 1}


async def test_submit_with_other_fields_raises_in_the_cell(host: ReplActivities) -> None:
    episode = DspyEpisode(host, {"q": "x"}, ["answer", "count"])
    for code, expected in [
        ("SUBMIT('only one')", "SUBMIT takes exactly these fields: answer, count"),
        ("SUBMIT(answer='a', count=1, extra=2)", "SUBMIT takes exactly these fields: answer, count"),
        ("SUBMIT('a', 1, 2)", "SUBMIT takes exactly these fields: answer, count"),
        ("SUBMIT('a', count=1)", "SUBMIT accepts positional or keyword values, not both"),
        ("SUBMIT(answer={1, 2}, count=1)", "SUBMIT values must be JSON-serialisable"),
    ]:
        outcome = await episode.run(code)
        assert outcome.submitted is None
        assert expected in (outcome.error or ""), code


async def test_a_worker_without_the_sandbox_rebuilds_it_with_the_same_inputs(
    blob_store: BlobStore, sandboxes: Path
) -> None:
    first = ReplActivities(blob_store, "queue-a", sandboxes / "a")
    second = ReplActivities(blob_store, "queue-b", sandboxes / "b")
    try:
        episode = DspyEpisode(first, {"doc": "hello", "numbers": [1, 2, 3]}, ["total"])
        await episode.run("total = sum(numbers)\ndoc = 'changed'")
        episode.host = second
        outcome = await episode.run("print(doc, total)\nSUBMIT(total)")
        assert outcome.rebuilt is True
        assert (outcome.stdout, outcome.submitted) == ("hello 6\n", {"total": 6})
        check = await episode.run("print(doc, total, numbers)")
        assert check.stdout == "hello 6 [1, 2, 3]\n"
    finally:
        await first.close_all()
        await second.close_all()
