"""One episode's REPL inside the sandbox: its namespace, its helpers, and how a cell runs.

The session is what the host's `init` makes and every `exec` uses: the namespace (the
episode's context, the model helpers, the variables cells bind), which cell bound each name
(a rebuild re-runs it for a name no snapshot holds), and a cell's run: output bounded as it
is written, a time limit that `except Exception` cannot swallow, the answer, the typed
outputs and a bounded view of the variables. Calls out of the cell are host_calls.py's; the
snapshot, restore and replay ops are rebuild.py's. Standard library only, like everything
the sandbox loads.
"""

from __future__ import annotations

import ast
import io
import json
import os
import random
import reprlib
import signal
import sys
import traceback
import types
from typing import Any, BinaryIO

from . import answer as answers
from . import contexts
from .host_calls import HostCalls, ToolError, check_prompts, prompt_list, text_or_error
from .layers import sweep_strays
from .volatile import FLAGGED, WALL, volatile_source, watch_volatile_reads

FIELD_CHARS = 1_000_000  # the worker's SANDBOX_FIELD_CHARS: longest error or answer sent

ITEMS_SHOWN = 50
"""Elements of a list, tuple, set or dict rendered in the variables summary."""


class CellTimeout(BaseException):
    """BaseException so `except Exception` in model code does not swallow it."""


class Submitted(BaseException):
    """A DSPy program's SUBMIT: the cell ends there (BaseException, as CellTimeout)."""


