"""Pydantic models that cross the workflow/activity boundary.

Every activity takes exactly one of these as input so fields can be added later without
breaking running histories. Large text fields are fine here: the claim-check codec moves
any payload over its threshold into the blob store, and history keeps the digest.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from durable_rlm.workflows import defaults, names
from durable_rlm.workflows.fallback import ExecutionResult, FallbackReason, REPLHistoryEntry
from durable_rlm.workflows.typed_outputs import FieldSpec


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- request ------------------------------------------------------------------------------


Provider = Literal["openai", "anthropic"]
API_KEY_ENV: dict[str, str] = {"openai": "OPENAI_API_KEY", "anthropic": "ANTHROPIC_API_KEY"}


class ModelPrice(StrictModel):
    """List price of a model in USD per million tokens (durable_rlm/prices.py looks it up)."""

    input_usd_per_mtok: float = Field(ge=0)
    output_usd_per_mtok: float = Field(ge=0)

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        return round(
            (prompt_tokens * self.input_usd_per_mtok + completion_tokens * self.output_usd_per_mtok) / 1e6,
            COST_DIGITS,
        )


COST_DIGITS = 9
"""USD costs are rounded to a billionth of a dollar, so sums are the same wherever made."""


class ModelSettings(StrictModel):
    """Where a model lives. Never holds a secret: only the name of the worker's env var.

    `provider` picks the API: "openai" (any OpenAI-compatible server: OpenAI, vLLM, Ollama,
    llama.cpp, OpenRouter) or "anthropic" (the Messages API). A model name may carry it as
    a prefix, "anthropic:claude-sonnet-4-5"; the key variable then defaults to the provider's.
    """

    model: str = Field(min_length=1)
    provider: Provider = "openai"
    base_url: str | None = None
    api_key_env: str = "OPENAI_API_KEY"
    temperature: float | None = Field(default=None, ge=0)
    max_tokens: int | None = Field(default=None, ge=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: list[str] | None = Field(default=None, max_length=4, description="stop sequences")
    extra_body: dict[str, Any] = Field(
        default_factory=dict, description="vendor options sent as they are (e.g. top_k, repetition_penalty)"
    )
    request_timeout_s: float = Field(default=defaults.REQUEST_TIMEOUT_S, gt=0)
    max_attempts: int = Field(default=defaults.MODEL_ATTEMPTS, ge=1)
    logprobs: bool = Field(default=False, description="ask for token logprobs (a confidence source)")
    price: ModelPrice | None = Field(
        default=None, description="set from the price table when the request is made; None: cost unknown"
    )
    reports_cost: bool = Field(
        default=False,
        description="the provider returns each call's cost (usage.cost: OpenRouter, LiteLLM proxies); "
        "that figure is used, so max_cost_usd needs no price for this model",
    )

    @model_validator(mode="before")
    @classmethod
    def _provider_prefix(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("model"), str):
            return data
        prefix, sep, rest = data["model"].partition(":")
        if sep and prefix in API_KEY_ENV and rest:
            if data.get("provider", prefix) != prefix:
                raise ValueError(
                    f"model {data['model']!r} names provider {prefix!r}, not {data['provider']!r}"
                )
            data = {**data, "model": rest, "provider": prefix}
        provider = data.get("provider", "openai")
        if provider in API_KEY_ENV and "api_key_env" not in data:
            data = {**data, "api_key_env": API_KEY_ENV[provider]}
        return data


class ContextRef(StrictModel):
    """The episode's context, stored once in the blob store before the episode starts:
    text (a `str`), a JSON value, or documents (an index blob naming one blob per document,
    loaded by the sandbox when code touches it)."""

    digest: str
    kind: Literal["text", "json", "documents"] = "text"
    size: int = Field(ge=0, description="characters (of all documents, for documents)")
    type_name: str = "str"
    stored_bytes: int = Field(default=0, ge=0, description="UTF-8 bytes stored; 0: not recorded")
    char_width: int = Field(default=1, ge=1, le=4, description="bytes per character of the `str`")
    documents: int = Field(default=0, ge=0, description="how many, for documents")
    view: Literal["str", "mapped"] = Field(
        default="str", description="text only: a `str`, or a read-only view of the worker's copy (ASCII)"
    )


class DocumentRef(StrictModel):
    """One document of a documents context, as its index lists it."""

    name: str
    digest: str
    kind: Literal["text", "json"] = "text"
    size: int = Field(ge=0)
    stored_bytes: int = Field(default=0, ge=0)
    char_width: int = Field(default=1, ge=1, le=4)


class EpisodeLimits(StrictModel):
    max_iterations: int = Field(default=defaults.MAX_ITERATIONS, ge=1)
    max_llm_calls: int = Field(
        default=defaults.MAX_LLM_CALLS, ge=1, description="sub-calls made from the REPL"
    )
    max_duration: timedelta = Field(default=defaults.MAX_DURATION, description="counted from submission")
    cell_timeout_s: float = Field(default=defaults.CELL_TIMEOUT_S, gt=0)
    output_truncation: int = Field(default=defaults.OUTPUT_TRUNCATION, ge=100)
    max_parallel_subcalls: int = Field(
        default=defaults.MAX_PARALLEL_SUBCALLS, ge=1, le=defaults.MAX_PARALLEL_SUBCALLS_CEILING
    )
    max_cells_per_reply: int = Field(default=defaults.MAX_CELLS_PER_REPLY, ge=1)
    context_window_tokens: int | None = Field(
        default=None, ge=1_000, description="the root model's window; compaction keeps requests inside it"
    )
    compact_at: float = Field(default=defaults.COMPACT_AT_SHARE, gt=0, le=1.0)
    resent_message_chars: int = Field(default=defaults.RESENT_MESSAGE_CHARS, ge=1_000)
    max_model_calls: int | None = Field(
        default=None,
        ge=1,
        description="every model call of the episode and its children (root, sub, compaction, "
        "extraction); one is held back for fallback extraction. A child's ceiling is its share "
        "of what its parent has left",
    )
    max_tokens: int | None = Field(
        default=None,
        ge=1,
        description="tokens of the episode and its children; no call starts once they are spent",
    )
    max_cost_usd: float | None = Field(
        default=None,
        gt=0,
        description="USD of the episode and its children, from the price table; every model "
        "the episode can call needs a price",
    )
    max_children_per_batch: int = Field(
        default=defaults.MAX_CHILDREN_PER_BATCH, ge=1, le=defaults.MAX_CHILDREN_PER_BATCH_CEILING
    )
    max_tool_calls: int = Field(default=defaults.MAX_TOOL_CALLS, ge=0, description="custom-tool calls")
    max_reply_chars: int = Field(
        default=defaults.MAX_REPLY_CHARS,
        ge=1_000,
        le=defaults.MAX_REPLY_CHARS_CEILING,
        description="characters of one model reply read (root, sub-call, compaction, extraction); "
        "a longer reply is cut there, and the cut text ends with a note saying so",
    )

    @field_validator("max_duration")
    @classmethod
    def _positive_duration(cls, value: timedelta) -> timedelta:
        if value.total_seconds() <= 0:
            raise ValueError("max_duration must be positive")
        return value


class SnapshotPolicy(StrictModel):
    """When the worker snapshots the REPL's namespace after a cell (REPL snapshots): a
    rebuild loads the latest snapshot and re-runs only the cells after it."""

    after_s: float = Field(
        default=defaults.SNAPSHOT_AFTER_S,
        ge=0,
        description="snapshot once the cells since the last snapshot have run this many seconds",
    )
    every_cells: int = Field(
        default=defaults.SNAPSHOT_EVERY_CELLS,
        ge=1,
        description="...or after this many cells (1: every cell). Either rule waits while the cells "
        "since the last snapshot would cost less to re-run than it cost to take (the time rule: "
        "half as much), so a big namespace is snapshotted less often",
    )
    volatile: bool = Field(
        default=True,
        description="snapshot after a cell that read the clock or OS randomness, so a rebuild "
        "restores the values the model saw instead of drawing new ones",
    )
    max_mb: int = Field(
        default=defaults.SNAPSHOT_EPISODE_MB,
        ge=1,
        description="snapshot megabytes the episode keeps in the store: the newest that fit, "
        "older ones deleted (the newest two always kept, so a snapshot larger than the one "
        "before it leaves room for is not taken, and the timeline says so)",
    )


class DurabilitySettings(StrictModel):
    """How fast a dead worker is noticed. Tests shorten these; production keeps defaults."""

    heartbeat_timeout_s: float = Field(default=defaults.HEARTBEAT_TIMEOUT_S, gt=0)
    sticky_schedule_to_start_s: float = Field(default=defaults.STICKY_SCHEDULE_TO_START_S, gt=0)
    task_timeout_s: float = Field(
        default=defaults.WORKFLOW_TASK_TIMEOUT_S,
        gt=0,
        le=120,
        description="workflow task timeout: how soon a worker lost during a local REPL step is noticed",
    )
    local_repl: bool = Field(
        default=True,
        description="run REPL steps as local activities on the worker that runs the episode "
        "(half the round trips per iteration); False routes them to the sandbox's worker queue",
    )
    local_model_calls: bool = Field(
        default=False,
        description="run model calls as local activities of the worker that runs the episode "
        "(fewer events and round trips per call; a lost worker is noticed by the workflow "
        "task timeout, not a heartbeat)",
    )
    snapshots: SnapshotPolicy | None = Field(
        default_factory=SnapshotPolicy,
        description="REPL snapshots; None: a rebuild re-runs every cell since the start",
    )


class TerminationSpec(StrictModel):
    """Which termination policy (docs/behaviour/termination-policies.md) decides that the
    episode is done."""

    name: str = "final_pattern"
    config: dict[str, Any] = Field(default_factory=dict)
    scan_printed_output: bool = Field(
        default=False,
        description="hand the policy what cells printed (rlm_code style); by default printed data "
        "never ends an episode, only the model's own answer does",
    )


class RewardSpec(StrictModel):
    """A deterministic per-action reward added to any reward sent by update."""

    function: str = "none"
    config: dict[str, float] = Field(default_factory=dict)


class ToolParam(StrictModel):
    """One parameter of a custom tool, as the REPL's wrapper function declares it."""

    name: str
    kind: Literal["positional_only", "positional_or_keyword", "var_positional", "keyword_only", "var_keyword"]
    has_default: bool = False
    default: Any = Field(default=None, description="a JSON value")


