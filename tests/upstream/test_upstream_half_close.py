"""An upstream that half-closes (FIN) while the final dot still sits in the relay's write buffer.

The peer is a real TCP SMTP peer on loopback. It reads the body slowly until the relay has handed
its transport the whole body and some of it is still buffered in the process, then the SENDING
hook lets the final dot go (it joins the buffer), and the peer sends FIN (``write_eof``: it
stops writing but can still read) and reads on. aiosmtplib takes the EOF as a lost connection
and asyncio closes the transport gracefully, which goes on flushing the buffer: the relay calls
the transfer lost (``dot_written`` False, reservation released) and must then reset the
connection, or the dot reaches a peer that may deliver it, and the client's retry is a second
copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import aiosmtplib
import pytest

from relay.core.interfaces import DeliveryProgress, OutboundMessage, RcptStatus
from relay.upstream import transfer
from relay.upstream.smtp import SmtpUpstream, SmtpUpstreamConfig
from relay.upstream.transfer import is_wire, write_backlog
from tests.support.waiting import until

pytestmark = pytest.mark.both_loops  # asyncio's loop and uvloop's (tests/conftest.py)

TERMINATOR = b"\r\n.\r\n"
RCVBUF_BYTES = 64 * 1024
BODY_BYTES = 3_000_000
BUFFERED_BELOW = 512 * 1024  # under AHEAD_BYTES: the relay would have topped it up by now


@dataclass
class HalfClosePeer:
    """Answers up to ``354``; then the test reads the body through ``reader``."""

    port: int = 0
    in_data: asyncio.Event = field(default_factory=asyncio.Event)
    reader: asyncio.StreamReader | None = None
    writer: asyncio.StreamWriter | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"220 halfclose.test ESMTP\r\n")
        while line := await reader.readline():
            verb = line[:4].upper()
            if verb == b"EHLO":
                writer.write(b"250-halfclose.test\r\n250 8BITMIME\r\n")
            elif verb == b"DATA":
                writer.write(b"354 go ahead\r\n")
                await writer.drain()
                self.reader, self.writer = reader, writer
                self.in_data.set()
                return
            else:
                writer.write(b"250 ok\r\n")
            await writer.drain()


@contextlib.asynccontextmanager
async def half_close_peer() -> AsyncIterator[HalfClosePeer]:
    peer = HalfClosePeer()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF_BYTES)
    sock.bind(("127.0.0.1", 0))
    server = await asyncio.start_server(peer.handle, sock=sock)
    peer.port = sock.getsockname()[1]
    try:
        yield peer
    finally:
        if peer.writer is not None:
            peer.writer.transport.abort()
        server.close()


async def test_a_half_close_with_the_dot_still_buffered_never_lets_the_dot_follow(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """FIN from the peer while the dot is in the relay's buffer: the relay reports the message
    not sent (dot not written, a temporary refusal), so the peer must never receive the dot.
    (The SENDING mark starts here with up to BUFFERED_BELOW of the body still buffered, so that
    the dot can join a buffer the kernel cannot take whole.)"""
    monkeypatch.setattr(transfer, "MARK_AHEAD_BYTES", BUFFERED_BELOW)
    async with half_close_peer() as peer:
        upstream = SmtpUpstream(config=SmtpUpstreamConfig(
            host="127.0.0.1", port=peer.port, local_hostname="relay.test",
            command_timeout_s=30.0, final_timeout_s=30.0, pool_size=0))
        opened: list[aiosmtplib.SMTP] = []
        open_new = upstream._pool._open_new

        async def watched() -> aiosmtplib.SMTP:  # the test reads the connection's backlog
            smtp = await open_new()
            sock = smtp.transport.get_extra_info("socket") if smtp.transport else None
            if sock is not None:  # fixed: the kernel does not grow it under the test
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, RCVBUF_BYTES)
            opened.append(smtp)
            return smtp

        upstream._pool._open_new = watched
        gate = asyncio.Event()

        async def before_dot(_accepted: Sequence[str]) -> bool:
            await gate.wait()
            return True

        progress = DeliveryProgress(before_dot=before_dot)
        content = b"Subject: half close\r\n\r\n" + b"x" * 998 + b"\r\n"
        content *= BODY_BYTES // len(content)
        delivery = asyncio.ensure_future(upstream.deliver(OutboundMessage(
            mail_from="a@example.com", rcpt_tos=["b@example.net"], content=content), progress))
        await asyncio.wait_for(peer.in_data.wait(), 30)
        assert peer.reader is not None and peer.writer is not None
        transport = opened[0].transport
        assert is_wire(transport)
        received = bytearray()
        # read slowly until the relay handed over the whole body and still buffers part of it
        while not 0 < write_backlog(transport) < BUFFERED_BELOW:
            received += await asyncio.wait_for(peer.reader.read(16 * 1024), 30)
            await asyncio.sleep(0.005)
        held = -1
        while held != write_backlog(transport):  # the kernel took what it could
            held = write_backlog(transport)
            await asyncio.sleep(0.05)
        gate.set()  # the dot joins the buffer
        await until(lambda: write_backlog(transport) == held + 3, 10, "the dot buffered")
        peer.writer.write_eof()  # FIN: the peer stops writing, still reads
        result = await asyncio.wait_for(delivery, 30)
        with contextlib.suppress(ConnectionError):
            while chunk := await asyncio.wait_for(peer.reader.read(256 * 1024), 30):
                received += chunk
        [outcome] = result.recipients.values()
        assert outcome.status is RcptStatus.REFUSED and not progress.dot_written, outcome
        assert not received.endswith(TERMINATOR), "the dot followed a transfer given up"
        await upstream.close()