class BoundedWriter(io.TextIOBase):
    """Keeps the first `limit` characters; counts the rest so memory stays bounded."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.parts: list[str] = []
        self.kept = 0
        self.dropped = 0

    def write(self, text: str) -> int:
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
    """One episode's namespace, and the helpers its cells call."""

    def __init__(self, channel_in: BinaryIO, channel_out: BinaryIO) -> None:
        self.calls = HostCalls(channel_in, channel_out)
        self.namespace: dict[str, Any] = {}
        self.reserved: set[str] = set()
        self.submitted: dict[str, Any] | None = None
        self.final: tuple[str, str] | None = None  # (kind, answer) set by FINAL / FINAL_VAR
        # (names shown, characters each) of the variables summary: the worker's
        # defaults.VARIABLES_SHOWN and VARIABLE_CHARS, sent with init; none without them.
        self.variable_limits: tuple[int, int] | None = None
        self.child_batch_cap: int | None = None  # set when rlm_query starts child episodes
        self.initial: dict[str, Any] = {}  # the REPL's own names as init made them
        self.helpers: dict[str, Any] = {}  # the REPL's own functions, put back before each cell
        self.defined_by: dict[str, int] = {}  # name -> the last cell that bound it
        self.sandbox_dir = "."
        self.rlms = False  # rlms 0.1.3's semantics (the host's init says so)
        # A DSPy program's REPL (the host's init says so): SUBMIT's fields in order, and the
        # input fields, bound again before each cell as DSPy's interpreter binds them.
        self.dspy_outputs: list[str] | None = None
        self.inputs: dict[str, Any] = {}

    @repl_helper("llm_query")
    def llm_query(self, prompt: str, model: str | None = None) -> str:
        check_prompts("llm_query", [prompt], model)
        answer = self.calls.call("llm_query", [prompt], model)[0]
        if self.rlms:
            return text_or_error(answer)  # rlms's: the cell goes on with an "Error: ..." string
        if not answer["ok"]:
            raise RuntimeError(f"llm_query failed: {answer['text']}")
        return answer["text"]

    @repl_helper("llm_query_batched")
    def llm_query_batched(self, prompts: list[str], model: str | None = None) -> list[str]:
        prompts = prompt_list("llm_query_batched", prompts, model)
        if not prompts:
            return []
        return [text_or_error(a) for a in self.calls.call("llm_query_batched", prompts, model)]

    @repl_helper("rlm_query")
    def rlm_query(self, prompt: str, model: str | None = None) -> str:
        """A whole sub-episode whose `context` is the prompt; errors come back as
        "Error: ..." strings, as in rlms, so the calling code goes on."""
        check_prompts("rlm_query", [prompt], model)
        return text_or_error(self.calls.call("rlm_query", [prompt], model)[0])

    @repl_helper("rlm_query_batched")
    def rlm_query_batched(self, prompts: list[str], model: str | None = None) -> list[str]:
        prompts = prompt_list("rlm_query_batched", prompts, model)
        cap = self.child_batch_cap
        if cap is not None and len(prompts) > cap:
            raise ValueError(
                f"rlm_query_batched got {len(prompts)} prompts; at most {cap} child episodes run "
                "in one batch: split the list"
            )
        if not prompts:
            return []
        return [text_or_error(a) for a in self.calls.call("rlm_query_batched", prompts, model)]

    @repl_helper("SHOW_VARS")
    def show_vars(self) -> None:
        names = [
            f"{name}: {type(value).__name__}"
            for name, value in self.namespace.items()
            if not name.startswith("_") and name not in self.reserved
        ]
        print("\n".join(names) if names else "(no variables yet)")

    @repl_helper("SUBMIT")
    def submit(self, *values: Any, **fields: Any) -> None:
        """Record typed outputs; the workflow validates them against the episode's fields.
        A DSPy program's SUBMIT takes its fields by position too and ends the cell."""
        if self.dspy_outputs is not None:
            fields = dspy_submission(self.dspy_outputs, values, fields)
        elif values:
            raise TypeError("SUBMIT takes its fields by name: SUBMIT(field=value, ...)")
        try:
            json.dumps(fields)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"SUBMIT values must be JSON-serialisable: {exc}") from None
        self.submitted = fields
        if self.dspy_outputs is not None:
            raise Submitted
        print(f"SUBMIT received: {', '.join(sorted(fields)) or '(no fields)'}")

    @repl_helper("FINAL")
    def final_value(self, value: Any) -> None:
        """FINAL(x) in a cell: the answer is str(x), the value, not the name written."""
        self.final = ("final", text_of(value))

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
        self.final = ("final_var", text_of(self.namespace[key]))

    def init(self, message: dict[str, Any], context_fd: int | None = None) -> None:
        """The namespace from the host's init message: the context (from the worker's cached
        copy, opened before the layers: contexts.py), `random` seeded, the helpers and the
        episode's tools, and the host's limits."""
        context: Any = contexts.load_context(context_fd, message)
        random.seed(message.get("seed", 0))
        if message.get("variables_shown") is not None and message.get("variable_chars") is not None:
            self.variable_limits = (int(message["variables_shown"]), int(message["variable_chars"]))
        cap = message.get("child_batch_cap")
        self.child_batch_cap = int(cap) if cap is not None else None
        self.calls.limit(message)
        self.rlms = bool(message.get("rlms"))
        self.calls.own_errors = self.rlms
        self.namespace = {
            "__name__": "__main__",
            "__builtins__": __builtins__,
            "context": context,
            "answer": answers.AnswerDict(),
        }
        for name, method in _HELPERS.items():
            self.namespace[name] = getattr(self, method)
        self.namespace["ToolError"] = ToolError
        for spec in message.get("tools") or []:
            self.namespace[spec["name"]] = self.calls.tool(spec)
        outputs = message.get("dspy_outputs")
        if outputs is not None:
            # A DSPy program's inputs are variables of their own names, and `context` is
            # one of them or nothing.
            self.dspy_outputs = [str(name) for name in outputs]
            self.inputs = context if isinstance(context, dict) else {}
            del self.namespace["context"]
            self.namespace.update(self.inputs)
        self.reserved = set(self.namespace)
        if self.rlms:
            self.namespace["context_0"] = context  # rlms binds it, and `context` as its alias
        # The REPL's own functions, put back before every cell: code that overwrote one
        # (`llm_query = None`, by accident or not) does not cost the episode its helpers.
        self.helpers = {k: v for k, v in self.namespace.items() if callable(v) or k == "ToolError"}
        # `answer` is data (a snapshot saves it as the cells left it), not one of the REPL's own.
        self.initial = {k: v for k, v in self.namespace.items() if k not in ("__builtins__", "answer")}
        self.sandbox_dir = os.getcwd()
        watch_volatile_reads()

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
        self.namespace.update(self.inputs)  # a DSPy program's inputs, as each step is given them
        stdout, stderr = BoundedWriter(limit), BoundedWriter(limit)
        self.submitted, self.final = None, None
        error: str | None = None
        status = "ok"
        saved = sys.stdout, sys.stderr
        bound_before = {name: id(value) for name, value in self.namespace.items()}
        FLAGGED[0], self.calls.blocked_s, started = False, 0.0, WALL()

        def on_alarm(signum: int, frame: Any) -> None:
            raise CellTimeout(f"cell exceeded its {timeout:g} s time limit")

        signal.signal(signal.SIGALRM, on_alarm)
        sys.stdout, sys.stderr = stdout, stderr
        ready: str | None = None
        answers.start_cell()
        try:
            signal.setitimer(signal.ITIMER_REAL, timeout)
            try:
                self._run(code, cell_name)
            finally:
                # Inside the cell's time limit: a rebound `answer` may be a hostile dict.
                ready = answers.end_cell(self.namespace, self.rlms)
                if self.rlms:
                    self._put_back_aliases()
        except CellTimeout as exc:
            status, error = "timeout", f"TimeoutError: {exc}"
        except Submitted:
            pass  # a DSPy program's SUBMIT: the outputs are recorded
        except SystemExit:
            status, error = "error", "SystemExit: exiting the REPL is not allowed"
        except BaseException as exc:  # noqa: BLE001 - everything a cell raises is an observation
            status, error = "error", format_error(exc)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            sys.stdout, sys.stderr = saved
            sweep_strays()
        elapsed = max(0.0, WALL() - started - self.calls.blocked_s)
        volatile = FLAGGED[0] or volatile_source(code)
        if cell is not None:
            self._note_bindings(bound_before, cell)
        kind, answer = self.final if self.final is not None else ("answer_ready", ready)
        limits = self.variable_limits if summary else None
        return {
            "op": "done",
            "status": status,
            "stdout": stdout.getvalue(),
            "stderr": stderr.getvalue(),
            "error": clip(error),
            "answer": clip(answer),
            "answer_kind": kind if answer is not None else None,
            "submitted": self.submitted,
            "variables": self.variables_summary(*limits) if limits is not None else {},
            "elapsed": elapsed,
            "volatile": volatile,
        }

    def _put_back_aliases(self) -> None:
        """rlms's: a cell that rebinds `context` or `history` changes nothing after it;
        they are context_0 and history_0 again."""
        for alias, name in (("context", "context_0"), ("history", "history_0")):
            if name in self.namespace:
                self.namespace[alias] = self.namespace[name]

    def _note_bindings(self, before: dict[str, int], cell: int) -> None:
        """Which cell last bound each name: a rebuild re-runs it for a name no snapshot holds."""
        for name, value in self.namespace.items():
            if before.get(name) != id(value):
                self.defined_by[name] = cell
        for name in [n for n in self.defined_by if n not in self.namespace]:
            del self.defined_by[name]

    def variables_summary(self, limit: int, width: int) -> dict[str, str]:
        """A bounded text view of user variables, for termination policies: at most `limit`
        names, `width` characters each."""
        # Bounded as it is built: a large value is not rendered whole and then cut.
        shorten = reprlib.Repr()
        shorten.maxstring = shorten.maxother = width
        shorten.maxlist = shorten.maxtuple = shorten.maxset = shorten.maxdict = ITEMS_SHOWN
        summary: dict[str, str] = {}
        for name, value in list(self.namespace.items()):
            if len(summary) >= limit:
                break
            if name.startswith("_") or name in self.reserved - {"answer"}:
                continue
            if isinstance(value, (types.ModuleType, types.FunctionType, type)):
                continue
            if type(value) is answers.AnswerDict:
                value = dict(value)  # reprlib bounds a dict, not a subclass of one
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

    def read_variable(self, name: str) -> dict[str, Any]:
        if name not in self.namespace or name in self.reserved - {"context", "answer"}:
            return {"op": "var", "found": False}
        try:
            return {"op": "var", "found": True, "value": clip(str(self.namespace[name]))}
        except Exception as exc:  # noqa: BLE001
            return {"op": "var", "found": True, "value": f"<str() failed: {exc!r}>"}


