# A DSPy program whose RLM runs out of iterations: DSPy's `extract` answers the outputs. It
# calls the module where an event loop runs, as a notebook or an async app does.
import asyncio
import json
import os
import sys

import dspy
from dspy.primitives import LocalInterpreter

RLM = dspy.RLM

base = os.environ["DSPY_TEST_API_BASE"]
dspy.configure(lm=dspy.LM("openai/root-m", api_base=base, api_key="sk-scripted", cache=False))

rlm = RLM("numbers, target -> total: int, reached: bool", max_iters=2, interpreter_factory=LocalInterpreter)


async def main():
    return rlm(numbers=[4, 8, 15, 16, 23, 42], target=100)  # a blocking call inside the loop


prediction = asyncio.run(main())
print(json.dumps({"keys": list(prediction.keys()), "fields": dict(prediction.items())}))
sys.stdout.flush()
os._exit(0)  # temporalio's exit-time quirk (sdk-python#300)
