"""Which REPL cells a person should see before they run (`--approve risky`).

It runs in workflow code, so it is pure and deterministic: one `ast.parse` and one walk,
linear in the cell's size. It is static because nothing of the cell may run before the
approval. It is a triage aid, not a boundary: the sandbox is the security boundary, and
`--approve all` gates every cell. Flagged: file writes and deletes, processes, networking
and native code, code chosen at run time, and loops without an end or of ten million turns
or more (nested loops multiplied).

What it flags decides which cells of a `risky` episode wait, so it is part of history:
after a release, a change to it needs a new workflow version like any other change to
workflow code (docs: "Versioning").
Figures: bench/risk.py (about 1.2 ms per KB, 2-3x `ast.parse` alone).
"""

from __future__ import annotations

import ast

MAX_REASONS = 20
MAX_ASSESSED_CHARS = 100_000  # ~0.2 s to parse; a larger cell is flagged unread (parsing 1 MB takes >1 s)
LONG_LOOP = 10_000_000

_WRITE_MODES = frozenset("wax+")
_OS_WRITES = frozenset(
    {
        "remove", "unlink", "rmdir", "removedirs", "rename", "renames", "replace", "truncate",
        "chmod", "chown", "link", "symlink", "mkdir", "makedirs", "write",
    }
)  # fmt: skip
_OS_PROCESSES = frozenset({"system", "popen", "fork", "forkpty", "kill", "killpg"})
_OS_PROCESS_PREFIXES = ("exec", "spawn", "posix_spawn")
_PATH_WRITES = frozenset(
    {"write_text", "write_bytes", "unlink", "rmdir", "touch", "mkdir", "rename", "replace"}
)
_SHUTIL_WRITES = frozenset(
    {
        "copy", "copy2", "copyfile", "copytree", "copymode", "copystat", "move", "rmtree",
        "chown", "make_archive", "unpack_archive",
    }
)  # fmt: skip
_DATA_WRITES = frozenset(
    {
        "to_csv", "to_json", "to_parquet", "to_excel", "to_pickle", "to_hdf", "to_feather",
        "to_sql", "savefig", "save", "savez", "savez_compressed", "savetxt", "tofile",
    }
)  # fmt: skip
_STAR_WRITES = {"os": _OS_WRITES, "shutil": _SHUTIL_WRITES}
_PROCESS_MODULES = frozenset({"subprocess", "multiprocessing", "pty", "signal", "pexpect"})
_NATIVE_OR_NETWORK = frozenset(
    {
        "socket", "ssl", "http", "urllib", "urllib3", "requests", "httpx", "aiohttp", "ftplib",
        "smtplib", "telnetlib", "xmlrpc", "asyncio", "websocket", "websockets", "paramiko",
        "ctypes", "_ctypes", "cffi", "mmap", "socketserver", "imaplib", "poplib",
    }
)  # fmt: skip
_DYNAMIC = frozenset({"__import__", "exec", "eval", "compile"})
_ENDLESS = frozenset({"count", "cycle", "repeat"})


def assess(code: str) -> list[str]:
    """Reasons this cell is risky, in source order, de-duplicated; [] when it is not."""
    if len(code) > MAX_ASSESSED_CHARS:
        return [f"too large to assess ({len(code):,} characters): read it before approving"]
    try:
        tree = ast.parse(code)
    except SyntaxError as exc:
        where = f" (line {exc.lineno})" if exc.lineno else ""
        return [f"does not parse: {exc.msg}{where}"]
    except (RecursionError, MemoryError):
        return ["too deeply nested to assess"]
    except ValueError as exc:  # null bytes, on Pythons before 3.12
        return [f"does not parse: {exc}"]
    try:
        return _Assessor(tree).reasons()
    except RecursionError:
        return ["too deeply nested to assess"]


