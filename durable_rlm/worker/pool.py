"""Several worker processes under one supervisor: `python worker.py --processes N|auto`.

One Python process is one core (the GIL): a worker saturates it long before the server or
the machine. Temporal scales out by more pollers on the same task queue, so N processes,
each a whole worker (its own workflow cache, sandboxes and activity slots), use N cores with
nothing home-made between them. The supervisor only starts them, shares the machine's
sandbox budget among them, restarts one that dies, and drains them together.

- **One budget.** Each process gets 1/N of `DRLM_MAX_SANDBOXES` (default: what one worker
  would take of this machine's memory) and of `DRLM_SANDBOX_BUDGET_MB`, so N processes hold
  no more sandboxes than one worker would.
- **Ready once all are.** Each child's stdout is read (a pipe nobody reads stops a worker:
  durable_rlm/telemetry/log_path.py) and passed on with its index; "worker ready: N
  processes: ..." is the first line, once every child said "worker ready" (a restarted
  child's line says "restarted"). Their stderr (the bounded log path) is the supervisor's.
- **Drained together.** SIGTERM or SIGINT is passed to every child, which drains as a single
  worker does; a second signal is passed on too (the children leave at once). The
  supervisor exits with the worst child's code.
- **A dead child comes back.** One that exits while no drain was asked is restarted after a
  pause that doubles up to RESTART_MAX_S; its episodes meanwhile go on on the others.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

RESTART_FIRST_S = 1.0
RESTART_MAX_S = 30.0
STABLE_S = 60.0
"""A child that ran this long before it died is restarted after RESTART_FIRST_S again."""


def process_count(value: str) -> int:
    """`--processes`: a count, or `auto` (the cores this process may run on)."""
    if value.strip().lower() == "auto":
        return max(1, len(os.sched_getaffinity(0)))
    try:
        count = int(value)
    except ValueError:
        raise ValueError(f"--processes takes a number or 'auto', not {value!r}") from None
    if not 1 <= count <= 256:
        raise ValueError(f"--processes must be between 1 and 256, not {count}")
    return count


def child_environment(
    environ: Mapping[str, str], processes: int, index: int, max_sandboxes: int | None, budget_mb: int | None
) -> dict[str, str]:
    """A child's environment: the parent's, with its share of the sandbox budget."""
    env = dict(environ)
    env["DRLM_WORKER_PROCESS"] = f"{index + 1}/{processes}"
    if max_sandboxes is not None:
        env["DRLM_MAX_SANDBOXES"] = str(max(1, max_sandboxes // processes))
    if budget_mb is not None:
        env["DRLM_SANDBOX_BUDGET_MB"] = str(max(64, budget_mb // processes))
    return env


@dataclass
class _Child:
    index: int
    command: Sequence[str]
    env: dict[str, str]
    process: subprocess.Popen[str] | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    said_ready: str = ""  # its "worker ready" line, without the words
    started: float = 0.0
    restarts: int = 0
    pause_s: float = RESTART_FIRST_S

    def start(self, say: _Printer) -> None:
        self.ready.clear()
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            self.command, env=self.env, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True
        )
        reader = threading.Thread(target=self._relay, args=(self.process, say), daemon=True)
        reader.start()

    def _relay(self, process: subprocess.Popen[str], say: _Printer) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith("worker ready"):
                self.said_ready = line.removeprefix("worker ready").strip(" :\n")
                self.ready.set()
                if not self.restarts:
                    continue  # told once, for all of them (`supervise`)
                line = f"restarted, {line}"
            say(f"[{self.index + 1}] {line.rstrip()}")

    def signal(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                self.process.send_signal(signum)
            except ProcessLookupError:
                pass


class _Printer:
    """Lines from many reader threads, whole, on stdout."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __call__(self, line: str) -> None:
        with self._lock:
            try:
                sys.stdout.write(line + "\n")
                sys.stdout.flush()
            except (BrokenPipeError, ValueError):
                pass  # nobody reads the supervisor's output: the children go on


def supervise(
    processes: int,
    environ: Mapping[str, str],
    max_sandboxes: int | None,
    budget_mb: int | None,
    command: Sequence[str] | None = None,
) -> int:
    """Run `processes` workers until a signal drains them; their worst exit code."""
    command = list(command or [sys.executable, "-m", "durable_rlm.worker.main", "--processes", "1"])
    say = _Printer()
    children = [
        _Child(i, command, child_environment(environ, processes, i, max_sandboxes, budget_mb))
        for i in range(processes)
    ]
    draining = threading.Event()
    signals: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        signals.append(signum)
        draining.set()
        for child in children:
            child.signal(signal.SIGTERM if signum == signal.SIGTERM else signal.SIGINT)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for child in children:
            child.start(say)
        announced = False
        restart_at: dict[int, float] = {}
        while True:
            if not announced and all(c.ready.is_set() for c in children):
                announced = True
                queues = "; ".join(f"[{c.index + 1}] {c.said_ready}" for c in children)
                say(f"worker ready: {processes} processes: {queues}")
            alive = [c for c in children if c.process is not None and c.process.poll() is None]
            if draining.is_set():
                if not alive:
                    break
            else:
                for child in children:
                    if child in alive or child.index in restart_at:
                        continue
                    code = child.process.returncode if child.process else None
                    ran = time.monotonic() - child.started
                    if ran >= STABLE_S:
                        child.pause_s = RESTART_FIRST_S
                    print(
                        f"worker process {child.index + 1}/{processes} exited with code {code} after "
                        f"{ran:.0f} s; restarting it in {child.pause_s:g} s",
                        file=sys.stderr,
                        flush=True,
                    )
                    restart_at[child.index] = time.monotonic() + child.pause_s
                    child.pause_s = min(child.pause_s * 2, RESTART_MAX_S)
                for index, when in list(restart_at.items()):
                    if time.monotonic() >= when:
                        del restart_at[index]
                        children[index].restarts += 1
                        children[index].start(say)
            if draining.is_set():
                time.sleep(0.2)  # the children drain; this only watches
            else:
                draining.wait(0.2)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    codes = [c.process.returncode for c in children if c.process is not None]
    restarted = sum(c.restarts for c in children)
    say(f"worker pool stopped: {processes} processes, exit codes {codes}, {restarted} restart(s)")
    failed = [code for code in codes if code]
    if not failed:
        return 0
    return failed[0] if failed[0] > 0 else 1  # a child a signal ended (-9): a failure