class ToolSpec(StrictModel):
    """A custom tool offered to the episode's REPL: a function registered on the workers
    (durable_rlm.tools), run as an activity with its own timeout and retries."""

    name: str = Field(pattern=r"^[A-Za-z][A-Za-z0-9_]*$")
    params: list[ToolParam] = Field(default_factory=list)
    signature: str = "()"
    doc: str = ""
    timeout_s: float = Field(default=defaults.TOOL_TIMEOUT_S, gt=0)
    max_attempts: int = Field(default=defaults.TOOL_ATTEMPTS, ge=1)

    @field_validator("name")
    @classmethod
    def _free_name(cls, value: str) -> str:
        if value in names.REPL_RESERVED:
            raise ValueError(f"tool name {value!r} would hide the REPL's own {value}")
        return value


class ParentLink(StrictModel):
    """Where a child episode was called from: its parent, the cell and the call."""

    episode_id: str
    cell_index: int
    call_index: int


class ForkOrigin(StrictModel):
    """Where a fork branched: its source's state after `iteration` is its starting state."""

    source_id: str = Field(min_length=1)
    source_run_id: str = Field(description="the source's run whose history gave the state")
    iteration: int = Field(ge=1, description="the last iteration inherited from the source")
    elapsed_s: float = Field(ge=0, description="max_duration the source had spent by then")
    source_running: bool = Field(default=False, description="the source had not ended when forked")
    changes: list[str] = Field(default_factory=list, description="settings the fork changed, for people")
    ancestors: list[str] = Field(
        default_factory=list, description="the source's own sources, when it is a fork itself"
    )
    lineage_mac: str | None = Field(
        default=None,
        description="the lineage signed with the snapshot key (durable_rlm/store/snapshot_key.py)",
    )

    @property
    def lineage(self) -> list[str]:
        """The episodes whose REPL snapshots the fork may load: its source and theirs."""
        return [self.source_id, *self.ancestors]


