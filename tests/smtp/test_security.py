"""Listener security on real sockets: client networks, connection limits, sender patterns,
STARTTLS and implicit TLS, AUTH only over TLS, PROXY protocol, and swaks as the client."""

from __future__ import annotations

import asyncio
import base64
import logging
import shutil
import smtplib
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from relay.app import Relay
from relay.core import replies
from tests.support.clients import RawClient, message
from tests.support.pki import Pki, starttls, tls_relay
from tests.support.relays import MakeRelay
from tests.support.sink import Sink

USER, PASSWORD = "user@example.com", "pass"
PLAIN = base64.b64encode(f"\0{USER}\0{PASSWORD}".encode()).decode()


@pytest.fixture(scope="module")
def auth_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A credentials file for user@example.com / pass, written by `dedup-relay hash-password`."""
    result = subprocess.run(
        [sys.executable, "-m", "relay", "hash-password", "--user", USER, "--password-stdin"],
        input=PASSWORD + "\n", capture_output=True, text=True, timeout=60, check=True)
    path = tmp_path_factory.mktemp("auth") / "users"
    path.write_text(result.stdout)
    assert result.stdout.startswith(f"{USER}:$argon2id$")
    assert PASSWORD not in result.stdout
    return path


async def test_client_outside_allowed_networks_is_refused(make_relay: MakeRelay,
                                                          sink: Sink) -> None:
    """A client from 127.0.0.5 is told 421 4.7.0 when only 127.0.0.1/32 may connect."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", allowed_networks="127.0.0.1/32")
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.port,
                                                   local_addr=("127.0.0.5", 0))
    greeting = await asyncio.wait_for(reader.readline(), 5)
    assert greeting.decode().rstrip() == str(replies.CLIENT_NOT_ALLOWED)
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed
    writer.close()
    allowed = await RawClient.connect(relay.port)  # from 127.0.0.1: greeted
    assert (await allowed.cmd("NOOP")).startswith("250")
    await allowed.close()


async def test_connections_per_address_are_limited(make_relay: MakeRelay, sink: Sink) -> None:
    """The third connection from one address gets 421 4.7.0; a freed slot is reusable."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", max_connections_per_ip=2)
    first, second = await RawClient.connect(relay.port), await RawClient.connect(relay.port)
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
    line = await asyncio.wait_for(reader.readline(), 5)
    assert line.decode().rstrip() == str(replies.TOO_MANY_CONNECTIONS_FROM_HOST)
    writer.close()
    await first.close()
    await asyncio.sleep(0.2)
    third = await RawClient.connect(relay.port)
    assert (await third.cmd("NOOP")).startswith("250")
    await second.close()
    await third.close()


async def test_total_connections_are_limited(make_relay: MakeRelay, sink: Sink) -> None:
    """Past max_connections every new client gets 421 4.7.0, wherever it comes from."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", max_connections=1)
    held = await RawClient.connect(relay.port)
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.port,
                                                   local_addr=("127.0.0.9", 0))
    line = await asyncio.wait_for(reader.readline(), 5)
    assert line.decode().rstrip() == str(replies.TOO_MANY_CONNECTIONS)
    writer.close()
    await held.close()


