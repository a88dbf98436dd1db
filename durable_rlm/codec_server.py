"""A codec server for the Temporal Web UI and CLI: claim-check references shown as content.

The claim-check codec (durable_rlm/codec.py) leaves a digest in history for every payload
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
import json
import logging
import socket
import struct
import threading
from collections.abc import Iterable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs

from google.protobuf.message import DecodeError
from temporalio.api.common.v1 import Payload

from durable_rlm.blobs import BlobNotFound, BlobStore, DirectoryBackend, SqlBackend
from durable_rlm.codec import DEFAULT_THRESHOLD, ENCODING, ENCRYPTED, KEY_ID, ClaimCheckCodec, EncryptionCodec
from durable_rlm.encryption import MissingKey
from durable_rlm.errors import ConfigurationError
from durable_rlm.private_net import peer_uid

log = logging.getLogger(__name__)

DISPLAY_LIMIT = 64 * 1024  # bytes of one decoded payload's data the UI is given, at most
MAX_BODY = 32 * 1024 * 1024  # a request body over this is refused (413), not read
UI_PORT = 8233  # the embedded server's default Web UI port (settings.ui_port)
ALLOWED_HEADERS = "Content-Type, X-Namespace, Authorization"  # what the Web UI sends
JSON_PLAIN = b"json/plain"


def ui_origins(port: int = UI_PORT) -> tuple[str, ...]:
    """The origins a browser gives the embedded server's Web UI (both names of loopback)."""
    return (f"http://127.0.0.1:{port}", f"http://localhost:{port}")


# --- decoding -----------------------------------------------------------------------------


def decode_payloads(
    payloads: Sequence[Payload], blobs: BlobStore, limit: int | None = DISPLAY_LIMIT, previews: bool = True
) -> list[Payload]:
    """Payloads as a reader should see them: claim-check references replaced by their
    content, content over `limit` bytes shortened (None: whole), unreadable blobs replaced by
    a JSON placeholder naming the digest and the store. Other payloads pass unchanged.

    Never raises for a payload's content: one bad reference must not hide a whole event."""
    decoded = [_decode_guarded(payload, blobs, limit) for payload in payloads]
    return [_with_contexts(payload, blobs) for payload in decoded] if previews else decoded


def as_lines(payload: Payload) -> Payload:
    """For a person's eyes only (the Web UI, `temporal ... --codec-endpoint`): every string
    with a line break becomes the list of its lines. The UI shows a payload as JSON, where a
    model's reply or a cell's code is one string full of `\\n`; a list of lines reads as
    the text. Marked `drlm-display: lines`; never what a worker reads (workers decode with
    their own codec, not this server)."""
    if payload.metadata.get("encoding") != JSON_PLAIN or b"\\n" not in payload.data:
        return payload
    if len(payload.data) > DISPLAY_LIMIT:
        return payload
    try:
        value = json.loads(payload.data)
    except ValueError:
        return payload
    out = Payload()
    out.CopyFrom(payload)
    out.data = json.dumps(_split_lines(value), ensure_ascii=False).encode("utf-8")
    out.metadata["drlm-display"] = b"lines"
    return out


def _split_lines(value: Any, depth: int = 0) -> Any:
    if isinstance(value, str):
        return value.split("\n") if "\n" in value else value
    if depth > 16:
        return value
    if isinstance(value, dict):
        return {key: _split_lines(item, depth + 1) for key, item in value.items()}
    if isinstance(value, list):
        return [_split_lines(item, depth + 1) for item in value]
    return value


def unreadable(payload: Payload) -> str | None:
    """The placeholder's text, if `decode_payloads` could not read this payload."""
    if payload.metadata.get("drlm-error") != b"true":
        return None
    return str(json.loads(payload.data))


CONTEXT_PREVIEW = 4_000  # characters of an episode's context shown beside its reference


