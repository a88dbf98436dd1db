"""A scripted OpenAI-compatible chat server on 127.0.0.1, for tests and the demo.

The real `openai` client talks HTTP to it. A script maps each request to a reply (text,
HTTP error, delay). Every request is recorded, so a test can prove which calls were made
and that none was repeated.
"""

from __future__ import annotations

import gzip
import json
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from durable_rlm.ports import SERVE_POLL_S
from durable_rlm.workflows.fallback import EXTRACTION_MARKER


@dataclass
class Reply:
    text: str = ""
    status: int = 200
    delay_s: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)
    error: str | None = None
    logprobs: list[float] | None = None  # per-token, returned when the request asks
    # Sent as it is instead of a chat completion: a proxy's HTML page, truncated JSON, a
    # JSON object without choices. `status` and `headers` still apply.
    raw: str | None = None
    content_type: str = "application/json"
    reset: bool = False  # the connection is reset (RST) instead of any reply
    cost: float | None = None  # sent as usage.cost, as OpenRouter and LiteLLM proxies report it
    gzip: bool = False  # the body goes gzip-compressed (Content-Encoding: gzip)


@dataclass
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]
    received_at: float
    body: dict[str, Any] = field(default_factory=dict)
    api: str = "openai"  # or "anthropic": the system prompt is then messages[0], as for OpenAI
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def is_root(self) -> bool:
        return bool(self.messages) and self.messages[0].get("role") == "system"

    @property
    def is_extraction(self) -> bool:
        """A fallback-extraction call (seed 004): one user message with the seed's prompt."""
        return not self.is_root and self.last_user.lstrip().startswith(EXTRACTION_MARKER)

    @property
    def is_compaction(self) -> bool:
        """A conversation-compaction call: one user message asking for a summary."""
        return not self.is_root and self.last_user.lstrip().startswith(COMPACTION_MARKER)

    @property
    def turn(self) -> int:
        """Root turn number (0-based): how many replies the conversation already holds."""
        return sum(1 for m in self.messages if m.get("role") == "assistant")

    @property
    def last_user(self) -> str:
        users = [m.get("content", "") for m in self.messages if m.get("role") == "user"]
        return users[-1] if users else ""


Script = Callable[[ChatRequest], "Reply | str"]


COMPACTION_MARKER = "You are compacting the working memory"
SCRIPTED_SUMMARY = "Scripted summary: the earlier turns looked at the context."

NOTHING_EXTRACTED = '{"answer": null, "_extraction_notes": "scripted: no extraction reply was scripted"}'


def root_and_sub(
    root_turns: Sequence[Reply | str],
    sub: Callable[[str], Reply | str] | None = None,
    extract: Callable[[str], Reply | str] | None = None,
) -> Script:
    """Root calls get `root_turns[turn]` (the last repeats); sub-calls get `sub(prompt)`;
    fallback extraction gets `extract(prompt)` (default: a reply that extracts nothing);
    compaction gets a fixed summary."""

    def script(request: ChatRequest) -> Reply | str:
        if request.is_root:
            return root_turns[min(request.turn, len(root_turns) - 1)]
        if request.is_extraction:
            return extract(request.last_user) if extract else NOTHING_EXTRACTED
        if request.is_compaction:
            return SCRIPTED_SUMMARY
        if sub is None:
            return Reply(status=500, error="this script has no sub-model")
        return sub(request.last_user)

    return script