async def test_sender_outside_allowed_patterns_is_refused(make_relay: MakeRelay,
                                                          sink: Sink) -> None:
    """With allowed_senders, another reverse path gets 550 5.7.1 and a matching one 250."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}",
                             allowed_senders="*@example.com,bounces-*@example.org")
    client = await RawClient.connect(relay.port)
    await client.cmd("EHLO client.test")
    assert await client.cmd("MAIL FROM:<ceo@evil.example>") == str(replies.SENDER_NOT_ALLOWED)
    assert await client.cmd("MAIL FROM:<App@Example.com>") == str(replies.SENDER_OK)
    await client.cmd("RSET")
    assert await client.cmd("MAIL FROM:<bounces-7@example.org>") == str(replies.SENDER_OK)
    await client.close()


async def test_auth_is_offered_only_after_starttls(make_relay: MakeRelay, sink: Sink,
                                                   pki: Pki, auth_file: Path) -> None:
    """EHLO in clear offers STARTTLS, not AUTH; after TLS it offers AUTH PLAIN LOGIN."""
    relay = await tls_relay(make_relay, sink, pki, auth_file=auth_file)
    client = await RawClient.connect(relay.port)
    clear = await client.cmd("EHLO client.test")
    assert "STARTTLS" in clear and "AUTH" not in clear
    assert (await client.cmd(f"AUTH PLAIN {PLAIN}")).startswith("538 5.7.11")
    await starttls(client, pki.client_context)
    secured = await client.cmd("EHLO client.test")
    assert "250-AUTH LOGIN PLAIN" in secured and "STARTTLS" not in secured
    assert await client.cmd(f"AUTH PLAIN {PLAIN}") == "235 2.7.0 Authentication successful"
    await client.close()


async def test_starttls_discards_plaintext_sent_before_the_handshake(
    make_relay: MakeRelay, sink: Sink, pki: Pki
) -> None:
    """A command pipelined after STARTTLS in clear is thrown away (RFC 3207 section 4.2)."""
    relay = await tls_relay(make_relay, sink, pki)
    client = await RawClient.connect(relay.port)
    await client.cmd("EHLO client.test")
    await client.write(b"STARTTLS\r\nMAIL FROM:<injected@example.com>\r\n")
    assert (await client.reply()).startswith("220")
    await client.writer.start_tls(pki.client_context, server_hostname="relay.test")
    await client.cmd("EHLO client.test")
    assert (await client.cmd("RCPT TO:<user@example.net>")).startswith("503 5.5.1")
    await client.close()


async def test_authenticated_message_over_starttls_is_relayed(
    make_relay: MakeRelay, sink: Sink, pki: Pki, auth_file: Path
) -> None:
    """STARTTLS + AUTH + a message: relayed once, Received says ESMTPSA; MAIL before AUTH 530."""
    relay = await tls_relay(make_relay, sink, pki, auth_file=auth_file, auth_required=True,
                            tls_required=True)
    client = await RawClient.connect(relay.port)
    await client.cmd("EHLO client.test")
    assert (await client.cmd("MAIL FROM:<app@example.com>")).startswith("530 5.7.0")
    await starttls(client, pki.client_context)
    await client.cmd("EHLO client.test")
    assert (await client.cmd("MAIL FROM:<app@example.com>")).startswith("530 5.7.0")
    assert (await client.cmd(f"AUTH PLAIN {PLAIN}")).startswith("235")
    assert (await client.cmd("MAIL FROM:<app@example.com>")).startswith("250")
    assert (await client.cmd("RCPT TO:<user@example.net>")).startswith("250")
    assert (await client.cmd("DATA")).startswith("354")
    await client.write(message(key="TLS-1") + b".\r\n")
    assert (await client.reply()).startswith("250 2.0.0 Ok: relayed 1")
    await client.close()
    assert len(sink.handler.delivered) == 1
    assert b" with ESMTPSA id " in sink.handler.delivered[0].content


async def test_implicit_tls_listener_offers_auth_without_starttls(
    make_relay: MakeRelay, sink: Sink, pki: Pki, auth_file: Path
) -> None:
    """On the implicit-TLS port the session is TLS from the first byte: AUTH, no STARTTLS."""
    relay = await tls_relay(make_relay, sink, pki, auth_file=auth_file)
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", relay.tls_port, ssl=pki.client_context, server_hostname="relay.test")
    client = RawClient(reader, writer)
    assert (await client.reply()).startswith("220")
    ehlo = await client.cmd("EHLO client.test")
    assert "AUTH LOGIN PLAIN" in ehlo and "STARTTLS" not in ehlo
    assert (await client.cmd(f"AUTH PLAIN {PLAIN}")).startswith("235")
    await client.close()


async def test_wrong_password_is_refused_and_counted(
    make_relay: MakeRelay, sink: Sink, pki: Pki, auth_file: Path
) -> None:
    """A wrong password gets 535 5.7.8 and moves relay_auth_failures_total."""
    relay = await tls_relay(make_relay, sink, pki, auth_file=auth_file, auth_failure_delay=0.01)
    client = await RawClient.connect(relay.port)
    await client.cmd("EHLO client.test")
    await starttls(client, pki.client_context)
    await client.cmd("EHLO client.test")
    wrong = base64.b64encode(f"\0{USER}\0nope".encode()).decode()
    assert (await client.cmd(f"AUTH PLAIN {wrong}")).startswith("535 5.7.8")
    await client.close()
    assert relay.registry.get_sample_value("relay_auth_failures_total") == 1.0


async def test_auth_without_credentials_configured_is_not_available(
    make_relay: MakeRelay, sink: Sink, pki: Pki
) -> None:
    """With TLS but no auth file, EHLO offers no AUTH and AUTH is answered 502 5.5.1."""
    relay = await tls_relay(make_relay, sink, pki)
    client = await RawClient.connect(relay.port)
    await client.cmd("EHLO client.test")
    await starttls(client, pki.client_context)
    assert "AUTH" not in await client.cmd("EHLO client.test")
    assert await client.cmd(f"AUTH PLAIN {PLAIN}") == str(replies.AUTH_NOT_AVAILABLE)
    await client.close()


async def test_proxy_protocol_admits_by_the_proxied_source(make_relay: MakeRelay,
                                                           sink: Sink) -> None:
    """Behind a balancer the PROXY header's source address is checked, not the balancer's."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", proxy_protocol=True,
                             proxy_networks="127.0.0.1/32", allowed_networks="192.0.2.0/24")
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
    writer.write(b"PROXY TCP4 192.0.2.10 127.0.0.1 40000 25\r\n")
    assert (await asyncio.wait_for(reader.readline(), 5)).startswith(b"220")
    writer.close()
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
    writer.write(b"PROXY TCP4 198.51.100.1 127.0.0.1 40000 25\r\n")
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed without a greeting
    writer.close()
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.port,
                                                   local_addr=("127.0.0.7", 0))
    assert (await asyncio.wait_for(reader.readline(), 5)).decode().rstrip() == str(
        replies.CLIENT_NOT_ALLOWED)  # not a trusted balancer
    writer.close()


