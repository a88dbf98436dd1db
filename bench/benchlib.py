"""Shared parts of the benchmark suite (`python bench/run.py`): figures with medians, min,
max, ratios and targets; rich tables; the embedded server, stores and worker processes;
histories; and what /proc says about a worker and its sandboxes.

Every section module (overhead, rlms_compare, concurrency, history, rebuild, recovery) has
`async def run(ctx: Context) -> Section` and runs alone through `section_main`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
for _path in (str(ROOT), str(BENCH)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import sqlalchemy as sa  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from temporalio.api.enums.v1 import EventType  # noqa: E402
from temporalio.api.history.v1 import HistoryEvent  # noqa: E402
from temporalio.client import Client  # noqa: E402

from durable_rlm.settings import Settings  # noqa: E402
from durable_rlm.store.blobs import BlobStore, SqlBackend  # noqa: E402
from durable_rlm.store.codec import data_converter  # noqa: E402
from durable_rlm.store.sql import open_store  # noqa: E402
from durable_rlm.worker.runtime import EmbeddedServer, Services, running_workers  # noqa: E402

console = Console(stderr=False, highlight=False, width=None if sys.stdout.isatty() else 160)
progress = Console(stderr=True, highlight=False)


def say(message: str) -> None:
    """A progress line on stderr (the tables go to stdout)."""
    progress.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {message}")


# --- figures --------------------------------------------------------------------------------


@dataclass
class Target:
    op: str  # "<=" or ">="
    value: float
    on: str = "median"  # "median", "max" or "ratio": which number is judged
    text: str = ""

    def holds(self, number: float | None) -> bool | None:
        if number is None:
            return None
        return number <= self.value if self.op == "<=" else number >= self.value


@dataclass
class Figure:
    key: str
    label: str
    unit: str  # ms, s, B, KB, MB, count, %, x, /s
    values: list[float]
    ratio: float | None = None
    ratio_label: str = ""  # what the ratio is of, e.g. "durable / direct"
    target: Target | None = None
    note: str = ""
    baseline: bool = False  # this figure is a baseline others are measured against

    @property
    def median(self) -> float | None:
        return statistics.median(self.values) if self.values else None

    @property
    def passed(self) -> bool | None:
        if self.target is None:
            return None
        number = {"median": self.median, "max": max(self.values, default=None), "ratio": self.ratio}[
            self.target.on
        ]
        return self.target.holds(number)

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "label": self.label,
            "unit": self.unit,
            "values": self.values,
            "median": self.median,
            "min": min(self.values, default=None),
            "max": max(self.values, default=None),
            "runs": len(self.values),
            "ratio": self.ratio,
            "ratio_label": self.ratio_label,
            "baseline": self.baseline,
            "target": None
            if self.target is None
            else {
                "op": self.target.op,
                "value": self.target.value,
                "on": self.target.on,
                "text": self.target.text or f"{self.target.op} {self.target.value:g}",
            },
            "status": None if self.passed is None else ("PASS" if self.passed else "MISS"),
            "note": self.note,
        }


@dataclass
class Section:
    name: str
    title: str
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    series: dict[str, Any] = field(default_factory=dict)  # raw data for plots
    duration_s: float = 0.0
    error: str | None = None

    def add(self, key: str, label: str, unit: str, values: list[float] | float, **kw: Any) -> Figure:
        values = [float(v) for v in values] if isinstance(values, list) else [float(values)]
        figure = Figure(key, label, unit, values, **kw)
        self.figures.append(figure)
        return figure

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "duration_s": round(self.duration_s, 1),
            "figures": [f.to_json() for f in self.figures],
            "notes": self.notes,
            "series": self.series,
            "error": self.error,
        }


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or not b:
        return None
    return a / b


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "ms":
        return f"{value:,.1f} ms"
    if unit == "s":
        return f"{value:,.2f} s"
    if unit == "B":
        return f"{value:,.0f} B"
    if unit == "KB":
        return f"{value:,.1f} KB"
    if unit == "MB":
        return f"{value:,.1f} MB"
    if unit == "count":
        return f"{value:,.0f}"
    if unit == "%":
        return f"{value:.0f}%"
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "/s":
        return f"{value:,.2f}/s"
    return f"{value:,.3g} {unit}".strip()


def render(section: dict[str, Any], out: Console = console) -> None:
    """One section's figures as a rich table (from its JSON form)."""
    table = Table(title=f"{section['title']}  ({section['duration_s']:.0f} s)", title_justify="left")
    for column, justify in [
        ("figure", "left"),
        ("median", "right"),
        ("min", "right"),
        ("max", "right"),
        ("runs", "right"),
        ("ratio", "right"),
        ("target", "left"),
        ("", "left"),
    ]:
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for f in section["figures"]:
        unit = f["unit"]
        status = {"PASS": "[green]PASS[/green]", "MISS": "[red]MISS[/red]"}.get(f["status"] or "", "")
        r = f"{f['ratio']:.2f}x {f['ratio_label']}" if f["ratio"] is not None else ""
        target = f["target"]["text"] if f["target"] else ""
        label = f["label"] + (" [dim](baseline)[/dim]" if f["baseline"] else "")
        if f["note"]:
            label += f"\n[dim]{f['note']}[/dim]"
        table.add_row(
            label,
            fmt(f["median"], unit),
            fmt(f["min"], unit) if f["runs"] > 1 else "",
            fmt(f["max"], unit) if f["runs"] > 1 else "",
            str(f["runs"]),
            r,
            target,
            status,
        )
    out.print(table)
    if section.get("error"):
        out.print(f"[red]section failed:[/red] {section['error']}")
    for note in section["notes"]:
        out.print(f"  [dim]- {note}[/dim]")
    out.print()


