"""Upstream faults aiosmtpd cannot be told to make: a raw asyncio SMTP peer that hangs up
before or after the final dot. The relay must release in the first case (the retry is safe)
and mark UNKNOWN in the second (a release would send a duplicate; RFC 1047)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from conftest import MakeRelay, message, send

from relay import replies
from relay.fingerprint import fingerprint, normalize_recipient, store_key
from relay.interfaces import State


@dataclass
class RawUpstream:
    """A scripted SMTP peer: ``mode`` is ``close_mid_data`` or ``close_after_dot``."""

    mode: str
    port: int = 0
    data_commands: int = 0
    bytes_after_354: int = 0
    server: asyncio.base_events.Server | None = field(default=None, repr=False)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"220 raw.test ESMTP\r\n")
        try:
            while line := await reader.readline():
                verb = line[:4].upper()
                if verb == b"EHLO":
                    writer.write(b"250-raw.test\r\n250-8BITMIME\r\n250 SMTPUTF8\r\n")
                elif verb == b"DATA":
                    self.data_commands += 1
                    writer.write(b"354 go ahead\r\n")
                    await writer.drain()
                    await self._data(reader)
                    return
                elif verb == b"QUIT":
                    writer.write(b"221 bye\r\n")
                    return
                else:
                    writer.write(b"250 ok\r\n")
                await writer.drain()
        finally:
            writer.close()

    async def _data(self, reader: asyncio.StreamReader) -> None:
        if self.mode == "close_mid_data":
            chunk = await reader.read(65536)  # take a little, then hang up
            self.bytes_after_354 += len(chunk)
            return
        buffer = b""
        while not buffer.endswith(b"\r\n.\r\n"):
            chunk = await reader.read(65536)
            if not chunk:
                return
            buffer += chunk
        self.bytes_after_354 += len(buffer)  # the whole message and the dot: hang up unanswered


@contextlib.asynccontextmanager
async def raw_upstream(mode: str) -> AsyncIterator[RawUpstream]:
    """Serve a RawUpstream on 127.0.0.1:0 for the duration of the block."""
    peer = RawUpstream(mode=mode)
    peer.server = await asyncio.start_server(peer.handle, "127.0.0.1", 0)
    peer.port = peer.server.sockets[0].getsockname()[1]
    try:
        yield peer
    finally:
        peer.server.close()


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
        record = await relay.store.inspect(key_for(relay.settings.store_prefix, "user@example.net"))
        assert record.state is State.ABSENT


async def test_connection_lost_after_the_dot_is_unknown(make_relay: MakeRelay) -> None:
    """Upstream hanging up after the final dot without a reply: 451 4.4.2 and state UNKNOWN."""
    async with raw_upstream("close_after_dot") as peer:
        relay = await make_relay(upstream=f"127.0.0.1:{peer.port}")
        result = await send(relay.port, ["user@example.net"], message())
        assert (result.code, result.text) == (451, replies.OUTCOME_UNKNOWN.text)
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