@pytest.fixture
def swaks() -> Iterator[str]:
    """The swaks binary (.ci/run installs it)."""
    path = shutil.which("swaks")
    if path is None:
        pytest.fail("swaks is not installed (.ci/run installs it)")
    yield path


async def test_swaks_starttls_and_auth_session_succeeds(
    make_relay: MakeRelay, sink: Sink, pki: Pki, auth_file: Path, swaks: str
) -> None:
    """swaks with STARTTLS and AUTH LOGIN sends twice through the relay: one delivery."""
    relay = await tls_relay(make_relay, sink, pki, auth_file=auth_file, auth_required=True)
    outputs = []
    for _ in range(2):
        proc = await asyncio.create_subprocess_exec(
            swaks, "--server", "127.0.0.1", "--port", str(relay.port), "--tls",
            "--tls-verify", "--tls-ca-path", str(pki.ca_file), "--tls-sni", "relay.test",
            "--auth", "LOGIN", "--auth-user", USER, "--auth-password", PASSWORD,
            "--from", "app@example.com", "--to", "user@example.net",
            "--header", "X-Dedupe-Key: SWAKS-1", "--header", "X-Template: receipt",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, out.decode()
        outputs.append(out.decode())
    assert "235 2.7.0 Authentication successful" in outputs[0]
    assert "250 2.0.0 Ok: relayed 1" in outputs[0]
    assert "duplicate suppressed" in outputs[1]
    assert len(sink.handler.delivered) == 1


async def _send_as(relay: Relay, pki: Pki, user: str | None, key: str) -> str:
    """One message to user@example.net over STARTTLS, authenticated as ``user`` (or not)."""
    client = await RawClient.connect(relay.port)
    await client.cmd("EHLO client.test")
    await starttls(client, pki.client_context)
    await client.cmd("EHLO client.test")
    if user is not None:
        blob = base64.b64encode(f"\0{user}\0{PASSWORD}".encode()).decode()
        assert (await client.cmd(f"AUTH PLAIN {blob}")).startswith("235")
    for command in ("MAIL FROM:<app@example.com>", "RCPT TO:<user@example.net>", "DATA"):
        assert (await client.cmd(command))[:1] in ("2", "3")
    await client.write(message(key=key) + b".\r\n")
    reply = await client.reply()
    await client.close()
    return reply


@pytest.mark.parametrize("scoped", [True, False])
async def test_scope_by_auth_keeps_tenants_apart(
    make_relay: MakeRelay, sink: Sink, pki: Pki, tmp_path: Path, scoped: bool
) -> None:
    """Two applications (AUTH identities) use the same key for the same recipient: with
    scope_by_auth each is delivered and each one's retry suppressed; without it the second
    application's message would be taken for a duplicate of the first's (design.md §2)."""
    from relay.credentials import format_entry, hash_password

    users = ["billing@example.com", "shop@example.com"]
    creds = tmp_path / "users"
    creds.write_text("".join(format_entry(u, hash_password(PASSWORD, scheme="bcrypt")) + "\n"
                             for u in users))
    relay = await tls_relay(make_relay, sink, pki, auth_file=creds, scope_by_auth=scoped)
    replies_seen = [await _send_as(relay, pki, u, "order-42") for u in [*users, *users]]
    if scoped:
        assert ["relayed 1" in r for r in replies_seen] == [True, True, False, False]
        assert all("suppressed" in r for r in replies_seen[2:])
        assert len(sink.handler.delivered) == 2
    else:
        assert ["relayed 1" in r for r in replies_seen] == [True, False, False, False]
        assert len(sink.handler.delivered) == 1
    unauthenticated = await _send_as(relay, pki, None, "order-42")  # the unscoped namespace
    assert ("relayed 1" in unauthenticated) is scoped


# ------------------------------------------------------------------------------------------
# MAIL and RCPT parameters (RFC 5321 section 4.1.2, RFC 4954 section 5)
# ------------------------------------------------------------------------------------------


def _smtplib_auth_send(port: int, context: ssl.SSLContext, mail_options: list[str]) -> int:
    """STARTTLS, AUTH PLAIN and one message with ``mail_options``; the DATA reply code."""
    client = smtplib.SMTP("127.0.0.1", port, timeout=30)
    try:
        client.ehlo("client.test")
        client.starttls(context=context)
        client.ehlo("client.test")
        client.login(USER, PASSWORD)
        refused = client.sendmail("app@example.com", ["user@example.net"],
                                  message(key="AUTHPARAM-1"), mail_options=mail_options)
        assert refused == {}
        return 250
    finally:
        client.quit()


async def test_mail_auth_parameter_after_auth_is_relayed_and_not_forwarded(
    make_relay: MakeRelay, sink: Sink, pki: Pki, auth_file: Path
) -> None:
    """MAIL FROM ... AUTH=<> from an authenticated client (Exim, JavaMail) is relayed, and
    the upstream, which does not advertise AUTH, is sent no AUTH parameter (RFC 4954 5)."""
    relay = await tls_relay(make_relay, sink, pki, auth_file=auth_file)
    code = await asyncio.to_thread(_smtplib_auth_send, relay.port, pki.client_context,
                                   ["AUTH=<>"])
    assert code == 250
    assert len(sink.handler.delivered) == 1
    assert not any(o.upper().startswith("AUTH") for o in sink.handler.mail_commands[0][1])


async def test_the_decision_line_names_the_auth_user(
    make_relay: MakeRelay, sink: Sink, pki: Pki, auth_file: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The message's log line carries the AUTH identity the session authenticated as (masked
    like any address in a log line unless ``log_recipients``) and the client's address."""
    caplog.set_level(logging.INFO, logger="relay.smtp.handler")
    relay = await tls_relay(make_relay, sink, pki, auth_file=auth_file, log_recipients=True)
    assert await asyncio.to_thread(_smtplib_auth_send, relay.port, pki.client_context,
                                   []) == 250
    [line] = [r for r in caplog.records if r.name == "relay.smtp.handler" and r.msg == "message"]
    assert (getattr(line, "auth_user", None), getattr(line, "client", None)) == (
        USER, "127.0.0.1")


async def _authenticated_client(relay: Relay, pki: Pki) -> RawClient:
    client = await RawClient.connect(relay.port)
    await client.cmd("EHLO client.test")
    await starttls(client, pki.client_context)
    await client.cmd("EHLO client.test")
    assert (await client.cmd(f"AUTH PLAIN {PLAIN}")).startswith("235")
    return client


@pytest.mark.parametrize("value", [
    "<>", "app@example.com", "app+2Buser@example.com", "e+3Dmc2@example.com"])
async def test_mail_auth_parameter_takes_any_xtext(
    make_relay: MakeRelay, sink: Sink, pki: Pki, auth_file: Path, value: str
) -> None:
    """AUTH= with <> or any xtext mailbox (RFC 4954 5, RFC 3461 4) is 250 at MAIL."""
    relay = await tls_relay(make_relay, sink, pki, auth_file=auth_file)
    client = await _authenticated_client(relay, pki)
    assert await client.cmd(f"MAIL FROM:<app@example.com> AUTH={value}") == str(
        replies.SENDER_OK)
    await client.close()


@pytest.mark.parametrize("value", ["", "a+zz@example.com", "a+2@example.com", "a=b"])
async def test_mail_auth_parameter_that_is_no_xtext_is_501(
    make_relay: MakeRelay, sink: Sink, pki: Pki, auth_file: Path, value: str
) -> None:
    """AUTH= whose value is empty or no xtext (a bad +XX escape) is 501 5.5.4."""
    relay = await tls_relay(make_relay, sink, pki, auth_file=auth_file)
    client = await _authenticated_client(relay, pki)
    reply = await client.cmd(f"MAIL FROM:<app@example.com> AUTH={value}")
    assert reply.startswith("501 5.5.4"), reply
    await client.close()


async def test_mail_auth_parameter_is_555_where_auth_is_not_advertised(
    make_relay: MakeRelay, sink: Sink, pki: Pki, auth_file: Path
) -> None:
    """Before STARTTLS the relay offers no AUTH, so AUTH= is 555 5.5.4 (RFC 5321 4.1.2)."""
    relay = await tls_relay(make_relay, sink, pki, auth_file=auth_file)
    client = await RawClient.connect(relay.port)
    assert "AUTH" not in await client.cmd("EHLO client.test")
    reply = await client.cmd("MAIL FROM:<app@example.com> AUTH=<>")
    assert reply.startswith("555 5.5.4"), reply
    await client.close()


@pytest.mark.parametrize(("command", "code"), [
    ("MAIL FROM:<app@example.com> SIZE=100 BODY=8BITMIME SMTPUTF8", "250 2.1.0"),
    ("MAIL FROM:<app@example.com> BODY=7BIT", "250 2.1.0"),
    ("MAIL FROM:<app@example.com> RET=HDRS", "555 5.5.4"),
    ("MAIL FROM:<app@example.com> ENVID=x", "555 5.5.4"),
    ("MAIL FROM:<app@example.com> BODY=BINARYMIME", "501 5.5.4"),
    ("MAIL FROM:<app@example.com> SMTPUTF8=yes", "501 5.5.4"),
])
async def test_mail_parameters_follow_what_ehlo_advertised(
    relay: Relay, command: str, code: str
) -> None:
    """SIZE, BODY and SMTPUTF8 are advertised and accepted; DSN's RET/ENVID are not: 555."""
    client = await RawClient.connect(relay.port)
    await client.cmd("EHLO client.test")
    assert (await client.cmd(command)).startswith(code)
    await client.close()


@pytest.mark.parametrize("param", ["NOTIFY=NEVER", "ORCPT=rfc822;user@example.net", "X=1"])
async def test_rcpt_parameters_of_unadvertised_extensions_are_555(
    relay: Relay, param: str
) -> None:
    """RCPT TO with a parameter (DSN is not advertised) is 555 5.5.4 (RFC 5321 4.1.2)."""
    client = await RawClient.connect(relay.port)
    assert "DSN" not in await client.cmd("EHLO client.test")
    await client.cmd("MAIL FROM:<app@example.com>")
    reply = await client.cmd(f"RCPT TO:<user@example.net> {param}")
    assert reply.startswith("555 5.5.4"), reply
    await client.close()


# ------------------------------------------------------------------------------------------
# TLS details (RFC 3207, Mozilla intermediate configuration)
# ------------------------------------------------------------------------------------------


async def test_second_starttls_inside_tls_is_503_and_the_session_goes_on(
    make_relay: MakeRelay, sink: Sink, pki: Pki
) -> None:
    """STARTTLS inside TLS is 503 5.5.1 (RFC 3207 4.2) and the session keeps working."""
    relay = await tls_relay(make_relay, sink, pki)
    client = await RawClient.connect(relay.port)
    await client.cmd("EHLO client.test")
    await starttls(client, pki.client_context)
    await client.cmd("EHLO client.test")
    assert (await client.cmd("STARTTLS")).startswith("503 5.5.1")
    assert (await client.cmd("NOOP")).startswith("250")
    await client.close()


async def test_starttls_on_the_implicit_tls_port_is_503(
    make_relay: MakeRelay, sink: Sink, pki: Pki
) -> None:
    """On the implicit-TLS port STARTTLS is 503 5.5.1 too: TLS is already active."""
    relay = await tls_relay(make_relay, sink, pki)
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", relay.tls_port, ssl=pki.client_context, server_hostname="relay.test")
    client = RawClient(reader, writer)
    await client.reply()
    await client.cmd("EHLO client.test")
    assert (await client.cmd("STARTTLS")).startswith("503 5.5.1")
    assert (await client.cmd("NOOP")).startswith("250")
    await client.close()


async def test_failed_starttls_handshake_is_one_info_line_and_counted(
    make_relay: MakeRelay, sink: Sink, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    """Garbage instead of a ClientHello after STARTTLS is one INFO line, no warning and no
    traceback, and one ``relay_tls_handshake_failures_total{listener="starttls"}``."""
    caplog.set_level(logging.INFO)
    relay = await tls_relay(make_relay, sink, pki)
    client = await RawClient.connect(relay.port)
    await client.cmd("EHLO client.test")
    assert (await client.cmd("STARTTLS")).startswith("220")
    caplog.clear()
    await client.write(b"GET / HTTP/1.0\r\n\r\n" * 20)
    assert await asyncio.wait_for(client.reader.read(), 5) == b""  # closed
    await client.close()
    await asyncio.sleep(0.1)
    assert [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING] == []
    lines = [r for r in caplog.records if "TLS handshake" in r.getMessage()]
    assert [r.levelno for r in lines] == [logging.INFO]
    failures = relay.registry.get_sample_value
    assert failures("relay_tls_handshake_failures_total", {"listener": "starttls"}) == 1
    assert failures("relay_tls_handshake_failures_total", {"listener": "implicit"}) == 0


def _cbc_only_tls12_context(pki: Pki) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki.ca_file))
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    context.set_ciphers("ECDHE-ECDSA-AES128-SHA:ECDHE-RSA-AES128-SHA:ECDHE-ECDSA-AES256-SHA384:"
                        "ECDHE-RSA-AES256-SHA384:ECDHE-ECDSA-AES128-SHA256:"
                        "ECDHE-RSA-AES128-SHA256:AES128-SHA:AES256-SHA")
    return context


