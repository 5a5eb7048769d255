"""Smarthost AUTH XOAUTH2 / OAUTHBEARER with an OAuth2 token provider, a private CA and a client
certificate: the SMTP upstream against a real aiosmtpd smarthost that takes only
tokens a real loopback HTTPS token endpoint (aiohttp, trustme CA) issued."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trustme
from aiohttp import web
from aiosmtpd.smtp import SMTP

from relay.core.interfaces import DeliveryResult, OutboundMessage, RcptStatus
from relay.upstream.oauth import FormGrant, OAuthConfig, TokenError, TokenProvider
from relay.upstream.smtp import SmtpUpstream, SmtpUpstreamConfig
from tests.support.clients import message
from tests.support.oauth import (
    OAuthSinkHandler,
    TokenEndpoint,
    oauth_smtp,
    server_tls,
    start_token_endpoint,
    write_client_cert,
)
from tests.support.sink import SinkHandler

pytestmark = pytest.mark.timeout(30)

MAILBOX = "mailbox@example.com"
SECRET = "s3cret-client-secret"
REFRESH = "1//refresh-token-value"


@dataclass
class Smarthost:
    handler: SinkHandler
    port: int


@contextlib.asynccontextmanager
async def smarthost(handler: SinkHandler, tls: ssl.SSLContext | None = None,
                    *, oauth: bool = True, starttls: bool = False) -> AsyncIterator[Smarthost]:
    """Serve ``handler`` on 127.0.0.1:0 (implicit TLS with ``tls``, or STARTTLS required
    with ``starttls``); AUTH required when ``oauth``."""
    loop = asyncio.get_running_loop()

    def factory() -> SMTP:
        if oauth:
            assert isinstance(handler, OAuthSinkHandler)
            return oauth_smtp(handler)
        if starttls:
            return SMTP(handler, hostname="sink.test", tls_context=tls, require_starttls=True)
        return SMTP(handler, hostname="sink.test")

    server = await loop.create_server(factory, host="127.0.0.1", port=0,
                                      ssl=None if starttls else tls)
    try:
        yield Smarthost(handler, server.sockets[0].getsockname()[1])
    finally:
        server.close()


@pytest.fixture
async def endpoint(tmp_path: Path) -> AsyncIterator[TokenEndpoint]:
    served = await start_token_endpoint(tmp_path)
    yield served
    await served.stop()


def provider(endpoint: TokenEndpoint, *, refresh: bool = False,
             clock: Callable[[], float] | None = None) -> TokenProvider:
    config = OAuthConfig(
        token_url=endpoint.url, client_id="client-1", client_secret=SECRET,
        refresh_token=REFRESH if refresh else None, scope="https://outlook.office365.com/.default",
        ca_file=endpoint.ca_file, timeout_s=5.0)
    return TokenProvider(FormGrant(config), clock=clock or time.monotonic)


def upstream(port: int, tokens: TokenProvider | None, *, auth: str = "xoauth2",
             user: str = MAILBOX, **extra: Any) -> SmtpUpstream:
    return SmtpUpstream(config=SmtpUpstreamConfig(
        host="127.0.0.1", port=port, local_hostname="relay.test", auth=auth,
        token_provider=tokens, username=user or None, connect_timeout_s=5.0, command_timeout_s=5.0,
        final_timeout_s=5.0, pool_size=0, **extra))


def outbound(key: str = "K-1") -> OutboundMessage:
    return OutboundMessage(mail_from="app@example.com", rcpt_tos=["user@example.net"],
                           content=message(key))


def reply_of(result: DeliveryResult) -> str:
    (only,) = result.recipients.values()
    return f"{only.reply.code} {only.reply.text}" if only.status is not RcptStatus.ACCEPTED \
        else "accepted"


async def test_one_token_fetch_serves_many_messages_sent_at_once(
        endpoint: TokenEndpoint) -> None:
    """Five messages at once, each on its own new connection (pool size 0): five AUTHs, one
    token request (the concurrent ones waited for the same fetch)."""
    handler = OAuthSinkHandler(endpoint=endpoint)
    async with smarthost(handler) as host:
        up = upstream(host.port, provider(endpoint))
        results = await asyncio.gather(*(up.deliver(outbound(f"K-{i}")) for i in range(5)))
        await up.close()
    assert [reply_of(r) for r in results] == ["accepted"] * 5
    assert endpoint.fetches == 1
    assert handler.verdicts == [235] * 5 and len(handler.delivered) == 5


async def test_an_expired_token_is_fetched_again(endpoint: TokenEndpoint) -> None:
    """A token is kept until expires_in less the margin (a tenth of its life, at most 60 s),
    then fetched again."""
    now = [1000.0]
    endpoint.expires_in = 100.0
    tokens = provider(endpoint, clock=lambda: now[0])
    handler = OAuthSinkHandler(endpoint=endpoint)
    async with smarthost(handler) as host:
        up = upstream(host.port, tokens)
        assert reply_of(await up.deliver(outbound("K-1"))) == "accepted"
        now[0] += 89.0  # within 100 s less 10 s
        assert reply_of(await up.deliver(outbound("K-2"))) == "accepted"
        assert endpoint.fetches == 1
        now[0] += 2.0  # past it
        assert reply_of(await up.deliver(outbound("K-3"))) == "accepted"
        await up.close()
    assert endpoint.fetches == 2
    assert [s.split(b"Bearer ")[1] for s in handler.initial_responses] == [
        b"tok-1\x01\x01", b"tok-1\x01\x01", b"tok-2\x01\x01"]


@pytest.mark.parametrize("auth", ["xoauth2", "oauthbearer"])
async def test_a_refused_token_is_fetched_once_more_and_the_message_goes(
        endpoint: TokenEndpoint, auth: str) -> None:
    """The smarthost forgot the cached token: 535 (XOAUTH2) or the RFC 7628 error challenge
    then 535 (OAUTHBEARER); the token is dropped, one new one fetched, AUTH runs again on a
    new connection and the message is delivered once."""
    handler = OAuthSinkHandler(endpoint=endpoint)
    async with smarthost(handler) as host:
        up = upstream(host.port, provider(endpoint), auth=auth)
        assert reply_of(await up.deliver(outbound("K-1"))) == "accepted"
        endpoint.revoke_all()
        assert reply_of(await up.deliver(outbound("K-2"))) == "accepted"
        await up.close()
    assert handler.verdicts == [235, 535, 235]
    assert endpoint.fetches == 2
    assert len(handler.delivered) == 2 and handler.transactions == 2


async def test_a_token_refused_twice_is_451_and_no_loop(endpoint: TokenEndpoint) -> None:
    """A smarthost that refuses every token (the mailbox is not the token's): one retry with
    a fresh token, then 451 4.7.0; no MAIL was sent. The fresh token is kept, so the next
    message costs one token request, not two."""
    handler = OAuthSinkHandler(endpoint=endpoint)
    async with smarthost(handler) as host:
        up = upstream(host.port, provider(endpoint), user="someone-else@example.com")
        result = await up.deliver(outbound())
        assert endpoint.fetches == 2 and handler.verdicts == [535, 535]
        again = await up.deliver(outbound())  # the fresh token was kept: one more fetch
        await up.close()
    assert reply_of(result) == reply_of(again) == (
        "451 4.7.0 Relay cannot authenticate to its upstream")
    assert endpoint.fetches == 3 and handler.verdicts == [535] * 4
    assert handler.transactions == 0


async def test_token_endpoint_down_is_451_then_delivered_once_back(
        endpoint: TokenEndpoint) -> None:
    """The endpoint unreachable: 451 4.7.0 naming it, nothing relayed; once it answers again
    the retry is delivered."""
    handler = OAuthSinkHandler(endpoint=endpoint)
    async with smarthost(handler) as host:
        up = upstream(host.port, provider(endpoint))
        await endpoint.stop()
        down = await up.deliver(outbound())
        assert reply_of(down) == ("451 4.7.0 Relay cannot get an OAuth2 token for its upstream "
                                  "(token endpoint unreachable), try again later")
        assert handler.transactions == 0 and not handler.delivered
        await endpoint.start()
        assert reply_of(await up.deliver(outbound())) == "accepted"
        await up.close()
    assert len(handler.delivered) == 1


@pytest.mark.parametrize(("status", "raw", "says"), [
    (401, None, "token endpoint refused, HTTP 401"),
    (200, b"<html>not json</html>", "token endpoint reply malformed"),
    (200, b'{"token_type": "Bearer", "expires_in": 3600}', "token endpoint reply malformed"),
    (200, b'{"access_token": "t", "expires_in": 0}', "token endpoint reply malformed"),
    (200, b'{"access_token": "t", "expires_in": -5}', "token endpoint reply malformed"),
    (200, b'{"access_token": "t", "expires_in": "inf"}', "token endpoint reply malformed"),
    (200, b'{"access_token": "t", "expires_in": Infinity}', "token endpoint reply malformed"),
    (200, b'{"access_token": "t", "expires_in": NaN}', "token endpoint reply malformed"),
    (200, b'{"access_token": "t", "expires_in": 1e400}', "token endpoint reply malformed"),
    (200, b'{"access_token": "' + b"x" * 70000 + b'"}', "token endpoint reply too large"),
    # nested past the JSON parser's recursion limit, within the size bound
    (200, b"[" * 30000 + b"]" * 30000, "token endpoint reply malformed"),
    (400, b'{"error": ' + b"[" * 30000 + b"]" * 30000 + b"}", "token endpoint refused, HTTP 400"),
])
async def test_a_refusing_or_malformed_token_endpoint_is_451_without_the_secret_logged(
        endpoint: TokenEndpoint, caplog: pytest.LogCaptureFixture, status: int,
        raw: bytes | None, says: str) -> None:
    endpoint.status, endpoint.raw = status, raw
    handler = OAuthSinkHandler(endpoint=endpoint)
    with caplog.at_level(logging.DEBUG):
        async with smarthost(handler) as host:
            up = upstream(host.port, provider(endpoint, refresh=True))
            result = await up.deliver(outbound())
            await up.close()
    assert reply_of(result).startswith("451 4.7.0 Relay cannot get an OAuth2 token")
    assert says in reply_of(result)
    assert handler.transactions == 0
    assert SECRET not in caplog.text and REFRESH not in caplog.text
    assert "token endpoint" in caplog.text


async def test_an_error_text_with_terminal_escapes_is_logged_shortened_and_escaped(
        endpoint: TokenEndpoint, caplog: pytest.LogCaptureFixture) -> None:
    """An error reply whose ``error_description`` holds terminal escapes and 10 KB: the
    ERROR line shows them as ``\\x1b`` and stays short."""
    endpoint.status, endpoint.raw = 400, json.dumps({
        "error": "invalid_grant",
        "error_description": "\x1b[2J\x1b]0;pwned\x07\x9b" + "d" * 10_000}).encode()
    with pytest.raises(TokenError, match="refused, HTTP 400"):
        await provider(endpoint).token()
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert "invalid_grant: \\x1b[2J\\x1b]0;pwned\\x07\\x9b" in line
    assert not any(ch in line for ch in "\x1b\x07\x9b") and len(line) < 500, line


async def test_a_redirect_from_the_token_endpoint_is_not_followed(
        endpoint: TokenEndpoint, caplog: pytest.LogCaptureFixture) -> None:
    """A 307 to another (plain http) endpoint: no request reaches it, the secret is sent
    once, and the fetch fails naming the redirect."""
    elsewhere: list[str] = []

    async def collect(request: web.Request) -> web.Response:
        elsewhere.append(await request.text())
        return web.json_response({"access_token": "stolen", "token_type": "Bearer"})

    app = web.Application()
    app.router.add_post("/token", collect)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    endpoint.redirect_to = f"http://127.0.0.1:{port}/token"
    try:
        with pytest.raises(TokenError, match="redirected, HTTP 307"):
            await provider(endpoint).token()
    finally:
        await runner.cleanup()
    assert elsewhere == []
    assert endpoint.fetches == 1
    assert "not followed" in caplog.text and SECRET not in caplog.text


async def test_a_token_reply_without_end_is_refused_after_the_bound(
        endpoint: TokenEndpoint) -> None:
    """A 200 that streams 400 MB without a Content-Length is refused once 64 KiB are read;
    the endpoint never gets to write it all."""
    endpoint.stream_bytes = 400 * 1024 * 1024
    with pytest.raises(TokenError, match="too large"):
        await provider(endpoint).token()
    assert endpoint.streamed < 64 * 1024 * 1024


async def test_client_credentials_grant_form(endpoint: TokenEndpoint) -> None:
    """Microsoft 365 / Entra: grant_type=client_credentials with the client id, secret and
    scope, form-encoded (RFC 6749 section 4.4.2)."""
    await provider(endpoint).token()
    assert endpoint.forms == [{
        "grant_type": "client_credentials", "client_id": "client-1", "client_secret": SECRET,
        "scope": "https://outlook.office365.com/.default"}]


async def test_refresh_token_grant_form(endpoint: TokenEndpoint) -> None:
    """Google: grant_type=refresh_token with the refresh token, client id and secret
    (RFC 6749 section 6)."""
    assert await provider(endpoint, refresh=True).token() == "tok-1"
    assert endpoint.forms == [{
        "grant_type": "refresh_token", "client_id": "client-1", "client_secret": SECRET,
        "refresh_token": REFRESH, "scope": "https://outlook.office365.com/.default"}]


async def test_the_token_endpoint_is_verified_against_its_ca(
        endpoint: TokenEndpoint, tmp_path: Path) -> None:
    """Without the endpoint's CA (the system's CAs do not know it) no token is fetched."""
    config = OAuthConfig(token_url=endpoint.url, client_id="c", client_secret=SECRET)
    with pytest.raises(TokenError, match="unreachable"):
        await TokenProvider(FormGrant(config)).token()
    assert endpoint.fetches == 0


async def test_xoauth2_and_oauthbearer_strings(endpoint: TokenEndpoint) -> None:
    """XOAUTH2: user=U^Aauth=Bearer T^A^A; OAUTHBEARER (RFC 7628 3.1):
    n,a=U,^Ahost=H^Aport=P^Aauth=Bearer T^A^A."""
    handler = OAuthSinkHandler(endpoint=endpoint)
    async with smarthost(handler) as host:
        tokens = provider(endpoint)
        for auth in ("xoauth2", "oauthbearer"):
            up = upstream(host.port, tokens, auth=auth)
            assert reply_of(await up.deliver(outbound(auth))) == "accepted"
            await up.close()
    assert handler.initial_responses == [
        b"user=mailbox@example.com\x01auth=Bearer tok-1\x01\x01",
        b"n,a=mailbox@example.com,\x01host=127.0.0.1\x01port=%d\x01auth=Bearer tok-1\x01\x01"
        % host.port]


@pytest.mark.parametrize("tls", ["tls", "starttls"])
async def test_upstream_ca_file_verifies_a_private_ca(tmp_path: Path, tls: str) -> None:
    """A smarthost (implicit TLS, or STARTTLS) with a certificate of a private CA: verified
    with upstream_ca_file; without it the handshake fails (451 4.4.1) and nothing is sent."""
    ca = trustme.CA()
    ca_file = tmp_path / "private-ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    handler = SinkHandler()
    async with smarthost(handler, server_tls(ca), oauth=False,
                         starttls=tls == "starttls") as host:
        without = upstream(host.port, None, auth="password", user="", tls=tls)
        refused = await without.deliver(outbound("K-1"))
        with_ca = upstream(host.port, None, auth="password", user="", tls=tls, ca_file=ca_file)
        accepted = await with_ca.deliver(outbound("K-2"))
        await with_ca.close()
    assert reply_of(refused).startswith("451 4.4.1")
    assert reply_of(accepted) == "accepted"
    assert len(handler.delivered) == 1


async def test_a_client_certificate_the_smarthost_requires(tmp_path: Path) -> None:
    """The smarthost requires a client certificate of its client CA (CERT_REQUIRED): with
    upstream_client_cert/key delivered, without it refused with nothing sent."""
    ca, client_ca = trustme.CA(), trustme.CA()
    ca_file = tmp_path / "private-ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    cert, key = write_client_cert(client_ca, tmp_path)
    handler = SinkHandler()
    async with smarthost(handler, server_tls(ca, client_ca=client_ca), oauth=False) as host:
        without = upstream(host.port, None, auth="password", user="", tls="tls", ca_file=ca_file)
        refused = await without.deliver(outbound("K-1"))
        with_cert = upstream(host.port, None, auth="password", user="", tls="tls", ca_file=ca_file,
                             client_cert=cert, client_key=key)
        accepted = await with_cert.deliver(outbound("K-2"))
        await with_cert.close()
    assert reply_of(refused).startswith("451 4.4.")
    assert reply_of(accepted) == "accepted"
    assert len(handler.delivered) == 1