class EpisodeRequest(StrictModel):
    task: str
    context: ContextRef | None = None
    root_model: ModelSettings
    sub_model: ModelSettings | None = None
    limits: EpisodeLimits = Field(default_factory=EpisodeLimits)
    durability: DurabilitySettings = Field(default_factory=DurabilitySettings)
    code_fences: list[str] = Field(default_factory=lambda: ["repl"], min_length=1)
    seed: int | None = None
    termination: TerminationSpec = Field(default_factory=TerminationSpec)
    reward: RewardSpec = Field(default_factory=RewardSpec)
    output_fields: list[FieldSpec] | None = Field(
        default=None, description="typed outputs for SUBMIT(...); None means one `answer` string"
    )
    fallback_extraction: bool = Field(default=True, description="extract outputs when a limit is hit")
    max_depth: int = Field(
        default=defaults.MAX_DEPTH,
        ge=1,
        le=defaults.MAX_DEPTH_CEILING,
        description="rlm_query starts a child episode only while the child's depth stays below this",
    )
    depth: int = Field(default=0, ge=0, description="0 for the root; set for child episodes")
    parent: ParentLink | None = None
    other_models: list[ModelSettings] = Field(
        default_factory=list, description="models REPL code may name in llm_query / rlm_query"
    )
    deadline: datetime | None = Field(
        default=None, description="an absolute deadline over max_duration (a child gets its parent's)"
    )
    tools: list[ToolSpec] = Field(default_factory=list, description="custom tools the REPL offers")
    sub_tools: list[ToolSpec] | None = Field(
        default=None,
        description="the tools child episodes (rlm_query) offer instead of `tools`, and pass on "
        "to theirs (rlms's custom_sub_tools); None: children offer `tools`",
    )
    system_prompt: str | None = Field(
        default=None, description="replaces the built-in system prompt (rlms's custom_system_prompt)"
    )
    setup_code: str | None = Field(
        default=None,
        description="the REPL's first cell, run before the first root call (rlms's "
        "environment_kwargs setup_code); in the cell log, so a rebuild runs it again",
    )
    repl_values: list[str] = Field(
        default_factory=list,
        description="the variables the setup cell binds from data tools (rlms's custom_tools "
        "values), one line each, as the system prompt lists them",
    )
    approve: ApproveMode = Field(
        default="none", description="cells that wait for a person's approval before they run"
    )
    rlms: bool = Field(
        default=False,
        description="rlms 0.1.3's semantics where ours differ (the rlms-compatible `RLM` sets it): "
        'a failed llm_query returns an "Error: ..." string, `context` and `history` are put '
        "back after each cell, `context_0` is bound, a custom system prompt is composed as "
        "rlms composes it",
    )
    dspy: DspyPrompts | None = Field(
        default=None,
        description="a DSPy program's RLM (`durable_rlm.dspy.RLM` sets it): DSPy's prompts, one cell "
        "per reply read from its `code` field, each step's output as DSPy's history shows it, "
        "SUBMIT as DSPy's, extraction as DSPy's `extract`",
    )
    private_text: bool = Field(
        default=False,
        description="payloads are encrypted (DRLM_ENCRYPTION_KEYS): search attributes, which the "
        "server indexes in the clear, carry no task or prompt text",
    )
    carry: EpisodeCarry | None = Field(
        default=None, description="set by continue-as-new to hand the loop's state over; leave empty"
    )
    fork: ForkOrigin | None = Field(
        default=None, description="set by `drlm fork`: carry is then the source's state at the branch"
    )
    session: SessionTurn | None = Field(
        default=None,
        description="set by a persistent session (workflows/session.py): this episode is one of its "
        "turns, starting from the REPL the last turn left, with setup_code binding this turn's values",
    )

    @field_validator("task")
    @classmethod
    def _task_not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("task must not be empty")
        return value

    @field_validator("code_fences")
    @classmethod
    def _fences_are_words(cls, value: list[str]) -> list[str]:
        for fence in value:
            if not fence or not all(c.isalnum() or c in "-_+" for c in fence):
                raise ValueError(f"invalid code fence language {fence!r}")
        return value

    @property
    def effective_sub_model(self) -> ModelSettings:
        return self.sub_model or self.root_model

    def tool_named(self, name: str) -> ToolSpec | None:
        return next((t for t in self.tools if t.name == name), None)

    @field_validator("tools")
    @classmethod
    def _distinct_tools(cls, value: list[ToolSpec]) -> list[ToolSpec]:
        names = [t.name for t in value]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names must be distinct: {names}")
        return value

    def model_named(self, name: str | None) -> ModelSettings | None:
        """The settings of a model REPL code names (None: the sub-model); None if unknown."""
        if name is None:
            return self.effective_sub_model
        for settings in (self.effective_sub_model, self.root_model, *self.other_models):
            if settings.model == name:
                return settings
        return None

    @property
    def known_models(self) -> list[str]:
        names = [self.effective_sub_model.model, self.root_model.model]
        names += [m.model for m in self.other_models]
        return list(dict.fromkeys(names))

    @property
    def spawns_children(self) -> bool:
        """Whether rlm_query here starts child episodes (else it is a plain llm_query)."""
        return self.depth + 1 < self.max_depth

    def uncosted_models(self) -> list[str]:
        """The models whose calls' cost is unknown: no price, and no cost in their replies.
        A cost limit needs none of them (at the start, and when a person sets one)."""
        models = (self.root_model, self.effective_sub_model, *self.other_models)
        return list(dict.fromkeys(m.model for m in models if m.price is None and not m.reports_cost))

    @model_validator(mode="after")
    def _cost_limit_priced(self) -> EpisodeRequest:
        if self.limits.max_cost_usd is None:
            return self
        unpriced = self.uncosted_models()
        if unpriced:
            raise ValueError(
                f"max_cost_usd needs a price for every model the episode can call; none for "
                f"{', '.join(dict.fromkeys(unpriced))} (add it to a price file: DRLM_PRICES_FILE)"
            )
        return self

    @model_validator(mode="after")
    def _depth_within_max(self) -> EpisodeRequest:
        if self.depth >= self.max_depth:
            raise ValueError(f"depth {self.depth} must be below max_depth {self.max_depth}")
        return self

    @field_validator("output_fields")
    @classmethod
    def _distinct_fields(cls, value: list[FieldSpec] | None) -> list[FieldSpec] | None:
        if value is not None:
            names = [f.name for f in value]
            if not names:
                raise ValueError("output_fields needs at least one field")
            if len(set(names)) != len(names):
                raise ValueError(f"output_fields names must be distinct: {names}")
        return value