async def test_tls12_offers_no_cbc_suite(make_relay: MakeRelay, sink: Sink, pki: Pki) -> None:
    """A TLS 1.2 client restricted to CBC suites gets no handshake (Mozilla intermediate)."""
    relay = await tls_relay(make_relay, sink, pki)
    with pytest.raises((ssl.SSLError, ConnectionResetError)):  # alert, or reset before it
        _reader, writer = await asyncio.open_connection(
            "127.0.0.1", relay.tls_port, ssl=_cbc_only_tls12_context(pki),
            server_hostname="relay.test")
        writer.close()
    tls12 = ssl.create_default_context(cafile=str(pki.ca_file))
    tls12.maximum_version = ssl.TLSVersion.TLSv1_2
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", relay.tls_port, ssl=tls12, server_hostname="relay.test")
    assert "GCM" in writer.get_extra_info("cipher")[0] or "CHACHA20" in writer.get_extra_info(
        "cipher")[0]
    assert (await asyncio.wait_for(reader.readline(), 5)).startswith(b"220")
    writer.close()


async def test_auth_budget_spent_from_one_address_is_refused_and_counted(
    make_relay: MakeRelay, sink: Sink, pki: Pki, auth_file: Path
) -> None:
    """With auth_max_failures = 1 a wrong password closes with 421, and the next connection's
    AUTH is 421 unchecked, counted in relay_auth_refused_total."""
    relay = await tls_relay(make_relay, sink, pki, auth_file=auth_file, auth_failure_delay=0.01,
                            auth_max_failures=1)
    wrong = base64.b64encode(f"\0{USER}\0nope".encode()).decode()
    for blob in (wrong, PLAIN):
        client = await RawClient.connect(relay.port)
        await client.cmd("EHLO client.test")
        await starttls(client, pki.client_context)
        await client.cmd("EHLO client.test")
        assert await client.cmd(f"AUTH PLAIN {blob}") == str(replies.AUTH_TOO_MANY_FAILURES)
        await client.close()
    assert relay.registry.get_sample_value("relay_auth_failures_total") == 1.0
    assert relay.registry.get_sample_value("relay_auth_refused_total") == 1.0