# --- how a section runs ---------------------------------------------------------------------


@dataclass
class Context:
    quick: bool
    repeats: int
    work: Path  # a scratch directory of this run

    def scratch(self, name: str) -> Path:
        path = self.work / f"{name}-{uuid.uuid4().hex[:6]}"
        path.mkdir(parents=True)
        return path


def make_context(quick: bool, repeats: int | None) -> Context:
    work = Path(tempfile.mkdtemp(prefix="drlm-bench-", dir="/tmp"))
    work.chmod(0o711)  # sandboxes drop to `nobody`; their roots must be traversable
    return Context(quick=quick, repeats=repeats or (1 if quick else 3), work=work)


async def run_section(
    name: str, title: str, body: Callable[[Context, Section], Awaitable[None]], ctx: Context
) -> Section:
    section = Section(name, title)
    started = time.monotonic()
    try:
        await body(ctx, section)
    except Exception as exc:  # noqa: BLE001 - one failed section must not lose the others
        import traceback

        traceback.print_exc()
        section.error = f"{type(exc).__name__}: {exc}"
    section.duration_s = time.monotonic() - started
    return section


def section_main(
    run: Callable[[Context], Awaitable[Section]], description: str, script: str | None = None
) -> None:
    """`python bench/<section>.py [--quick] [--repeats R] [--merge]`: run one section, print
    its table; with `script` named, `--merge` adds it to bench/results/latest.json."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a tiny smoke version")
    parser.add_argument("--repeats", type=int, default=None, help="runs per figure (default 3, quick 1)")
    if script is not None:
        parser.add_argument(
            "--merge", action="store_true", help="add the section to bench/results/latest.json"
        )
    args = parser.parse_args()
    ctx = make_context(args.quick, args.repeats)
    try:
        section = asyncio.run(run(ctx))
    finally:
        shutil.rmtree(ctx.work, ignore_errors=True)
    data = section.to_json()
    render(data)
    if getattr(args, "merge", False) and not args.quick and not section.error:
        merge_section(data, f"python bench/{script} --merge")
    finish(1 if section.error else 0)


def finish(code: int) -> None:
    """temporalio can crash at interpreter exit after all work is done (sdk-python#300)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def median(values: list[float]) -> float:
    return statistics.median(values)


def merge_section(section: dict, command: str, path: Path | None = None) -> None:
    """Put one section run alone into the suite's figures (bench/results/latest.json),
    keeping the others, with when, from which commit and by which command it was merged."""
    path = path or RESULTS / "latest.json"
    results = json.loads(path.read_text())
    results["sections"][section["name"]] = section
    results["meta"].setdefault("merged", {})[section["name"]] = {
        "started": (dt.datetime.now(dt.UTC) - dt.timedelta(seconds=section["duration_s"])).isoformat(
            timespec="seconds"
        ),
        "git": git_commit(),
        "command": command,
        "duration_s": section["duration_s"],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }
    path.write_text(json.dumps(results, indent=1))
    say(f"merged into {path}")


# --- server, stores, workers ------------------------------------------------------------------


@dataclass
class BenchEnv:
    directory: Path
    address: str
    database_url: str
    engine: sa.Engine
    blobs: BlobStore
    client: Client
    server_pid: int | None = None  # the embedded server's process (and its own children)

    @contextlib.asynccontextmanager
    async def workers(self, task_queue: str) -> AsyncIterator[Any]:
        """This process's workers (both queues), as `drlm run` runs them."""
        settings = Settings(task_queue=task_queue, data_dir=self.directory)
        async with running_workers(Services(settings, self.blobs, self.engine, self.client)) as repl:
            yield repl

    def worker_process(self, task_queue: str, **env: str) -> WorkerProcess:
        return WorkerProcess(self.address, self.database_url, task_queue, env, self.directory)


@contextlib.asynccontextmanager
async def bench_env(directory: Path, tuned: bool = True) -> AsyncIterator[BenchEnv]:
    """A fresh embedded dev server (as shipped: tuned) and SQL store in `directory`."""
    database_url = f"sqlite:///{directory / 'drlm.sqlite'}"
    engine = open_store(database_url)
    blobs = BlobStore(SqlBackend(engine))
    server = EmbeddedServer(directory / "temporal.sqlite", tuned=tuned)
    async with server as address:
        client = await Client.connect(address, data_converter=data_converter(blobs))
        pid = server.process.pid if server.process is not None else None
        yield BenchEnv(directory, address, database_url, engine, blobs, client, pid)


class WorkerProcess:
    """`python worker.py` in its own process against the bench's server (as
    tests/conftest.py's WorkerProcess).

    Its output is filed, all of it, in `worker-<pid>.log` of the bench's directory: stderr
    straight into the file, stdout through a thread that reads every line (it watches for
    "worker ready") and appends it there. A pipe read only for its first line fills at 64 KB,
    and a worker writing to it stops (N=200 stalled 7 minutes that way:
    durable_rlm/telemetry/log_path.py)."""

    def __init__(
        self, address: str, database_url: str, task_queue: str, extra: dict[str, str], directory: Path
    ) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "DRLM_"))}
        env.update(
            TEMPORAL_ADDRESS=address,
            DRLM_DATABASE_URL=database_url,
            DRLM_TASK_QUEUE=task_queue,
            DRLM_LOG_LEVEL="WARNING",
            **extra,
        )
        self.started_at = time.time()
        self.log_path = directory / f"worker-{uuid.uuid4().hex[:8]}.log"
        with open(self.log_path, "ab") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, str(ROOT / "worker.py")],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=stderr,
            )
        self.log_path = self.log_path.rename(directory / f"worker-{self.process.pid}.log")
        self.ready_at: float | None = None
        self.first_line: str | None = None
        self._ready = threading.Event()
        self._drain = threading.Thread(target=self._file_stdout, name=f"drain-{self.pid}", daemon=True)
        self._drain.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def _file_stdout(self) -> None:
        assert self.process.stdout is not None
        with open(self.log_path, "ab") as log:
            for raw in self.process.stdout:
                if self.first_line is None:
                    self.first_line = raw.decode(errors="replace")
                    if self.first_line.startswith("worker ready"):
                        self.ready_at = time.time()
                    self._ready.set()
                log.write(raw)
                log.flush()
        self._ready.set()  # the worker ended (before it was ready, if first_line is None)

    async def ready(self, timeout: float = 60) -> WorkerProcess:
        await asyncio.wait_for(asyncio.to_thread(self._ready.wait), timeout)
        if self.ready_at is None:
            raise RuntimeError(
                f"worker.py did not start: {self.first_line!r} (exit {self.process.poll()}); "
                f"its output: {self.tail()}"
            )
        return self

    def tail(self, chars: int = 2000) -> str:
        """The end of what the worker wrote."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def output_bytes(self) -> int:
        """How much the worker has written (stdout and stderr)."""
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


# --- histories ----------------------------------------------------------------------------------


async def histories(client: Client, workflow_id: str, first_run_id: str | None = None) -> list[HistoryEvent]:
    """Every event of an episode, across continue-as-new runs."""
    events: list[HistoryEvent] = []
    run_id = first_run_id
    if run_id is None:
        # The first run of this id: follow the chain from the start.
        described = await client.get_workflow_handle(workflow_id).describe()
        run_id = described.raw_description.workflow_execution_info.first_run_id or described.run_id
    while run_id:
        history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
        events.extend(history.events)
        last = history.events[-1] if history.events else None
        run_id = None
        if last is not None and last.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW:
            run_id = last.workflow_execution_continued_as_new_event_attributes.new_execution_run_id
    return events


def history_bytes(events: list[HistoryEvent]) -> int:
    return sum(e.ByteSize() for e in events)


def count_events(events: list[HistoryEvent], kind: int) -> int:
    return sum(1 for e in events if e.event_type == kind)


# --- /proc ----------------------------------------------------------------------------------------

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()  # fields from `state` (field 3) on


def children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None:
            kids.setdefault(int(fields[1]), []).append(int(entry.name))
    return kids


def descendants(pid: int, kids: dict[int, list[int]] | None = None) -> list[int]:
    """Every live process under `pid` (sandboxes, however they were started: spawned by the
    worker or forked from a template process)."""
    kids = children_map() if kids is None else kids
    out, stack = [], list(kids.get(pid, []))
    while stack:
        p = stack.pop()
        out.append(p)
        stack.extend(kids.get(p, []))
    return out


def cpu_seconds(pid: int, reaped: bool = True) -> float:
    """utime + stime of a process (and, with `reaped`, of its waited-for children)."""
    fields = _stat_fields(pid)
    if fields is None:
        return 0.0
    ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    if reaped:
        ticks += int(fields[13]) + int(fields[14])  # cutime, cstime
    return ticks / CLOCK_TICKS


def tree_cpu_seconds(pid: int) -> float:
    """CPU time of a process, its reaped children, and its live descendants."""
    return cpu_seconds(pid) + sum(cpu_seconds(p, reaped=False) for p in descendants(pid))


def status_kb(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def uss_kb(pid: int) -> int | None:
    """Unique set size: Private_Clean + Private_Dirty from smaps_rollup."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    total = 0
    for line in text.splitlines():
        if line.startswith(("Private_Clean:", "Private_Dirty:")):
            total += int(line.split()[1])
    return total


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def machine() -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    ram_gb = status_total_ram_kb() / 1024 / 1024
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "ram_gb": round(ram_gb, 1),
        "python": sys.version.split()[0],
        "platform": sys.platform,
        "kernel": os.uname().release,
    }


def status_total_ram_kb() -> int:
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1])
    return 0


def git_commit() -> dict[str, Any]:
    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return out.stdout.strip()

    return {
        "commit": git("rev-parse", "HEAD"),
        "subject": git("log", "-1", "--format=%s"),
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    }
