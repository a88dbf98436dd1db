"""The codec and page server's requests, one rule at a time (durable_rlm/viewer/codec_requests.py,
codec_server.py): who may ask, what each path answers, the login links and sessions. A real
server on a loopback port over a real blob store; the
episode pages are the real ones without a Temporal server (the list reads no store, and an
action that needs the server fails as it would). tests/test_codec_server.py decodes a real
episode's history; tests/test_page_access.py attacks the login and the Host check;
tests/test_codec_logins.py and tests/test_codec_wire.py test the logins and the payloads'
JSON without a server."""

from __future__ import annotations

import base64
import http.client
import json
import logging
import shutil
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from durable_rlm.errors import ConfigurationError
from durable_rlm.settings import Settings
from durable_rlm.store.blobs import BlobStore, DirectoryBackend
from durable_rlm.viewer.codec_requests import host_of
from durable_rlm.viewer.codec_server import CodecServer, ui_origins
from durable_rlm.viewer.codec_wire import (
    ALLOWED_HEADERS,
    MAX_BODY,
)
from durable_rlm.viewer.episode_page import SECURITY_HEADERS, EpisodePages

UI = "http://127.0.0.1:8233"
SECRET = "c" * 43


@pytest.fixture
def store(tmp_path: Path) -> BlobStore:
    return BlobStore(DirectoryBackend(tmp_path / "blobs"))


@pytest.fixture
def serve(store: BlobStore, tmp_path: Path) -> Iterator[Any]:
    """Start codec servers (with the episode pages when asked); stop them after."""
    started: list[CodecServer] = []

    def start(pages: bool = False, **options: Any) -> CodecServer:
        if pages:
            settings = Settings(data_dir=tmp_path / "data")
            address = options.pop("address", lambda: None)  # None: no Temporal server yet
            options["pages"] = EpisodePages(settings, store, None, address=address, sender="tester")
        server = CodecServer(options.pop("blobs", store), **options).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


class Answer:
    def __init__(self, response: http.client.HTTPResponse) -> None:
        self.status = response.status
        self.headers = response.headers
        self.body = response.read()

    def json(self) -> Any:
        return json.loads(self.body)


