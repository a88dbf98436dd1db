"""`drlm export`: an episode as the rlms package's JSONL trajectory log, or as one JSON document.

The rlms log is there so rlms's own visualizer opens our episodes: its lines are shaped as
rlms 0.1.3 writes them (`RLMLogger` and the `to_dict` of `RLMMetadata`, `RLMIteration`,
`REPLResult`, `RLMChatCompletion` in rlm/core/types.py); tests/test_export.py checks them
with rlms itself. Everything comes from the history (durable_rlm/audit/timeline.py) and the blob
store, which holds the conversation each root call was sent.
"""

from __future__ import annotations

import ast
import asyncio
import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from durable_rlm.audit.timeline import CellView, ChildView, SubCall, Timeline, ending_text, episode_timeline
from durable_rlm.errors import ConfigurationError
from durable_rlm.server.connection import connect
from durable_rlm.settings import Settings
from durable_rlm.store.blobs import BlobStore
from durable_rlm.store.chains import read_conversation
from durable_rlm.workflows import defaults
from durable_rlm.workflows.compaction import resent_view
from durable_rlm.workflows.models import EpisodeRequest, ForkOrigin, Message, TokenUsage, ending_words
from durable_rlm.workflows.prompts import HISTORY_CELL

FORMATS = ("rlms", "json")
ENVIRONMENT_TYPE = "local"
"""rlms's name for a REPL in a process next to the loop: the closest of its environments."""
ANSWERED_BY_AN_ITERATION = ("model", "policy")
"""Answer sources found in the last iteration itself; an extracted answer came after it."""


async def export_command(settings: Settings, episode_id: str, fmt: str, output: str | None) -> int:
    """Write the episode to `output` (default: stdout). An unknown id is a LookupError."""
    if fmt not in FORMATS:
        raise ConfigurationError(f"unknown export format {fmt!r}; known: {', '.join(FORMATS)}")
    async with connect(settings) as services:
        timeline = await episode_timeline(services.client, episode_id)
        text = await asyncio.to_thread(export_text, timeline, services.blobs, fmt)
    _write(text, output)
    what = "an rlms trajectory log" if fmt == "rlms" else "JSON"
    lines = text.count("\n")
    where = f"to {output}" if output is not None else "to standard output"
    # On stderr: standard output may be the export itself.
    print(
        f"episode {episode_id}: {len(timeline.iterations)} iteration(s) written as {what} {where} "
        f"({lines:,} line(s), {len(text.encode()):,} bytes)",
        file=sys.stderr,
    )
    return 0


def export_text(timeline: Timeline, blobs: BlobStore, fmt: str) -> str:
    """The episode in `fmt`: "rlms" (JSONL, one entry per line) or "json" (one document)."""
    resolve_prompts(timeline, blobs)
    if fmt == "json":
        return timeline.model_dump_json(indent=2) + "\n"
    return "".join(json.dumps(entry) + "\n" for entry in rlms_log(timeline, blobs))


def resolve_prompts(timeline: Timeline, blobs: BlobStore) -> None:
    """Fill each iteration's `prompt` (children's too): the chain it names plus the turn's
    new messages, shortened as the root call shortened them when it sent them."""
    for it in timeline.iterations:
        if it.prompt is None:
            messages = [*read_conversation(blobs, it.conversation), *it.append]
            it.prompt = resent_view(messages, it.resent_message_chars or defaults.RESENT_MESSAGE_CHARS)
        for cell in it.cells:
            for child in cell.children:
                if child.timeline is not None:
                    resolve_prompts(child.timeline, blobs)


def rlms_log(timeline: Timeline, blobs: BlobStore) -> list[dict[str, Any]]:
    """RLMLogger's entries: a metadata line, then one line per iteration."""
    head = {"type": "metadata", "timestamp": _stamp(timeline.started_at), **run_metadata(timeline)}
    return [head, *iteration_entries(timeline, blobs)]


