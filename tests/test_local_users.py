"""Another user of the machine gets nothing from the shared server (docs/security.md,
"Other users of the machine").

Run as root (the harness's user), these tests start the data directory's shared server as
any client does, then act as uid `nobody` (the attacker) against every TCP port the
supervisor's process tree listens on in the host's network: the Temporal frontend, the Web
UI, the codec server. The same probes, run as the owner, must get answers, so a probe that
learns nothing because it is broken cannot pass.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from durable_rlm.ports import free_port, wait_listening
from durable_rlm.server.embedded import ServerFiles, acquire, running_state, shared_server, temporal_binary
from durable_rlm.settings import Settings

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another uid needs root")

SYSTEM_PYTHON = "/usr/bin/python3"  # the venv's interpreter lives under /root, closed to nobody
NOBODY = pwd.getpwnam("nobody")

# Connects to each port, says something in each protocol the ports speak, and reports how
# many bytes came back (stdlib only: it runs under the system interpreter as nobody).
PROBE = r"""
import json, socket, sys
ports, path = json.loads(sys.argv[1]), sys.argv[2]
body = b'{"payloads": [{"metadata": {"encoding": "anNvbi9wbGFpbg=="}, "data": "IngiCg=="}]}'
http1 = (
    f"POST {path}/decode HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
).encode() + body
h2 = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
got = {}
for port in ports:
    for name, hello in (("http1", http1), ("h2", h2)):
        received = b""
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=3) as sock:
                sock.sendall(hello)
                while len(received) < 65536:
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    received += chunk
        except OSError:
            pass
        got[f"{port}/{name}"] = len(received)