class ScriptedModelServer:
    def __init__(
        self,
        script: Script,
        models: set[str] | None = None,
        api_key: str | None = None,
        port: int = 0,
        context_window_tokens: int | None = None,
    ) -> None:
        self.script = script
        self.models = models
        self.api_key = api_key
        self.context_window_tokens = context_window_tokens  # prompts over it get OpenAI's 400
        self.requests: list[ChatRequest] = []
        self.completed = 0
        self._lock = threading.Lock()
        self._server = ScriptedHttpServer(("127.0.0.1", port), self)
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        host, port = self._server.socket.getsockname()[:2]  # as bound: a str host
        return f"http://{host}:{port}/v1"

    def start(self) -> ScriptedModelServer:
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": SERVE_POLL_S}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:  # shutdown() waits forever for a loop that never ran
            self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> ScriptedModelServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def record(self, request: ChatRequest) -> None:
        """A request as it arrived (a test reads them all: what the model was sent)."""
        with self._lock:
            self.requests.append(request)

    def count_completed(self) -> None:
        """A reply was sent whole (a test tells calls answered from calls cut off)."""
        with self._lock:
            self.completed += 1

    def root_requests(self) -> list[ChatRequest]:
        with self._lock:
            return [r for r in self.requests if r.is_root]

    def sub_requests(self) -> list[ChatRequest]:
        with self._lock:
            return [r for r in self.requests if not (r.is_root or r.is_extraction or r.is_compaction)]

    def compaction_requests(self) -> list[ChatRequest]:
        with self._lock:
            return [r for r in self.requests if r.is_compaction]

    def extraction_requests(self) -> list[ChatRequest]:
        with self._lock:
            return [r for r in self.requests if r.is_extraction]


class ScriptedHttpServer(ThreadingHTTPServer):
    """The listening socket of one `ScriptedModelServer`, which its requests reach as `self.model_server`."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], model_server: ScriptedModelServer) -> None:
        self.model_server = model_server
        super().__init__(address, ScriptedRequests)


class ScriptedRequests(BaseHTTPRequestHandler):
    """One request to the scripted model: OpenAI's chat completions or Anthropic's messages,
    answered by the script, with each API's own error shape."""

    protocol_version = "HTTP/1.1"
    server: ScriptedHttpServer
    api = "openai"

    @property
    def model_server(self) -> ScriptedModelServer:
        return self.server.model_server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def handle(self) -> None:
        try:
            super().handle()
        except (BrokenPipeError, ConnectionResetError):
            pass  # a client that read only so much of a reply hung up: not the server's error

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in separate writes; without this, Nagle and delayed ACKs add
        # ~40 ms to every keep-alive request and pollute timings.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _send(
        self,
        status: int,
        body: dict[str, Any] | str,
        headers: dict[str, str] | None = None,
        content_type: str = "application/json",
        compress: bool = False,
    ) -> None:
        data = (body if isinstance(body, str) else json.dumps(body)).encode()
        if compress:
            data = gzip.compress(data, compresslevel=6)
            headers = {**(headers or {}), "Content-Encoding": "gzip"}
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        try:
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # a client that reads only so much of a reply closes

    def _error(
        self, status: int, message: str, headers: dict[str, str] | None = None, code: object = None
    ) -> None:
        if self.api == "anthropic":
            kinds = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}
            name = kinds.get(status, "invalid_request_error" if status < 500 else "api_error")
            self._send(status, {"type": "error", "error": {"type": name, "message": message}}, headers)
            return
        kind = "invalid_request_error" if status < 500 else "server_error"
        error = {"message": message, "type": kind, "code": code if code is not None else status}
        self._send(status, {"error": error}, headers)

    def do_GET(self) -> None:  # noqa: N802 (the http.server naming)
        if not self.path.rstrip("/").endswith("/models"):
            self._error(404, f"no route {self.path}")
            return
        names = sorted(self.model_server.models or {"scripted"})
        models = [{"id": n, "object": "model", "owned_by": "scripted"} for n in names]
        self._send(200, {"object": "list", "data": models})

    def do_POST(self) -> None:  # noqa: N802
        request = self._request()
        if request is None or self._refused(request):
            return
        reply = self.model_server.script(request)
        if isinstance(reply, str):
            reply = Reply(text=reply)
        if reply.delay_s:
            time.sleep(reply.delay_s)
        if reply.reset:
            # SO_LINGER 0: closing sends RST, as a proxy dropping the connection does.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            self.connection.close()
            return
        if reply.raw is not None:
            self._send(reply.status, reply.raw, reply.headers, reply.content_type, reply.gzip)
        elif reply.status != 200:
            self._error(reply.status, reply.error or "scripted failure", reply.headers)
            return
        else:
            number = len(self.model_server.requests)
            body = (anthropic_body if self.api == "anthropic" else openai_body)(request, reply, number)
            self._send(200, body, reply.headers, compress=reply.gzip and self.api == "openai")
        self.model_server.count_completed()

    def _request(self) -> ChatRequest | None:
        """The request read, routed and authenticated (recorded as it arrived), or None
        once an error was answered."""
        raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        path = self.path.split("?")[0].rstrip("/")
        if path.endswith("/messages"):
            self.api = "anthropic"
        elif not path.endswith("/chat/completions"):
            self._error(404, f"no route {self.path}")
            return None
        # Anthropic's clients send x-api-key (older) or a bearer token (newer).
        bearer = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
        given = (self.headers.get("x-api-key") or bearer) if self.api == "anthropic" else bearer
        expected = self.model_server.api_key
        if expected and given != expected:
            self._error(401, "invalid x-api-key" if self.api == "anthropic" else "Incorrect API key provided")
            return None
        try:
            body = json.loads(raw)
            if self.api == "anthropic":
                request = anthropic_request(body, dict(self.headers))
                if not isinstance(body.get("max_tokens"), int):
                    self._error(400, "max_tokens: Field required")
                    return None
            else:
                request = ChatRequest(body["model"], list(body["messages"]), time.time(), body)
        except (ValueError, KeyError, TypeError):
            self._error(400, "malformed chat completion request")
            return None
        self.model_server.record(request)
        return request

    def _refused(self, request: ChatRequest) -> bool:
        """An unknown model, or a prompt past the model's window, answered as the API does."""
        served = self.model_server
        if served.models is not None and request.model not in served.models:
            self._error(404, f"The model `{request.model}` does not exist")
            return True
        window = served.context_window_tokens
        tokens = sum(len(str(m.get("content", ""))) for m in request.messages) // 4
        if window is not None and tokens + int(request.body.get("max_tokens") or 0) > window:
            self._error(
                400,
                f"This model's maximum context length is {window} tokens. However, your "
                f"messages resulted in {tokens} tokens. Please reduce the length of the messages.",
                code="context_length_exceeded",
            )
            return True
        return False


