"""What a DSPy program's RLM sends its model, rendered by DSPy's own chat adapter in the
program's process: the `generate_action` and `extract` predictors' signatures (their
instructions as an optimizer left them) and demos, and the user message around the REPL
history and the iteration, cut where those go (`PromptTemplate`). The episode fills the
cuts each iteration (workflows/dspy_program.py), so the model sees what DSPy's RLM would
send it.

The one part that is ours: the interpreter's own lines. DSPy asks its interpreter what to
say about where code runs (`execution_instructions`) and drops its sub-agent lines for an
interpreter that cannot host `import dspy`; ours is the episode's sandbox.
"""

from __future__ import annotations

import uuid
from typing import Any

from dspy.adapters.chat_adapter import ChatAdapter
from dspy.adapters.json_adapter import JSONAdapter
from dspy.adapters.xml_adapter import XMLAdapter
from dspy.dsp.utils.settings import settings as dspy_settings

from durable_rlm.errors import ConfigurationError
from durable_rlm.workflows.models import DspyPrompts, Message, PromptTemplate

EXECUTION_INSTRUCTIONS = (
    "Code runs as Python in a sandboxed process of a durable episode: after a crash the REPL is "
    "rebuilt as it was. State, imports, functions, and variables persist for this session. Tools "
    "and SUBMIT are available as global functions; call tools with keyword arguments."
)


class Sandbox:
    """What DSPy's RLM takes as its interpreter factory: the REPL here is the episode's
    sandbox, run by the workers, so this one only says where code runs (DSPy reads its
    `execution_instructions` into the prompt) and is never called."""

    execution_instructions = EXECUTION_INSTRUCTIONS

    def __init__(self) -> None:
        raise ConfigurationError("durable_rlm.dspy.RLM runs its REPL in the episode's sandbox, not here")


def _stand_ins() -> dict[str, str]:
    """Stand-ins for the values the episode fills in, new for each rendering: no adapter
    changes them, and no text of the program's can hold one by chance."""
    token = uuid.uuid4().hex
    return {"history": f"\x00history-{token}\x00", "iteration": f"\x00iteration-{token}\x00"}


def chat_adapter() -> ChatAdapter:
    """The adapter DSPy would format with: the configured one, which must read and write
    ChatAdapter's `[[ ## field ## ]]` sections (the episode parses replies that way)."""
    adapter = dspy_settings.adapter
    if adapter is None:
        return ChatAdapter()
    if not isinstance(adapter, ChatAdapter) or isinstance(adapter, (JSONAdapter, XMLAdapter)):
        raise ConfigurationError(
            f"dspy is configured with {type(adapter).__name__}: durable_rlm.dspy.RLM speaks "
            "ChatAdapter's format (the default); configure dspy.ChatAdapter() or none"
        )
    return adapter


def rendered(
    adapter: ChatAdapter, signature: Any, demos: list[Any], inputs: dict[str, Any], holes: dict[str, str]
) -> tuple[list[Message], PromptTemplate]:
    """The messages before the last (system, demos) and the last one, a template: `inputs`
    hold the stand-ins of `holes` where the episode fills values in."""
    messages = adapter.format(signature, demos, inputs)
    *before, last = messages
    if last.get("role") != "user" or not all(isinstance(m.get("content"), str) for m in messages):
        raise ConfigurationError("durable_rlm.dspy.RLM sends text messages: this adapter formats others")
    text: str = last["content"]
    parts: list[str] = []
    names: list[Any] = []
    while True:
        found = [(text.find(stand_in), name) for name, stand_in in holes.items() if stand_in in text]
        if not found:
            break
        at, name = min(found)
        parts.append(text[:at])
        names.append(name)
        text = text[at + len(holes[name]) :]
    parts.append(text)
    prefix = [Message(role=m["role"], content=m["content"]) for m in before]
    return prefix, PromptTemplate(parts=parts, holes=names)


def dspy_prompts(
    action_signature: Any,
    action_demos: list[Any],
    extract_signature: Any,
    extract_demos: list[Any],
    variables_info: list[str],
    max_output_chars: int,
    inputs: list[str],
) -> DspyPrompts:
    adapter, holes = chat_adapter(), _stand_ins()
    action, action_user = rendered(
        adapter,
        action_signature,
        action_demos,
        {"variables_info": variables_info, "repl_history": holes["history"], "iteration": holes["iteration"]},
        holes,
    )
    extract, extract_user = rendered(
        adapter,
        extract_signature,
        extract_demos,
        {"variables_info": variables_info, "repl_history": holes["history"]},
        holes,
    )
    return DspyPrompts(
        action=action,
        action_user=action_user,
        extract=extract,
        extract_user=extract_user,
        max_output_chars=max_output_chars,
        inputs=inputs,
    )
