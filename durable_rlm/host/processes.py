"""Processes of this machine, named so that a reused pid is not mistaken for them.

A pid alone names a process only until it exits: the kernel gives the number to the next
process. A pid and its start time (clock ticks after boot, from /proc/<pid>/stat) name one
process for good, so every judgement of "is that still the process we knew" (a sandbox the
reaper would kill, the shared Temporal server a lease names) compares both.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProcStat:
    state: str
    ppid: int
    start: int  # clock ticks after boot: with the pid, names one process for good


def proc_stat(pid: int) -> ProcStat | None:
    """/proc/<pid>/stat, or None when there is no such process (or it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            text = file.read().decode("ascii", "replace")
        fields = text[text.rindex(")") + 2 :].split()  # the name may hold spaces and ')'
        return ProcStat(state=fields[0], ppid=int(fields[1]), start=int(fields[19]))
    except (OSError, ValueError, IndexError):
        return None


def running(pid: int, start: int | None) -> bool:
    """Is `pid` still the process that started at `start` (any, when None)? A zombie has
    ended."""
    found = proc_stat(pid)
    return found is not None and found.state not in ("Z", "X") and (start is None or found.start == start)


def start_time(pid: int) -> int | None:
    found = proc_stat(pid)
    return None if found is None else found.start
