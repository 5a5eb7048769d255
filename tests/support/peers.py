"""Scripted raw SMTP peers for the upstream tests: one command loop, each test's behaviour in
the hooks (``on_rcpt``, ``on_data``), served on 127.0.0.1 by :func:`serve_peer`."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

TERMINATOR = b"\r\n.\r\n"
"""CRLF . CRLF: the end of a message's data (RFC 5321 section 4.1.1.4)."""


@dataclass(kw_only=True)
class ScriptedPeer:
    """An SMTP server loop for tests: greets as ``name``, answers EHLO with ``ehlo`` (the
    extension lines after the first), QUIT with 221, RCPT with :meth:`on_rcpt`, DATA with
    :meth:`on_data` (False ends the connection), MAIL with :meth:`on_mail` (likewise), anything
    else 250.

    ``port`` is set by :func:`serve_peer`; ``cut`` counts connections that ended in an OSError
    (a reset from the relay) or, through :meth:`read_to_dot`, before the final dot;
    ``handlers`` holds the connection tasks (cancelled when the server ends).
    """

    name: ClassVar[bytes] = b"peer.test"
    ehlo: ClassVar[tuple[bytes, ...]] = (b"8BITMIME",)

    port: int = 0
    cut: int = 0
    handlers: set[asyncio.Task[None]] = field(default_factory=set)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one connection (the ``client_connected_cb`` of ``asyncio.start_server``)."""
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        writer.write(b"220 " + self.name + b" ESMTP\r\n")
        try:
            while line := await reader.readline():
                verb = line[:4].upper()
                if verb == b"EHLO":
                    lines = [self.name, *self.ehlo]
                    writer.write(b"".join(
                        b"250" + (b" " if i == len(lines) - 1 else b"-") + text + b"\r\n"
                        for i, text in enumerate(lines)))
                elif verb == b"MAIL":
                    if not await self.on_mail(writer):
                        return
                elif verb == b"RCPT":
                    await self.on_rcpt(writer)
                elif verb == b"DATA":
                    if not await self.on_data(reader, writer):
                        return
                elif verb == b"QUIT":
                    writer.write(b"221 bye\r\n")
                    return
                else:
                    writer.write(b"250 ok\r\n")
                await writer.drain()
        except OSError:
            self.cut += 1  # a reset from the relay
        finally:
            writer.close()

    async def on_mail(self, writer: asyncio.StreamWriter) -> bool:
        """Answer MAIL (250); False ends the connection."""
        writer.write(b"250 ok\r\n")
        return True

    async def on_rcpt(self, writer: asyncio.StreamWriter) -> None:
        """Answer RCPT (250)."""
        writer.write(b"250 ok\r\n")

    async def on_data(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Answer DATA: 354, the message up to its dot, 250; False when the relay hung up."""
        writer.write(b"354 go ahead\r\n")
        await writer.drain()
        if not await self.read_to_dot(reader):
            return False
        writer.write(b"250 2.0.0 queued\r\n")
        return True

    async def read_to_dot(self, reader: asyncio.StreamReader,
                          each: Callable[[bytes], Awaitable[None]] | None = None) -> bool:
        """Read the message up to its final dot, awaiting ``each(chunk)`` after every chunk
        that did not end it; False (and ``cut`` counted) when the relay hung up first."""
        tail = b""
        while True:
            chunk = await reader.read(64 * 1024)
            if not chunk:
                self.cut += 1
                return False
            if TERMINATOR in tail + chunk:
                return True
            tail = (tail + chunk)[-len(TERMINATOR):]
            if each is not None:
                await each(chunk)


@dataclass(kw_only=True)
class DotSwallower(ScriptedPeer):
    """An upstream that reads each message to its final dot and then hangs up without a reply
    while ``swallow`` is set (the relay holds the message in doubt), else answers 250;
    ``received`` counts the messages whose dot it read."""

    swallow: bool = True
    received: int = 0

    async def on_data(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"354 go ahead\r\n")
        await writer.drain()
        if not await self.read_to_dot(reader):
            return False
        self.received += 1
        if self.swallow:
            return False
        writer.write(b"250 2.0.0 queued as Q1\r\n")
        return True


P = TypeVar("P", bound=ScriptedPeer)


@contextlib.asynccontextmanager
async def serve_peer(peer: P, tls: ssl.SSLContext | None = None, *,
                     rcvbuf: int | None = None) -> AsyncIterator[P]:
    """Serve ``peer`` on 127.0.0.1:0 (TLS from the first byte with ``tls``; a fixed receive
    buffer of ``rcvbuf`` bytes, so the kernel does not grow it on loopback) until the block
    ends; then close the server and cancel the peer's connections."""
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.bind(("127.0.0.1", 0))
    server = await asyncio.start_server(peer.handle, sock=sock, ssl=tls)
    peer.port = sock.getsockname()[1]
    try:
        yield peer
    finally:
        server.close()
        for task in peer.handlers:
            task.cancel()