def ask(
    server: CodecServer,
    method: str,
    path: str,
    body: bytes | None = None,
    **headers: str,
) -> Answer:
    """One request with exactly these headers (Host 127.0.0.1 unless given)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        connection.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        given = {k.replace("_", "-"): v for k, v in headers.items()}
        given.setdefault("Host", "127.0.0.1")
        if body is not None:
            given.setdefault("Content-Length", str(len(body)))
        for key, value in given.items():
            connection.putheader(key, value)
        connection.endheaders(body)
        return Answer(connection.getresponse())
    finally:
        connection.close()


def payload_json(data: bytes, **metadata: bytes) -> dict[str, Any]:
    return {
        "metadata": {k: base64.b64encode(v).decode() for k, v in metadata.items()},
        "data": base64.b64encode(data).decode(),
    }


EMPTY = json.dumps({"payloads": []}).encode()


# --- the Host header ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "host"),
    [
        (None, None),
        ("", None),
        ("  LocalHost:8234 ", "localhost"),
        ("127.0.0.1", "127.0.0.1"),
        ("[::1]:8234", "::1"),
        ("[::1]", "::1"),
        ("::1", "::1"),  # a bare IPv6 address has no port to cut
        ("a:b:c", "a:b:c"),
    ],
)
def test_the_host_a_host_header_names(header: str | None, host: str | None) -> None:
    assert host_of(header) == host


def test_a_request_naming_no_host_of_ours_is_421_and_says_which_it_answers(serve) -> None:
    server = serve()
    refused = ask(server, "GET", "/", Host="elsewhere.example")
    assert refused.status == 421
    assert refused.json() == {"error": "this server answers only to 127.0.0.1, localhost or its own address"}
    assert refused.headers["Connection"] == "close"
    assert ask(server, "GET", "/", Host="LOCALHOST:1").status == 200


def test_a_malformed_request_line_gets_the_servers_own_error(serve) -> None:
    """The Host check runs on a request http.server could parse; before that, its own 400."""
    server = serve()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as raw:
        raw.sendall(b"NONSENSE\r\n\r\n")
        reply = b"".join(iter(lambda: raw.recv(4096), b""))
    assert b"Error code: 400" in reply and b"421" not in reply


# --- the capability, the one-shot login and the session ------------------------------------------


def test_without_a_capability_every_path_is_open(serve) -> None:
    server = serve()
    assert server.url == f"http://127.0.0.1:{server.port}"
    assert ask(server, "GET", "/").json() == {
        "service": "drlm codec server",
        "endpoints": ["POST /decode", "POST /encode"],
    }
    assert ask(server, "POST", "/decode", EMPTY).json() == {"payloads": []}


def test_with_a_capability_the_path_starts_with_it_and_is_answered_below_it(serve) -> None:
    server = serve(path_secret=SECRET)
    assert server.url == f"http://127.0.0.1:{server.port}/{SECRET}"
    assert ask(server, "GET", f"/{SECRET}").json()["service"] == "drlm codec server"
    assert ask(server, "GET", f"/{SECRET}/?x=1").json()["service"] == "drlm codec server"
    assert ask(server, "GET", f"/{SECRET}?x=a?b").json()["service"] == "drlm codec server"
    assert ask(server, "GET", f"/{SECRET}/?x=/a?b").json()["service"] == "drlm codec server"
    assert ask(server, "POST", f"/{SECRET}/default/encode", EMPTY).json() == {"payloads": []}
    for path in (
        "/",
        "/decode",
        f"/{SECRET[:-1]}/decode",
        f"/x{SECRET}/decode",
        f"/X{SECRET}/decode",
        f"/decode/{SECRET}",
    ):
        answer = ask(server, "POST", path, EMPTY)
        assert (answer.status, answer.json()) == (404, {"error": "not found"}), path


@pytest.mark.parametrize("secret", ["", "a/b"])
def test_a_capability_is_one_non_empty_path_segment(store: BlobStore, secret: str) -> None:
    with pytest.raises(
        ConfigurationError, match="^a codec server's path secret is one non-empty path segment$"
    ):
        CodecServer(store, path_secret=secret)


def test_a_login_token_is_minted_only_with_the_capability_and_opens_the_page_asked_for(serve) -> None:
    server = serve(path_secret=SECRET, pages=True)
    minted = ask(server, "POST", f"/{SECRET}/login-token", json.dumps({"next": "/episodes/ep-1"}).encode())
    link = minted.json()["url"]
    assert link.startswith(f"http://127.0.0.1:{server.port}/open?token=")
    opened = ask(server, "GET", link.removeprefix(f"http://127.0.0.1:{server.port}"))
    assert opened.status == 303 and opened.headers["Location"] == "/episodes/ep-1"
    assert opened.headers["Content-Length"] == "0"
    assert (
        opened.headers["Cache-Control"] == "no-store" and opened.headers["Referrer-Policy"] == "no-referrer"
    )
    cookie = opened.headers["Set-Cookie"]
    assert cookie.startswith(f"drlm_{server.port}=") and cookie.endswith(
        "; Path=/; HttpOnly; SameSite=Strict"
    )
    session = cookie.split(";")[0]
    page = ask(server, "GET", "/episodes", Cookie=session)
    assert page.status == 200 and b"episodes" in page.body
    assert ask(server, "GET", "/episodes", Cookie=f"drlm_{server.port}=forged").status == 404
    assert ask(server, "GET", "/episodes", Cookie=f"drlm_1={session.partition('=')[2]}").status == 404
    assert ask(server, "GET", "/episodes", Cookie="no cookie; ===").status == 404
    # A session never mints: only the capability does.
    assert ask(server, "POST", "/login-token", b"{}", Cookie=session).status == 404


@pytest.mark.parametrize(
    ("body", "target"),
    [
        (b"", "/episodes"),
        (b"{}", "/episodes"),
        (b'{"next": null}', "/episodes"),
        (b"not json", "/episodes"),
        (b"[1]", "/episodes"),
        (b'{"next": "https://elsewhere.example/"}', "/episodes"),
        (b'{"next": "/episodes//elsewhere.example"}', "/episodes"),
        (b'{"next": "/decode"}', "/episodes"),
        (b'{"next": "/episodes?status=running"}', "/episodes?status=running"),
    ],
)
def test_a_login_link_opens_only_a_page_of_ours(serve, body: bytes, target: str) -> None:
    server = serve(path_secret=SECRET)
    link = ask(server, "POST", f"/{SECRET}/login-token", body).json()["url"]
    opened = ask(server, "GET", link.removeprefix(f"http://127.0.0.1:{server.port}"))
    assert opened.headers["Location"] == target


def test_a_login_link_works_once_and_an_unknown_one_never(serve) -> None:
    server = serve(path_secret=SECRET)
    link = ask(server, "POST", f"/{SECRET}/login-token", b"{}").json()["url"]
    path = link.removeprefix(f"http://127.0.0.1:{server.port}")
    assert ask(server, "GET", f"{path}&then=a?b").status == 303  # the query is all after the first ?
    for used in (path, "/open?token=made-up", "/open", "/open/?token="):
        again = ask(server, "GET", used)
        assert again.status == 403, used
        assert again.json() == {"error": "this link was used or has expired: run `drlm ui --open` again"}
    assert ask(server, "GET", "/openX?token=made-up").status == 404  # not the login's path


def test_a_refused_login_is_one_answer_and_the_connection_ends(serve) -> None:
    server = serve(path_secret=SECRET)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as raw:
        raw.sendall(b"GET /open?token=made-up HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        reply = b"".join(iter(lambda: raw.recv(4096), b""))
    assert reply.startswith(b"HTTP/1.1 403 ") and reply.count(b"HTTP/1.1 ") == 1, reply


def test_a_request_without_the_capability_is_one_404(serve) -> None:
    server = serve(path_secret=SECRET)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as raw:
        raw.sendall(b"GET /decode HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        reply = b"".join(iter(lambda: raw.recv(4096), b""))
    assert reply.startswith(b"HTTP/1.1 404 ") and reply.count(b"HTTP/1.1 ") == 1, reply


def test_a_refused_origin_is_one_answer_and_the_connection_ends(serve) -> None:
    server = serve()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as raw:
        raw.sendall(
            b"POST /decode HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: http://elsewhere.example\r\n"
            + b"Content-Length: %d\r\n\r\n" % len(EMPTY)
            + EMPTY
        )
        reply = b"".join(iter(lambda: raw.recv(4096), b""))
    assert reply.startswith(b"HTTP/1.1 403 ") and reply.count(b"HTTP/1.1 ") == 1, reply


# --- the owner's sockets -----------------------------------------------------------------------


def test_the_owners_own_socket_is_served(serve) -> None:
    import os

    server = serve(owner_uid=os.getuid())
    assert ask(server, "POST", "/decode", EMPTY).json() == {"payloads": []}


# --- CORS ---------------------------------------------------------------------------------------


def test_the_ui_origins_are_the_embedded_servers_under_both_loopback_names() -> None:
    assert ui_origins() == ("http://127.0.0.1:8233", "http://localhost:8233")
    assert ui_origins(9000) == ("http://127.0.0.1:9000", "http://localhost:9000")


def test_a_preflight_names_what_the_ui_may_send_and_for_how_long(serve) -> None:
    server = serve()
    answer = ask(server, "OPTIONS", "/decode", Origin=UI)
    assert answer.status == 204 and answer.body == b""
    assert answer.headers["Content-Length"] == "0"
    assert answer.headers["Access-Control-Allow-Methods"] == "POST, OPTIONS"
    assert answer.headers["Access-Control-Allow-Headers"] == ALLOWED_HEADERS
    assert answer.headers["Access-Control-Max-Age"] == "600"
    assert answer.headers["Access-Control-Allow-Origin"] == UI
    assert answer.headers["Access-Control-Allow-Credentials"] == "true"
    assert answer.headers["Vary"] == "Origin"
    assert "Access-Control-Allow-Private-Network" not in answer.headers
    private = ask(server, "OPTIONS", "/decode", Origin=UI, Access_Control_Request_Private_Network="true")
    assert private.headers["Access-Control-Allow-Private-Network"] == "true"
    plain = ask(server, "OPTIONS", "/decode")  # no Origin: nothing to allow, nothing refused
    assert plain.status == 204 and "Access-Control-Allow-Origin" not in plain.headers


def test_a_refused_origin_is_told_which_are_allowed(serve) -> None:
    server = serve(origins=["http://b.example/", "http://a.example", "http://BOX"])
    assert server.origins == frozenset(
        {"http://a.example", "http://b.example", "http://BOX"}
    )  # one slash cut
    answer = ask(server, "POST", "/decode", EMPTY, Origin="http://c.example")
    assert answer.status == 403
    assert answer.json() == {
        "error": "origin http://c.example is not allowed; allowed: http://BOX, http://a.example, http://b.example"
    }
    assert ask(server, "POST", "/decode", EMPTY, Origin="http://b.example").status == 200


def test_any_origin_when_told_so(serve) -> None:
    server = serve(origins=["*"])
    answer = ask(server, "POST", "/decode", EMPTY, Origin="http://anywhere.example")
    assert answer.status == 200
    assert answer.headers["Access-Control-Allow-Origin"] == "http://anywhere.example"


def header_names(server: CodecServer, request: bytes) -> list[str]:
    """The header names of the answer to a raw request, as they are on the wire."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as raw:
        raw.sendall(request)
        reply = b"".join(iter(lambda: raw.recv(4096), b""))
    lines = reply.partition(b"\r\n\r\n")[0].decode().split("\r\n")[1:]
    return [line.partition(":")[0] for line in lines]