# ------------------------------------------------------------------------------------------
# implicit TLS admission and PROXY protocol v2
# ------------------------------------------------------------------------------------------


async def test_implicit_tls_refuses_a_disallowed_client_before_the_handshake(
    make_relay: MakeRelay, sink: Sink, pki: Pki
) -> None:
    """A client outside allowed_networks is closed on the TLS port before any handshake."""
    relay = await tls_relay(make_relay, sink, pki, allowed_networks="127.0.0.1/32")
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.tls_port,
                                                   local_addr=("127.0.0.2", 0))
    assert await asyncio.wait_for(reader.read(), 2) == b""  # no ServerHello: closed at once
    writer.close()


async def test_implicit_tls_handshakes_are_bounded_in_time_and_counted(
    make_relay: MakeRelay, sink: Sink, pki: Pki
) -> None:
    """50 idle handshakes: those over max_connections are closed at once (well before the
    handshake timeout), the others after tls_handshake_timeout (3 s, give or take a loaded
    loop's lag); while they wait they count toward the limit of the plain port."""
    relay = await tls_relay(make_relay, sink, pki, max_connections=20,
                            max_connections_per_ip=100, tls_handshake_timeout=3.0)
    loop = asyncio.get_running_loop()

    async def closed_after(reader: asyncio.StreamReader, since: float) -> float:
        assert await asyncio.wait_for(reader.read(), 30) == b""
        return loop.time() - since

    # each connection's time is from its own open, watched from then on (a loaded runner
    # opens 50 connections slowly)
    idle, watching = [], []
    for _ in range(50):
        since = loop.time()
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.tls_port)
        idle.append((reader, writer))
        watching.append(asyncio.ensure_future(closed_after(reader, since)))
    await asyncio.sleep(0.2)
    plain_reader, plain_writer = await asyncio.open_connection("127.0.0.1", relay.port)
    line = await asyncio.wait_for(plain_reader.readline(), 5)
    assert line.decode().rstrip() == str(replies.TOO_MANY_CONNECTIONS)
    plain_writer.close()

    closed_at = await asyncio.gather(*watching)
    for _, writer in idle:
        writer.close()
    assert sum(t < 2.0 for t in closed_at) >= 30  # over the limit: not held
    assert max(closed_at) < 3.0 + 3.0  # the others no longer than the handshake timeout
    await asyncio.sleep(0.2)
    client = await RawClient.connect(relay.port)  # the slots are free again
    await client.close()


