"""OAuth2 smarthost AUTH through a real relay process: `serve --upstream-auth
xoauth2 --oauth-token-url https://127.0.0.1:P/...` against a loopback HTTPS token endpoint
(aiohttp, trustme CA) and an aiosmtpd smarthost that takes only the tokens it issued; the
shared test Redis under a random prefix; the settings rules and unusable files (exit 78)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trustme
from cryptography.hazmat.primitives import serialization

from tests.support.cli import run_cli
from tests.support.clients import message, send
from tests.support.oauth import (
    OAuthSinkHandler,
    TokenEndpoint,
    oauth_smtp,
    server_tls,
    start_token_endpoint,
    write_client_cert,
)
from tests.support.relays import REDIS_URL, ServeProcess, delete_prefix, start_serve

pytestmark = pytest.mark.timeout(60)

MAILBOX = "mailbox@example.com"


@pytest.fixture
async def endpoint(tmp_path: Path) -> AsyncIterator[TokenEndpoint]:
    served = await start_token_endpoint(tmp_path)
    yield served
    await served.stop()


@pytest.fixture
async def smarthost(endpoint: TokenEndpoint) -> AsyncIterator[tuple[OAuthSinkHandler, int]]:
    handler = OAuthSinkHandler(endpoint=endpoint, user=MAILBOX)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: oauth_smtp(handler), host="127.0.0.1", port=0)
    yield handler, server.sockets[0].getsockname()[1]
    server.close()


async def _serve(tmp_path: Path, endpoint: TokenEndpoint, port: int,
                 *extra: str) -> AsyncIterator[ServeProcess]:
    secret = tmp_path / "client-secret"
    secret.write_text("s3cret\n")
    prefix = f"test:{uuid.uuid4().hex}:"
    relay = await start_serve(
        tmp_path, "--upstream", f"127.0.0.1:{port}", "--store", REDIS_URL,
        "--store-prefix", prefix, "--settle-journal", str(tmp_path / "owed.jsonl"),
        "--metrics-listen", "off", "--upstream-pool-size", "0",
        "--upstream-auth", "xoauth2", "--upstream-user", MAILBOX,
        "--oauth-token-url", endpoint.url, "--oauth-client-id", "client-1",
        "--oauth-client-secret-file", str(secret), "--oauth-ca-file", str(endpoint.ca_file),
        "--oauth-scope", "https://outlook.office365.com/.default", *extra, workers=1)
    try:
        yield relay
    finally:
        relay.stop()
        delete_prefix(REDIS_URL, prefix)


async def test_xoauth2_relay_fetches_one_token_and_refetches_on_535(
        tmp_path: Path, endpoint: TokenEndpoint,
        smarthost: tuple[OAuthSinkHandler, int]) -> None:
    """Three messages (each on a new upstream connection): three AUTH XOAUTH2, one token
    request; the smarthost forgets the token: the next message gets 535 at AUTH, the relay
    fetches one new token and delivers it."""
    handler, port = smarthost
    async for relay in _serve(tmp_path, endpoint, port):
        for key in ("K-1", "K-2", "K-3"):
            assert (await send(relay.port, ["user@example.net"], message(key))).code == 250
        assert endpoint.fetches == 1 and handler.verdicts == [235, 235, 235]
        endpoint.revoke_all()
        assert (await send(relay.port, ["user@example.net"], message("K-4"))).code == 250
    assert endpoint.fetches == 2
    assert handler.verdicts == [235, 235, 235, 535, 235]
    assert len(handler.delivered) == 4
    assert endpoint.forms[0]["grant_type"] == "client_credentials"
    assert endpoint.forms[0]["client_secret"] == "s3cret"


async def test_token_endpoint_down_the_client_gets_451_then_the_retry_goes(
        tmp_path: Path, endpoint: TokenEndpoint,
        smarthost: tuple[OAuthSinkHandler, int]) -> None:
    """The endpoint unreachable: the client gets 451 4.7.0 saying so, nothing is relayed and
    the reservation is released; once it is back the client's retry is delivered once."""
    handler, port = smarthost
    async for relay in _serve(tmp_path, endpoint, port):
        await endpoint.stop()
        down = await send(relay.port, ["user@example.net"], message("K-down"))
        assert down.code == 451 and down.text.startswith("4.7.0 Relay cannot get an OAuth2 "
                                                         "token"), down
        assert "token endpoint unreachable" in down.text
        assert not handler.delivered and handler.transactions == 0
        await endpoint.start()
        assert (await send(relay.port, ["user@example.net"], message("K-down"))).code == 250
    assert len(handler.delivered) == 1
    logged = relay.log_path.read_text()
    assert "s3cret" not in logged


