"""The codec server (docs/guides/viewer.md): the Web UI's claim-checked payloads decoded
over HTTP, from a real episode's history, with a real SQL blob store, CORS and a bearer
token."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from google.protobuf.json_format import MessageToDict
from temporalio.api.common.v1 import Payload
from temporalio.api.enums.v1 import EventType

from durable_rlm.client.episodes import store_context
from durable_rlm.scripted import root_and_sub
from durable_rlm.store.blobs import BlobStore, digest_of
from durable_rlm.store.codec import ENCODING, ClaimCheckCodec
from durable_rlm.store.display import DISPLAY_LIMIT, as_lines, decode_payloads, store_name
from durable_rlm.viewer.codec_server import CodecServer, ui_origins
from durable_rlm.workflows import names
from tests.conftest import request_for, run_episode

UI = "http://127.0.0.1:8233"
CLAIM_CHECK_B64 = base64.b64encode(ENCODING).decode()


@pytest.fixture
def codec(blobs: BlobStore) -> Iterator[Any]:
    """Start codec servers on free ports over the session's SQL blob store; stop them after."""
    started: list[CodecServer] = []

    def start(**kwargs: Any) -> CodecServer:
        server = CodecServer(kwargs.pop("store", blobs), **kwargs).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


class Answer:
    def __init__(self, status: int, headers: Any, body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def json(self) -> Any:
        return json.loads(self.body)


def call(url: str, body: Any = None, method: str = "POST", **headers: str) -> Answer:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    headers = {k.replace("_", "-"): v for k, v in headers.items()}
    if data is not None:
        headers.setdefault("Content-Type", "application/json")
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return Answer(response.status, response.headers, response.read())
    except urllib.error.HTTPError as error:
        return Answer(error.code, error.headers, error.read())


def ui_payloads(value: Any) -> list[dict[str, Any]]:
    """Every payload in a history event as the Web UI holds it (proto3 JSON)."""
    if isinstance(value, dict):
        if "metadata" in value and "data" in value:
            return [value]
        return [p for v in value.values() for p in ui_payloads(v)]
    if isinstance(value, list):
        return [p for v in value for p in ui_payloads(v)]
    return []


def in_json(payload: Payload) -> dict[str, Any]:
    return {
        "metadata": {k: base64.b64encode(v).decode() for k, v in payload.metadata.items()},
        "data": base64.b64encode(payload.data).decode(),
    }


def data_of(payload: dict[str, Any]) -> Any:
    return json.loads(base64.b64decode(payload["data"]))


def claim_checked(blobs: BlobStore, value: Any) -> Payload:
    """`value` as a worker would leave it in history: JSON, then the claim check."""
    inner = Payload(metadata={"encoding": b"json/plain"}, data=json.dumps(value).encode())
    (payload,) = asyncio.run(ClaimCheckCodec(blobs, threshold=0).encode([inner]))
    assert payload.metadata["encoding"] == ENCODING
    return payload


# --- a real episode ---------------------------------------------------------------------------


async def test_the_ui_sees_the_context_prompts_and_code_of_a_claim_checked_episode(
    client, blobs, worker, scripted, codec
) -> None:
    context_text = "".join(f"Line {i}: the heron waits by the weir. " for i in range(600))
    long_code = "notes = '" + "kingfisher " * 600 + "'\nprint(len(notes))"
    server = scripted(
        root_and_sub(["```repl\nprint(context[:8000])\n```", f"```repl\n{long_code}\n```", "FINAL(seen)"])
    )
    episode_id = f"codec-{uuid.uuid4().hex[:8]}"
    request = request_for(server, context=store_context(blobs, context_text))
    assert (await run_episode(client, request, worker.task_queue, episode_id)).answer == "seen"
    history = await client.get_workflow_handle(episode_id).fetch_history()

    events = [(e, ui_payloads(MessageToDict(e))) for e in history.events]
    payloads = [p for _, ps in events for p in ps]
    checked = [p for p in payloads if p["metadata"].get("encoding") == CLAIM_CHECK_B64]
    assert len(checked) >= 3, "the episode must be large enough to be claim-checked"
    seen_raw = " ".join(base64.b64decode(p["data"]).decode() for p in checked)
    assert "heron" not in seen_raw and "kingfisher" not in seen_raw  # history holds digests

    ui = codec()
    answer = await asyncio.to_thread(
        call, f"{ui.url}/decode", {"payloads": payloads}, Origin=UI, X_Namespace="default"
    )
    assert answer.status == 200, answer.body
    assert answer.headers["Access-Control-Allow-Origin"] == UI
    decoded = answer.json()["payloads"]
    assert len(decoded) == len(payloads)
    previews = 0
    for before, after in zip(payloads, decoded, strict=True):
        if before not in checked:
            value = data_of(after)
            if (
                isinstance(value, dict)
                and isinstance(value.get("context"), dict)
                and "preview" in value["context"]
            ):
                # A request names its context by digest: the reader also gets its start.
                previews += 1
                assert value["context"]["preview"].startswith("Line 0: the heron waits by the weir.")
                del value["context"]["preview"]
                assert value == data_of(before)
            else:
                # What was never claim-checked passes untouched, but for text shown as lines.
                assert after == in_json(as_lines(Payload(**_raw(before))))
        data_of(after)  # and every payload is JSON the UI can show
    assert previews >= 1

    shown = [json.dumps(data_of(p), ensure_ascii=False) for p in decoded]
    assert not any(base64.b64decode(p["metadata"]["encoding"]) == ENCODING for p in decoded)
    assert any(context_text[:8000] in text for text in shown)  # cell 1's output: the context
    # Text reads as its lines (a reply, a cell's code), not as one string full of \\n.
    texts = [data_of(p).get("text") for p in decoded if isinstance(data_of(p), dict)]
    shown_lines = ["\n".join(t) for t in texts if isinstance(t, list)]
    assert any(long_code in text for text in shown_lines)
    # The prompt of iteration 2 (the root model call's input) carries cell 1's output.
    prompts = [
        ps
        for e, ps in events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and e.activity_task_scheduled_event_attributes.activity_type.name == names.ROOT_COMPLETION
        and any(p in checked for p in ps)
    ]
    assert prompts, "a root model call's claim-checked input"
    prompt = await asyncio.to_thread(call, f"{ui.url}/decode", {"payloads": prompts[0]}, Origin=UI)
    assert any(context_text[:2000] in json.dumps(data_of(p)) for p in prompt.json()["payloads"])

    # The same payloads the worker's own codec reads back (nothing here is over the limit).
    codec_view = await ClaimCheckCodec(blobs).decode([Payload(**_raw(p)) for p in checked])
    from_server = [p for before, p in zip(payloads, decoded, strict=True) if before in checked]
    assert [in_json(as_lines(p)) for p in codec_view] == from_server

    # The CLI's template, `--codec-endpoint http://host:port/{namespace}`, works as well.
    namespaced = await asyncio.to_thread(call, f"{ui.url}/default/decode", {"payloads": checked})
    assert namespaced.status == 200 and namespaced.json()["payloads"] == from_server


def _raw(payload: dict[str, Any]) -> dict[str, Any]:
    return {
        "metadata": {k: base64.b64decode(v) for k, v in payload["metadata"].items()},
        "data": base64.b64decode(payload["data"]),
    }


# --- CORS and the token -----------------------------------------------------------------------


def test_a_preflight_is_answered_for_the_ui_origins_and_refused_for_others(codec, blobs) -> None:
    server = codec()  # default origins: the embedded server's UI, under both loopback names
    assert set(ui_origins()) == {"http://127.0.0.1:8233", "http://localhost:8233"}
    for origin in ui_origins():
        answer = call(
            f"{server.url}/decode",
            method="OPTIONS",
            Origin=origin,
            Access_Control_Request_Method="POST",
            Access_Control_Request_Headers="content-type,x-namespace",
        )
        assert answer.status == 204
        assert answer.headers["Access-Control-Allow-Origin"] == origin
        allowed = {h.strip().lower() for h in answer.headers["Access-Control-Allow-Headers"].split(",")}
        assert {"content-type", "x-namespace", "authorization"} <= allowed
        assert "POST" in answer.headers["Access-Control-Allow-Methods"]
        assert answer.headers["Access-Control-Allow-Credentials"] == "true"

    other = "http://evil.example:8233"
    refused = call(
        f"{server.url}/decode", method="OPTIONS", Origin=other, Access_Control_Request_Method="POST"
    )
    assert refused.status == 403 and "Access-Control-Allow-Origin" not in refused.headers
    posted = call(f"{server.url}/decode", {"payloads": []}, Origin=other)
    assert posted.status == 403 and "Access-Control-Allow-Origin" not in posted.headers
    assert "not allowed" in posted.json()["error"]

    # Without an Origin (the CLI, curl) there is nothing to check and no CORS header to add.
    plain = call(f"{server.url}/decode", {"payloads": []})
    assert plain.status == 200 and plain.json() == {"payloads": []}
    assert "Access-Control-Allow-Origin" not in plain.headers

    # The origins are a parameter: a cluster's UI, say.
    cluster = codec(origins=["https://temporal.example.com/"])
    answer = call(f"{cluster.url}/decode", {"payloads": []}, Origin="https://temporal.example.com")
    assert answer.headers["Access-Control-Allow-Origin"] == "https://temporal.example.com"
    assert call(f"{cluster.url}/decode", {"payloads": []}, Origin=UI).status == 403


@pytest.mark.parametrize(
    "origin",
    [
        "http://127.0.0.1:8233.evil.example",  # a name of the attacker's that begins like ours
        "http://localhost:8233.evil.example",
        "http://127.0.0.1:82330",  # another port
        "http://127.0.0.1:8233/.evil.example",
        "http://127.0.0.1:8233X",  # only a trailing slash is ignored
    ],
)
def test_an_origin_is_allowed_whole_never_by_its_beginning(codec, origin: str) -> None:
    """An allowed origin is compared whole (a trailing slash aside): an origin that merely
    starts with the UI's gets no CORS headers and a 403, so a page of its own cannot read
    payloads with the browser's credentials."""
    server = codec()
    for method, body in (("OPTIONS", None), ("POST", {"payloads": []})):
        answer = call(f"{server.url}/decode", body, method=method, Origin=origin)
        assert answer.status == 403, (method, answer.status)
        assert "Access-Control-Allow-Origin" not in answer.headers
        assert "Access-Control-Allow-Credentials" not in answer.headers
    assert call(f"{server.url}/decode", {"payloads": []}, Origin=f"{UI}/").status == 200


def test_a_configured_token_is_required_on_every_post(codec, blobs) -> None:
    server = codec(token="s3cret")
    body = {"payloads": [in_json(claim_checked(blobs, {"text": "guarded " * 1000}))]}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        answer = call(f"{server.url}/decode", body, Origin=UI, **headers)
        assert answer.status == 401, headers
        assert answer.headers["WWW-Authenticate"].startswith("Bearer")
        assert "Authorization: Bearer" in answer.json()["error"]
        assert answer.headers["Access-Control-Allow-Origin"] == UI  # so the UI can read why
    assert call(f"{server.url}/encode", body).status == 401
    # A browser's preflight carries no credentials: it is answered without the token.
    assert call(f"{server.url}/decode", method="OPTIONS", Origin=UI).status == 204

    answer = call(f"{server.url}/decode", body, Origin=UI, Authorization="Bearer s3cret")
    assert answer.status == 200
    assert data_of(answer.json()["payloads"][0]) == {"text": "guarded " * 1000}


def test_a_path_capability_is_required_on_every_request(codec, blobs) -> None:
    """The supervisor's codec server (docs/security.md): loopback is no boundary between
    users, so every path starts with its secret; without it, or with another, 404 and no
    payload."""
    secret = "k" * 43
    server = codec(path_secret=secret)
    assert server.url == f"http://127.0.0.1:{server.port}/{secret}"
    base = f"http://127.0.0.1:{server.port}"
    body = {"payloads": [in_json(claim_checked(blobs, {"text": "capable " * 1000}))]}
    for prefix in ("", "/default", f"/{secret[:-1]}", f"/{secret}x", "/" + "j" * 43):
        for action in ("decode", "encode"):
            answer = call(f"{base}{prefix}/{action}", body, Origin=UI)
            assert answer.status == 404, (prefix, action)
            assert b"capable" not in answer.body and answer.json() == {"error": "not found"}
        assert call(f"{base}{prefix}/", method="GET").status == 404
        assert call(f"{base}{prefix}/decode", method="OPTIONS", Origin=UI).status == 404
    for path in ("/decode", "/default/decode"):  # also under the CLI's namespace prefix
        answer = call(f"{server.url}{path}", body, Origin=UI)
        assert answer.status == 200
        assert data_of(answer.json()["payloads"][0]) == {"text": "capable " * 1000}
    assert call(f"{server.url}/decode", method="OPTIONS", Origin=UI).status == 204


def test_another_uids_connection_is_reset_unread(codec, blobs) -> None:
    """With `owner_uid`, the kernel's TCP table decides: this process is not the owner."""
    import http.client
    import os

    server = codec(owner_uid=os.getuid() + 1)
    body = json.dumps({"payloads": [in_json(claim_checked(blobs, {"text": "owned " * 1000}))]})
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    with pytest.raises((ConnectionResetError, http.client.RemoteDisconnected)):
        connection.request("POST", "/decode", body, {"Content-Type": "application/json"})
        connection.getresponse().read()
    mine = codec(owner_uid=os.getuid())
    answer = call(f"{mine.url}/decode", json.loads(body))
    assert answer.status == 200 and data_of(answer.json()["payloads"][0]) == {"text": "owned " * 1000}


def test_another_uids_connection_is_reset_not_closed(codec) -> None:
    """Reset (SO_LINGER 0: an RST after the server's FIN), not an orderly close: a client
    that sends nothing still sees its connection torn down, never left half-open."""
    import os
    import socket

    server = codec(owner_uid=os.getuid() + 1)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as client:
        try:
            client.recv(1)  # the server's FIN (b""), or the reset itself
        except (ConnectionResetError, BrokenPipeError):
            pass
        deadline = time.monotonic() + 5
        state = client.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
        while state != 7 and time.monotonic() < deadline:  # TCP_CLOSE: the peer reset it
            time.sleep(0.01)
            state = client.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
    assert state == 7  # an orderly close leaves it in CLOSE_WAIT (8)


# --- size, missing blobs, bad bodies -----------------------------------------------------------


def test_a_server_shortens_at_its_own_limit(codec, blobs) -> None:
    """A server given a display limit shortens there, not at the default's."""
    stdout = "x" * (DISPLAY_LIMIT // 2)
    payload = in_json(claim_checked(blobs, {"stdout": stdout}))
    for limit, whole in ((None, True), (DISPLAY_LIMIT // 4, False)):
        answer = call(f"{codec(limit=limit).url}/decode", {"payloads": [payload]}, Origin=UI)
        (shown,) = answer.json()["payloads"]
        value = json.loads(base64.b64decode(shown["data"]))
        assert (value["stdout"] == stdout) is whole, limit
        assert ("drlm_codec_note" in value) is not whole, limit


def test_a_huge_payload_is_shortened_and_says_its_size_and_digest(codec, blobs) -> None:
    server = codec()
    stdout = "".join(f"row {i}\n" for i in range(400_000)) + "THE END"
    payload = claim_checked(blobs, {"stdout": stdout, "status": "ok", "cell_index": 3})
    digest = payload.data.decode()
    size = len(Payload.FromString(blobs.get(digest)).data)
    assert size > 3_000_000

    started = time.perf_counter()
    answer = call(f"{server.url}/decode", {"payloads": [in_json(payload)]}, Origin=UI)
    elapsed = time.perf_counter() - started
    assert answer.status == 200
    (shown,) = answer.json()["payloads"]
    data = base64.b64decode(shown["data"])
    assert len(data) <= DISPLAY_LIMIT < size
    value = json.loads(data)
    assert f"{size:,} bytes" in value["drlm_codec_note"] and digest in value["drlm_codec_note"]
    assert (value["status"], value["cell_index"]) == ("ok", 3)  # the small fields stay whole
    shown_out = "\n".join(value["stdout"])  # the UI reads text as its lines
    assert shown_out.startswith("row 0\nrow 1\n") and shown_out.endswith("THE END")
    assert f"of {len(stdout):,} characters left out" in shown_out
    meta = {k: base64.b64decode(v).decode() for k, v in shown["metadata"].items()}
    assert (
        meta["encoding"] == "json/plain" and meta["drlm-size"] == str(size) and meta["drlm-digest"] == digest
    )
    assert elapsed < 30, elapsed

    # Not JSON: a string of its head, with the same note.
    raw = Payload(metadata={"encoding": b"binary/plain"}, data=b"\x00binary " * 20_000)
    (stored,) = asyncio.run(ClaimCheckCodec(blobs, threshold=0).encode([raw]))
    (shown,) = decode_payloads([stored], blobs)
    assert len(shown.data) <= DISPLAY_LIMIT
    assert json.loads(shown.data).startswith(
        f"[shortened for display by the drlm codec server: the whole payload is {len(raw.data):,} bytes"
    )
    # Without a limit (for `drlm show`), the content comes back whole.
    assert decode_payloads([stored], blobs, limit=None) == [raw]


def test_a_missing_blob_decodes_to_a_placeholder_naming_digest_and_store(codec, blobs) -> None:
    server = codec()
    digest = digest_of(b"a blob this store never held " + uuid.uuid4().bytes)
    missing = Payload(metadata={"encoding": ENCODING, "size": b"123456"}, data=digest.encode())
    malformed = Payload(metadata={"encoding": ENCODING, "size": b"9"}, data=b"sha256:not-a-digest")
    small = Payload(metadata={"encoding": b"json/plain"}, data=b'"untouched"')
    body = {"payloads": [in_json(missing), in_json(small), in_json(malformed)]}
    answer = call(f"{server.url}/decode", body, Origin=UI)
    assert answer.status == 200
    first, second, third = answer.json()["payloads"]
    text = data_of(first)
    assert digest in text and "not found" in text and "123456 bytes" in text
    assert store_name(blobs) in text and "sqlite" in text
    assert second == in_json(small)
    assert "unreadable" in data_of(third) and "sha256:not-a-digest" in data_of(third)


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"{not json", 400, "the body is not JSON"),
        (b"\xff\xfe", 400, "the body is not JSON"),
        (b"[1, 2]", 400, 'the body must be a JSON object {"payloads"'),
        (b'{"payload": []}', 400, 'the body must be a JSON object {"payloads"'),
        (b'{"payloads": [3]}', 400, "payload 0 is not a JSON object"),
        (
            b'{"payloads": [{"metadata": {"encoding": "anNvbi9wbGFpbg=="}, "data": "@@@"}]}',
            400,
            "data is not base64",
        ),
        (b'{"payloads": [{"metadata": [], "data": ""}]}', 400, "metadata must be an object"),
        (b'{"payloads": [{"metadata": {"encoding": 7}, "data": ""}]}', 400, "must be a base64 string"),
        # The usual mistake: metadata in plain text instead of base64.
        (
            b'{"payloads": [{"metadata": {"encoding": "json/plain"}, "data": "IjEi"}]}',
            400,
            "not base64 of a name",
        ),
    ],
)
def test_a_malformed_body_is_a_400_with_a_clear_message(
    codec, body: bytes, status: int, message: str
) -> None:
    server = codec()
    for action in ("decode", "encode"):
        answer = call(f"{server.url}/{action}", body, Origin=UI)
        assert answer.status == status
        assert message in answer.json()["error"], answer.body
        assert b"Traceback" not in answer.body
        assert answer.headers["Access-Control-Allow-Origin"] == UI


def test_wrong_paths_methods_and_sizes_are_refused_plainly(codec) -> None:
    server = codec()
    assert call(f"{server.url}/nowhere", {"payloads": []}).status == 404
    wrong = call(f"{server.url}/decode", method="GET")
    assert wrong.status == 405 and "POST" in wrong.headers["Allow"]
    assert call(server.url + "/", method="GET").json()["service"] == "drlm codec server"
    huge = urllib.request.Request(
        f"{server.url}/decode", data=b"{}", method="POST", headers={"Content-Length": str(1 << 30)}
    )
    try:
        urllib.request.urlopen(huge, timeout=10)
    except urllib.error.HTTPError as error:
        assert error.code == 413 and "at most" in json.loads(error.read())["error"]
    else:
        raise AssertionError("a 1 GB body was accepted")


def test_encode_claim_checks_like_a_worker_and_decode_reads_it_back(codec, blobs) -> None:
    server = codec()
    big = Payload(metadata={"encoding": b"json/plain"}, data=json.dumps({"signal": "x" * 10_000}).encode())
    small = Payload(metadata={"encoding": b"json/plain"}, data=b'"tiny"')
    encoded = call(f"{server.url}/encode", {"payloads": [in_json(big), in_json(small)]}).json()["payloads"]
    assert encoded[0]["metadata"]["encoding"] == CLAIM_CHECK_B64 and encoded[1] == in_json(small)
    assert asyncio.run(ClaimCheckCodec(blobs).decode([Payload(**_raw(encoded[0]))])) == [big]
    decoded = call(f"{server.url}/decode", {"payloads": encoded}).json()["payloads"]
    assert decoded == [in_json(big), in_json(small)]


def test_serve_forever_blocks_until_stopped(blobs) -> None:
    server = CodecServer(blobs, port=0)
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    try:
        assert call(f"{server.url}/decode", {"payloads": []}).json() == {"payloads": []}
    finally:
        server.stop()
        thread.join(5)
    assert not thread.is_alive()


def test_a_stop_before_the_serving_thread_runs_still_ends_its_loop(blobs) -> None:
    """The window between `start()` and the serving thread's first line, held open here: a
    `stop()` in it must still shut down the loop the thread is about to enter (or it would
    wait out its join and leave the thread serving)."""
    door = threading.Event()

    class HeldAtTheDoor(CodecServer):
        def serve_forever(self) -> None:
            door.wait(10)
            super().serve_forever()

    server = HeldAtTheDoor(blobs, port=0).start()
    opener = threading.Timer(0.2, door.set)
    opener.start()
    began = time.monotonic()
    try:
        server.stop()
        assert time.monotonic() - began < 3
    finally:
        opener.cancel()
