"""A codec server for the Temporal Web UI and CLI: claim-check references shown as content.

The claim-check codec (durable_rlm/store/codec.py) leaves a digest in history for every payload
over 4 KB, so without help the Web UI shows `sha256:…` where prompts, code and outputs
should be. Temporal's remote codec protocol lets the UI ask us instead: it POSTs
`{"payloads": [{"metadata": {k: base64}, "data": base64}, ...]}` (proto3 JSON, with an
`X-Namespace` header) to `<endpoint>/decode` and displays the payloads we send back.

Decoding is for reading, so it never fails a whole request for one payload: a blob too large
to display is shortened (and says so, with its size and digest), and a blob that cannot be
read becomes a readable placeholder. Payloads encrypted with DRLM_ENCRYPTION_KEYS are
opened with the server's keys (a placeholder says which key is missing).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import http.cookies
import json
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs

from temporalio.api.common.v1 import Payload

from durable_rlm.errors import ConfigurationError
from durable_rlm.ports import SERVE_POLL_S
from durable_rlm.server.private_net import peer_uid
from durable_rlm.store.blobs import BlobStore
from durable_rlm.store.codec import (
    DEFAULT_THRESHOLD,
    ClaimCheckCodec,
)
from durable_rlm.store.display import DISPLAY_LIMIT, as_lines, decode_payloads

log = logging.getLogger(__name__)

MAX_BODY = 32 * 1024 * 1024  # a request body over this is refused (413), not read
UI_PORT = 8233  # the embedded server's default Web UI port (settings.ui_port)
ALLOWED_HEADERS = "Content-Type, X-Namespace, Authorization"  # what the Web UI sends


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
LOGIN_TOKEN_S = 60.0  # a one-shot login link works this long, once
MAX_LOGINS = 1_000  # tokens and sessions kept; the oldest go first


def host_of(header: str | None) -> str | None:
    """The host a Host header names, without its port (`[::1]:8234` -> `::1`)."""
    if not header:
        return None
    value = header.strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    return value.rpartition(":")[0] if value.count(":") == 1 else value


class Logins:
    """One-shot login tokens (a command mints one; a browser redeems it once, within
    LOGIN_TOKEN_S) and the sessions they open (a random cookie, HttpOnly, SameSite=Strict:
    sent by no other site's page). In memory: they end with the server."""

    def __init__(self) -> None:
        self._tokens: dict[str, tuple[float, str]] = {}
        self._sessions: dict[str, float] = {}
        self._lock = threading.Lock()

    def mint(self, wanted: str) -> str:
        """A token for a page below the server's own paths (never another site)."""
        target = wanted if wanted.startswith("/episodes") and "//" not in wanted else "/episodes"
        token = secrets.token_urlsafe(32)
        with self._lock:
            self._tokens[token] = (time.monotonic() + LOGIN_TOKEN_S, target)
            _bounded(self._tokens)
        return token

    def redeem(self, token: str) -> tuple[str, str] | None:
        """(the page the token opens, a new session), once; None when the token was used,
        expired or never minted."""
        with self._lock:
            found = self._tokens.pop(token, None) if token else None
            if found is None or found[0] < time.monotonic():
                return None
            session = secrets.token_urlsafe(32)
            self._sessions[session] = time.monotonic()
            _bounded(self._sessions)
            return found[1], session

    @staticmethod
    def cookie(port: int, session: str) -> str:
        """The session's cookie: per port (127.0.0.1's cookies are shared by its ports)."""
        return f"drlm_{port}={session}; Path=/; HttpOnly; SameSite=Strict"

    def has_session(self, header: str | None, port: int) -> bool:
        if not header:
            return False
        jar = http.cookies.SimpleCookie()
        try:
            jar.load(header)
        except http.cookies.CookieError:
            return False
        morsel = jar.get(f"drlm_{port}")
        with self._lock:
            return morsel is not None and any(
                hmac.compare_digest(morsel.value.encode(), known.encode()) for known in self._sessions
            )


def _bounded(table: dict[str, Any]) -> None:
    while len(table) > MAX_LOGINS:
        table.pop(next(iter(table)))


def ui_origins(port: int = UI_PORT) -> tuple[str, ...]:
    """The origins a browser gives the embedded server's Web UI (both names of loopback)."""
    return (f"http://127.0.0.1:{port}", f"http://localhost:{port}")


# --- decoding -----------------------------------------------------------------------------


# --- the JSON form of payloads ------------------------------------------------------------


class BadRequest(ValueError):
    """A request body we cannot read; its message goes back to the caller as a 400."""


def payloads_from_json(body: bytes) -> list[Payload]:
    """The `{"payloads": [...]}` body the Web UI and CLI send, as Payloads (proto3 JSON)."""
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the body is not JSON: {exc}") from None
    if not isinstance(document, dict) or not isinstance(document.get("payloads"), list):
        raise BadRequest('the body must be a JSON object {"payloads": [{"metadata": {...}, "data": "..."}]}')
    return [_payload_from_json(index, item) for index, item in enumerate(document["payloads"])]


def _payload_from_json(index: int, item: Any) -> Payload:
    if not isinstance(item, dict):
        raise BadRequest(f"payload {index} is not a JSON object")
    metadata = item.get("metadata")
    metadata = {} if metadata is None else metadata  # proto3 JSON: null is the default
    if not isinstance(metadata, dict):
        raise BadRequest(f"payload {index}: metadata must be an object of base64 strings")
    data = item.get("data")
    payload = Payload(data=b"" if data is None else _base64(data, f"payload {index}: data"))
    for key, value in metadata.items():
        payload.metadata[key] = _base64(value, f"payload {index}: metadata {key!r}")
    encoding = payload.metadata.get("encoding")
    if encoding is not None and not (encoding.isascii() and encoding.decode("ascii").isprintable()):
        # The usual mistake: `"encoding": "json/plain"` instead of its base64, which decodes
        # (base64 is lax) to bytes that match no codec, and the payload passes undecoded.
        raise BadRequest(
            f"payload {index}: metadata 'encoding' is not base64 of a name: metadata values are "
            "base64 in proto3 JSON (json/plain is anNvbi9wbGFpbg==)"
        )
    return payload


def _base64(value: Any, what: str) -> bytes:
    """Proto3 JSON bytes: standard or URL-safe base64, padded or not."""
    if not isinstance(value, str):
        raise BadRequest(f"{what} must be a base64 string, not {type(value).__name__}")
    text = value.strip().replace("-", "+").replace("_", "/")
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except binascii.Error:
        raise BadRequest(f"{what} is not base64") from None


def payloads_to_json(payloads: Iterable[Payload]) -> dict[str, list[dict[str, Any]]]:
    """Payloads in proto3 JSON, always with `metadata` and `data` (the UI looks for both)."""

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode("ascii")

    return {
        "payloads": [
            {"metadata": {k: b64(v) for k, v in p.metadata.items()}, "data": b64(p.data)} for p in payloads
        ]
    }


# --- the server ---------------------------------------------------------------------------


class CodecServer:
    """Temporal's remote codec protocol over the blob store: POST /decode and /encode (also
    under a namespace prefix, `/<namespace>/decode`, the CLI's `{namespace}` template).

    Listens on loopback by default. `origins` are the Web UI origins a browser may call from
    (CORS; "*" for any); a request from any other origin is refused, one without an Origin
    header (the CLI, curl) is not. With `token`, every POST needs `Authorization: Bearer
    <token>` (for a server others can reach). Runs in a thread (`start`/`stop`) or blocking
    (`serve_forever`).

    Loopback is no boundary between the users of one machine, so the supervisor's server
    (durable_rlm/server/embedded.py) also takes a capability and an owner: with `path_secret`, every
    request's path starts with `/<secret>` (the endpoint `url` carries it; the UI has no way
    to send a header of ours) and any other path is 404; with `owner_uid`, a connection
    from a socket of another uid (the kernel's TCP table says whose) is reset before a byte
    is read."""

    def __init__(
        self,
        blobs: BlobStore,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        origins: Sequence[str] | None = None,
        token: str | None = None,
        limit: int | None = DISPLAY_LIMIT,
        threshold: int = DEFAULT_THRESHOLD,
        path_secret: str | None = None,
        owner_uid: int | None = None,
        pages: Any | None = None,
        allowed_hosts: Sequence[str] = (),
    ) -> None:
        self.blobs = blobs
        # The episode pages (durable_rlm/viewer/episode_page.py): served under the same capability.
        self.pages = pages
        if path_secret is not None and (not path_secret or "/" in path_secret):
            raise ConfigurationError("a codec server's path secret is one non-empty path segment")
        self.path_secret = path_secret
        self.owner_uid = owner_uid
        self.origins = frozenset(ui_origins() if origins is None else (o.rstrip("/") for o in origins))
        self.token = token or None
        self.limit = limit
        self.threshold = threshold
        # The blob store's read cache is not thread-safe and request threads share it.
        self._lock = threading.Lock()
        # Host names a request may use: loopback's, the bound address, and those given (a
        # server others reach by a name). Any other is a DNS-rebinding page's: 421.
        self.hosts = frozenset(h.lower() for h in (*LOOPBACK_HOSTS, host, *allowed_hosts))
        self.logins = Logins()
        try:
            self._server = ThreadingHTTPServer((host, port), self._handler())
        except OSError as exc:
            raise ConfigurationError(
                f"the codec server cannot listen on {host}:{port}: {exc.strerror or exc}"
            ) from None
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None
        self._serving = False

    @property
    def url(self) -> str:
        """The endpoint to give the UI (`--ui-codec-endpoint`) or the CLI (`--codec-endpoint`)."""
        host, port = self._server.socket.getsockname()[:2]  # as bound: a str host
        secret = f"/{self.path_secret}" if self.path_secret else ""
        return f"http://{host}:{port}{secret}"

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> CodecServer:
        self._serving = True  # before the thread runs: a quick stop() must still shut it down
        self._thread = threading.Thread(target=self.serve_forever, name="codec-server", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve until `stop` from another thread (or KeyboardInterrupt, for the caller)."""
        self._serving = True
        try:
            self._server.serve_forever(poll_interval=SERVE_POLL_S)
        finally:
            self._server.server_close()

    def stop(self) -> None:
        if self._serving:  # shutdown() waits forever for a loop that never ran
            self._server.shutdown()
            self._serving = False
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        self._server.server_close()
        if self.pages is not None:
            self.pages.close()

    def __enter__(self) -> CodecServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def allows(self, origin: str) -> bool:
        return "*" in self.origins or origin.rstrip("/") in self.origins

    def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        """For display: claim checks resolved, long content shortened, text as lines."""
        with self._lock:
            return [as_lines(p) for p in decode_payloads(payloads, self.blobs, self.limit)]

    def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        """What a worker's codec would write (the UI encodes signal and start inputs)."""
        with self._lock:
            return asyncio.run(ClaimCheckCodec(self.blobs, self.threshold).encode(payloads))

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            server_version = "drlm-codec-server"

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("codec server: " + format, *args)

            def setup(self) -> None:
                super().setup()
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def handle(self) -> None:
                if server.owner_uid is not None and peer_uid(self.connection) != server.owner_uid:
                    # Another user's socket: reset, nothing read, nothing said.
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                    return
                super().handle()

            def parse_request(self) -> bool:
                """Every request names a host of ours, before anything else is looked at."""
                if not super().parse_request():
                    return False
                if host_of(self.headers.get("Host")) not in server.hosts:
                    self._error(421, "this server answers only to 127.0.0.1, localhost or its own address")
                    return False
                return True

            def _capable(self) -> bool:
                """The path starts with the capability, or the browser holds a session the
                one-shot login gave it (always, without a capability); else 404."""
                if server.path_secret is None or self._by_path() or self._by_cookie():
                    return True
                self._error(404, "not found")
                return False

            def _by_path(self) -> bool:
                if server.path_secret is None:
                    return False
                first = self.path.split("?", 1)[0].lstrip("/").split("/", 1)[0]
                return hmac.compare_digest(first.encode(), server.path_secret.encode())

            def _by_cookie(self) -> bool:
                return server.logins.has_session(self.headers.get("Cookie"), server.port)

            def _login(self) -> bool:
                """GET /open?token=T (no capability in the URL): a one-shot token that a
                command minted is exchanged for a session cookie, then the page."""
                if self.path.split("?", 1)[0].rstrip("/") != "/open":
                    return False
                token = (self._query().get("token") or [""])[0]
                redeemed = server.logins.redeem(token)
                if redeemed is None:
                    self._error(403, "this link was used or has expired: run `drlm ui --open` again")
                    return True
                target, session = redeemed
                self.send_response(303)
                self.send_header("Location", target)
                self.send_header("Set-Cookie", server.logins.cookie(server.port, session))
                self.send_header("Content-Length", "0")
                self.send_header("Cache-Control", "no-store")
                self.send_header("Referrer-Policy", "no-referrer")
                self.end_headers()
                return True

            def _cors(self) -> dict[str, str]:
                origin = self.headers.get("Origin")
                if origin is None or not server.allows(origin):
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
                if origin is not None and not server.allows(origin):
                    self._error(
                        403, f"origin {origin} is not allowed; allowed: {', '.join(sorted(server.origins))}"
                    )
                    return True
                return False

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
                if server.pages is not None and server.pages.owns(self._path()):
                    self._page(lambda: server.pages.get(self._path(), self._query(), self._base()))
                    return
                if self._path() == "/":
                    self._send(
                        200, {"service": "drlm codec server", "endpoints": ["POST /decode", "POST /encode"]}
                    )
                elif self._action():
                    self._error(405, "use POST", {"Allow": "POST, OPTIONS"})
                else:
                    self._error(404, f"no endpoint {self._path()}: use POST /decode or POST /encode")

            def do_POST(self) -> None:  # noqa: N802
                try:
                    self._post()
                except Exception as exc:  # answered in one line: never a traceback to the UI
                    log.exception("codec server: %s failed", self._path())
                    self._error(
                        500, f"internal error: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                    )

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

            def _query(self) -> dict[str, list[str]]:
                return parse_qs(self.path.partition("?")[2])

            def _base(self) -> str:
                return f"/{server.path_secret}" if self._by_path() else ""

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
                if server.pages is not None and server.pages.owns(self._path()):
                    body = self._body()
                    if body is not None:
                        self._page(lambda: server.pages.post(self._path(), body, self.headers, server.port))
                    return
                if self._origin_refused():
                    return
                action = self._action()
                if action is None:
                    self._error(404, f"no endpoint {self._path()}: use POST /decode or POST /encode")
                    return
                if server.token is not None:
                    given = self.headers.get("Authorization", "")
                    if not hmac.compare_digest(given.encode(), f"Bearer {server.token}".encode()):
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
                convert = server.decode if action == "decode" else server.encode
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
                token = server.logins.mint(str(wanted))
                host, port = server._server.server_address[:2]
                self._send(200, {"url": f"http://{host!s}:{port}/open?token={token}"})

        return Handler
