"""The sandbox processes a worker holds, spawned or forked from a template.

A spawned sandbox is `python -s -P child.py WORKER_PID DIR`: ~110 ms and ~20 MB each, all of
it its own. A forked one comes from a fork server (activities/sandbox/forkserver.py) that
has paid the interpreter start and the imports once; it shares those pages copy-on-write.
Both run the same sandbox code (`child.serve`) with the same layers. `SandboxProcess` is what
the REPL host needs of either: the pid, the channel (stdin writer, stdout reader), the exit
code, kill and wait, so frames, kills and "the REPL process exited (code N)" read the same.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from durable_rlm.activities.sandbox import CHILD_PATH, FORKSERVER_PATH, cgroups
from durable_rlm.activities.sandbox.forkserver import MAX_MESSAGE, decode, encode
from durable_rlm.activities.sandbox_reaper import UID_CLAIMS, forget_stale_uid_claims
from durable_rlm.host.processes import proc_stat

log = logging.getLogger(__name__)

HASH_SEED = "0"
"""Every sandbox, spawned or forked, on any worker, hashes str and bytes the same way, so a
REPL rebuilt elsewhere iterates its sets in the same order (a template's children could not
each have their own seed anyway: the seed is fixed when the interpreter starts)."""


INTERPRETER_FLAGS = ("-s", "-P")
"""`-I` without its `-E`: no user site-packages, no script directory on sys.path. `-E` would
also drop PYTHONHASHSEED, the one PYTHON* variable there is: the environment is entirely
`sandbox_env`, so ignoring the environment would add nothing but a random hash seed."""


def sandbox_env(home: Path) -> dict[str, str]:
    """The whole environment of a sandbox (and of the template): nothing of the worker's."""
    return {"PATH": "/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8", "PYTHONHASHSEED": HASH_SEED}


class SandboxProcess(Protocol):
    """What the REPL host needs of a sandbox process, however it was started."""

    kind: str  # "spawn" or "fork"

    @property
    def pid(self) -> int: ...

    @property
    def stdin(self) -> asyncio.StreamWriter: ...

    @property
    def stdout(self) -> asyncio.StreamReader: ...

    @property
    def returncode(self) -> int | None:
        """None while it runs; then its exit status, or -N when signal N ended it."""

    def kill(self) -> None:
        """SIGKILL it (no-op once it ended)."""

    async def wait(self) -> int: ...

    def close(self) -> None:
        """Release the host's ends of its pipes (after it ended)."""


class SpawnedProcess:
    kind = "spawn"
    leaf: cgroups.Leaf | None = None  # its cgroup (activities/sandbox/cgroups.py), if any

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self._process = process

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def stdin(self) -> asyncio.StreamWriter:
        assert self._process.stdin is not None
        return self._process.stdin

    @property
    def stdout(self) -> asyncio.StreamReader:
        assert self._process.stdout is not None
        return self._process.stdout

    @property
    def returncode(self) -> int | None:
        return self._process.returncode

    def kill(self) -> None:
        if self._process.returncode is None:
            # Its whole process group while it leads one (it cannot leave it: seccomp
            # refuses setsid), so what it forked goes with it.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._process.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                self._process.kill()

    async def wait(self) -> int:
        return await self._process.wait()

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        if self.leaf is not None:
            leaf, self.leaf = self.leaf, None
            leaf.remove()


async def spawn_sandbox(directory: Path, env: dict[str, str], limit: int) -> SpawnedProcess:
    """A fresh interpreter for one sandbox; its death signal is tied to this worker."""
    with open(directory / "sandbox.err", "wb") as stderr:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            *INTERPRETER_FLAGS,
            str(CHILD_PATH),
            str(os.getpid()),
            str(directory),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
            env=env,
            cwd=directory,
            start_new_session=True,
            limit=limit,
        )
    spawned = SpawnedProcess(process)
    spawned.leaf = cgroups.place(process.pid, cgroups.leaf_name(directory))  # before its init
    return spawned


class ForkServerError(RuntimeError):
    """The template could not be started, or could not fork a sandbox."""


