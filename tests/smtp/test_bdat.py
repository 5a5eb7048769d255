"""BDAT (RFC 3030 CHUNKING) is not offered: a client's ``BDAT`` is answered ``521 5.5.1`` and
the connection closed, so the chunk that follows it on the wire is never read as commands
(a chunk quoting ``RSET``/``MAIL``/``RCPT``/``DATA`` once had its quoted message relayed).
Raw-socket clients on the plain port, after STARTTLS and on the implicit-TLS port."""

from __future__ import annotations

import asyncio
import ssl

import pytest

from relay.core import replies
from tests.support.clients import RawClient, message
from tests.support.pki import Pki, starttls, tls_relay
from tests.support.relays import MakeRelay
from tests.support.sink import Sink

pytestmark = pytest.mark.both_loops

# a chunk whose content reads as a whole SMTP session: executed line by line, it relays a
# message of its own to an address the client never named in RCPT
QUOTED_SESSION = (b"RSET\r\nMAIL FROM:<app@example.com>\r\nRCPT TO:<quoted@example.net>\r\n"
                  b"DATA\r\n" + message(key="QUOTED-1") + b".\r\nQUIT\r\n")


async def _until_closed(client: RawClient, wait_s: float = 10.0) -> bytes:
    """Every byte the relay sends until it closes the connection."""
    received = b""
    while chunk := await asyncio.wait_for(client.reader.read(4096), wait_s):
        received += chunk
    return received


async def _client(relay_port: int, context: ssl.SSLContext | None, how: str) -> RawClient:
    """A greeted client that said EHLO (CHUNKING not in its answer): on the plain port,
    after STARTTLS, or on the implicit-TLS port."""
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", relay_port, ssl=context if how == "implicit" else None,
        server_hostname="relay.test" if how == "implicit" else None)
    client = RawClient(reader, writer)
    assert (await client.reply()).startswith("220")
    ehlo = await client.cmd("EHLO client.test")
    if how == "starttls":
        assert context is not None
        await starttls(client, context)
        ehlo = await client.cmd("EHLO client.test")
    assert "CHUNKING" not in ehlo
    return client


@pytest.mark.parametrize("how", ["plain", "starttls", "implicit"])
async def test_a_bdat_chunk_is_never_read_as_commands(
        make_relay: MakeRelay, sink: Sink, pki: Pki, how: str) -> None:
    """MAIL, RCPT, then ``BDAT n LAST`` with a chunk quoting a whole session in the same
    write: ``521 5.5.1`` and the connection closed; nothing reaches the smarthost."""
    relay = await tls_relay(make_relay, sink, pki)
    port = relay.tls_port if how == "implicit" else relay.port
    client = await _client(port, pki.client_context, how)
    assert (await client.cmd("MAIL FROM:<app@example.com>")).startswith("250")
    assert (await client.cmd("RCPT TO:<user@example.net>")).startswith("250")
    await client.write(b"BDAT %d LAST\r\n" % len(QUOTED_SESSION) + QUOTED_SESSION)
    said = (await _until_closed(client)).decode()
    await client.close()
    assert said == f"{replies.BDAT_NOT_IMPLEMENTED}\r\n", said
    await asyncio.sleep(0.3)  # a message relayed from the chunk would be at the sink now
    assert sink.handler.transactions == 0 and sink.handler.delivered == []


async def test_bdat_as_the_first_command_ends_the_session(make_relay: MakeRelay,
                                                          sink: Sink) -> None:
    """``BDAT 0 LAST`` before any other command: ``521 5.5.1``, then the connection closes
    without another reply (the ``QUIT`` after it is not answered)."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}")
    client = await RawClient.connect(relay.port)
    await client.write(b"BDAT 0 LAST\r\nQUIT\r\n")
    said = (await _until_closed(client)).decode()
    await client.close()
    assert said == f"{replies.BDAT_NOT_IMPLEMENTED}\r\n", said
