"""The OAuth2 token sources of the ``oauth`` extra against a loopback HTTPS identity provider
(aiohttp, a trustme CA) that checks what a real one checks: msal's client-credentials grant
with a client secret, a certificate (the client assertion's signature verified with the
certificate's key) and a federated token (read again for each fetch); msal's managed identity
(the App Service endpoint, its secret header); google-auth's service account (the JWT
assertion verified with the key's public half, for the delegated mailbox). Also the generic
grant keeping a refresh token the endpoint rotated, and the settings building each source."""

from __future__ import annotations

import asyncio
import datetime
import errno
import json
import logging
import os
import socket
import stat
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jwt
import pytest
import trustme
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from relay.settings import Settings
from relay.upstream import oauth
from relay.upstream.oauth import FormGrant, OAuthConfig, TokenError, TokenProvider
from relay.upstream.oauth_libraries import (
    EntraClient,
    EntraCredential,
    EntraManagedIdentity,
    GoogleServiceAccount,
    load_certificate,
    load_service_account,
)
from tests.support.oauth import serve_https

TENANT = "contoso"
CLIENT = "11111111-2222-3333-4444-555555555555"
SCOPE = "https://outlook.office365.com/.default"
MAILBOX = "relay@example.com"
JWT_BEARER = "urn:ietf:params:oauth:client-assertion-type:jwt-bearer"