# --- result -------------------------------------------------------------------------------

EndReason = Literal[
    "final",
    "final_var",
    "answer_ready",
    "max_iterations",
    "max_llm_calls",
    "max_duration",
    "context_overflow",
    "model_error",
    "policy",
    "submitted",
    "cancelled",
    "max_model_calls",
    "max_tokens",
    "max_cost_usd",
    "finish_requested",
    "infrastructure_error",
]

FailureCause = Literal["model", "request", "store", "sandbox", "infrastructure"]
"""What a failure that ended an episode was: the model's provider (down, overloaded, a bad
reply), the request (rejected by the provider: a wrong model name, a refused key), the
store, the sandbox, or the rest of the infrastructure (a worker, the server, our code)."""

FAILURE_ENDINGS = frozenset({"model_error", "infrastructure_error"})
"""Endings that are failures: without an answer, such an episode's status is "failed"."""

AnswerSource = Literal["model", "policy", "extraction", "none"]
"""Who gave the answer: the model (FINAL, FINAL_VAR, answer dict, SUBMIT), a termination
policy (answer_policy names it), fallback extraction (see confidence), or nobody."""


class TokenUsage(StrictModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float | None = Field(
        default=0.0, description="USD from the model's price; None once any call's price is unknown"
    )
    cost_source: Literal["provider", "price_table"] | None = Field(
        default=None,
        description="where a call's cost_usd comes from: the provider's reply (usage.cost) or the "
        "price table; None for a sum of calls or an unknown cost",
    )

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @classmethod
    def priced(cls, prompt_tokens: int, completion_tokens: int, price: ModelPrice | None) -> TokenUsage:
        """A call's usage and its cost: null for a model without a price, never a guess."""
        cost = None if price is None else price.cost(prompt_tokens, completion_tokens)
        source: Literal["price_table"] | None = None if price is None else "price_table"
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            cost_usd=cost,
            cost_source=source,
        )

    def with_reported_cost(self, reported: Any) -> TokenUsage:
        """The provider's own figure for this call (`usage.cost`, as OpenRouter and LiteLLM
        proxies return it) over the price table's; anything but a finite, non-negative
        number is no report."""
        if isinstance(reported, bool) or not isinstance(reported, (int, float)):
            return self
        if not 0 <= reported < float("inf"):  # also false for NaN
            return self
        return self.model_copy(
            update={"cost_usd": round(float(reported), COST_DIGITS), "cost_source": "provider"}
        )

    def add(self, other: TokenUsage) -> TokenUsage:
        mine, theirs = self.cost_usd, other.cost_usd
        return TokenUsage(
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            completion_tokens=self.completion_tokens + other.completion_tokens,
            cost_usd=round(mine + theirs, COST_DIGITS) if mine is not None and theirs is not None else None,
        )


class TerminationDecision(StrictModel):
    """Which policy ended the episode, at which step (iteration - 1), and why."""

    policy: str
    step: int
    reason: str
    answer: str | None
    action_type: str


class ChildEpisode(StrictModel):
    """A direct child of an episode (rlm_query) as its parent's result lists it."""

    episode_id: str
    depth: int
    cell_index: int
    call_index: int
    model: str
    ended_by: str = Field(description="the child's ended_by, or failed / cancelled / terminated")
    answer: str | None = Field(default=None, description="clipped to CHILD_ANSWER_CHARS")
    error: str | None = None
    model_calls: int = 0
    tokens: int = 0
    episodes: int = Field(default=1, description="episodes in the child's tree, itself included")


class EpisodeResult(StrictModel):
    episode_id: str = ""
    answer: str | None
    answer_source: AnswerSource = "none"
    answer_policy: str | None = None
    confidence: float | None = Field(
        default=None, description="of the answer: 1.0 for the model's own, computed for extracted"
    )
    stop_reason: str = ""
    ended_by: EndReason
    iterations: int
    model_calls: int
    sub_calls: int
    usage: TokenUsage
    model_time_s: float = 0.0
    error: str | None = None
    failure_cause: FailureCause | None = Field(
        default=None, description="when a failure ended the episode: what failed"
    )
    replay_divergences: int = 0
    termination: TerminationDecision | None = None
    cumulative_reward: float = 0.0
    execution: ExecutionResult | None = None
    compactions: int = 0
    lost_cells: int = 0
    tool_calls: int = 0
    depth: int = 0
    tree_episodes: int = Field(default=1, description="this episode and all its descendants")
    children: list[ChildEpisode] = Field(default_factory=list, description="direct children")
    unaccounted_tokens: int = Field(
        default=0, description="token shares charged for descendants whose spend is unknown"
    )
    unaccounted_cost_usd: float = Field(
        default=0.0, description="cost shares charged for descendants whose spend is unknown"
    )
    repl: ReplState | None = Field(
        default=None, description="a session turn's REPL at its end: where the next turn starts"
    )
    conversation: str | None = Field(
        default=None, description="a session turn's conversation head (its history_k is read from it)"
    )

    @property
    def status(self) -> EpisodeStatus:
        """How the episode ended, in the one vocabulary of endings (`ENDINGS`): the CLI, the
        API, the audit store, the page and the `DrlmStatus` search attribute all say this."""
        return ending_of_result(self.ended_by, self.answer, self.answer_source)


