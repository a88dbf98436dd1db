"""Runtime settings from the environment (pydantic-settings), validated once at start-up.

Every setting has one environment variable; `drlm info` prints each store's location and
which variable (or default) chose it. Stores live in one per-user directory by default, so
the CLI, the Python API and `python worker.py` find the same data from any directory.
"""

from __future__ import annotations

import os
import tomllib
import urllib.parse
from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

import platformdirs
from pydantic import AliasChoices, Field, PrivateAttr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from durable_rlm.errors import ConfigurationError
from durable_rlm.host.owned_dirs import owned_directory
from durable_rlm.store.encryption import Keyring
from durable_rlm.workflows import defaults

__all__ = ["ConfigurationError", "Settings", "default_data_dir"]

SECRET_FIELDS = frozenset({"codec_token", "temporal_api_key", "snapshot_key", "encryption_keys"})
"""Settings `drlm config` never prints (the database URL's password is hidden too)."""

SERVER_IDLE_S = 300.0  # how long the shared embedded server outlives its last client


def default_data_dir() -> Path:
    """The user's data directory (e.g. ~/.local/share/drlm): one per user, not per cwd."""
    return Path(platformdirs.user_data_dir("drlm", appauthor=False))


def _env(field: str, variable: str, default: Any, **kwargs: Any) -> Any:
    return Field(default, validation_alias=AliasChoices(field, variable), **kwargs)


