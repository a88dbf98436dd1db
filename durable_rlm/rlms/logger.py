"""rlms's logger, and an ended episode's iterations as its lines."""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from durable_rlm.audit.timeline import Timeline
    from durable_rlm.store.blobs import BlobStore


class RLMLogger:
    """rlms's RLMLogger (rlm/logger/rlm_logger.py), same interface and the same JSONL lines:
    a metadata line, then one line per iteration; kept in memory for the result's
    `metadata`, and appended to `log_dir/<file_name>_<time>_<id>.jsonl` when log_dir is set.
    rlms's own RLMLogger works with RLM too."""

    def __init__(self, log_dir: str | None = None, file_name: str = "rlm") -> None:
        self.log_dir = log_dir
        self.log_file_path: str | None = None
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
            stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
            self.log_file_path = os.path.join(log_dir, f"{file_name}_{stamp}_{uuid.uuid4().hex[:8]}.jsonl")
        self._run_metadata: dict[str, Any] | None = None
        self._iterations: list[dict[str, Any]] = []
        self._iteration_count = 0

    def log_metadata(self, metadata: Any) -> None:
        if self._run_metadata is not None:
            return
        self._run_metadata = metadata.to_dict() if hasattr(metadata, "to_dict") else dict(metadata)
        self._append({"type": "metadata", "timestamp": datetime.now().isoformat(), **self._run_metadata})

    def log(self, iteration: Any) -> None:
        self._iteration_count += 1
        body = iteration.to_dict() if hasattr(iteration, "to_dict") else dict(iteration)
        entry = {
            "type": "iteration",
            "iteration": self._iteration_count,
            "timestamp": datetime.now().isoformat(),
            **body,
        }
        self._iterations.append(entry)
        self._append(entry)

    def clear_iterations(self) -> None:
        self._iterations = []
        self._iteration_count = 0

    def get_trajectory(self) -> dict[str, Any] | None:
        if self._run_metadata is None:
            return None
        return {"run_metadata": self._run_metadata, "iterations": list(self._iterations)}

    @property
    def iteration_count(self) -> int:
        return self._iteration_count

    def _append(self, entry: dict[str, Any]) -> None:
        if self.log_file_path:
            with open(self.log_file_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")


@dataclass
class Logged:
    """What rlms's logger takes: an object with `to_dict()`."""

    body: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return self.body


def replay_to_logger(
    logger: Any, timeline: Timeline, blobs: BlobStore, run_metadata: dict[str, Any] | None = None
) -> None:
    """The episode's iterations as rlms's logger lines (durable_rlm/viewer/export.py). A
    child episode's trajectory carries `run_metadata` (the RLM's own), as rlms's child RLM
    is made from its parent's settings, with the child's model."""
    from durable_rlm.viewer.export import (  # start-up: temporalio, not on import
        iteration_entries,
        resolve_prompts,
    )

    resolve_prompts(timeline, blobs)
    for entry in iteration_entries(timeline, blobs):
        body = {k: v for k, v in entry.items() if k not in ("type", "iteration", "timestamp")}
        if run_metadata is not None:
            _children_as_rlms_makes_them(body, run_metadata)
        logger.log(Logged(body))


def _children_as_rlms_makes_them(iteration: dict[str, Any], run_metadata: dict[str, Any]) -> None:
    for block in iteration.get("code_blocks", []):
        for call in block.get("result", {}).get("rlm_calls", []):
            trajectory = call.get("metadata")
            if not isinstance(trajectory, dict) or "run_metadata" not in trajectory:
                continue
            model = call.get("root_model") or run_metadata.get("root_model")
            kwargs = {**run_metadata.get("backend_kwargs", {}), "model_name": model}
            trajectory["run_metadata"] = {**run_metadata, "root_model": model, "backend_kwargs": kwargs}
            for inner in trajectory.get("iterations", []):
                _children_as_rlms_makes_them(inner, run_metadata)