print(json.dumps(got))
"""


def listening_state(settings: Settings) -> dict:
    """The shared server's state once its codec server (and pages) listen: they come up a
    moment after the Temporal server answers (durable_rlm/supervisor.py)."""
    state = running_state(settings)
    assert state is not None and state.get("codec"), state
    assert wait_listening(str(state["codec"]), 30), "the supervisor's codec server never listened"
    return state


def probe(ports: list[int], path: str, as_nobody: bool) -> dict[str, int]:
    out = subprocess.run(
        [SYSTEM_PYTHON, "-c", PROBE, json.dumps(ports), path],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
        **({"user": NOBODY.pw_uid, "group": NOBODY.pw_gid, "extra_groups": []} if as_nobody else {}),
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def temporal_cli(address: str, home: Path, as_nobody: bool, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(home / "temporal"), *args, "--address", address, "--disable-config-file"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
        env={"HOME": str(home), "PATH": "/usr/bin:/bin"},
        **({"user": NOBODY.pw_uid, "group": NOBODY.pw_gid, "extra_groups": []} if as_nobody else {}),
    )


def process_tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def listening(table: str, inodes: set[str]) -> set[int]:
    """Ports in LISTEN state (0A) whose socket is one of `inodes`, from a /proc net table."""
    ports = set()
    for line in Path(table).read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and fields[9] in inodes:
            ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


@pytest.fixture
def nobody_home() -> Iterator[Path]:
    """A directory of nobody's, with a copy of the `temporal` CLI (the venv is root's). Not
    under pytest's base directory: pytest keeps that 0700 (and others' runs re-set it)."""
    home = Path(tempfile.mkdtemp(prefix="drlm-nobody-"))
    try:
        home.chmod(0o755)
        shutil.copy(temporal_binary(), home / "temporal")
        os.chown(home, NOBODY.pw_uid, NOBODY.pw_gid)
        yield home
    finally:
        shutil.rmtree(home, ignore_errors=True)


async def test_another_user_gets_nothing_from_any_port_of_the_shared_server(
    tmp_path: Path, nobody_home: Path
) -> None:
    settings = Settings(data_dir=tmp_path / "data", ui_port=free_port(), server_idle_s=2)
    async with shared_server(settings) as lease:
        state = listening_state(settings)
        assert state is not None and state["private"] is True
        tree = process_tree(int(state["pid"]))
        inodes = set().union(*(socket_inodes(pid) for pid in tree))
        host_ports = listening("/proc/self/net/tcp", inodes) | listening("/proc/self/net/tcp6", inodes)
        frontend = int(lease.address.rsplit(":", 1)[1])
        ui = int(str(lease.ui).rsplit(":", 1)[1])
        codec = int(str(state["codec"]).split("/")[2].rsplit(":", 1)[1])
        # Every port the tree opens on the host is one of these three; the dev server's own
        # ports (frontend, HTTP API, metrics, UI, internal services) are in its namespace.
        assert host_ports == {frontend, ui, codec}
        server_pid = next(p for p in tree if Path(f"/proc/{p}/exe").resolve().name == "temporal")
        inside = listening(f"/proc/{server_pid}/net/tcp", socket_inodes(server_pid))
        assert len(inside) >= 4 and not listening("/proc/self/net/tcp", socket_inodes(server_pid))

        # nobody knows the codec's capability (the dev server's command line shows it).
        path = "/" + str(state["codec"]).split("/", 3)[3]
        ports = sorted(host_ports)
        owner = probe(ports, path, as_nobody=False)
        stranger = probe(ports, path, as_nobody=True)
        for port in ports:
            assert owner[f"{port}/http1"] + owner[f"{port}/h2"] > 0, (port, owner)
        assert stranger == {key: 0 for key in owner}, stranger

        # What nobody did in the finding: list workflows, start one, and it is refused.
        listed = temporal_cli(lease.address, nobody_home, True, "workflow", "list")
        assert listed.returncode != 0 and "failed connecting" in listed.stderr, listed.stderr
        started = temporal_cli(
            lease.address, nobody_home, True, "workflow", "start", "--type", "EpisodeWorkflow",
            "--task-queue", "q", "--workflow-id", "planted",
        )  # fmt: skip
        assert started.returncode != 0
        mine = temporal_cli(lease.address, nobody_home, False, "workflow", "list")
        assert mine.returncode == 0, mine.stderr
        assert "planted" not in mine.stdout


async def test_the_web_ui_is_given_the_codec_capability(tmp_path: Path) -> None:
    import urllib.request

    settings = Settings(data_dir=tmp_path / "data", ui_port=free_port(), server_idle_s=2)
    async with shared_server(settings) as lease:
        state = listening_state(settings)
        assert state is not None
        files = ServerFiles.of(settings)
        secret = files.codec_secret.read_text().strip()
        assert files.codec_secret.stat().st_mode & 0o777 == 0o600 and len(secret) >= 32
        assert str(state["codec"]).endswith(f"/{secret}")
        with urllib.request.urlopen(f"{lease.ui}/api/v1/settings", timeout=30) as answer:
            ui_settings = json.loads(answer.read())
        assert ui_settings["Codec"]["Endpoint"] == state["codec"]
        # The capability answers; the same server without it (or with another) does not.
        base = str(state["codec"]).removesuffix(f"/{secret}")
        with urllib.request.urlopen(f"{state['codec']}/", timeout=10) as answer:
            assert json.loads(answer.read())["service"] == "drlm codec server"
        for wrong in ("", "/" + "x" * len(secret), f"/{secret[:-1]}"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(f"{base}{wrong}/", timeout=10)
            assert refused.value.code == 404


async def test_the_web_ui_answers_loopback_names_only(tmp_path: Path) -> None:
    """DNS rebinding: a page of evil.example whose name resolves to 127.0.0.1 would read the
    UI's API from the owner's own browser; its Host gives it away."""
    import http.client

    settings = Settings(data_dir=tmp_path / "data", ui_port=free_port(), server_idle_s=2)
    async with shared_server(settings) as lease:
        port = int(str(lease.ui).rsplit(":", 1)[1])

        def get(host: str) -> tuple[int, bytes]:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            try:
                connection.request("GET", "/api/v1/settings", headers={"Host": host})
                answer = connection.getresponse()
                return answer.status, answer.read()
            finally:
                connection.close()

        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.nip.io:80", "localhostx"):
            status, body = get(host)
            assert status == 421 and b"Codec" not in body, host
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost:9000", f"[::1]:{port}"):
            status, body = get(host)
            assert status == 200 and b"Codec" in body, (host, status, body[:200])


def test_the_gate_works_for_an_unprivileged_owner(nobody_home: Path) -> None:
    """As nobody (a user namespace owns its network): nobody's connections are forwarded to
    a server inside, and root's (root reads everything anyway); another uid's are reset."""
    import urllib.request

    from durable_rlm.server import private_net
    from durable_rlm.server.private_net import NO_NAMESPACE

    port = free_port()
    home = nobody_home / "www"
    home.mkdir(mode=0o755)
    (home / "index.html").write_text("inside")
    # The gate is stdlib only: a copy nobody can read runs where the source tree is root's.
    shutil.copy(private_net.__file__, nobody_home / "private_net.py")
    gate = subprocess.Popen(
        [SYSTEM_PYTHON, str(nobody_home / "private_net.py"), f"--forward={port}", "--",
         SYSTEM_PYTHON, "-m", "http.server", "--bind", "127.0.0.1", "--directory", str(home), str(port)],
        cwd="/", env={"PATH": "/usr/bin:/bin"},
        user=NOBODY.pw_uid, group=NOBODY.pw_gid, extra_groups=[],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        fetch = (
            "import sys, urllib.request, time\n"
            "for _ in range(int(sys.argv[1])):\n"
            "    try:\n"
            f"        print(urllib.request.urlopen('http://127.0.0.1:{port}/', timeout=5).read().decode())\n"
            "        break\n"
            "    except OSError: time.sleep(0.1)\n"
        )

        def fetch_as(uid: int, attempts: int) -> str:
            out = subprocess.run(
                [SYSTEM_PYTHON, "-c", fetch, str(attempts)], capture_output=True, text=True, timeout=60,
                cwd="/", user=uid, group=uid, extra_groups=[],
            )  # fmt: skip
            return out.stdout.strip()

        mine = fetch_as(NOBODY.pw_uid, attempts=100)  # also waits for the gate to listen
        if gate.poll() == NO_NAMESPACE:
            pytest.skip("unprivileged user namespaces are off on this machine")
        assert mine == "inside", gate.poll()
        assert fetch_as(NOBODY.pw_uid - 1, attempts=3) == ""  # another uid than the owner
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as answer:
            assert answer.read() == b"inside"  # root
    finally:
        gate.terminate()
        gate.wait(10)
    assert gate.returncode == 0, gate.stderr.read() if gate.stderr else ""


def test_doctor_names_the_other_login_users_and_what_stays_open(tmp_path: Path) -> None:
    from durable_rlm.host.processes import start_time
    from durable_rlm.server.embedded import local_exposure, other_login_users

    settings = Settings(data_dir=tmp_path / "data")
    others = other_login_users()
    accounts = {e.pw_name: e for e in pwd.getpwall()}
    assert "nobody" not in others  # no shell, no login
    assert all(accounts[name].pw_uid not in (0, os.getuid()) for name in others)
    state, detail = local_exposure(settings)  # no server running: a namespace is tried
    assert "admit only uid" in detail
    if others:
        assert state == "warn" and others[0] in detail and "(ps)" in detail
    # A server that had to run in the open (no namespace) is said to be open.
    files = ServerFiles.of(settings)
    me = os.getpid()
    files.write_state({"address": "127.0.0.1:1", "pid": me, "started": start_time(me), "private": False})
    state, detail = local_exposure(settings)
    assert state == "warn" and "open to every local user" in detail


POST_HISTORY = r"""
import json, socket, sys
url, body = sys.argv[1], open(sys.argv[2], "rb").read()
host_port, path = url.removeprefix("http://").split("/", 1)
request = (
    f"POST /{path}/decode HTTP/1.1\r\nHost: {host_port}\r\nContent-Type: application/json\r\n"
    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
).encode() + body
received = b""
try:
    with socket.create_connection(("127.0.0.1", int(host_port.split(":")[1])), timeout=10) as sock:
        sock.sendall(request)
        while chunk := sock.recv(1 << 20):
            received += chunk
