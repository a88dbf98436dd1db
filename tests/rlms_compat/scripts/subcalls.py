# Sub-calls as rlms's tests make them: many in one cell (no cap), a batch, one that fails
# (an "Error: ..." string, the cell goes on), and the usage summary counting them.
from rlm import RLM

rlm = RLM(backend="openai", backend_kwargs={"model_name": "gpt-x"}, max_iterations=4)
result = rlm.completion("alpha beta gamma", root_prompt="Many sub-calls")
print(result.response)
print({model: s.total_calls for model, s in result.usage_summary.model_usage_summaries.items()})
