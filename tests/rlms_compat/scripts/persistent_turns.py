# A multi-turn conversation over one REPL, as rlms's persistent mode has it: three
# documents, one completion each, then the same in a `with` block.
from rlm import RLM

DOCUMENTS = ["First document about cats", "Second document about dogs", "Third document"]

rlm = RLM(backend="openai", backend_kwargs={"model_name": "gpt-x"}, max_iterations=4, persistent=True)
for k, document in enumerate(DOCUMENTS):
    print(rlm.completion(document, root_prompt=f"Session step {k}").response)
rlm.close()

with RLM(backend="openai", backend_kwargs={"model_name": "gpt-x"}, max_iterations=4, persistent=True) as chat:
    for k, document in enumerate(DOCUMENTS):
        print("with:", chat.completion(document, root_prompt=f"Session step {k}").response)
