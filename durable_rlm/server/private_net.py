"""The embedded Temporal server in a network of its own, reachable only by its owner.

The dev server (`temporal server start-dev`) has no authentication and no TLS flags: on
127.0.0.1 every local user could list, read, start and terminate workflows, and read its Web
UI. So the supervisor starts it through this small gate (`python -m durable_rlm.server.private_net
--forward PORT ... -- temporal server start-dev ...`):

1. The gate binds its host-side listeners on 127.0.0.1 (the frontend's and the UI's ports)
   and keeps a handle on the host's TCP table, then leaves the host's network: a network
   namespace of its own (as root; otherwise inside a user namespace owned by the same uid).
   Every port the dev server opens afterwards (frontend, HTTP API, metrics, UI, internal
   services, membership) exists only in that namespace, where nothing else lives.
2. For each connection to a host-side listener, the gate asks the kernel's TCP table which
   uid owns the connecting socket (loopback: both ends are on this machine) and forwards to
   the same port inside the namespace only when it is the owner's uid (or root's: root reads
   the data directory anyway, and `sudo drlm` must not find the server "down" and replace
   it); any other uid's connection is reset before a byte is read or written.

3. On the Web UI's port (`--forward-http`), the first request of a connection must name
   the host as an IP address or `localhost`: a web page that rebinds its own domain name to
   127.0.0.1 (DNS rebinding) would otherwise read the UI's API, histories included, from the
   owner's browser. (A browser keeps connections per host name, so the first request's
   Host speaks for the connection.)

Clients change nothing: the Python SDK, the `temporal` CLI and a browser of the owner
connect to 127.0.0.1:<port> as before. What stays open: root (who can read the data
directory anyway), and any program running as the owner, such as a web page in the
owner's browser sending requests it cannot read the answers of (cross-site requests), as
with any local UI without a login.

If no namespace can be made (unprivileged user namespaces disabled), the gate exits with
`NO_NAMESPACE` before starting anything and the caller starts the server in the open.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import fcntl
import functools
import ipaddress
import os
import signal
import socket
import struct
import subprocess
import sys
from typing import cast

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
NO_NAMESPACE = 75  # the gate's exit code: no private network here (EX_TEMPFAIL)
NO_PORT = 76  # a host-side port is taken
HEAD_TIMEOUT_S = 30.0  # for a request head on the UI's port
HEAD_LIMIT = 64 * 1024  # bytes of a request head, or held before the inner side is up
_WHY = b"open the Web UI at 127.0.0.1 or localhost, not a host name"
MISDIRECTED = (
    b"HTTP/1.1 421 Misdirected Request\r\nContent-Type: text/plain\r\n"
    b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_WHY), _WHY)
)
_STUBS = frozenset({"03", "06"})  # SYN_RECV, TIME_WAIT in /proc/net/tcp


class TcpTable:
    """The uid owning a TCP socket, from /proc/net/tcp of the network this was opened in (a
    handle opened before leaving the host's network keeps reading the host's table)."""

    def __init__(self) -> None:
        self._fd = os.open("/proc/self/net/tcp", os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        os.close(self._fd)

    def _text(self) -> str:
        os.lseek(self._fd, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(self._fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks).decode("ascii", errors="replace")

    def owner(self, local: tuple[str, int], remote: tuple[str, int]) -> int | None:
        """The uid of the socket whose local end is `local` and remote end `remote` (None:
        no such socket, or more than one answer)."""
        want_local, want_remote = _hex(local), _hex(remote)
        uids = set()
        for line in self._text().splitlines()[1:]:
            fields = line.split()
            # TIME_WAIT and SYN_RECV entries are kernel stubs printed with uid 0 (a stale
            # one may share the 4-tuple): only a full socket names its owner.
            if len(fields) > 7 and fields[1] == want_local and fields[2] == want_remote:
                if fields[3] not in _STUBS:
                    uids.add(int(fields[7]))
        return uids.pop() if len(uids) == 1 else None


def _hex(address: tuple[str, int]) -> str:
    # The kernel prints the network-order address as a native integer, then the port.
    (packed,) = struct.unpack("=I", socket.inet_aton(address[0]))
    return f"{packed:08X}:{address[1]:04X}"


def peer_uid(connection: socket.socket, table: TcpTable | None = None) -> int | None:
    """The uid that owns the other end of an accepted loopback TCP connection (None: not a
    local peer, or gone already)."""
    if connection.family != socket.AF_INET:
        return None
    own = table or TcpTable()
    try:
        return own.owner(connection.getpeername(), connection.getsockname())
    except OSError:
        return None
    finally:
        if table is None:
            own.close()


# --- leaving the host's network -----------------------------------------------------------


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL("libc.so.6", use_errno=True)


def enter_private_network() -> None:
    """Leave the host's network for a new one holding only loopback (raises OSError)."""
    libc = _libc()
    uid, gid = os.getuid(), os.getgid()
    if os.geteuid() == 0:
        flags = CLONE_NEWNET
    else:
        flags = CLONE_NEWNET | CLONE_NEWUSER  # an unprivileged user owns the new network
    if libc.unshare(flags) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"unshare: {os.strerror(errno)}")
    if flags & CLONE_NEWUSER:
        # The same ids inside, so files the server writes are the owner's as before.
        with open("/proc/self/setgroups", "w") as out:
            out.write("deny")
        with open("/proc/self/uid_map", "w") as out:
            out.write(f"{uid} {uid} 1")
        with open("/proc/self/gid_map", "w") as out:
            out.write(f"{gid} {gid} 1")
    _loopback_up()


