"""The scripted model's replies for the differential scripts: each decides from what rlms
and durable-rlm both send (the root prompt a script passes, the number of replies so far),
never from either library's own prompt text."""

from __future__ import annotations

import re

from durable_rlm.scripted import ChatRequest, Reply

STEP = re.compile(r"Session step (\d+)")

DOCUMENTS = ["First document about cats", "Second document about dogs", "Third document"]
TURN_ANSWERS = ["First cats", "Second dogs (saw turn 0)", "Third document (saw turn 1)"]

PREVIOUS_STEP = (
    "next(m['content'] for m in history_{k} if 'Session step' in m['content']).split('Session step ')[1][0]"
)


def step_of(request: ChatRequest) -> int | None:
    for message in request.messages:
        found = STEP.search(str(message.get("content", "")))
        if found:
            return int(found.group(1))
    return None


def persistent_turns(request: ChatRequest) -> str | Reply:
    """A turn of a persistent session, rlms's way: it looks at its own context_k first, then
    sets `answer["ready"]` in its second reply, quoting the step the last turn's history
    asked for. A turn that took an earlier turn's answer ends after one root call, with it."""
    step = step_of(request)
    assert request.is_root and step is not None, request.messages
    if request.turn == 0:
        return f"```repl\nwords = context_{step}.split()\nprint(len(words), words[0])\n```"
    said = "words[0] + ' ' + words[-1]"
    if step > 0:
        said += " + ' (saw turn ' + " + PREVIOUS_STEP.format(k=step - 1) + " + ')'"
    return f"```repl\nanswer['content'] = {said}\nanswer['ready'] = True\n```"
