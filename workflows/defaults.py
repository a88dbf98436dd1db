"""Every default number of an episode, defined once, each with its reason.

Models, the CLI, the workflow and the activities read these; nothing else repeats them.
(The sandbox child is standard-library only and cannot import this: the host passes it the
values it needs in its init message.)
"""

from __future__ import annotations

from datetime import timedelta

# --- episode limits ------------------------------------------------------------------------

MAX_ITERATIONS = 20
"""The fallback trigger's specified default: enough turns for look, chunk, query, combine."""

MAX_LLM_CALLS = 50
"""The fallback trigger's specified default for sub-calls made from the REPL."""

MAX_DURATION = timedelta(hours=1)
"""An episode's wall-clock budget, counted from submission. The bare fallback trigger's
specified default is 5 minutes, but a production RLM run with a few dozen sub-calls
routinely takes longer; episodes always pass their own limit, so SEED_TRIGGER_MAX_DURATION
is only `FallbackTrigger()`'s default
(docs/architecture/decisions.md#behaviour-kept-from-the-specifications)."""

SEED_TRIGGER_MAX_DURATION = timedelta(seconds=300)
"""The specified `FallbackTrigger::default()`; kept for that API, not used by episodes."""

CELL_TIMEOUT_S = 60.0
"""One REPL cell's compute time (model calls excluded): long enough for real pandas-free
text processing of a large context, short enough that a runaway loop costs a minute."""

OUTPUT_TRUNCATION = 20_000
"""Characters of a cell's output the model sees (rlms truncates at a similar size)."""

STORED_OUTPUT_CHARS = 1_000_000
"""Characters of a cell's output kept for the record (history, cell log, extraction). The
sandbox counts and drops the rest as it is printed, so a runaway print cannot fill memory."""

MAX_PARALLEL_SUBCALLS = 16
"""Sub-calls of one llm_query_batched in flight at once: providers rate-limit bursts."""

MAX_PARALLEL_SUBCALLS_CEILING = 500
"""Below Temporal's 2,000 pending activities per execution, with room for the rest."""

MAX_PROMPTS_PER_CALL = 1_000
"""Prompts one `llm_query_batched` (or any REPL call) may carry: each is an activity and
three or more history events, and a history ends at 51,200. The sandbox refuses a longer
list with an error in the cell (split it); a frame that carries more is a protocol error."""

MAX_CALL_BYTES = 32 * 1024 * 1024
"""Bytes of one REPL call's frame (its prompts as JSON): what the sandbox may hand the worker
at once. Refused in the cell past it (a model reads far less; a child context that big
belongs in the episode's own context). Below SANDBOX_IN_FLIGHT_BYTES, so it fits."""

MAX_CELLS_PER_REPLY = 16
"""Code blocks run from one reply. A reply with thousands of blocks is not a plan, and each
block is a REPL step in history."""

# --- models --------------------------------------------------------------------------------

MAX_REPLY_CHARS = 1_000_000
"""Characters of one model reply the worker reads; a longer reply is cut there and says so
(activities/reply_limits.py). No provider's largest output (128k tokens, ~500k characters)
comes near it: past it is a model repeating itself until its max_tokens, or an endpoint that
is broken or hostile. Everything after the call (the workflow task that parses the reply,
history, the conversation) then handles a bounded text."""

MAX_REPLY_CHARS_CEILING = 4_000_000
"""The largest max_reply_chars an episode may set: a reply this long is parsed, recorded and
acted on in one workflow task well within Temporal's ~2 s (tests/test_reply_limits.py)."""

REQUEST_TIMEOUT_S = 120.0
"""One model request. Long replies from large models take a minute or more."""

MODEL_ATTEMPTS = 6
"""Temporal attempts per model call; with the back-off below that covers ~2 minutes of a
provider's 429/5xx before the call is given up."""

MODEL_RETRY_INITIAL = timedelta(seconds=1)
MODEL_RETRY_BACKOFF = 2.0
MODEL_RETRY_MAX_INTERVAL = timedelta(seconds=60)
"""Exponential back-off between model attempts; a provider's retry-after overrides it."""

ACTIVITY_SLACK_S = 30.0
"""Added to a request or cell timeout for an activity's start-to-close: the activity also
reads and writes the blob store around the call."""

REPLY_TOKENS_RESERVED = 4_096
"""Tokens kept free for the reply when the model's max_tokens is not set (compaction)."""

CHARS_PER_TOKEN = 4
"""Rough size of a token in English text; used only to estimate new messages' tokens. The
provider's own prompt_tokens count of the previous call is used wherever there is one."""

# --- conversation --------------------------------------------------------------------------

