"""The sandbox process: runs model-written code for one episode.

Started by the worker as `python -s -P child.py PARENT_PID DIR`, or forked from a template
process (forkserver.py) that has already imported this module; both then run `serve`.
Standard library only, so nothing of the worker (settings, credentials, clients) is
importable here. It talks to its host over length-prefixed JSON frames (framing.py) on the
original stdin/stdout; file descriptors 0 and 1 are then pointed at /dev/null so stray
writes from cells cannot corrupt the channel.

This file is the entry only: it loads its sibling modules as the package `drlm_sandbox`
(`_load_siblings`), puts the isolation layers in place (layers.py, kernel.py, cgroups.py),
and serves the host's requests with the episode's session (session.py, host_calls.py,
rebuild.py). The reaper knows sandboxes by this file's name on their command line.

Isolation, strongest first: a network namespace with no interfaces (when permitted), an
unprivileged uid when started as root, resource limits, and an audit hook that refuses
sockets, processes, signals to other processes, ctypes, and file access outside the
sandbox directory (reads of the Python installation excepted).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from typing import NoReturn

PACKAGE = "drlm_sandbox"
"""The name activities/sandbox/ has inside a sandbox."""


def _load_siblings() -> None:
    """activities/sandbox/ as the package `drlm_sandbox`, so its modules import one another
    (relative imports) here as they do in the worker: under -P no directory of ours is on
    sys.path, and nothing of the worker's packages may be imported here. Its __init__ is
    not run (nothing in it is the sandbox's). Loaded before any layer is in place, while
    every file is in reach."""
    sys.dont_write_bytecode = True  # it writes nothing but in its own directory: no bytecode
    if PACKAGE not in sys.modules:
        spec = importlib.machinery.ModuleSpec(PACKAGE, None, is_package=True)
        spec.submodule_search_locations = [os.path.dirname(os.path.abspath(__file__))]
        sys.modules[PACKAGE] = importlib.util.module_from_spec(spec)


def _sibling(name: str) -> ModuleType:
    return importlib.import_module(f"{PACKAGE}.{name}")


_load_siblings()
framing = _sibling("framing")
layers = _sibling("layers")
session = _sibling("session")
contexts = _sibling("contexts")
rebuild = _sibling("rebuild")


def serve(parent_pid: int, sandbox_dir: str) -> NoReturn:
    """The sandbox's whole life once its process exists, spawned or forked alike: the
    channel on fds 0/1, the layers, the session, the loop. It never returns."""
    sys.dont_write_bytecode = True
    channel_in = os.fdopen(os.dup(0), "rb")
    channel_out = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)

    init = framing.read_frame(channel_in)
    if init is None or init.get("op") != "init":
        os._exit(2)
    repl = session.Session(channel_in, channel_out)
    try:
        # The worker's cached context is opened first: once the layers are in place its
        # files are out of reach (contexts.py). No code of the model has run yet.
        context_fd = contexts.open_context(init)
        started = layers.start_layers(init, parent_pid, sandbox_dir)
        repl.init(init, context_fd)
    except (layers.LayerError, OSError, ValueError, MemoryError) as exc:
        framing.write_frame(channel_out, {"op": "failed", "error": f"{type(exc).__name__}: {exc}"})
        os._exit(4)
    framing.write_frame(
        channel_out, {"op": "ready", "layers": started, "network": started["network"], "uid": os.getuid()}
    )

    while True:
        message = framing.read_frame(channel_in)
        if message is None or message["op"] == "shutdown":
            os._exit(0)
        if message["op"] == "exec":
            reply = repl.execute(
                message["code"],
                message["cell_name"],
                float(message["timeout"]),
                int(message["limit"]),
                summary=bool(message.get("summary", True)),
                cell=message.get("cell"),
            )
        elif message["op"] == "snapshot":
            reply = rebuild.snapshot(repl, message)
        elif message["op"] == "restore":
            reply = rebuild.restore(repl, message)
        elif message["op"] == "replay":
            reply = rebuild.replay(repl, list(message["cells"]))
        elif message["op"] == "read_var":
            reply = repl.read_variable(str(message["name"]))
        else:
            reply = {"op": "error", "error": f"unknown op {message['op']!r}"}
        framing.write_frame(channel_out, reply)


def main() -> None:
    serve(int(sys.argv[1]), sys.argv[2])


if __name__ == "__main__":
    main()
