"""Who may read the page and codec server: a request that names another host (a DNS-
rebinding page in the owner's browser) gets 421; the capability is on no command line
(not the Temporal server's, not the browser's that `drlm ui --open` starts), which gets a
one-shot token exchanged for a session cookie instead."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from durable_rlm.viewer.codec_requests import host_of
from tests.test_codec_server import call, claim_checked, codec, in_json  # noqa: F401 - the fixture
from tests.test_episode_page import page_base, session
from tests.test_unattended import DRLM, environ

UI = "http://127.0.0.1:8233"


def raw_get(port: int, path: str, host: str | None, method: str = "GET", body: bytes | None = None) -> int:
    """A request with exactly this Host header (None: none at all), as a rebinding page's."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        if host is not None:
            connection.putheader("Host", host)
        if body is not None:
            connection.putheader("Content-Type", "application/json")
            connection.putheader("Content-Length", str(len(body)))
        connection.endheaders(body)
        answer = connection.getresponse()
        answer.read()  # all of it: a connection closed with unread data is reset
        return answer.status
    finally:
        connection.close()


@pytest.mark.parametrize(
    ("header", "host"),
    [
        ("127.0.0.1:8234", "127.0.0.1"),
        ("localhost", "localhost"),
        ("[::1]:80", "::1"),
        ("EVIL.example:1", "evil.example"),
        ("[::1]x]:80", "::1"),  # an address in brackets ends at the first "]"
    ],
)
def test_a_host_header_is_read_without_its_port(header: str, host: str) -> None:
    assert host_of(header) == host


def test_a_request_for_another_host_gets_421_and_nothing_else(codec, blobs) -> None:  # noqa: F811
    secret = "s" * 43
    server = codec(path_secret=secret, allowed_hosts=["drlm.internal"])
    body = json.dumps({"payloads": [in_json(claim_checked(blobs, {"text": "private " * 1000}))]}).encode()
    for path, method, data in (
        (f"/{secret}/decode", "POST", body),
        (f"/{secret}/", "GET", None),
        (f"/{secret}/decode", "OPTIONS", None),
        ("/open?token=x", "GET", None),
    ):
        for host in ("evil.example", f"evil.example:{server.port}", "127.0.0.1.evil.example", "", None):
            assert raw_get(server.port, path, host, method, data) == 421, (path, method, host)
    for host in ("127.0.0.1", f"localhost:{server.port}", "drlm.internal"):
        assert raw_get(server.port, f"/{secret}/decode", host, "POST", body) == 200, host


@pytest.mark.parametrize("secret", ["X" * 43, "x", "-_Xx9"])
def test_a_capability_is_answered_below_it_whatever_its_letters(codec, secret: str) -> None:  # noqa: F811
    server = codec(path_secret=secret)
    assert call(f"{server.url}/", method="GET").json()["service"] == "drlm codec server"
    assert call(f"{server.url}/decode", {"payloads": []}).json() == {"payloads": []}


def whole_reply(port: int, request: bytes) -> bytes:
    """Everything the server sends back to one raw request, until it closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        raw.sendall(request)
        return b"".join(iter(lambda: raw.recv(4096), b""))


def test_a_refused_host_is_answered_once_and_nothing_is_served_after(codec) -> None:  # noqa: F811
    server = codec()
    reply = whole_reply(server.port, b"GET / HTTP/1.1\r\nHost: evil.example\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 421 ") and reply.count(b"HTTP/1.1 ") == 1
    assert b"drlm codec server" not in reply.partition(b"\r\n\r\n")[2]  # no service answer


def test_a_malformed_request_is_answered_by_http_server_alone(
    codec,  # noqa: F811
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A request line http.server refuses (its own 400 or 505) runs no handler of ours: one
    answer, and no handler's traceback in the server's output."""
    server = codec()
    for request in (b"NONSENSE\r\n\r\n", b"GET / HTTP/2.0\r\nHost: 127.0.0.1\r\n\r\n"):
        reply = whole_reply(server.port, request)
        assert reply.count(b"Error code explanation") == 1 and b"421" not in reply, reply
    assert "Traceback" not in capfd.readouterr().err