def test_answers_spell_their_header_names_as_http_does(serve) -> None:
    """Header names are case-insensitive to a reader, but what this server writes is spelled
    one way: the usual one, which a log or a capture of the wire shows."""
    server = serve(path_secret=SECRET, pages=True, token="t0k")
    host = b"Host: 127.0.0.1\r\nConnection: close\r\n"
    preflight = header_names(
        server,
        b"OPTIONS /%s/decode HTTP/1.1\r\n%sOrigin: %s\r\n" % (SECRET.encode(), host, UI.encode())
        + b"Access-Control-Request-Private-Network: true\r\n\r\n",
    )
    assert preflight == [
        "Server",
        "Date",
        "Content-Length",
        "Access-Control-Allow-Origin",
        "Access-Control-Allow-Credentials",
        "Vary",
        "Access-Control-Allow-Methods",
        "Access-Control-Allow-Headers",
        "Access-Control-Max-Age",
        "Access-Control-Allow-Private-Network",
    ]
    refused = header_names(
        server, b"POST /%s/decode HTTP/1.1\r\n%sContent-Length: 2\r\n\r\n{}" % (SECRET.encode(), host)
    )
    assert refused == ["Server", "Date", "Content-Type", "Content-Length", "WWW-Authenticate", "Connection"]
    wrong = header_names(server, b"GET /%s/decode HTTP/1.1\r\n%s\r\n" % (SECRET.encode(), host))
    assert wrong == ["Server", "Date", "Content-Type", "Content-Length", "Allow", "Connection"]
    link = ask(server, "POST", f"/{SECRET}/login-token", b"{}", Authorization="Bearer t0k").json()["url"]
    path = link.removeprefix(f"http://127.0.0.1:{server.port}").encode()
    login = header_names(server, b"GET %s HTTP/1.1\r\n%s\r\n" % (path, host))
    assert login == [
        "Server",
        "Date",
        "Location",
        "Set-Cookie",
        "Content-Length",
        "Cache-Control",
        "Referrer-Policy",
    ]
    page = header_names(server, b"GET /%s/episodes HTTP/1.1\r\n%s\r\n" % (SECRET.encode(), host))
    assert page[:4] == ["Server", "Date", "Content-Type", "Content-Length"]
    assert set(SECURITY_HEADERS) <= set(page)


