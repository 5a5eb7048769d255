"""The SENDING mark overlaps the body (it starts after the 354), and only the final dot waits
for it.

The upstream is a raw SMTP peer on loopback that keeps a timeline of what it received; the store
is a private redis-server whose writes the peer pauses (``CLIENT PAUSE ... WRITE``, which holds
every script) when it answers RCPT, before the relay starts its mark: the mark cannot land
while the pause lasts. The peer lifts the pause when the first bytes of the body reach it, so
the body can only get there if the relay sent it with its mark still in flight, and the final
dot must come after the lift. A pause kept past the store timeout fails the mark, which ends
the transaction with a reset and no dot.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import pytest
import redis
import trustme

from relay.core import replies
from relay.core.fingerprint import fingerprint, store_key
from relay.core.interfaces import State
from relay.core.recipients import normalize_recipient
from tests.support.clients import message, send
from tests.support.peers import ScriptedPeer, serve_peer
from tests.support.redis_servers import free_port, wait_for
from tests.support.relays import MakeRelay
from tests.support.waiting import until

pytestmark = pytest.mark.both_loops  # asyncio's loop and uvloop's (tests/conftest.py)



PAUSE_LIMIT_MS = 60_000
"""The server lifts a pause by itself after this long, should a test end without lifting it."""


async def redis_command(port: int, *args: str) -> bytes:
    """Send one command to the Redis on 127.0.0.1:``port`` on a connection of its own; its
    first reply line."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"*%d\r\n" % len(args) + b"".join(
            b"$%d\r\n%s\r\n" % (len(a), a.encode()) for a in args))
        return await asyncio.wait_for(reader.readline(), 30)
    finally:
        writer.close()


@dataclass(kw_only=True)
class TimelinePeer(ScriptedPeer):
    """An SMTP peer that records when it saw DATA, the first body bytes and the final dot
    (``time.monotonic()``), and pauses the writes of the Redis on ``redis_port`` when it
    answers RCPT. With ``lift_on_body`` it lifts the pause when the first body bytes arrive
    (at the latest once the dot has: a relay that held the body back for its mark then shows
    a dot before the lift); ``lifted`` is when it sent the lift."""

    name = b"timeline.test"

    redis_port: int
    lift_on_body: bool
    seen: dict[str, float] = field(default_factory=dict)
    lifted: float | None = None

    async def on_rcpt(self, writer: asyncio.StreamWriter) -> None:
        reply = await redis_command(self.redis_port, "CLIENT", "PAUSE", str(PAUSE_LIMIT_MS),
                                    "WRITE")
        assert reply == b"+OK\r\n", reply
        writer.write(b"250 ok\r\n")

    async def lift(self) -> None:
        """End the pause (once): the mark held by it lands."""
        if self.lifted is None:
            self.lifted = time.monotonic()
            reply = await redis_command(self.redis_port, "CLIENT", "UNPAUSE")
            assert reply == b"+OK\r\n", reply

    async def on_data(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        self.seen["DATA"] = time.monotonic()
        return await super().on_data(reader, writer)

    async def read_to_dot(self, reader: asyncio.StreamReader,
                          each: Callable[[bytes], Awaitable[None]] | None = None) -> bool:
        """The message up to its dot (``ScriptedPeer.read_to_dot``), noting when its first
        bytes and its dot arrived in ``seen``."""
        async def first(chunk: bytes) -> None:
            self.seen.setdefault("body", time.monotonic())
            if self.lift_on_body:
                await self.lift()
            if each is not None:
                await each(chunk)

        if not await super().read_to_dot(reader, first):
            return False
        self.seen.setdefault("body", time.monotonic())  # body and dot in one chunk
        self.seen["dot"] = time.monotonic()
        if self.lift_on_body:
            await self.lift()
        return True


@contextlib.asynccontextmanager
async def timeline_peer(redis_port: int, lift_on_body: bool, tls: ssl.SSLContext | None = None
                        ) -> AsyncIterator[TimelinePeer]:
    """Serve a TimelinePeer on 127.0.0.1:0 (TLS from the first byte with ``tls``); the pause
    is lifted when it ends."""
    peer = TimelinePeer(redis_port=redis_port, lift_on_body=lift_on_body)
    try:
        async with serve_peer(peer, tls) as served:
            yield served
    finally:
        await redis_command(redis_port, "CLIENT", "UNPAUSE")


@dataclass(frozen=True)
class PausableRedis:
    """A private redis-server of one test."""

    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


@pytest.fixture
def private_redis() -> Iterator[PausableRedis]:
    """A redis-server on a free loopback port, no persistence; stopped at the end of the
    test."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (.ci/run installs it)")
    port = free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with contextlib.closing(redis.Redis(port=port, socket_timeout=0.5)) as client:
            wait_for("the private redis-server answering", lambda: bool(client.ping()), 30.0)
        yield PausableRedis(port)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _key(prefix: str) -> str:
    return store_key(prefix, fingerprint(normalize_recipient("user@example.net"), "welcome",
                                         "K-1"))


@pytest.fixture(scope="module")
def server_tls() -> ssl.SSLContext:
    """A server context with a trustme certificate for 127.0.0.1."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    trustme.CA().issue_cert("127.0.0.1").configure_cert(context)
    return context


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
async def test_the_mark_overlaps_data_and_body_and_the_dot_waits_for_it(
        make_relay: MakeRelay, private_redis: PausableRedis, server_tls: ssl.SSLContext,
        tls: bool) -> None:
    """The store holds the mark until the body reaches the upstream: DATA and the body
    reach it before the mark lands, the final dot only after; the message is relayed and
    SENT. (The store timeout is generous: a loaded runner may take seconds from the 354 to
    the first body bytes.)"""
    async with timeline_peer(private_redis.port, True, server_tls if tls else None) as peer:
        upstream_tls = {"upstream_tls": "tls", "upstream_verify": False} if tls else {}
        relay = await make_relay(upstream=f"127.0.0.1:{peer.port}", store=private_redis.url,
                                 store_timeout=10.0, **upstream_tls)
        result = await send(relay.port, ["user@example.net"], message())
        assert result.code == 250, result
        assert peer.lifted is not None
        assert peer.seen["DATA"] < peer.seen["body"] <= peer.lifted < peer.seen["dot"]
        assert relay.store is not None
        record = await relay.store.inspect(_key(relay.settings.store_prefix))
        assert record.state is State.SENT


async def test_a_failed_mark_resets_the_transfer_without_the_dot(
        make_relay: MakeRelay, private_redis: PausableRedis) -> None:
    """The store holds its writes past the store timeout during the mark: the client gets
    the store's 451, the upstream had DATA and the body, never the dot (the connection is
    reset)."""
    async with timeline_peer(private_redis.port, False) as peer:
        relay = await make_relay(upstream=f"127.0.0.1:{peer.port}", store=private_redis.url,
                                 store_timeout=2.0)
        result = await send(relay.port, ["user@example.net"], message())
        assert (result.code, result.text) == (451, replies.STORE_DOWN.text), result
        assert "DATA" in peer.seen and "dot" not in peer.seen
        await until(lambda: peer.cut == 1, within_s=30, what="the reset at the upstream")
