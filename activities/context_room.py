"""How large a context a sandbox can hold as one `str`, on this host.

A sandbox builds `context` from a read-only map of the worker's cached copy (context_cache.py):
while it decodes, the map and the new string are both in its address space, and the map goes
once the string is made. So the room it needs is the string (characters x their width, as
CPython stores it) plus the bytes mapped, plus the interpreter and the REPL's own working
memory (`BASE_BYTES`). A sandbox's address space is its whole memory budget when a cgroup
bounds the sandbox as a whole, and a share of it otherwise (activities/sandbox/layers.py
`set_limits`). A context past that room cannot be loaded: it is refused before the episode
starts, saying how to pass it as documents or raise the budget.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from durable_rlm.activities.sandbox import cgroups
from durable_rlm.activities.sandbox.layers import FALLBACK_TASKS

MB = 1024 * 1024
BASE_BYTES = 256 * MB
"""The interpreter, the REPL's helpers, and room for a cell to work (a slice, a regex match)."""


@dataclass(frozen=True)
class Room:
    """What one sandbox process may hold, and why that much."""

    bytes: int
    why: str

    def need(self, str_bytes: int, mapped_bytes: int) -> int:
        return str_bytes + mapped_bytes + BASE_BYTES

    def refusal(self, what: str, str_bytes: int, mapped_bytes: int, documents: bool = False) -> str | None:
        """One line when `what` does not fit as one string; None when it does."""
        need = self.need(str_bytes, mapped_bytes)
        if need <= self.bytes:
            return None
        raise_to = -(-need // MB) * self.bytes_per_budget_mb
        advice = (
            "split the document or raise DRLM_SANDBOX_MEMORY_MB"
            if documents
            else "pass it as documents (`--context DIR`, or several `--context FILE`: each file is "
            "loaded only when code touches it) or raise DRLM_SANDBOX_MEMORY_MB"
        )
        return (
            f"{what} needs {need / MB:,.0f} MB to load as one string in the sandbox "
            f"({str_bytes / MB:,.0f} MB of str, {mapped_bytes / MB:,.0f} MB mapped while it is made, "
            f"{BASE_BYTES // MB} MB for the REPL), but a sandbox holds {self.bytes / MB:,.0f} MB here "
            f"({self.why}): {advice} (to at least {raise_to:,} MB)"
        )

    @property
    def bytes_per_budget_mb(self) -> int:
        """How many budget MB one MB of room costs (the share a process gets)."""
        return FALLBACK_TASKS if "split" in self.why else 1


def sandbox_room(memory_mb: int, local: bool = True) -> Room:
    """The room of one sandbox process with a budget of `memory_mb`, as this host's worker
    would set it (`local`), or as any worker would at best (a remote deployment's)."""
    whole = f"DRLM_SANDBOX_MEMORY_MB={memory_mb}"
    if not local or os.geteuid() != 0 or cgroups.support().available:
        return Room(memory_mb * MB, whole)
    # A root worker without a cgroup: each of the sandbox's processes gets a share.
    share = max(memory_mb // FALLBACK_TASKS, 1)
    return Room(share * MB, f"{whole} split over {FALLBACK_TASKS} processes: this host has no cgroup")