def run_metadata(timeline: Timeline) -> dict[str, Any]:
    """`RLMMetadata.to_dict()`. backend_kwargs hold no secret: a model never does, and the
    base URL loses any credentials or query it carries."""
    request = _request(timeline)
    model = request.root_model
    backend_kwargs: dict[str, Any] = {"model_name": model.model}
    if model.base_url:
        backend_kwargs["base_url"] = _public_url(model.base_url)
    fork = {"forked_from": _fork(request.fork)} if request.fork is not None else {}
    return {
        **fork,
        "root_model": model.model,
        "max_depth": request.max_depth,
        "max_iterations": request.limits.max_iterations,
        "backend": model.provider,
        "backend_kwargs": backend_kwargs,
        "environment_type": ENVIRONMENT_TYPE,
        "environment_kwargs": {},
        "other_backends": other_backends(request),
    }


def other_backends(request: EpisodeRequest) -> list[str] | None:
    """The backends the REPL's calls could use besides the root's: the sub-model (rlms's
    other backend) and every `--other-model`; None when there are none, as rlms writes it."""
    others = [*([request.sub_model] if request.sub_model is not None else []), *request.other_models]
    return [m.provider for m in others] or None


def _fork(fork: ForkOrigin) -> dict[str, Any]:
    return {"episode_id": fork.source_id, "iteration": fork.iteration, "changes": fork.changes}


def iteration_entries(timeline: Timeline, blobs: BlobStore) -> list[dict[str, Any]]:
    """One logger entry per iteration (`RLMIteration.to_dict()` plus type, number, time).
    The setup cell (iteration 0: environment_kwargs' setup_code) is no iteration: rlms runs
    it when it makes the environment."""
    final = _final_answer(timeline)
    turns = [it for it in timeline.iterations if it.iteration > 0]
    last = len(turns)
    return [
        {
            "type": "iteration",
            "iteration": number,
            "timestamp": _stamp(it.ended_at or it.started_at or timeline.started_at),
            "prompt": [_message(m) for m in it.prompt or []],
            "response": it.response or "",
            # rlms's `history` filled after a compaction is no code of the model's.
            "code_blocks": [
                code_block(cell, blobs) for cell in it.cells if not cell.code.startswith(HISTORY_CELL)
            ],
            "final_answer": final if number == last else None,
            # A reset's gap is not time the iteration worked (timeline.py, `reset_gap_s`).
            "iteration_time": _seconds(it.started_at, it.ended_at, it.reset_gap_s),
            # A fork's iterations up to its branch ran in its source: marked, not re-run.
            **({"inherited_from": it.inherited_from} if it.inherited_from else {}),
        }
        for number, it in enumerate(turns, start=1)
    ]


def code_block(cell: CellView, blobs: BlobStore) -> dict[str, Any]:
    """`CodeBlock.to_dict()`: rlms reports a cell's exception on stderr, as we do here."""
    calls: list[tuple[int, dict[str, Any]]] = [(c.call_index, sub_call(c)) for c in cell.sub_calls]
    calls += [(c.call_index, child_call(c, blobs)) for c in cell.children]
    return {
        "code": cell.code,
        "result": {
            "stdout": cell.stdout,
            "stderr": "\n".join(x for x in (cell.stderr, cell.error) if x),
            "locals": {name: json_local(text) for name, text in cell.variables.items()},
            "execution_time": _seconds(cell.started_at, cell.ended_at, cell.reset_gap_s),
            "rlm_calls": [entry for _, entry in sorted(calls, key=lambda pair: pair[0])],
            "final_answer": cell.answer,
        },
    }


def json_local(text: str) -> Any:
    """A REPL variable as rlms's log holds it: a JSON value (rlms's `_serialize_value`),
    the text itself for what is not a Python literal (a string, or an object's repr).
    The history keeps each variable's bounded text view (strings as they are, numbers by
    str, the rest by repr): a literal there is read back as the value it shows."""
    if len(text) > 10_000 or "..." in text:  # a view cut by reprlib is not the value
        return text
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text
    return _serialized(value)