COMPACT_AT_SHARE = 0.8
"""Compact when the next request plus its reserved reply would pass this share of the
context window (rlms's default share); the rest is headroom for estimation error."""

COMPACTION_KEEP_MESSAGES = 2
"""Most recent messages kept verbatim by a compaction: the observation before the model's
latest reply, and that reply; the newest observation follows them. After the model has
said a request is too long, a compaction keeps none."""

COMPACTION_INPUT_CHARS = 200_000
"""Characters of earlier turns given to the summariser; the middle of longer ones is cut."""

RESENT_MESSAGE_CHARS = 20_000
"""An earlier reply or observation longer than this is shortened in what is resent (head
and tail kept); the stored conversation keeps it whole."""

# --- durability ----------------------------------------------------------------------------

HEARTBEAT_TIMEOUT_S = 10.0
"""A worker that stops heartbeating for this long is presumed dead and the step retried, when
no worker on its machine can tell (the liveness signal, durable_rlm/worker/liveness.py, tells
in ~3 s on one machine). With 200 episodes on one saturated worker (bench/concurrency.py), 3 s
presumed 86 live model calls dead, 5 s none; at 1,000 every heartbeat the server records is a
write to its one SQLite file, and 5 s with a beat each second had ~1,300 heartbeat timeouts
and 2,098 tasks past their timeout, where 10 s with a beat every 2.5 s had 376 and 570
(BENCHMARKS.md, "Overload on 2026-11-29")."""

STICKY_SCHEDULE_TO_START_S = 5.0
"""How long a REPL step waits for the worker that holds its sandbox before another worker
rebuilds the sandbox from the log."""

WORKFLOW_TASK_TIMEOUT_S = 10.0
"""A local REPL step runs inside a workflow task: a worker lost during it is noticed when the
task times out (the SDK extends the task every 80% of this while a step runs longer). 5 s
gave 17 task timeouts with 200 episodes on one CPU-bound worker; Temporal's 10 s, none."""

HEARTBEAT_EVERY_S = 1.0
"""The shortest heartbeat period of long activities (the worker's SDK throttle is the same)."""

BEATS_PER_HEARTBEAT_TIMEOUT = 4
"""A long activity beats this many times per heartbeat timeout (`beat_every_s` in
activities/attempts.py): every 2.5 s against the default 10 s, so a beat may be 7.5 s late
before a live call is presumed dead; never more often than HEARTBEAT_EVERY_S (a test's 3 s
timeout keeps a beat a second). Fewer beats are fewer writes for the server, which records each."""

REPL_ATTEMPTS_STICKY = 2
REPL_ATTEMPTS_SHARED = 3
"""A REPL step gets two tries on its worker, then three on any worker (rebuilding); after
that the cell is recorded as lost and the episode goes on without it."""

LOCAL_RETRY_THRESHOLD_S = 10.0
"""A local model step whose next retry is further away than this waits on a durable timer
(the SDK schedules the retry from a new workflow task) instead of in the worker's memory."""

REPL_ATTEMPTS_LOCAL = 3
"""A REPL step run as a local activity (on the worker that runs the episode's workflow task)
gets three tries, counted across workers by a ledger in the blob store; after that the cell
is recorded as lost."""

REPL_SLACK_S = 120.0
"""Added to the cell timeout for a REPL step: a rebuild replays earlier cells first."""

SNAPSHOT_AFTER_S = 1.0
"""A REPL snapshot is taken once the cells since the last one have run this long in all:
a rebuild then re-runs at most about this much cell time. A small namespace snapshots in
~5 ms, so a second of cells pays it back 200 times (bench/snapshots.py)."""

SNAPSHOT_EVERY_CELLS = 20
"""...and at least every this many cells, so a log of quick cells is never replayed whole."""

REPLAY_CELL_COST_S = 0.0007
"""What re-running one logged cell costs a rebuild besides the cell's own time (reading it
from the log, the exchange with the sandbox): 1,000 trivial cells took ~0.69 s."""

SNAPSHOT_TIMEOUT_S = 60.0
"""How long the sandbox may take to write (or load) a snapshot; then it is abandoned and the
sandbox discarded (the cell log is intact: the next step rebuilds from it)."""

SNAPSHOT_FILES_MB = 64
"""Files the cells wrote in their directory travel in the snapshot up to this total; past
it no snapshot is taken (a rebuild re-runs the cells, which re-create the files)."""

AUDIT_ATTEMPTS = 5
"""The audit store is a projection: a few retries, then history alone is the record."""

AUDIT_CLOSE_S = 10.0
"""Longest one attempt at an ending episode's audit row may take (a worker killed mid-write
is replaced by another attempt after this)."""

