"""REPL snapshots, inside the sandbox: the namespace pickled to a file, and loaded back.

Runs only in a sandbox process (rebuild.py there): a snapshot is bytes that
model-written code shaped (any `__reduce__` runs here), so it is made and loaded where that
code already runs, never in the worker. The worker stores the file, signs it, and checks
the signature before handing it to a sandbox of the same episode.

cloudpickle, not dill: it pickles what cells define (functions, lambdas, classes of
`__main__`) by value and everything else with the C pickler. dill's pure-Python pickler
took 5.3 s where cloudpickle took 0.33 s for 68 MB of ordinary data (the same load time).
zstd (level 1), not zlib: on 84 MB of pickled variables, half of it random bytes, zlib
level 1 took 1.75 s to compress and 0.23 s to decompress, zstd 0.17 s and 0.10 s.

A snapshot holds: every user name it can pickle (in one pickle, so shared references stay
shared), the `random` module's state, the files the cells wrote in the sandbox directory,
and which cell last bound each name. Names that cannot be pickled are listed with the reason
and the cell that bound them; a rebuild re-runs that cell for them. The REPL's helpers
(`llm_query`, tools, `context`...) are stored as references to the loading sandbox's own.
"""

from __future__ import annotations

import os
import pickle
import random
import sys
import types
from typing import Any

import cloudpickle
import zstandard

FORMAT = 1
SKIPPED_FILES = ("sandbox.err",)
SNAPSHOT_PREFIX = ".drlm-snapshot-"


class SnapshotError(RuntimeError):
    """The snapshot could not be written or loaded; the message says why."""


class _Discard:
    def write(self, data: bytes) -> int:
        return len(data)


class _Pickler(cloudpickle.Pickler):
    def __init__(self, file: Any, helpers: dict[int, str]) -> None:
        super().__init__(file, protocol=5)
        self.helpers = helpers

    def persistent_id(self, obj: Any) -> str | None:
        return self.helpers.get(id(obj))


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: Any, helpers: dict[str, Any]) -> None:
        super().__init__(file)
        self.helpers = helpers

    def persistent_load(self, pid: Any) -> Any:
        if pid not in self.helpers:
            raise pickle.UnpicklingError(f"the snapshot names an unknown REPL helper {pid!r}")
        return self.helpers[pid]


def _dynamic_module(value: types.ModuleType, sandbox_dir: str) -> bool:
    """A module a fresh sandbox could not import by name: made at run time, or loaded from
    the sandbox directory."""
    spec = getattr(value, "__spec__", None)
    origin = getattr(spec, "origin", None) or getattr(value, "__file__", None)
    if sys.modules.get(value.__name__) is not value:
        return True
    if spec is None and value.__name__ not in sys.builtin_module_names:
        return True
    if not origin or not os.path.isabs(str(origin)):
        return False  # built-in, frozen
    return os.path.normpath(str(origin)).startswith(os.path.normpath(sandbox_dir) + os.sep)


def _why_not(value: Any, helpers: dict[int, str]) -> str | None:
    """Why this one value cannot be pickled (None: it can)."""
    try:
        _Pickler(_Discard(), helpers).dump(value)
    except RecursionError:
        return "too deeply nested to pickle"
    except Exception as exc:  # noqa: BLE001 - whatever a __reduce__ raises
        text = f"{type(exc).__name__}: {exc}"
        return text if len(text) <= 200 else text[:197] + "..."
    return None


def _files(sandbox_dir: str, cap_bytes: int) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    total = 0
    for root, _dirs, names in os.walk(sandbox_dir):
        for name in names:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, sandbox_dir)
            if rel in SKIPPED_FILES or name.startswith(SNAPSHOT_PREFIX) or not os.path.isfile(path):
                continue
            total += os.path.getsize(path)
            if total > cap_bytes:
                raise SnapshotError(
                    f"the files in the sandbox directory pass {cap_bytes // 2**20} MB: not saved"
                )
            with open(path, "rb") as handle:
                files[rel] = handle.read()
    return files


def take(
    path: str,
    namespace: dict[str, Any],
    initial: dict[str, Any],
    defined_by: dict[str, int],
    sandbox_dir: str,
    files_cap_bytes: int,
) -> dict[str, Any]:
    """Write the snapshot to `path`; returns {size, unsaved: {name: [cell, reason]}}."""
    helpers = {id(value): name for name, value in initial.items()}
    anchor = types.FunctionType(compile("pass", "<snapshot>", "exec"), namespace)  # shares the globals
    names: dict[str, Any] = {}
    unsaved: dict[str, list[Any]] = {}
    for name, value in namespace.items():
        if name == "__builtins__" or (name in initial and initial[name] is value):
            continue
        if isinstance(value, types.ModuleType) and _dynamic_module(value, sandbox_dir):
            unsaved[name] = [defined_by.get(name), "a module imported dynamically"]
            continue
        names[name] = value
    state = {
        "format": FORMAT,
        "anchor": anchor,
        "names": names,
        "random": random.getstate(),
        "defined_by": dict(defined_by),
        "files": _files(sandbox_dir, files_cap_bytes),
    }
    for attempt in range(2):
        try:
            with open(path, "wb") as raw, zstandard.ZstdCompressor(level=1).stream_writer(raw) as sink:
                _Pickler(sink, helpers).dump(state)
            break
        except Exception as exc:  # noqa: BLE001 - a value refused to pickle: find which
            if attempt:
                raise SnapshotError(
                    f"the namespace could not be pickled: {type(exc).__name__}: {exc}"
                ) from None
            for name in list(names):
                reason = _why_not(names[name], helpers)
                if reason is not None:
                    unsaved[name] = [defined_by.get(name), reason]
                    del names[name]
    return {"size": os.path.getsize(path), "unsaved": unsaved}


def load(
    path: str, initial: dict[str, Any], sandbox_dir: str
) -> tuple[dict[str, Any], dict[str, int], dict[str, bytes]]:
    """The namespace a snapshot holds (the helpers bound to this sandbox's), with the files
    put back and `random` where it was; returns (namespace, defined_by, files)."""
    with open(path, "rb") as handle, zstandard.ZstdDecompressor().stream_reader(handle) as stream:
        state = _Unpickler(stream, initial).load()
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise SnapshotError("not a snapshot of this format")
    put_files(state["files"], sandbox_dir)
    namespace = state["anchor"].__globals__  # the functions' globals: it must become the namespace
    namespace.clear()
    namespace.update(initial)
    namespace.update(state["names"])
    random.setstate(state["random"])
    return namespace, dict(state["defined_by"]), state["files"]


def put_files(files: dict[str, bytes], sandbox_dir: str) -> None:
    root = os.path.normpath(sandbox_dir)
    for rel, content in files.items():
        target = os.path.normpath(os.path.join(root, rel))
        if not target.startswith(root + os.sep):
            continue
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as handle:
            handle.write(content)
