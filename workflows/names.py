"""Stable names of the workflow and its activities. Never rename one once deployed: running
histories refer to these strings."""

WORKFLOW = "RlmEpisode"

ROOT_COMPLETION = "drlm.root_completion"
SUB_QUERY = "drlm.sub_query"
REPL_EXECUTE = "drlm.repl_execute"
REPL_RESUME = "drlm.repl_resume"
REPL_READ_VARIABLE = "drlm.repl_read_variable"
REPL_CLOSE = "drlm.repl_close"
AUDIT_EPISODE = "drlm.audit_episode"
RUN_TOOL = "drlm.run_tool"
EXTRACT_FALLBACK = "drlm.extract_fallback"
COMPACT_CONVERSATION = "drlm.compact_conversation"

# Call kinds from the REPL whose calls start child episodes (rlm_query); the rest are model calls.
CHILD_KINDS = frozenset({"rlm_query", "rlm_query_batched"})

# Names the REPL defines itself: no custom tool may take one.
REPL_RESERVED = frozenset(
    {
        "context",
        "answer",
        "llm_query",
        "llm_query_batched",
        "rlm_query",
        "rlm_query_batched",
        "SHOW_VARS",
        "SUBMIT",
        "FINAL",
        "FINAL_VAR",
        "ToolError",
        "print",
    }
)

# A custom tool's calls have the kind "tool:<name>".
TOOL_KIND_PREFIX = "tool:"

# Error types the workflow and the retry policies key on.
MODEL_REQUEST_REJECTED = "ModelRequestRejected"
MODEL_UNAVAILABLE = "ModelUnavailable"
SANDBOX_FAILURE = "SandboxFailure"
SANDBOXES_BUSY = "SandboxesBusy"  # every sandbox of the worker ran a step for the whole wait
INVALID_REQUEST = "InvalidEpisodeRequest"
POLICY_FAILURE = "TerminationPolicyFailure"
MODEL_CONTEXT_OVERFLOW = "ModelContextOverflow"
MODEL_AUTH_FAILED = "ModelAuthFailed"  # 401/403 or no key: not retried; the episode waits for a fix
MODEL_BAD_REPLY = "ModelBadReply"  # HTTP 200 that is not a completion (not JSON, no choices): retried
TOOL_NOT_REGISTERED = "ToolNotRegistered"
TOOL_BAD_CALL = "ToolBadCall"  # arguments that do not fit, a result that is not JSON
TOOL_FAILED = "ToolFailed"  # the tool raised: retried per its declaration
TOOL_VALUE_PREFIX = "pickle:"
"""A tool's result or exception that is no JSON value travels to the sandbox pickled, as
`pickle:<base64>\n<what it shows>`; JSON text never starts so. Only the sandbox loads it."""
STORE_UNAVAILABLE = "StoreUnavailable"  # the audit or blob store failed a step: waited out
STALE_ATTEMPT = "StaleAttempt"  # a paused worker's attempt the server gave up: it pays nothing
WORKER_LOST = "WorkerLost"  # the attempt's worker died (durable_rlm/worker/liveness.py): retried at once
REPL_STEP_ABANDONED = "ReplStepAbandoned"  # a local REPL step started too often without finishing

# workflow.patched() ids, each for a change made after a release that alters the commands of
# histories the release wrote: id -> the release it follows. Before the first release the
# code changes freely (the recorded histories are made again); docs: "Versioning".
RELEASED_PATCHES: dict[str, str] = {}

# The update a client sends once the worker has a fixed key: paused model calls try again.
RETRY_CREDENTIALS = "retry_credentials"

# A person steering a running episode (workflows/steering.py): each a validated update.
HINT = "hint"
SET_LIMITS = "set_limits"
PAUSE = "pause"
RESUME = "resume"
FINISH_NOW = "finish_now"
DECIDE_CELL = "decide_cell"  # approve (as written or edited) or reject the cell that waits

# A persistent session (workflows/session.py): one workflow over many turns, each turn an
# episode (`<session>-turn<k>`) that starts from the REPL the last one left.
SESSION_WORKFLOW = "RlmSession"
SESSION_TURN = "turn"  # update: run one turn to its answer
SESSION_CLOSE = "close"  # update: end the session once no turn runs
SESSION_STATE = "session"  # query: the session's turns and REPL


def turn_episode_id(session_id: str, turn: int) -> str:
    """The id of a session's turn `turn` (0-based): the CLI finds a session's turns by it."""
    return f"{session_id}-turn{turn}"


# Retention (durable_rlm/audit/gc.py): a Temporal Schedule starts GC_WORKFLOW, which runs one
# COLLECT_GARBAGE activity on any worker.
GC_WORKFLOW = "DrlmBlobRetention"
COLLECT_GARBAGE = "drlm.collect_garbage"
GC_SCHEDULE_ID = "drlm-blob-retention"

# --- the episode list's search attributes --------------------------------------------------

SEARCH_ATTRIBUTES: tuple[tuple[str, str], ...] = (
    ("DrlmTask", "Text"),
    ("DrlmModel", "Keyword"),
    ("DrlmStatus", "Keyword"),
    ("DrlmEndedBy", "Keyword"),
    ("DrlmAnswerSource", "Keyword"),
    ("DrlmIterations", "Int"),
    ("DrlmTokens", "Int"),
)
"""(name, type) of each search attribute (workflows/metadata.py `KEYS`, which must match: it
checks as it is imported), as `temporal server start-dev --search-attribute NAME=TYPE` takes
them. Here, without temporalio, because the shared server's supervisor names them before it
starts the server, and importing the SDK first (~0.2 s) would delay that start. SQL
visibility (the dev server; SQLite, MySQL and PostgreSQL clusters) holds 3 Int, 3 Text and
10 Keyword custom attributes per namespace (the dev server refuses a fourth Int at start):
these take 2, 1 and 4, and leave room for the operator's own."""
