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
import hmac
import http.cookies
import logging
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any

from temporalio.api.common.v1 import Payload

from durable_rlm.errors import ConfigurationError
from durable_rlm.ports import SERVE_POLL_S
from durable_rlm.store.blobs import BlobStore
from durable_rlm.store.codec import (
    DEFAULT_THRESHOLD,
    ClaimCheckCodec,
)
from durable_rlm.store.display import DISPLAY_LIMIT, as_lines, decode_payloads
from durable_rlm.viewer.codec_requests import LOOPBACK_HOSTS, CodecHttpServer

log = logging.getLogger(__name__)

UI_PORT = 8233  # the embedded server's default Web UI port (settings.ui_port)


LOGIN_TOKEN_S = 60.0  # a one-shot login link works this long, once
MAX_LOGINS = 1_000  # tokens and sessions kept; the oldest go first


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
            self._server = CodecHttpServer((host, port), self)
        except OSError as exc:
            raise ConfigurationError(
                f"the codec server cannot listen on {host}:{port}: {exc.strerror or exc}"
            ) from None
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