# --- the token ---------------------------------------------------------------------------------


def test_an_empty_token_is_no_token(serve) -> None:
    server = serve(token="")
    assert server.token is None
    assert ask(server, "POST", "/decode", EMPTY).status == 200


def test_a_token_is_asked_for_with_its_realm(serve) -> None:
    server = serve(token="t0k")
    refused = ask(server, "POST", "/decode", EMPTY, Authorization="Bearer t0")
    assert refused.status == 401
    assert refused.json() == {"error": "this codec server needs Authorization: Bearer <token>"}
    assert refused.headers["WWW-Authenticate"] == 'Bearer realm="drlm codec server"'
    assert ask(server, "POST", "/decode", EMPTY, Authorization="Bearer t0k").status == 200


# --- paths, methods, bodies ---------------------------------------------------------------------


def test_get_answers_the_service_and_refuses_the_actions_and_other_paths(serve) -> None:
    server = serve()
    for path in ("/decode", "/default/encode/"):
        wrong = ask(server, "GET", path)
        assert (wrong.status, wrong.json()) == (405, {"error": "use POST"})
        assert wrong.headers["Allow"] == "POST, OPTIONS"
    missing = ask(server, "GET", "/decoder")
    assert (missing.status, missing.json()) == (
        404,
        {"error": "no endpoint /decoder: use POST /decode or POST /encode"},
    )
    assert ask(server, "POST", "/decodeX", EMPTY).status == 404  # the action is the whole last segment
    assert ask(server, "POST", "/x/y", EMPTY).json() == {
        "error": "no endpoint /x/y: use POST /decode or POST /encode"
    }


