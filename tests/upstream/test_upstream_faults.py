"""Upstream faults aiosmtpd cannot be told to make: a raw asyncio SMTP peer that hangs up
before or after the final dot. The relay must release in the first case (the retry is safe)
and mark UNKNOWN in the second (a release would send a duplicate; RFC 1047)."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from relay.core import replies
from relay.core.fingerprint import fingerprint, store_key
from relay.core.interfaces import State
from relay.core.recipients import normalize_recipient
from tests.support.clients import message, send
from tests.support.peers import ScriptedPeer, serve_peer
from tests.support.relays import MakeRelay


@dataclass(kw_only=True)
class RawUpstream(ScriptedPeer):
    """A scripted SMTP peer: ``mode`` is ``close_mid_data`` or ``close_after_dot``.

    ``bytes_after_354``: what it read of the message (``close_after_dot``: without the chunk
    that held the final dot)."""

    name = b"raw.test"
    ehlo = (b"8BITMIME", b"SMTPUTF8")

    mode: str
    data_commands: int = 0
    bytes_after_354: int = 0

    async def on_data(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Hang up in the middle of the message, or after its dot without a reply."""
        self.data_commands += 1
        writer.write(b"354 go ahead\r\n")
        await writer.drain()
        if self.mode == "close_mid_data":
            chunk = await reader.read(65536)  # take a little, then hang up
            self.bytes_after_354 += len(chunk)
            return False

        async def count(chunk: bytes) -> None:
            self.bytes_after_354 += len(chunk)

        await self.read_to_dot(reader, count)  # the whole message and the dot: hang up unanswered
        return False


@contextlib.asynccontextmanager
async def raw_upstream(mode: str) -> AsyncIterator[RawUpstream]:
    """Serve a RawUpstream on 127.0.0.1:0 for the duration of the block."""
    async with serve_peer(RawUpstream(mode=mode)) as peer:
        yield peer


def key_for(prefix: str, rcpt: str) -> str:
    """Store key of (rcpt, template 'welcome', key 'K-1')."""
    return store_key(prefix, fingerprint(normalize_recipient(rcpt), "welcome", "K-1"))


async def test_connection_lost_before_the_dot_releases(make_relay: MakeRelay) -> None:
    """Upstream hanging up while the message is still being written: 451, fingerprint released."""
    async with raw_upstream("close_mid_data") as peer:
        relay = await make_relay(upstream=f"127.0.0.1:{peer.port}",
                                 max_message_size=64 * 1024 * 1024)
        big = message(body=("x" * 998 + "\r\n") * 32_000)  # ~32 MB: more than socket buffers
        result = await send(relay.port, ["user@example.net"], big)
        assert (result.code, result.text) == (451, replies.UPSTREAM_LOST.text)
        assert peer.data_commands == 1
        assert peer.bytes_after_354 < len(big)
        assert relay.store is not None
        record = await relay.store.inspect(key_for(relay.settings.store_prefix, "user@example.net"))
        assert record.state is State.ABSENT


async def test_connection_lost_after_the_dot_is_unknown(make_relay: MakeRelay) -> None:
    """Upstream hanging up after the final dot without a reply: 451 4.4.2 and state UNKNOWN."""
    async with raw_upstream("close_after_dot") as peer:
        relay = await make_relay(upstream=f"127.0.0.1:{peer.port}")
        result = await send(relay.port, ["user@example.net"], message())
        assert (result.code, result.text) == (451, replies.OUTCOME_UNKNOWN.text)
        assert relay.store is not None
        record = await relay.store.inspect(key_for(relay.settings.store_prefix, "user@example.net"))
        assert record.state is State.UNKNOWN
        retry = await send(relay.port, ["user@example.net"], message())
        assert retry.code == 250 and "suppressed" in retry.text
        assert peer.data_commands == 1


@pytest.mark.parametrize("mode", ["close_after_dot"])
async def test_unknown_is_counted(make_relay: MakeRelay, mode: str) -> None:
    """An unknown outcome is counted in relay_recipients_total{outcome="unknown"}."""
    async with raw_upstream(mode) as peer:
        relay = await make_relay(upstream=f"127.0.0.1:{peer.port}")
        await send(relay.port, ["user@example.net"], message())
        value = relay.registry.get_sample_value("relay_recipients_total", {"outcome": "unknown"})
        assert value == 1.0