class EpisodeProgress(StrictModel):
    """Live state for `drlm run`'s progress lines (a query, so it costs no history)."""

    iteration: int
    phase: str
    model_calls: int
    sub_calls: int
    last_response: str = ""
    last_output: str = ""
    finished: bool = False
    phase_started: datetime | None = None
    # Set while a model call waits for a fixed key (the provider refused it): what failed
    # and what to do. The episode goes on after a `retry_credentials` update.
    paused: str | None = None
    # Since `drlm watch` draws budgets (a query's answer is not in history: no patch needed).
    tokens: int = 0
    cost_usd: float | None = 0.0
    limits: EpisodeLimits | None = None
    started_at: datetime | None = None
    root_model: str | None = None
    pending_cell: PendingCell | None = Field(default=None, description="a cell waiting for approval")
    held: str | None = Field(default=None, description="paused by a person: by whom and why")
    approve: ApproveMode = "none"
    actions: list[ActionRecord] = Field(default_factory=list, description="the latest steering actions")
    actions_total: int = 0


# --- model activities ---------------------------------------------------------------------


class Message(StrictModel):
    role: Literal["system", "user", "assistant"]
    content: str


class CallFacts(StrictModel):
    """What the audit store records of a model call beyond its text and usage; measured by
    the activity, so history holds it and a rebuilt audit store reads the same."""

    started_at: datetime | None = None
    prompt_digest: str | None = Field(default=None, description="sha256 of the messages sent")
    # What the provider said of its reply (telemetry's gen_ai.response.*); absent before.
    response_model: str | None = Field(default=None, description="the model that answered, as named")
    response_id: str | None = Field(default=None, description="the provider's id of the reply")
    finish_reasons: list[str] | None = Field(default=None, description="why the reply stopped")
    reply_cut_at: int | None = Field(
        default=None, description="the reply was longer than max_reply_chars: the characters kept"
    )


class PromptTemplate(StrictModel):
    """A user message as DSPy's adapter rendered it, cut where its changing values go: the
    text is parts[0] + the value of holes[0] + parts[1] + ... (`history`: the REPL history
    as DSPy formats it; `iteration`: "3/20")."""

    parts: list[str] = Field(min_length=1)
    holes: list[Literal["history", "iteration"]] = Field(default_factory=list)

    @model_validator(mode="after")
    def _one_part_around_each_hole(self) -> PromptTemplate:
        if len(self.parts) != len(self.holes) + 1:
            raise ValueError("a prompt template has one more part than holes")
        return self


class DspyPrompts(StrictModel):
    """A DSPy program's RLM (`durable_rlm.dspy.RLM`): what its model is sent, as DSPy's own
    adapter rendered it in the program's process (instructions, fields, the optimizer's
    demos), cut into what stays and what changes each iteration. The episode's model sees
    the prompts DSPy's RLM would send, and its replies are read as DSPy reads them
    (workflows/dspy_program.py)."""

    action: list[Message] = Field(min_length=1, description="the next action's system message and demos")
    action_user: PromptTemplate
    extract: list[Message] = Field(min_length=1, description="extraction's system message and demos")
    extract_user: PromptTemplate
    max_output_chars: int = Field(ge=0, description="each step's output in the history, head and tail")
    inputs: list[str] = Field(
        description="the input fields, bound in the REPL from the context's JSON object"
    )


class DspyTurn(StrictModel):
    """A root call of a DSPy program's episode: its conversation begins with `prefix`
    messages (system and demos) and the first user message; the user message sent is the
    template filled with the steps since, as DSPy's REPL history shows them."""

    prefix: int = Field(ge=1)
    user: PromptTemplate
    iteration: str
    max_output_chars: int = Field(ge=0)


class DspyExtraction(StrictModel):
    """The extraction of a DSPy program's episode, sent as DSPy's `extract` predictor is:
    its own system message and demos, then the history in its user message."""

    prefix: int = Field(ge=1, description="messages before the conversation's first user message")
    messages: list[Message] = Field(min_length=1)
    user: PromptTemplate
    max_output_chars: int = Field(ge=0)


class RootCompletionInput(StrictModel):
    """One root-model turn. The conversation is a hash chain in the blob store: history
    carries its head digest and only this turn's new messages, never the whole transcript."""

    episode_id: str
    iteration: int
    model: ModelSettings
    conversation: str | None
    append: list[Message]
    resent_message_chars: int = defaults.RESENT_MESSAGE_CHARS
    max_reply_chars: int = defaults.MAX_REPLY_CHARS
    dspy: DspyTurn | None = Field(default=None, description="a DSPy program's turn: sent as DSPy renders it")


class RootCompletion(CallFacts):
    text: str
    conversation: str
    usage: TokenUsage
    model_time_s: float
    mean_logprob: float | None = None
    sent_chars: int = 0


class CompactionInput(StrictModel):
    """Summarise the older turns of a conversation into one message (a step of its own)."""

    episode_id: str
    iteration: int
    model: ModelSettings
    conversation: str | None
    keep_messages: int = defaults.COMPACTION_KEEP_MESSAGES
    input_chars: int = defaults.COMPACTION_INPUT_CHARS
    reason: str = ""
    max_reply_chars: int = defaults.MAX_REPLY_CHARS
    history: bool = Field(
        default=False, description="return the turns summarised and the summary as rlms's `history` entries"
    )


class CompactionReply(CallFacts):
    conversation: str
    conversation_chars: int
    summary: str
    removed_messages: int
    kept_messages: int
    usage: TokenUsage
    model_time_s: float
    history: str | None = Field(
        default=None,
        description="JSON: rlms's `history` entries (each turn's messages, then the summary), when asked",
    )


class SubQueryInput(StrictModel):
    episode_id: str
    iteration: int
    cell_index: int
    call_index: int
    model: ModelSettings
    prompt: str
    max_reply_chars: int = defaults.MAX_REPLY_CHARS


class SubQueryReply(CallFacts):
    text: str
    usage: TokenUsage
    model_time_s: float


class ToolCallInput(StrictModel):
    episode_id: str
    iteration: int
    cell_index: int
    call_index: int
    tool: str
    arguments: str = Field(description='JSON: {"args": [...], "kwargs": {...}}')


class ToolReply(StrictModel):
    result: str = Field(
        description="the tool's return value as JSON, or pickled (names.TOOL_VALUE_PREFIX) when it "
        "is no JSON value: the sandbox loads it"
    )


