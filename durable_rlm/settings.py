"""Runtime settings from the environment, validated once at start-up."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from durable_rlm.errors import ConfigurationError
from workflows import defaults

__all__ = ["ConfigurationError", "Settings"]


class Settings(BaseModel):
    temporal_address: str | None = None
    temporal_namespace: str = "default"
    task_queue: str = "drlm-episodes"
    data_dir: Path = Path(".drlm")
    database_url: str | None = None
    blob_store: str = Field(default="sql", description="'sql' or a directory path")
    claim_check_threshold: int = Field(default=4096, ge=256)
    sandbox_memory_mb: int = Field(default=defaults.SANDBOX_MEMORY_MB, ge=64)
    sandbox_idle_s: float = Field(default=defaults.SANDBOX_IDLE_S, gt=0)
    sandbox_start: Literal["fork", "spawn"] = Field(
        default="fork", description="fork sandboxes from a template process, or spawn each afresh"
    )
    sandbox_budget_mb: int | None = Field(
        default=None, ge=64, description="evict idle sandboxes (rebuilt from the log) above this total"
    )
    capacity: int = Field(
        default=defaults.WORKER_CAPACITY,
        ge=1,
        le=100_000,
        description="live episodes one worker serves: its workflow cache and local-step slots",
    )
    activity_slots: int = Field(
        default=defaults.ACTIVITY_SLOTS, ge=1, le=100_000, description="model calls and tools in flight"
    )
    snapshot_key: str | None = Field(
        default=None, repr=False, description="signs REPL snapshots; default: a key file in data_dir"
    )
    tracing: str = "off"
    policy_modules: str = Field(default="", description="comma-separated modules registering policies")
    tool_modules: str = Field(default="", description="comma-separated modules registering custom tools")

    @field_validator("tracing")
    @classmethod
    def _tracing_kind(cls, value: str) -> str:
        if value not in {"off", "console", "otlp"}:
            raise ValueError("DRLM_TRACING must be off, console or otlp")
        return value

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Settings:
        env = dict(os.environ if environ is None else environ)
        mapping = {
            "TEMPORAL_ADDRESS": "temporal_address",
            "TEMPORAL_NAMESPACE": "temporal_namespace",
            "DRLM_TASK_QUEUE": "task_queue",
            "DRLM_DATA_DIR": "data_dir",
            "DRLM_DATABASE_URL": "database_url",
            "DRLM_BLOB_STORE": "blob_store",
            "DRLM_CLAIM_CHECK_THRESHOLD": "claim_check_threshold",
            "DRLM_SANDBOX_MEMORY_MB": "sandbox_memory_mb",
            "DRLM_SANDBOX_IDLE_S": "sandbox_idle_s",
            "DRLM_SANDBOX_BUDGET_MB": "sandbox_budget_mb",
            "DRLM_SANDBOX_START": "sandbox_start",
            "DRLM_CAPACITY": "capacity",
            "DRLM_ACTIVITY_SLOTS": "activity_slots",
            "DRLM_TRACING": "tracing",
            "DRLM_SNAPSHOT_KEY": "snapshot_key",
            "DRLM_POLICY_MODULES": "policy_modules",
            "DRLM_TOOL_MODULES": "tool_modules",
        }
        values = {field: env[name] for name, field in mapping.items() if env.get(name)}
        try:
            return cls(**values)
        except ValueError as exc:
            raise ConfigurationError(f"invalid configuration: {exc}") from exc

    @property
    def policy_module_names(self) -> tuple[str, ...]:
        return tuple(m.strip() for m in self.policy_modules.split(",") if m.strip())

    @property
    def tool_module_names(self) -> tuple[str, ...]:
        return tuple(m.strip() for m in self.tool_modules.split(",") if m.strip())

    @property
    def embedded(self) -> bool:
        return not self.temporal_address

    @property
    def effective_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'drlm.sqlite').resolve()}"

    @property
    def temporal_db_file(self) -> Path:
        return (self.data_dir / "temporal.sqlite").resolve()