@dataclass
class ScriptedUpstream:
    """An SMTP peer answering each verb from ``script`` (default 250 / 354 / 250 after the dot).

    ``script`` keys: ``EHLO``, ``MAIL``, ``RCPT``, ``DATA`` (the reply instead of 354) and
    ``DOT`` (the reply to the final dot). ``commands`` records every command line received.
    """

    script: dict[str, str]
    port: int = 0
    commands: list[bytes] = field(default_factory=list)
    messages: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"220 scripted.test ESMTP\r\n")
        try:
            while line := await reader.readline():
                self.commands.append(line.rstrip(b"\r\n"))
                verb = line[:4].upper().decode()
                if verb == "QUIT":
                    writer.write(b"221 bye\r\n")
                    return
                writer.write(await self._answer(verb, reader, writer))
                await writer.drain()
        finally:
            writer.close()

    async def _answer(self, verb: str, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> bytes:
        default = {"EHLO": "250-scripted.test\r\n250 SIZE 100000000", "DATA": "354 go ahead"}
        reply = self.script.get(verb, default.get(verb, "250 2.0.0 ok"))
        if verb == "DATA" and reply.startswith("354"):
            writer.write(reply.encode() + b"\r\n")
            await writer.drain()
            buffer = b""
            while not buffer.endswith(b"\r\n.\r\n"):
                chunk = await reader.read(65536)
                if not chunk:
                    return b""  # the relay hung up mid-message
                buffer += chunk
            self.messages += 1
            reply = self.script.get("DOT", "250 2.0.0 queued as X")
        return reply.encode() + b"\r\n"


@contextlib.asynccontextmanager
async def scripted(**script: str) -> AsyncIterator[ScriptedUpstream]:
    """Serve a ScriptedUpstream on 127.0.0.1:0 for the duration of the block."""
    peer = ScriptedUpstream(script=script)
    server = await asyncio.start_server(peer.handle, "127.0.0.1", 0)
    peer.port = server.sockets[0].getsockname()[1]
    try:
        yield peer
    finally:
        server.close()


@pytest.mark.parametrize(("script", "state"), [
    ({"RCPT": "252 2.0.0 cannot verify"}, State.ABSENT),
    ({"DATA": "250 2.0.0 ok, no data needed"}, State.ABSENT),
    ({"DATA": "221 2.0.0 bye"}, State.ABSENT),
    ({"MAIL": "354 what"}, State.ABSENT),
    ({"DOT": "354 more please"}, State.UNKNOWN),
    ({"DOT": "199 hmm"}, State.UNKNOWN),
    ({"DOT": "600 hmm"}, State.UNKNOWN),
])
async def test_a_reply_no_rfc_allows_is_never_passed_to_the_client(
    make_relay: MakeRelay, script: dict[str, str], state: State
) -> None:
    """An upstream reply out of place gives the client a 4yz, never a 2yz/3yz it could trust."""
    async with scripted(**script) as peer:
        relay = await make_relay(upstream=f"127.0.0.1:{peer.port}")
        result = await send(relay.port, ["user@example.net"], message())
        assert 400 <= result.code < 500, result
        assert re.match(r"4\.\d+\.\d+ ", result.text)
        assert relay.store is not None
        record = await relay.store.inspect(key_for(relay.settings.store_prefix, "user@example.net"))
        assert record.state is state
        samples = relay.registry.get_sample_value(
            "relay_upstream_replies_total",
            {"code_class": "2xx", "upstream": f"127.0.0.1:{peer.port}"})
        assert samples == 0.0


async def test_helo_only_upstream_gets_helo_and_the_message(make_relay: MakeRelay) -> None:
    """An upstream that refuses EHLO is greeted with HELO and takes a 7-bit message."""
    async with scripted(EHLO="500 5.5.1 EHLO not understood") as peer:
        relay = await make_relay(upstream=f"127.0.0.1:{peer.port}")
        result = await send(relay.port, ["user@example.net"], message())
        assert result.code == 250
        assert any(c.upper().startswith(b"HELO ") for c in peer.commands)
        assert peer.messages == 1


async def test_seven_bit_upstream_takes_ascii_and_idn_mail(make_relay: MakeRelay) -> None:
    """Without 8BITMIME/SMTPUTF8 upstream, ASCII content and IDN domains still go (A-labels)."""
    async with scripted() as peer:
        relay = await make_relay(upstream=f"127.0.0.1:{peer.port}")
        declared = await send(relay.port, ["user@example.net"], message(key="D-1"),
                              mail_options=["SMTPUTF8", "BODY=8BITMIME"])
        idn = await send(relay.port, ["user@bücher.example"], message(key="D-2"),
                         mail_options=["SMTPUTF8"])
        assert (declared.code, idn.code) == (250, 250)
        mails = [c for c in peer.commands if c.upper().startswith(b"MAIL")]
        assert all(b"SMTPUTF8" not in m and b"BODY=" not in m for m in mails)
        assert b"RCPT TO:<user@xn--bcher-kva.example>" in peer.commands
        assert peer.messages == 2


async def test_seven_bit_upstream_refuses_what_cannot_be_downgraded(
    make_relay: MakeRelay
) -> None:
    """A UTF-8 local part or UTF-8 headers need SMTPUTF8: 550 5.6.7, nothing sent, no key."""
    async with scripted() as peer:
        relay = await make_relay(upstream=f"127.0.0.1:{peer.port}")
        local = await send(relay.port, ["jörg@example.com"], message(key="U-1"),
                           mail_options=["SMTPUTF8"])
        headers = await send(relay.port, ["user@example.net"],
                             message(key="U-2", extra="Subject: Grüße\r\n").replace(
                                 b"Subject: test\r\n", b""),
                             mail_options=["SMTPUTF8"])
        assert (local.code, local.text) == (550, replies.UPSTREAM_NO_SMTPUTF8.text)
        assert (headers.code, headers.text) == (550, replies.UPSTREAM_NO_SMTPUTF8.text)
        assert peer.messages == 0
        assert relay.store is not None
        record = await relay.store.inspect(key_for(relay.settings.store_prefix, "jörg@example.com"))
        assert record.state is State.ABSENT