AUDIT_CLOSE_PATIENCE_S = 20.0
"""Longest an ending episode keeps trying to write its closing audit row (short attempts,
backing off): a store restarting or locked for a moment still gets the row from the
episode itself; a store down for longer delays the episode's end by this much only, and the
reconciler (every worker runs it at start and each minute) writes the row from history once
the store is back. The audit store is a projection: it never holds an answer back long."""

CLOSE_SANDBOX_TIMEOUT_S = 10.0
"""Waiting for the worker that holds the sandbox at the end; idle reaping covers the rest."""

# --- sandbox -------------------------------------------------------------------------------

SANDBOX_MEMORY_MB = 4_096
SANDBOX_FILE_MB = 256
"""Address space and largest file of a sandbox: room for a large context and its copies."""

SANDBOX_FILES_MB = 1_024
"""A sandbox's own directory, a tmpfs of this size in its mount namespace: what its cells
write is bounded there (a cell once wrote 1 GB to the host's /tmp in 3 s), and its pages
count against the sandbox's memory (SANDBOX_MEMORY_MB), never the host's disk."""

SNAPSHOT_EPISODE_MB = 1_024
"""Snapshot bytes one episode keeps in the store: its newest snapshots that fit, the older
ones deleted as newer ones need the room (a cell making 240 MB of variables once added 240
MB to the store each time, 720 MB in 20 s). The newest two are always kept (a step retried
after a crash restarts from the one before the newest), so one snapshot larger than what
the one before it leaves of this is not taken: a rebuild re-runs the cells after the last."""

SANDBOX_CPU_S = 3_600
SANDBOX_PROCESSES = 64
"""CPU seconds over a sandbox's whole life (RLIMIT_CPU: a thread left spinning after its cell
is stopped; the REPL is then rebuilt from the log), and processes and threads of its own uid
(RLIMIT_NPROC: a fork bomb stops there)."""

SANDBOX_IDLE_S = 1_800.0
"""A sandbox unused this long is killed; the next step rebuilds it from the log."""

SANDBOX_STARTUP_S = 30.0
"""A sandbox that is not ready in this time failed to start."""

SANDBOX_SLOT_MB = 64
MIN_SANDBOXES = 4
"""The default limit of live sandboxes per worker (DRLM_MAX_SANDBOXES): three quarters of
its memory at this much each. A sandbox forked from the template holds ~3 MB of its own; the
rest is room for its context and variables."""

SANDBOX_SLOT_WAIT_S = 60.0
"""A step waits this long for one of the worker's sandboxes (all running steps) before its
attempt fails as busy and is retried: half the slack a step has beyond its cell's timeout."""

SANDBOX_BUSY_PAUSE_S = 1.0
"""After a step's wait for a sandbox ran out, the workflow asks again this much later."""

STORE_WAIT_FIRST_S = 2.0
STORE_WAIT_MAX_S = 30.0
"""A step the store failed (names.STORE_UNAVAILABLE) is asked again after a durable timer:
2 s, doubling to at most 30 s, for as long as the episode's deadline allows."""

WORKFLOW_TASK_SLOTS = 100
"""Workflow tasks one worker runs at once (the SDK's own default)."""

HARD_KILL_GRACE_S = 5.0
"""After a cell's timeout, how long its interrupt has before the process is killed."""

# The largest frame on a sandbox's channel is the frame format's own (MAX_FRAME_BYTES in
# activities/sandbox/framing.py): the sandbox, which cannot import this module, reads by it too.

SANDBOX_FIELD_CHARS = 1_000_000
"""Longest error, answer, stderr or stdout a worker takes from a sandbox (the sandbox cuts
its own; the worker cuts again in case the sandbox's code was changed by a cell)."""

SANDBOX_IN_FLIGHT_BYTES = 64 * 1024 * 1024
"""Bytes of frames from one sandbox the worker holds at once, read but not yet taken (the
frame being read included), whatever their number; also the largest frame. Past it the
worker stops reading and the sandbox blocks on its pipe: N hostile sandboxes cost at most
N x this, not what they write."""

SANDBOX_FRAME_VALUES = 400_000
SANDBOX_FRAME_DEPTH = 100
"""Values (containers, keys, scalars) and nesting of one frame from a sandbox, counted on its
bytes before any object is built (activities/sandbox/values.py): bytes alone do not bound
what JSON builds (a 60 MB frame of `[{},{},...]` is 20 million objects, 3.2 GB); this many
are ~30 MB at most. An honest frame's largest part is a SUBMIT of at most
SANDBOX_FIELD_CHARS as the sandbox writes it (", " between values): ~333,000 values."""

SNAPSHOT_MAX_MB = 512
"""Largest REPL snapshot the worker reads from a sandbox (compressed). A namespace past it is
not snapshotted: a rebuild re-runs its cells instead of the worker holding that much."""

