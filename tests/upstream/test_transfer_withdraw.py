"""The reset that withdraws a final dot (relay.upstream.transfer.withdraw) answers for the
moment the socket closes, not the moment it was asked.

The loop closes an aborted socket at its next turn; the kernel goes on sending meanwhile. A
peer that reads again in that gap gets the whole message and its dot before the reset: the
relay had counted the bytes unsent a moment before, released the record as "the dot can
never arrive", and the retry was a second copy (a nemesis run on PostgreSQL: a link stalled,
the wait for the final reply ended, and the stall ended in the gap of a loaded loop).

Real sockets over loopback, small buffers so that the last of a 256 KiB payload waits in the
relay's kernel; the peer reads everything in a callback queued before the abort's close.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from relay.upstream.transfer import kernel_unsent, withdraw, write_backlog
from tests.support.waiting import until

pytestmark = pytest.mark.both_loops  # asyncio's loop and uvloop's (tests/conftest.py)

PAYLOAD = bytes(range(256)) * 1024  # 256 KiB, more than the peer's receive window


@dataclass
class Link:
    """The relay's side (an asyncio transport) and the peer's (a blocking socket that has not
    read yet)."""

    transport: asyncio.Transport
    peer: socket.socket


@pytest.fixture
async def link() -> AsyncIterator[Link]:
    """A connection whose peer does not read: PAYLOAD written, asyncio's buffer empty, the
    kernel still holding unsent bytes of it."""
    server = socket.create_server(("127.0.0.1", 0))
    server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
    loop = asyncio.get_running_loop()
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1024 * 1024)
    client.setblocking(False)
    await loop.sock_connect(client, server.getsockname())
    peer, _ = server.accept()
    server.close()
    transport, _ = await loop.create_connection(asyncio.Protocol, sock=client)
    transport.write(PAYLOAD)
    await until(lambda: write_backlog(transport) == 0 and bool(kernel_unsent(transport)))
    yield Link(transport, peer)
    transport.abort()
    peer.close()


def _read_all(peer: socket.socket) -> bytes:
    """What the peer can read until the relay's side closes or resets (10 s at most)."""
    peer.settimeout(10)
    got = bytearray()
    try:
        while chunk := peer.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    return bytes(got)


async def test_a_peer_that_reads_before_the_close_means_the_dot_may_have_left(
        link: Link) -> None:
    """The peer reads every byte between the ask and the close: withdraw says 0 (the dot may
    have left), and the peer indeed got the whole payload."""
    got: list[bytes] = []
    peer = link.peer
    peer.settimeout(10)

    def read_payload() -> None:
        data = bytearray()
        while len(data) < len(PAYLOAD):
            data += peer.recv(65536)
        got.append(bytes(data))

    asyncio.get_running_loop().call_soon(read_payload)  # runs before the abort's close
    assert await withdraw(link.transport) == 0
    assert got == [PAYLOAD]


async def test_a_peer_that_does_not_read_is_reset_before_the_last_bytes(link: Link) -> None:
    """The peer reads nothing until the close: withdraw says how many bytes were unsent, and
    the peer never gets the payload's end (its read ends in a reset)."""
    unsent = await withdraw(link.transport)
    assert unsent > 0
    got = await asyncio.to_thread(_read_all, link.peer)
    assert len(got) <= len(PAYLOAD) - unsent