def _proxy_v2(command: int, source: str = "192.0.2.10", family: int = 0x11) -> bytes:
    """A PROXY protocol v2 header: ``command`` 0 LOCAL / 1 PROXY, TCP over IPv4 by default."""
    signature = b"\r\n\r\n\x00\r\nQUIT\n"
    if family == 0x00:
        return signature + bytes([0x20 | command, 0x00]) + (0).to_bytes(2, "big")
    body = (socket.inet_aton(source) + socket.inet_aton("127.0.0.1")
            + (40000).to_bytes(2, "big") + (25).to_bytes(2, "big"))
    return signature + bytes([0x20 | command, family]) + len(body).to_bytes(2, "big") + body


@pytest.mark.parametrize("header", [_proxy_v2(0), _proxy_v2(0, family=0x00)])
async def test_proxy_v2_local_from_a_proxy_that_is_no_allowed_client_is_refused(
    make_relay: MakeRelay, sink: Sink, header: bytes
) -> None:
    """A v2 LOCAL header is judged by the proxy's own address (its address block is ignored):
    a trusted proxy that is no allowed client gets no greeting."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", proxy_protocol=True,
                             proxy_networks="127.0.0.1/32", allowed_networks="192.0.2.0/24")
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
    writer.write(header)
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()


async def test_proxy_v2_local_from_an_allowed_proxy_is_greeted(make_relay: MakeRelay,
                                                               sink: Sink) -> None:
    """A v2 LOCAL health check from a proxy that is also an allowed client is greeted."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", proxy_protocol=True,
                             proxy_networks="127.0.0.1/32", allowed_networks="127.0.0.1/32")
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
    writer.write(_proxy_v2(0, family=0x00))
    assert (await asyncio.wait_for(reader.readline(), 5)).startswith(b"220")
    writer.close()


