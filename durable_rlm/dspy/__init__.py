"""DSPy's RLM on the durable runtime: `dspy.RLM(...)` becomes `durable_rlm.dspy.RLM(...)`.

The optional extra `durable-rlm[dspy]` installs DSPy; nothing outside this package imports it.
One concern a module: module.py the `RLM` class; prompts.py DSPy's prompts, rendered by its
adapter; lms.py a dspy.LM as our model settings; outputs.py the signature's typed outputs;
prediction.py the Prediction and the traces optimizers read."""

from durable_rlm.dspy.module import RLM

__all__ = ["RLM"]