def _with_contexts(payload: Payload, blobs: BlobStore) -> Payload:
    """A request names its context by digest (`{"digest": "sha256:…", "kind": "text", ...}`):
    for a reader, put the start of the context beside it (`"preview"`)."""
    if payload.metadata.get("encoding") != JSON_PLAIN or b'"kind"' not in payload.data:
        return payload
    if len(payload.data) > DISPLAY_LIMIT or b'"sha256:' not in payload.data:
        return payload
    try:
        value = json.loads(payload.data)
    except ValueError:
        return payload
    if not _add_previews(value, blobs, budget=[8]):
        return payload
    out = Payload()
    out.CopyFrom(payload)
    out.data = json.dumps(value, ensure_ascii=False).encode("utf-8")
    return out


def _add_previews(value: Any, blobs: BlobStore, budget: list[int], depth: int = 0) -> bool:
    """Walk (bounded: depth 8, at most `budget` contexts) and add previews in place."""
    if depth > 8 or budget[0] <= 0:
        return False
    changed = False
    if isinstance(value, dict):
        digest = value.get("digest")
        if isinstance(digest, str) and digest.startswith("sha256:") and value.get("kind") in ("text", "json"):
            budget[0] -= 1
            try:
                text = blobs.get_text(digest)
                cut = len(text) - CONTEXT_PREVIEW
                value["preview"] = text[:CONTEXT_PREVIEW] + (f"… [{cut} more characters]" if cut > 0 else "")
            except Exception as exc:  # noqa: BLE001 - a missing context must not hide the event
                value["preview"] = f"[context {digest} unreadable: {str(exc).splitlines()[0][:200]}]"
            return True
        for item in value.values():
            changed = _add_previews(item, blobs, budget, depth + 1) or changed
    elif isinstance(value, list):
        for item in value[:100]:
            changed = _add_previews(item, blobs, budget, depth + 1) or changed
    return changed


def _decode_guarded(payload: Payload, blobs: BlobStore, limit: int | None) -> Payload:
    try:
        return _decode_one(payload, blobs, limit)
    except Exception as exc:  # a bug here must still leave the rest of the event readable
        log.exception("codec server: cannot decode a payload")
        digest = payload.data.decode("utf-8", errors="replace")[:80]
        return _placeholder(f"[cannot decode claim-checked payload {digest}: {type(exc).__name__}]", digest)


def _decode_one(payload: Payload, blobs: BlobStore, limit: int | None) -> Payload:
    if payload.metadata.get("encoding") == ENCRYPTED:
        # Sealed with DRLM_ENCRYPTION_KEYS: opened with the keys this server's store has.
        kid = payload.metadata.get(KEY_ID, b"").decode(errors="replace")
        try:
            payload = EncryptionCodec(blobs.keyring).open_payload(payload)
        except MissingKey as exc:
            return _placeholder(f"[encrypted payload: {exc}]", f"key {kid}")
    if payload.metadata.get("encoding") != ENCODING:
        return payload
    digest = payload.data.decode("utf-8", errors="replace")
    size = payload.metadata.get("size", b"?").decode("ascii", errors="replace")
    try:
        inner = Payload.FromString(blobs.get(digest))
    except BlobNotFound:
        message = str(BlobNotFound(digest, store_name(blobs)))
        return _placeholder(f"[claim-checked payload of {size} bytes: {message}]", digest)
    except (ValueError, DecodeError) as exc:  # a malformed digest, a corrupt blob
        return _placeholder(f"[claim-checked payload {digest} of {size} bytes is unreadable: {exc}]", digest)
    except Exception as exc:  # the store itself: the database is down, a permission
        log.warning("codec server: cannot read blob %s: %s", digest, exc)
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        return _placeholder(
            f"[cannot read claim-checked payload {digest} from {store_name(blobs)}: {reason}]", digest
        )
    if limit is not None and len(inner.data) > limit:
        return _shorten(inner, digest, limit)
    return inner


def store_name(blobs: BlobStore) -> str:
    """Where the blobs are read from, for messages (no password)."""
    if blobs.where:
        return blobs.where
    backend = blobs.backend
    if isinstance(backend, SqlBackend):
        return "the blobs table of " + backend.engine.url.render_as_string(hide_password=True)
    if isinstance(backend, DirectoryBackend):
        return f"the blob directory {backend.root}"
    return type(backend).__name__