class ForkedProcess:
    """A sandbox forked by the template: its pipes are the host's, its exit code is what the
    template (its parent, which reaps it) reports."""

    kind = "fork"
    leaf: cgroups.Leaf | None = None  # its cgroup (activities/sandbox/cgroups.py), if any

    def __init__(
        self,
        server: ForkServer,
        pid: int,
        stdin: asyncio.StreamWriter,
        stdout: asyncio.StreamReader,
        transports: list[asyncio.BaseTransport],
        exited: asyncio.Future[int],
    ) -> None:
        self._server = server
        self._pid = pid
        self._stdin = stdin
        self._stdout = stdout
        self._transports = transports
        self._exited = exited

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def stdin(self) -> asyncio.StreamWriter:
        return self._stdin

    @property
    def stdout(self) -> asyncio.StreamReader:
        return self._stdout

    @property
    def returncode(self) -> int | None:
        return self._exited.result() if self._exited.done() else None

    def kill(self) -> None:
        # Asked of the template: until it reaps the sandbox, the pid cannot be reused.
        if self.returncode is None:
            self._server.kill(self._pid)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def close(self) -> None:
        for transport in self._transports:
            transport.close()
        if self.leaf is not None:
            leaf, self.leaf = self.leaf, None
            leaf.remove()


