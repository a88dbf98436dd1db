"""The codec and page server's one-shot login tokens and the sessions they open
(durable_rlm/viewer/codec_server.py, `Logins`), without a server: their expiry, their bound
in number, their randomness, and the cookie that carries a session. Through a real server:
tests/test_codec_requests.py."""

from __future__ import annotations

import pytest

from durable_rlm.viewer import codec_server
from durable_rlm.viewer.codec_server import Logins


def test_logins_expire_and_are_bounded_in_number(monkeypatch: pytest.MonkeyPatch) -> None:
    logins = Logins()
    token = logins.mint("/episodes/a")
    assert logins.redeem(token) is not None and logins.redeem(token) is None
    assert logins.redeem("") is None
    monkeypatch.setattr(codec_server, "LOGIN_TOKEN_S", -1.0)
    expired = logins.mint("/episodes")
    assert logins.redeem(expired) is None  # past its time: refused, and gone
    monkeypatch.setattr(codec_server, "LOGIN_TOKEN_S", 60.0)
    monkeypatch.setattr(codec_server, "MAX_LOGINS", 3)
    tokens = [logins.mint("/episodes") for _ in range(5)]
    assert [logins.redeem(t) is not None for t in tokens] == [False, False, True, True, True]
    sessions = [s for _, s in filter(None, (logins.redeem(logins.mint("/episodes")) for _ in range(4)))]
    assert [logins.has_session(f"drlm_9={s}", 9) for s in sessions] == [False, True, True, True]


def test_a_session_cookie_is_the_ports_own() -> None:
    logins = Logins()
    target, session = logins.redeem(logins.mint("/episodes")) or ("", "")
    assert target == "/episodes"
    assert Logins.cookie(8234, session) == f"drlm_8234={session}; Path=/; HttpOnly; SameSite=Strict"
    assert logins.has_session(f"other=1; drlm_8234={session}", 8234)
    assert not logins.has_session(f"drlm_8235={session}", 8234)
    assert not logins.has_session(None, 8234) and not logins.has_session("", 8234)
    assert not logins.has_session('drlm_8234="unterminated', 8234)
    # A header the cookie parser refuses (an illegal name) opens nothing, whatever it carries.
    assert not logins.has_session("drlm_8234=forged; a(b=1", 8234)
    assert not logins.has_session(f"a(b=1; drlm_8234={session}", 8234)


def test_tokens_and_sessions_carry_32_random_bytes() -> None:
    logins = Logins()
    token = logins.mint("/episodes")
    _, session = logins.redeem(token) or ("", "")
    assert len(token) == len(session) == 43  # 32 bytes, URL-safe base64 without padding
    assert token != session


def test_a_token_works_until_its_deadline_and_not_after(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1_000.0]
    monkeypatch.setattr(codec_server.time, "monotonic", lambda: now[0])
    logins = Logins()
    at_the_deadline, after_it = logins.mint("/episodes"), logins.mint("/episodes")
    now[0] += codec_server.LOGIN_TOKEN_S
    assert logins.redeem(at_the_deadline) is not None  # its last instant is still within
    now[0] += 0.001
    assert logins.redeem(after_it) is None
