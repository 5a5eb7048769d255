"""Every HTTP request of the msal and google-auth token sources keeps the generic grant's rules,
against a loopback HTTPS identity provider (aiohttp, a trustme CA) that redirects to plain
http, sends 100 MB replies and error texts with terminal escapes, and a plain-http host that
records whatever reaches it: no redirect is followed (the token POST, msal's discovery
document), a reply is read within 64 KiB (the resident memory of a process fetching a 100 MB
reply stays put), nothing goes to a plain-http endpoint off this machine (a service account
key's ``token_uri``, a managed identity's endpoint), and what an endpoint says is logged
shortened and escaped."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trustme
from aiohttp import web
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from prometheus_client import CollectorRegistry

from relay.ops.metrics import PrometheusMetrics
from relay.upstream.oauth import TOKEN_FAILURES, TokenError, TokenProvider
from relay.upstream.oauth_libraries import (
    EntraClient,
    EntraCredential,
    EntraManagedIdentity,
    GoogleServiceAccount,
    load_service_account,
)
from tests.support.cli import run_cli
from tests.support.oauth import serve_https

pytestmark = pytest.mark.timeout(60)

TENANT = "contoso"
CLIENT = "11111111-2222-3333-4444-555555555555"
SECRET = "s3cret-client-secret"
HUGE = 100 * 1024 * 1024
ESCAPES = "\x1b[2J\x1b]0;pwned\x07"


@dataclass
class HostileIdp:
    """Entra's discovery and token endpoints, Google's token endpoint and an App Service
    managed identity endpoint on https://127.0.0.1:``port``. ``token`` says how the token
    endpoints answer: ``ok``, ``redirect`` (307 to ``location``), ``huge`` (100 MB, chunked),
    ``huge_declared`` (100 MB, its Content-Length said), ``escapes`` (an error whose texts hold
    terminal escapes, 10 KB long); ``discovery`` is ``ok`` or ``redirect``."""

    ca: trustme.CA
    ca_file: Path
    token: str = "ok"
    discovery: str = "ok"
    location: str = ""
    asked: list[str] = field(default_factory=list)
    port: int = 0
    _runner: web.AppRunner | None = None

    @property
    def base(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    async def _discovery(self, request: web.Request) -> web.StreamResponse:
        self.asked.append(request.path)
        if self.discovery == "redirect":
            raise web.HTTPTemporaryRedirect(self.location)
        base = f"{self.base}/{TENANT}"
        return web.json_response({
            "issuer": f"{base}/v2.0", "token_endpoint": f"{base}/oauth2/v2.0/token",
            "authorization_endpoint": f"{base}/oauth2/v2.0/authorize"})

    async def _token(self, request: web.Request) -> web.StreamResponse:
        self.asked.append(request.path)
        await request.read()
        if self.token == "redirect":
            raise web.HTTPTemporaryRedirect(self.location)
        if self.token.startswith("huge"):
            return await self._huge(request, declared=self.token == "huge_declared")
        if self.token == "escapes":
            return web.json_response({"error": ESCAPES + "e" * 10_000,
                                      "error_description": ESCAPES + "d" * 10_000},
                                     status=400)
        return web.json_response({"access_token": "at-1", "token_type": "Bearer",
                                  "expires_in": 3600, "expires_on": "9999999999"})

    async def _huge(self, request: web.Request, *, declared: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        if declared:
            response.content_length = HUGE
        else:
            response.enable_chunked_encoding()
        await response.prepare(request)
        chunk, sent = b'{"access_token": "' + b"x" * 65500, 0
        try:
            while sent < HUGE:
                await response.write(chunk[:HUGE - sent])
                sent += min(len(chunk), HUGE - sent)
            await response.write_eof()
        except (ConnectionError, RuntimeError):
            pass  # the client stopped reading and closed
        return response

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get(f"/{TENANT}/v2.0/.well-known/openid-configuration", self._discovery)
        app.router.add_post(f"/{TENANT}/oauth2/v2.0/token", self._token)
        app.router.add_post("/google/token", self._token)
        app.router.add_get("/msi/token", self._token)
        self._runner, self.port = await serve_https(app, self.ca)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@dataclass
class PlainHttpHost:
    """A plain-http host on loopback that records every request it gets (method, path,
    body) and answers each with a token."""

    received: list[str] = field(default_factory=list)
    port: int = 0
    _runner: web.AppRunner | None = None

    async def _any(self, request: web.Request) -> web.Response:
        self.received.append(f"{request.method} {request.path} {await request.text()}")
        return web.json_response({  # the generic grant's fields and a managed identity's
            "access_token": "from-plain-http", "token_type": "Bearer", "expires_in": 3600,
            "expires_on": str(int(time.time()) + 3600),
            "resource": request.query.get("resource", "")})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._any)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def idp(tmp_path: Path) -> AsyncIterator[HostileIdp]:
    ca = trustme.CA()
    ca_file = tmp_path / "idp-ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    served = HostileIdp(ca=ca, ca_file=ca_file)
    await served.start()
    yield served
    await served.stop()


@pytest.fixture
async def plain() -> AsyncIterator[PlainHttpHost]:
    host = PlainHttpHost()
    await host.start()
    yield host
    await host.stop()


def entra(idp: HostileIdp, metrics: PrometheusMetrics | None = None) -> TokenProvider:
    return TokenProvider(EntraClient(
        token_url=f"{idp.base}/{TENANT}/oauth2/v2.0/token", client_id=CLIENT,
        credential=EntraCredential(client_secret=SECRET),
        scope="https://outlook.office365.com/.default", ca_file=idp.ca_file, timeout_s=5.0),
        on_failure=None if metrics is None else metrics.oauth_token_failure)


def key_file(folder: Path, token_uri: str) -> Path:
    """A service account's JSON key whose ``token_uri`` is ``token_uri``."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    path = folder / "google-sa.json"
    path.write_text(json.dumps({
        "type": "service_account", "project_id": "p", "private_key_id": "k1",
        "private_key": key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()).decode(),
        "client_email": "relay@p.iam.gserviceaccount.com", "client_id": "1",
        "token_uri": token_uri}))
    return path


