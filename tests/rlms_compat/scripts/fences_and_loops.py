# What notebooks and chatty models do: an inline fence ("Here: ```repl"), and completion()
# called where an event loop already runs.
import asyncio

from rlm import RLM


def ask(root_prompt):
    rlm = RLM(backend="openai", backend_kwargs={"model_name": "gpt-x"}, max_iterations=4)
    return rlm.completion("one two three", root_prompt=root_prompt).response


print(ask("Inline fence"))


async def main():
    await asyncio.sleep(0)
    print("in a running loop:", ask("Inline fence"))


asyncio.run(main())
