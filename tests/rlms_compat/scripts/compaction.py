# Compaction with a low threshold, as rlms's compaction examples run it: the numbers of the
# first steps are gone from the conversation when the last step needs them, and the model
# finds them in `history`.
from rlm import RLM
from rlm.logger import RLMLogger

logger = RLMLogger()
rlm = RLM(
    backend="openai",
    backend_kwargs={"model_name": "gpt-x"},
    environment="local",
    environment_kwargs={},
    max_depth=1,
    max_iterations=12,
    compaction=True,
    compaction_threshold_pct=0.05,
    logger=logger,
)
prompt = "Compaction steps: generate data_a and data_b, their means, then answer from `history`."
result = rlm.completion(prompt, root_prompt=prompt)
print("Response:", result.response)
print("Iterations logged:", len(result.metadata["iterations"]))
