"""Starting a sandbox: its directory, its init message, and its process, forked or spawned.

A sandbox is forked from a template process (activities/sandbox/forkserver.py, started on
first use and again if it dies) or, in spawn mode or while no template can start, spawned
as a fresh interpreter; both run the same code and report the same layers. The worker's
sandbox settings (`SandboxConfig`) are read as each sandbox starts.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from temporalio.exceptions import ApplicationError

from durable_rlm.activities.context_cache import ContextCache
from durable_rlm.activities.context_room import sandbox_room
from durable_rlm.activities.live_sandbox import UNREADABLE_VIEW, LiveSandbox
from durable_rlm.activities.sandbox.kernel import OWN_TMPFS
from durable_rlm.activities.sandbox_processes import (
    ForkServer,
    ForkServerError,
    SandboxProcess,
    SandboxUids,
    sandbox_env,
    spawn_sandbox,
    uss_bytes,
)
from durable_rlm.activities.sandbox_protocol import FRAME_OVERHEAD, READ_BUFFER, FrameInbox, read_frames
from durable_rlm.activities.sandbox_reaper import SandboxHome
from durable_rlm.host.files import sandbox_file_tail
from durable_rlm.host.owned_dirs import owned_directory
from durable_rlm.store.blobs import BlobStore
from durable_rlm.workflows import defaults, names
from durable_rlm.workflows.models import SandboxRef

log = logging.getLogger(__name__)

FORK_RETRY_S = 60.0  # after a template failed to start, sandboxes are spawned this long


def default_sandbox_root() -> Path:
    """Where sandboxes live unless DRLM_SANDBOX_DIR says: shared by the workers of this user,
    so one reaps the sandboxes another left when it died."""
    return Path(tempfile.gettempdir()) / "drlm-sandboxes"


def prepare_sandbox_root(root: Path) -> Path:
    """The root, this worker's own: made now, or refused when another user made it, could
    swap it or could write in it (durable_rlm/host/owned_dirs.py); its homes' records say which
    processes a reaper may kill. When sandboxes drop to other uids, every parent must let
    them through, and the root only through (0711)."""
    mode = 0o711 if os.geteuid() == 0 else 0o700
    root = owned_directory(root, mode=mode, parents_mode=mode)
    if os.geteuid() == 0:
        for parent in [root, *root.parents]:
            if not os.stat(parent).st_mode & 0o001:
                raise ValueError(
                    f"sandbox directory {root} is unreachable for the unprivileged sandbox user: "
                    f"{parent} is not traversable by others (chmod o+x, or choose another root)"
                )
    return root


def refuse_too_large(ref: SandboxRef, memory_mb: int) -> None:
    """A context no sandbox of this worker can hold as one string ends the step with the
    reason (a client elsewhere checked it against the budget at best, not this host's)."""
    context = ref.context
    if context is None or context.kind == "documents" or context.view == "mapped" or not context.stored_bytes:
        return
    refusal = sandbox_room(memory_mb).refusal(
        f"the context ({context.size:,} characters)", context.size * context.char_width, context.stored_bytes
    )
    if refusal is not None:
        raise ApplicationError(refusal, type=names.SANDBOX_FAILURE, non_retryable=True)


@dataclass
class SandboxConfig:
    """How this worker makes and keeps its sandboxes (ReplActivities' arguments). Read as
    each sandbox starts or each pass runs, so a change applies to the next one."""

    memory_mb: int
    idle_s: float
    max_frame_bytes: int
    audit_hook: bool  # tests turn it off to prove the other layers hold alone
    sandbox_start: str  # "fork" or "spawn"
    memory_budget_mb: int | None
    filesystem: bool  # the private root; tests of the other layers turn it off
    namespaces: str  # "user": as a root worker without CAP_SYS_ADMIN would
    files_mb: int | None = defaults.SANDBOX_FILES_MB  # its own directory a tmpfs this big (None: the host's)


class SandboxStarter:
    """Starts this worker's sandboxes, and owns the template they are forked from."""

    def __init__(
        self, blobs: BlobStore, config: SandboxConfig, home: SandboxHome, uids: SandboxUids | None
    ) -> None:
        self.blobs = blobs
        self.contexts = ContextCache(blobs, encrypting=blobs.keyring is not None)
        self.config = config
        self.home = home
        self.uids = uids
        self.template: ForkServer | None = None
        self._template_lock = asyncio.Lock()
        self._fork_retry_at = 0.0
        self.fork_warned = False
        self.network_warned = False

    async def start(self, ref: SandboxRef) -> LiveSandbox:
        """A new sandbox for `ref`'s episode, ready (its layers in place), in a directory of
        its own with the episode's context, under a uid of its own when the worker is root."""
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in ref.episode_id)[:80]
        directory = self.home.ensure() / f"{safe}-{uuid.uuid4().hex[:8]}"
        directory.mkdir()
        config = self.config
        init: dict[str, Any] = {
            "op": "init",
            "seed": ref.seed,
            "memory_mb": config.memory_mb,
            "file_mb": defaults.SANDBOX_FILE_MB,
            "variables_shown": defaults.VARIABLES_SHOWN,
            "variable_chars": defaults.VARIABLE_CHARS,
            "audit_hook": config.audit_hook,
            "child_batch_cap": ref.child_batch_cap,
            "rlms": ref.rlms,
            "dspy_outputs": ref.dspy_outputs,
            "tools": [spec.model_dump(mode="json") for spec in ref.tools],
            "cpu_s": defaults.SANDBOX_CPU_S,
            "processes": defaults.SANDBOX_PROCESSES,
            "filesystem": config.filesystem,
            # The sandbox refuses larger calls in the cell; a frame past them is refused here.
            "max_prompts": defaults.MAX_PROMPTS_PER_CALL,
            "max_call_bytes": defaults.MAX_CALL_BYTES,
            "dir_mb": config.files_mb,
        }
        if config.namespaces == "user":
            init["namespaces"] = "user"  # tests: the path of a root worker without CAP_SYS_ADMIN
        uid = self.uids.claim() if self.uids is not None else None
        try:
            if ref.context is not None:
                refuse_too_large(ref, config.memory_mb)
                # The worker's read-only copy, made once and mapped by every sandbox over it.
                copy = await self.contexts.copy_of(ref.context)
                init["context"] = copy.init_message(ref.context.view)
            if uid is not None:
                init["uid"] = uid
                for p in [directory, *directory.iterdir()]:
                    os.chown(p, uid, uid)
            process = await self._start_process(directory)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)  # no process yet: nothing else holds it
            if uid is not None and self.uids is not None:
                self.uids.release(uid)
            raise
        self.home.record(process.pid, "sandbox")
        frames = FrameInbox(defaults.SANDBOX_IN_FLIGHT_BYTES)
        max_frame = min(config.max_frame_bytes, defaults.SANDBOX_IN_FLIGHT_BYTES - FRAME_OVERHEAD)
        box = LiveSandbox(
            episode_id=ref.episode_id,
            process=process,
            directory=directory,
            frames=frames,
            reader=asyncio.create_task(read_frames(process.stdout, frames, max_frame)),
            uid=uid,
            uids=self.uids,
        )
        try:
            await box.send(init)
            ready = await box.receive(defaults.SANDBOX_STARTUP_S)
        except BaseException:
            await asyncio.shield(box.kill())
            raise
        if ready is None or ready.get("op") != "ready":
            if ready is not None and ready.get("op") == "failed":
                detail = str(ready.get("error"))
            else:
                detail = await asyncio.to_thread(sandbox_file_tail, directory, "sandbox.err") or "no output"
            await box.kill()
            raise ApplicationError(f"the REPL sandbox failed to start: {detail}", type=names.SANDBOX_FAILURE)
        box.layers = dict(ready.get("layers") or {})
        if box.layers.get("network") == "none" and not self.network_warned:
            self.network_warned = True
            log.warning(
                "sandboxes have no network namespace on this worker (unshare refused); only the "
                "audit hook refuses sockets. Run the worker as root or allow user namespaces."
            )
        return box

    async def _start_process(self, directory: Path) -> SandboxProcess:
        """Fork the sandbox from the template, or spawn it (spawn mode, or no template)."""
        env = sandbox_env(directory)
        if self.config.sandbox_start == "fork":
            template = await self.running_template()
            if template is not None:
                try:
                    return await template.fork(directory, env, READ_BUFFER, defaults.SANDBOX_STARTUP_S)
                except ForkServerError as exc:
                    self._fork_failed(str(exc))
        return await spawn_sandbox(directory, env, READ_BUFFER)

    async def running_template(self) -> ForkServer | None:
        """The template, started now if there is none or it died; None while a failed start
        is recent (sandboxes are spawned meanwhile)."""
        async with self._template_lock:
            if self.template is not None and self.template.alive:
                return self.template
            if time.monotonic() < self._fork_retry_at:
                return None
            try:
                self.template = await ForkServer.start(self.home.ensure(), defaults.SANDBOX_STARTUP_S)
                self.home.record(self.template.pid, "template")
            except (ForkServerError, OSError) as exc:
                self.template = None
                self._fork_retry_at = time.monotonic() + FORK_RETRY_S
                self._fork_failed(str(exc))
            return self.template

    async def warm(self) -> None:
        """Start the template now, before any step needs it: its interpreter and imports
        (~0.2 s) then run in a process of their own beside the worker's start and the
        episode's first model call, not on its first step's path. Spawn mode has none."""
        if self.config.sandbox_start == "fork":
            await self.running_template()

    def _fork_failed(self, problem: str) -> None:
        if not self.fork_warned:
            self.fork_warned = True
            log.warning(
                "sandboxes cannot be forked from a template on this worker (%s); they are spawned "
                "instead (slower to start, more memory each)",
                problem,
            )

    def template_uss(self) -> int | None:
        """The template's unique set size; None in spawn mode, or when no template runs."""
        template = self.template
        return uss_bytes(template.pid) if template is not None and template.alive else None

    async def close(self) -> None:
        """Stop the template (a later sandbox starts a new one) and remove the home."""
        async with self._template_lock:
            if self.template is not None:
                await self.template.close()
                self.template = None
            self.home.remove()  # made again if this host starts another sandbox
            self.contexts.close()  # and the context copies with it
            if self.uids is not None:
                self.uids.reap_stale()

    async def probe(self) -> dict[str, str]:
        """Start a sandbox, report its isolation layers, and close it (`drlm doctor`). A
        forked sandbox and a spawned one report the same layers: they run the same code."""
        ref = SandboxRef(
            episode_id=f"doctor-{uuid.uuid4().hex[:8]}",
            context=None,
            seed=0,
            log_head=None,
            cell_timeout_s=5,
            output_truncation=1_000,
        )
        box = await self.start(ref)
        try:
            layers = dict(box.layers)
            if OWN_TMPFS in layers.get("filesystem", ""):
                layers["view"] = "readable" if box.view_readable() else UNREADABLE_VIEW
            return layers
        finally:
            await box.kill()
