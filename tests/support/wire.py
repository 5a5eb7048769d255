"""Helpers of the wire-level tests: store keys and states of a relay, raw messages, SMTP
transactions on a RawClient and assertions on replies and relayed bytes."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import redis.asyncio as aredis

from relay.app import Relay
from relay.core import replies
from relay.core.fingerprint import fingerprint, store_key
from relay.core.headers import parse_message
from relay.core.interfaces import SmtpReply, State
from relay.core.recipients import normalize_recipient
from tests.support.clients import RawClient
from tests.support.sink import Delivered

RCPT = "user@example.net"

def key_of(relay: Relay, rcpt: str, template: str, key: str) -> str:
    """The store key the relay uses for (rcpt, template, key) under its own settings."""
    norm = normalize_recipient(
        rcpt, local_part_case_sensitive=relay.settings.local_part_case_sensitive)
    return store_key(relay.settings.store_prefix, fingerprint(norm, template, key))


async def state_of(relay: Relay, rcpt: str, template: str, key: str) -> State:
    """What the store holds for (rcpt, template, key)."""
    assert relay.store is not None
    return (await relay.store.inspect(key_of(relay, rcpt, template, key))).state


async def stored_keys(relay: Relay) -> list[bytes]:
    """Every Redis key under the relay's prefix (no reservation left behind: empty)."""
    client = aredis.Redis.from_url(relay.settings.store)
    try:
        return [k async for k in client.scan_iter(match=relay.settings.store_prefix + "*")]
    finally:
        await client.aclose()


def msg(*headers: str | bytes, body: bytes = b"hello") -> bytes:
    """A raw CRLF message: From, the given header lines, an empty line, ``body``."""
    lines = [b"From: app@example.com"]
    lines += [h.encode() if isinstance(h, str) else h for h in headers]
    return b"".join(line + b"\r\n" for line in lines) + b"\r\n" + body + b"\r\n"


def assert_reply(reply: str, expected: SmtpReply) -> None:
    """``reply`` has the code and the RFC 3463 code of the catalogue entry ``expected``."""
    enhanced = replies.enhanced_of(expected)
    assert enhanced is not None
    assert reply.startswith(f"{expected.code} {enhanced} "), (reply, str(expected))


def codes(got: Sequence[str]) -> list[int]:
    """The three-digit codes of a list of replies."""
    return [int(r[:3]) for r in got]


def added_before(data: bytes) -> list[bytes]:
    """The header line the relay adds before ``data`` (add_message_id): a Message-ID field
    when ``data`` has none, as the relay's parse reads it; else nothing."""
    return [] if parse_message(data).first("message-id") is not None else [b"Message-ID: "]


def assert_relayed_unchanged(delivered: Delivered, data: bytes) -> None:
    """Upstream got ``data`` byte for byte, preceded only by the relay's Received: header
    (and the Message-ID it adds to a message without one, add_message_id)."""
    assert delivered.content.endswith(data)
    trace = delivered.content[: len(delivered.content) - len(data)]
    lines = trace.split(b"\r\n")
    for start in added_before(data):
        assert lines[-2].startswith(start), lines
        del lines[-2]
    assert lines[0].startswith(b"Received: from ")
    assert lines[-1] == b""
    assert all(line[:1] in (b" ", b"\t") for line in lines[1:-1])


async def ehlo(port: int) -> tuple[RawClient, str]:
    """Connect a RawClient and say EHLO; returns the client and the EHLO reply."""
    client = await RawClient.connect(port)
    return client, await client.cmd("EHLO legacy.example.com")


async def transaction(client: RawClient, rcpts: Sequence[str], data: bytes,
                      mail: bytes = b"MAIL FROM:<app@example.com>") -> list[str]:
    """MAIL, one RCPT each, DATA, ``data`` (sent as is) and the terminator; all replies."""
    got = [await client.cmd(mail)]
    for rcpt in rcpts:
        got.append(await client.cmd(f"RCPT TO:<{rcpt}>".encode()))
    got.append(await client.cmd("DATA"))
    await client.write(data + b".\r\n")
    got.append(await client.reply())
    return got


async def closed_by_server(client: RawClient, wait_s: float = 2.0) -> bool:
    """True when the server closes the connection within ``wait_s`` seconds."""
    try:
        return await asyncio.wait_for(client.reader.read(), wait_s) == b""
    except (ConnectionError, TimeoutError):
        return False
