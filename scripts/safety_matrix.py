"""Switch off one safety mechanism at a time, in a copy of the tree, and run the suite.

    .venv/bin/python scripts/safety_matrix.py [--only NAME ...]

Each mechanism must have a test that fails when that mechanism alone is off; a mechanism
whose suite stays green is a hole in the tests, and the script exits non-zero. The suite
runs with the security and recovery tests first and stops at the first failure, so a
caught mechanism costs seconds. The table it prints goes in docs/testing.md ("Safety mechanisms").
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIRST = [
    "tests/test_liveness.py",  # a minute
    "tests/test_model_failures.py",  # half a minute
    "tests/test_local_users.py",  # seconds; the codec capability is caught in test_codec_server.py
    "tests/test_page_access.py",  # seconds: the Host check, the one-shot login, `ps` of `drlm ui --open`
    "tests/test_repl.py",
    "tests/test_escape.py",  # the kernel layers, attacked with the audit hook on and off
    "tests/test_snapshots.py",
    "tests/test_recovery.py",
    "tests/test_replay.py",
    "tests/test_episode.py",
    "tests/test_answers.py",
    "tests/test_hygiene.py",
    "tests/test_everyday.py",
    "tests/test_sandbox_files.py",  # seconds
    "tests/test_host_protocol.py",
    "tests/test_reply_limits.py",  # a minute and a half
    "tests/test_wire_values.py",  # seconds
    "tests/test_frame_bounds.py",  # half a minute
    "tests/test_owned_dirs.py",  # seconds
    "tests/test_disk_quotas.py",  # half a minute
]


@dataclass(frozen=True)
class Mechanism:
    name: str
    file: str
    find: str
    replace: str
    how: str


MECHANISMS = [
    Mechanism(
        "sandbox file barrier",
        "activities/sandbox/layers.py",
        "if path is not None and not inside(path, roots):",
        "if path is not None and not writing and not inside(path, roots):",
        "the audit hook lets cells write anywhere their uid may",
    ),
    Mechanism(
        "network namespace",
        "activities/sandbox/layers.py",
        '    if root and init.get("namespaces") != "user" and libc.unshare(kernel.CLONE_NEWNET) == 0:',
        '    if root and init.get("namespaces") != "user" and libc.unshare(0) == 0:',
        "the root path's unshare leaves the sandbox in the worker's network",
    ),
    Mechanism(
        "uid drop",
        "activities/sandbox/layers.py",
        "    os.setgroups([])\n    os.setgid(uid)\n    os.setuid(uid)\n",
        '    return "kept"\n',
        "set_ids() keeps the worker's uid",
    ),
    Mechanism(
        "rlimits",
        "activities/sandbox/layers.py",
        "            resource.setrlimit(kind, (value, value))",
        "            pass",
        "set_limits() sets nothing",
    ),
    Mechanism(
        "death signal",
        "activities/sandbox/layers.py",
        "        result = libc.prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL",
        "        result = 0",
        "no PR_SET_PDEATHSIG",
    ),
    Mechanism(
        "audit hook",
        "activities/sandbox/layers.py",
        "        sys.addaudithook(guard)",
        "        pass",
        "the hook is never installed",
    ),
    Mechanism(
        "claim check",
        "durable_rlm/store/codec.py",
        "    if blobs is not None:\n        codecs.append(ClaimCheckCodec(blobs, threshold))",
        "    if False:\n        codecs.append(ClaimCheckCodec(blobs, threshold))",
        "no payload codec: payloads go into history whole",
    ),
    Mechanism(
        "divergence detection",
        "activities/repl_rebuild.py",
        "if answer.prompt != request.prompt_digest or answer.kind != request.kind:",
        "if False:",
        "a rebuilt cell's different call is answered silently",
    ),
    Mechanism(
        "snapshot signature",
        "activities/repl_snapshots.py",
        "if not hmac.compare_digest(snapshot.mac, self._mac(snapshot)):",
        "if False:",
        "a rebuild loads a snapshot without checking its keyed hash",
    ),
    Mechanism(
        "snapshot episode binding",
        "activities/repl_snapshots.py",
        "if snapshot.episode != ref.episode_id and not self._descends(ref, snapshot.episode):",
        "if False:",
        "a rebuild loads another episode's snapshot",
    ),
    Mechanism(
        "fork lineage signature",
        "activities/repl_snapshots.py",
        "        return hmac.compare_digest(ref.lineage_mac, signed)",
        "        return True",
        "a request that claims to be a fork loads another episode's snapshot",
    ),
    Mechanism(
        "sandbox reaping",
        "activities/sandbox_reaper.py",
        "            done = _reap_one(root, entry, here, grace_s)",
        "            done = None",
        "dead workers' sandbox homes are never reaped",
    ),
    Mechanism(
        "shared server leases",
        "durable_rlm/server/embedded.py",
        "            if holder_alive:",
        "            if False:",
        "the supervisor counts no client's lease",
    ),
    # Another user of the machine reads nothing from the shared server (docs/security.md).
    Mechanism(
        "shared server's private network",
        "durable_rlm/supervisor.py",
        "        private=True,\n",
        "        private=False,\n",
        "the supervisor starts the dev server on the host's loopback",
    ),
    Mechanism(
        "owner-uid forwarder",
        "durable_rlm/server/private_net.py",
        "        if peer_uid(sock, self.gate.table) not in self.gate.admitted:",
        "        if False:",
        "the forwarder admits every uid",
    ),
    Mechanism(
        "codec capability",
        "durable_rlm/viewer/codec_requests.py",
        "        return hmac.compare_digest(first.encode(), self.codec.path_secret.encode())",
        "        return True",
        "the codec server answers without its path secret",
    ),
    Mechanism(
        "codec host check",
        "durable_rlm/viewer/codec_requests.py",
        'if host_of(self.headers.get("Host")) not in self.codec.hosts:',
        "if False:",
        "the page and codec server answer any Host header (a DNS-rebinding page's)",
    ),
    Mechanism(
        "CORS origin compared whole",
        "durable_rlm/viewer/codec_server.py",
        'return "*" in self.origins or origin.rstrip("/") in self.origins',
        'return "*" in self.origins or any(origin.startswith(o) for o in self.origins)',
        "an origin that begins like the UI's (http://127.0.0.1:8233.evil.example) gets credentials",
    ),
    Mechanism(
        "one-shot login",
        "durable_rlm/viewer/codec_server.py",
        "            found = self._tokens.pop(token, None) if token else None",
        "            found = self._tokens.get(token) if token else None",
        "a login link opens the page again and again",
    ),
    Mechanism(
        "capability off the command line",
        "durable_rlm/server/embedded.py",
        '            args += ("--env-file", str(self._codec_env_file()), "--env", "default")',
        '            args += ("--ui-codec-endpoint", str(self.codec_endpoint))',
        "the Temporal server's command line carries the codec endpoint and its secret",
    ),
    Mechanism(
        "codec owner uid",
        "durable_rlm/viewer/codec_requests.py",
        "if self.codec.owner_uid is not None and peer_uid(self.connection) != self.codec.owner_uid:",
        "if False:",
        "the codec server answers every uid",
    ),
    Mechanism(
        "UI host check",
        "durable_rlm/server/private_net.py",
        "            if not loopback_host(bytes(self.held)):",
        "            if False:",
        "the UI's port answers any Host (DNS rebinding)",
    ),
    # The host trusts no path, size or count a sandbox chose (docs/security.md).
    Mechanism(
        "sandbox file: no link followed",
        "durable_rlm/host/files.py",
        "_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK",
        "_READ = os.O_RDONLY | os.O_NONBLOCK",
        "the host opens a snapshot path through a link the sandbox planted",
    ),
    Mechanism(
        "sandbox file: regular files only",
        "durable_rlm/host/files.py",
        "        if not stat.S_ISREG(info.st_mode):\n            raise",
        "        if False:\n            raise",
        "the host reads a FIFO or a device the sandbox left as its snapshot",
    ),
    Mechanism(
        "sandbox file: bounded read",
        "durable_rlm/host/files.py",
        "            if len(data) > limit:",
        "            if False:",
        "the host reads a snapshot file for as long as it grows",
    ),
    Mechanism(
        "sandbox tree removal without recursion",
        "activities/live_sandbox.py",
        "run_in_executor(REMOVER, remove_sandbox_tree, self.directory)",
        "run_in_executor(REMOVER, shutil.rmtree, self.directory, True)",
        "a sandbox's directory is removed by shutil.rmtree (a descriptor and a frame per level)",
    ),
    Mechanism(
        "frames bounded in bytes",
        "activities/sandbox_protocol.py",
        "        while self.held and self.held + size > self.budget:",
        "        while False:",
        "the host reads every frame a sandbox sends, however many bytes are waiting",
    ),
    Mechanism(
        "frames checked field by field",
        "activities/live_sandbox.py",
        "            frame = await asyncio.to_thread(decode_frame, item) if big else decode_frame(item)",
        "            frame = json.loads(item)",
        "a frame is taken as any JSON object",
    ),
    Mechanism(
        "one frame within the in-flight budget",
        "activities/sandbox_start.py",
        "        max_frame = min(config.max_frame_bytes, defaults.SANDBOX_IN_FLIGHT_BYTES - FRAME_OVERHEAD)",
        "        max_frame = config.max_frame_bytes",
        "one frame of up to the format's 256 MiB is read into the worker (a frame alone always fits)",
    ),
    Mechanism(
        "calls capped in the cell",
        "activities/sandbox/host_calls.py",
        '            self.max_prompts = int(message["max_prompts"])',
        "            pass",
        "a cell's llm_query_batched may carry any number of prompts",
    ),
    Mechanism(
        "IPC namespace",
        "activities/sandbox/kernel.py",
        "SANDBOX_NAMESPACES = CLONE_NEWIPC | CLONE_NEWPID\n",
        "SANDBOX_NAMESPACES = CLONE_NEWPID\n",
        "sandboxes share the host's System V IPC",
    ),
    Mechanism(
        "PID namespace",
        "activities/sandbox/kernel.py",
        "SANDBOX_NAMESPACES = CLONE_NEWIPC | CLONE_NEWPID\n",
        "SANDBOX_NAMESPACES = CLONE_NEWIPC\n",
        "the REPL sees and may name every process of the host",
    ),
    Mechanism(
        "sandbox cgroup",
        "activities/sandbox/cgroups.py",
        '            _write(os.path.join(path, "cgroup.procs"), str(pid))\n',
        "",
        "leaves are made, but no sandbox is moved into one",
    ),
    Mechanism(
        "RLIMIT_AS x RLIMIT_NPROC",
        "activities/sandbox/layers.py",
        "    if not whole and processes is not None:\n",
        "    if False:\n",
        "without a cgroup, each process may have the whole budget",
    ),
    # A dead worker's calls retried at once, and planted files not followed (the liveness signal).
    Mechanism(
        "liveness: dead workers reaped",
        "durable_rlm/worker/liveness.py",
        "            dead = await asyncio.shield(finding)\n",
        "            dead: list[_DeadWorker] = []\n",
        "a worker never fails a dead worker's attempts (they wait for the heartbeat timeout)",
    ),
    Mechanism(
        "liveness: a ledger link not followed",
        "durable_rlm/worker/liveness.py",
        "        return stat.S_ISDIR(os.lstat(ledger).st_mode)\n",
        "        return ledger.is_dir()\n",
        "a dead worker's ledger that is a link is read (and its files removed) where it points",
    ),
    Mechanism(
        "failure stack traces bounded",
        "durable_rlm/store/codec.py",
        "        failure.stack_trace = innermost_frames(failure.stack_trace)\n",
        "        pass\n",
        "a failure carries every frame of its stack (the server warns past 2 KB, drops past 4 KB)",
    ),
    Mechanism(
        "seccomp: io_uring and memfd",
        "activities/sandbox/kernel.py",
        '    "memfd_create": 319,\n    "io_uring_setup": 425,\n',
        "",
        "io_uring_setup and memfd_create are allowed",
    ),
    Mechanism(
        "seccomp: socket families",
        "activities/sandbox/kernel.py",
        'DENIED_SOCKET_FAMILIES = {"AF_NETLINK": AF_NETLINK, "AF_PACKET": AF_PACKET, "AF_VSOCK": AF_VSOCK}',
        'DENIED_SOCKET_FAMILIES = {"AF_PACKET": AF_PACKET}',
        "netlink and vsock sockets are allowed",
    ),
    # Every size the host takes from a model is bounded before it is parsed (docs/security.md).
    Mechanism(
        "reply body read within its cap",
        "activities/llm.py",
        "        with reading_at_most(body_cap(max_reply_chars)):",
        "        with contextlib.nullcontext():",
        "the client reads a reply's whole body (a 100 MB reply, decompressed, into the worker)",
    ),
    Mechanism(
        "reply cut at max_reply_chars",
        "activities/reply_limits.py",
        "    if len(text) <= limit and whole:\n        return text, None",
        "    if True:\n        return text, None",
        "a reply of any length goes to the workflow task, history and the conversation",
    ),
    Mechanism(
        "extraction reads the first fences only",
        "workflows/fallback.py",
        "itertools.islice(iter_fenced_blocks(text), EXTRACTION_FENCES_READ)",
        "iter_fenced_blocks(text)",
        "an extraction reply of a million fenced blocks costs a million parses in a workflow task",
    ),
    Mechanism(
        "frames bounded in values and depth",
        "activities/sandbox_protocol.py",
        "        values.check(body, defaults.SANDBOX_FRAME_VALUES, defaults.SANDBOX_FRAME_DEPTH)\n",
        "        pass\n",
        "a frame's JSON is parsed whatever it builds (60 MB of `[{},...]`: 20 million objects)",
    ),
    Mechanism(
        "MAX_CALL_BYTES on the host",
        "activities/sandbox_protocol.py",
        "    if isinstance(frame, Call) and len(body) > defaults.MAX_CALL_BYTES:",
        "    if False:",
        "a call the sandbox's own check let through (its code changed) reaches the provider",
    ),
    Mechanism(
        "tool arguments bounded in values",
        "activities/tools.py",
        'call = values.loads(request.arguments.encode("utf-8", "surrogatepass"))',
        "call = json.loads(request.arguments)",
        "a tool call's arguments are parsed whatever they build",
    ),
    # No directory another user made, could swap or could write (docs/security.md).
    Mechanism(
        "sandbox root of the worker's own",
        "activities/sandbox_start.py",
        "    root = owned_directory(root, mode=mode, parents_mode=mode)\n",
        "    root = root.resolve()\n    root.mkdir(parents=True, exist_ok=True)\n    os.chmod(root, mode)\n",
        "a root worker uses (and chmods) a sandbox root another user made, or a link one left",
    ),
    Mechanism(
        "reaper: own homes only",
        "activities/sandbox_reaper.py",
        "    if info.st_uid != os.geteuid():\n        return None  # another user's",
        "    if os.geteuid() != 0 and info.st_uid != os.geteuid():\n        return None  # another user's",
        "a root reaper judges homes other users made",
    ),
    Mechanism(
        "reaper: own records only",
        "activities/sandbox_reaper.py",
        "if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_size > RECORD_BYTES:",
        "if not stat.S_ISREG(info.st_mode) or info.st_size > RECORD_BYTES:",
        "the reaper kills the processes named by records another user wrote",
    ),
    Mechanism(
        "data directory of the user's own",
        "durable_rlm/settings.py",
        "    owned_directory(path, 0o700)\n    return path",
        "    path.mkdir(parents=True, exist_ok=True, mode=0o700)\n    return path",
        "the data directory (store, snapshot key) may be one another user made",
    ),
    # What one episode may put on disk (docs/security.md).
    Mechanism(
        "sandbox directory a tmpfs",
        "activities/sandbox/layers.py",
        '    dir_mb = int(init["dir_mb"]) if init.get("dir_mb") else None',
        "    dir_mb = None",
        "a sandbox's own directory is the host's: its cells write to the host's disk without bound",
    ),
    Mechanism(
        "snapshot quota: older ones go",
        "activities/repl_snapshots.py",
        "        while len(kept) > 1 and total > quota:",
        "        while False:",
        "every snapshot an episode takes stays in the store",
    ),
    Mechanism(
        "snapshot quota: room beside the last",
        "activities/repl_snapshots.py",
        "        limit = min(defaults.SNAPSHOT_MAX_MB * 2**20, room)",
        "        limit = defaults.SNAPSHOT_MAX_MB * 2**20",
        "a snapshot larger than the quota leaves room for is taken anyway",
    ),
    Mechanism(
        "large buffers returned to the system",
        "durable_rlm/worker/runtime.py",
        "    return_large_buffers()  # a snapshot or a reply of megabytes leaves no heap behind\n",
        "",
        "a worker that read a few large snapshots stays hundreds of megabytes larger",
    ),
]


def copy_tree(dest: Path) -> None:
    ignore = shutil.ignore_patterns(
        ".venv", ".git", "mutants", "__pycache__", ".drlm", "*.egg-info", ".ruff_cache"
    )
    shutil.copytree(ROOT, dest, ignore=ignore, dirs_exist_ok=True)


def switch_off(tree: Path, mechanism: Mechanism) -> None:
    path = tree / mechanism.file
    text = path.read_text()
    if text.count(mechanism.find) != 1:
        raise SystemExit(f"{mechanism.name}: the code to switch off is not in {mechanism.file} exactly once")
    path.write_text(text.replace(mechanism.find, mechanism.replace))


def run_suite(tree: Path) -> tuple[bool, str, float]:
    """(a test failed, the first failing test, seconds)."""
    rest = sorted(
        str(p.relative_to(tree))
        for p in (tree / "tests").glob("test_*.py")
        if str(p.relative_to(tree)) not in FIRST
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "TEMPORAL_", "DRLM_"))}
    # Subprocesses (`drlm`, worker.py) import the copy too, not the editable install's tree.
    env["PYTHONPATH"] = str(tree)
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-x",
            "-q",
            "-rfE",
            "-p",
            "no:cacheprovider",
            "-m",
            "",
            *FIRST,
            *rest,
        ],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", done.stdout, re.MULTILINE)
    return done.returncode != 0, (failed[0] if failed else ""), time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="mechanism names to test (default: all)")
    args = parser.parse_args()
    chosen = [m for m in MECHANISMS if not args.only or m.name in args.only]
    rows, holes = [], 0
    for mechanism in chosen:
        with tempfile.TemporaryDirectory(prefix="drlm-safety-") as scratch:
            tree = Path(scratch) / "tree"
            copy_tree(tree)
            switch_off(tree, mechanism)
            caught, first, seconds = run_suite(tree)
        holes += not caught
        verdict = f"caught by `{first}`" if caught else "NOT CAUGHT: every test passed"
        rows.append(f"| {mechanism.name} | {mechanism.how} | {verdict} | {seconds:.0f} s |")
        print(rows[-1], flush=True)
    print("\n| mechanism | switched off by | result | time |\n| --- | --- | --- | --- |")
    print("\n".join(rows))
    sys.stdout.flush()
    return 1 if holes else 0


if __name__ == "__main__":
    raise SystemExit(main())
