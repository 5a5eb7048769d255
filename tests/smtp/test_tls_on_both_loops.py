"""The implicit-TLS port and STARTTLS on asyncio's loop and on uvloop's (tests/conftest.py):
uvloop reads a new connection before the acceptor's pause holds, so the ClientHello reaches
the acceptor first and must be handed to the TLS layer (relay.smtp.implicit_tls)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tests.support.clients import RawClient, message
from tests.support.pki import Pki, starttls, tls_relay
from tests.support.relays import MakeRelay
from tests.support.sink import Sink

pytestmark = pytest.mark.both_loops


async def test_a_message_over_the_implicit_tls_port_is_relayed(
    make_relay: MakeRelay, sink: Sink, pki: Pki
) -> None:
    """Handshake, 220, a message relayed: the ClientHello read early is not lost."""
    relay = await tls_relay(make_relay, sink, pki)
    reader, writer = await asyncio.wait_for(asyncio.open_connection(
        "127.0.0.1", relay.tls_port, ssl=pki.client_context, server_hostname="relay.test"), 10)
    client = RawClient(reader, writer)
    assert (await client.reply()).startswith("220")
    await client.cmd("EHLO client.test")
    assert (await client.cmd("MAIL FROM:<app@example.com>")).startswith("250")
    assert (await client.cmd("RCPT TO:<user@example.net>")).startswith("250")
    assert (await client.cmd("DATA")).startswith("354")
    writer.write(message() + b"\r\n.\r\n")
    assert (await client.reply()).startswith("250")
    await client.close()
    assert sink.handler.copies_to("user@example.net") == 1


async def test_junk_on_the_implicit_tls_port_fails_its_handshake_at_once(
    make_relay: MakeRelay, sink: Sink, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    """Plain text to the TLS port: closed at once (not at the handshake timeout), one line."""
    caplog.set_level(logging.INFO)
    relay = await tls_relay(make_relay, sink, pki, tls_handshake_timeout=30.0)
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.tls_port)
    writer.write(b"GET / HTTP/1.0\r\n\r\n")
    await asyncio.wait_for(reader.read(), 5)
    writer.close()
    failed = [r for r in caplog.records if "TLS handshake failed" in r.getMessage()]
    assert len(failed) == 1 and "longer than" not in failed[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_starttls_then_a_message(make_relay: MakeRelay, sink: Sink, pki: Pki) -> None:
    """STARTTLS on the plain port, then a message relayed over it."""
    relay = await tls_relay(make_relay, sink, pki)
    client = await RawClient.connect(relay.port)
    await client.cmd("EHLO client.test")
    await starttls(client, pki.client_context)
    await client.cmd("EHLO client.test")
    assert (await client.cmd("MAIL FROM:<app@example.com>")).startswith("250")
    assert (await client.cmd("RCPT TO:<user@example.net>")).startswith("250")
    assert (await client.cmd("DATA")).startswith("354")
    client.writer.write(message() + b"\r\n.\r\n")
    assert (await client.reply()).startswith("250")
    await client.close()
    assert sink.handler.copies_to("user@example.net") == 1