@dataclass
class IdentityProvider:
    """Entra's discovery and token endpoints, an App Service managed identity endpoint and a
    Google token endpoint on https://127.0.0.1:``port``. ``client_secret``: the secret it
    takes; ``client_key``: the public key a client assertion must verify with; ``federated``:
    the federated tokens it takes; ``google_key``: the service account's public key."""

    ca: trustme.CA
    ca_file: Path
    client_secret: str = "s3cret"
    client_key: Any = None
    federated: set[str] = field(default_factory=set)
    google_key: Any = None
    identity_header: str = "msi-secret"
    port: int = 0
    requests: list[dict[str, str]] = field(default_factory=list)
    issued: int = 0
    rotate_refresh: bool = False
    refresh_in_force: str | None = None  # with rotate_refresh: the one refresh token it takes
    reply_delay_s: float = 0.0  # a rotating reply waits this long, the rotation done
    replying: asyncio.Event = field(default_factory=asyncio.Event)
    _runner: web.AppRunner | None = None

    @property
    def base(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def entra_token_url(self) -> str:
        return f"{self.base}/{TENANT}/oauth2/v2.0/token"

    def _token(self, **extra: Any) -> web.Response:
        self.issued += 1
        return web.json_response({"access_token": f"at-{self.issued}", "token_type": "Bearer",
                                  "expires_in": 3600, **extra})

    @staticmethod
    def _refused(why: str) -> web.Response:
        return web.json_response({"error": "invalid_client", "error_description": why},
                                 status=401)

    async def _discovery(self, request: web.Request) -> web.Response:
        base = f"{self.base}/{TENANT}"
        return web.json_response({
            "issuer": f"{base}/v2.0", "token_endpoint": f"{base}/oauth2/v2.0/token",
            "authorization_endpoint": f"{base}/oauth2/v2.0/authorize"})

    async def _entra(self, request: web.Request) -> web.Response:
        form = {k: str(v) for k, v in (await request.post()).items()}
        self.requests.append(form)
        if form.get("grant_type") != "client_credentials" or form.get("client_id") != CLIENT:
            return self._refused("grant")
        if "client_secret" in form:
            return (self._token() if form["client_secret"] == self.client_secret
                    else self._refused("secret"))
        if form.get("client_assertion_type") != JWT_BEARER:
            return self._refused("no credential")
        assertion = form["client_assertion"]
        if assertion in self.federated:
            return self._token()
        if self.client_key is None:
            return self._refused("assertion")
        try:
            claims = jwt.decode(assertion, self.client_key, algorithms=["RS256", "PS256"],
                                audience=self.entra_token_url)
        except jwt.PyJWTError as exc:
            return self._refused(f"assertion: {exc}")
        if claims.get("iss") != CLIENT or claims.get("sub") != CLIENT:
            return self._refused("assertion claims")
        return self._token()

    async def _managed_identity(self, request: web.Request) -> web.Response:
        self.requests.append(dict(request.query))
        if request.headers.get("X-IDENTITY-HEADER") != self.identity_header:
            return web.json_response({"error": "unauthorized"}, status=401)
        self.issued += 1
        return web.json_response({
            "access_token": f"at-{self.issued}", "expires_on": str(int(time.time()) + 3600),
            "resource": request.query.get("resource"), "token_type": "Bearer"})

    async def _google(self, request: web.Request) -> web.Response:
        form = {k: str(v) for k, v in (await request.post()).items()}
        self.requests.append(form)
        if form.get("grant_type") != "urn:ietf:params:oauth:grant-type:jwt-bearer":
            return self._refused("grant")
        try:
            claims = jwt.decode(form["assertion"], self.google_key, algorithms=["RS256"],
                                # google-auth's audience, whatever the key's token_uri
                                audience="https://oauth2.googleapis.com/token")
        except jwt.PyJWTError as exc:
            return self._refused(f"assertion: {exc}")
        self.requests[-1] = {**form, **{f"claim:{k}": str(v) for k, v in claims.items()}}
        return self._token()

    async def _generic(self, request: web.Request) -> web.Response:
        form = {k: str(v) for k, v in (await request.post()).items()}
        self.requests.append(form)
        if form.get("grant_type") != "refresh_token" or not form.get(
                "refresh_token", "").startswith("rt-"):
            return self._refused("refresh token")
        if not self.rotate_refresh:
            return self._token()
        # each refresh token is good once: the reply names the next, the old one is revoked
        if self.refresh_in_force not in (None, form["refresh_token"]):
            return web.json_response({"error": "invalid_grant"}, status=400)
        self.refresh_in_force = f"rt-{self.issued + 2}"
        reply = self._token(refresh_token=self.refresh_in_force)
        self.replying.set()
        await asyncio.sleep(self.reply_delay_s)  # rotated here already, whatever the client does
        return reply

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get(f"/{TENANT}/v2.0/.well-known/openid-configuration", self._discovery)
        app.router.add_post(f"/{TENANT}/oauth2/v2.0/token", self._entra)
        app.router.add_get("/msi/token", self._managed_identity)
        app.router.add_post("/google/token", self._google)
        app.router.add_post("/generic/token", self._generic)
        self._runner, self.port = await serve_https(app, self.ca)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def idp(tmp_path: Path) -> AsyncIterator[IdentityProvider]:
    ca = trustme.CA()
    ca_file = tmp_path / "idp-ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    served = IdentityProvider(ca=ca, ca_file=ca_file)
    await served.start()
    yield served
    await served.stop()


def rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def pem_key(key: rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def app_certificate(folder: Path) -> tuple[Path, rsa.RSAPrivateKey]:
    """A self-signed app registration certificate and its key in one PEM file."""
    key = rsa_key()
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "relay-app")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    path = folder / "entra-app.pem"
    path.write_bytes(pem_key(key) + cert.public_bytes(serialization.Encoding.PEM))
    return path, key


def entra(idp: IdentityProvider, credential: EntraCredential) -> TokenProvider:
    return TokenProvider(EntraClient(token_url=idp.entra_token_url, client_id=CLIENT,
                                     credential=credential, scope=SCOPE, ca_file=idp.ca_file,
                                     timeout_s=5.0))


async def test_entra_client_secret(idp: IdentityProvider) -> None:
    tokens = entra(idp, EntraCredential(client_secret="s3cret"))
    assert await tokens.token() == "at-1"
    assert await tokens.token() == "at-1"  # the relay's cache: one fetch
    assert tokens.fetches == 1 and len(idp.requests) == 1
    assert idp.requests[0]["scope"].split() == [SCOPE]


async def test_entra_wrong_secret_is_a_token_error_without_the_secret(
        idp: IdentityProvider, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(TokenError, match="refused"):
        await entra(idp, EntraCredential(client_secret="wrong-secret")).token()
    assert "wrong-secret" not in caplog.text and "invalid_client" in caplog.text


async def test_entra_certificate_signs_a_client_assertion_the_idp_verifies(
        idp: IdentityProvider, tmp_path: Path) -> None:
    path, key = app_certificate(tmp_path)
    idp.client_key = key.public_key()
    tokens = entra(idp, EntraCredential(certificate=load_certificate(path)))
    assert await tokens.token() == "at-1"
    assert "client_secret" not in idp.requests[0]
    header = jwt.get_unverified_header(idp.requests[0]["client_assertion"])
    assert "x5c" in header  # the certificate travels with the assertion (subject/issuer auth)


async def test_entra_certificate_of_another_key_is_refused(
        idp: IdentityProvider, tmp_path: Path) -> None:
    path, _ = app_certificate(tmp_path)
    idp.client_key = rsa_key().public_key()  # the app registration holds another certificate
    with pytest.raises(TokenError):
        await entra(idp, EntraCredential(certificate=load_certificate(path))).token()


def test_a_certificate_file_without_its_key_is_refused(tmp_path: Path) -> None:
    path, _ = app_certificate(tmp_path)
    cert_only = tmp_path / "cert-only.pem"
    text = path.read_text()
    cert_only.write_text(text[text.index("-----BEGIN CERTIFICATE"):])
    with pytest.raises(ValueError, match="no unencrypted PEM private key"):
        load_certificate(cert_only)
    other = tmp_path / "mismatch.pem"
    other.write_bytes(pem_key(rsa_key()) + text[text.index("-----BEGIN CERTIFICATE"):].encode())
    with pytest.raises(ValueError, match="not the certificate's"):
        load_certificate(other)


async def test_entra_workload_identity_reads_the_federated_token_for_each_fetch(
        idp: IdentityProvider, tmp_path: Path) -> None:
    """Kubernetes rotates the projected token in place: a fetch after the rotation sends the
    new one."""
    token_file = tmp_path / "azure-identity-token"
    token_file.write_text("federated-1\n")
    idp.federated = {"federated-1", "federated-2"}
    tokens = entra(idp, EntraCredential(federated_token_file=token_file))
    assert await tokens.token() == "at-1"
    token_file.write_text("federated-2\n")
    tokens.invalidate("at-1")  # the smarthost refused it: fetched again
    await tokens.token()
    assert [r["client_assertion"] for r in idp.requests] == ["federated-1", "federated-2"]


async def test_managed_identity_on_app_service(idp: IdentityProvider,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IDENTITY_ENDPOINT", f"{idp.base}/msi/token")
    monkeypatch.setenv("IDENTITY_HEADER", idp.identity_header)
    tokens = TokenProvider(EntraManagedIdentity(identity="system", scope=SCOPE,
                                                ca_file=idp.ca_file, timeout_s=5.0))
    assert await tokens.token() == "at-1"
    assert idp.requests[0]["resource"] == "https://outlook.office365.com"
    user = TokenProvider(EntraManagedIdentity(identity=CLIENT, scope=SCOPE,
                                              ca_file=idp.ca_file, timeout_s=5.0))
    await user.token()
    assert idp.requests[1]["client_id"] == CLIENT


async def test_managed_identity_refused_is_a_token_error(
        idp: IdentityProvider, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IDENTITY_ENDPOINT", f"{idp.base}/msi/token")
    monkeypatch.setenv("IDENTITY_HEADER", "not-the-header")
    with pytest.raises(TokenError):
        await TokenProvider(EntraManagedIdentity(identity="system", scope=SCOPE,
                                                 ca_file=idp.ca_file, timeout_s=5.0)).token()


def service_account_file(folder: Path, idp: IdentityProvider) -> Path:
    key = rsa_key()
    idp.google_key = key.public_key()
    path = folder / "google-sa.json"
    path.write_text(json.dumps({
        "type": "service_account", "project_id": "p", "private_key_id": "k1",
        "private_key": pem_key(key).decode(), "client_email": "relay@p.iam.gserviceaccount.com",
        "client_id": "1", "token_uri": f"{idp.base}/google/token"}))
    return path


async def test_google_service_account_token_for_the_mailbox(
        idp: IdentityProvider, tmp_path: Path) -> None:
    info = load_service_account(service_account_file(tmp_path, idp))
    tokens = TokenProvider(GoogleServiceAccount(info=info, subject=MAILBOX,
                                                scope="https://mail.google.com/",
                                                ca_file=idp.ca_file, timeout_s=5.0))
    assert await tokens.token() == "at-1"
    claims = idp.requests[0]
    assert claims["claim:sub"] == MAILBOX  # domain-wide delegation: the mailbox's token
    assert claims["claim:scope"] == "https://mail.google.com/"
    assert claims["claim:iss"] == "relay@p.iam.gserviceaccount.com"


def test_a_service_account_file_that_is_not_one_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "sa.json"
    path.write_text(json.dumps({"type": "authorized_user", "refresh_token": "x"}))
    with pytest.raises(ValueError, match="not a service account key"):
        load_service_account(path)
    path.write_text(json.dumps({"type": "service_account", "client_email": "a@b",
                                "token_uri": "https://t", "private_key": "garbage"}))
    with pytest.raises(ValueError, match="private key does not load"):
        load_service_account(path)


async def test_a_rotated_refresh_token_is_kept_and_written_back(
        idp: IdentityProvider, tmp_path: Path) -> None:
    """An endpoint that rotates refresh tokens revokes the old one: the next refresh uses the
    new one, and the file holds it for the next start."""
    idp.rotate_refresh = True
    refresh_file = tmp_path / "refresh-token"
    refresh_file.write_text("rt-0\n")
    refresh_file.chmod(0o600)
    tokens = TokenProvider(FormGrant(OAuthConfig(
        token_url=f"{idp.base}/generic/token", client_id="c", refresh_token="rt-0",
        ca_file=idp.ca_file, timeout_s=5.0, refresh_token_file=refresh_file)))
    assert await tokens.token() == "at-1"
    tokens.invalidate("at-1")
    assert await tokens.token() == "at-2"
    assert [r["refresh_token"] for r in idp.requests] == ["rt-0", "rt-2"]
    assert refresh_file.read_text().strip() == "rt-3"
    assert refresh_file.stat().st_mode & 0o777 == 0o600
    # no temporary file left; the workers' lock file stays
    assert [p.name for p in await asyncio.to_thread(lambda: list(tmp_path.iterdir()))
            if p.name.startswith(".refresh")] == [".refresh-token.lock"]


def refresh_grant(idp: IdentityProvider, refresh_file: Path,
                  timeout_s: float = 5.0) -> TokenProvider:
    """One worker's token provider over the refresh token in ``refresh_file``, as the
    settings build it (the token read from the file once, at start)."""
    return TokenProvider(FormGrant(OAuthConfig(
        token_url=f"{idp.base}/generic/token", client_id="c",
        refresh_token=refresh_file.read_text().strip(), ca_file=idp.ca_file,
        timeout_s=timeout_s, refresh_token_file=refresh_file)))


def held(refresh_file: Path) -> str:
    """The refresh token ``refresh_file`` holds."""
    return refresh_file.read_text().strip()


@pytest.fixture
def rotating(idp: IdentityProvider, tmp_path: Path) -> Path:
    """The identity provider rotates refresh tokens; the file holding the first one."""
    idp.rotate_refresh = True
    refresh_file = tmp_path / "refresh-token"
    refresh_file.write_text("rt-0\n")
    return refresh_file


async def test_a_worker_refreshes_with_the_token_another_worker_rotated(
        idp: IdentityProvider, rotating: Path) -> None:
    """Two workers started with the same refresh token: once one has rotated it (the
    endpoint revoking the old one), the other's next refresh sends the new one."""
    first, second = refresh_grant(idp, rotating), refresh_grant(idp, rotating)
    assert await first.token() == "at-1"
    assert await second.token() == "at-2"
    first.invalidate("at-1")
    assert await first.token() == "at-3"
    sent = [r["refresh_token"] for r in idp.requests]
    assert sent == ["rt-0", "rt-2", "rt-3"], sent
    assert held(rotating) == idp.refresh_in_force


async def test_workers_refreshing_at_once_take_turns(
        idp: IdentityProvider, rotating: Path) -> None:
    """Four workers fetching at the same moment: the file's lock lets one refresh at a time,
    each with the token the one before it wrote; none is refused."""
    idp.reply_delay_s = 0.1
    workers = [refresh_grant(idp, rotating) for _ in range(4)]
    tokens = await asyncio.gather(*(w.token() for w in workers))
    assert sorted(tokens) == ["at-1", "at-2", "at-3", "at-4"]
    assert [r["refresh_token"] for r in idp.requests] == ["rt-0", "rt-2", "rt-3", "rt-4"]


async def test_a_queue_of_refreshes_longer_than_one_timeout_is_waited_out(
        idp: IdentityProvider, rotating: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight workers queued on the lock behind an endpoint that takes 0.5 s each: the last
    waits at least 3.5 s (the endpoint's sleeps alone), past one request's timeout (3 s, no
    margin here), yet each holder kept the lock within it (2.5 s to spare for a loaded
    runner), so none gives up."""
    monkeypatch.setattr(oauth, "_LOCK_MARGIN_S", 0.0)
    idp.reply_delay_s = 0.5
    workers = [refresh_grant(idp, rotating, timeout_s=3.0) for _ in range(8)]
    tokens = await asyncio.gather(*(w.token() for w in workers))
    assert len(set(tokens)) == 8 and len(idp.requests) == 8


async def test_a_stop_cutting_the_write_back_lets_the_lock_go_only_once_written(
        idp: IdentityProvider, rotating: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stop's bound cancels a refresh while its rotated token is being written (a slow
    disk): the lock is held until the file holds it, so the next worker refreshes with it."""
    real_write = oauth._write_secret

    def slow_write(path: Path, value: str) -> None:
        time.sleep(0.5)
        real_write(path, value)

    monkeypatch.setattr(oauth, "_write_secret", slow_write)
    first, second = refresh_grant(idp, rotating), refresh_grant(idp, rotating)
    fetching = asyncio.create_task(first.token())
    await asyncio.wait_for(idp.replying.wait(), 5)
    await asyncio.sleep(0.1)  # the reply read, the write under way
    await first.close(timeout_s=0.05)
    with pytest.raises(asyncio.CancelledError):
        await fetching
    assert await second.token() == "at-2"
    assert [r["refresh_token"] for r in idp.requests] == ["rt-0", "rt-2"]


async def test_a_folder_that_cannot_sync_leaves_the_rotation_kept(
        idp: IdentityProvider, rotating: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A filesystem whose folders refuse fsync (EINVAL): the rename holds the new token, so it
    is a WARNING, not the ERROR that says a restart would read the old one."""
    real_fsync = os.fsync

    def no_folder_sync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "Invalid argument")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", no_folder_sync)
    tokens = refresh_grant(idp, rotating)
    with caplog.at_level(logging.INFO):
        assert await tokens.token() == "at-1"
    assert held(rotating) == "rt-2"
    assert "not synced" in caplog.text and "could not be written" not in caplog.text


async def test_a_refresh_cut_after_the_rotation_still_keeps_the_new_token(
        idp: IdentityProvider, rotating: Path) -> None:
    """The caller is cancelled (a shutdown's cut) once the endpoint has rotated the token but
    before its reply arrived: the fetch runs on, the provider's close waits for it, and the
    file holds the new token."""
    idp.reply_delay_s = 0.5
    tokens = refresh_grant(idp, rotating)
    caller = asyncio.create_task(tokens.token())
    await asyncio.wait_for(idp.replying.wait(), 5)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await tokens.close(timeout_s=5.0)
    assert held(rotating) == "rt-2" == idp.refresh_in_force


async def test_a_rotated_token_is_written_through_a_symbolic_link(
        idp: IdentityProvider, tmp_path: Path) -> None:
    """The configured file is a link to the secret: the link stays, its target gets the
    rotated token."""
    idp.rotate_refresh = True
    (tmp_path / "secrets").mkdir()
    target = tmp_path / "secrets" / "refresh-token"
    target.write_text("rt-0\n")
    link = tmp_path / "refresh-token"
    link.symlink_to(target)
    assert await refresh_grant(idp, link).token() == "at-1"
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text().strip() == "rt-2"


def google_tokens(folder: Path, idp: IdentityProvider, port: int) -> TokenProvider:
    """A service account's token provider whose token endpoint is https://127.0.0.1:``port``,
    each request bounded by 0.5 s."""
    info = {**load_service_account(service_account_file(folder, idp)),
            "token_uri": f"https://127.0.0.1:{port}/token"}
    return TokenProvider(GoogleServiceAccount(info=info, subject=MAILBOX,
                                              scope="https://mail.google.com/",
                                              ca_file=idp.ca_file, timeout_s=0.5))


async def unreachable_within(tokens: TokenProvider, bound_s: float) -> None:
    """``tokens.token()`` fails ``unreachable`` within ``bound_s`` seconds."""
    started = time.monotonic()
    with pytest.raises(TokenError, match="unreachable"):
        await asyncio.wait_for(tokens.token(), 30)
    assert time.monotonic() - started < bound_s


async def test_a_token_reply_that_trickles_is_unreachable_after_the_fetch_deadline(
        tmp_path: Path, idp: IdentityProvider) -> None:
    """An endpoint that sends its reply a byte every 0.2 s never trips a 0.5 s read timeout;
    the whole fetch is bounded (twice the timeout) all the same."""
    finished = asyncio.Event()

    async def trickle(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        for byte in b'{"access_token": "never-finished", "expires_in": 3600}' * 4:
            if finished.is_set():
                break
            await response.write(bytes([byte]))
            await asyncio.sleep(0.2)
        return response

    app = web.Application()
    app.router.add_post("/token", trickle)
    runner, port = await serve_https(app, idp.ca)
    try:
        await unreachable_within(google_tokens(tmp_path, idp, port), 3)
    finally:
        finished.set()
        await asyncio.sleep(0.5)  # the reply ends; the abandoned fetch's thread reads its end
        await runner.cleanup()


async def test_a_token_endpoint_that_never_answers_is_unreachable_after_the_timeout(
        tmp_path: Path, idp: IdentityProvider) -> None:
    """google-auth asks with its own 120 s timeout; the relay's bound wins: a token endpoint
    that accepts and never answers is ``unreachable`` after ``timeout_s``."""
    silent = socket.create_server(("127.0.0.1", 0))
    try:
        await unreachable_within(google_tokens(tmp_path, idp, silent.getsockname()[1]), 10)
    finally:
        silent.close()


def settings(**values: Any) -> Settings:
    common: dict[str, Any] = {"upstream": "smtp.example.com:587", "upstream_auth": "xoauth2",
                              "upstream_user": MAILBOX}
    return Settings(**common, **values)


async def test_the_settings_build_each_provider(idp: IdentityProvider, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``oauth_provider`` and its credential reach the right source, which fetches."""
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    cert, key = app_certificate(tmp_path)
    idp.client_key = key.public_key()
    common = {"oauth_token_url": idp.entra_token_url, "oauth_client_id": CLIENT,
              "oauth_ca_file": idp.ca_file}
    monkeypatch.setenv("IDENTITY_ENDPOINT", f"{idp.base}/msi/token")
    monkeypatch.setenv("IDENTITY_HEADER", idp.identity_header)
    built = [
        settings(oauth_provider="microsoft", oauth_client_secret_file=secret, **common),
        settings(oauth_provider="microsoft", oauth_certificate_file=cert, **common),
        settings(oauth_provider="microsoft", oauth_managed_identity="system",
                 oauth_ca_file=idp.ca_file),
        settings(oauth_provider="google", oauth_ca_file=idp.ca_file,
                 oauth_service_account_file=service_account_file(tmp_path, idp)),
    ]
    for number, each in enumerate(built, start=1):
        tokens = each.smarthost_tokens()
        assert tokens is not None
        assert await tokens.token() == f"at-{number}", each.oauth_provider
