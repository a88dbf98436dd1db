"""The sandbox process: runs model-written code for one episode.

Started by the worker as `python -s -P child.py PARENT_PID DIR`, or forked from a template
process (forkserver.py) that has already imported this module; both then run `serve`.
Standard library only, so nothing of the worker (settings, credentials, clients) is
importable here. It talks to its host over length-prefixed JSON frames on the original
stdin/stdout; file descriptors 0 and 1 are then pointed at /dev/null so stray writes from
cells cannot corrupt the channel.

Isolation, strongest first: a network namespace with no interfaces (when permitted), an
unprivileged uid when started as root, resource limits, and an audit hook that refuses
sockets, processes, signals to other processes, ctypes, and file access outside the
sandbox directory (reads of the Python installation excepted).
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import io
import json
import os
import signal
import struct
import sys
import traceback
from typing import Any, BinaryIO, NoReturn

HEADER = struct.Struct(">I")
MAX_FRAME = 256 * 1024 * 1024


def encode_frame(message: dict[str, Any]) -> bytes:
    # A lone surrogate (a cell printed "\udcff") has no UTF-8: it is sent as "?", not fatal.
    body = json.dumps(message, ensure_ascii=False).encode("utf-8", errors="replace")
    return HEADER.pack(len(body)) + body


def decode_body(body: bytes) -> dict[str, Any]:
    message = json.loads(body.decode("utf-8"))
    if not isinstance(message, dict) or "op" not in message:
        raise ValueError("malformed sandbox frame")
    return message


_SEQ: list[Any] = [None]
"""The sequence number of the host's last request: every frame sent carries it, so the host
knows a frame answers what it asked now, not an earlier request (a frame left in the pipe
by a process a cell forked, say)."""


def read_frame(stream: BinaryIO) -> dict[str, Any] | None:
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (length,) = HEADER.unpack(header)
    if length > MAX_FRAME:
        raise ValueError(f"sandbox frame too large: {length} bytes")
    body = stream.read(length)
    if len(body) < length:
        return None
    message = decode_body(body)
    _SEQ[0] = message.get("seq")
    return message


def write_frame(stream: BinaryIO, message: dict[str, Any]) -> None:
    if _SEQ[0] is not None:
        message = {**message, "seq": _SEQ[0]}
    stream.write(encode_frame(message))
    stream.flush()


# --- isolation ------------------------------------------------------------------------------

NOBODY = 65534
_BLOCKED_PREFIXES = (
    "socket.",
    "subprocess.",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.fork",
    "os.forkpty",
    "os.kill",
    "os.killpg",
    "signal.pthread_kill",
    "ctypes.",
    "os.symlink",
    "os.link",
    "pty.",
    "_posixsubprocess.",
    "sys.remote_exec",
)
_PATH_WRITE_EVENTS = {
    "os.remove",
    "os.rename",
    "os.replace",
    "os.mkdir",
    "os.rmdir",
    "os.chmod",
    "os.chown",
    "os.truncate",
    "os.utime",
    "os.chdir",
    "shutil.rmtree",
    "shutil.copyfile",
    "shutil.move",
}
_PATH_READ_EVENTS = {"os.listdir", "os.scandir", "glob.glob"}


_LIBC: Any = None


def _libc() -> Any:
    """libc through ctypes, loaded once per process: a fork-server template loads it before
    forking, so its sandboxes skip the load (`start_layers` drops the handle when done)."""
    global _LIBC
    if _LIBC is None:
        import ctypes

        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def _forget_libc() -> None:
    global _LIBC
    _LIBC = None


class LayerError(RuntimeError):
    """A sandbox layer that must hold could not be put in place: the sandbox does not start."""


# Imported before the uid drop: the interpreter may live where `nobody` cannot read
# (a pyenv under /root), and model code reaches for these most.
PRELOADED = (
    "random re json math cmath collections collections.abc itertools functools operator "
    "statistics string textwrap datetime heapq bisect decimal fractions typing dataclasses "
    "csv io hashlib base64 difflib unicodedata copy pprint time enum zlib struct array "
    "calendar numbers html html.parser urllib.parse uuid codecs locale fnmatch glob shlex "
    "contextlib abc keyword tokenize warnings gzip bz2 lzma zipfile tarfile pathlib socket subprocess "
    "encodings.idna inspect"
).split()


def preload_modules() -> None:
    import importlib

    for name in PRELOADED:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    try:
        snapshots()
    except ImportError:
        pass  # no cloudpickle here: the host is told when it asks for a snapshot


_SIBLINGS: dict[str, Any] = {}


def _sibling(filename: str) -> Any:
    """A module of activities/sandbox/, loaded once by its path: under -P no directory of
    ours is on sys.path."""
    module = _SIBLINGS.get(filename)
    if module is None:
        import importlib.util

        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), filename)
        name = "drlm_sandbox_" + filename.removesuffix(".py")
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
        _SIBLINGS[filename] = module
    return module


def snapshots() -> Any:
    """activities/sandbox/snapshot.py: pickling the namespace, and loading it back."""
    return _sibling("snapshot.py")


# --- volatile cells ---------------------------------------------------------------------------

_VOLATILE = [False]  # set when the running cell reads the clock or OS randomness
_WALL = __import__("time").perf_counter  # the host's own timing, never flagged
_CLOCK_READS = (
    ("time", ("time", "time_ns", "monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns")),
    ("time", ("localtime", "gmtime", "ctime", "asctime", "strftime")),  # flagged without a time argument
    ("os", ("urandom", "getrandom")),
)
_VOLATILE_WORDS = frozenset({"now", "today", "utcnow", "SystemRandom", "secrets", "token_hex", "token_bytes"})


def _flagging(module: Any, name: str, reads_clock_without_args: bool) -> Any:
    original = getattr(module, name)

    def call(*args: Any, **kwargs: Any) -> Any:
        # strftime(format) and asctime() read the clock; with a time tuple they do not.
        if not reads_clock_without_args or len(args) + len(kwargs) <= (1 if name == "strftime" else 0):
            _VOLATILE[0] = True
        return original(*args, **kwargs)

    # Named as the original, so a pickled reference to it loads as the new sandbox's.
    call.__module__, call.__name__, call.__qualname__ = module.__name__, name, name
    call.__doc__ = original.__doc__
    return call


def watch_volatile_reads() -> None:
    """Flag cells that read the clock or OS randomness (they snapshot right after, so a
    rebuild restores what the model saw). `random` needs none: it is seeded, and its state
    travels in the snapshot. What wrappers cannot see (datetime.now, secrets) is found in
    the code's words."""
    import importlib

    for position, (module_name, functions) in enumerate(_CLOCK_READS):
        module = importlib.import_module(module_name)
        for name in functions:
            if hasattr(module, name):
                setattr(module, name, _flagging(module, name, reads_clock_without_args=position == 1))


