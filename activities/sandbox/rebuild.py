"""The sandbox's part of a rebuild: snapshot the namespace, restore one, replay cells.

The worker decides when (activities/repl_snapshots.py, repl_rebuild.py) and checks a
snapshot's signature before handing it over; here the namespace is pickled and loaded (by
snapshot.py, in the sandbox: a snapshot is bytes model code shaped), and cells are re-run
with their calls answered from the log, so no model is called again (DESIGN invariant 3).
Standard library only, like everything the sandbox loads (snapshot.py's cloudpickle is
optional: without it a snapshot fails and the worker re-runs cells instead).
"""

from __future__ import annotations

import contextlib
import importlib
import os
from types import ModuleType
from typing import Any

from .answer import AnswerDict, rewrap
from .kernel import HOST_FILES
from .session import Session


def snapshots() -> ModuleType:
    """activities/sandbox/snapshot.py: loaded with the preloaded modules if cloudpickle is
    installed (layers.preload_modules); an ImportError here says it is not."""
    return importlib.import_module(".snapshot", __package__)


def snapshot(session: Session, message: dict[str, Any]) -> dict[str, Any]:
    """Pickle the namespace to the file the host named; too large a snapshot is removed."""
    path = os.path.join(session.sandbox_dir, str(message["name"]))
    try:
        taken = snapshots().take(
            path,
            session.namespace,
            session.initial,
            session.defined_by,
            session.sandbox_dir,
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


def host_file(session: Session, name: str) -> str:
    """A file the host wrote for the sandbox: in its own directory, or, when that is a tmpfs
    of its own (kernel.py), where the host's side of it is seen read-only."""
    if os.path.isdir(HOST_FILES):
        return os.path.join(HOST_FILES, name)
    return os.path.join(session.sandbox_dir, name)


def restore(session: Session, message: dict[str, Any]) -> dict[str, Any]:
    """Load a snapshot, then re-run the cells that bound the names it could not hold,
    keeping only those names from each (everything else stays as the snapshot has it)."""
    path = host_file(session, str(message["name"]))
    try:
        # Older snapshots refer to the REPL's first `answer` as one of its own names.
        known = {**session.initial, "answer": AnswerDict()}
        session.namespace, session.defined_by, files = snapshots().load(path, known, session.sandbox_dir)
        session.namespace["__builtins__"] = __builtins__
        rewrap(session.namespace, session.rlms)
    except BaseException as exc:  # noqa: BLE001 - the host falls back to re-running cells
        return {"op": "restore_failed", "error": f"{type(exc).__name__}: {exc}"[:500]}
    finally:
        with contextlib.suppress(OSError):
            os.remove(path)
    calls = session.calls
    notes: dict[str, str] = {}
    for cell in message.get("recreate", []):
        wanted = set(cell["names"])
        kept = dict(session.namespace)
        calls.recorded, calls.asked = list(cell["answers"]), []
        try:
            done = session.execute(
                cell["code"], cell["cell_name"], float(cell["timeout"]), int(cell["limit"])
            )
        finally:
            calls.recorded, calls.asked = None, []
        for name in set(session.namespace) | set(kept):
            if name in wanted:
                continue
            if name in kept:
                session.namespace[name] = kept[name]
            else:
                del session.namespace[name]
        for name in sorted(wanted):
            if name in session.namespace:
                session.defined_by[name] = int(cell["cell"])
                notes[name] = f"re-created by re-running cell {cell['cell']}"
            else:
                problem = done.get("error") or "the cell did not bind it"
                notes[name] = f"lost: re-running cell {cell['cell']} did not re-create it ({problem})"
    if message.get("recreate"):
        # The re-run cells may have written files: they are as the snapshot has them.
        snapshots().put_files(files, session.sandbox_dir)
    return {"op": "restored", "notes": notes}


def replay(session: Session, cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Re-run finished cells to rebuild the namespace, in one exchange with the host: their
    calls are answered from the answers logged with them. Reports what each cell asked,
    so the host can tell where the code diverged from the log."""
    calls = session.calls
    report = []
    try:
        for cell in cells:
            calls.recorded, calls.asked = list(cell["answers"]), []
            done = session.execute(
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
                    "asked": calls.asked,
                    "elapsed": done["elapsed"],
                    "volatile": done["volatile"],
                }
            )
    finally:
        calls.recorded, calls.asked = None, []
    return {"op": "replayed", "cells": report}
