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
import json
import ssl
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
from relay.upstream.oauth import FormGrant, OAuthConfig, TokenError, TokenProvider
from relay.upstream.oauth_libraries import (
    EntraClient,
    EntraCredential,
    EntraManagedIdentity,
    GoogleServiceAccount,
    load_certificate,
    load_service_account,
)

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
        if self.rotate_refresh:  # each refresh token is good once; the reply names the next
            return self._token(refresh_token=f"rt-{self.issued + 2}")
        return self._token()

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get(f"/{TENANT}/v2.0/.well-known/openid-configuration", self._discovery)
        app.router.add_post(f"/{TENANT}/oauth2/v2.0/token", self._entra)
        app.router.add_get("/msi/token", self._managed_identity)
        app.router.add_post("/google/token", self._google)
        app.router.add_post("/generic/token", self._generic)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ca.issue_cert("127.0.0.1").configure_cert(context)
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=context)
        await site.start()
        server = site._server
        assert isinstance(server, asyncio.base_events.Server) and server.sockets
        self.port = server.sockets[0].getsockname()[1]

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
    assert [p.name for p in await asyncio.to_thread(lambda: list(tmp_path.iterdir()))
            if p.name.startswith(".refresh")] == []


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
