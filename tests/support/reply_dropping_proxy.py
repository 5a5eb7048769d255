"""A TCP proxy between the relay and a real smarthost that loses, on demand, what makes a
message in doubt: the smarthost's reply to the final dot (``drop_reply``: the smarthost has
the message, the relay never hears so), or the final dot itself (``lose_dot``: the smarthost
never gets the message). Everything else passes both ways, byte for byte."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

TERMINATOR = b"\r\n.\r\n"
"""The end of a message's data (RFC 5321 section 4.1.1.4); nothing else on the wire of a
DATA transaction holds it (the body is dot-stuffed, commands are single lines)."""


@dataclass
class ReplyDroppingProxy:
    """Forwards 127.0.0.1:``port`` to 127.0.0.1:``target_port``. ``mode``, read when a
    message's final dot comes from the client: ``pass``, ``drop_reply`` (the dot goes on, the
    smarthost's reply to it is read and dropped, then both connections are closed) or
    ``lose_dot`` (the data goes on without its final ``.`` line, then both are closed).
    ``dots`` counts final dots seen, ``dropped`` the replies dropped and ``lost`` the dots
    lost."""

    target_port: int
    mode: str = "pass"
    port: int = 0
    dots: int = 0
    dropped: int = 0
    lost: int = 0
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def handle(self, client_r: asyncio.StreamReader,
                     client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        swallow = asyncio.Event()
        upward = asyncio.create_task(self._upward(client_r, server_w, client_w, swallow))
        downward = asyncio.create_task(self._downward(server_r, client_w, server_w, swallow))
        self.tasks.update((upward, downward))
        await asyncio.gather(upward, downward, return_exceptions=True)
        for writer in (client_w, server_w):
            writer.close()

    async def _upward(self, client_r: asyncio.StreamReader, server_w: asyncio.StreamWriter,
                      client_w: asyncio.StreamWriter, swallow: asyncio.Event) -> None:
        tail = b""
        with contextlib.suppress(OSError):
            while chunk := await client_r.read(65536):
                seen = tail + chunk
                at = seen.find(TERMINATOR)
                if at < 0:
                    tail = seen[-(len(TERMINATOR) - 1):]
                    server_w.write(chunk)
                    await server_w.drain()
                    continue
                self.dots += 1
                if self.mode == "lose_dot":  # up to the last data line's end, not the dot
                    server_w.write(chunk[:max(0, at + 2 - len(tail))])
                    await server_w.drain()
                    self.lost += 1
                    break
                if self.mode == "drop_reply":
                    swallow.set()
                server_w.write(chunk)
                await server_w.drain()
                tail = b""
        for writer in (server_w, client_w):
            writer.close()

    async def _downward(self, server_r: asyncio.StreamReader, client_w: asyncio.StreamWriter,
                        server_w: asyncio.StreamWriter, swallow: asyncio.Event) -> None:
        with contextlib.suppress(OSError):
            while chunk := await server_r.read(65536):
                if swallow.is_set():  # the reply to the dot: dropped, both sides closed
                    self.dropped += 1
                    break
                client_w.write(chunk)
                await client_w.drain()
        for writer in (server_w, client_w):
            writer.close()


@contextlib.asynccontextmanager
async def serve_proxy(target_port: int) -> AsyncIterator[ReplyDroppingProxy]:
    """A :class:`ReplyDroppingProxy` to ``target_port`` on 127.0.0.1:0 until the block ends."""
    proxy = ReplyDroppingProxy(target_port)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = await asyncio.start_server(proxy.handle, sock=sock)
    proxy.port = sock.getsockname()[1]
    try:
        yield proxy
    finally:
        server.close()
        for task in proxy.tasks:
            task.cancel()