def google(idp: HostileIdp, folder: Path, token_uri: str | None = None) -> TokenProvider:
    info: dict[str, Any] = {
        **load_service_account(key_file(folder, f"{idp.base}/google/token")),
        **({"token_uri": token_uri} if token_uri else {})}
    return TokenProvider(GoogleServiceAccount(
        info=info, subject="relay@example.com", scope="https://mail.google.com/",
        ca_file=idp.ca_file, timeout_s=5.0))


async def refused(tokens: TokenProvider) -> TokenError:
    with pytest.raises(TokenError) as caught:
        await asyncio.wait_for(tokens.token(), 30)
    return caught.value


async def test_msal_does_not_follow_a_token_redirect_to_plain_http(
        idp: HostileIdp, plain: PlainHttpHost, caplog: pytest.LogCaptureFixture) -> None:
    """The token POST answered 307 to http://: the client secret is not sent there, no token
    is taken from there, the failure is ``redirected`` (and counted so), the ERROR names the
    redirect and not the secret."""
    idp.token, idp.location = "redirect", f"http://127.0.0.1:{plain.port}/steal"
    registry = CollectorRegistry()
    metrics = PrometheusMetrics(registry=registry)
    metrics.declare_token_failures(TOKEN_FAILURES)
    failure = await refused(entra(idp, metrics))
    assert failure.kind == "redirected" and "HTTP 307" in failure.reason
    assert plain.received == []
    assert registry.get_sample_value("relay_oauth_token_failures_total",
                                     {"reason": "redirected"}) == 1
    assert "not followed" in caplog.text and SECRET not in caplog.text


async def test_msal_does_not_follow_a_redirect_of_its_discovery_document(
        idp: HostileIdp, plain: PlainHttpHost) -> None:
    """msal's OpenID discovery document answered 307 to http://: not followed, so no token
    endpoint named by a plain-http host is ever asked."""
    idp.discovery, idp.location = "redirect", f"http://127.0.0.1:{plain.port}/openid"
    assert (await refused(entra(idp))).kind == "redirected"
    assert plain.received == [] and idp.asked == [
        f"/{TENANT}/v2.0/.well-known/openid-configuration"]


async def test_google_auth_does_not_follow_a_token_redirect_to_plain_http(
        idp: HostileIdp, plain: PlainHttpHost, tmp_path: Path) -> None:
    """The JWT-bearer POST answered 307 to http://: the signed assertion is not sent there."""
    idp.token, idp.location = "redirect", f"http://127.0.0.1:{plain.port}/steal"
    assert (await refused(google(idp, tmp_path))).kind == "redirected"
    assert plain.received == []


_PEAK_RSS_OF_A_FETCH = """
import asyncio, json, sys
import google.auth.transport.requests, google.oauth2.service_account, msal, requests
from pathlib import Path
from relay.upstream.oauth import TokenError, TokenProvider
from relay.upstream.oauth_libraries import (
    EntraClient, EntraCredential, GoogleServiceAccount, load_service_account)

def peak() -> int:  # VmHWM: this process's own (getrusage's keeps the parent's from the fork)
    status = Path("/proc/self/status").read_text().splitlines()
    return int(next(line for line in status if line.startswith("VmHWM:")).split()[1]) * 1024

async def main() -> None:
    which, url, ca_file = sys.argv[1:4]
    if which == "entra":
        source = EntraClient(token_url=url, client_id="c",
                             credential=EntraCredential(client_secret="s"), scope="s",
                             ca_file=Path(ca_file), timeout_s=10.0)
    else:
        source = GoogleServiceAccount(info=load_service_account(Path(url)), subject="a@b",
                                      scope="s", ca_file=Path(ca_file), timeout_s=10.0)
    before = peak()
    try:
        await TokenProvider(source).token()
        outcome = "token"
    except TokenError as exc:
        outcome = exc.kind
    print(json.dumps({"outcome": outcome, "before": before, "after": peak()}))

asyncio.run(main())
"""