def dspy_submission(names: list[str], values: tuple[Any, ...], fields: dict[str, Any]) -> dict[str, Any]:
    """SUBMIT's arguments as DSPy's interpreter takes them: all by position, in the output
    fields' order, or all by name, and exactly the output fields."""
    if values and fields:
        raise TypeError("SUBMIT accepts positional or keyword values, not both")
    given = dict(zip(names, values, strict=False)) if values else dict(fields)
    if set(given) != set(names) or len(values) > len(names):
        raise TypeError(f"SUBMIT takes exactly these fields: {', '.join(names)}")
    return given


def text_of(value: Any) -> str:
    try:
        return str(value)
    except Exception as exc:  # noqa: BLE001 - a hostile __str__
        return f"<answer could not be converted to text: {exc!r}>"


def clip(text: str | None) -> str | None:
    if text is None or len(text) <= FIELD_CHARS:
        return text
    return text[:FIELD_CHARS] + f"\n... [{len(text) - FIELD_CHARS:,} more characters truncated]"


def format_error(exc: BaseException) -> str:
    """The exception as a traceback of the cell's own frames (none of the sandbox's)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.startswith("<cell")]
    lines = traceback.format_list(frames) if frames else []
    detail = "".join(traceback.format_exception_only(type(exc), exc))
    return ("Traceback (most recent call last):\n" + "".join(lines) if lines else "") + detail.rstrip()
