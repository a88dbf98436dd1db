# A depth-2 run and its metadata tree, as rlms's depth_metadata_example and
# rlm_query_batched_example print it: the usage summary (the run's own calls), and each
# sub-call's model, response and nested trajectory; and the sub-call callbacks.
from rlm import RLM
from rlm.logger import RLMLogger


def tree(result):
    print("root:", result.root_model, "response:", result.response)
    for model, summary in result.usage_summary.model_usage_summaries.items():
        print("  usage:", model, "calls", summary.total_calls)
    for i, iteration in enumerate(result.metadata.get("iterations", [])):
        for block in iteration.get("code_blocks", []):
            for j, call in enumerate(block.get("result", {}).get("rlm_calls", [])):
                nested = call.get("metadata")
                depth = f"{len(nested.get('iterations', []))} iteration(s)" if nested else "none"
                said = f"{call.get('root_model')} {call.get('response')!r}"
                print(f"  iter {i + 1} sub-call {j + 1}: {said} nested={depth}")


def run(root_prompt):
    started, ended = [], []
    rlm = RLM(
        backend="openai",
        backend_kwargs={"model_name": "gpt-x"},
        environment="local",
        max_depth=2,
        max_iterations=3,
        logger=RLMLogger(),
        on_subcall_start=lambda depth, model, preview: started.append((depth, model, preview)),
        on_subcall_complete=lambda depth, model, took, error: ended.append((depth, model, error)),
    )
    tree(rlm.completion(root_prompt))
    print("  sub-calls started:", sorted(started))
    print("  sub-calls ended:", sorted(ended))


run("Depth one call")
run("Depth batched calls")