async def test_behind_a_proxy_the_per_address_limit_counts_the_client(
    make_relay: MakeRelay, sink: Sink
) -> None:
    """With max_connections_per_ip = 1 two clients behind one proxy are both greeted; a
    second connection of one of them gets 421 4.7.0."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", proxy_protocol=True,
                             proxy_networks="127.0.0.1/32", allowed_networks="192.0.2.0/24",
                             max_connections_per_ip=1)
    held = []
    for source in ("192.0.2.10", "192.0.2.11"):
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        writer.write(_proxy_v2(1, source))
        assert (await asyncio.wait_for(reader.readline(), 5)).startswith(b"220")
        held.append(writer)
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
    writer.write(_proxy_v2(1, "192.0.2.10"))
    line = await asyncio.wait_for(reader.readline(), 5)
    assert line.decode().rstrip() == str(replies.TOO_MANY_CONNECTIONS_FROM_HOST)
    for w in [*held, writer]:
        w.close()


async def test_received_header_names_the_proxied_client(make_relay: MakeRelay,
                                                        sink: Sink) -> None:
    """Behind a proxy the Received: header names the client, not the proxy."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", proxy_protocol=True,
                             proxy_networks="127.0.0.1/32", allowed_networks="192.0.2.0/24")
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
    writer.write(_proxy_v2(1, "192.0.2.10"))
    client = RawClient(reader, writer)
    assert (await client.reply()).startswith("220")
    await client.cmd("EHLO client.test")
    for command in ("MAIL FROM:<app@example.com>", "RCPT TO:<user@example.net>", "DATA"):
        assert (await client.cmd(command))[:1] in ("2", "3")
    await client.write(message(key="PROXY-RCVD") + b".\r\n")
    assert (await client.reply()).startswith("250")
    await client.close()
    trace = sink.handler.delivered[0].content.split(b"\r\n\t", 1)[0]
    assert b"[192.0.2.10]" in trace and b"[127.0.0.1]" not in trace