async def peak_rss_of_a_fetch(which: str, where: str, ca_file: Path) -> dict[str, Any]:
    """Fetch a token (``which``: ``entra`` from the token URL ``where``, ``google`` with the
    key file ``where``) in a new process; its outcome and peak resident memory in bytes before
    and after the fetch (the libraries imported before the first measure)."""
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _PEAK_RSS_OF_A_FETCH, which, where, str(ca_file),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(child.communicate(), 50)
    assert child.returncode == 0, err.decode()
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("which", ["entra", "google"])
@pytest.mark.parametrize("reply", ["huge", "huge_declared"])
async def test_a_100_mb_token_reply_is_refused_and_the_memory_stays_put(
        idp: HostileIdp, tmp_path: Path, which: str, reply: str) -> None:
    """A 100 MB token reply, chunked or with its Content-Length, through msal or google-auth:
    refused ``too_large``, and the peak resident memory of the fetching process grows by less
    than 16 MB (by about twice the reply when requests read it whole)."""
    idp.token = reply
    where = (f"{idp.base}/{TENANT}/oauth2/v2.0/token" if which == "entra"
             else str(key_file(tmp_path, f"{idp.base}/google/token")))
    measured = await peak_rss_of_a_fetch(which, where, idp.ca_file)
    assert measured["outcome"] == "too_large", measured
    assert measured["after"] - measured["before"] < 16 * 1024 * 1024, measured


def test_a_service_account_key_whose_token_uri_is_plain_http_is_refused(
        tmp_path: Path) -> None:
    """The key's ``token_uri`` on http:// off this machine: the key does not load, and
    check-config exits 78 naming the setting and the URL."""
    path = key_file(tmp_path, "http://oauth2.example.com/token")
    with pytest.raises(ValueError, match=re.escape(
            "token_uri http://oauth2.example.com/token: plain http to a host that is not "
            "this machine")):
        load_service_account(path)
    path.chmod(0o600)
    result = run_cli(
        "check-config", "--upstream", "127.0.0.1:2525", "--metrics-listen", "off",
        "--listen", "127.0.0.1:0", "--upstream-auth", "xoauth2",
        "--upstream-user", "relay@example.com", "--oauth-provider", "google",
        "--oauth-service-account-file", str(path), cwd=tmp_path)
    assert result.returncode == 78, result
    assert "http://oauth2.example.com/token" in result.stderr
    assert "--oauth-service-account-file, RELAY_" in result.stderr


async def test_nothing_is_sent_to_a_plain_http_token_uri_off_this_machine(
        idp: HostileIdp, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A key whose ``token_uri`` is http:// (given past its check): the fetch fails
    ``not_https`` at once, without connecting; http:// to loopback is allowed."""
    failure = await refused(google(idp, tmp_path, "http://192.0.2.1/token"))
    assert failure.kind == "not_https"
    assert "http://192.0.2.1/token not asked" in caplog.text


async def test_a_managed_identity_endpoint_on_plain_http_off_this_machine_is_refused(
        idp: HostileIdp, plain: PlainHttpHost, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """App Service's ``IDENTITY_ENDPOINT`` on http:// to loopback is asked; on http:// to
    another host it is refused (``not_https``) and check-config names the variable."""
    monkeypatch.setenv("IDENTITY_HEADER", "h")
    monkeypatch.setenv("IDENTITY_ENDPOINT", f"http://127.0.0.1:{plain.port}/msi/token")
    local = TokenProvider(EntraManagedIdentity(identity="system", scope="s", timeout_s=5.0))
    assert await local.token() == "from-plain-http"
    monkeypatch.setenv("IDENTITY_ENDPOINT", "http://192.0.2.1/msi/token")
    far = TokenProvider(EntraManagedIdentity(identity="system", scope="s", timeout_s=5.0))
    assert (await refused(far)).kind == "not_https"
    result = run_cli(
        "check-config", "--upstream", "127.0.0.1:2525", "--metrics-listen", "off",
        "--listen", "127.0.0.1:0", "--upstream-auth", "xoauth2",
        "--upstream-user", "relay@example.com", "--oauth-provider", "microsoft",
        "--oauth-managed-identity", "system", cwd=tmp_path,
        env={"IDENTITY_ENDPOINT": "http://192.0.2.1/msi/token", "IDENTITY_HEADER": "h"})
    assert result.returncode == 78, result
    assert "IDENTITY_ENDPOINT http://192.0.2.1/msi/token" in result.stderr


async def test_an_error_text_with_terminal_escapes_is_logged_shortened_and_escaped(
        idp: HostileIdp, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """10 KB error texts holding terminal escapes, through msal and google-auth: each ERROR
    line holds none of the escapes (shown as ``\\x1b``) and stays short."""
    idp.token = "escapes"
    assert (await refused(entra(idp))).kind == "refused"
    assert (await refused(google(idp, tmp_path))).kind == "refused"
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(lines) == 2, lines
    for line in lines:
        assert "\x1b" not in line and "\x07" not in line and "\\x1b" in line
        assert len(line) < 1000, len(line)
