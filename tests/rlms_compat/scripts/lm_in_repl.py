# A REPL driven by the program itself, as rlms's lm_in_repl example drives it: a client, an
# LM handler, a LocalREPL with a context and setup code, and a cell that calls llm_query.
import os

from rlm.clients.openai import OpenAIClient
from rlm.core.lm_handler import LMHandler
from rlm.environments.local_repl import LocalREPL

setup_code = 'secret = "1424424"\n'
context_payload = "\nThis is a test context. It should print out, revealing the magic number to be 4.\n"
code = """
response = llm_query("What is 2 + 2? Reply with just the number.")
print(response)
print(type(response))
print(context)
print("Secret from setup code: ", secret)
"""

client = OpenAIClient(model_name="gpt-x", base_url=os.environ["OPENAI_BASE_URL"])
with LMHandler(client=client) as handler:
    host, port = handler.address
    print("handler on", host, port > 0)
    with LocalREPL(
        lm_handler_address=handler.address, context_payload=context_payload, setup_code=setup_code
    ) as repl:
        result = repl.execute_code(code)
        print(f"stdout: {result.stdout!r}")
        print(f"stderr: {result.stderr!r}")
        print(f"response variable: {repl.locals.get('response')!r}")
        print("locals:", {k: v for k, v in sorted(repl.locals.items()) if k != "f"})  # rlms's open file
        print("calls:", [(c.root_model, c.prompt, c.response) for c in result.rlm_calls])
        failed = repl.execute_code("1 / 0")
        print("error:", failed.stderr.strip().splitlines()[-1])
        print(
            "answered:",
            repl.execute_code("answer['content'] = response\nanswer['ready'] = True").final_answer,
        )