def test_a_post_needs_a_body_of_a_known_length_within_the_limit(serve) -> None:
    server = serve()
    for headers, status, error in (
        ({}, 411, "a request body with Content-Length is required"),
        ({"Content_Length": "-1"}, 411, "a request body with Content-Length is required"),
        (
            {"Content_Length": str(MAX_BODY + 1)},
            413,
            f"the body is {MAX_BODY + 1:,} bytes; at most {MAX_BODY:,} are read",
        ),
    ):
        answer = ask(server, "POST", "/decode", None, **headers)
        assert (answer.status, answer.json()) == (status, {"error": error}), headers
        assert answer.headers["Connection"] == "close"
    exact = EMPTY + b" " * (MAX_BODY - len(EMPTY))  # exactly the limit: read
    assert ask(server, "POST", "/decode", exact).status == 200


def test_an_answer_is_json_with_its_length_and_keeps_the_connection(serve) -> None:
    server = serve()
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        for _ in range(2):  # one connection, two requests: HTTP/1.1 keep-alive
            connection.request("POST", "/decode", EMPTY, {"Content-Type": "application/json"})
            response = connection.getresponse()
            body = response.read()
            assert response.status == 200 and body == EMPTY
            assert response.getheader("Content-Type") == "application/json"
            assert response.getheader("Content-Length") == str(len(body))
            assert response.getheader("Connection") is None
            assert response.getheader("Server").startswith("drlm-codec-server")
    finally:
        connection.close()


def test_a_failure_inside_a_request_is_a_500_in_one_line(
    serve, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="durable_rlm.viewer.codec_requests")
    deep = tmp_path / ("a" * 120) / ("b" * 120) / ("c" * 120)  # an error message past 300 characters
    deep.mkdir(parents=True)
    broken = BlobStore(DirectoryBackend(deep / "gone"))
    shutil.rmtree(deep / "gone")
    (deep / "gone").write_text("a file where the blob store's folder was")
    server = serve(blobs=broken, threshold=0)
    body = json.dumps({"payloads": [payload_json(b'"x"', encoding=b"json/plain")]}).encode()
    answer = ask(server, "POST", "/encode", body)
    assert answer.status == 500
    error = answer.json()["error"]
    head = "internal error: NotADirectoryError: [Errno 20] Not a directory: "
    assert error.startswith(head) and "\n" not in error, error
    assert len(error) == len("internal error: NotADirectoryError: ") + 300  # cut at 300
    logged = [r for r in caplog.records if r.exc_info]
    assert [r.getMessage() for r in logged] == ["codec server: /encode failed"]


def test_requests_are_logged_at_debug_level(serve, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="durable_rlm.viewer.codec_requests")
    server = serve()
    ask(server, "GET", "/")
    assert any(r.getMessage().startswith('codec server: "GET / HTTP/1.1" 200') for r in caplog.records)


# --- the episode pages -------------------------------------------------------------------------


def test_the_pages_are_served_below_the_capability_with_their_security_headers(serve) -> None:
    server = serve(path_secret=SECRET, pages=True)
    page = ask(server, "GET", f"/{SECRET}/episodes?status=running")
    assert page.status == 200 and page.headers["Content-Type"] == "text/html; charset=utf-8"
    assert page.headers["Content-Length"] == str(len(page.body))
    for key, value in SECURITY_HEADERS.items():
        assert page.headers[key] == value
    assert f'action="/{SECRET}/episodes"'.encode() in page.body  # its links keep the capability
    lease = ask(server, "GET", f"/{SECRET}/episodes/lease")
    assert lease.headers["Content-Type"] == "application/json" and "lease_s" in lease.json()
    # Without pages, the same path is no endpoint of the codec server.
    plain = serve(path_secret=SECRET)
    assert ask(plain, "GET", f"/{SECRET}/episodes").status == 404


