"""`drlm doctor`: what this machine gives an episode, checked for real.

It starts a real sandbox and reports each isolation layer as the sandbox itself saw it, so
a missing network namespace (the sandbox then relies on its audit hook alone) is visible
before the first episode, not discovered in an audit.
"""

from __future__ import annotations

import os
import platform
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from durable_rlm.activities.repl import ReplActivities
from durable_rlm.activities.sandbox import cgroups
from durable_rlm.activities.sandbox.kernel import OWN_TMPFS
from durable_rlm.activities.sandbox_processes import SandboxUids
from durable_rlm.activities.sandbox_start import default_sandbox_root
from durable_rlm.server.embedded import local_exposure
from durable_rlm.settings import Settings
from durable_rlm.store.blobs import BlobStore, DirectoryBackend
from durable_rlm.store.sql import open_store
from durable_rlm.worker.runtime import temporal_binary
from durable_rlm.workflows import defaults


@dataclass
class Check:
    area: str
    item: str
    state: str  # "ok", "warn" or "fail"
    detail: str


async def sandbox_layers(root: Path, files_mb: int = defaults.SANDBOX_FILES_MB) -> list[Check]:
    scratch = Path(tempfile.mkdtemp(prefix="drlm-doctor-"))
    try:
        try:
            blobs = BlobStore(DirectoryBackend(scratch / "blobs"))
            host = ReplActivities(blobs, "doctor", root, files_mb=files_mb)
            try:
                layers = await host.probe()
            finally:
                await host.close_all()  # the template too
        except Exception as exc:  # noqa: BLE001 - report whatever stopped the start
            return [Check("sandbox", "start", "fail", str(exc))]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    root_worker = os.geteuid() == 0
    network = layers.get("network", "?")
    return [
        Check("sandbox", "start", "ok", f"sandboxes start under {root}"),
        Check(
            "sandbox",
            "network",
            "ok" if network in ("netns", "userns+netns") else "warn",
            {
                "netns": "empty network namespace",
                "userns+netns": "empty network namespace (in a user namespace)",
            }.get(network, "no network namespace: only the audit hook refuses sockets"),
        ),
        Check(
            "sandbox",
            "filesystem",
            "ok" if layers.get("filesystem", "").startswith("private root") else "warn",
            layers.get("filesystem", "?"),
        ),
        Check(
            "sandbox",
            "uid",
            "ok" if (not root_worker or _own_uid(layers.get("uid", ""))) else "fail",
            layers.get("uid", "?") + (" (one per sandbox)" if root_worker else ""),
        ),
        Check(
            "sandbox",
            "ipc and pid namespaces",
            "ok" if layers.get("ipc_pid") == "ipc+pid" else "warn",
            "its own System V IPC (gone with it) and PIDs (it sees no other process)"
            if layers.get("ipc_pid") == "ipc+pid"
            else f"{layers.get('ipc_pid', '?')}: IPC objects or processes are visible across sandboxes",
        ),
        Check(
            "sandbox",
            "memory as a whole",
            "ok" if layers.get("cgroup", "").startswith("whole sandbox") else "warn",
            layers.get("cgroup", "?")
            if layers.get("cgroup", "").startswith("whole sandbox")
            else f"no cgroup ({cgroups.support().reason or layers.get('cgroup', '?')}); "
            + layers.get("rlimits", "?").partition("; ")[2].removeprefix("no cgroup: "),
        ),
        Check("sandbox", "rlimits", "ok", layers.get("rlimits", "?")),
        Check(
            "sandbox",
            "seccomp",
            "ok" if layers.get("seccomp", "").endswith("refused") else "warn",
            layers.get("seccomp", "?"),
        ),
        Check("sandbox", "death signal", "ok", layers.get("death_signal", "?")),
        Check(
            "sandbox",
            "audit hook",
            "ok" if layers.get("audit_hook") == "on" else "fail",
            layers.get("audit_hook", "?"),
        ),
        *disk_checks(layers, root, files_mb),
    ]


