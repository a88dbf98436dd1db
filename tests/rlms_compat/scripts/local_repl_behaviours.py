# LocalREPL as rlms's own tests use it: versioned contexts and histories with their aliases,
# the REPL's names put back after a cell rebinds them, custom tools and data, answer.
from rlm.environments import SupportsPersistence
from rlm.environments.local_repl import LocalREPL


def double(x):
    return 2 * x


with LocalREPL(
    context_payload="first", custom_tools={"double": double, "RATE": {"tool": 0.5, "description": "a rate"}}
) as repl:
    print("persistent:", isinstance(repl, SupportsPersistence))
    repl.add_context({"second": [1, 2]})
    repl.add_history([{"role": "user", "content": "hi"}])
    repl.add_history([{"role": "user", "content": "again"}])
    print("counts:", repl.get_context_count(), repl.get_history_count())
    out = repl.execute_code(
        "print(context, context_1['second'], history[0]['content'], history_1[0]['content'])"
    )
    print("bound:", out.stdout.strip())
    repl.execute_code("context = 'hijacked'\nhistory = None\nllm_query = None")
    print(
        "put back:",
        repl.execute_code("print(context, history is history_0, callable(llm_query))").stdout.strip(),
    )
    print("tools:", repl.execute_code("print(double(21), RATE)").stdout.strip())
    print(
        "locals:",
        sorted(k for k in repl.locals if k in ("context", "context_0", "context_1", "history", "answer")),
    )
    set_ready = repl.execute_code("answer['content'] = double(2)\nanswer['ready'] = True")
    print("answer:", set_ready.final_answer, repl.execute_code("print(answer['ready'])").final_answer)
    failed = repl.execute_code("undefined_name")
    print("error:", failed.stderr.strip().splitlines()[-1])
