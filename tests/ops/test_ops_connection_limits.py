"""The ops HTTP server bounds its connections (relay.ops.http): at most MAX_CONNECTIONS open at
once, each closed after IDLE_TIMEOUT_S with no byte from its client, while the SMTP listener of
the same process keeps accepting."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from relay.app import Relay
from relay.ops.http import IDLE_TIMEOUT_S, MAX_CONNECTIONS
from tests.support.clients import RawClient
from tests.support.relays import MakeRelay
from tests.support.sink import Sink

pytestmark = pytest.mark.both_loops

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def get(port: int, path: str = "/metrics") -> bytes:
    """One HTTP/1.0 GET; the whole answer, or b"" when the server closed without one."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10)
    except OSError:
        return b""
    try:
        writer.write(f"GET {path} HTTP/1.0\r\nHost: relay\r\n\r\n".encode())
        return await asyncio.wait_for(reader.read(), 10)
    except OSError:
        return b""
    finally:
        writer.transport.abort()


async def closed_within(reader: asyncio.StreamReader, wait_s: float) -> bool:
    """True when the server closes the connection (EOF or reset) within ``wait_s`` seconds."""
    try:
        return await asyncio.wait_for(reader.read(), wait_s) == b""
    except TimeoutError:  # an OSError too: caught first
        return False
    except OSError:
        return True


@pytest.fixture
async def observed(make_relay: MakeRelay, sink: Sink) -> Relay:
    """A relay with its ops server on a free port."""
    return await make_relay(upstream=f"127.0.0.1:{sink.port}", metrics_listen="127.0.0.1:0")


async def open_idle(port: int, count: int) -> list[Connection]:
    """``count`` connections to ``port`` that send nothing."""
    return [await asyncio.open_connection("127.0.0.1", port) for _ in range(count)]


def close_all(connections: list[Connection]) -> None:
    for _, writer in connections:
        writer.transport.abort()


async def test_a_connection_over_the_cap_is_closed_while_smtp_accepts(observed: Relay) -> None:
    """With MAX_CONNECTIONS idle connections open, one more is closed unanswered, and an SMTP
    client is still greeted 220."""
    idle = await open_idle(observed.metrics_port, MAX_CONNECTIONS)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", observed.metrics_port)
        writer.write(b"GET /metrics HTTP/1.0\r\n\r\n")
        with contextlib.suppress(OSError):
            await writer.drain()
        assert await closed_within(reader, 5.0)
        writer.transport.abort()
        client = RawClient(*await asyncio.open_connection("127.0.0.1", observed.port))
        assert (await client.reply()).startswith("220")
        await client.close()
    finally:
        close_all(idle)


async def test_idle_connections_are_closed_after_the_timeout(observed: Relay) -> None:
    """Connections that send nothing, or stop mid-request, are closed after IDLE_TIMEOUT_S,
    and /metrics answers again at full capacity."""
    idle = await open_idle(observed.metrics_port, MAX_CONNECTIONS)
    stalled = idle[0][1]
    stalled.write(b"GET /metrics HTTP/1.1\r\nHost: re")
    try:
        closed = await asyncio.gather(*(closed_within(r, IDLE_TIMEOUT_S + 10.0) for r, _ in idle))
        assert all(closed)
    finally:
        close_all(idle)
    answer = await get(observed.metrics_port)
    assert answer.split(b" ", 2)[1] == b"200", answer[:80]


async def test_a_connection_that_keeps_talking_is_not_closed_as_idle(observed: Relay) -> None:
    """A keep-alive client asking /healthz more often than IDLE_TIMEOUT_S keeps its
    connection past the timeout."""
    reader, writer = await asyncio.open_connection("127.0.0.1", observed.metrics_port)
    try:
        loop = asyncio.get_running_loop()
        end = loop.time() + IDLE_TIMEOUT_S * 1.5
        while loop.time() < end:
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: relay\r\n\r\n")
            status = await asyncio.wait_for(reader.readline(), 10)
            assert status.startswith(b"HTTP/1.1 200")
            headers = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            length = next(int(line.split(b":", 1)[1]) for line in headers.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            await asyncio.wait_for(reader.readexactly(length), 10)
            await asyncio.sleep(IDLE_TIMEOUT_S / 4)
    finally:
        writer.transport.abort()