# --- REPL activities ----------------------------------------------------------------------


class SandboxRef(StrictModel):
    """Which REPL state a step applies to: the cell log head names it exactly, so a worker
    whose live sandbox is at another head rebuilds instead of running on stale state."""

    episode_id: str
    context: ContextRef | None
    seed: int
    log_head: str | None
    cell_timeout_s: float
    output_truncation: int
    stored_output_chars: int = defaults.STORED_OUTPUT_CHARS
    child_batch_cap: int | None = Field(
        default=None, description="most prompts per rlm_query_batched when it starts children"
    )
    tools: list[ToolSpec] = Field(default_factory=list, description="custom tools, as REPL functions")
    rlms: bool = Field(default=False, description="the REPL behaves as rlms 0.1.3's (EpisodeRequest.rlms)")
    dspy_outputs: list[str] | None = Field(
        default=None,
        description="a DSPy program's REPL: the input fields bound from the context's JSON object "
        "(again before each cell), and SUBMIT taking these output fields, positionally too, and "
        "ending the cell",
    )
    snapshots: SnapshotPolicy | None = Field(default=None, description="None: no snapshots are taken")
    lineage: list[str] = Field(
        default_factory=list,
        description="other episodes whose snapshots this one may load (a fork loads its parent's)",
    )
    lineage_mac: str | None = Field(default=None, description="the lineage, signed by `drlm fork`")


class SnapshotRef(StrictModel):
    """A REPL snapshot as the workflow records it, with the cell it follows."""

    digest: str = Field(description="blob of the compressed, pickled namespace")
    cell: int = Field(description="the last cell whose effects it holds")
    size: int = Field(description="bytes stored")
    log_head: str = Field(description="the cell-log node that records it")
    unsaved: list[str] = Field(
        default_factory=list, description="names a rebuild re-creates by re-running cells"
    )


class RebuildReport(StrictModel):
    """How a worker that lacked the live REPL rebuilt it (observations and audit)."""

    from_snapshot: int | None = Field(default=None, description="cell the loaded snapshot follows")
    cells_rerun: int = 0
    seconds: float = 0.0
    notes: list[str] = Field(default_factory=list, description="what the model should know")


class ExecuteCellInput(StrictModel):
    sandbox: SandboxRef
    iteration: int
    cell_index: int
    code: str


class CallAnswer(StrictModel):
    call_index: int
    prompt_digest: str
    ok: bool
    text: str


class ResumeCellInput(StrictModel):
    sandbox: SandboxRef
    cell_index: int
    answers: list[CallAnswer]


class ReadVariableInput(StrictModel):
    sandbox: SandboxRef
    name: str


class CloseSandboxInput(StrictModel):
    episode_id: str


class SubCallRequest(StrictModel):
    call_index: int
    prompt: str
    prompt_digest: str
    kind: str = Field(default="llm_query", description="which REPL helper made the call")
    model: str | None = Field(default=None, description="the model the call names, if any")
    context: ContextRef | None = Field(
        default=None, description="rlm_query: the prompt, stored as the child's context"
    )


class StepEcho(StrictModel):
    """A local REPL step's input as its result repeats it: history records a local
    activity's result (a marker), not its input, and the audit trail needs the cell."""

    cell_index: int
    iteration: int | None = None  # set for the step that starts the cell
    code: str | None = None  # likewise


class CellOutcome(StrictModel):
    """Result of one REPL step: either the cell finished, or it is suspended at model calls
    the workflow must run before resuming it."""

    status: Literal["completed", "suspended"]
    log_head: str
    worker_queue: str
    requests: list[SubCallRequest] = Field(default_factory=list)
    stdout: str = ""
    stderr: str = ""
    error: str | None = None
    answer: str | None = None
    answer_kind: Literal["final", "final_var", "answer_ready"] | None = None
    cell_status: str | None = None
    rebuilt: bool = False
    divergences: list[str] = Field(default_factory=list)
    variables: dict[str, str] = Field(default_factory=dict, description="bounded summary")
    submitted: dict[str, Any] | None = None
    step: StepEcho | None = Field(
        default=None, description="which step this answers; set by local steps, whose input is not in history"
    )
    snapshot: SnapshotRef | None = Field(default=None, description="taken after this cell")
    snapshot_note: str | None = Field(default=None, description="why no snapshot was taken when one was due")
    rebuild: RebuildReport | None = None
    started_at: datetime | None = Field(default=None, description="when this step began (audit)")
    ended_at: datetime | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class VariableValue(StrictModel):
    found: bool
    value: str | None = None
    log_head: str
    worker_queue: str


# --- fallback extraction ---------------------------------------------------------------------


class ExtractionInput(StrictModel):
    """Chain heads, not transcripts: the activity rebuilds the history itself."""

    episode_id: str
    model: ModelSettings
    conversation: str | None
    log_head: str | None
    variables: dict[str, str]
    output_fields: list[FieldSpec]
    reason: FallbackReason
    max_history: int = defaults.EXTRACTION_HISTORY_ENTRIES
    max_reply_chars: int = defaults.MAX_REPLY_CHARS
    dspy: DspyExtraction | None = Field(default=None, description="a DSPy program's: sent as its `extract`")
    append: list[Message] = Field(
        default_factory=list, description="a DSPy program's last step, added to the conversation first"
    )


class ExtractionReply(CallFacts):
    text: str
    usage: TokenUsage
    model_time_s: float
    history: list[REPLHistoryEntry]
    prompt_chars: int
    error: str | None = None
    conversation: str | None = Field(
        default=None, description="a DSPy program's conversation with its last step (its trajectory)"
    )


# --- updates -----------------------------------------------------------------------------------


class RewardUpdate(StrictModel):
    """A reward from an evaluator or a person, sent to a running episode."""

    value: float
    note: str | None = Field(default=None, max_length=defaults.REWARD_NOTE_CHARS)

    @field_validator("value")
    @classmethod
    def _finite(cls, value: float) -> float:
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError("reward must be a finite number")
        return value


class RewardRecord(StrictModel):
    """A reward as the audit store records it: which iteration it came during."""

    number: int = Field(description="1 for the episode's first reward")
    iteration: int
    value: float
    note: str | None = None