class _Assessor:
    def __init__(self, tree: ast.Module) -> None:
        self.tree = tree
        self.modules: dict[str, str] = {}  # local name -> module it names
        self.names: dict[str, str] = {}  # local name -> "module.attr" it was imported as
        self.found: dict[str, tuple[int, int]] = {}  # reason -> where it first shows
        self.parents: dict[ast.AST, ast.AST] = {}
        self.turns: dict[ast.AST, int] = {}  # a range loop -> its turns, times its enclosing loops'

    def reasons(self) -> list[str]:
        nodes = list(ast.walk(self.tree))
        for node in nodes:  # aliases first: `from os import remove` may follow its use in a def
            if isinstance(node, ast.Import):
                for alias in node.names:
                    self.modules[alias.asname or alias.name.split(".")[0]] = (
                        alias.name if alias.asname else alias.name.split(".")[0]
                    )
            elif isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    if alias.name == "*":  # `from os import *`: its writing names come bare
                        for leaf in _STAR_WRITES.get(node.module, ()):
                            self.names.setdefault(leaf, f"{node.module}.{leaf}")
                    else:
                        self.names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        for node in nodes:
            self._visit(node)
        reasons = sorted(self.found, key=self.found.__getitem__)
        if len(reasons) > MAX_REASONS:
            return [*reasons[:MAX_REASONS], f"... and {len(reasons) - MAX_REASONS} more"]
        return reasons

    def _flag(self, node: ast.AST, what: str) -> None:
        line, column = getattr(node, "lineno", 0), getattr(node, "col_offset", 0)
        self.found.setdefault(f"line {line}: {what}", (line, column))

    def _visit(self, node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                self._module(node, alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            self._module(node, node.module)
        elif isinstance(node, ast.Call):
            self._call(node)
        elif isinstance(node, ast.While) and isinstance(node.test, ast.Constant) and node.test.value:
            self._flag(node, "loop without an end (while True)")
        elif isinstance(node, ast.For | ast.AsyncFor):
            self._loop(node)

    def _module(self, node: ast.AST, name: str) -> None:
        top = name.split(".")[0]
        if top in _PROCESS_MODULES:
            self._flag(node, f"imports {name} (starts processes)")
        elif top in _NATIVE_OR_NETWORK:
            self._flag(node, f"imports {name} (network or native code)")

    def _qualified(self, func: ast.expr) -> str | None:
        """`module.attr` a call names through the cell's imports, or the bare builtin name."""
        if isinstance(func, ast.Name):
            return self.names.get(func.id, func.id)
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            base = self.modules.get(func.value.id) or self.names.get(func.value.id)
            if base is not None:
                return f"{base}.{func.attr}"
        return None

    def _call(self, node: ast.Call) -> None:
        name = self._qualified(node.func)
        attr = node.func.attr if isinstance(node.func, ast.Attribute) else None
        if name in ("open", "io.open", "builtins.open") or attr == "open" and name is None:
            self._open(node)
        elif name is not None and name.startswith("os."):
            leaf = name[3:]
            if leaf in _OS_WRITES:
                self._flag(node, f"writes or deletes files ({name})")
            elif leaf in _OS_PROCESSES or leaf.startswith(_OS_PROCESS_PREFIXES):
                self._flag(node, f"starts or signals processes ({name})")
        elif name is not None and name.startswith("shutil."):
            if name[7:] in _SHUTIL_WRITES:
                self._flag(node, f"writes or deletes files ({name})")
        elif name is not None and name.split(".")[0] in _PROCESS_MODULES and "." in name:
            self._flag(node, f"starts processes ({name})")
        elif name in _DYNAMIC or name in ("importlib.import_module", "builtins.__import__"):
            self._flag(node, f"runs code chosen at run time ({name})")
        elif name in ("getattr", "setattr", "delattr") and len(node.args) >= 2:
            if not isinstance(node.args[1], ast.Constant):
                self._flag(node, f"runs code chosen at run time ({name} of a computed name)")
        elif attr in _PATH_WRITES:
            self._flag(node, f"writes or deletes files (.{attr})")
        elif attr in _DATA_WRITES and (node.args or node.keywords):
            self._flag(node, f"writes a file (.{attr})")

    def _open(self, node: ast.Call) -> None:
        mode: ast.expr | None = node.args[1] if len(node.args) > 1 else None
        for keyword in node.keywords:
            if keyword.arg == "mode":
                mode = keyword.value
        if isinstance(node.func, ast.Attribute) and node.args:  # Path(...).open(mode)
            mode = node.args[0] if mode is None or len(node.args) == 1 else mode
        if mode is None:
            return  # read-only by default
        if not isinstance(mode, ast.Constant) or not isinstance(mode.value, str):
            self._flag(node, "opens a file with a mode chosen at run time")
        elif _WRITE_MODES & set(mode.value):
            self._flag(node, f"writes a file (open(..., {mode.value!r}))")

    def _loop(self, node: ast.For | ast.AsyncFor) -> None:
        source = node.iter
        if not isinstance(source, ast.Call):
            return
        name = self._qualified(source.func)
        if name in ("itertools.count", "itertools.cycle") or (
            name == "itertools.repeat" and len(source.args) < 2 and not source.keywords
        ):
            self._flag(node, f"loop without an end ({name})")
        elif name == "range":
            count = _range_length(source)
            if count is None:
                return
            # Nested loops multiply: range(10**4) inside range(10**4). ast.walk visits an
            # enclosing loop first, so its total is known: each range is evaluated once.
            outer = self.parents.get(node)
            while outer is not None and outer not in self.turns:
                outer = self.parents.get(outer)
            total = min(count * self.turns[outer], _HUGE) if outer is not None else count
            self.turns[node] = total
            if total >= LONG_LOOP:
                nested = "" if total == count else " counting the loops around it"
                self._flag(node, f"very long loop ({total:,} iterations{nested})")


_HUGE = 10**30  # larger constants are all "huge"; clamping keeps the arithmetic cheap


def _integer(node: ast.expr) -> int | None:
    """A constant integer expression's value (`10**8`, `1_000 * 1_000`, `int(1e9)`), clamped."""
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
            return None
        return max(-_HUGE, min(_HUGE, int(value))) if abs(value) != float("inf") else None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _integer(node.operand)
        return None if inner is None else -inner
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "int":
        return _integer(node.args[0]) if len(node.args) == 1 and not node.keywords else None
    if not isinstance(node, ast.BinOp):
        return None
    left, right = _integer(node.left), _integer(node.right)
    if left is None or right is None:
        return None
    if isinstance(node.op, ast.Pow):
        if right < 0:
            return None
        if abs(left) <= 1 or right <= 100:  # cheap: at most 100 multiplications of clamped values
            value = left**right
        else:
            value = _HUGE if left > 0 or right % 2 == 0 else -_HUGE
    elif isinstance(node.op, ast.Add):
        value = left + right
    elif isinstance(node.op, ast.Sub):
        value = left - right
    elif isinstance(node.op, ast.Mult):
        value = left * right
    elif isinstance(node.op, ast.FloorDiv) and right:
        value = left // right
    else:
        return None
    return max(-_HUGE, min(_HUGE, value))


def _range_length(call: ast.Call) -> int | None:
    values = []
    for arg in call.args:
        value = _integer(arg)
        if value is None:
            return None
        values.append(value)
    if len(values) == 1:
        return max(values[0], 0)
    if len(values) in (2, 3):
        step = values[2] if len(values) == 3 else 1
        return max((values[1] - values[0]) // step, 0) if step else None
    return None
