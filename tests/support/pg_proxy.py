"""A TCP proxy in front of the test PostgreSQL (or any TCP server: the test Redis) that can
make it hang or refuse (a server that stops answering mid-statement keeps its connections
open)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from urllib.parse import urlsplit, urlunsplit

from tests.support.postgres import POSTGRES_URL


class PgProxy:
    """A TCP proxy on a free loopback port in front of ``host:port``, in the running loop.

    ``hang()``: bytes are still read from both sides but no longer passed on, and new
    connections are accepted and never answered (a peer that hangs, not one that refuses);
    ``refuse()``: every connection is closed and new ones are closed at once; ``resume()``:
    traffic flows again (bytes held while hung are passed on); ``hold_replies()``: requests
    still pass, the server's answers wait until ``resume()`` (a reply lost on its way, for a
    while); ``drop()``: every connection is closed with the bytes held while hung (a partition
    that outlasted its connections: what their peers sent never arrives), new ones flow.
    ``partitioned`` (set it):
    connections accepted meanwhile are read and never answered, also after it is cleared (an
    address that drops packets; ``blackholed`` counts them). ``connect_delay_s``: each new
    connection waits that long before it is connected through (a database slow to connect).
    ``close()`` ends everything.
    """

    def __init__(self, host: str, port: int, *, connect_delay_s: float = 0.0) -> None:
        self._target = (host, port)
        self.connect_delay_s = connect_delay_s
        self.partitioned = False
        self.blackholed = 0
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._replies = asyncio.Event()  # the server's bytes may pass on
        self._replies.set()
        self._refusing = False
        self._generation = 0  # drop() ends the connections of earlier generations
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        """Listen on a free loopback port (``self.port``)."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    def url(self, url: str) -> str:
        """``url`` (a postgresql:// or redis:// URL) pointed at this proxy."""
        parts = urlsplit(url)
        netloc = parts.netloc.rsplit("@", 1)
        user = netloc[0] + "@" if len(netloc) == 2 else ""
        return urlunsplit(parts._replace(netloc=f"{user}127.0.0.1:{self.port}"))

    def hang(self) -> None:
        """Stop passing bytes on (connections stay open)."""
        self._flowing.clear()

    def hold_replies(self) -> None:
        """Hold the server's bytes (requests still pass on)."""
        self._replies.clear()

    def refuse(self) -> None:
        """Close every connection; close new ones at once."""
        self._refusing = True
        for writer in self._writers:
            writer.close()
        self._writers.clear()

    def drop(self) -> None:
        """Close every connection, dropping the bytes held while hung; new connections flow."""
        self._generation += 1
        for writer in self._writers:
            writer.close()
        self._writers.clear()
        self.resume()

    def resume(self) -> None:
        """Pass bytes on again and accept new connections normally."""
        self._refusing = False
        self._flowing.set()
        self._replies.set()

    async def close(self) -> None:
        """Stop listening and end every connection and task."""
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            if self._refusing:
                writer.close()
                return
            self._writers.append(writer)
            if self.partitioned:
                self.blackholed += 1
                while await reader.read(65536):
                    pass
                return
            if self.connect_delay_s:
                await asyncio.sleep(self.connect_delay_s)
            await self._flowing.wait()
            up_reader, up_writer = await asyncio.open_connection(*self._target)
            self._writers.append(up_writer)
            await asyncio.gather(self._pipe(reader, up_writer),
                                 self._pipe(up_reader, writer, self._replies))
        except (OSError, asyncio.IncompleteReadError):
            writer.close()
        except asyncio.CancelledError:  # close(): the task ends quietly (asyncio's server
            writer.close()  # callback would log a cancelled handler as an error)
        finally:
            self._tasks.discard(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    gate: asyncio.Event | None = None) -> None:
        generation = self._generation
        try:
            while data := await reader.read(65536):
                await self._flowing.wait()
                if gate is not None:
                    await gate.wait()
                if self._refusing or self._generation != generation:
                    break
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def pg_proxy() -> AsyncIterator[PgProxy]:
    """A started :class:`PgProxy` in front of the test PostgreSQL (``RELAY_TEST_POSTGRES_URL``'s
    host and port); resumed and closed at the end."""
    async with proxy_to(POSTGRES_URL, default_port=5432) as proxy:
        yield proxy


@contextlib.asynccontextmanager
async def proxy_to(url: str, *, default_port: int = 6379) -> AsyncIterator[PgProxy]:
    """A started :class:`PgProxy` in front of the host and port of ``url`` (any TCP server:
    a Redis too; ``proxy.url(url)`` is ``url`` through it); resumed and closed at the end."""
    proxy = await start_proxy(url, default_port=default_port)
    try:
        yield proxy
    finally:
        proxy.resume()
        await proxy.close()


async def start_proxy(url: str, *, default_port: int = 6379) -> PgProxy:
    """A started :class:`PgProxy` in front of the host and port of ``url``; the caller
    closes it."""
    parts = urlsplit(url)
    proxy = PgProxy(parts.hostname or "127.0.0.1", parts.port or default_port)
    await proxy.start()
    return proxy