def anthropic_request(body: dict[str, Any], headers: dict[str, str]) -> ChatRequest:
    """An Anthropic Messages request, seen as a chat request: the system prompt becomes the
    first message and content blocks become text."""

    def text(content: Any) -> str:
        if isinstance(content, str):
            return content
        return "".join(b.get("text", "") for b in content if isinstance(b, dict))

    messages = [{"role": m["role"], "content": text(m["content"])} for m in body["messages"]]
    system = body.get("system")
    if system:
        messages.insert(0, {"role": "system", "content": text(system)})
    return ChatRequest(body["model"], messages, time.time(), body, "anthropic", headers)


def _prompt_chars(request: ChatRequest) -> int:
    return sum(len(str(m.get("content", ""))) for m in request.messages)


def anthropic_body(request: ChatRequest, reply: Reply, number: int) -> dict[str, Any]:
    """A Messages API reply (tokens counted as characters / 4)."""
    return {
        "id": f"msg_scripted_{number}",
        "type": "message",
        "role": "assistant",
        "model": request.model,
        "content": [{"type": "text", "text": reply.text}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": _prompt_chars(request) // 4, "output_tokens": len(reply.text) // 4},
    }


def openai_body(request: ChatRequest, reply: Reply, number: int) -> dict[str, Any]:
    """A chat completion (tokens counted as characters / 4; logprobs when asked and scripted;
    the provider-reported cost when scripted)."""
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": reply.text},
        "finish_reason": "stop",
    }
    if request.body.get("logprobs") and reply.logprobs is not None:
        choice["logprobs"] = {
            "content": [
                {"token": f"t{i}", "logprob": lp, "bytes": None, "top_logprobs": []}
                for i, lp in enumerate(reply.logprobs)
            ]
        }
    prompt, completion = _prompt_chars(request) // 4, len(reply.text) // 4
    return {
        "id": f"chatcmpl-scripted-{number}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            **({"cost": reply.cost} if reply.cost is not None else {}),
        },
    }
