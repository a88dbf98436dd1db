"""rlms's trajectory and configuration types (rlm/core/types.py), the shapes its logger
lines and its programs use: a code block's result, an iteration, the run's metadata, and
what the first prompt says about the context. The result and usage types are results.py's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal

from durable_rlm.rlms.results import RLMChatCompletion

ClientBackend = Literal[
    "openai", "portkey", "openrouter", "vercel", "vllm", "anthropic", "azure_openai", "gemini"
]
EnvironmentType = Literal["local", "ipython", "docker", "modal", "prime", "daytona", "e2b"]


def json_value(value: Any) -> Any:
    """A REPL value as rlms's logger writes it: JSON as it is, a tuple as a list, a module,
    a function or anything else as a short text."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, ModuleType):
        return f"<module '{value.__name__}'>"
    if isinstance(value, list | tuple):
        return [json_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): json_value(v) for k, v in value.items()}
    if callable(value):
        return f"<{type(value).__name__} '{getattr(value, '__name__', type(value).__name__)}'>"
    try:
        return repr(value)
    except Exception:  # noqa: BLE001 - a hostile __repr__
        return f"<{type(value).__name__}>"


class REPLResult:
    """One code block's run: its output, the variables after it, its sub-calls, the answer
    it set (rlms's `final_answer`)."""

    def __init__(
        self,
        stdout: str,
        stderr: str,
        locals: dict[str, Any],  # noqa: A002 - rlms's name
        execution_time: float | None = None,
        rlm_calls: list[RLMChatCompletion] | None = None,
        final_answer: str | None = None,
    ) -> None:
        self.stdout = stdout
        self.stderr = stderr
        self.locals = locals
        self.execution_time = execution_time
        self.rlm_calls = rlm_calls or []
        self.final_answer = final_answer

    def __str__(self) -> str:
        return (
            f"REPLResult(stdout={self.stdout}, stderr={self.stderr}, locals={self.locals}, "
            f"execution_time={self.execution_time}, rlm_calls={len(self.rlm_calls)})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "stdout": self.stdout,
            "stderr": self.stderr,
            "locals": {k: json_value(v) for k, v in self.locals.items()},
            "execution_time": self.execution_time,
            "rlm_calls": [call.to_dict() for call in self.rlm_calls],
            "final_answer": self.final_answer,
        }


@dataclass
class CodeBlock:
    code: str
    result: REPLResult

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "result": self.result.to_dict()}


@dataclass
class RLMIteration:
    prompt: Any
    response: str
    code_blocks: list[CodeBlock] = field(default_factory=list)
    final_answer: str | None = None
    iteration_time: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "response": self.response,
            "code_blocks": [block.to_dict() for block in self.code_blocks],
            "final_answer": self.final_answer,
            "iteration_time": self.iteration_time,
        }


@dataclass
class RLMMetadata:
    """The run's configuration, the logger's first line."""

    root_model: str
    max_depth: int
    max_iterations: int
    backend: str
    backend_kwargs: dict[str, Any]
    environment_type: str
    environment_kwargs: dict[str, Any]
    other_backends: list[str] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "root_model": self.root_model,
            "max_depth": self.max_depth,
            "max_iterations": self.max_iterations,
            "backend": self.backend,
            "backend_kwargs": {k: json_value(v) for k, v in self.backend_kwargs.items()},
            "environment_type": self.environment_type,
            "environment_kwargs": {k: json_value(v) for k, v in self.environment_kwargs.items()},
            "other_backends": self.other_backends,
        }


class QueryMetadata:
    """What rlms's first prompt says of a context: its type and the length of each part."""

    def __init__(self, prompt: Any) -> None:
        if isinstance(prompt, str):
            self.context_type, self.context_lengths = "str", [len(prompt)]
        elif isinstance(prompt, dict):
            self.context_type = "dict"
            self.context_lengths = [_length(part) for part in prompt.values()]
        elif isinstance(prompt, list):
            self.context_type = "list"
            if not prompt:
                self.context_lengths = [0]
            elif isinstance(prompt[0], dict) and "content" in prompt[0]:
                self.context_lengths = [len(str(part.get("content", ""))) for part in prompt]
            elif isinstance(prompt[0], dict):
                self.context_lengths = [_length(part) for part in prompt]
            else:
                self.context_lengths = [len(part) for part in prompt]
        else:
            raise ValueError(f"Invalid prompt type: {type(prompt)}")
        self.context_total_length = sum(self.context_lengths)


def _length(part: Any) -> int:
    if isinstance(part, str):
        return len(part)
    try:
        return len(json.dumps(part, default=str))
    except (TypeError, ValueError):
        return len(repr(part))
