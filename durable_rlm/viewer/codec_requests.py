"""The codec server's requests: who may ask (`Guarded`), and what each path answers
(`CodecRequests`). Module-level classes that the server's HTTP server instantiates per
request; they reach the `CodecServer` (its blobs, capability, logins, pages) as `self.codec`.

Every request is checked in this order before anything of it is read or answered: the
socket's uid (another user's connection is reset), the Host header (a DNS-rebinding page's
gets 421), then the capability in the path or a session the one-shot login gave the browser
(404 without either), the Origin for the UI's cross-origin calls (CORS), and a bearer token
where one is set.
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import struct
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from durable_rlm.server.private_net import peer_uid
from durable_rlm.viewer.codec_wire import (
    ALLOWED_HEADERS,
    MAX_BODY,
    BadRequest,
    payloads_from_json,
    payloads_to_json,
)

if TYPE_CHECKING:
    from durable_rlm.viewer.codec_server import CodecServer

log = logging.getLogger(__name__)

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def host_of(header: str | None) -> str | None:
    """The host a Host header names, without its port (`[::1]:8234` -> `::1`)."""
    if not header:
        return None
    value = header.strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    return value.rpartition(":")[0] if value.count(":") == 1 else value


class CodecHttpServer(ThreadingHTTPServer):
    """The listening socket of one `CodecServer`, which its requests reach as `self.codec`."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], codec: CodecServer) -> None:
        self.codec = codec
        super().__init__(address, CodecRequests)


