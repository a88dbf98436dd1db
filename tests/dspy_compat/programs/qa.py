# A DSPy program with an RLM: two inputs, two typed outputs, a tool and a sub-LM, as DSPy's
# RLM examples and tests use them. It reads the model's address from the environment and
# prints the Prediction's fields as JSON.
import json
import os
import sys

import dspy
from dspy.primitives import LocalInterpreter

RLM = dspy.RLM


def lookup(key: str) -> str:
    """Look a key up in the service table."""
    return {"auth": "auth-service: 3 restarts", "db": "db-primary: healthy"}.get(key, "unknown")


class IncidentReport(dspy.Signature):
    """Find the service that failed most in the log."""

    log: str = dspy.InputField(desc="the incident log")
    question: str = dspy.InputField()
    service: str = dspy.OutputField(desc="the service's name")
    failures: int = dspy.OutputField(desc="how many times it failed")


base, key = os.environ["DSPY_TEST_API_BASE"], "sk-scripted"
dspy.configure(lm=dspy.LM("openai/root-m", api_base=base, api_key=key, cache=False))
sub = dspy.LM("openai/sub-m", api_base=base, api_key=key, cache=False)

rlm = RLM(IncidentReport, max_iters=5, tools=[lookup], sub_lm=sub, interpreter_factory=LocalInterpreter)
log = "\n".join(
    f"12:{m:02d} auth-service ERROR timeout" if m % 3 else f"12:{m:02d} db-primary ok" for m in range(30)
)
prediction = rlm(log=log, question="Which service failed most?")
print(json.dumps({"keys": list(prediction.keys()), "fields": dict(prediction.items())}))
sys.stdout.flush()
os._exit(0)  # temporalio's exit-time quirk (sdk-python#300)