async def test_a_failed_handshake_on_the_implicit_tls_port_is_one_info_line_and_counted(
    make_relay: MakeRelay, sink: Sink, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that sends no TLS at all to the implicit-TLS port: one INFO line, no WARNING
    and no traceback (asyncio reported the loss to a session that never started), and one
    ``relay_tls_handshake_failures_total{listener="implicit"}``."""
    caplog.set_level(logging.INFO)
    relay = await tls_relay(make_relay, sink, pki)
    caplog.clear()  # the start-up lines
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.tls_port)
    writer.write(b"GET / HTTP/1.0\r\n\r\n")
    await asyncio.wait_for(reader.read(), 5)
    writer.close()
    await asyncio.sleep(0.2)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    failed = [r for r in caplog.records if "TLS handshake failed" in r.getMessage()]
    assert [r.levelno for r in failed] == [logging.INFO]
    assert relay.registry.get_sample_value("relay_tls_handshake_failures_total",
                                           {"listener": "implicit"}) == 1


async def test_a_handshake_pending_at_stop_starts_no_session(
    make_relay: MakeRelay, sink: Sink, pki: Pki
) -> None:
    """A client whose TLS handshake had not begun when the relay stopped is closed, never
    greeted 220 with a fresh session (it was, and its message relayed, then cut)."""
    relay = await tls_relay(make_relay, sink, pki)
    raw = socket.create_connection(("127.0.0.1", relay.tls_port), timeout=5)
    await asyncio.sleep(0.1)  # admitted, waiting for the ClientHello
    await relay.stop()

    def handshake_and_greeting() -> bytes:
        try:
            with pki.client_context.wrap_socket(raw, server_hostname="relay.test") as tls:
                return tls.recv(100)
        except (OSError, ssl.SSLError):
            return b""

    assert await asyncio.to_thread(handshake_and_greeting) == b""


async def test_the_reply_to_starttls_carries_an_enhanced_code(
    make_relay: MakeRelay, sink: Sink, pki: Pki
) -> None:
    """STARTTLS is answered 220 2.0.0 (a reply to a command, not the greeting: RFC 2034)."""
    relay = await tls_relay(make_relay, sink, pki)
    client = await RawClient.connect(relay.port)
    await client.cmd("EHLO client.test")
    assert await client.cmd("STARTTLS") == "220 2.0.0 Ready to start TLS"
    await client.writer.start_tls(pki.client_context, server_hostname="relay.test")
    await client.close()