@dataclass
class _Outgoing:
    data: bytes
    fds: list[int] = field(default_factory=list)  # owned: closed once sent or dropped

    def close_fds(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []


class ForkServer:
    """The host's side of one template process: start it, ask it to fork and to kill, hear
    what it reports. Dead when the template exits; a dead one is replaced, not repaired."""

    def __init__(self, process: subprocess.Popen[bytes], sock: socket.socket, log_path: Path) -> None:
        self._process = process
        self._sock = sock
        self._log_path = log_path
        self._pending: dict[int, asyncio.Future[int]] = {}
        self._exits: dict[int, asyncio.Future[int]] = {}
        self._outbox: collections.deque[_Outgoing] = collections.deque()
        self._writing = False
        self._ids = 0
        self._dead = False
        self._closed = False
        self._reader: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def alive(self) -> bool:
        return not self._dead and self._process.poll() is None

    @classmethod
    async def start(cls, root: Path, timeout: float) -> ForkServer:
        """Start a template under `root` and wait until it has loaded everything."""
        loop = asyncio.get_running_loop()
        log_path = root / f"forkserver-{uuid.uuid4().hex[:8]}.err"
        host_end, template_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            stderr = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                # Popen, not asyncio's: the template is reaped here (`_reap`), bound to no loop.
                process = subprocess.Popen(
                    [sys.executable, *INTERPRETER_FLAGS, str(FORKSERVER_PATH), str(os.getpid())],
                    stdin=template_end.fileno(),
                    stdout=subprocess.DEVNULL,
                    stderr=stderr,
                    env=sandbox_env(root),
                    cwd=root,
                    start_new_session=True,
                )
            finally:
                os.close(stderr)
                template_end.close()
        except BaseException:
            host_end.close()
            log_path.unlink(missing_ok=True)
            raise
        host_end.setblocking(False)
        server = cls(process, host_end, log_path)
        try:
            async with asyncio.timeout(timeout):  # not wait_for: it can swallow a cancel (3.11)
                data = await loop.sock_recv(host_end, MAX_MESSAGE)
            ready = decode(data) if data else None
            if ready is None or ready.get("op") != "ready":
                raise ForkServerError(f"the template did not start: {server.stderr_tail() or 'no output'}")
        except BaseException as exc:
            await server.close()
            if isinstance(exc, (TimeoutError, ValueError, OSError)):
                raise ForkServerError(f"the template did not start: {exc!r}") from exc
            raise
        server._reader = asyncio.create_task(server._read())
        return server

    def stderr_tail(self) -> str:
        try:
            return self._log_path.read_text(errors="replace")[-2_000:].strip()
        except OSError:
            return ""

    async def fork(self, directory: Path, env: dict[str, str], limit: int, timeout: float) -> ForkedProcess:
        """A sandbox in `directory`, its stderr in sandbox.err there, its channel on pipes."""
        loop = asyncio.get_running_loop()
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        try:
            err = os.open(
                directory / "sandbox.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644
            )
        except BaseException:
            for fd in (in_r, in_w, out_r, out_w):
                os.close(fd)
            raise
        stdin_file = os.fdopen(in_w, "wb", buffering=0)
        stdout_file = os.fdopen(out_r, "rb", buffering=0)
        self._ids += 1
        request_id = self._ids
        answer: asyncio.Future[int] = loop.create_future()
        self._pending[request_id] = answer
        transports: list[asyncio.BaseTransport] = []
        pid: int | None = None
        try:
            # The template's ends go with the request: the outbox closes them once sent.
            self._post(
                {"op": "fork", "id": request_id, "directory": str(directory), "env": env}, [in_r, out_w, err]
            )
            async with asyncio.timeout(timeout):  # not wait_for: it can swallow a cancel (3.11)
                pid = await answer
            reader = asyncio.StreamReader(limit=limit)
            read_transport, _ = await loop.connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(reader), stdout_file
            )
            transports.append(read_transport)
            write_transport, write_protocol = await loop.connect_write_pipe(
                asyncio.streams.FlowControlMixin, stdin_file
            )
            transports.append(write_transport)
            writer = asyncio.StreamWriter(write_transport, write_protocol, None, loop)
            forked = ForkedProcess(self, pid, writer, reader, transports, self._exits[pid])
            forked.leaf = cgroups.place(pid, cgroups.leaf_name(directory))  # before its init
            return forked
        except BaseException as exc:
            self._pending.pop(request_id, None)  # a late "forked" is then killed on arrival
            if pid is not None:
                self.kill(pid)
            for transport in transports:
                transport.close()
            stdin_file.close()
            stdout_file.close()
            if isinstance(exc, TimeoutError):
                # An unresponsive template cannot be trusted to kill what it forked either:
                # closing it takes its sandboxes down (they are rebuilt from their logs).
                await asyncio.shield(self.close())
                raise ForkServerError(f"the template did not fork within {timeout:g} s") from exc
            raise

    def kill(self, pid: int) -> None:
        if pid in self._exits and not self._dead:
            with contextlib.suppress(ForkServerError):
                self._post({"op": "kill", "pid": pid}, [])

    async def close(self) -> None:
        """Close the channel: the template kills its sandboxes and exits."""
        if self._closed:
            return
        self._closed = True
        if self._reader is not None and self._reader is not asyncio.current_task():
            self._reader.cancel()
            with contextlib.suppress(BaseException):
                await self._reader
        self._mark_dead(ForkServerError("the template was closed"))
        self._sock.close()
        if not await self._reap(5):
            self._process.kill()  # not reaped yet: the pid is still the template's
            await self._reap(5)
        self._bury()
        self._log_path.unlink(missing_ok=True)

    # --- internals ------------------------------------------------------------------------

    def _post(self, message: dict[str, object], fds: list[int]) -> None:
        """Queue a message (and the fds it carries, now owned by the queue) and send what
        the socket takes now; the rest goes when it is writable."""
        item = _Outgoing(b"", fds)
        try:
            item.data = encode(message)
            if self._dead:
                raise ForkServerError("the template is gone")
        except BaseException:
            item.close_fds()
            raise
        self._outbox.append(item)
        self._flush()

    def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        while self._outbox and not self._dead:
            item = self._outbox[0]
            try:
                if item.fds:
                    socket.send_fds(self._sock, [item.data], item.fds)
                else:
                    self._sock.send(item.data)
            except BlockingIOError:
                if not self._writing:
                    loop.add_writer(self._sock, self._flush)
                    self._writing = True
                return
            except OSError as exc:
                self._mark_dead(ForkServerError(f"the template's channel broke: {exc}"))
                return
            self._outbox.popleft()
            item.close_fds()
        if self._writing:
            loop.remove_writer(self._sock)
            self._writing = False

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                data = await loop.sock_recv(self._sock, MAX_MESSAGE)
                if not data:
                    break
                self._dispatch(decode(data))
        except (OSError, ValueError) as exc:
            log.warning("the sandbox template's channel broke: %r", exc)
        if self._closed:
            return
        self._mark_dead(ForkServerError("the template exited"))
        await self._reap(5)
        tail = self.stderr_tail()
        log.warning(
            "the sandbox template (pid %d) exited (code %s); its sandboxes died with it, the next "
            "sandbox starts a new one%s",
            self._process.pid,
            self._process.returncode,
            f": {tail}" if tail else "",
        )
        self._bury()
        self._sock.close()
        self._log_path.unlink(missing_ok=True)

    async def _reap(self, timeout: float) -> bool:
        """Wait (in a thread) for the template to exit; True once it has and was reaped."""
        try:
            await asyncio.to_thread(self._process.wait, timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def _dispatch(self, message: dict[str, Any]) -> None:
        op = message.get("op")
        if op == "forked":
            pid = int(message["pid"])
            self._exits[pid] = asyncio.get_running_loop().create_future()
            answer = self._pending.pop(int(message["id"]), None)
            if answer is None or answer.done():
                self.kill(pid)  # its requester gave up (cancelled or timed out)
            else:
                answer.set_result(pid)
        elif op == "refused":
            request_id = message.get("id")
            answer = self._pending.pop(request_id, None) if request_id is not None else None
            error = ForkServerError(f"the template refused: {message.get('error')}")
            if answer is not None and not answer.done():
                answer.set_exception(error)
            elif answer is None:
                log.warning("%s", error)
        elif op == "exit":
            exited = self._exits.pop(int(message["pid"]), None)
            if exited is not None and not exited.done():
                exited.set_result(int(message["code"]))

    def _mark_dead(self, error: ForkServerError) -> None:
        self._dead = True
        if self._writing:
            asyncio.get_running_loop().remove_writer(self._sock)
            self._writing = False
        while self._outbox:
            self._outbox.popleft().close_fds()
        for answer in self._pending.values():
            if not answer.done():
                answer.set_exception(error)
        self._pending.clear()

    def _bury(self) -> None:
        """The template is gone, so are its sandboxes: their death signal is SIGKILL."""
        for exited in self._exits.values():
            if not exited.done():
                exited.set_result(-signal.SIGKILL)
        self._exits.clear()


def uss_bytes(pid: int) -> int | None:
    """Unique set size: the memory only this process holds (what killing it frees), with
    the PID namespace it keeps: a sandbox's REPL is the child of the process the host started
    (its keeper, outside the namespace: activities/sandbox/kernel.py `become_pid_one`)."""
    total = _uss_kb(pid)
    if total is None:
        return None
    for inside in _kept_namespace(pid):
        total += _uss_kb(inside) or 0
    return total * 1024


def _kept_namespace(pid: int) -> list[int]:
    """The processes of the PID namespaces `pid` is the parent of (none for a template, whose
    children are keepers in its own namespace)."""
    try:
        own = os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return []
    children = _children()
    if pid not in children:  # started since the last scan: a keeper always has its REPL
        children = _children(fresh=True)
    kept: list[int] = []
    for child in children.get(pid, []):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{child}/ns/pid") != own:
                kept.append(child)
    for inside in kept:  # and what they started (their namespace's)
        kept.extend(children.get(inside, []))
    return kept


_CHILDREN: list[tuple[float, dict[int, list[int]]]] = []
CHILDREN_FRESH_S = 1.0
"""One scan of /proc serves every sandbox measured within this long (a memory report of a
thousand sandboxes would otherwise scan it a thousand times)."""


def _children(fresh: bool = False) -> dict[int, list[int]]:
    """Each process's children, by pid (there is no /proc/PID/task/TID/children here)."""
    now = time.monotonic()
    if not fresh and _CHILDREN and now - _CHILDREN[0][0] < CHILDREN_FRESH_S:
        return _CHILDREN[0][1]
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            found = proc_stat(int(entry.name))
            if found is not None:
                children.setdefault(found.ppid, []).append(int(entry.name))
    _CHILDREN[:] = [(now, children)]
    return children


def _uss_kb(pid: int) -> int | None:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    kb = 0
    for line in text.splitlines():
        if line.startswith(("Private_Clean:", "Private_Dirty:")):
            kb += int(line.split()[1])
    return kb


class SandboxUids:
    """A uid of its own for each live sandbox, when the worker runs as root: sandboxes then
    cannot signal, trace or prlimit each other, RLIMIT_NPROC counts each alone, and every
    process a sandbox left behind is found by its uid when it closes (`kill_uid`).

    A uid is claimed by a symlink `<root>/.uids/<uid>` -> the claiming worker's home, made
    exclusively, so workers that share a sandbox root never hand out the same one. A claim
    whose home is gone (its worker died) is stale: `reap_stale` removes it. Uids are drawn at
    random from a range no account uses."""

    FIRST = 1 << 20
    SPAN = 1 << 30

    def __init__(self, root: Path, home: Path) -> None:
        self.root = root
        self.claims = root / UID_CLAIMS
        self.home = home

    def claim(self) -> int:
        for _ in range(100):
            uid = self.FIRST + secrets.randbelow(self.SPAN)
            try:
                self.claims.mkdir(mode=0o700, exist_ok=True)
                os.symlink(self.home, self.claims / str(uid))
            except (FileExistsError, FileNotFoundError):  # taken, or the directory just went
                continue
            return uid
        raise RuntimeError(f"no free sandbox uid under {self.claims}")

    def release(self, uid: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.claims / str(uid))
        self._remove_if_empty()

    def reap_stale(self) -> None:
        """Forget the claims of workers whose home is gone."""
        forget_stale_uid_claims(self.root)

    def _remove_if_empty(self) -> None:
        with contextlib.suppress(OSError):  # not empty, or gone: both fine
            self.claims.rmdir()


def kill_uid(uid: int, passes: int = 5) -> int:
    """SIGKILL every process owned by `uid` (a sandbox's own uid: nothing else runs as it),
    again until none is left (one may have forked meanwhile); returns how many were killed."""
    killed = 0
    for _ in range(passes):
        found = []
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if entry.stat(follow_symlinks=False).st_uid == uid:
                        found.append(int(entry.name))
        if not found:
            break
        for pid in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
    return killed