def _serialized(value: Any) -> Any:
    """rlms 0.1.3's `_serialize_value` (rlm/core/types.py): JSON values stay, tuples are
    lists, dict keys strings, and anything else its repr."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_serialized(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _serialized(v) for k, v in value.items()}
    return repr(value)


def sub_call(call: SubCall) -> dict[str, Any]:
    """`RLMChatCompletion.to_dict()` of an llm_query: a failed call has an error, no reply."""
    entry: dict[str, Any] = {
        "root_model": call.model,
        "prompt": call.prompt,
        "response": call.reply or "",
        "usage_summary": usage_summary(call.model, 1, call.usage if call.error is None else None),
        "execution_time": float(call.model_time_s),
    }
    if call.error is not None:
        entry["error"] = call.error
    return entry


def child_call(child: ChildView, blobs: BlobStore) -> dict[str, Any]:
    """An rlm_query that ran a child episode, as rlms records a child RLM: its answer, and
    its own trajectory (metadata and iterations) under `metadata`."""
    timeline = child.timeline
    result = timeline.result if timeline is not None else None
    entry: dict[str, Any] = {
        "root_model": child.model,
        "prompt": blobs.get_text(child.context.digest) if child.context is not None else "",
        "response": (result.answer if result is not None else None) or "",
        "usage_summary": usage_summary(
            child.model, result.model_calls if result else 0, result.usage if result else None
        ),
        "execution_time": _seconds(timeline.started_at, timeline.ended_at) if timeline else 0.0,
    }
    if timeline is not None:
        entry["metadata"] = {
            "run_metadata": run_metadata(timeline),
            "iterations": iteration_entries(timeline, blobs),
        }
    if timeline is None:
        entry["error"] = f"child episode {child.episode_id} has no history"
    elif result is None:
        why = f": {timeline.failure}" if timeline.failure else ""
        entry["error"] = f"child episode {child.episode_id} {ending_words(timeline.status)}{why}"
    elif result.answer is None:
        entry["error"] = f"child episode {child.episode_id} ended ({ending_text(result)}) without an answer"
    return entry


def usage_summary(model: str, calls: int, usage: TokenUsage | None) -> dict[str, Any]:
    """`UsageSummary.to_dict()`: cost keys only when the cost is known, as rlms writes them."""
    if usage is None:
        return {"model_usage_summaries": {}}
    summary: dict[str, Any] = {
        "total_calls": calls,
        "total_input_tokens": usage.prompt_tokens,
        "total_output_tokens": usage.completion_tokens,
    }
    if usage.cost_usd is None:
        return {"model_usage_summaries": {model: summary}}
    summary["total_cost"] = usage.cost_usd
    return {"model_usage_summaries": {model: summary}, "total_cost": usage.cost_usd}


def _final_answer(timeline: Timeline) -> str | None:
    result = timeline.result
    if result is None or result.answer_source not in ANSWERED_BY_AN_ITERATION:
        return None
    return result.answer


def _request(timeline: Timeline) -> EpisodeRequest:
    if timeline.request is None:
        raise LookupError(f"episode {timeline.episode_id}: its history holds no request")
    return timeline.request


def _message(message: Message) -> dict[str, str]:
    return {"role": message.role, "content": message.content}


def _stamp(moment: datetime | None) -> str:
    """Local time without a zone, as rlms's `datetime.now().isoformat()` writes it."""
    return moment.astimezone().replace(tzinfo=None).isoformat() if moment is not None else ""


def _seconds(start: datetime | None, end: datetime | None, stood_still: float = 0.0) -> float:
    if start is None or end is None:
        return 0.0
    return max(0.0, (end - start).total_seconds() - stood_still)


def _public_url(url: str) -> str:
    """The URL without user, password, query or fragment: where a key could hide."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _write(text: str, output: str | None) -> None:
    """All or nothing: the text is complete before a byte of it is written."""
    if output is None:
        sys.stdout.write(text)
        return
    try:
        Path(output).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise ConfigurationError(f"cannot write {output}: {exc.strerror or exc}") from None
