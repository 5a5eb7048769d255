"""The SENDING mark overlaps the body (it starts after the 354), and only the final dot waits
for it.

The upstream is a raw SMTP peer on loopback that keeps a timeline of what it received; the store
is a private redis-server that the peer puts to sleep (``DEBUG SLEEP``) when it answers RCPT,
before the relay starts its mark: the mark cannot land before the server wakes. With the
mark landing late the peer has DATA and the body before that, and the final dot only after; a
mark that fails (the server sleeps past the store timeout) ends the transaction with a reset
and no dot.
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



@dataclass(kw_only=True)
class TimelinePeer(ScriptedPeer):
    """An SMTP peer that records when it saw DATA, the first body bytes and the final dot
    (``time.monotonic()``), and sends ``DEBUG SLEEP sleep_s`` to the Redis on ``redis_port``
    when it answers RCPT; ``awake`` is when that sleep ended."""

    name = b"timeline.test"

    redis_port: int
    sleep_s: float
    seen: dict[str, float] = field(default_factory=dict)
    awake: float | None = None

    async def on_rcpt(self, writer: asyncio.StreamWriter) -> None:
        await self._put_redis_to_sleep()
        writer.write(b"250 ok\r\n")

    async def on_data(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        self.seen["DATA"] = time.monotonic()
        return await super().on_data(reader, writer)

    async def _put_redis_to_sleep(self) -> None:
        """Send DEBUG SLEEP on a connection of its own; note when the server answers."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.redis_port)
        arg = f"{self.sleep_s:g}".encode()
        writer.write(b"*3\r\n$5\r\nDEBUG\r\n$5\r\nSLEEP\r\n$%d\r\n%s\r\n" % (len(arg), arg))
        await writer.drain()
        await asyncio.sleep(0.05)  # the server is asleep before the relay's mark is sent

        async def wake() -> None:
            await reader.readline()
            self.awake = time.monotonic()
            writer.close()

        task = asyncio.ensure_future(wake())
        self.handlers.add(task)

    async def read_to_dot(self, reader: asyncio.StreamReader,
                          each: Callable[[bytes], Awaitable[None]] | None = None) -> bool:
        """The message up to its dot (``ScriptedPeer.read_to_dot``), noting when its first
        bytes and its dot arrived in ``seen``."""
        async def first(chunk: bytes) -> None:
            self.seen.setdefault("body", time.monotonic())
            if each is not None:
                await each(chunk)

        if not await super().read_to_dot(reader, first):
            return False
        self.seen.setdefault("body", time.monotonic())  # body and dot in one chunk
        self.seen["dot"] = time.monotonic()
        return True


@contextlib.asynccontextmanager
async def timeline_peer(redis_port: int, sleep_s: float, tls: ssl.SSLContext | None = None
                        ) -> AsyncIterator[TimelinePeer]:
    """Serve a TimelinePeer on 127.0.0.1:0 (TLS from the first byte with ``tls``)."""
    async with serve_peer(TimelinePeer(redis_port=redis_port, sleep_s=sleep_s), tls) as peer:
        yield peer


@dataclass(frozen=True)
class SleepyRedis:
    """A private redis-server that accepts DEBUG SLEEP (from loopback)."""

    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


@pytest.fixture
def private_redis() -> Iterator[SleepyRedis]:
    """A redis-server on a free loopback port with the DEBUG command enabled, no persistence;
    stopped at the end of the test."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (.ci/run installs it)")
    port = free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--enable-debug-command", "local"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with contextlib.closing(redis.Redis(port=port, socket_timeout=0.5)) as client:
            wait_for("the private redis-server answering", lambda: bool(client.ping()), 10.0)
        yield SleepyRedis(port)
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
        make_relay: MakeRelay, private_redis: SleepyRedis, server_tls: ssl.SSLContext,
        tls: bool) -> None:
    """The store answers the mark 0.6 s late: DATA and the body reach the upstream before
    it lands, the final dot only after; the message is relayed and SENT."""
    async with timeline_peer(private_redis.port, 0.6, server_tls if tls else None) as peer:
        upstream_tls = {"upstream_tls": "tls", "upstream_verify": False} if tls else {}
        relay = await make_relay(upstream=f"127.0.0.1:{peer.port}", store=private_redis.url,
                                 store_timeout=2.0, **upstream_tls)
        result = await send(relay.port, ["user@example.net"], message())
        assert result.code == 250, result
        assert peer.awake is not None
        assert peer.seen["DATA"] < peer.seen["body"] < peer.awake < peer.seen["dot"]
        assert relay.store is not None
        record = await relay.store.inspect(_key(relay.settings.store_prefix))
        assert record.state is State.SENT


async def test_a_failed_mark_resets_the_transfer_without_the_dot(
        make_relay: MakeRelay, private_redis: SleepyRedis) -> None:
    """The store sleeps past its timeout during the mark: the client gets the store's 451,
    the upstream had DATA and the body, never the dot (the connection is reset)."""
    async with timeline_peer(private_redis.port, sleep_s=1.5) as peer:
        relay = await make_relay(upstream=f"127.0.0.1:{peer.port}", store=private_redis.url,
                                 store_timeout=0.5)
        result = await send(relay.port, ["user@example.net"], message())
        assert (result.code, result.text) == (451, replies.STORE_DOWN.text), result
        assert "DATA" in peer.seen and "dot" not in peer.seen
        await until(lambda: peer.cut == 1, within_s=5, what="the reset at the upstream")