def test_a_pages_action_needs_a_small_json_body_from_the_page_itself(
    serve, caplog: pytest.LogCaptureFixture
) -> None:
    server = serve(path_secret=SECRET, pages=True)
    path = f"/{SECRET}/episodes/ep-1/act/hint"
    origin = f"http://127.0.0.1:{server.port}"
    for headers, status in (
        ({}, 411),
        ({"Content_Length": "x"}, 413),
        ({"Content_Length": str(64 * 1024 + 1)}, 413),
    ):
        answer = ask(server, "POST", path, None, Origin=origin, **headers)
        assert (answer.status, answer.json()) == (status, {"error": "a JSON body of at most 64 KB"}), headers
    refused = ask(
        server, "POST", path, b"{}", Origin="http://elsewhere.example", Content_Type="application/json"
    )
    assert refused.status == 403 and "from the episode page itself" in refused.json()["error"]
    # From the page: the action runs, and without a Temporal server it fails in one line
    # (the traceback goes to the log). A body of exactly 64 KB is read.
    caplog.set_level(logging.ERROR, logger="durable_rlm.viewer.codec_requests")
    whole = b'{"text": "' + b"x" * (64 * 1024 - 12) + b'"}'
    assert len(whole) == 64 * 1024
    for body in (b'{"text": "hi"}', whole):
        failed = ask(server, "POST", path, body, Origin=origin, Content_Type="application/json")
        assert failed.status == 500
        assert failed.json() == {"error": "internal error: LookupError: the Temporal server is not up yet"}
        assert failed.headers["Connection"] == "close"
    logged = [r for r in caplog.records if r.exc_info]
    assert [r.getMessage() for r in logged] == ["episode page: /episodes/ep-1/act/hint failed"] * 2
    # The body read is the one the action gets: a list is no form.
    listed = ask(server, "POST", path, b"[1]", Origin=origin, Content_Type="application/json")
    assert (listed.status, listed.json()) == (400, {"error": "the body is a JSON object"})


@pytest.mark.parametrize(("message", "shown"), [("y" * 400 + "\nthe rest", "y" * 300), ("", "")])
def test_a_pages_failure_is_shown_as_its_first_line_cut_at_300(serve, message: str, shown: str) -> None:
    def address() -> str | None:
        raise RuntimeError(message)

    server = serve(path_secret=SECRET, pages=True, address=address)
    failed = ask(
        server,
        "POST",
        f"/{SECRET}/episodes/ep-1/act/hint",
        b'{"text": "hi"}',
        Origin=f"http://127.0.0.1:{server.port}",
        Content_Type="application/json",
    )
    assert (failed.status, failed.json()) == (500, {"error": f"internal error: RuntimeError: {shown}"})


def test_the_login_link_opens_a_page_under_a_session_with_no_capability_in_its_links(serve) -> None:
    server = serve(path_secret=SECRET, pages=True)
    link = ask(server, "POST", f"/{SECRET}/login-token", b"{}").json()["url"]
    opened = ask(server, "GET", link.removeprefix(f"http://127.0.0.1:{server.port}"))
    page = ask(server, "GET", "/episodes", Cookie=opened.headers["Set-Cookie"].split(";")[0])
    assert page.status == 200 and SECRET.encode() not in page.body
    assert b'action="/episodes"' in page.body


# --- the server itself -----------------------------------------------------------------------------


def test_a_port_taken_is_a_configuration_error_that_names_it(store: BlobStore) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigurationError) as refused:
            CodecServer(store, port=port)
    assert str(refused.value) == f"the codec server cannot listen on 127.0.0.1:{port}: Address already in use"


def test_the_hosts_a_server_answers_to(store: BlobStore) -> None:
    server = CodecServer(store, allowed_hosts=["Drlm.Internal"])
    try:
        assert server.hosts == frozenset({"127.0.0.1", "localhost", "::1", "drlm.internal"})
    finally:
        server.stop()


def test_a_server_used_as_a_context_serves_inside_and_stops_after(store: BlobStore) -> None:
    with CodecServer(store) as server:
        assert ask(server, "POST", "/decode", EMPTY).status == 200
        port = server.port
        # Its thread is named for a stack dump, and a daemon: it never holds the process open.
        assert [t.daemon for t in threading.enumerate() if t.name == "codec-server"] == [True]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_a_server_stopped_before_it_served_stops_at_once(store: BlobStore) -> None:
    CodecServer(store).stop()  # never started: nothing to wait for
    server = CodecServer(store).start()
    server.stop()
    server.stop()  # twice is harmless