# Settings.from_env(mapping) reads only the mapping (tests, embedding); Settings() reads
# os.environ like any pydantic-settings class.
_MAPPING_ONLY: ContextVar[bool] = ContextVar("drlm_settings_mapping_only", default=False)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(extra="ignore", populate_by_name=True, env_ignore_empty=True)

    temporal_address: str | None = _env("temporal_address", "TEMPORAL_ADDRESS", None)
    temporal_namespace: str = _env("temporal_namespace", "TEMPORAL_NAMESPACE", "default")
    temporal_tls_cert: Path | None = _env(
        "temporal_tls_cert", "TEMPORAL_TLS_CERT", None, description="client certificate (PEM) for mTLS"
    )
    temporal_tls_key: Path | None = _env(
        "temporal_tls_key", "TEMPORAL_TLS_KEY", None, description="its private key (PEM)"
    )
    temporal_tls_ca: Path | None = _env(
        "temporal_tls_ca", "TEMPORAL_TLS_CA", None, description="the server's CA (PEM); default: system roots"
    )
    temporal_api_key: str | None = _env(
        "temporal_api_key",
        "TEMPORAL_API_KEY",
        None,
        repr=False,
        description="Temporal Cloud API key (TLS on)",
    )
    task_queue: str = _env("task_queue", "DRLM_TASK_QUEUE", "drlm-episodes")
    deployment_name: str | None = _env(
        "deployment_name",
        "DRLM_DEPLOYMENT_NAME",
        None,
        description="Temporal Worker Deployment of this worker (with DRLM_BUILD_ID); unset: unversioned",
    )
    build_id: str | None = _env(
        "build_id", "DRLM_BUILD_ID", None, description="this worker's build in the deployment"
    )
    versioning: Literal["auto-upgrade", "pinned"] = _env(
        "versioning",
        "DRLM_VERSIONING",
        "auto-upgrade",
        description="episodes in flight move to the current build (patched code), or stay on theirs",
    )
    data_dir: Path = _env(
        "data_dir", "DRLM_DATA_DIR", None, description="default: the user data dir (platformdirs)"
    )
    database_url: str | None = _env("database_url", "DRLM_DATABASE_URL", None)
    blob_store: str = _env(
        "blob_store",
        "DRLM_BLOB_STORE",
        "sql",
        description="'sql', a directory path, or s3://BUCKET/PREFIX (an S3-compatible object store)",
    )
    s3_endpoint_url: str | None = _env(
        "s3_endpoint_url",
        "DRLM_S3_ENDPOINT_URL",
        None,
        description="the endpoint of an s3:// blob store; unset: AWS S3 (or AWS_ENDPOINT_URL)",
    )
    claim_check_threshold: int = _env("claim_check_threshold", "DRLM_CLAIM_CHECK_THRESHOLD", 4096, ge=256)
    sandbox_memory_mb: int = _env(
        "sandbox_memory_mb", "DRLM_SANDBOX_MEMORY_MB", defaults.SANDBOX_MEMORY_MB, ge=64
    )
    sandbox_idle_s: float = _env("sandbox_idle_s", "DRLM_SANDBOX_IDLE_S", defaults.SANDBOX_IDLE_S, gt=0)
    sandbox_dir: Path | None = _env(
        "sandbox_dir",
        "DRLM_SANDBOX_DIR",
        None,
        description="the sandboxes' root, a directory of this user's own that only it can write "
        "(refused otherwise); default: $TMPDIR/drlm-sandboxes",
    )
    sandbox_files_mb: int = _env(
        "sandbox_files_mb",
        "DRLM_SANDBOX_FILES_MB",
        defaults.SANDBOX_FILES_MB,
        ge=1,
        description="a sandbox's own directory, a tmpfs of this size counted in its memory "
        "(with the private root; without it the host's disk, 256 MB a file)",
    )
    sandbox_start: Literal["fork", "spawn"] = _env(
        "sandbox_start",
        "DRLM_SANDBOX_START",
        "fork",
        description="fork sandboxes from a template process, or spawn each afresh",
    )
    sandbox_budget_mb: int | None = _env(
        "sandbox_budget_mb",
        "DRLM_SANDBOX_BUDGET_MB",
        None,
        ge=64,
        description="evict idle sandboxes (rebuilt from the log) above this total",
    )
    max_sandboxes: int | None = _env(
        "max_sandboxes",
        "DRLM_MAX_SANDBOXES",
        None,
        ge=1,
        le=100_000,
        description="live sandboxes one worker holds (idle ones evicted, then new work waits); "
        "default: 3/4 of its memory at 64 MB each",
    )
    hold_new_episodes: bool = _env(
        "hold_new_episodes",
        "DRLM_HOLD_NEW_EPISODES",
        False,
        description="while every sandbox runs a step, poll no new episodes (other workers take "
        "them); costs workflow-task latency on a CPU-saturated worker",
    )
    capacity: int = _env(
        "capacity",
        "DRLM_CAPACITY",
        defaults.WORKER_CAPACITY,
        ge=1,
        le=100_000,
        description="live episodes one worker serves: its workflow cache and local-step slots",
    )
    activity_slots: int = _env(
        "activity_slots",
        "DRLM_ACTIVITY_SLOTS",
        defaults.ACTIVITY_SLOTS,
        ge=1,
        le=100_000,
        description="model calls and tools in flight",
    )
    encryption_keys: str | None = _env(
        "encryption_keys",
        "DRLM_ENCRYPTION_KEYS",
        None,
        repr=False,
        description="ID=BASE64(32 bytes),...: AES-256-GCM for payloads and blobs; the first "
        "encrypts, all decrypt (rotation)",
    )
    snapshot_key: str | None = _env(
        "snapshot_key",
        "DRLM_SNAPSHOT_KEY",
        None,
        repr=False,
        description="signs REPL snapshots; default: a key file in data_dir",
    )
    server_idle_s: float = _env(
        "server_idle_s",
        "DRLM_SERVER_IDLE_S",
        SERVER_IDLE_S,
        ge=0,
        description="the shared embedded server stops this long after its last client left",
    )
    steer_wait_s: float = _env(
        "steer_wait_s",
        "DRLM_STEER_WAIT_S",
        20.0,
        gt=0,
        le=3600,
        description="how long a steering command (cancel, hint, approve, ...) waits for a busy "
        "worker's answer before it returns, saying the request is not confirmed",
    )
    ui: bool = _env("ui", "DRLM_UI", True, description="serve the Temporal Web UI from the embedded server")
    ui_port: int = _env(
        "ui_port", "DRLM_UI_PORT", 8233, ge=1, le=65535, description="its port (a free one if taken)"
    )
    ui_address: str | None = _env(
        "ui_address", "DRLM_UI_ADDRESS", None, description="the UI of a cluster, e.g. http://localhost:8080"
    )
    codec_token: str | None = _env(
        "codec_token", "DRLM_CODEC_TOKEN", None, repr=False, description="bearer token of `drlm codec-server`"
    )
    tracing: str = _env(
        "tracing",
        "DRLM_TRACING",
        "off",
        description="traces and metrics: off, console or otlp; OTEL_{TRACES,METRICS}_EXPORTER override",
    )
    metrics_address: str | None = _env(
        "metrics_address",
        "DRLM_METRICS_ADDRESS",
        None,
        description="host:port of a Prometheus endpoint for the SDK's and our metrics; unset: none",
    )
    prices_file: Path | None = _env(
        "prices_file",
        "DRLM_PRICES_FILE",
        None,
        description="a JSON price table (USD per million tokens) over the shipped one; "
        "default: prices.json in the data directory, if there is one",
    )
    policy_modules: str = _env(
        "policy_modules",
        "DRLM_POLICY_MODULES",
        "",
        description="comma-separated modules registering policies",
    )
    tool_modules: str = _env(
        "tool_modules",
        "DRLM_TOOL_MODULES",
        "",
        description="comma-separated modules registering custom tools",
    )

    _environ: dict[str, str] = PrivateAttr(default_factory=dict)
    _given: frozenset[str] = PrivateAttr(default=frozenset())
    _from_file: dict[str, str] = PrivateAttr(default_factory=dict)
    _keyring: Any = PrivateAttr(default=None)

    def __init__(self, **values: Any) -> None:
        super().__init__(**values)
        self._given = frozenset(values)  # field names the caller passed (from_env passes variables)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,) if _MAPPING_ONLY.get() else (init_settings, env_settings)

    @model_validator(mode="after")
    def _encryption_keys(self) -> Settings:
        if self.encryption_keys:
            try:
                Keyring.parse(self.encryption_keys)
            except ConfigurationError as exc:
                raise ValueError(str(exc)) from None
        return self

    @model_validator(mode="after")
    def _deployment_pair(self) -> Settings:
        if (self.deployment_name is None) != (self.build_id is None):
            raise ValueError("DRLM_DEPLOYMENT_NAME and DRLM_BUILD_ID go together: set both or neither")
        for name in ("deployment_name", "build_id"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ValueError(f"{self.variables()[name]} is blank")
        if self.deployment_name is not None and "." in self.deployment_name:
            # The server's version string is "name.build": a dot in the name is ambiguous.
            raise ValueError(f"DRLM_DEPLOYMENT_NAME: {self.deployment_name!r} has a dot; it may not")
        return self

    def keyring(self) -> Any:
        """DRLM_ENCRYPTION_KEYS parsed (durable_rlm/store/encryption.py), or None: no encryption."""
        if not self.encryption_keys:
            return None
        if self._keyring is None:
            self._keyring = Keyring.parse(self.encryption_keys)
        return self._keyring

    def worker_deployment(self) -> Any:
        """The SDK's Worker Deployment config of this worker, or None (unversioned)."""
        if self.deployment_name is None or self.build_id is None:
            return None
        from temporalio.common import (  # start-up: temporalio 0.15 s; only a versioned worker needs it
            VersioningBehavior,
            WorkerDeploymentVersion,
        )
        from temporalio.worker import WorkerDeploymentConfig  # start-up: 0.4 s; settings are read without it

        behavior = {"auto-upgrade": VersioningBehavior.AUTO_UPGRADE, "pinned": VersioningBehavior.PINNED}
        return WorkerDeploymentConfig(
            version=WorkerDeploymentVersion(deployment_name=self.deployment_name, build_id=self.build_id),
            use_worker_versioning=True,
            default_versioning_behavior=behavior[self.versioning],
        )

    @model_validator(mode="after")
    def _tls_pair(self) -> Settings:
        if (self.temporal_tls_cert is None) != (self.temporal_tls_key is None):
            raise ValueError("TEMPORAL_TLS_CERT and TEMPORAL_TLS_KEY go together: set both or neither")
        for name in ("temporal_tls_cert", "temporal_tls_key", "temporal_tls_ca"):
            path = getattr(self, name)
            if path is not None and not path.is_file():
                raise ValueError(f"{self.variables()[name]}: no file at {path}")
        return self

    def temporal_tls(self) -> Any:
        """The client's TLS settings: mTLS from the certificate and key, plain TLS for an API
        key (Temporal Cloud), else None (a local server)."""
        if self.temporal_tls_cert is None and self.temporal_api_key is None and self.temporal_tls_ca is None:
            return None
        from temporalio.service import TLSConfig  # start-up: temporalio 0.1 s; drlm list skips

        return TLSConfig(
            client_cert=self.temporal_tls_cert.read_bytes() if self.temporal_tls_cert else None,
            client_private_key=self.temporal_tls_key.read_bytes() if self.temporal_tls_key else None,
            server_root_ca_cert=self.temporal_tls_ca.read_bytes() if self.temporal_tls_ca else None,
        )

    @field_validator("tracing")
    @classmethod
    def _tracing_kind(cls, value: str) -> str:
        if value not in {"off", "console", "otlp"}:
            raise ValueError("DRLM_TRACING must be off, console or otlp")
        return value

    @field_validator("data_dir", mode="before")
    @classmethod
    def _data_dir(cls, value: Any) -> Path:
        return default_data_dir() if value in (None, "") else Path(os.path.expanduser(str(value)))

    def model_post_init(self, context: Any) -> None:
        if not self._environ:
            self._environ = {} if _MAPPING_ONLY.get() else dict(os.environ)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Settings from `environ` (default os.environ) over the TOML config file (DRLM_CONFIG,
        or drlm.toml in the user config directory if there is one); a bad value is a
        ConfigurationError naming the variable or the file."""
        env = dict(os.environ if environ is None else environ)
        config = config_file(env)
        from_file = read_config(config) if config is not None else {}
        values = {variable: env[variable] for variable in cls.variables().values() if env.get(variable)}
        chosen = {field for field, variable in cls.variables().items() if variable in values}
        values |= {field: value for field, value in from_file.items() if field not in chosen}
        token = _MAPPING_ONLY.set(True)
        try:
            settings = cls(**values)
        except ValidationError as exc:
            in_file = {field: str(config) for field in from_file if field not in chosen}
            raise ConfigurationError(f"invalid configuration: {_explain(exc, in_file)}") from exc
        finally:
            _MAPPING_ONLY.reset(token)
        settings._environ = env
        settings._given = frozenset()
        settings._from_file = {field: str(config) for field in from_file if field not in chosen}
        return settings

    @classmethod
    def variables(cls) -> dict[str, str]:
        """field -> its environment variable."""
        out = {}
        for name, info in cls.model_fields.items():
            alias = info.validation_alias
            assert isinstance(alias, AliasChoices)
            out[name] = str(alias.choices[-1])
        return out

    def origin(self, field: str) -> str:
        """Which setting chose a field's value: its variable, the caller, or the default."""
        variable = self.variables()[field]
        if field in self._given:
            return "set by the caller"
        if self._environ.get(variable):
            return variable
        if field in self._from_file:
            return f"config file {self._from_file[field]}"
        return f"default ({variable} unset)"

    def effective(self) -> list[tuple[str, Any, str, str]]:
        """Every setting as (field, value, variable, origin), secrets masked: `drlm config`."""
        rows = []
        for field, variable in self.variables().items():
            value = getattr(self, field)
            if field in SECRET_FIELDS and value:
                value = "***"
            elif field == "database_url" and value:
                value = safe_url(value)
            elif isinstance(value, Path):
                value = str(value)
            origin = self.origin(field)
            rows.append((field, value, variable, "default" if origin.startswith("default") else origin))
        return rows

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
        # Quoted: SQLAlchemy reads %-escapes in the path (a data directory named `a%20b`).
        return f"sqlite:///{urllib.parse.quote(str((self.data_dir / 'drlm.sqlite').resolve()))}"

    @property
    def temporal_db_file(self) -> Path:
        return (self.data_dir / "temporal.sqlite").resolve()

    def describe_stores(self) -> dict[str, tuple[str, str]]:
        """Each store's location and the setting that chose it (for `drlm info`, and for
        errors that must say where a process looked)."""

        def chosen(field: str, otherwise: str) -> str:
            origin = self.origin(field)
            return otherwise if origin.startswith("default") else origin

        data_dir = chosen("data_dir", "default: the user data directory (set DRLM_DATA_DIR to move it)")
        in_data_dir = f"DRLM_DATABASE_URL unset: in the data directory, {data_dir}"
        database_url = safe_url(self.effective_database_url)
        return {
            "data directory": (str(self.data_dir.resolve()), data_dir),
            "temporal": (
                f"{self.temporal_address} (namespace {self.temporal_namespace})"
                if self.temporal_address
                else f"embedded dev server on {self.temporal_db_file}",
                chosen(
                    "temporal_address", "TEMPORAL_ADDRESS unset: the embedded server of the data directory"
                ),
            ),
            "SQL store": (database_url, chosen("database_url", in_data_dir)),
            "blob store": (
                f"table 'blobs' of {database_url}" if self.blob_store == "sql" else self.blob_store_name,
                chosen("blob_store", "DRLM_BLOB_STORE unset: in the SQL store"),
            ),
        }

    @property
    def blob_store_name(self) -> str:
        """Where blobs live, as every process of a deployment must name it the same way."""
        if self.blob_store == "sql":
            return "sql"
        if self.blob_store.startswith("s3://"):
            endpoint = f" at {self.s3_endpoint_url}" if self.s3_endpoint_url else ""
            return f"{self.blob_store}{endpoint}"
        return str(Path(self.blob_store).resolve())

    def prepare_data_dir(self) -> Path:
        """The data directory, created private (0700) with its SQLite files 0600: it holds
        contexts, prompts and answers."""
        return private_dir(self.data_dir)


def config_file(env: Mapping[str, str]) -> Path | None:
    """DRLM_CONFIG, or drlm.toml in the user config directory when it exists."""
    named = env.get("DRLM_CONFIG")
    if named:
        path = Path(os.path.expanduser(named))
        if not path.is_file():
            raise ConfigurationError(f"DRLM_CONFIG: no config file at {path}")
        return path
    default = Path(platformdirs.user_config_dir("drlm", appauthor=False)) / "drlm.toml"
    return default if default.is_file() else None


def read_config(path: Path) -> dict[str, Any]:
    """A TOML file of settings by field name (`task_queue = "q"`) or by variable
    (`DRLM_TASK_QUEUE = "q"`), flat or under a `[drlm]` table; unknown keys are errors."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigurationError(f"config file {path}: {exc}") from None
    data = data.get("drlm", data) if isinstance(data.get("drlm"), dict) else data
    by_variable = {variable: field for field, variable in Settings.variables().items()}
    values: dict[str, Any] = {}
    for key, value in data.items():
        field = key if key in Settings.model_fields else by_variable.get(key)
        if field is None:
            known = ", ".join(sorted(Settings.model_fields))
            raise ConfigurationError(f"config file {path}: unknown setting {key!r} (known: {known})")
        values[field] = value
    return values


def safe_url(url: str) -> str:
    """A database URL fit to print: its password hidden."""
    from sqlalchemy.engine import make_url  # start-up: SQLAlchemy 0.14 s; import durable_rlm skips

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not a URL: print nothing of it
        return "(an unparsable DRLM_DATABASE_URL)"


def private_dir(path: Path) -> Path:
    """`path` as a 0700 directory of this user's own: made now, or refused (UnsafeDirectory)
    when another user made it, could swap it or could write in it (durable_rlm/host/owned_dirs.py)."""
    owned_directory(path, 0o700)
    return path


def private_file(path: Path) -> Path:
    """Create `path` empty with mode 0600 unless it exists (SQLite gives its -wal and -shm
    files the mode of the database file)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        pass
    return path


def _explain(exc: ValidationError, in_file: Mapping[str, str] | None = None) -> str:
    """Each problem named by what set it: its variable, or its key in the config file."""
    variables = Settings.variables()
    problems = []
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else "value"
        name = variables.get(field, field)
        if in_file and field in in_file:
            name = f"{field} in {in_file[field]}"
        if not error["loc"]:  # a rule over several settings: its message names them
            problems.append(str(error["msg"]).removeprefix("Value error, "))
            continue
        got = "***" if field in SECRET_FIELDS else repr(error.get("input"))
        problems.append(f"{name}: {error['msg']} (got {got})")
    return "; ".join(problems)