class Guarded(BaseHTTPRequestHandler):
    """Who may ask: the owner's sockets, our Host names, the capability or a session."""

    protocol_version = "HTTP/1.1"
    server_version = "drlm-codec-server"
    server: CodecHttpServer

    @property
    def codec(self) -> CodecServer:
        return self.server.codec

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("codec server: " + format, *args)

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def handle(self) -> None:
        if self.codec.owner_uid is not None and peer_uid(self.connection) != self.codec.owner_uid:
            # Another user's socket: reset, nothing read, nothing said.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            return
        super().handle()

    def parse_request(self) -> bool:
        """Every request names a host of ours, before anything else is looked at."""
        if not super().parse_request():
            return False
        if host_of(self.headers.get("Host")) not in self.codec.hosts:
            self._error(421, "this server answers only to 127.0.0.1, localhost or its own address")
            return False
        return True

    def _capable(self) -> bool:
        """The path starts with the capability, or the browser holds a session the
        one-shot login gave it (always, without a capability); else 404."""
        if self.codec.path_secret is None or self._by_path() or self._by_cookie():
            return True
        self._error(404, "not found")
        return False

    def _by_path(self) -> bool:
        if self.codec.path_secret is None:
            return False
        first = self.path.split("?", 1)[0].lstrip("/").split("/", 1)[0]
        return hmac.compare_digest(first.encode(), self.codec.path_secret.encode())

    def _by_cookie(self) -> bool:
        return self.codec.logins.has_session(self.headers.get("Cookie"), self.codec.port)

    def _login(self) -> bool:
        """GET /open?token=T (no capability in the URL): a one-shot token that a
        command minted is exchanged for a session cookie, then the page."""
        if self.path.split("?", 1)[0].rstrip("/") != "/open":
            return False
        token = (self._query().get("token") or [""])[0]
        redeemed = self.codec.logins.redeem(token)
        if redeemed is None:
            self._error(403, "this link was used or has expired: run `drlm ui --open` again")
            return True
        target, session = redeemed
        self.send_response(303)
        self.send_header("Location", target)
        self.send_header("Set-Cookie", self.codec.logins.cookie(self.codec.port, session))
        self.send_header("Content-Length", "0")
        self.send_header("Cache-Control", "no-store")
        self.send_header("Referrer-Policy", "no-referrer")
        self.end_headers()
        return True

    def _cors(self) -> dict[str, str]:
        origin = self.headers.get("Origin")
        if origin is None or not self.codec.allows(origin):
            return {}
        return {
            "Access-Control-Allow-Origin": origin,
            "Access-Control-Allow-Credentials": "true",  # the UI's "include credentials"
            "Vary": "Origin",
        }

    def _send(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in {**self._cors(), **(headers or {})}.items():
            self.send_header(key, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        self.close_connection = True  # the body may be unread: start afresh
        self._send(status, {"error": message}, headers)

    def _origin_refused(self) -> bool:
        origin = self.headers.get("Origin")
        if origin is not None and not self.codec.allows(origin):
            self._error(
                403, f"origin {origin} is not allowed; allowed: {', '.join(sorted(self.codec.origins))}"
            )
            return True
        return False

    def _query(self) -> dict[str, list[str]]:
        return parse_qs(self.path.partition("?")[2])


class CodecRequests(Guarded):
    """What each path answers: the remote codec protocol, the episode pages, the login link."""

    def do_OPTIONS(self) -> None:  # noqa: N802 (the http.server naming)
        """A browser's preflight: it carries no credentials, so no token check."""
        if not self._capable() or self._origin_refused():
            return
        headers = {
            "Access-Control-Allow-Methods": "POST, OPTIONS",
            "Access-Control-Allow-Headers": ALLOWED_HEADERS,
            "Access-Control-Max-Age": "600",
        }
        if self.headers.get("Access-Control-Request-Private-Network") == "true":
            headers["Access-Control-Allow-Private-Network"] = "true"
        self.send_response(204)
        self.send_header("Content-Length", "0")
        for key, value in {**self._cors(), **headers}.items():
            self.send_header(key, value)
        self.end_headers()

    def do_GET(self) -> None:  # noqa: N802
        if self._login() or not self._capable():
            return
        if self.codec.pages is not None and self.codec.pages.owns(self._path()):
            self._page(lambda: self.codec.pages.get(self._path(), self._query(), self._base()))
            return
        if self._path() == "/":
            self._send(200, {"service": "drlm codec server", "endpoints": ["POST /decode", "POST /encode"]})
        elif self._action():
            self._error(405, "use POST", {"Allow": "POST, OPTIONS"})
        else:
            self._error(404, f"no endpoint {self._path()}: use POST /decode or POST /encode")

    def do_POST(self) -> None:  # noqa: N802
        try:
            self._post()
        except Exception as exc:  # answered in one line: never a traceback to the UI
            log.exception("codec server: %s failed", self._path())
            self._error(500, f"internal error: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")

    def _path(self) -> str:
        """The path below the capability (a session's paths have none)."""
        path = self.path.split("?", 1)[0]
        if self._by_path():
            path = "/" + path.lstrip("/").partition("/")[2]
        return path.rstrip("/") or "/"

    def _action(self) -> str | None:
        last = self._path().rsplit("/", 1)[-1]
        return last if last in ("decode", "encode") else None

    def _body(self) -> bytes | None:
        """A page action's body (small: 64 KB at most), or None after an error."""
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit() or int(length) > 64 * 1024:
            self._error(411 if length is None else 413, "a JSON body of at most 64 KB")
            return None
        return self.rfile.read(int(length))

    def _base(self) -> str:
        return f"/{self.codec.path_secret}" if self._by_path() else ""

    def _page(self, answer: Any) -> None:
        """An episode page's answer, with the page's security headers."""
        from durable_rlm.viewer.episode_page import (  # start-up: 0.17 s; drlm codec-server skips it
            SECURITY_HEADERS,
        )

        try:
            response = answer()
        except Exception as exc:  # one line to the browser, the traceback to the log
            log.exception("episode page: %s failed", self._path())
            first = (str(exc).splitlines() or [""])[0][:300]
            self._error(500, f"internal error: {type(exc).__name__}: {first}")
            return
        self.send_response(response.status)
        self.send_header("Content-Type", response.content_type)
        self.send_header("Content-Length", str(len(response.body)))
        for key, value in {**SECURITY_HEADERS, **response.headers}.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(response.body)

    def _post(self) -> None:
        if not self._capable():
            return
        if self._path() == "/login-token" and self._by_path():
            self._mint()
            return
        if self.codec.pages is not None and self.codec.pages.owns(self._path()):
            body = self._body()
            if body is not None:
                self._page(lambda: self.codec.pages.post(self._path(), body, self.headers, self.codec.port))
            return
        if self._origin_refused():
            return
        action = self._action()
        if action is None:
            self._error(404, f"no endpoint {self._path()}: use POST /decode or POST /encode")
            return
        if self.codec.token is not None:
            given = self.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.codec.token}".encode()):
                self._error(
                    401,
                    "this codec server needs Authorization: Bearer <token>",
                    {"WWW-Authenticate": 'Bearer realm="drlm codec server"'},
                )
                return
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self._error(411, "a request body with Content-Length is required")
            return
        if int(length) > MAX_BODY:
            self._error(413, f"the body is {int(length):,} bytes; at most {MAX_BODY:,} are read")
            return
        try:
            payloads = payloads_from_json(self.rfile.read(int(length)))
        except BadRequest as exc:
            self._send(400, {"error": str(exc)})
            return
        convert = self.codec.decode if action == "decode" else self.codec.encode
        self._send(200, payloads_to_json(convert(payloads)))

    def _mint(self) -> None:
        """A command holding the capability asks for a one-shot login link (`drlm ui
        --open`): a browser's command line then carries a token that works once, within
        seconds, instead of the capability."""
        body = self._body()
        if body is None:
            return
        try:
            wanted = json.loads(body or b"{}").get("next") or "/episodes"
        except (ValueError, AttributeError):
            wanted = "/episodes"
        token = self.codec.logins.mint(str(wanted))
        host, port = self.server.server_address[:2]
        self._send(200, {"url": f"http://{host!s}:{port}/open?token={token}"})