except OSError:
    pass
sys.stdout.write(received.decode("utf-8", "replace"))
"""


async def test_an_encrypted_episodes_history_posted_by_another_user_decodes_to_nothing(
    tmp_path: Path, nobody_home: Path, scripted
) -> None:
    """The finding itself: with DRLM_ENCRYPTION_KEYS set, uid nobody POSTed an episode's
    history payloads to the supervisor's codec server (capability included: `ps` shows it)
    and got the task and the answer in clear. Now nobody gets no byte; the owner still does."""
    import base64

    from durable_rlm.api import DurableRLM
    from durable_rlm.scripted import root_and_sub
    from tests.test_codec_server import ui_payloads

    key = base64.b64encode(os.urandom(32)).decode()
    settings = Settings(
        data_dir=tmp_path / "data", ui_port=free_port(), server_idle_s=2, encryption_keys=f"k1={key}"
    )
    model = scripted(root_and_sub(["FINAL(the vault code is 4711)"]))
    rlm = DurableRLM("scripted", base_url=model.base_url, settings=settings)
    held = await acquire(settings)  # one supervisor for the whole test, however slow the machine
    services = await rlm.open()
    try:
        episode = await rlm.start("the ledger of accounts", "Which code opens the vault?", "sealed-1")
        assert (await episode.result()).answer == "the vault code is 4711"
        history = await services.client.get_workflow_handle("sealed-1").fetch_history()
        state = listening_state(settings)
        assert state is not None
    finally:
        await rlm.close()
    payloads = ui_payloads(history.to_json_dict())
    raw = json.dumps(payloads)
    assert "4711" not in raw and "Which code" not in raw  # sealed in history
    body = nobody_home / "history.json"
    body.write_text(json.dumps({"payloads": payloads}))
    body.chmod(0o644)

    def post(as_nobody: bool) -> str:
        out = subprocess.run(
            [SYSTEM_PYTHON, "-c", POST_HISTORY, str(state["codec"]), str(body)],
            capture_output=True, text=True, timeout=60, cwd="/",
            **({"user": NOBODY.pw_uid, "group": NOBODY.pw_gid, "extra_groups": []} if as_nobody else {}),
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        return out.stdout

    try:
        assert running_state(settings)["pid"] == state["pid"]
        mine, theirs = post(as_nobody=False), post(as_nobody=True)
    finally:
        held.release()
    assert mine.startswith("HTTP/1.1 200")
    decoded = json.loads(mine.split("\n\n", 1)[1])["payloads"]  # text mode: \r\n read as \n
    shown = [base64.b64decode(p["data"]).decode() for p in decoded]
    assert any("4711" in text for text in shown) and any("Which code opens the vault?" in t for t in shown)
    assert theirs == ""


def test_a_time_wait_stub_never_names_the_owner() -> None:
    """/proc/net/tcp prints TIME_WAIT and SYN_RECV stubs with uid 0; a stale one sharing the
    4-tuple of another user's connection must not make it the owner's (root's)."""
    from durable_rlm.server.private_net import TcpTable

    header = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    )
    stub = "   0: 0100007F:A000 0100007F:1F90 06 00000000:00000000 03:00000F3C 00000000     0        0 0\n"
    live = "   1: 0100007F:A000 0100007F:1F90 01 00000000:00000000 00:00000000 00000000 65534        0 91\n"
    table = TcpTable()
    try:
        for text, uid in (
            (header + stub + live, 65534),
            (header + stub, None),
            (header + live + live, 65534),
        ):
            table._text = lambda text=text: text  # type: ignore[method-assign]
            assert table.owner(("127.0.0.1", 0xA000), ("127.0.0.1", 0x1F90)) == uid
        table._text = lambda: header + live + live.replace("65534", "    0")  # type: ignore[method-assign]
        assert table.owner(("127.0.0.1", 0xA000), ("127.0.0.1", 0x1F90)) is None
    finally:
        table.close()