def test_a_one_shot_login_opens_the_page_once_and_its_cookie_serves_it(codec, blobs) -> None:  # noqa: F811
    secret = "t" * 43
    server = codec(path_secret=secret)
    minted = call(f"{server.url}/login-token", {"next": "/decode"})
    assert minted.status == 200
    link = minted.json()["url"]
    assert secret not in link and link.startswith(f"http://127.0.0.1:{server.port}/open?token=")
    path = link.removeprefix(f"http://127.0.0.1:{server.port}")
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    connection.request("GET", path)
    answer = connection.getresponse()
    answer.read()
    assert answer.status == 303 and answer.getheader("Location") == "/episodes"  # only our own pages
    cookie = answer.getheader("Set-Cookie")
    assert cookie is not None and "HttpOnly" in cookie and "SameSite=Strict" in cookie
    connection.request("GET", path)  # the same link again: used
    again = connection.getresponse()
    again.read()
    assert again.status == 403
    connection.close()
    session_cookie = cookie.split(";")[0]
    body = {"payloads": [in_json(claim_checked(blobs, {"text": "mine " * 1000}))]}
    assert call(f"http://127.0.0.1:{server.port}/decode", body, Cookie=session_cookie).status == 200
    assert call(f"http://127.0.0.1:{server.port}/decode", body).status == 404  # no cookie, no secret
    assert call(f"http://127.0.0.1:{server.port}/login-token", {}, Cookie=session_cookie).status == 404


BROWSER = r"""
import http.cookiejar, json, subprocess, sys, urllib.request
url = sys.argv[1]
ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
opener = urllib.request.build_opener(
    urllib.request.ProxyHandler({}), urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar())
)
with opener.open(url, timeout=30) as page:
    status, text = page.status, page.read().decode()
try:
    opener.open(url, timeout=30)
    second = 200
except urllib.error.HTTPError as error:
    second = error.code
with open(sys.argv[2], "w") as out:
    json.dump({"argv": sys.argv, "ps": ps, "status": status, "text": text, "second": second}, out)
"""


async def test_drlm_ui_open_gives_the_browser_a_one_shot_link_not_the_capability(
    tmp_path: Path, scripted
) -> None:
    server = scripted(lambda request: "FINAL(opened)")
    async with session(tmp_path, server.base_url) as (rlm, services, settings):
        episode_id = f"opened-{uuid.uuid4().hex[:6]}"
        await (await rlm.start("c", "Say opened.", episode_id)).result()
        secret = page_base(settings).rsplit("/", 1)[1]
        browser = tmp_path / "browser.py"
        browser.write_text(BROWSER)
        seen = tmp_path / "seen.json"
        opened = subprocess.run(
            [DRLM, "ui", episode_id, "--open"],
            capture_output=True,
            text=True,
            timeout=120,
            env=environ(
                tmp_path, DRLM_UI="true", BROWSER=f"{sys.executable} {browser} %s {seen}", NO_PROXY="*"
            ),
        )
        assert opened.returncode == 0, opened.stderr
        found = json.loads(seen.read_text())
    assert secret not in " ".join(found["argv"])  # the browser's command line
    assert secret not in found["ps"]  # nor any process's: the Temporal server's included
    assert found["status"] == 200 and episode_id in found["text"] and "opened" in found["text"]
    assert found["second"] == 403  # the link works once
    assert opened.stdout.strip().endswith(f"/{secret}/episodes/{episode_id}")  # printed for its owner only


def test_drlm_run_prints_its_page_and_drlm_ui_opens_ours(tmp_path: Path, scripted) -> None:
    """Our page of the episode, not the Temporal UI's (which calls a cancelled episode
    COMPLETED); `drlm ui` with no id gives our list of episodes."""
    server = scripted(lambda request: "FINAL(paged)")
    episode_id = f"paged-{uuid.uuid4().hex[:6]}"
    env = environ(tmp_path, DRLM_UI="true")
    args = ["run", "t", "--base-url", server.base_url, "--model", "m", "--id", episode_id]
    ran = subprocess.run([DRLM, *args], capture_output=True, text=True, timeout=120, env=env)
    assert ran.returncode == 0, ran.stderr
    (line,) = [line for line in ran.stderr.splitlines() if line.startswith("its page: ")]
    page = line.removeprefix("its page: ")
    assert page.startswith("http://127.0.0.1:") and page.endswith(f"/episodes/{episode_id}")
    listed = subprocess.run([DRLM, "ui"], capture_output=True, text=True, timeout=60, env=env)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.strip() == page.removesuffix(f"/{episode_id}")
    temporal = subprocess.run([DRLM, "ui", "--temporal"], capture_output=True, text=True, timeout=60, env=env)
    assert temporal.stdout.strip().endswith("/namespaces/default/workflows")
