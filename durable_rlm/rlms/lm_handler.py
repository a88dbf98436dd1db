"""rlms's LMHandler (rlm/core/lm_handler.py): the clients a REPL's `llm_query` reaches, by
model name, with the usage they kept.

rlms's handler serves its REPLs over a TCP socket. durable-rlm's REPL runs in a sandbox with
no network, so the REPL (LocalREPL, local_repl.py) asks the handler in this process: its
`address` names it, a loopback port reserved while it runs, as rlms's would be.
"""

from __future__ import annotations

import socket
import threading
from typing import Any, Literal

from durable_rlm.rlms.clients import BaseLM
from durable_rlm.rlms.results import UsageSummary

_RUNNING: dict[tuple[str, int], LMHandler] = {}
_LOCK = threading.Lock()


class LMHandler:
    """The root client, an optional client for depth-1 calls, and others by model name."""

    def __init__(
        self,
        client: BaseLM,
        host: str = "127.0.0.1",
        port: int = 0,
        other_backend_client: BaseLM | None = None,
        **kwargs: Any,
    ) -> None:
        self.default_client = client
        self.other_backend_client = other_backend_client
        self.clients: dict[str, BaseLM] = {}
        if client.model_name:
            self.clients[client.model_name] = client
        self.host, self._port = host, port
        self._socket: socket.socket | None = None

    def register_client(self, model_name: str, client: BaseLM) -> None:
        self.clients[model_name] = client

    def get_client(self, model: str | None = None, depth: int = 0) -> BaseLM:
        """A named model's client; else depth 1's own client when there is one; else the root's."""
        if model and model in self.clients:
            return self.clients[model]
        if depth == 1 and self.other_backend_client is not None:
            return self.other_backend_client
        return self.default_client

    def completion(self, prompt: str | list[dict[str, Any]], model: str | None = None) -> str:
        return self.get_client(model).completion(prompt)

    def get_usage_summary(self) -> UsageSummary:
        """Every client's usage, merged by model."""
        merged: dict[str, Any] = {}
        seen: set[int] = set()
        for client in [self.default_client, self.other_backend_client, *self.clients.values()]:
            if client is None or id(client) in seen:
                continue
            seen.add(id(client))
            merged.update(client.get_usage_summary().model_usage_summaries)
        return UsageSummary(merged)

    @property
    def port(self) -> int:
        return self._port

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self._port)

    def start(self) -> tuple[str, int]:
        if self._socket is None:
            self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._socket.bind((self.host, self._port))
            self._port = self._socket.getsockname()[1]
            with _LOCK:
                _RUNNING[self.address] = self
        return self.address

    def stop(self) -> None:
        if self._socket is not None:
            with _LOCK:
                _RUNNING.pop(self.address, None)
            self._socket.close()
            self._socket = None

    def __enter__(self) -> LMHandler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        self.stop()
        return False


def handler_at(address: tuple[str, int] | None) -> LMHandler | None:
    """The running handler of this process at `address`, if any."""
    if address is None:
        return None
    with _LOCK:
        return _RUNNING.get(tuple(address))  # type: ignore[arg-type]  # a (host, port) list from JSON too
