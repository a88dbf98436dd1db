# A DSPy program that contains an RLM, compiled by DSPy's BootstrapFewShot over a few
# examples with a metric; then the compiled program answers a new question. Prints the demos
# each predictor was given and the compiled program's Prediction.
import json
import os
import sys

import dspy
from dspy.primitives import LocalInterpreter
from dspy.teleprompt import BootstrapFewShot

RLM = dspy.RLM

base = os.environ["DSPY_TEST_API_BASE"]
dspy.configure(lm=dspy.LM("openai/root-m", api_base=base, api_key="sk-scripted", cache=False))


class Shout(dspy.Module):
    def __init__(self):
        super().__init__()
        self.rlm = RLM("question -> answer", max_iters=3, interpreter_factory=LocalInterpreter)

    def forward(self, question):
        return self.rlm(question=question)


trainset = [dspy.Example(question=q, answer=q.upper()).with_inputs("question") for q in ["abc", "def", "ghi"]]
optimizer = BootstrapFewShot(
    metric=lambda example, prediction, trace=None: example.answer == prediction.answer,
    max_bootstrapped_demos=2,
    max_labeled_demos=0,
)
compiled = optimizer.compile(Shout(), trainset=trainset)
demos = {
    name: [{k: str(v) for k, v in demo.items()} for demo in p.demos]
    for name, p in compiled.named_predictors()
}
print("compiled", flush=True)
prediction = compiled(question="xyz")
print(json.dumps({"demos": demos, "fields": dict(prediction.items())}))
sys.stdout.flush()
os._exit(0)  # temporalio's exit-time quirk (sdk-python#300)