class RewardReceipt(StrictModel):
    accepted: int
    pending: float
    cumulative: float


class CancelRequest(StrictModel):
    """Stop an episode and its descendants; with `extract`, first run fallback extraction."""

    extract: bool = False
    reason: str = Field(default="cancelled by request", max_length=defaults.REWARD_NOTE_CHARS)


class CancelReceipt(StrictModel):
    episode_id: str
    iteration: int
    extract: bool


class CredentialsReceipt(StrictModel):
    """What a `retry_credentials` update released: the model calls that waited for a key."""

    episode_id: str
    waiting_calls: int


# --- steering: a person supervising a running episode (workflows/steering.py) -----------------

ApproveMode = Literal["none", "risky", "all"]
"""Which cells wait for a person before they run: none, those the risk assessment flags, all."""


class SteeringUpdate(StrictModel):
    """What every steering action carries: who sent it (recorded in history and the audit)."""

    sender: str = Field(min_length=1, max_length=defaults.SENDER_CHARS)

    @field_validator("sender")
    @classmethod
    def _sender_named(cls, value: str) -> str:
        if not value.strip() or any(c in value for c in "\r\n\t"):
            raise ValueError("sender must be a name on one line")
        return value.strip()


class HintUpdate(SteeringUpdate):
    """Text the root model reads as a user message on its next turn."""

    text: str = Field(min_length=1, max_length=defaults.HINT_CHARS)

    @field_validator("text")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("a hint must not be blank")
        return value


class LimitsUpdate(SteeringUpdate):
    """New values for some limits; those left None keep theirs. Lowering one below what is
    spent ends the episode by the normal limit path (fallback extraction)."""

    max_iterations: int | None = None
    max_llm_calls: int | None = None
    max_duration: timedelta | None = Field(default=None, description="counted from submission")
    max_model_calls: int | None = None
    max_tokens: int | None = None
    max_cost_usd: float | None = None

    @model_validator(mode="after")
    def _within_the_limits_bounds(self) -> LimitsUpdate:
        """One truth: each new value is checked by EpisodeLimits' own field (its bounds,
        its validators), not by a second copy of them here."""
        changes = self.changes()
        if changes:
            EpisodeLimits.model_validate(changes)
        return self

    def changes(self) -> dict[str, Any]:
        return self.model_dump(exclude={"sender"}, exclude_none=True)


class PauseUpdate(SteeringUpdate):
    """Hold the episode at its next step boundary: no worker slot, no sandbox, until resumed."""

    hold_clock: bool = Field(
        default=False, description="stop max_duration counting while paused (it counts by default)"
    )
    reason: str = Field(default="", max_length=defaults.REWARD_NOTE_CHARS)


class ResumeUpdate(SteeringUpdate):
    pass


class FinishUpdate(SteeringUpdate):
    """Stop at the next step boundary and answer by fallback extraction over the history."""

    reason: str = Field(default="", max_length=defaults.REWARD_NOTE_CHARS)


class CellDecision(SteeringUpdate):
    """A person's decision on the cell that waits: approve it (as written, or `code` edited)
    or reject it with a reason the model reads."""

    cell: int = Field(ge=1, description="the waiting cell's number (a stale decision is refused)")
    approve: bool
    code: str | None = Field(default=None, max_length=defaults.EDITED_CELL_CHARS, description="edited")
    reason: str = Field(default="", max_length=defaults.REWARD_NOTE_CHARS)

    @model_validator(mode="after")
    def _consistent(self) -> CellDecision:
        if not self.approve and self.code is not None:
            raise ValueError("a rejected cell takes no edited code")
        if not self.approve and not self.reason.strip():
            raise ValueError("a rejection needs a reason (the model reads it)")
        if self.code is not None and not self.code.strip():
            raise ValueError("the edited code is empty")
        return self


class PendingCell(StrictModel):
    """A cell waiting for approval, as `drlm pending` lists it."""

    episode_id: str
    cell: int
    iteration: int
    code: str
    reasons: list[str] = Field(default_factory=list, description="why the risk assessment flagged it")
    mode: ApproveMode
    since: datetime

    @property
    def approval_id(self) -> str:
        return f"{self.episode_id}#{self.cell}"


class ActionRecord(StrictModel):
    """A steering action as the episode applied it: history holds the update itself, this
    the state it changed (carried over continue-as-new, audited when the episode ends)."""

    number: int = Field(description="1 for the episode's first action")
    kind: str = Field(description="hint, limits, pause, resume, finish, approve, edit, reject, gate")
    sender: str
    at: datetime
    iteration: int
    detail: str = ""


class SteeringReceipt(StrictModel):
    episode_id: str
    iteration: int
    action: int = Field(description="the action's number in the episode")
    message: str


# --- audit ------------------------------------------------------------------------------------


EpisodeStatus = Literal[
    "running", "answered", "extracted", "no_answer", "failed", "cancelled", "terminated", "timed_out"
]
ENDINGS: tuple[EpisodeStatus, ...] = (
    "answered",
    "extracted",
    "no_answer",
    "failed",
    "cancelled",
    "terminated",
    "timed_out",
)
"""How an episode ended, one word for each way, the same everywhere: the model (or a
policy) answered; a limit came first and the answer was extracted; it ended with no answer
(a limit, a policy, an extraction that found none); a failure ended it; a person cancelled
it; Temporal terminated it; it passed its execution timeout. Never "completed": Temporal's
own word for a workflow that returned, whatever it returned."""
LEGACY_COMPLETED = "completed"
"""The word rows and histories of earlier versions used for the first three endings."""


def ending_of_result(ended_by: str, answer: str | None, answer_source: str) -> EpisodeStatus:
    """The ending of an episode that returned a result (`EpisodeResult.status`)."""
    if ended_by == "cancelled":
        return "cancelled"
    if answer is None:
        return "failed" if ended_by in FAILURE_ENDINGS else "no_answer"
    return "extracted" if answer_source == "extraction" else "answered"


def ending_words(status: str) -> str:
    """An ending as a person reads it: `no answer`, `timed out`."""
    return status.replace("_", " ")