def volatile_code(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in _VOLATILE_WORDS:
            return True
        if isinstance(node, ast.Name) and node.id in _VOLATILE_WORDS:
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            named = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            if any(part in _VOLATILE_WORDS for n in named for part in n.split(".")):
                return True
    return False


def set_ids(uid: int) -> str:
    """Become `uid` (group `uid`, no supplementary groups) for good: a worker running as root
    never leaves a cell as uid 0."""
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    if os.geteuid() != uid or os.getegid() != uid or 0 in (os.getuid(), os.getgid()):
        raise LayerError("uid drop did not take effect")
    return f"uid {uid}"


def die_with_parent(parent_pid: int, libc: Any) -> str:
    # Set after the uid change: the kernel clears the parent-death signal on credential
    # changes. A SIGKILLed worker must not leave sandboxes behind.
    try:
        result = libc.prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except OSError as exc:
        raise LayerError(f"cannot set the parent-death signal: {exc}") from exc
    if result != 0:
        raise LayerError("cannot set the parent-death signal: prctl failed")
    if os.getppid() != parent_pid:
        os._exit(3)  # the worker died before we could ask to die with it
    return "SIGKILL on worker death"


FALLBACK_TASKS = 8
"""Without a cgroup of its own, a sandbox with a uid of its own bounds its memory as
RLIMIT_AS x RLIMIT_NPROC: at most this many processes (threads count), each with an
address space of its budget / FALLBACK_TASKS, so all of them together stay in the budget."""


def set_limits(memory_mb: int, file_mb: int, cpu_s: int, processes: int | None, whole: bool = False) -> str:
    """Kernel limits of the whole sandbox life: memory, file size, open files, CPU time (a
    thread a cell left spinning is stopped by it), and, when the sandbox has a uid of its
    own, processes (a fork bomb stops there; with a shared uid the count would be the
    worker's too).

    RLIMIT_AS is per process. When a cgroup bounds the sandbox's memory as a whole (`whole`),
    each process may have the whole budget; otherwise, with a uid of its own, the budget is
    split: FALLBACK_TASKS processes of budget / FALLBACK_TASKS each. With neither (a worker
    not root, no delegated cgroup) memory is bounded per process only, and said so."""
    import resource

    budget = memory_mb
    if not whole and processes is not None:
        processes = min(processes, FALLBACK_TASKS)
        memory_mb = max(budget // processes, 1)
    limits = {
        "RLIMIT_AS": (resource.RLIMIT_AS, memory_mb * 1024 * 1024),
        "RLIMIT_FSIZE": (resource.RLIMIT_FSIZE, file_mb * 1024 * 1024),
        "RLIMIT_CORE": (resource.RLIMIT_CORE, 0),
        "RLIMIT_NOFILE": (resource.RLIMIT_NOFILE, OPEN_FILES),
        "RLIMIT_CPU": (resource.RLIMIT_CPU, cpu_s),
    }
    if processes is not None:
        limits["RLIMIT_NPROC"] = (resource.RLIMIT_NPROC, processes)
    for label, (kind, value) in limits.items():
        try:
            resource.setrlimit(kind, (value, value))
        except (ValueError, OSError, OverflowError) as exc:
            raise LayerError(f"cannot set {label} to {value}: {exc}") from exc
    counted = f"{processes} processes" if processes is not None else "processes not limited (shared uid)"
    if whole:
        bound = ""
    elif processes is not None:
        bound = f"; no cgroup: {memory_mb} MB x {processes} processes bound the sandbox's {budget} MB"
    else:
        bound = "; no cgroup and a shared uid: memory is bounded per process only"
    return (
        f"address space {memory_mb} MB, files {file_mb} MB, no core, {OPEN_FILES} open files, "
        f"CPU {cpu_s} s, {counted}{bound}"
    )


OPEN_FILES = 256


def _readable_roots(sandbox_dir: str) -> tuple[str, ...]:
    import sysconfig

    paths = sysconfig.get_paths()
    roots = {paths.get(key, "") for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots |= {
        os.path.join(sys.base_prefix, "lib"),
        "/usr/share/zoneinfo",
        "/usr/lib/locale",
        "/etc/localtime",
        "/dev/null",
        "/dev/urandom",
        "/dev/zero",
        sandbox_dir,
    }
    return tuple(sorted(os.path.normpath(r) for r in roots if r))


def make_guard(sandbox_dir: str) -> Any:
    sandbox_dir = os.path.normpath(sandbox_dir)
    readable = _readable_roots(sandbox_dir)

    def inside(path: Any, roots: tuple[str, ...]) -> bool:
        if isinstance(path, int):
            return True  # an fd the process already holds
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not isinstance(path, str):
            path = os.fspath(path)
        full = os.path.normpath(os.path.join(sandbox_dir, path))
        return any(full == r or full.startswith(r + os.sep) for r in roots)

    def guard(event: str, args: tuple[Any, ...]) -> None:
        if event == "os.kill" and args == (-1, signal.SIGKILL) and _SWEEPING[0]:
            return  # `sweep_strays`: reaches only this sandbox's own uid, whoever asks
        if event.startswith(_BLOCKED_PREFIXES):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode = args[0], args[1]
            writing = isinstance(mode, str) and any(c in mode for c in "wax+")
            if isinstance(mode, int):  # os.open flags
                writing = bool(mode & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC))
            roots = (sandbox_dir,) if writing else readable
            if path is not None and not inside(path, roots):
                raise PermissionError(f"sandbox: access to {path!r} is not allowed")
        elif event in _PATH_WRITE_EVENTS:
            for path in args[:2]:
                if isinstance(path, (str, bytes, os.PathLike)) and not inside(path, (sandbox_dir,)):
                    raise PermissionError(f"sandbox: {event} outside the sandbox is not allowed")
        elif event in _PATH_READ_EVENTS:
            if args and args[0] is not None and not inside(args[0], readable):
                raise PermissionError(f"sandbox: {event} of {args[0]!r} is not allowed")

    return guard


_SWEEPING = [False]
_OWN_UID = [False]  # the sandbox runs as a uid no other process has (a root worker's)


def sweep_strays() -> None:
    """After each cell: SIGKILL every other process of this sandbox's own uid (kill(-1)
    reaches exactly those), and reap them. A process a cell forked (possible once the audit
    hook is out of the way) shares the channel's descriptors: it must not outlive its cell
    and speak later. With a shared uid (a worker not root) kill(-1) would reach the worker:
    nothing is swept, and the audit hook's refusal of fork is what stands."""
    if not _OWN_UID[0]:
        return
    _SWEEPING[0] = True
    try:
        os.kill(-1, signal.SIGKILL)
    except OSError:
        pass  # none to kill
    finally:
        _SWEEPING[0] = False
    while True:  # its own children, each SIGKILLed: reaped as they die
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return
        except InterruptedError:
            continue


# --- cells ----------------------------------------------------------------------------------


class ToolError(RuntimeError):
    """A custom tool failed (it raised, timed out, or is not on the worker)."""


class CellTimeout(BaseException):
    """BaseException so `except Exception` in model code does not swallow it."""


class BoundedWriter(io.TextIOBase):
    """Keeps the first `limit` characters; counts the rest so memory stays bounded."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.parts: list[str] = []
        self.kept = 0
        self.dropped = 0

    def write(self, text: str) -> int:  # type: ignore[override]
        text = str(text)
        room = self.limit - self.kept
        if room > 0:
            self.parts.append(text[:room])
            self.kept += min(room, len(text))
        self.dropped += max(0, len(text) - max(room, 0))
        return len(text)

    def writable(self) -> bool:
        return True

    def getvalue(self) -> str:
        text = "".join(self.parts)
        if self.dropped:
            text += f"\n... [{self.dropped} more characters truncated]"
        return text


_HELPERS: dict[str, str] = {}
"""The REPL's helper functions: the name model code calls -> the Session method. One
registry, so a new helper (rlm_query, a custom tool) is one decorated method."""


def repl_helper(name: str) -> Any:
    def register(method: Any) -> Any:
        _HELPERS[name] = method.__name__
        return method

    return register


class Session:
    """One episode's namespace and the host channel its model helpers talk through."""

    def __init__(self, channel_in: BinaryIO, channel_out: BinaryIO) -> None:
        self.channel_in = channel_in
        self.channel_out = channel_out
        self.namespace: dict[str, Any] = {}
        self.reserved: set[str] = set()
        self.submitted: dict[str, Any] | None = None
        self.final: tuple[str, str] | None = None  # (kind, answer) set by FINAL / FINAL_VAR
        self.variable_limits = (50, 200)
        self.child_batch_cap: int | None = None  # set when rlm_query starts child episodes
        self.recorded: list[dict[str, Any]] | None = None  # answers served while rebuilding
        self.asked: list[list[str]] = []  # [kind, prompt digest] of each call while rebuilding
        self.initial: dict[str, Any] = {}  # the REPL's own names as init made them
        self.defined_by: dict[str, int] = {}  # name -> the last cell that bound it
        self.sandbox_dir = "."
        self.blocked_s = 0.0  # time the running cell spent waiting on the host
        # The host's limits on one call (workflows/defaults.py, sent with init): a call past
        # them is refused here, in the cell; the host refuses a frame past them regardless.
        self.max_prompts: int | None = None
        self.max_call_bytes: int | None = None

    def _call(self, kind: str, prompts: list[str], model: str | None = None) -> list[dict[str, Any]]:
        """Suspend the cell at calls of one kind; the workflow routes them by kind. While the
        REPL is rebuilt, the calls are answered from the log instead, by position. A call
        past the host's limits raises in the cell, live or rebuilt alike."""
        if self.max_prompts is not None and len(prompts) > self.max_prompts:
            raise ValueError(
                f"{kind} got {len(prompts):,} prompts; at most {self.max_prompts:,} go in one call: "
                "split the list"
            )
        frame: dict[str, Any] = {"op": "call", "kind": kind, "prompts": prompts}
        if model is not None:
            frame["model"] = model
        data = encode_frame({**frame, "seq": _SEQ[0]} if _SEQ[0] is not None else frame)
        if self.max_call_bytes is not None and len(data) - HEADER.size > self.max_call_bytes:
            raise ValueError(
                f"{kind}: the prompts of this call take {len(data) - HEADER.size:,} bytes; at most "
                f"{self.max_call_bytes:,} go in one call: send less, or split it"
            )
        if self.recorded is not None:
            answers = []
            for prompt in prompts:
                self.asked.append([kind, "sha256:" + hashlib.sha256(prompt.encode("utf-8")).hexdigest()])
                missing = {"ok": False, "text": "replay diverged: no recorded result"}
                answers.append(self.recorded.pop(0) if self.recorded else missing)
            return answers
        remaining, _ = signal.setitimer(signal.ITIMER_REAL, 0)  # model and child time is not cell time
        waited = _WALL()
        self.channel_out.write(data)
        self.channel_out.flush()
        reply = read_frame(self.channel_in)
        self.blocked_s += _WALL() - waited
        if reply is None:
            os._exit(0)
        if remaining > 0:
            signal.setitimer(signal.ITIMER_REAL, remaining)
        answers = reply.get("answers", [])
        if reply.get("op") != "answers" or len(answers) != len(prompts):
            raise RuntimeError("sandbox: malformed answer from host")
        return answers

    @repl_helper("llm_query")
    def llm_query(self, prompt: str, model: str | None = None) -> str:
        _check_prompts("llm_query", [prompt], model)
        answer = self._call("llm_query", [prompt], model)[0]
        if not answer["ok"]:
            raise RuntimeError(f"llm_query failed: {answer['text']}")
        return answer["text"]

    @repl_helper("llm_query_batched")
    def llm_query_batched(self, prompts: list[str], model: str | None = None) -> list[str]:
        prompts = _prompt_list("llm_query_batched", prompts, model)
        if not prompts:
            return []
        return [_text_or_error(a) for a in self._call("llm_query_batched", prompts, model)]

    @repl_helper("rlm_query")
    def rlm_query(self, prompt: str, model: str | None = None) -> str:
        """A whole sub-episode whose `context` is the prompt; errors come back as
        "Error: ..." strings, as in rlms, so the calling code goes on."""
        _check_prompts("rlm_query", [prompt], model)
        return _text_or_error(self._call("rlm_query", [prompt], model)[0])

    @repl_helper("rlm_query_batched")
    def rlm_query_batched(self, prompts: list[str], model: str | None = None) -> list[str]:
        prompts = _prompt_list("rlm_query_batched", prompts, model)
        cap = self.child_batch_cap
        if cap is not None and len(prompts) > cap:
            raise ValueError(
                f"rlm_query_batched got {len(prompts)} prompts; at most {cap} child episodes run "
                "in one batch: split the list"
            )
        if not prompts:
            return []
        return [_text_or_error(a) for a in self._call("rlm_query_batched", prompts, model)]

    @repl_helper("SHOW_VARS")
    def show_vars(self) -> None:
        names = [
            f"{name}: {type(value).__name__}"
            for name, value in self.namespace.items()
            if not name.startswith("_") and name not in self.reserved
        ]
        print("\n".join(names) if names else "(no variables yet)")

    @repl_helper("SUBMIT")
    def submit(self, **fields: Any) -> None:
        """Record typed outputs; the workflow validates them against the episode's fields."""
        try:
            json.dumps(fields)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"SUBMIT values must be JSON-serialisable: {exc}") from None
        self.submitted = fields
        print(f"SUBMIT received: {', '.join(sorted(fields)) or '(no fields)'}")

    @repl_helper("FINAL")
    def final_value(self, value: Any) -> None:
        """FINAL(x) in a cell: the answer is str(x), the value, not the name written."""
        self.final = ("final", _text_of(value))

    @repl_helper("FINAL_VAR")
    def final_var(self, name: Any) -> None:
        """FINAL_VAR("name") in a cell: the answer is the named variable's value."""
        if not isinstance(name, str):
            raise TypeError(
                f"FINAL_VAR expects a variable name as a string, got {type(name).__name__}; "
                "to answer with a value, call FINAL(value)"
            )
        key = name.strip().strip("'\"")
        if key not in self.namespace or key in self.reserved - {"context", "answer"}:
            raise NameError(
                f"FINAL_VAR: no variable named {key!r}; to answer with a value, call FINAL(value)"
            )
        self.final = ("final_var", _text_of(self.namespace[key]))

    def init(self, message: dict[str, Any]) -> None:
        import random

        context: Any = None
        path = message.get("context_path")
        if path:
            with open(path, encoding="utf-8") as handle:
                context = json.load(handle) if message.get("context_kind") == "json" else handle.read()
        random.seed(message.get("seed", 0))
        self.variable_limits = (
            int(message.get("variables_shown", 50)),
            int(message.get("variable_chars", 200)),
        )
        cap = message.get("child_batch_cap")
        self.child_batch_cap = int(cap) if cap is not None else None
        if message.get("max_prompts") is not None:
            self.max_prompts = int(message["max_prompts"])
        if message.get("max_call_bytes") is not None:
            self.max_call_bytes = int(message["max_call_bytes"])
        self.namespace = {
            "__name__": "__main__",
            "__builtins__": __builtins__,
            "context": context,
            "answer": {"content": "", "ready": False},
        }
        for name, method in _HELPERS.items():
            self.namespace[name] = getattr(self, method)
        self.namespace["ToolError"] = ToolError
        for spec in message.get("tools") or []:
            self.namespace[spec["name"]] = self._tool(spec)
        self.reserved = set(self.namespace)
        # The REPL's own functions, put back before every cell: code that overwrote one
        # (`llm_query = None`, by accident or not) does not cost the episode its helpers.
        self.helpers = {k: v for k, v in self.namespace.items() if callable(v) or k == "ToolError"}
        self.initial = {k: v for k, v in self.namespace.items() if k != "__builtins__"}
        self.sandbox_dir = os.getcwd()
        watch_volatile_reads()

    def _tool(self, spec: dict[str, Any]) -> Any:
        """A REPL function with the tool's name, parameters and docstring. Its call suspends
        the cell like llm_query; the workflow runs the tool as an activity."""
        import inspect

        params = [
            inspect.Parameter(
                p["name"],
                getattr(inspect.Parameter, p["kind"].upper()),
                default=p.get("default") if p.get("has_default") else inspect.Parameter.empty,
            )
            for p in spec.get("params", [])
        ]
        signature = inspect.Signature(params)
        name = spec["name"]

        def call(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)  # TypeError, as a real call would raise
            try:
                payload = json.dumps({"args": list(bound.args), "kwargs": bound.kwargs})
            except (TypeError, ValueError) as exc:
                raise TypeError(f"{name}: arguments must be JSON values ({exc})") from None
            answer = self._call(f"tool:{name}", [payload])[0]
            if not answer["ok"]:
                raise ToolError(f"{name} failed: {answer['text']}")
            return json.loads(answer["text"])

        call.__name__ = call.__qualname__ = name
        call.__doc__ = spec.get("doc") or None
        call.__signature__ = signature  # type: ignore[attr-defined]
        return call

    def execute(
        self,
        code: str,
        cell_name: str,
        timeout: float,
        limit: int,
        summary: bool = True,
        cell: int | None = None,
    ) -> dict[str, Any]:
        """Run a cell. A cell re-run to rebuild the REPL needs no variables summary (only the
        step's last cell is reported). Reports its own run time (calls to the host excluded:
        what a rebuild would spend on it) and whether it read the clock."""
        self.namespace.update(self.helpers)
        stdout, stderr = BoundedWriter(limit), BoundedWriter(limit)
        self.submitted, self.final = None, None
        error: str | None = None
        status = "ok"
        saved = sys.stdout, sys.stderr
        bound_before = {name: id(value) for name, value in self.namespace.items()}
        _VOLATILE[0], self.blocked_s, started = False, 0.0, _WALL()

        def on_alarm(signum: int, frame: Any) -> None:
            raise CellTimeout(f"cell exceeded its {timeout:g} s time limit")

        signal.signal(signal.SIGALRM, on_alarm)
        sys.stdout, sys.stderr = stdout, stderr  # type: ignore[assignment]
        try:
            signal.setitimer(signal.ITIMER_REAL, timeout)
            self._run(code, cell_name)
        except CellTimeout as exc:
            status, error = "timeout", f"TimeoutError: {exc}"
        except SystemExit:
            status, error = "error", "SystemExit: exiting the REPL is not allowed"
        except BaseException as exc:  # noqa: BLE001 - everything a cell raises is an observation
            status, error = "error", _format_error(exc)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            sys.stdout, sys.stderr = saved
            sweep_strays()
        elapsed = max(0.0, _WALL() - started - self.blocked_s)
        volatile = _VOLATILE[0] or self._volatile_code(code)
        if cell is not None:
            self._note_bindings(bound_before, cell)
        kind, answer = self.final if self.final is not None else ("answer_ready", self._ready_answer())
        return {
            "op": "done",
            "status": status,
            "stdout": stdout.getvalue(),
            "stderr": stderr.getvalue(),
            "error": _clip(error),
            "answer": _clip(answer),
            "answer_kind": kind if answer is not None else None,
            "submitted": self.submitted,
            "variables": self.variables_summary(*self.variable_limits) if summary else {},
            "elapsed": elapsed,
            "volatile": volatile,
        }

    @staticmethod
    def _volatile_code(code: str) -> bool:
        try:
            return volatile_code(ast.parse(code))
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return False

    def _note_bindings(self, before: dict[str, int], cell: int) -> None:
        """Which cell last bound each name: a rebuild re-runs it for a name no snapshot holds."""
        for name, value in self.namespace.items():
            if before.get(name) != id(value):
                self.defined_by[name] = cell
        for name in [n for n in self.defined_by if n not in self.namespace]:
            del self.defined_by[name]

    def snapshot(self, message: dict[str, Any]) -> dict[str, Any]:
        path = os.path.join(self.sandbox_dir, str(message["name"]))
        try:
            taken = snapshots().take(
                path,
                self.namespace,
                self.initial,
                self.defined_by,
                self.sandbox_dir,
                int(message["files_bytes"]),
            )
        except ImportError as exc:
            return {"op": "snapshot_failed", "error": f"no snapshot support in the sandbox: {exc}"}
        except BaseException as exc:  # noqa: BLE001 - hostile values, full disk, memory limit
            return {"op": "snapshot_failed", "error": f"{type(exc).__name__}: {exc}"[:500]}
        limit = message.get("max_bytes")
        if limit is not None and taken["size"] > int(limit):
            with contextlib.suppress(OSError):
                os.remove(path)
            return {
                "op": "snapshot_failed",
                "error": f"the snapshot takes {taken['size']:,} bytes, over the worker's {int(limit):,}",
            }
        return {"op": "snapshotted", **taken}

    def restore(self, message: dict[str, Any]) -> dict[str, Any]:
        """Load a snapshot, then re-run the cells that bound the names it could not hold,
        keeping only those names from each (everything else stays as the snapshot has it)."""
        path = os.path.join(self.sandbox_dir, str(message["name"]))
        try:
            self.namespace, self.defined_by, files = snapshots().load(path, self.initial, self.sandbox_dir)
            self.namespace["__builtins__"] = __builtins__
        except BaseException as exc:  # noqa: BLE001 - the host falls back to re-running cells
            return {"op": "restore_failed", "error": f"{type(exc).__name__}: {exc}"[:500]}
        finally:
            with contextlib.suppress(OSError):
                os.remove(path)
        notes: dict[str, str] = {}
        for cell in message.get("recreate", []):
            wanted = set(cell["names"])
            kept = dict(self.namespace)
            self.recorded, self.asked = list(cell["answers"]), []
            try:
                done = self.execute(
                    cell["code"], cell["cell_name"], float(cell["timeout"]), int(cell["limit"])
                )
            finally:
                self.recorded, self.asked = None, []
            for name in set(self.namespace) | set(kept):
                if name in wanted:
                    continue
                if name in kept:
                    self.namespace[name] = kept[name]
                else:
                    del self.namespace[name]
            for name in sorted(wanted):
                if name in self.namespace:
                    self.defined_by[name] = int(cell["cell"])
                    notes[name] = f"re-created by re-running cell {cell['cell']}"
                else:
                    problem = done.get("error") or "the cell did not bind it"
                    notes[name] = f"lost: re-running cell {cell['cell']} did not re-create it ({problem})"
        if message.get("recreate"):
            # The re-run cells may have written files: they are as the snapshot has them.
            snapshots().put_files(files, self.sandbox_dir)
        return {"op": "restored", "notes": notes}

    def replay(self, cells: list[dict[str, Any]]) -> dict[str, Any]:
        """Re-run finished cells to rebuild the namespace, in one exchange with the host: their
        calls are answered from the answers logged with them. Reports what each cell asked,
        so the host can tell where the code diverged from the log."""
        report = []
        try:
            for cell in cells:
                self.recorded, self.asked = list(cell["answers"]), []
                done = self.execute(
                    cell["code"],
                    cell["cell_name"],
                    float(cell["timeout"]),
                    int(cell["limit"]),
                    summary=False,
                    cell=cell.get("cell"),
                )
                report.append(
                    {
                        "status": done["status"],
                        "asked": self.asked,
                        "elapsed": done["elapsed"],
                        "volatile": done["volatile"],
                    }
                )
        finally:
            self.recorded, self.asked = None, []
        return {"op": "replayed", "cells": report}

    def variables_summary(self, limit: int = 50, width: int = 200) -> dict[str, str]:
        """A bounded text view of user variables, for termination policies."""
        import reprlib
        import types

        # Bounded as it is built: a large value is not rendered whole and then cut.
        shorten = reprlib.Repr()
        shorten.maxstring = shorten.maxother = width
        shorten.maxlist = shorten.maxtuple = shorten.maxset = shorten.maxdict = 50
        summary: dict[str, str] = {}
        for name, value in list(self.namespace.items()):
            if len(summary) >= limit:
                break
            if name.startswith("_") or name in self.reserved - {"answer"}:
                continue
            if isinstance(value, (types.ModuleType, types.FunctionType, type)):
                continue
            try:
                if isinstance(value, str):
                    text = value[:width]
                elif isinstance(value, (int, float, bool)):
                    text = str(value)
                else:
                    text = shorten.repr(value)
            except Exception:  # noqa: BLE001 - hostile __repr__
                text = f"<{type(value).__name__}>"
            summary[name] = text[:width]
        return summary

    def _run(self, code: str, cell_name: str) -> None:
        tree = ast.parse(code, filename=cell_name, mode="exec")
        last = tree.body[-1] if tree.body else None
        if isinstance(last, ast.Expr):
            # Echo the value of a trailing expression, as a REPL does.
            tree.body.pop()
            exec(compile(tree, cell_name, "exec"), self.namespace)
            value = eval(compile(ast.Expression(last.value), cell_name, "eval"), self.namespace)
            if value is not None:
                print(repr(value))
        else:
            exec(compile(tree, cell_name, "exec"), self.namespace)

    def _ready_answer(self) -> str | None:
        answer = self.namespace.get("answer")
        if isinstance(answer, dict) and answer.get("ready") is True:
            return _text_of(answer.get("content", ""))
        return None

    def read_variable(self, name: str) -> dict[str, Any]:
        if name not in self.namespace or name in self.reserved - {"context", "answer"}:
            return {"op": "var", "found": False}
        try:
            return {"op": "var", "found": True, "value": _clip(str(self.namespace[name]))}
        except Exception as exc:  # noqa: BLE001
            return {"op": "var", "found": True, "value": f"<str() failed: {exc!r}>"}


def _check_prompts(helper: str, prompts: list[Any], model: Any) -> None:
    for prompt in prompts:
        if not isinstance(prompt, str):
            raise TypeError(f"{helper} expects str prompts, got {type(prompt).__name__}")
    if model is not None and not isinstance(model, str):
        raise TypeError(f"{helper}: model must be a model name (str) or None, got {type(model).__name__}")


def _prompt_list(helper: str, prompts: Any, model: Any) -> list[str]:
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__iter__"):
        raise TypeError(f"{helper} expects a list of str prompts, got {type(prompts).__name__}")
    items = list(prompts)
    _check_prompts(helper, items, model)
    return items


def _text_or_error(answer: dict[str, Any]) -> str:
    return answer["text"] if answer["ok"] else f"Error: {answer['text']}"


def _text_of(value: Any) -> str:
    try:
        return str(value)
    except Exception as exc:  # noqa: BLE001 - a hostile __str__
        return f"<answer could not be converted to text: {exc!r}>"


FIELD_CHARS = 1_000_000  # the worker's SANDBOX_FIELD_CHARS: longest error or answer sent


def _clip(text: str | None) -> str | None:
    if text is None or len(text) <= FIELD_CHARS:
        return text
    return text[:FIELD_CHARS] + f"\n... [{len(text) - FIELD_CHARS:,} more characters truncated]"


def _format_error(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.startswith("<cell")]
    lines = traceback.format_list(frames) if frames else []
    detail = "".join(traceback.format_exception_only(type(exc), exc))
    return ("Traceback (most recent call last):\n" + "".join(lines) if lines else "") + detail.rstrip()


def start_layers(init: dict[str, Any], parent_pid: int, sandbox_dir: str) -> dict[str, str]:
    """Put every isolation layer in place; each reports what it did.

    As root (with CAP_SYS_ADMIN): an empty network namespace and a private root filesystem
    are made as root, then the sandbox becomes its own uid (which clears every capability).
    Otherwise (not root, or root without CAP_SYS_ADMIN, as in a default container): the uid
    is dropped first, then a user namespace of its own (its uid mapped to itself) makes the
    network and mount namespaces, and every capability is dropped. Then the limits, the
    parent-death signal, the seccomp filter, and last the audit hook (Python's own guard,
    one layer more: every other layer holds without it)."""
    # libc (through ctypes) and the kernel layers are loaded before the uid drop and the new
    # root: after them the interpreter's own files may be out of reach.
    import resource  # noqa: F401 - set_limits needs it after the uid drop and the new root

    libc = _libc()
    k = kernel()
    uid = int(init.get("uid", NOBODY))
    filesystem = bool(init.get("filesystem", True))
    preload_modules()
    guard = make_guard(sandbox_dir)
    sources = k.readonly_sources()
    layers: dict[str, str] = {}
    root = os.geteuid() == 0
    _OWN_UID[0] = root and "uid" in init  # the host gave it a uid of its own
    memory_mb, processes = int(init.get("memory_mb", 4096)), int(init.get("processes", 64))
    # First, while /sys is in view and before any privilege goes: the limits of the cgroup the
    # host placed it in, which bound the sandbox as a whole (activities/sandbox/cgroups.py).
    try:
        whole = _sibling("cgroups.py").limit_own(memory_mb, processes)
    except OSError as exc:
        raise LayerError(f"cannot limit the sandbox's cgroup: {exc}") from exc
    layers["cgroup"] = whole or "none (the host placed it in no cgroup of its own)"
    if root and init.get("namespaces") != "user" and libc.unshare(k.CLONE_NEWNET) == 0:
        layers["network"] = "netns"
        layers["ipc_pid"] = _ipc_and_pids(k, libc)
        layers["filesystem"] = _filesystem(k, libc, sandbox_dir, sources, filesystem)
        layers["uid"] = set_ids(uid)
    else:
        if root:
            layers["uid"] = set_ids(uid)  # first: no namespace may leave it uid 0
        else:
            uid = os.geteuid()
            layers["uid"] = f"uid {uid} (worker not root: no drop)"
        try:
            k.enter_user_namespace(libc, uid, os.getegid())
            if libc.unshare(k.CLONE_NEWNET) != 0:
                raise OSError("unshare(CLONE_NEWNET) refused")
            layers["network"] = "userns+netns"
            layers["ipc_pid"] = _ipc_and_pids(k, libc)
            layers["filesystem"] = _filesystem(k, libc, sandbox_dir, sources, filesystem)
            k.drop_capabilities(libc)
        except OSError as exc:
            layers.setdefault("network", "none")
            layers.setdefault("ipc_pid", f"none (no user namespace: {exc})")
            layers.setdefault("filesystem", f"none (no user namespace: {exc})")
    layers["rlimits"] = set_limits(
        memory_mb,
        int(init.get("file_mb", 256)),
        int(init.get("cpu_s", 3600)),
        processes if root else None,
        whole=whole is not None,
    )
    layers["death_signal"] = die_with_parent(parent_pid, libc)
    try:
        layers["seccomp"] = k.install_seccomp(libc)
    except OSError as exc:
        raise LayerError(f"cannot install the seccomp filter: {exc}") from exc
    if layers["ipc_pid"] == "ipc+pid":
        # Last of the kernel layers, so the keeper left outside holds every one of them too.
        k.become_pid_one(libc)
        _OWN_UID[0] = True  # kill(-1) now reaches the namespace's processes only: strays can be swept
    os.chdir(sandbox_dir)
    _forget_libc()  # model code finds no libc handle lying around (it is refused anyway)
    if init.get("audit_hook", True):
        sys.addaudithook(guard)
        layers["audit_hook"] = "on"
    else:  # only tests turn it off, to prove the other layers hold alone
        layers["audit_hook"] = "off"
    return layers


def _ipc_and_pids(k: Any, libc: Any) -> str:
    try:
        return k.private_ipc_and_pids(libc)
    except OSError as exc:  # a kernel without these namespaces: said, and `drlm doctor` warns
        return f"none ({exc})"


def _filesystem(k: Any, libc: Any, sandbox_dir: str, sources: list[str], wanted: bool) -> str:
    if not wanted:
        return "off (asked)"
    try:
        return k.isolate_filesystem(libc, sandbox_dir, sources)
    except OSError as exc:
        raise LayerError(f"cannot make the sandbox's private root: {exc}") from exc


def kernel() -> Any:
    """activities/sandbox/kernel.py: the kernel-enforced layers."""
    return _sibling("kernel.py")


def serve(parent_pid: int, sandbox_dir: str) -> NoReturn:
    """The sandbox's whole life once its process exists, spawned or forked alike: the
    channel on fds 0/1, the layers, the session, the loop. It never returns."""
    sys.dont_write_bytecode = True
    channel_in = os.fdopen(os.dup(0), "rb")
    channel_out = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)

    init = read_frame(channel_in)
    if init is None or init.get("op") != "init":
        os._exit(2)
    session = Session(channel_in, channel_out)
    try:
        layers = start_layers(init, parent_pid, sandbox_dir)
        session.init(init)
    except (LayerError, OSError) as exc:
        write_frame(channel_out, {"op": "failed", "error": f"{type(exc).__name__}: {exc}"})
        os._exit(4)
    write_frame(
        channel_out, {"op": "ready", "layers": layers, "network": layers["network"], "uid": os.getuid()}
    )

    while True:
        message = read_frame(channel_in)
        if message is None or message["op"] == "shutdown":
            os._exit(0)
        if message["op"] == "exec":
            reply = session.execute(
                message["code"],
                message["cell_name"],
                float(message["timeout"]),
                int(message["limit"]),
                summary=bool(message.get("summary", True)),
                cell=message.get("cell"),
            )
        elif message["op"] == "snapshot":
            reply = session.snapshot(message)
        elif message["op"] == "restore":
            reply = session.restore(message)
        elif message["op"] == "replay":
            reply = session.replay(list(message["cells"]))
        elif message["op"] == "read_var":
            reply = session.read_variable(str(message["name"]))
        else:
            reply = {"op": "error", "error": f"unknown op {message['op']!r}"}
        write_frame(channel_out, reply)


def main() -> None:
    serve(int(sys.argv[1]), sys.argv[2])


if __name__ == "__main__":
    main()