def _placeholder(text: str, digest: str) -> Payload:
    return Payload(
        metadata={"encoding": JSON_PLAIN, "drlm-digest": digest.encode(), "drlm-error": b"true"},
        data=json.dumps(text).encode(),
    )


def _shorten(inner: Payload, digest: str, limit: int) -> Payload:
    """JSON stays JSON (the UI parses it): its long strings are cut in the middle until it
    fits, and a note says what was left out; anything else becomes a string of its head."""
    size = len(inner.data)
    note = (
        f"shortened for display by the drlm codec server: the whole payload is {size:,} bytes, blob {digest}"
    )
    encoding = inner.metadata.get("encoding", b"")
    data: bytes | None = None
    if encoding.startswith(b"json/"):
        try:
            data = _fit_json(json.loads(inner.data), note, limit)
        except (ValueError, RecursionError):  # not JSON after all, or nested too deep
            data = None
    if data is None:  # not JSON, or JSON that no amount of string cutting fits
        data = _head_as_string(inner.data.decode("utf-8", errors="replace"), note, limit)
    metadata = {k: v for k, v in inner.metadata.items() if k not in ("encoding", "messageType")}
    metadata.update(
        {
            "encoding": JSON_PLAIN,
            "drlm-shortened": b"true",
            "drlm-size": str(size).encode(),
            "drlm-digest": digest.encode(),
        }
    )
    return Payload(metadata=metadata, data=data)


def _head_as_string(text: str, note: str, limit: int) -> bytes:
    prefix = f"[{note}; its first part follows] "
    keep = max(limit - len(prefix) - 2, 0)
    while True:
        data = _utf8(json.dumps(prefix + text[:keep], ensure_ascii=False))
        if len(data) <= limit or keep == 0:
            return data
        keep = max(keep - (len(data) - limit), 0)  # each character dropped saves a byte or more


def _fit_json(value: Any, note: str, limit: int) -> bytes | None:
    cap = max(limit // 2, 256)
    while cap >= 64:
        shortened = _cut_strings(value, cap)
        if isinstance(shortened, dict):
            shortened = {"drlm_codec_note": note, **shortened}
        else:
            shortened = {"drlm_codec_note": note, "value": shortened}
        data = _utf8(json.dumps(shortened, ensure_ascii=False))
        if len(data) <= limit:
            return data
        cap //= 2
    return None


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", errors="replace")  # JSON may hold a lone surrogate (escaped)


def _cut_strings(value: Any, cap: int) -> Any:
    if isinstance(value, str):
        if len(value) <= cap:
            return value
        keep = cap // 2
        left_out = f"[{len(value) - 2 * keep:,} of {len(value):,} characters left out]"
        return f"{value[:keep]} … {left_out} … {value[-keep:]}"
    if isinstance(value, dict):
        return {k: _cut_strings(v, cap) for k, v in value.items()}
    if isinstance(value, list):
        return [_cut_strings(v, cap) for v in value]
    return value


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
    (durable_rlm/server.py) also takes a capability and an owner: with `path_secret`, every
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
    ) -> None:
        self.blobs = blobs
        # The episode pages (durable_rlm/episode_page.py): served under the same capability.
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
        host, port = self._server.server_address[:2]
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
            self._server.serve_forever()
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

            def _capable(self) -> bool:
                """The path starts with the capability (always, without one); else 404."""
                if server.path_secret is None:
                    return True
                first = self.path.split("?", 1)[0].lstrip("/").split("/", 1)[0]
                if hmac.compare_digest(first.encode(), server.path_secret.encode()):
                    return True
                self._error(404, "not found")
                return False

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
                if not self._capable():
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
                """The path below the capability."""
                path = self.path.split("?", 1)[0]
                if server.path_secret is not None:
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
                return f"/{server.path_secret}" if server.path_secret else ""

            def _page(self, answer: Any) -> None:
                """An episode page's answer, with the page's security headers."""
                from durable_rlm.episode_page import SECURITY_HEADERS

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

        return Handler
