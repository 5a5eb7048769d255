"""Every way a client connection can end gives its connection slot back, on both ports and both
loops: what a load balancer's health check (connect, close) or a TLS scanner (resets, partial or
whole ClientHellos, handshakes then gone) does hundreds of times leaves the relay at full
capacity (relay.smtp.implicit_tls, relay.smtp.session)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import ssl
import struct
from collections.abc import Awaitable, Callable

import pytest

from relay.app import Relay
from tests.support.clients import RawClient
from tests.support.pki import Pki, tls_relay
from tests.support.relays import MakeRelay
from tests.support.sink import Sink

pytestmark = pytest.mark.both_loops

MAX_CONNECTIONS = 6
DROPS_PER_WAY = 40  # per port: 6 ways x 2 ports x 40 = 480 connections per loop
Drop = Callable[[socket.socket], Awaitable[None]]


@functools.cache
def client_hello() -> bytes:
    """The bytes of a real TLS ClientHello (RFC 8446 section 4.1.2), as a client sends it;
    made once (a client context loads the system's CA certificates: hundreds of them cost
    seconds of CPU) and sent on every connection that needs one."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    tls = context.wrap_bio(incoming, outgoing, server_side=False)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


async def close(sock: socket.socket) -> None:
    """Connect, then close before any byte (a health check)."""


async def reset(sock: socket.socket) -> None:
    """Connect, then reset (SO_LINGER 0: the close sends RST)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


async def half_hello(sock: socket.socket) -> None:
    """Half a ClientHello, then close."""
    hello = client_hello()
    await asyncio.get_running_loop().sock_sendall(sock, hello[: len(hello) // 2])


async def whole_hello_then_reset(sock: socket.socket) -> None:
    """A whole ClientHello (the handshake is under way), then reset."""
    await asyncio.get_running_loop().sock_sendall(sock, client_hello())
    await reset(sock)


async def eof(sock: socket.socket) -> None:
    """Shut down the sending side (EOF), then close."""
    sock.shutdown(socket.SHUT_WR)


async def eof_after_hello(sock: socket.socket) -> None:
    """A whole ClientHello, then EOF before the handshake ends."""
    await asyncio.get_running_loop().sock_sendall(sock, client_hello())
    sock.shutdown(socket.SHUT_WR)


WAYS: tuple[Drop, ...] = (close, reset, half_hello, whole_hello_then_reset, eof, eof_after_hello)


async def drop_connection(port: int, drop: Drop) -> None:
    """Open one TCP connection to ``port``, end it by ``drop``, close the socket."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, ("127.0.0.1", port))
        with contextlib.suppress(OSError):  # the relay may have refused and closed already
            await drop(sock)
    finally:
        sock.close()


async def drop_after_handshake(relay: Relay, pki: Pki) -> None:
    """Finish the TLS handshake on the implicit-TLS port, then reset before reading a byte."""
    _, writer = await asyncio.wait_for(asyncio.open_connection(
        "127.0.0.1", relay.tls_port, ssl=pki.client_context, server_hostname="relay.test"), 10)
    writer.transport.abort()


async def greeted(port: int, context: ssl.SSLContext | None,
                  held: list[asyncio.StreamWriter]) -> str:
    """Connect (over TLS with ``context``), keep the connection open in ``held``, and return
    the first reply, or ``refused`` when the relay closed it first (the implicit-TLS port
    refuses with no byte)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(
            "127.0.0.1", port, ssl=context,
            server_hostname="relay.test" if context else None), 10)
    except OSError:
        return "refused"
    held.append(writer)
    try:
        return await RawClient(reader, writer).reply(wait_s=10)
    except ConnectionError:
        return "refused"


async def full_capacity(relay: Relay, pki: Pki) -> bool:
    """True when MAX_CONNECTIONS clients open at once, half on each port, are all greeted
    220."""
    ports = [(relay.port, None), (relay.tls_port, pki.client_context)] * (MAX_CONNECTIONS // 2)
    held: list[asyncio.StreamWriter] = []
    try:
        replies = await asyncio.gather(*(greeted(p, c, held) for p, c in ports))
    finally:
        for writer in held:
            writer.transport.abort()
    return all(text.startswith("220") for text in replies)


async def wait_for_full_capacity(relay: Relay, pki: Pki, deadline_s: float) -> bool:
    """Poll :func:`full_capacity` until it holds or ``deadline_s`` passed."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while not await full_capacity(relay, pki):
        if loop.time() > end:
            return False
        await asyncio.sleep(0.2)
    return True


async def test_hundreds_of_dropped_connections_leave_full_capacity(
    make_relay: MakeRelay, sink: Sink, pki: Pki
) -> None:
    """Connections closed, reset, cut mid-ClientHello or mid-handshake, half-closed or dropped
    after the handshake, on both ports, all give their slots back."""
    relay = await tls_relay(
        make_relay, sink, pki, max_connections=MAX_CONNECTIONS,
        max_connections_per_ip=MAX_CONNECTIONS, tls_handshake_timeout=1.0)
    for drop in WAYS:
        for port in (relay.port, relay.tls_port):
            for _ in range(DROPS_PER_WAY // 4):
                await asyncio.gather(*(drop_connection(port, drop) for _ in range(4)))
    for _ in range(DROPS_PER_WAY // 4):
        await asyncio.gather(*(drop_after_handshake(relay, pki) for _ in range(4)))
    assert await wait_for_full_capacity(relay, pki, deadline_s=20.0)


@pytest.mark.parametrize("drop", WAYS, ids=[w.__name__ for w in WAYS])
async def test_a_connection_dropped_before_its_handshake_gives_its_slot_back(
    make_relay: MakeRelay, sink: Sink, pki: Pki, drop: Drop
) -> None:
    """Each way of ending a connection to the implicit-TLS port, done to every slot, leaves
    every slot free again."""
    relay = await tls_relay(
        make_relay, sink, pki, max_connections=MAX_CONNECTIONS,
        max_connections_per_ip=MAX_CONNECTIONS, tls_handshake_timeout=1.0)
    await asyncio.gather(*(drop_connection(relay.tls_port, drop)
                           for _ in range(MAX_CONNECTIONS)))
    assert await wait_for_full_capacity(relay, pki, deadline_s=20.0)
