"""The shared server's supervisor (durable_rlm/supervisor.py) tells clients the Temporal
address as soon as the server answers, and brings up the codec server and pages after: the
port their URL names is held meanwhile, so no other process takes it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from durable_rlm.ports import free_port, wait_listening
from durable_rlm.server.embedded import ServerFiles, shared_server
from durable_rlm.settings import Settings
from durable_rlm.store.blobs import BlobStore, DirectoryBackend
from durable_rlm.supervisor import _held_port
from durable_rlm.viewer.codec_server import CodecServer


def test_a_held_port_is_refused_to_others_and_taken_by_the_codec_server(tmp_path: Path) -> None:
    held = _held_port()
    port = held.getsockname()[1]
    try:
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))  # another process's listener cannot have it
        codec = CodecServer(BlobStore(DirectoryBackend(tmp_path / "blobs")), port=port).start()
        try:
            assert codec.port == port and wait_listening(codec.url, 5)
        finally:
            codec.stop()
    finally:
        held.close()


async def test_clients_get_the_server_and_then_the_codec_server_it_named(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", ui_port=free_port(), server_idle_s=2)
    async with shared_server(settings) as lease:
        state = ServerFiles.of(settings).read_state()
        assert state is not None and state["address"] == lease.address
        assert wait_listening(str(state["codec"]), 30)  # the URL the UI was given is served
