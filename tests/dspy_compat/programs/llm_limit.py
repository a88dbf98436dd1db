# A DSPy program whose RLM asks its sub-LM once more than max_llm_calls allows.
import json
import os
import sys

import dspy
from dspy.primitives import LocalInterpreter

RLM = dspy.RLM

base = os.environ["DSPY_TEST_API_BASE"]
dspy.configure(lm=dspy.LM("openai/root-m", api_base=base, api_key="sk-scripted", cache=False))

rlm = RLM("question -> answer", max_iters=3, max_llm_calls=1, interpreter_factory=LocalInterpreter)
prediction = rlm(question="How many calls?")
print(json.dumps({"keys": list(prediction.keys()), "fields": dict(prediction.items())}))
sys.stdout.flush()
os._exit(0)  # temporalio's exit-time quirk (sdk-python#300)
