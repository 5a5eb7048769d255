"""OAuth2 parts of the tests: a loopback HTTPS token endpoint (aiohttp, a trustme CA) that
counts requests and issues short-lived tokens, and an aiosmtpd smarthost that takes AUTH
XOAUTH2 / OAUTHBEARER only with a token the endpoint issued and that has not expired."""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path

import trustme
from aiohttp import web
from aiosmtpd.smtp import SMTP, AuthResult, Envelope, Session

from tests.support.sink import SinkHandler

TOKEN_PATH = "/oauth2/v2.0/token"


async def serve_https(app: web.Application, ca: trustme.CA,
                      port: int = 0) -> tuple[web.AppRunner, int]:
    """Serve ``app`` over HTTPS on 127.0.0.1:``port`` (0: a free one) with a certificate of
    ``ca``; its runner (``cleanup()`` closes the port) and the port."""
    runner = web.AppRunner(app)
    await runner.setup()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    site = web.TCPSite(runner, "127.0.0.1", port, ssl_context=context)
    await site.start()
    server = site._server
    assert isinstance(server, asyncio.base_events.Server) and server.sockets
    return runner, server.sockets[0].getsockname()[1]


@dataclass
class TokenEndpoint:
    """An OAuth2 token endpoint on https://127.0.0.1:``port``/oauth2/v2.0/token.

    Every POST is counted (``forms`` holds each request's form fields); it answers
    ``{"access_token": "tok-N", "token_type": "Bearer", "expires_in": expires_in}``, or
    ``status`` with an error object when ``status`` is not 200, or ``raw`` as the body when
    set; ``redirect_to`` answers 307 there, ``stream_bytes`` streams a body that long. :meth:`stop`
    closes the port (unreachable), :meth:`start` opens it again.

    With ``rotate``, a refresh-token grant is answered with a new refresh token and the one
    sent is spent; a spent one sent again (reuse detection, RFC 9700 section 4.14.2) revokes
    the whole family (``family_revoked``): every later refresh is ``invalid_grant``.
    """

    ca: trustme.CA
    ca_file: Path
    expires_in: float = 3600.0
    status: int = 200
    raw: bytes | None = None
    redirect_to: str | None = None  # answer 307 with this Location instead of a token
    stream_bytes: int = 0  # answer 200 with this many bytes, chunked (no Content-Length)
    streamed: int = 0  # bytes of that stream written before the client went away
    port: int = 0
    forms: list[dict[str, str]] = field(default_factory=list)
    issued: dict[str, float] = field(default_factory=dict)  # token -> time.time() it expires
    rotate: bool = False
    refresh_in_force: str | None = None  # with rotate: the one refresh token taken (None: any)
    spent: set[str] = field(default_factory=set)
    family_revoked: bool = False
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}{TOKEN_PATH}"

    @property
    def fetches(self) -> int:
        return len(self.forms)

    def valid(self, token: str) -> bool:
        """Whether ``token`` was issued here and has not expired (nor been revoked)."""
        return time.time() < self.issued.get(token, 0.0)

    def revoke_all(self) -> None:
        """Every token issued so far stops being valid (a smarthost that forgot them)."""
        self.issued.clear()

    async def _token(self, request: web.Request) -> web.StreamResponse:
        form = await request.post()
        self.forms.append({k: str(v) for k, v in form.items()})
        if self.redirect_to is not None:
            raise web.HTTPTemporaryRedirect(self.redirect_to)
        if self.stream_bytes:
            return await self._stream(request)
        if self.raw is not None:
            return web.Response(body=self.raw, status=self.status,
                                content_type="application/json")
        if self.status != 200:
            return web.json_response(
                {"error": "invalid_client", "error_description": "no such client"},
                status=self.status)
        token = f"tok-{len(self.forms)}"
        reply: dict[str, object] = {"access_token": token, "token_type": "Bearer",
                                    "expires_in": self.expires_in}
        if self.rotate and form.get("grant_type") == "refresh_token":
            sent = str(form.get("refresh_token"))
            if sent in self.spent or self.family_revoked:
                self.family_revoked = True
                return web.json_response({"error": "invalid_grant"}, status=400)
            if self.refresh_in_force not in (None, sent):
                return web.json_response({"error": "invalid_grant"}, status=400)
            self.spent.add(sent)
            self.refresh_in_force = reply["refresh_token"] = f"rt-{len(self.forms)}"
        self.issued[token] = time.time() + self.expires_in
        return web.json_response(reply)

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        """``stream_bytes`` of a JSON string, chunked, counting what was written."""
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        chunk = b"x" * 65536
        try:
            while self.streamed < self.stream_bytes:
                await response.write(chunk)
                self.streamed += len(chunk)
            await response.write_eof()
        except (ConnectionError, RuntimeError):
            pass  # the client stopped reading and closed
        return response

    async def start(self) -> None:
        """Serve (on the same port when it served before)."""
        app = web.Application()
        app.router.add_post(TOKEN_PATH, self._token)
        self._runner, self.port = await serve_https(app, self.ca, self.port)

    async def stop(self) -> None:
        """Close the port: requests then fail to connect."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


async def start_token_endpoint(folder: Path, *, expires_in: float = 3600.0) -> TokenEndpoint:
    """A TokenEndpoint with a new trustme CA, its PEM in ``folder``/oauth-ca.pem."""
    ca = trustme.CA()
    ca_file = folder / "oauth-ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    endpoint = TokenEndpoint(ca=ca, ca_file=ca_file, expires_in=expires_in)
    await endpoint.start()
    return endpoint


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@dataclass
class OAuthSinkHandler(SinkHandler):
    """The sink's handler that also takes AUTH XOAUTH2 and OAUTHBEARER for ``user`` with a
    token ``endpoint`` issued and that is still valid; a bad token gets 535 (XOAUTH2) or the
    RFC 7628 error challenge, then 535 (OAUTHBEARER); MAIL before AUTH gets 530.
    ``initial_responses`` holds every decoded initial response, ``verdicts`` every AUTH
    outcome code."""

    endpoint: TokenEndpoint | None = None
    user: str = "mailbox@example.com"
    initial_responses: list[bytes] = field(default_factory=list)
    verdicts: list[int] = field(default_factory=list)

    async def handle_MAIL(self, server: SMTP, session: Session, envelope: Envelope,
                          address: str, options: list[str]) -> str:
        if not session.authenticated:
            return "530 5.7.0 Authentication required"
        return await super().handle_MAIL(server, session, envelope, address, options)

    def _check(self, blob: str) -> bytes | None:
        try:
            decoded = base64.b64decode(blob, validate=True)
        except ValueError:
            return None
        self.initial_responses.append(decoded)
        return decoded

    def _token_ok(self, token: str) -> bool:
        return self.endpoint is not None and self.endpoint.valid(token)

    async def auth_XOAUTH2(self, server: SMTP, args: list[str]) -> AuthResult:
        decoded = self._check(args[1]) if len(args) == 2 else None
        fields = dict(p.split("=", 1) for p in (decoded or b"").decode().split("\x01") if p)
        if (fields.get("user") == self.user and fields.get("auth", "").startswith("Bearer ")
                and self._token_ok(fields["auth"][len("Bearer "):])):
            self.verdicts.append(235)
            return AuthResult(success=True)
        self.verdicts.append(535)
        return AuthResult(success=False, handled=False,
                          message="535 5.7.8 Username and Password not accepted")

    async def auth_OAUTHBEARER(self, server: SMTP, args: list[str]) -> AuthResult:
        decoded = self._check(args[1]) if len(args) == 2 else None
        gs2, _, rest = (decoded or b"").decode().partition("\x01")
        fields = dict(p.split("=", 1) for p in rest.split("\x01") if p)
        if (gs2 == f"n,a={self.user}," and fields.get("auth", "").startswith("Bearer ")
                and self._token_ok(fields["auth"][len("Bearer "):])):
            self.verdicts.append(235)
            return AuthResult(success=True)
        error = json.dumps({"status": "invalid_token", "schemes": "bearer"})
        await server.challenge_auth(error)  # RFC 7628 3.2.2: the client answers ^A (or empty)
        self.verdicts.append(535)
        return AuthResult(success=False, handled=False, message="535 5.7.8 invalid token")


def oauth_smtp(handler: OAuthSinkHandler, tls: ssl.SSLContext | None = None) -> SMTP:
    """An aiosmtpd server that offers AUTH XOAUTH2 and OAUTHBEARER only (MAIL needs it:
    :meth:`OAuthSinkHandler.handle_MAIL`)."""
    return SMTP(handler, hostname="oauth-sink.test", auth_require_tls=False,
                auth_exclude_mechanism=["LOGIN", "PLAIN"], data_size_limit=10 * 1024 * 1024)


def server_tls(ca: trustme.CA, *, client_ca: trustme.CA | None = None) -> ssl.SSLContext:
    """An implicit-TLS server context with a certificate of ``ca`` for 127.0.0.1; with
    ``client_ca``, a client certificate signed by it is required."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1", "localhost").configure_cert(context)
    if client_ca is not None:
        context.verify_mode = ssl.CERT_REQUIRED
        client_ca.configure_trust(context)
    return context


def write_client_cert(client_ca: trustme.CA, folder: Path) -> tuple[Path, Path]:
    """A client certificate of ``client_ca`` and its key as PEM files in ``folder``."""
    issued = client_ca.issue_cert("relay.test")
    cert, key = folder / "client-cert.pem", folder / "client-key.pem"
    issued.cert_chain_pems[0].write_to_path(str(cert))
    issued.private_key_pem.write_to_path(str(key))
    return cert, key
