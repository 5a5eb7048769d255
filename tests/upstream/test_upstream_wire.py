"""A slow upstream link never makes a duplicate (design.md §1).

The upstream here is a real TCP (or TLS) peer on loopback with a small receive buffer that
pauses its reads after ``354`` or reads at a fixed rate, so the message backs up in the
relay's write buffers as on a slow WAN link. What the peer receives is checked byte for byte:
after the relay gave up on a transfer (451, reservation released) the peer never sees the
final dot, and a transfer that keeps moving is never cut, however long it takes.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
import trustme

from relay.app import Relay
from relay.core import replies
from relay.core.fingerprint import fingerprint, store_key
from relay.core.interfaces import State
from relay.core.recipients import normalize_recipient
from relay.store.redis.store import RedisStore
from relay.upstream.transfer import is_wire, write_backlog
from tests.support.clients import message, send
from tests.support.peers import ScriptedPeer, serve_peer
from tests.support.relays import MakeRelay
from tests.support.waiting import until

pytestmark = pytest.mark.both_loops  # asyncio's loop and uvloop's (tests/conftest.py)

RCVBUF_BYTES = 64 * 1024  # fixed, so the kernel does not grow it to tens of MB on loopback


@dataclass(kw_only=True)
class SlowPeer(ScriptedPeer):
    """An SMTP peer whose reads after ``354`` pause for ``pause_s`` or run at ``rate_bps``;
    with ``early_reply`` it reads a first chunk and answers it before pausing.

    ``dots`` counts messages received up to their final dot (each answered 250);
    ``cut`` counts transfers that ended (EOF or reset) before the dot.
    """

    name = b"slow.test"
    ehlo = (b"8BITMIME", b"SIZE 100000000")

    pause_s: float = 0.0
    rate_bps: float = 0.0
    early_reply: bytes = b""
    dots: int = 0
    data_started: asyncio.Event = field(default_factory=asyncio.Event)

    async def on_data(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"354 go ahead\r\n")
        await writer.drain()
        if self.early_reply:
            await reader.read(64 * 1024)
            writer.write(self.early_reply + b"\r\n")
            await writer.drain()
        self.data_started.set()
        await asyncio.sleep(self.pause_s)

        async def paced(chunk: bytes) -> None:
            if self.rate_bps:
                await asyncio.sleep(len(chunk) / self.rate_bps)

        if not await self.read_to_dot(reader, paced):
            return False
        self.dots += 1
        writer.write(b"250 2.0.0 queued\r\n")
        return True

    async def finished(self, timeout_s: float = 30.0) -> None:
        """Wait until every connection the peer served has ended."""
        deadline = time.monotonic() + timeout_s
        while any(not t.done() for t in self.handlers):
            assert time.monotonic() < deadline, "the peer's connections did not end"
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def slow_peer(tls: ssl.SSLContext | None = None, *, pause_s: float = 0.0,
                    rate_bps: float = 0.0, early_reply: bytes = b""
                    ) -> AsyncIterator[SlowPeer]:
    """Serve a SlowPeer on 127.0.0.1:0 (TLS from the first byte when ``tls`` is given)."""
    peer = SlowPeer(pause_s=pause_s, rate_bps=rate_bps, early_reply=early_reply)
    async with serve_peer(peer, tls, rcvbuf=RCVBUF_BYTES):
        yield peer


@pytest.fixture(scope="module")
def server_tls() -> ssl.SSLContext:
    """A server context with a trustme certificate for 127.0.0.1."""
    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    return context


def big_message(megabytes: int) -> bytes:
    """A CRLF message of about ``megabytes`` MB with the dedupe headers."""
    return message(body=("x" * 998 + "\r\n") * (megabytes * 1000))


def key_for(prefix: str, rcpt: str = "user@example.net") -> str:
    """Store key of (rcpt, template 'welcome', key 'K-1')."""
    return store_key(prefix, fingerprint(normalize_recipient(rcpt), "welcome", "K-1"))


async def slow_relay(make_relay: MakeRelay, peer: SlowPeer, tls: bool, **extra: object) -> Relay:
    """A relay in front of ``peer`` with a 1 s command (stall) timeout."""
    settings: dict[str, object] = {
        "upstream": f"127.0.0.1:{peer.port}", "upstream_command_timeout": 1.0,
        "upstream_timeout": 20.0, "max_message_size": 64 * 1024 * 1024}
    if tls:
        settings.update(upstream_tls="tls", upstream_verify=False)
    settings.update(extra)
    return await make_relay(**settings)


@pytest.mark.slow  # a transfer paced over seconds
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
async def test_a_stalled_transfer_is_given_up_and_its_dot_never_follows(
    make_relay: MakeRelay, server_tls: ssl.SSLContext, tls: bool
) -> None:
    """An upstream pausing its reads past the stall timeout: 451, released, no dot ever sent."""
    async with slow_peer(server_tls if tls else None, pause_s=4.0) as peer:
        relay = await slow_relay(make_relay, peer, tls)
        result = await send(relay.port, ["user@example.net"], big_message(8))
        assert (result.code, result.text) == (451, replies.UPSTREAM_TIMEOUT.text)
        assert relay.store is not None
        record = await relay.store.inspect(key_for(relay.settings.store_prefix))
        assert record.state is State.ABSENT
        await peer.finished()
        assert (peer.dots, peer.cut) == (0, 1)


@pytest.mark.slow  # a transfer paced over seconds
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
async def test_a_slow_but_moving_transfer_is_not_cut(
    make_relay: MakeRelay, server_tls: ssl.SSLContext, tls: bool
) -> None:
    """8 MB through a 1 MB/s upstream take ~8 s against a 1 s stall timeout and are sent
    once. The kernel takes the message in bursts more than 1 s apart (a full send buffer, 4 MB
    on loopback, is writable again only once a third of it is free) while the link moves all
    along: the bytes the kernel sends count as progress too. The wait for the final reply
    (60 s) covers the 4 MB still in the kernel when it took the dot, on a loaded runner too."""
    async with slow_peer(server_tls if tls else None, rate_bps=1_000_000) as peer:
        relay = await slow_relay(make_relay, peer, tls, upstream_timeout=60.0)
        started = time.monotonic()
        result = await send(relay.port, ["user@example.net"], big_message(8))
        assert result.code == 250, result
        assert time.monotonic() - started > 3.0  # far longer than the command timeout
        assert peer.dots == 1


@pytest.mark.slow  # a transfer paced over seconds
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
async def test_a_shutdown_cutting_the_transfer_resets_it_before_the_dot(
    make_relay: MakeRelay, server_tls: ssl.SSLContext, tls: bool
) -> None:
    """A stop past its grace during a stalled transfer: released, and the dot never follows."""
    async with slow_peer(server_tls if tls else None, pause_s=4.0) as peer:
        relay = await slow_relay(make_relay, peer, tls, upstream_command_timeout=30.0,
                                 upstream_timeout=40.0, lease=60.0, shutdown_grace=0.5)
        sending = asyncio.create_task(
            send(relay.port, ["user@example.net"], big_message(8)))
        await asyncio.wait_for(peer.data_started.wait(), 20)
        await asyncio.sleep(1.0)  # the message is backing up in the relay's buffers
        await relay.stop()
        result = await sending
        assert (result.code, result.text) == (451, replies.CUT_BY_SHUTDOWN.text)
        store = RedisStore.from_url(relay.settings.store)
        try:
            record = await store.inspect(key_for(relay.settings.store_prefix))
        finally:
            await store.close()
        assert record.state is State.ABSENT
        await peer.finished()
        assert (peer.dots, peer.cut) == (0, 1)


@pytest.mark.slow  # a peer that reads nothing for 4 s
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
async def test_no_final_reply_while_the_kernel_holds_the_dot_resets_and_releases(
    make_relay: MakeRelay, server_tls: ssl.SSLContext, tls: bool
) -> None:
    """2 MB go into the kernel at once to a peer that reads nothing for 4 s; the 1 s wait for
    the final reply ends with bytes still unsent: the connection is reset, the client gets the
    timeout's 451 (released, not in doubt), and the dot never reaches the peer."""
    async with slow_peer(server_tls if tls else None, pause_s=4.0) as peer:
        relay = await slow_relay(make_relay, peer, tls, upstream_command_timeout=10.0,
                                 upstream_timeout=1.0)
        result = await send(relay.port, ["user@example.net"], big_message(2))
        assert (result.code, result.text) == (451, replies.UPSTREAM_TIMEOUT.text), result
        assert relay.store is not None
        record = await relay.store.inspect(key_for(relay.settings.store_prefix))
        assert record.state is State.ABSENT
        await peer.finished()
        assert (peer.dots, peer.cut) == (0, 1)