class AuditEvent(StrictModel):
    """Something the workflow decided or received that the audit store lists as an event."""

    key: str = Field(description="unique within the episode: a rewritten event replaces itself")
    kind: str
    iteration: int | None = None
    value: float | None = None
    detail: str | None = None
    sender: str | None = Field(default=None, description="who sent it (steering actions)")
    at: datetime | None = Field(default=None, description="when it took effect (steering actions)")


class AuditEpisodeInput(StrictModel):
    episode_id: str
    run_id: str
    task: str
    root_model: str
    status: EpisodeStatus
    result: EpisodeResult | None = None
    error: str | None = None
    # Since the call-granular audit store (all default, so older histories still decode):
    sub_model: str | None = None
    parent_id: str | None = None
    depth: int = 0
    limits: str | None = Field(default=None, description="the request's limits, JSON")
    started_at: datetime | None = Field(default=None, description="when the episode's first run started")
    ended_at: datetime | None = Field(default=None, description="set when it ends")
    events: list[AuditEvent] = Field(default_factory=list)
    forked_from: str | None = None
    forked_at: int | None = Field(default=None, description="the source's last inherited iteration")

    @model_validator(mode="before")
    @classmethod
    def _legacy_status(cls, data: Any) -> Any:
        """A row an earlier version wrote said "completed" for any result: read it as the
        ending its result had (audit-rebuild of old histories)."""
        if isinstance(data, dict) and data.get("status") == LEGACY_COMPLETED:
            result = data.get("result")
            if isinstance(result, EpisodeResult):
                ending = result.status
            elif isinstance(result, dict):
                source = str(result.get("answer_source", "none"))
                ending = ending_of_result(str(result.get("ended_by")), result.get("answer"), source)
            else:
                ending = "no_answer"
            data = {**data, "status": ending}
        return data

    @classmethod
    def of(
        cls,
        request: EpisodeRequest,
        *,
        episode_id: str,
        run_id: str,
        status: EpisodeStatus,
        started_at: datetime | None,
        ended_at: datetime | None,
        result: EpisodeResult | None = None,
        error: str | None = None,
        events: list[AuditEvent] | None = None,
    ) -> AuditEpisodeInput:
        """The episode's audit row from its request: the one function the workflow (live)
        and `durable_rlm/audit/projection.py` (rebuilt from history) both use, so the two rows
        cannot drift apart."""
        return cls(
            episode_id=episode_id,
            run_id=run_id,
            task=request.task,
            root_model=request.root_model.model,
            status=status,
            result=result,
            error=error,
            sub_model=request.effective_sub_model.model,
            parent_id=request.parent.episode_id if request.parent else None,
            forked_from=request.fork.source_id if request.fork else None,
            forked_at=request.fork.iteration if request.fork else None,
            depth=request.depth,
            limits=request.limits.model_dump_json(exclude_none=True),
            started_at=started_at,
            ended_at=ended_at,
            events=events or [],
        )


# --- workflow state ----------------------------------------------------------------------------


class EpisodeCarry(StrictModel):
    """Everything the loop knows, small by construction (heads of chains, counters), so it
    survives continue-as-new and keeps each new run's first event small."""

    seed: int
    deadline: datetime
    iteration: int = 0
    cell_count: int = 0
    conversation: str | None = None
    pending: list[Message] = Field(default_factory=list)
    log_head: str | None = None
    snapshot: SnapshotRef | None = Field(
        default=None, description="the latest REPL snapshot: a rebuild re-runs only the cells after it"
    )
    repl_queue: str | None = None
    model_calls: int = 0
    sub_calls: int = 0
    usage: TokenUsage = Field(default_factory=TokenUsage)
    model_time_s: float = 0.0
    divergences: int = 0
    policy_state: dict[str, Any] = Field(default_factory=dict)
    variables: dict[str, str] = Field(default_factory=dict)
    reward_inbox: float = 0.0
    cumulative_reward: float = 0.0
    rewards_received: int = 0
    last_prompt_tokens: int = 0
    last_reply_tokens: int = 0
    compactions: int = 0
    lost_cells: int = 0
    tool_calls: int = 0
    children: list[ChildEpisode] = Field(default_factory=list)
    tree_episodes: int = 1
    unaccounted_tokens: int = Field(
        default=0, description="token shares of children that ended without telling their spend"
    )
    unaccounted_cost_usd: float = Field(
        default=0.0, description="cost shares of children that ended without telling their spend"
    )
    rewards: list[RewardRecord] = Field(
        default_factory=list, description="the latest rewards received (for the audit's events)"
    )
    actions: list[ActionRecord] = Field(
        default_factory=list, description="the latest steering actions applied (for the audit's events)"
    )
    actions_total: int = 0
    hints: list[Message] = Field(default_factory=list, description="hints the model has not read yet")

    def charge(self, usage: TokenUsage, model_time_s: float, calls: int = 1) -> None:
        """Count a model call the episode made, with its tokens and time."""
        self.model_calls += calls
        self.usage = self.usage.add(usage)
        self.model_time_s += model_time_s

    def charge_child(self, child: ChildEpisode, usage: TokenUsage, model_time_s: float) -> None:
        """What a child spent counts against this episode: its calls are calls from the REPL."""
        self.children.append(child)
        self.model_calls += child.model_calls
        self.sub_calls += child.model_calls
        self.tree_episodes += child.episodes
        self.charge(usage, model_time_s, calls=0)


class ReplState(StrictModel):
    """A REPL as the cell log names it: what a session's next turn starts from. The log's
    head is the state; the snapshot lets a rebuild skip the cells before it."""

    log_head: str | None = None
    cell_count: int = Field(default=0, ge=0)
    snapshot: SnapshotRef | None = None
    variables: dict[str, str] = Field(default_factory=dict)


class SessionTurn(StrictModel):
    """What makes an episode a session's turn: the REPL it shares and where that REPL is."""

    session_id: str = Field(min_length=1, description="the sandbox's name: each turn's REPL is the session's")
    turn: int = Field(ge=0)
    repl: ReplState = Field(default_factory=ReplState)


EpisodeRequest.model_rebuild()
EpisodeResult.model_rebuild()
EpisodeProgress.model_rebuild()
