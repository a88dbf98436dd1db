"""The fork server: a template process that forks ready-made sandboxes.

Started by the worker as `python -s -P forkserver.py WORKER_PID` with a clean environment and
its control channel (an AF_UNIX SOCK_SEQPACKET socket) on fd 0. It imports child.py, runs
`preload_modules()` and loads libc once, then forks one sandbox per request: the interpreter
start, the imports and the libc load are paid once per worker instead of once per sandbox,
and the forked sandboxes share those pages copy-on-write.

A forked sandbox runs exactly the code a spawned one runs (`child.serve`): every isolation
layer (network namespace, rlimits, uid drop, parent-death signal, audit hook) is put in place
after the fork, in the sandbox itself. The template is single-threaded (`unshare` of a user
namespace refuses a threaded caller, and a fork copies only the calling thread), holds no
credential, never runs model code, and only ever sees sandbox directories and their
four-variable environment: contexts and code go to the sandbox over its own pipes.

Messages are one JSON object per packet. The host sends `fork` (with the sandbox's stdin,
stdout and stderr as SCM_RIGHTS fds) and `kill`; the template answers `ready`, `forked`,
`refused`, and reports every sandbox's end as `exit` (it is their parent and reaps them, so
a pid it is asked to kill is never a reused one). Death chain: the template dies with the
worker (PR_SET_PDEATHSIG), each sandbox with the template; the template also exits, killing
its sandboxes, when the host closes the channel.

Standard library only.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import os
import selectors
import signal
import socket
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

CHILD_PATH = Path(__file__).with_name("child.py")
MAX_MESSAGE = 64 * 1024  # one control packet; requests are a path and four variables
CHILD_MODULE = "drlm_sandbox_child"


def encode(message: dict[str, Any]) -> bytes:
    data = json.dumps(message).encode("utf-8")
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"fork-server message of {len(data)} bytes is over {MAX_MESSAGE}")
    return data


def decode(data: bytes) -> dict[str, Any]:
    message = json.loads(data.decode("utf-8"))
    if not isinstance(message, dict) or "op" not in message:
        raise ValueError("malformed fork-server message")
    return message


def load_child() -> ModuleType:
    """child.py by its path: under -P the script's directory is not on sys.path."""
    spec = importlib.util.spec_from_file_location(CHILD_MODULE, CHILD_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[CHILD_MODULE] = module
    spec.loader.exec_module(module)
    return module


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


class Template:
    def __init__(self, child: ModuleType, control: socket.socket) -> None:
        self.child = child
        self.control = control
        self.children: set[int] = set()
        self.pid = os.getpid()
        self.max_fd = max(os.sysconf("SC_OPEN_MAX"), 1024)

    def send(self, message: dict[str, Any]) -> None:
        self.control.send(encode(message))

    def run(self) -> NoReturn:
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # the wakeup fd says it
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        selector = selectors.DefaultSelector()
        selector.register(self.control, selectors.EVENT_READ, "control")
        selector.register(wake_r, selectors.EVENT_READ, "children")
        self.send({"op": "ready", "pid": self.pid})
        while True:
            for key, _ in selector.select():
                if key.data == "children":
                    os.read(wake_r, 4096)
                    self.reap()
                else:
                    self.serve_one()
            self.reap()  # a SIGCHLD that raced the select is not left for later

    def serve_one(self) -> None:
        try:
            data, fds, flags, _ = socket.recv_fds(self.control, MAX_MESSAGE, 3)
        except ConnectionError:
            data, fds, flags = b"", [], 0
        if not data:
            self.shutdown()
        message: dict[str, Any] = {}
        try:
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise ValueError("truncated fork-server request")
            message = decode(data)
            if message["op"] == "fork":
                self.fork(message, fds)
            elif message["op"] == "kill":
                pid = int(message["pid"])
                if pid in self.children:  # not reaped yet: the pid is still this sandbox's
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pid, signal.SIGKILL)  # and what it forked (its group)
                    os.kill(pid, signal.SIGKILL)
            else:
                raise ValueError(f"unknown fork-server op {message['op']!r}")
        except Exception as exc:  # noqa: BLE001 - a bad request is refused, the template goes on
            self.send({"op": "refused", "id": message.get("id"), "error": f"{type(exc).__name__}: {exc}"})
        finally:
            for fd in fds:
                os.close(fd)

    def fork(self, message: dict[str, Any], fds: list[int]) -> None:
        directory, env = str(message["directory"]), dict(message["env"])
        if len(fds) != 3 or min(fds) < 3:
            raise ValueError("a fork request carries the sandbox's stdin, stdout and stderr")
        if threads() != 1:
            raise RuntimeError("the template is not single-threaded; refusing to fork")
        sys.stdout.flush()
        sys.stderr.flush()
        gc.collect()  # only what came since the last freeze: frozen objects are not scanned
        gc.freeze()  # so a sandbox's collections never write to the pages it shares
        pid = os.fork()
        if pid == 0:
            self.become_sandbox(directory, env, fds)
        self.children.add(pid)
        self.send({"op": "forked", "id": message["id"], "pid": pid})

    def become_sandbox(self, directory: str, env: dict[str, str], fds: list[int]) -> NoReturn:
        """In the forked child: only the sandbox's own fds, its own session and environment,
        then the same path as a spawned sandbox."""
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            self.control.detach()  # its fd is closed below; the object must not close it again
            os.closerange(3, self.max_fd)
            os.setsid()
            os.environ.clear()
            os.environ.update(env)
            os.chdir(directory)
            sys.argv = [str(CHILD_PATH), str(self.pid), directory]
            gc.enable()
            self.child.serve(self.pid, directory)
        except BaseException:  # noqa: BLE001 - told on the sandbox's stderr (sandbox.err)
            traceback.print_exc()
            sys.stderr.flush()
        os._exit(5)

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.discard(pid)
            self.send({"op": "exit", "pid": pid, "code": os.waitstatus_to_exitcode(status)})

    def shutdown(self) -> NoReturn:
        """The host closed the channel: its sandboxes go with the template."""
        for pid in self.children:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            os.kill(pid, signal.SIGKILL)
        os._exit(0)


def main() -> None:
    worker_pid = int(sys.argv[1])
    sys.dont_write_bytecode = True
    gc.disable()  # no collection holes in pages the sandboxes will share (re-enabled in each)
    control = socket.socket(fileno=os.dup(0))
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.close(devnull)

    child = load_child()  # and with it every module a sandbox runs (layers, kernel, cgroups...)
    layers = child.layers
    layers.preload_modules()
    layers.kernel.readonly_sources()  # warms what each sandbox's private root is made of
    libc = layers.load_libc()
    layers.readable_roots("/")  # warms sysconfig, which each sandbox's file guard reads

    layers.die_with_parent(worker_pid, libc)  # exits if the worker is already gone
    gc.collect()
    gc.freeze()
    Template(child, control).run()


if __name__ == "__main__":
    main()