SANDBOX_SEND_TIMEOUT_S = 30.0
"""A sandbox that reads none of a frame the worker sends for this long is broken."""

VARIABLES_SHOWN = 50
VARIABLE_CHARS = 200
"""The bounded summary of REPL variables that policies and extraction see."""

# --- what the model and people see ---------------------------------------------------------

CODE_SHOWN_CHARS = 2_000
"""Code echoed back in an observation: the model wrote it, it needs only a reminder."""

PROGRESS_TEXT_CHARS = 2_000
"""Last response and output kept for the `progress` query."""

POLICY_TEXT_CHARS = 4_000
"""Text a termination policy's regexes may scan (opt-in printed output): user patterns run
inside the workflow task, so their input is bounded."""

EXTRACTION_HISTORY_ENTRIES = 50
EXTRACTION_OUTPUT_CHARS = 4_000
"""The specified extraction prompt: the last cells, each output shortened
(docs/behaviour/fallback-extraction.md, "The prompt")."""

REWARD_NOTE_CHARS = 2_000


MAX_DEPTH = 1
"""rlms's meaning: the root is depth 0, and a call whose child would be at depth >= max_depth
is a plain llm_query. 1 means no recursion unless the user asks for it."""

MAX_DEPTH_CEILING = 8

MAX_CHILDREN_PER_BATCH = 8
"""Children of one rlm_query_batched call all run in parallel; a larger batch is an error."""

MAX_CHILDREN_PER_BATCH_CEILING = 64

CHILD_ANSWER_CHARS = 500
"""How much of a child's answer its parent keeps in the result's list of children."""

TOOL_TIMEOUT_S = 60.0
"""A custom tool's time per attempt, unless it declares its own at registration."""

TOOL_ATTEMPTS = 3

TOOL_THREADS = 16
"""Threads of a worker's pool for sync tools (async tools need none)."""

MAX_TOOL_CALLS = 1_000
"""Tool calls per episode: each adds ~9 history events, and Temporal ends a history at 51,200."""

CHILD_DEADLINE_SLACK_S = 60.0
"""A child's deadline is its parent's minus a tenth of the time left, at most this: time for
the child's own fallback extraction before the parent's timer fires."""

ANTHROPIC_MAX_TOKENS = 4_096
"""The Messages API requires max_tokens; this is sent when the model settings give none."""


# --- worker capacity -------------------------------------------------------------------------

WORKER_CAPACITY = 500
"""Live episodes one worker serves. Its workflow cache holds that many: an episode evicted
from the cache replays its whole history on its next step (~0.5 s per iteration) and, its
REPL steps being local, rebuilds its sandbox on whichever worker picks it up."""

STICKY_TIMEOUT_S = 10.0
"""How long a workflow task of an episode a worker holds waits for that worker (its sticky
queue) before the server gives it to the shared queue. It was 1 s, to move a dead worker's
episodes fast; on a busy worker, hundreds of tasks a minute then left for the shared queue,
where they waited minutes behind new episodes its admission held back (median 84 s, up to
13 minutes at N=1,000; BENCHMARKS.md). A dead worker on the machine has its episodes given
back at once by the liveness signal (durable_rlm/worker/liveness.py); one on another
machine moves them after this, as its calls wait for their heartbeat timeout (also 10 s)."""

ACTIVITY_SLOTS = 512
"""Model calls and tool calls in flight on one worker. A model call is async: waiting on the
provider holds a slot, not a thread."""

AUDITED_REWARDS = 200
"""Rewards an episode keeps for the audit store's events (the latest; history has them all)."""

REPLY_TOKENS_ESTIMATE = 1_000
"""A root reply's size before the model has replied once (the model's max_tokens unset):
what a token or cost budget expects the next call and an extraction to need."""

DRAIN_GRACE_S = 25.0
"""How long a stopping `python worker.py` (SIGTERM) lets the model calls and REPL steps in
flight finish. Past it a call is cancelled (it fails, and is paid again on another worker)
and a REPL step still running is left to be re-run elsewhere from the cell log. Under
Kubernetes' default 30 s from SIGTERM to SIGKILL, with time left to close the sandboxes
(docker compose's default is 10 s: give workers `stop_grace_period: 30s`)."""

# Steering (workflows/steering.py): what a person may send a running episode.
SENDER_CHARS = 200
HINT_CHARS = 20_000
EDITED_CELL_CHARS = 200_000
AUDITED_ACTIONS = 500  # the latest actions the carried state and the closing audit keep
PROGRESS_ACTIONS = 10  # the latest actions a progress query (drlm watch) shows