@pytest.mark.parametrize(("early", "code", "state"), [
    (b"552 5.3.4 Message too big", 552, State.ABSENT),
    (b"250 2.0.0 queued already", 451, State.UNKNOWN),
])
async def test_a_reply_before_the_whole_message_stops_the_transfer(
    make_relay: MakeRelay, early: bytes, code: int, state: State
) -> None:
    """A reply mid-message resets the rest (no dot follows); only a refusal is taken as one."""
    async with slow_peer(pause_s=2.0, early_reply=early) as peer:
        relay = await slow_relay(make_relay, peer, False, upstream_command_timeout=10.0)
        result = await send(relay.port, ["user@example.net"], big_message(8))
        assert result.code == code, result
        assert relay.store is not None
        record = await relay.store.inspect(key_for(relay.settings.store_prefix))
        assert record.state is state
        await peer.finished()
        assert (peer.dots, peer.cut) == (0, 1)


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
async def test_the_write_backlog_counts_every_byte_the_kernel_has_not_taken(
    server_tls: ssl.SSLContext, tls: bool
) -> None:
    """8 MB written to a peer that reads nothing: the backlog is all of it but what the two
    small socket buffers hold (under TLS: the TLS layer's bytes plus its TCP transport's, on
    uvloop too, whose TLS transport alone reports 0), and 0 once the peer read everything."""
    size, window = 8_000_000, 1_000_000  # loopback keeps at most a few 64 KB buffers
    reading, done = asyncio.Event(), asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reading.wait()
        await reader.readexactly(size)
        writer.close()
        await writer.wait_closed()
        done.set()

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF_BYTES)
    sock.bind(("127.0.0.1", 0))
    server = await asyncio.start_server(handle, sock=sock, ssl=server_tls if tls else None)
    client_tls = ssl.create_default_context()
    client_tls.check_hostname, client_tls.verify_mode = False, ssl.CERT_NONE
    client = socket.create_connection(sock.getsockname())
    client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, RCVBUF_BYTES)
    client.setblocking(False)
    transport, _ = await asyncio.get_running_loop().create_connection(
        asyncio.Protocol, sock=client, ssl=client_tls if tls else None,
        server_hostname="127.0.0.1" if tls else None)
    try:
        assert is_wire(transport)
        transport.write(b"x" * size)
        await asyncio.sleep(0.5)
        backlog = write_backlog(transport)
        assert size - window < backlog <= size + size // 100, backlog  # + TLS record overhead
        reading.set()
        await until(lambda: write_backlog(transport) == 0, 30, "an empty backlog")
        await asyncio.wait_for(done.wait(), 30)  # the peer read all of it
    finally:
        transport.abort()
        server.close()