def disk_checks(layers: dict[str, str], root: Path, files_mb: int) -> list[Check]:
    """What one episode may put on disk: its sandbox's files and its REPL snapshots."""
    tmpfs = OWN_TMPFS in layers.get("filesystem", "")
    view = layers.get("view", "readable")
    return [
        Check(
            "disk",
            "sandbox files",
            "ok" if tmpfs and view == "readable" else "warn",
            f"a sandbox's own directory is a tmpfs of {files_mb:,} MB (DRLM_SANDBOX_FILES_MB), "
            "counted in its memory, never on the host's disk" + ("" if view == "readable" else f"; {view}")
            if tmpfs
            else f"on the host's disk under {root}: {defaults.SANDBOX_FILE_MB} MB a file "
            "(RLIMIT_FSIZE), no bound on the total (no private root here)",
        ),
        Check(
            "disk",
            "REPL snapshots",
            "ok",
            f"each episode keeps at most {defaults.SNAPSHOT_EPISODE_MB:,} MB of snapshots in the store "
            "(snapshots.max_mb): older ones are deleted as newer ones need the room, those a fork "
            "starts from are kept; one that does not fit is not taken, and the timeline says so",
        ),
    ]


def _own_uid(shown: str) -> bool:
    """A root worker's sandbox runs as a uid of its own, never root."""
    number = shown.removeprefix("uid ")
    return number.isdigit() and int(number) >= SandboxUids.FIRST


def platform_checks(settings: Settings) -> list[Check]:
    checks = [
        Check(
            "machine",
            "python",
            "ok",
            f"{platform.python_version()} on {platform.system()} {platform.release()}",
        )
    ]
    try:
        checks.append(Check("temporal", "dev server CLI", "ok", temporal_binary()))
    except Exception as exc:  # noqa: BLE001
        checks.append(Check("temporal", "dev server CLI", "fail" if settings.embedded else "warn", str(exc)))
    checks.append(
        Check(
            "temporal",
            "mode",
            "ok",
            f"embedded dev server on {settings.temporal_db_file}"
            if settings.embedded
            else f"client of {settings.temporal_address} (namespace {settings.temporal_namespace})",
        )
    )
    if settings.embedded:
        # Issue 33: who else on this machine could reach the shared server (server.py).
        checks.append(Check("temporal", "other local users", *local_exposure(settings)))
    location, chosen_by = settings.describe_stores()["data directory"]
    mode = settings.data_dir.stat().st_mode & 0o777 if settings.data_dir.is_dir() else None
    checks.append(
        Check(
            "stores",
            "data directory",
            "warn" if mode is not None and mode & 0o077 else "ok",
            f"{location} ({chosen_by})"
            + ("" if mode is None else f", mode {mode:o}" + (": others can read it" if mode & 0o077 else "")),
        )
    )
    try:
        engine = open_store(settings.effective_database_url)
        engine.dispose()
        checks.append(Check("stores", "SQL store", "ok", engine.url.render_as_string(hide_password=True)))
    except Exception as exc:  # noqa: BLE001
        checks.append(Check("stores", "SQL store", "fail", f"{type(exc).__name__}: {exc}"))
    checks.append(
        Check(
            "stores", "blob store", "ok", "SQL table" if settings.blob_store == "sql" else settings.blob_store
        )
    )
    key = "set" if os.environ.get("OPENAI_API_KEY") else "not set"
    base = os.environ.get("OPENAI_BASE_URL") or "the provider's default"
    checks.append(Check("models", "endpoint", "ok", f"OPENAI_BASE_URL: {base}; OPENAI_API_KEY {key}"))
    return checks


async def run_doctor(settings: Settings, console: Console | None = None) -> int:
    console = console or Console()
    root = settings.sandbox_dir or default_sandbox_root()
    checks = platform_checks(settings) + await sandbox_layers(root, settings.sandbox_files_mb)
    table = Table(title="drlm doctor")
    for column in ("area", "check", "state", "detail"):
        table.add_column(column)
    style = {"ok": "green", "warn": "yellow", "fail": "red"}
    for check in checks:
        table.add_row(check.area, check.item, f"[{style[check.state]}]{check.state}[/]", check.detail)
    console.print(table)
    return 1 if any(c.state == "fail" for c in checks) else 0