def _loopback_up() -> None:
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, siocgifflags, request))[1]
        fcntl.ioctl(sock, siocsifflags, struct.pack("16sH14x", b"lo", flags | iff_up))


def _tied_to_parent() -> None:
    os.umask(0o077)
    with contextlib.suppress(Exception):
        _libc().prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


# --- the gate -----------------------------------------------------------------------------


class Gate:
    """Host-side listeners that forward the owner's connections into the namespace."""

    def __init__(self, ports: list[int], owner: int, http_ports: list[int] | None = None) -> None:
        self.admitted = frozenset({owner, 0})
        self.http_ports = frozenset(http_ports or ())
        ports = [*ports, *self.http_ports]
        self.table = TcpTable()
        self.listeners: list[socket.socket] = []
        for port in ports:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", port))
            listener.listen(128)
            self.listeners.append(listener)
        self.refused = 0

    async def serve(self) -> list[asyncio.Server]:
        loop = asyncio.get_running_loop()
        servers = []
        for listener in self.listeners:
            port = listener.getsockname()[1]
            check_host = port in self.http_ports
            servers.append(
                await loop.create_server(functools.partial(_Outer, self, port, check_host), sock=listener)
            )
        return servers


class _Half(asyncio.Protocol):
    """One side of a forwarded connection: what it receives is written to the other side,
    and it stops reading while the other side's buffer is full (protocol callbacks, not a
    coroutine per chunk: the gate sits on every round trip of every client)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.other: _Half | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A TCP connection's transport is a whole Transport; asyncio types the callback for any.
        self.transport = cast(asyncio.Transport, transport)
        with contextlib.suppress(OSError, AttributeError):
            transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    @property
    def live(self) -> asyncio.Transport:
        """The transport, where asyncio calls back only after connection_made."""
        if self.transport is None:
            raise RuntimeError("the connection is not made yet")
        return self.transport

    def data_received(self, data: bytes) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.write(data)

    def eof_received(self) -> bool:
        other = self.other.transport if self.other is not None else None
        if other is not None and other.can_write_eof():
            with contextlib.suppress(OSError, RuntimeError):
                other.write_eof()
            return True  # half-closed: the answer may still come back
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.close()

    def pause_writing(self) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.resume_reading()


class _Outer(_Half):
    """The client's side: the uid (and, on the UI's port, the Host) decide; until the inner
    connection is up, what the client sends is held (reading paused past the head)."""

    def __init__(self, gate: Gate, port: int, check_host: bool) -> None:
        super().__init__()
        self.gate, self.port, self.check_host = gate, port, check_host
        self.held = bytearray()
        self.open = False  # forwarding: the checks passed and the inner side is connected
        self.head_timer: asyncio.TimerHandle | None = None
        self.opening: asyncio.Task | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if peer_uid(sock, self.gate.table) not in self.gate.admitted:
            self.gate.refused += 1
            # RST, not FIN: nothing is said, not even an orderly goodbye.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.live.abort()
            return
        if self.check_host:
            self.head_timer = asyncio.get_running_loop().call_later(HEAD_TIMEOUT_S, self.live.abort)
        else:
            self._connect()

    def data_received(self, data: bytes) -> None:
        if self.open:
            super().data_received(data)
            return
        self.held += data
        if self.check_host and self.head_timer is not None:
            if b"\r\n\r\n" not in self.held:
                if len(self.held) > HEAD_LIMIT:
                    self.live.abort()
                return
            self.head_timer.cancel()
            self.head_timer = None
            if not loopback_host(bytes(self.held)):
                self.gate.refused += 1
                self.live.write(MISDIRECTED)
                self.live.close()
                return
            self._connect()
        elif len(self.held) > HEAD_LIMIT:
            self.live.pause_reading()

    def _connect(self) -> None:
        self.opening = asyncio.get_running_loop().create_task(self._open_inner())  # held: not collected

    async def _open_inner(self) -> None:
        inner = _Half()
        try:
            await asyncio.get_running_loop().create_connection(lambda: inner, "127.0.0.1", self.port)
        except OSError:
            self.live.close()
            return
        if self.transport is None or self.transport.is_closing():
            inner.live.close()
            return
        self.other, inner.other = inner, self
        self.open = True
        if self.held:
            inner.live.write(bytes(self.held))
            self.held.clear()
        self.transport.resume_reading()

    def eof_received(self) -> bool:
        if not self.open:
            self.live.close()
            return False
        return super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
        super().connection_lost(exc)


def loopback_host(head: bytes) -> bool:
    """Whether a request head's Host is an IP address or `localhost` (or absent: not a
    browser), never a name a web page controls."""
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() != b"host":
            continue
        host = value.strip().decode("latin-1")
        if host.startswith("["):  # [::1]:8233
            host = host[1 : host.find("]")] if "]" in host else host
        elif host.count(":") == 1:
            host = host.split(":", 1)[0]
        if host.lower().rstrip(".") == "localhost":
            return True
        try:
            ipaddress.ip_address(host)
            return True
        except ValueError:
            return False
    return True


async def _run(gate: Gate, command: list[str]) -> int:
    server = subprocess.Popen(command, stdin=subprocess.DEVNULL, preexec_fn=_tied_to_parent)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    servers = await gate.serve()
    try:
        while server.poll() is None and not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
    finally:
        for listening in servers:
            listening.close()
        if server.poll() is None:
            server.terminate()
            try:
                await asyncio.to_thread(server.wait, 10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    return server.returncode if not stop.is_set() else 0


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m durable_rlm.server.private_net", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--forward", type=int, action="append", default=[], help="a port to forward (repeatable)"
    )
    parser.add_argument(
        "--forward-http", type=int, action="append", default=[], help="a Web UI port: its Host is checked"
    )
    parser.add_argument("--probe", action="store_true", help="only say whether a private network can be made")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the server's command line")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    owner = os.getuid()
    if args.probe:
        try:
            enter_private_network()
        except OSError as exc:
            print(f"no private network: {exc}", file=sys.stderr)
            sys.exit(NO_NAMESPACE)
        sys.exit(0)
    try:
        gate = Gate(args.forward, owner, args.forward_http)  # bound in the host's network, before leaving it
    except OSError as exc:
        print(f"cannot listen on 127.0.0.1 for the server: {exc}", file=sys.stderr)
        sys.exit(NO_PORT)
    try:
        enter_private_network()
    except OSError as exc:
        print(f"no private network for the server: {exc}", file=sys.stderr)
        sys.exit(NO_NAMESPACE)
    sys.exit(asyncio.run(_run(gate, command)))


if __name__ == "__main__":
    main()