@pytest.mark.parametrize(("args", "says", "flag"), [
    (("--upstream-auth", "xoauth2", "--oauth-token-url", "https://127.0.0.1:1/t",
      "--oauth-client-id", "c", "--oauth-client-secret-file", "{secret}"),
     "needs upstream_user", "--upstream-user"),
    (("--upstream-auth", "oauthbearer", "--upstream-user", MAILBOX, "--oauth-token-url",
      "https://127.0.0.1:1/t", "--oauth-client-id", "c"),
     "oauth_client_secret_file", "--oauth-client-secret-file"),
    (("--oauth-token-url", "http://127.0.0.1:1/t"), "https://", "--oauth-token-url"),
    (("--upstream-ca-file", "{garbage}"), "no PEM CA file", "--upstream-ca-file"),
    (("--oauth-ca-file", "{garbage}"), "no PEM CA file", "--oauth-ca-file"),
    (("--upstream-client-cert", "{cert}"), "go together", "--upstream-client-key"),
    (("--upstream-client-cert", "{cert}", "--upstream-client-key", "{garbage}"),
     "no PEM certificate chain", "--upstream-client-cert"),
    (("--upstream-client-cert", "{cert}", "--upstream-client-key", "{encrypted_key}"),
     "no PEM certificate chain", "--upstream-client-cert"),
    (("--upstream-auth", "xoauth2", "--upstream-user", MAILBOX, "--oauth-token-url",
      "https://127.0.0.1:1/t", "--oauth-client-id", "c", "--oauth-client-secret-file",
      "{empty}"), "is empty", "--oauth-client-secret-file"),
])
def test_unusable_oauth_and_tls_settings_exit_78_naming_them(
        tmp_path: Path, args: tuple[str, ...], says: str, flag: str) -> None:
    """check-config (and serve, which runs the same checks) exit 78 naming the setting."""
    ca = trustme.CA()
    issued = ca.issue_cert("relay.test")
    cert = tmp_path / "client.pem"
    issued.cert_chain_pems[0].write_to_path(str(cert))
    (tmp_path / "garbage.txt").write_text("not PEM\n")
    key = serialization.load_pem_private_key(issued.private_key_pem.bytes(), None)
    (tmp_path / "encrypted.key").write_bytes(key.private_bytes(  # no prompt, no hang: 78
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"passphrase")))
    (tmp_path / "secret").write_text("s3cret\n")
    (tmp_path / "empty").write_text("\n")
    values = {"garbage": str(tmp_path / "garbage.txt"), "cert": str(cert),
              "secret": str(tmp_path / "secret"), "empty": str(tmp_path / "empty"),
              "encrypted_key": str(tmp_path / "encrypted.key")}
    argv = [arg.format(**values) for arg in args]
    result = run_cli("check-config", "--upstream", "127.0.0.1:2525", "--metrics-listen", "off",
                     "--listen", "127.0.0.1:0", *argv, cwd=tmp_path)
    assert result.returncode == 78, result
    assert says in result.stderr and f"{flag}, RELAY_" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


async def test_oauthbearer_over_tls_with_a_private_ca_and_a_client_certificate(
        tmp_path: Path, endpoint: TokenEndpoint) -> None:
    """The whole setup through a real relay: an implicit-TLS smarthost whose certificate a
    private CA signed (upstream_ca_file) and that requires a client certificate
    (upstream_client_cert/key), AUTH OAUTHBEARER with a token of the refresh-token grant."""
    ca = trustme.CA()
    ca_file = tmp_path / "smarthost-ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    cert, key = write_client_cert(ca, tmp_path)
    (tmp_path / "refresh").write_text("1//refresh\n")
    handler = OAuthSinkHandler(endpoint=endpoint, user=MAILBOX)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: oauth_smtp(handler), host="127.0.0.1", port=0,
                                      ssl=server_tls(ca, client_ca=ca))
    port = server.sockets[0].getsockname()[1]
    try:
        async for relay in _serve(  # the later --upstream-auth wins over _serve's xoauth2
                tmp_path, endpoint, port, "--upstream-auth", "oauthbearer",
                "--upstream-tls", "tls", "--upstream-ca-file", str(ca_file),
                "--upstream-client-cert", str(cert), "--upstream-client-key", str(key),
                "--oauth-refresh-token-file", str(tmp_path / "refresh")):
            assert (await send(relay.port, ["user@example.net"], message())).code == 250
    finally:
        server.close()
    assert len(handler.delivered) == 1 and handler.verdicts == [235]
    assert handler.initial_responses[0].startswith(b"n,a=mailbox@example.com,\x01host=")
    assert endpoint.forms[0]["grant_type"] == "refresh_token"
    assert endpoint.forms[0]["refresh_token"] == "1//refresh"
