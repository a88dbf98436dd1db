# rlms's limits, as its tests check them: each raises its own exception type with rlms's
# attributes, after the iteration that passed the limit.
from rlm import RLM
from rlm.utils.exceptions import BudgetExceededError, ErrorThresholdExceededError, TokenLimitExceededError


def run(root_prompt, **limits):
    rlm = RLM(backend="openai", backend_kwargs={"model_name": "gpt-x"}, max_iterations=12, **limits)
    try:
        result = rlm.completion("some context", root_prompt=root_prompt)
        print(root_prompt, "answered:", result.response)
    except ErrorThresholdExceededError as e:
        print(root_prompt, type(e).__name__, e.error_count, e.threshold, str(e))
        print("  last error names it:", "ZeroDivisionError" in (e.last_error or ""))
        print("  partial answer:", repr(e.partial_answer))
    except BudgetExceededError as e:
        print(root_prompt, type(e).__name__, f"{e.spent:.2f}", e.budget, str(e))
    except TokenLimitExceededError as e:
        print(root_prompt, type(e).__name__, e.tokens_used > e.token_limit, e.token_limit)
        print("  says:", str(e).split(":")[0].rsplit(" ", 1)[0])
        print("  partial answer:", repr(e.partial_answer))


run("Limit errors", max_errors=2)
run("Limit budget", max_budget=0.05)
run("Limit tokens", max_tokens=12_000)
run("Limit none", max_errors=3, max_budget=10.0, max_tokens=10**9)
