"""`durable_rlm.dspy.RLM` before and after its episode: what a DSPy program gives it becomes
the episode's request (the LM's model string, endpoint and key, the limits, the tools, the
typed outputs, DSPy's prompts), and what cannot work is refused with a clear error before
anything starts. The episode itself runs in tests/dspy_compat."""

from __future__ import annotations

from pathlib import Path

import dspy
import pytest

from durable_rlm.dspy import RLM, lms
from durable_rlm.dspy.module import SUB_KEY_ENV
from durable_rlm.dspy.outputs import OutputParseError
from durable_rlm.dspy.prediction import NoPrediction, prediction_of, run_of
from durable_rlm.errors import ConfigurationError
from durable_rlm.settings import Settings
from durable_rlm.workflows.fallback import ExecutionResult, Extracted, Failed, FallbackReason, Submitted
from durable_rlm.workflows.models import EpisodeResult, Message, TokenUsage


@pytest.fixture
def embedded(tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path)


@pytest.fixture
def remote(tmp_path: Path) -> Settings:
    return Settings(temporal_address="127.0.0.1:7233", data_dir=tmp_path)


def count_words(text: str, minimum: int = 1) -> int:
    """How many words of at least `minimum` letters."""
    return sum(len(w) >= minimum for w in text.split())


def lm(model: str = "openai/gpt-x", **kwargs: object) -> dspy.LM:
    return dspy.LM(model, cache=False, **kwargs)


def test_the_lm_s_model_string_endpoint_key_and_sampling_reach_the_request(embedded: Settings) -> None:
    root = lm(
        "openai/gpt-x", api_base="http://127.0.0.1:9/v1", api_key="sk-root", temperature=0.3, max_tokens=900
    )
    sub = lm("openrouter/cheap-m", api_key="sk-sub")
    program = RLM(
        "doc, question -> answer, count: int", max_iters=7, max_llm_calls=9, sub_lm=sub, settings=embedded
    )
    with dspy.context(lm=root):
        plan = program._plan({"doc": "text", "question": "q"})
    request, credentials = plan.durable.template, plan.durable.credentials
    assert (request.root_model.model, request.root_model.provider, request.root_model.base_url) == (
        "gpt-x",
        "openai",
        "http://127.0.0.1:9/v1",
    )
    assert (request.root_model.temperature, request.root_model.max_tokens) == (0.3, 900)
    assert request.sub_model is not None
    assert (request.sub_model.model, request.sub_model.base_url) == (
        "cheap-m",
        "https://openrouter.ai/api/v1",
    )
    assert request.sub_model.api_key_env == "OPENROUTER_API_KEY" and request.sub_model.reports_cost
    assert credentials == {"OPENAI_API_KEY": "sk-root", "OPENROUTER_API_KEY": "sk-sub"}
    limits = request.limits
    assert (limits.max_iterations, limits.max_llm_calls, limits.output_truncation) == (7, 9, 10_000)
    assert [f.name for f in request.output_fields or []] == ["answer", "count"]
    assert request.dspy is not None and request.dspy.inputs == ["doc", "question"]
    assert request.dspy.action_user.holes == ["history", "iteration"]
    assert request.tools == []  # none given: none offered (not every registered tool)


def test_a_second_key_under_the_same_variable_gets_a_variable_of_its_own(embedded: Settings) -> None:
    program = RLM("q -> a", sub_lm=lm(api_key="sk-two"), settings=embedded)
    with dspy.context(lm=lm(api_key="sk-one")):
        plan = program._plan({"q": "x"})
    assert plan.durable.credentials == {"OPENAI_API_KEY": "sk-one", SUB_KEY_ENV: "sk-two"}
    assert plan.durable.template.sub_model is not None
    assert plan.durable.template.sub_model.api_key_env == SUB_KEY_ENV


def test_with_remote_workers_the_keys_stay_theirs(remote: Settings) -> None:
    program = RLM("q -> a", settings=remote)
    with dspy.context(lm=lm(api_key="sk-here")):
        plan = program._plan({"q": "x"})
    assert plan.durable.credentials == {}


def test_tools_are_offered_under_their_dspy_names_and_taken_by_name_only(embedded: Settings) -> None:
    program = RLM("q -> a", tools=[count_words, dspy.Tool(count_words, name="words")], settings=embedded)
    with dspy.context(lm=lm()):
        plan = program._plan({"q": "x"})
    specs = {t.name: t for t in plan.durable.template.tools}
    assert set(specs) == {"count_words", "words"}
    assert [p.kind for p in specs["words"].params] == ["keyword_only", "keyword_only"]
    copy = program.deepcopy()  # an optimizer's copy offers the same tools
    with dspy.context(lm=lm()):
        assert {t.name for t in copy._plan({"q": "x"}).durable.template.tools} == set(specs)


