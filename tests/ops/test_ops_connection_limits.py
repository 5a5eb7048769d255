"""The ops HTTP server bounds its connections (relay.ops.http): at most MAX_CONNECTIONS open at
once, while the SMTP listener of the same process keeps accepting; each closed after its idle
timeout (IDLE_TIMEOUT_S in a relay, a shorter one in the idle tests) with no byte from its
client."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry

from relay.app import Relay
from relay.ops.http import IDLE_TIMEOUT_S, MAX_CONNECTIONS, OpsServer
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


SHORT_IDLE_S = 3.0
"""The idle timeout of the ops server in the idle tests (a relay's is IDLE_TIMEOUT_S)."""


@pytest.fixture
async def short_idle() -> AsyncIterator[int]:
    """An ops server (an empty registry, no readiness yet) on a free loopback port with an
    idle timeout of SHORT_IDLE_S; its port."""
    server = OpsServer(registry=CollectorRegistry(), health=None, host="127.0.0.1", port=0,
                       idle_timeout_s=SHORT_IDLE_S)
    await server.start()
    try:
        yield server.port
    finally:
        await server.stop()


def test_a_relays_ops_server_has_the_documented_idle_timeout() -> None:
    """The relay builds its ops server with the defaults the idle tests shorten."""
    assert OpsServer.__init__.__kwdefaults__ == {
        "sock": None, "max_connections": MAX_CONNECTIONS, "idle_timeout_s": IDLE_TIMEOUT_S}


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


async def test_idle_connections_are_closed_after_the_timeout(short_idle: int) -> None:
    """Connections that send nothing, or stop mid-request, are closed after the idle timeout
    (not before), and /metrics answers again at full capacity."""
    loop = asyncio.get_running_loop()
    idle = await open_idle(short_idle, MAX_CONNECTIONS)
    opened = loop.time()
    stalled = idle[0][1]
    stalled.write(b"GET /metrics HTTP/1.1\r\nHost: re")
    try:
        closed = await asyncio.gather(*(closed_within(r, SHORT_IDLE_S + 20.0) for r, _ in idle))
        assert all(closed)
        assert loop.time() - opened >= SHORT_IDLE_S * 0.9
    finally:
        close_all(idle)
    answer = await get(short_idle)
    assert answer.split(b" ", 2)[1] == b"200", answer[:80]


async def test_a_connection_that_keeps_talking_is_not_closed_as_idle(short_idle: int) -> None:
    """A keep-alive client asking /healthz more often than the idle timeout keeps its
    connection past the timeout."""
    reader, writer = await asyncio.open_connection("127.0.0.1", short_idle)
    try:
        loop = asyncio.get_running_loop()
        end = loop.time() + SHORT_IDLE_S * 1.5
        while loop.time() < end:
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: relay\r\n\r\n")
            status = await asyncio.wait_for(reader.readline(), 10)
            assert status.startswith(b"HTTP/1.1 200")
            headers = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            length = next(int(line.split(b":", 1)[1]) for line in headers.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            await asyncio.wait_for(reader.readexactly(length), 10)
            await asyncio.sleep(SHORT_IDLE_S / 4)
    finally:
        writer.transport.abort()
