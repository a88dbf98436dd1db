"""DSPy programs on DSPy's RLM and on ours, one scripted model: the same Prediction, and the
model sent the same prompts but for the lines DSPy takes from its interpreter."""

from __future__ import annotations

from tests.dspy_compat.harness import Compared, interpreter_lines
from tests.dspy_compat.models import INCIDENT, OUT_OF_ITERATIONS, OVER_THE_CALL_LIMIT, SHOUT


def sent(run_requests: list) -> list[tuple[str, list[tuple[str, str]]]]:
    """Each request as (model, [(role, text)]), the system prompt's interpreter lines left out."""
    return [
        (
            request.model,
            [
                (m["role"], interpreter_lines(m["content"]) if m["role"] == "system" else m["content"])
                for m in request.messages
            ],
        )
        for request in run_requests
    ]


def assert_same_run(run: Compared) -> None:
    assert run.ours.printed == run.theirs.printed
    assert sent(run.ours.requests) == sent(run.theirs.requests)


def test_a_program_with_two_inputs_two_typed_outputs_a_tool_and_a_sub_lm(differential) -> None:
    run = differential("qa", INCIDENT)
    assert_same_run(run)
    fields = run.theirs.printed["fields"]
    assert run.theirs.printed["keys"] == ["service", "failures", "trajectory", "final_reasoning"]
    assert (fields["service"], fields["failures"]) == ("auth-service", 20)
    outputs = [step["output"] for step in fields["trajectory"]]
    assert outputs[1] == "20\nauth-service: 3 restarts\nauth-service times out"
    assert outputs[2] == "[Error] NameError: name 'undefined_total' is not defined"
    assert outputs[3] == "FINAL: {'service': 'auth-service', 'failures': 20}"
    assert [r.model for r in run.theirs.requests] == ["root-m", "root-m", "sub-m", "root-m", "root-m"]


def test_a_program_that_runs_out_of_iterations_is_answered_by_extraction(differential) -> None:
    run = differential("out_of_iterations", OUT_OF_ITERATIONS)
    assert_same_run(run)
    fields = run.theirs.printed["fields"]
    assert run.theirs.printed["keys"] == ["trajectory", "final_reasoning", "total", "reached"]
    assert (fields["total"], fields["reached"], fields["final_reasoning"]) == (
        108,
        True,
        "Extract forced final output",
    )
    assert len(fields["trajectory"]) == 2


def test_an_optimizer_compiles_a_program_that_contains_it_and_its_demos_reach_the_model(differential) -> None:
    run = differential("compiled", SHOUT)
    assert_same_run(run)  # the same demos bootstrapped, the same compiled prompts sent
    demos = run.theirs.printed["demos"]
    assert [len(demos["rlm.generate_action"]), len(demos["rlm.extract"])] == [2, 0]
    assert run.theirs.printed["fields"]["answer"] == "XYZ"
    after = [r for r in run.ours.requests if "xyz" in r.messages[-1]["content"]]
    first = after[0].messages  # the compiled program's first call: system, the demos, the question
    assert [m["role"] for m in first] == ["system", "user", "assistant", "user", "assistant", "user"]
    bootstrapped = [demo["reasoning"] for demo in demos["rlm.generate_action"]]
    shown = [m["content"] for m in first[2:5:2]]
    assert all(
        f"[[ ## reasoning ## ]]\n{text}\n" in reply for text, reply in zip(bootstrapped, shown, strict=True)
    )


def test_a_call_over_max_llm_calls_raises_in_the_code_and_the_run_goes_on(differential) -> None:
    run = differential("llm_limit", OVER_THE_CALL_LIMIT)
    theirs, ours = run.theirs.printed["fields"], run.ours.printed["fields"]
    assert run.ours.printed["keys"] == run.theirs.printed["keys"]
    assert (
        (ours["answer"], ours["final_reasoning"])
        == (theirs["answer"], theirs["final_reasoning"])
        == ("one", "One call it is.")
    )
    steps = [ours["trajectory"], theirs["trajectory"]]
    assert [len(s) for s in steps] == [2, 2]
    assert steps[0][1] == steps[1][1]  # the second step, the same
    # Each says the limit in its own words: DSPy "LLM call limit exceeded: 1 + 1 > 1", ours
    # "max_llm_calls (1) reached: the call was not made".
    assert all(s[0]["output"].startswith("[Error] RuntimeError: ") for s in steps)
    assert [r.model for r in run.ours.requests] == [r.model for r in run.theirs.requests]