@pytest.mark.parametrize(
    ("model", "road"),
    [
        ("openai/gpt-x", ("gpt-x", "openai", None)),
        ("gpt-x", ("gpt-x", "openai", None)),
        ("anthropic/claude-x", ("anthropic:claude-x", "anthropic", None)),
        ("hosted_vllm/llama", ("llama", "openai", None)),
    ],
)
def test_litellm_prefixes_with_a_road_here(model: str, road: tuple[str, str, str | None]) -> None:
    endpoint = lms.endpoint_of(lm(model))
    assert (endpoint.model, endpoint.road.provider, endpoint.base_url) == road


def test_what_cannot_work_is_refused_before_anything_starts(embedded: Settings) -> None:
    program = RLM("doc -> answer", settings=embedded)
    with dspy.context(lm=lm("gemini/flash")), pytest.raises(ConfigurationError, match="provider 'gemini'"):
        program._plan({"doc": "x"})
    with dspy.context(lm=None), pytest.raises(ConfigurationError, match="No LM configured"):
        program._plan({"doc": "x"})
    with (
        dspy.context(lm=lm(), adapter=dspy.JSONAdapter()),
        pytest.raises(ConfigurationError, match="ChatAdapter"),
    ):
        program._plan({"doc": "x"})
    with dspy.context(lm=lm()), pytest.raises(ValueError, match="input 'doc' \\(set\\) is not a JSON value"):
        program._plan({"doc": {1, 2}})
    with dspy.context(lm=lm()), pytest.raises(ValueError, match="Unexpected inputs .*'question'"):
        program(question="x")  # DSPy's own check, as dspy.RLM makes it
    with dspy.context(lm=lm()), pytest.raises(ValueError, match="Missing required inputs: \\['doc'\\]"):
        program()


def test_another_interpreter_factory_is_not_used_and_says_so() -> None:
    with pytest.warns(UserWarning, match="interpreter_factory 'make' is not used"):

        def make() -> None: ...

        RLM("q -> a", interpreter_factory=make)


SIGNATURE = dspy.Signature("q -> answer, count: int")
REPLY = "[[ ## reasoning ## ]]\n{r}\n\n[[ ## code ## ]]\n```python\n{c}\n```\n\n[[ ## completed ## ]]"
CONVERSATION = [
    Message(role="system", content="system"),
    Message(role="user", content="first"),
    Message(role="assistant", content=REPLY.format(r="Look.", c="print(1)")),
    Message(role="user", content="1"),
    Message(role="assistant", content=REPLY.format(r="Done.", c="SUBMIT('x', '3')")),
]


def result_with(variant: object) -> EpisodeResult:
    return EpisodeResult(
        answer=None,
        ended_by="max_iterations",
        iterations=2,
        model_calls=2,
        sub_calls=0,
        usage=TokenUsage(),
        execution=ExecutionResult(variant=variant),
        stop_reason="max iterations reached; extraction failed",
    )


def test_submitted_values_are_parsed_as_dspy_parses_them() -> None:
    run = run_of(
        SIGNATURE,
        result_with(Submitted(outputs={"answer": "x", "count": "3"}, iterations=2, llm_calls=0)),
        CONVERSATION,
        1,
    )
    prediction = prediction_of(run)
    assert list(prediction.keys()) == ["answer", "count", "trajectory", "final_reasoning"]
    assert (prediction.count, prediction.final_reasoning) == (3, "Done.")
    assert prediction.trajectory[-1] == {
        "reasoning": "Done.",
        "code": "SUBMIT('x', '3')",
        "output": "FINAL: {'answer': 'x', 'count': 3}",
    }


def test_an_episode_without_outputs_or_with_outputs_dspy_cannot_parse_raises() -> None:
    with pytest.raises(NoPrediction, match="extraction failed"):
        run_of(SIGNATURE, result_with(Failed(reason="no [[ ## count ## ]]")), CONVERSATION, 1)
    reason = FallbackReason(kind="max_iterations", value=2, limit=2)
    extracted = Extracted(outputs={"answer": "x", "count": "many"}, confidence=0.5, reason=reason)
    with pytest.raises(OutputParseError, match="output field 'count'"):
        run_of(SIGNATURE, result_with(extracted), CONVERSATION, 1)
